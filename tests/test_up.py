"""``splitserve up`` as a user runs it: a node killed with SIGKILL is restarted (the
others keep serving, the status endpoint counts it), and Ctrl-C drains and stops
everything with exit status 0, leaving no /dev/shm segment."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis

from splitserve.deploy.launcher import free_port
from splitserve.node.shm_segments import list_segments, owner_pid

pytestmark = pytest.mark.slow


def completion(url: str) -> str:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_up_restarts_a_killed_node_and_ctrl_c_stops_cleanly():
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1")
    env.pop("SPLITSERVE_CLUSTER_TOKEN", None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port),
                           "--kv-cache-memory", "48MiB", "--kv-backend", "shm"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        status_url = None
        deadline = time.monotonic() + 240
        while status_url is None:
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-30:])
            line = up.stdout.readline()
            lines.append(line.rstrip())
            m = re.search(r"supervisor status: (http://\S+/status)", line)
            status_url = m and m.group(1)
        url = f"http://127.0.0.1:{port}"
        want = completion(url)
        nodes = {m["name"] for m in get_json(status_url)["members"]}
        assert nodes == {"prefill-0", "decode-0", "router", "redis", "responses-redis"}

        # the launcher's children are in their own sessions: find the prefill node's pid
        ps = _children(up.pid, "splitserve.cli prefill")
        assert len(ps) == 1
        os.kill(ps[0], signal.SIGKILL)
        t0 = time.monotonic()
        while True:  # the cluster keeps answering (decode prefills locally) while it restarts
            assert completion(url) == want
            st = {m["name"]: m for m in get_json(status_url)["members"]}
            if st["prefill-0"]["restarts"] == 1 and st["prefill-0"]["alive"]:
                break
            assert time.monotonic() - t0 < 60, st
            time.sleep(0.5)
        assert st["prefill-0"]["last_exit"] == -9 and st["decode-0"]["restarts"] == 0
        with urllib.request.urlopen(status_url.replace("/status", "/metrics"), timeout=10) as r:
            assert 'splitserve_launcher_restarts_total{member="prefill-0"} 1' in r.read().decode()
        shm = [n for n in list_segments() if owner_pid(n) and _child_of(owner_pid(n), up.pid)]
        assert len(shm) == 1  # the decode node's pool

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in shm)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@contextlib.contextmanager
def small_up(port: int, flags: list[str], env: dict[str, str] | None = None):
    """``splitserve up`` with one decode node and no prefill node, started and waited
    for until its banner is out: yields (the process, the lines it printed); killed on
    the way out if the test did not stop it."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1")
    for name in ("SPLITSERVE_API_KEY", "SPLITSERVE_REDIS_URL", "SPLITSERVE_CLUSTER_TOKEN"):
        full_env.pop(name, None)
    full_env.update(env or {})
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port), "--prefill-nodes", "0",
                           "--decode-nodes", "1", "--kv-cache-memory", "32MiB", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("supervisor status" in ln for ln in lines):
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-30:])
            lines.append(up.stdout.readline().rstrip())
        yield up, lines
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _children(parent: int, needle: str) -> list[int]:
    """Pids of ``parent``'s children whose command line contains ``needle`` (read from /proc,
    as ``pgrep -f -P`` would, without needing procps)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _child_of(int(entry), parent):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                found.append(int(entry))
    return found


def _child_of(pid: int, parent: int) -> bool:
    return _parent(pid) == parent


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, theirs, ...)."""
    parents = {int(e): _parent(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        found += sorted(frontier)
    return found


def _proc_file(pid: int, name: str) -> list[str]:
    """/proc/<pid>/<name> (cmdline or environ) as its NUL-separated strings ([] once it exited)."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _env_of(pid: int) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in _proc_file(pid, "environ") if "=" in kv)


def _by_kind(pids: list[int]) -> dict[str, list[int]]:
    """kind (redis-server, cli router, cli prefill, cli decode) -> the pids of that kind."""
    found: dict[str, list[int]] = {}
    for pid in pids:
        line = " ".join(_proc_file(pid, "cmdline"))
        kind = next((k for k in ("redis-server", "cli router", "cli prefill", "cli decode") if k in line), None)
        if kind:
            found.setdefault(kind, []).append(pid)
    return found


def test_up_puts_no_secret_on_any_command_line_and_each_member_gets_only_its_own(tmp_path):
    """Every process `up` starts gets the secrets it needs and no other: the nodes and
    the router the Redis URL and the cluster token in their environment, the router the
    API keys in an owner-only file of `up`'s private folder (a key with a comma in it
    stays one key: neither half authenticates), redis-server none at all, and nobody
    the caller's own $SPLITSERVE_API_KEY. No secret is on any command line (what `ps`
    shows every local user); the key file is gone once `up` stopped. The nodes carry
    `up`'s --load-format and --enforce-eager, and the cluster serves a keyed client."""
    keys = ["tenant-a-key," + "a" * 16, "tenant-b-key-" + "b" * 16]
    caller_key = "caller-env-key-0123456789"
    key_file = tmp_path / "keys"
    key_file.write_text(f"# two tenants\n{keys[0]} cache_salt=tenant-a\n{keys[1]} cache_salt=tenant-b\n")
    key_file.chmod(0o600)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1", SPLITSERVE_API_KEY=caller_key)
    for name in ("SPLITSERVE_REDIS_URL", "SPLITSERVE_CLUSTER_TOKEN"):
        env.pop(name, None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port),
                           "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-cache-memory", "32MiB",
                           "--kv-backend", "tcp", "--api-key-file", str(key_file),
                           "--load-format", "auto", "--enforce-eager"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("supervisor status" in ln for ln in lines):
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-30:])
            lines.append(up.stdout.readline().rstrip())
        pids = _descendants(up.pid)
        procs = {pid: (_proc_file(pid, "cmdline"), _env_of(pid)) for pid in pids}
        by_kind = _by_kind(pids)
        assert {k: len(v) for k, v in by_kind.items()} == {  # Redis: the main one and the responses'
            "redis-server": 2, "cli router": 1, "cli prefill": 1, "cli decode": 1}, procs
        # the secrets, as the members really got them (their environments)
        router_argv, router_env = procs[by_kind["cli router"][0]]
        redis_url = router_env["SPLITSERVE_REDIS_URL"]
        password = urllib.parse.urlsplit(redis_url).password
        token = router_env["SPLITSERVE_CLUSTER_TOKEN"]
        assert password and len(password) >= 16 and len(token) >= 16
        router_keys = Path(router_argv[router_argv.index("--api-key-file") + 1])
        assert router_keys.stat().st_mode & 0o777 == 0o600 and router_keys.parent.stat().st_mode & 0o777 == 0o700
        assert router_keys.read_text().split("\n")[:2] == [f"{keys[0]} cache_salt=tenant-a",
                                                            f"{keys[1]} cache_salt=tenant-b"]
        for kind in ("cli prefill", "cli decode"):
            node_env = procs[by_kind[kind][0]][1]
            assert node_env["SPLITSERVE_REDIS_URL"] == redis_url and node_env["SPLITSERVE_CLUSTER_TOKEN"] == token
            assert "SPLITSERVE_RESPONSES_REDIS_URL" not in node_env  # the routers' alone
        # stored responses: a Redis of their own, evicting only entries with a TTL, under the
        # router's budget; the node registry's refuses writes rather than evict
        responses_url = router_env["SPLITSERVE_RESPONSES_REDIS_URL"]
        assert responses_url != redis_url and urllib.parse.urlsplit(responses_url).password
        assert router_argv[router_argv.index("--responses-max-bytes") + 1] == str(192 << 20)
        with redis.Redis.from_url(responses_url) as r:
            memory = r.config_get("maxmemory*")
            assert memory["maxmemory"] == str(256 << 20) and memory["maxmemory-policy"] == "volatile-lru"
        with redis.Redis.from_url(redis_url) as r:
            assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
            assert int(r.config_get("maxmemory")["maxmemory"]) == 1 << 30
        for pid in by_kind["redis-server"]:
            assert not {n for n in procs[pid][1] if n.startswith("SPLITSERVE_")}, sorted(procs[pid][1])
        for pid, (argv, penv) in procs.items():
            assert "SPLITSERVE_API_KEY" not in penv, argv[:3]  # clients' keys: the router's file only
            line = " ".join(argv)
            for secret in (password, token, *keys, caller_key):
                assert secret not in line, f"a secret on the command line of {pid}: {argv[:3]}..."
            assert "--redis-url" not in argv and "--cluster-token" not in argv and "--api-key" not in argv
        for kind in ("cli prefill", "cli decode"):
            argv = procs[by_kind[kind][0]][0]
            assert argv[argv.index("--load-format") + 1] == "auto" and "--enforce-eager" in argv
        assert not any(k in "\n".join(lines) for k in keys)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 4,
                           "temperature": 0}).encode()
        halves = keys[0].split(",")
        for key, want in ((None, 401), (keys[1], 200), (keys[0], 200), (halves[0], 401), (halves[1], 401),
                          (caller_key, 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, answer = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == want, key
            if want == 200:
                assert answer["usage"]["completion_tokens"] == 4
        stored = json.dumps({"model": "SmolLM2-135M-Instruct", "input": "Hi", "max_output_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/responses", data=stored, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {keys[1]}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            response_id = json.loads(r.read())["id"]
        with redis.Redis.from_url(responses_url) as r:
            assert r.exists(f"splitserve:response:{response_id}")
        with redis.Redis.from_url(redis_url) as r:
            assert not list(r.scan_iter("splitserve:response*"))
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not router_keys.exists() and not router_keys.parent.exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_up_api_key_reaches_the_router(how):
    """``up --api-key KEY`` (or $SPLITSERVE_API_KEY): /v1/* answers 401 without the key
    (or with another one) and 200 with it; /health stays open for probes."""
    key, other = "k" * 24 + how, "o" * 24
    port = free_port()
    flag = ["--api-key", key] if how == "flag" else []
    env = {"SPLITSERVE_API_KEY": f"{key}\n{'x' * 24}\n"} if how == "env" else {}  # one spec per line
    with small_up(port, flag, env) as (up, lines):
        assert key not in "\n".join(lines)  # the banner shows where the key goes, not the key
        url = f"http://127.0.0.1:{port}"
        assert get_json(f"{url}/health")["decode_nodes"] == 1
        for headers, want in (({}, 401), ({"Authorization": f"Bearer {other}"}, 401),
                              ({"Authorization": f"Bearer {key}"}, 200)):
            body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
                if want == 401:
                    assert json.loads(e.read())["error"]["type"]
            assert status == want, (headers, status)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


@pytest.mark.parametrize("shared", [False, True])
def test_up_shared_prefix_cache_reaches_every_router(shared):
    """``up --shared-prefix-cache`` is each router's flag (keys without a salt share one
    cache); without it no router gets it (each key its own cache, the default)."""
    port = free_port()
    flags = ["--router-replicas", "2"] + (["--shared-prefix-cache"] if shared else [])
    with small_up(port, flags) as (up, _):
        routers = _children(up.pid, "cli router")
        assert len(routers) == 2
        for pid in routers:
            assert ("--shared-prefix-cache" in _proc_file(pid, "cmdline")) == shared
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


def test_up_router_replicas_prints_every_url_and_each_one_routes():
    """``up --router-replicas 2``: both routers are listed in the banner, see the node
    and serve completions; Ctrl-C stops both."""
    port = free_port()
    with small_up(port, ["--router-replicas", "2"]) as (up, lines):
        replicas = [m.group(1) for ln in lines if (m := re.search(r"router replica: (http://\S+)/v1", ln))]
        assert len(replicas) == 1, lines
        for url in (f"http://127.0.0.1:{port}", replicas[0]):
            assert get_json(f"{url}/health")["decode_nodes"] == 1
            assert isinstance(completion(url), str)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _read_lines(proc: subprocess.Popen, into: list[str]) -> threading.Thread:
    """A thread appending ``proc``'s output lines to ``into`` until it closes."""
    def pump():
        for line in proc.stdout:
            into.append(line.rstrip())
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def test_ctrl_c_stops_the_routers_then_the_nodes_then_redis_and_nothing_warns():
    """A terminal's Ctrl-C reaches `up`'s whole process group: the routers stop first (no
    new requests), then the nodes drain (they deregister and drop their index entries
    while Redis still answers), then Redis; no member logs a failed deregistration, a
    failed index cleanup or an unreachable Redis."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("SPLITSERVE_API_KEY", "SPLITSERVE_REDIS_URL", "SPLITSERVE_CLUSTER_TOKEN", "SPLITSERVE_QUIET"):
        env.pop(name, None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port),
                           "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-cache-memory", "32MiB",
                           "--kv-backend", "tcp", "--router-replicas", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)  # its own process group, as in a terminal
    lines: list[str] = []
    reader = _read_lines(up, lines)
    try:
        deadline = time.monotonic() + 240
        while not any("supervisor status" in ln for ln in lines):
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-30:])
            time.sleep(0.1)
        assert isinstance(completion(f"http://127.0.0.1:{port}"), str)
        kinds = _by_kind(_descendants(up.pid))
        assert {k: len(v) for k, v in kinds.items()} == {
            "redis-server": 2, "cli router": 2, "cli prefill": 1, "cli decode": 1}, kinds
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        exited: dict[int, float] = {}
        while up.poll() is None and time.monotonic() < deadline + 120:
            now = time.monotonic()
            exited.update({pid: now for pids in kinds.values() for pid in pids
                           if pid not in exited and _exited(pid)})
            time.sleep(0.005)
        assert up.wait(5) == 0
        reader.join(5)
        when = {kind: [exited.get(pid, time.monotonic()) for pid in pids] for kind, pids in kinds.items()}
        nodes = when["cli prefill"] + when["cli decode"]
        assert max(when["cli router"]) <= min(nodes) and max(nodes) <= min(when["redis-server"]), when
        noise = [ln for ln in lines if re.search(r"deregister.*failed|dropping the entries.*failed|"
                                                 r"Redis unreachable|events unavailable", ln)]
        assert not noise, "\n".join(noise)
        assert any("node decode-0 drained" in ln for ln in lines)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def test_up_killed_outright_leaves_no_member_running():
    """`up` killed with SIGKILL (an OOM kill, a test runner's timeout) cannot stop its
    members, each in a session of its own: the nodes and the router notice their launcher
    is gone and stop, and Redis gets SIGTERM from the kernel (deploy/orphan.py). Before,
    every member ran on, orphaned, serving and heartbeating."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("SPLITSERVE_API_KEY", "SPLITSERVE_REDIS_URL", "SPLITSERVE_CLUSTER_TOKEN", "SPLITSERVE_QUIET"):
        env.pop(name, None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port),
                           "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-cache-memory", "32MiB",
                           "--kv-backend", "tcp"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)
    lines: list[str] = []
    _read_lines(up, lines)
    members: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not any("supervisor status" in ln for ln in lines):
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-30:])
            time.sleep(0.1)
        kinds = _by_kind(_descendants(up.pid))
        assert {k: len(v) for k, v in kinds.items()} == {
            "redis-server": 2, "cli router": 1, "cli prefill": 1, "cli decode": 1}, kinds
        members = [pid for pids in kinds.values() for pid in pids]
        up.kill()
        up.wait()
        deadline = time.monotonic() + 60
        while not all(_exited(pid) for pid in members) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {kind: [pid for pid in pids if not _exited(pid)] for kind, pids in kinds.items()}
        assert not any(left.values()), f"still running after their launcher died: {left}"
    finally:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_never_says_it_serves_before_its_own_nodes_registered():
    """Redis full (maxmemory reached, noeviction) and still holding the records of a
    previous run's nodes, long dead: the router sees two nodes, but `up`'s own never
    registered. `up` must not print its URL: after --startup-timeout it names the nodes
    that did not register, stops every member and exits 1."""
    import asyncio

    from splitserve.common.node_registry import NodeInfo, NodeRegistry, new_epoch
    from splitserve.deploy.launcher import start_redis
    redis_proc, url = start_redis(password="stale-pw-0123456789")

    async def leave_stale_records():
        registry = NodeRegistry(url, ttl_s=600)
        for role in ("prefill", "decode"):
            await registry.heartbeat(NodeInfo(node_id=f"{role}-0", role=role, http_addr="http://127.0.0.1:9",
                                              model="SmolLM2-135M-Instruct", epoch=new_epoch()))
        await registry.close()

    asyncio.run(leave_stale_records())
    import redis
    with redis.Redis.from_url(url) as r:
        r.config_set("maxmemory", 1)  # every write from now on: OOM
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            r.set("probe", "x")
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1", SPLITSERVE_REDIS_URL=url)
    for name in ("SPLITSERVE_API_KEY", "SPLITSERVE_CLUSTER_TOKEN"):
        env.pop(name, None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port),
                           "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-cache-memory", "32MiB",
                           "--kv-backend", "tcp", "--startup-timeout", "15"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = _read_lines(up, lines)
    members: dict[str, list[int]] = {}  # kind -> pids, as seen while it ran
    try:
        t0 = time.monotonic()
        while up.poll() is None and time.monotonic() - t0 < 150:
            for kind, pids in _by_kind(_descendants(up.pid)).items():
                members[kind] = sorted(set(members.get(kind, [])) | set(pids))
            time.sleep(0.2)
        assert up.wait(1) == 1, "\n".join(lines[-30:])
        reader.join(5)
        out = "\n".join(lines)
        assert "is serving" not in out and "supervisor status" not in out, out
        error = next(ln for ln in lines if ln.startswith("error:"))
        assert "prefill-0" in error and "decode-0" in error and "registered" in error, error
        assert set(members) == {"redis-server", "cli router", "cli prefill", "cli decode"}, members  # started ...
        assert all(_exited(pid) for pids in members.values() for pid in pids)  # ... and left none running
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        redis_proc.kill()
        redis_proc.wait()

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
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

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
        assert nodes == {"prefill-0", "decode-0", "router", "redis"}

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


def test_up_puts_no_secret_on_any_command_line_and_still_serves(tmp_path):
    """Every process `up` starts (redis-server, both nodes, the router) gets the Redis
    password, the cluster token and the API keys in its environment; none of them is on
    any of their command lines (what `ps` shows every local user). The nodes carry `up`'s
    --load-format and --enforce-eager, and the cluster serves a keyed client."""
    keys = ["tenant-a-key-" + "a" * 16, "tenant-b-key-" + "b" * 16]
    key_file = tmp_path / "keys"
    key_file.write_text(f"# two tenants\n{keys[0]} cache_salt=tenant-a\n{keys[1]} cache_salt=tenant-b\n")
    key_file.chmod(0o600)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1")
    for name in ("SPLITSERVE_API_KEY", "SPLITSERVE_REDIS_URL", "SPLITSERVE_CLUSTER_TOKEN"):
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
        procs = {pid: (_proc_file(pid, "cmdline"), dict(
            kv.split("=", 1) for kv in _proc_file(pid, "environ") if "=" in kv)) for pid in _descendants(up.pid)}
        by_kind = {}
        for pid, (argv, _) in procs.items():
            line = " ".join(argv)
            kind = next((k for k in ("redis-server", "cli router", "cli prefill", "cli decode") if k in line), None)
            if kind:
                by_kind.setdefault(kind, []).append(pid)
        assert {k: len(v) for k, v in by_kind.items()} == {
            "redis-server": 1, "cli router": 1, "cli prefill": 1, "cli decode": 1}, procs
        # the secrets, as the members really got them (their environments)
        router_env = procs[by_kind["cli router"][0]][1]
        redis_url = router_env["SPLITSERVE_REDIS_URL"]
        password = urllib.parse.urlsplit(redis_url).password
        token = router_env["SPLITSERVE_CLUSTER_TOKEN"]
        assert password and len(password) >= 16 and len(token) >= 16
        assert all(k in router_env["SPLITSERVE_API_KEY"] for k in keys)
        for kind in ("cli prefill", "cli decode"):
            node_env = procs[by_kind[kind][0]][1]
            assert node_env["SPLITSERVE_REDIS_URL"] == redis_url and node_env["SPLITSERVE_CLUSTER_TOKEN"] == token
            assert "SPLITSERVE_API_KEY" not in node_env  # clients' keys are the router's alone
        for pid, (argv, _) in procs.items():
            line = " ".join(argv)
            for secret in (password, token, *keys):
                assert secret not in line, f"a secret on the command line of {pid}: {argv[:3]}..."
            assert "--redis-url" not in argv and "--cluster-token" not in argv and "--api-key" not in argv
        for kind in ("cli prefill", "cli decode"):
            argv = procs[by_kind[kind][0]][0]
            assert argv[argv.index("--load-format") + 1] == "auto" and "--enforce-eager" in argv
        assert not any(k in "\n".join(lines) for k in keys)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 4,
                           "temperature": 0}).encode()
        for headers, want in (({}, 401), ({"Authorization": f"Bearer {keys[1]}"}, 200)):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, answer = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == want
        assert answer["usage"]["completion_tokens"] == 4
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
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
    env = {"SPLITSERVE_API_KEY": f"{key},{'x' * 24}"} if how == "env" else {}
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

"""Local cluster launcher behind ``splitserve up`` (and the end-to-end tests):
a redis-server on a free port (unless one is given), N prefill and M decode
nodes, and the router, each a real process. ``splitserve up`` supervises them
(deploy/supervisor.py: a member that dies is restarted with backoff, the others keep
serving) and stops everything, draining, only on Ctrl-C/SIGTERM.

Nothing is open: ``up`` starts Redis with a random password and generates the cluster
token (common/auth.py); everything binds 127.0.0.1. No secret is ever on a member's
command line, where every local user can read it (``ps``, /proc/<pid>/cmdline), and each
member gets only the secrets it needs (deploy/member_secrets.py):

    secret              how it reaches its members
    Redis passwords     redis-server: its config on stdin (``redis-server -``, ``requirepass``);
                        router and nodes: the URL in $SPLITSERVE_REDIS_URL; the router alone
                        the responses Redis's in $SPLITSERVE_RESPONSES_REDIS_URL
    cluster token       router and nodes: $SPLITSERVE_CLUSTER_TOKEN
    client API keys     router: --api-key-file, an owner-only file of ``up``'s (key specs with
                        their cache salts, read from ``up --api-key-file``, ``--api-key`` or
                        the caller's $SPLITSERVE_API_KEY), removed when ``up`` stops

A process's environment is readable by its user and root only, like a 0600 file.

``up`` starts two Redis instances (deploy/local_redis.py): the main one (node registry, prefix
index; ``noeviction``) and one for the routers' stored /v1/responses (``--responses-maxmemory``,
``volatile-lru``), so no flood of stored responses can crowd out the node registry. It prints
its URL only once the cluster serves (deploy/readiness.py: every node registered, every
router sees them), or fails after ``--startup-timeout`` naming who is missing, having
stopped everything. It stops in order: the routers (no new requests), then the nodes
(they drain, deregister and withdraw their index entries), then Redis.

Defaults come from ``deploy/local.toml``; flags override them.

Devices (``splitserve up --device cuda``, ``--prefill-devices``, ``--decode-devices``,
``--dtype``, ``--gpu-memory-utilization``): ``deploy/devices.py`` places each node and picks
the KV backend (ipc when every node runs on CUDA); without them nodes run on the CPU as before.

CPU pinning (``cpus``, ``splitserve up --cpus prefill=0 decode=1 router=0``): each
listed role's processes start under ``taskset -c`` on those CPUs, and a pinned node
gets one torch thread per CPU, so prefill and decode never share a core.

Tensor parallelism (``tp``, ``splitserve up --prefill-tp 2 --decode-tp 4``): a node of N
ranks is one member whose process starts the other N - 1 itself (node/ranks.py), all in
the member's own process group. A rank's death is the node's: it exits non-zero, the
supervisor kills whatever is left of that process group (no stray rank outlives its
node) and restarts the node whole. With ``expert_parallel`` (``up --enable-expert-parallel``)
a MoE model's experts split over each node's ranks: each pool's EP size is its TP.

Data parallelism (``dp``, ``splitserve up --prefill-dp 2 --decode-dp 2``, a MoE model): a
data-parallel node of N ranks is N members, each a node of the pool with its own requests
and KV pool (``<role>-<i>``, i = node * N + rank), sharing the MoE layers; rank 0 hosts their
rendezvous on a port chosen once. A rank's death fails its peers' collectives: they exit too
and the supervisor restarts each, and they meet again at the same port. A node is started and
retired whole (``start_members``, ``retire_members``: the planner's unit): its ranks drain
together and stop at one agreed turn.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import NamedTuple

from ..common.auth import CLUSTER_TOKEN_ENV, auth_headers, new_cluster_token, redis_url_from
from ..common.config import parse_size
from ..common.kv_backends import DEFAULT_BACKEND
from ..router.api_keys import ApiKey, api_keys_from_args
from .devices import DevicePlan, plan_devices
from .local_redis import (MAIN_EVICTION, RESPONSES_EVICTION, RedisPolicy, free_port, responses_budget,
                          start_redis)
from .member import Proc
from .member_secrets import KeyFile, member_env
from .readiness import wait_serving
from .supervisor import Supervisor

DEFAULT_CONFIG = Path(__file__).with_name("local.toml")
NODE_DRAIN_GRACE_S = 30.0  # the nodes' and routers' --drain-grace default: `up` waits that long (+5 s) on Ctrl-C
REDIS = "redis"  # the members that are Redis instances (member_names)
RESPONSES_REDIS = "responses-redis"


class Cluster:
    """Real processes on this machine. ``start()`` returns once every node and the
    router answer; ``stop()`` is idempotent and kills what does not exit in time."""

    def __init__(self, prefill_nodes=1, decode_nodes=1, router_port=0, kv_backend=DEFAULT_BACKEND,
                 kv_cache_memory="256MiB", threads_per_node=1, redis_url=None, model=None,
                 host="127.0.0.1", colocated=False, extra_node_args=(), policy=None,
                 router_args=(), cpus=None, devices=None, cluster_token=None, redis_password=None,
                 served_model_names=(), api_keys=(), router_replicas=1, load_format=None,
                 enforce_eager=False, tp=None, kv_offload=None, redis_maxmemory=None,
                 responses_maxmemory=None, expert_parallel=False, dp=None, local_prefill_budget=None,
                 kv_pull_memory=None):
        # role ("prefill", "decode", "colocated", "router") -> CPU ids; unlisted roles float
        self.cpus: dict[str, tuple[int, ...]] = {r: tuple(c) for r, c in (cpus or {}).items()}
        self.devices: DevicePlan | None = devices  # None: every node on the CPU, its defaults
        self.cfg = dict(prefill_nodes=prefill_nodes, decode_nodes=decode_nodes, kv_backend=kv_backend,
                        kv_cache_memory=kv_cache_memory, threads=threads_per_node, model=model, host=host,
                        colocated=colocated, extra=list(extra_node_args), policy=policy,
                        router_args=list(router_args), served=list(served_model_names),
                        load_format=load_format, enforce_eager=enforce_eager,
                        tp={r: n for r, n in (tp or {}).items() if n != 1},  # role -> ranks per node
                        expert_parallel=expert_parallel,  # each node's EP size: its tp
                        dp={r: n for r, n in (dp or {}).items() if n != 1},  # role -> data-parallel ranks per node
                        kv_offload=kv_offload,
                        local_prefill_budget=local_prefill_budget,  # decode nodes' flag; None: theirs
                        kv_pull_memory=kv_pull_memory)  # every node's --kv-pull-memory (a size); None: theirs
        self._dp_ports: dict[tuple[str, int], int] = {}  # (role, data-parallel node) -> its rendezvous port
        self.router_port = router_port or free_port()
        if router_replicas < 1:
            raise ValueError(f"router_replicas: must be >= 1, got {router_replicas}")
        # One port per router replica (the first is router_port); all share the Redis and
        # keep their own prefix mirror, so any of them routes cache-aware alone.
        self.router_ports = [self.router_port] + [free_port() for _ in range(router_replicas - 1)]
        self.cluster_token = cluster_token  # None: internal endpoints open (tests that poke nodes)
        self.redis_password = redis_password  # for the Redis this cluster starts
        # the router's client keys (str or router.api_keys.ApiKey), handed over in a file; (): none
        self.api_keys = tuple(k if isinstance(k, ApiKey) else ApiKey(k) for k in api_keys)
        self.key_file = KeyFile(self.api_keys) if self.api_keys else None
        self.redis_url = redis_url
        self.redis: subprocess.Popen | None = None
        self.redis_policy = RedisPolicy(redis_maxmemory, MAIN_EVICTION)  # bytes or None: unbounded
        # With responses_maxmemory (bytes), a second Redis of that size holds the routers'
        # stored responses (deploy/local_redis.py); None: they live in the main one.
        self.responses_maxmemory: int | None = responses_maxmemory
        self.responses_redis: subprocess.Popen | None = None
        self.responses_redis_url: str | None = None
        self.procs: list[Proc] = []
        self._stopping = threading.Event()  # set by stop(): supervision ends
        self._stopped = threading.Event()  # set when stop() has stopped every member
        self._supervisor: Supervisor | None = None
        self.status_port = 0  # the supervisor's status endpoint, once supervised
        self.retired: set[str] = set()  # members stopped on purpose (a planner's scale-down): never restarted

    @property
    def url(self) -> str:
        return f"http://{self.cfg['host']}:{self.router_port}"

    @property
    def urls(self) -> list[str]:
        """Every router replica's base URL (``url`` first)."""
        return [f"http://{self.cfg['host']}:{port}" for port in self.router_ports]

    def start_routers(self) -> list[Proc]:
        """The router replicas: ``router``, then ``router-1``, ``router-2``, ..."""
        return [self._spawn("router" if i == 0 else f"router-{i}", self._router_args(port), "router")
                for i, port in enumerate(self.router_ports)]

    def _spawn(self, name: str, args: list[str], role: str) -> Proc:
        """Start ``splitserve <args>`` as member ``name``; its secrets go in its environment
        (the module's table), never in ``args``."""
        env = member_env(role, self.redis_url, self.cluster_token, self.responses_redis_url)
        cmd = [sys.executable, "-m", "splitserve.cli", *args]
        if role in self.cpus:
            cmd = ["taskset", "-c", ",".join(map(str, self.cpus[role])), *cmd]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        proc = Proc(name, p, args=list(args), role=role)
        threading.Thread(target=proc.pump, daemon=True).start()
        self.procs.append(proc)
        return proc

    def start_redis(self, port: int | None = None) -> None:
        """The main Redis (again on ``port`` when given: a restart)."""
        self.redis, self.redis_url = start_redis(port, self.redis_password, self.redis_policy, own_session=True)

    def start_responses_redis(self, port: int | None = None) -> None:
        """The Redis of the routers' stored responses, with the main one's password."""
        assert self.responses_maxmemory is not None, "a responses Redis needs its maxmemory"
        self.responses_redis, self.responses_redis_url = start_redis(
            port, self.redis_password, RedisPolicy(self.responses_maxmemory, RESPONSES_EVICTION), own_session=True)

    def auth_headers(self) -> dict[str, str]:
        """Headers for a request to a node's internal endpoints (/debug/state, ...)."""
        return auth_headers(self.cluster_token)

    # ---- supervision (deploy/supervisor.py) -----------------------------------------------
    def member_names(self) -> list[str]:
        names = [n for n in dict.fromkeys(p.name for p in self.procs) if n not in self.retired]
        return (names + ([REDIS] if self.redis is not None else [])
                + ([RESPONSES_REDIS] if self.responses_redis is not None else []))

    def retire(self, name: str) -> Proc:
        """Take member ``name`` out of supervision for good and SIGTERM it: a node drains
        (refuses new work, deregisters and withdraws its index entries, finishes what it
        holds within its --drain-grace) and exits; nothing restarts it."""
        self.retired.add(name)
        p = self.node(name)
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
        return p

    def node_id_of(self, name: str) -> str:
        """The node registry's node id of node member ``name`` (``start_node`` names both alike)."""
        return name

    def exit_code(self, name: str) -> int | None:
        """None while member ``name`` runs, else its exit status."""
        if name in (REDIS, RESPONSES_REDIS):
            proc = self.redis if name == REDIS else self.responses_redis
            assert proc is not None, "a member only while this cluster runs its own Redis"
            return proc.poll()
        return self.node(name).popen.poll()

    def respawn(self, name: str) -> None:
        """Start member ``name`` again as it was started (same node id, port, password)."""
        if self._stopping.is_set():
            return  # the cluster is stopping: its members exit on purpose
        if name == REDIS:
            self.start_redis(_port_of(self.redis_url))
            return
        if name == RESPONSES_REDIS:
            self.start_responses_redis(_port_of(self.responses_redis_url))
            return
        old = self.node(name)
        self._spawn(name, old.args, old.role)

    def supervise(self, poll_s: float = 0.25) -> Supervisor:
        """Restart members that die (a thread polling until ``stop()``); serves the
        supervisor's status endpoint."""
        sup = Supervisor(self.member_names, self.exit_code, self.respawn, self.on_death)
        sup.poll()  # every member is listed from the status endpoint's first answer on
        self.status_port = sup.serve_status()
        self._supervisor = sup

        def run():
            while not self._stopping.wait(poll_s):
                sup.poll()
            # A Redis this thread restarted dies with it (deploy/orphan.py): stay until stopped.
            self._stopped.wait()
        threading.Thread(target=run, name="supervisor", daemon=True).start()
        return sup

    def on_death(self, name: str) -> None:
        """A member died: kill what is left of its process group (a tensor-parallel node's
        worker ranks exit on their own when rank 0 goes; this makes sure), and forget it."""
        if name not in (REDIS, RESPONSES_REDIS):
            kill_group(self.node(name).popen.pid)
        self.forget_node(name)

    def forget_node(self, name: str) -> None:
        """Delete a dead node's node registry record now, so routers stop choosing it within
        one discovery poll (its index entries are keyed by the old epoch: never read again)."""
        if name in (REDIS, RESPONSES_REDIS) or name.startswith("router") or self.redis_url is None:
            return
        import redis
        from ..common.node_registry import node_key
        with redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1) as r:
            r.delete(node_key(name))

    def start_node(self, role: str, index: int, extra=()) -> Proc:
        return self._spawn(f"{role}-{index}", self.node_args(role, index, extra), role)

    def members(self, role: str) -> int:
        """Node processes of ``role``: its nodes times their data-parallel ranks (each rank is
        a node of the pool, ``<role>-<i>``: rank r of data-parallel node n is i = n * dp + r)."""
        c = self.cfg
        nodes = c["decode_nodes"] if role in ("decode", "colocated") else c["prefill_nodes"]
        return nodes * self.dp_size(role)

    def dp_size(self, role: str) -> int:
        """Members of one node of ``role``: its data-parallel ranks (1: the node is one member)."""
        return self.cfg["dp"].get("decode" if role == "colocated" else role, 1)

    def node_members(self, role: str, node: int) -> list[str]:
        """The member names of node ``node`` of ``role``: its data-parallel ranks in rank order."""
        size = self.dp_size(role)
        return [f"{role}-{node * size + rank}" for rank in range(size)]

    def start_members(self, role: str, node: int) -> list[Proc]:
        """Start node ``node`` of ``role`` whole: every data-parallel rank at once (they meet at
        the node's own rendezvous port), or its one member."""
        size = self.dp_size(role)
        return [self.start_node(role, node * size + rank) for rank in range(size)]

    def retire_members(self, role: str, node: int) -> list[str]:
        """Retire node ``node`` of ``role`` whole (``retire`` each of its members at once): the
        ranks of a data-parallel node drain together and stop at one agreed turn; the names."""
        names = self.node_members(role, node)
        for name in names:
            self.retire(name)
        return names

    def _dp_args(self, role: str, index: int) -> list[str]:
        """A data-parallel rank's flags: its node's rendezvous port, chosen once (restarts reuse it)."""
        size = self.dp_size(role)
        if size == 1:
            return []
        node, rank = divmod(index, size)
        port = self._dp_ports.setdefault((role, node), free_port())
        return ["--data-parallel-size", str(size), "--data-parallel-rank", str(rank),
                "--data-parallel-address", f"{self.cfg['host']}:{port}"]

    def node_args(self, role: str, index: int, extra=()) -> list[str]:
        """The command line of node ``index`` of ``role`` (after ``splitserve``)."""
        c = self.cfg
        threads = len(self.cpus[role]) if role in self.cpus else c["threads"]
        decode_role = "colocated" if c["colocated"] else "decode"
        counts = {"prefill": self.members("prefill"), decode_role: self.members(decode_role)}
        device = self.devices.node_args(role, index, counts) if self.devices else []
        memory = [] if "--gpu-memory-utilization" in device else ["--kv-cache-memory", c["kv_cache_memory"]]
        engine = ((["--load-format", c["load_format"]] if c["load_format"] else [])
                  + (["--enforce-eager"] if c["enforce_eager"] else []))
        # no --redis-url: the URL holds the Redis password, so it travels in $SPLITSERVE_REDIS_URL
        tp = c["tp"].get("decode" if role == "colocated" else role, 1)
        engine += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        engine += ["--enable-expert-parallel"] if c["expert_parallel"] else []
        engine += self._dp_args(role, index)
        engine += c["kv_offload"].node_args(f"{role}-{index}") if c["kv_offload"] else []
        if role == "decode" and c["local_prefill_budget"] is not None:
            engine += ["--local-prefill-budget", str(c["local_prefill_budget"])]
        if c["kv_pull_memory"] is not None:
            engine += ["--kv-pull-memory", str(c["kv_pull_memory"])]
        args = ["decode" if role == "colocated" else role, "--host", c["host"],
                "--kv-backend", c["kv_backend"], *memory, *device, *engine,
                "--threads", str(threads), "--node-id", f"{role}-{index}", *c["extra"], *extra]
        if role == "colocated":
            args.append("--colocated")
        return args + self._model_args()

    def _model_args(self) -> list[str]:
        """--model / --served-model-name, the same for the router and every node."""
        c = self.cfg
        return ((["--model", c["model"]] if c["model"] else [])
                + (["--served-model-name", *c["served"]] if c["served"] else []))

    def start(self, timeout: float = 180.0) -> "Cluster":
        """Start Redis (unless given), the nodes and the routers; return once it serves
        (deploy/readiness.py) or stop everything and raise ``NotServing`` after ``timeout``."""
        self._start_redises()
        c = self.cfg
        decode_role = "colocated" if c["colocated"] else "decode"
        counts = {"prefill": self.members("prefill"), decode_role: self.members(decode_role)}
        nodes = [self.start_node(role, i) for role, n in counts.items() for i in range(n)]
        routers = self.start_routers()
        self.wait_serving([*nodes, *routers], {self.node_id_of(p.name): p for p in nodes}, counts, timeout)
        return self

    def _start_redises(self) -> None:
        if self.redis_url is None:
            self.start_redis()
        if self.responses_maxmemory is not None and self.responses_redis is None:
            self.start_responses_redis()

    def wait_serving(self, members: list[Proc], nodes: dict[str, Proc], roles: dict[str, int],
                     timeout: float) -> None:
        """readiness.wait_serving; on failure every member is stopped before it raises."""
        try:
            wait_serving(members, nodes, self.urls, roles, self.redis_url, timeout)
        except BaseException:
            self.stop()
            raise

    def _router_args(self, port: int | None = None) -> list[str]:
        c = self.cfg
        policy = ["--policy", c["policy"]] if c["policy"] else []  # None: the router's default
        port = port or self.router_port
        keys = ["--api-key-file", self.key_file.path()] if self.key_file is not None else []
        store = (["--responses-max-bytes", str(responses_budget(self.responses_maxmemory))]
                 if self.responses_maxmemory is not None else [])  # the store refuses before Redis evicts
        return ["router", "--host", c["host"], "--port", str(port),  # Redis: $SPLITSERVE_REDIS_URL
                *policy, *keys, *store, *self._model_args(), *c["router_args"]]

    def wait_ready(self, p: Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not p.ready.wait(0.2):
            if p.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{p.name} failed to start:\n" + "\n".join(p.log[-20:]))

    def wait_for_nodes(self, n: int, timeout: float) -> None:
        """Until every router's /health reports ``n`` nodes."""
        import json
        deadline = time.monotonic() + timeout
        waiting = list(self.urls)
        while waiting and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{waiting[0]}/health", timeout=2) as r:
                    h = json.loads(r.read())
                    if sum(h.get(f"{role}_nodes", 0) for role in ("prefill", "decode", "colocated")) >= n:
                        waiting.pop(0)
                        continue
            except OSError:
                pass
            time.sleep(0.2)
        if waiting:
            raise RuntimeError(f"the router at {waiting[0]} did not see {n} nodes within {timeout}s")

    def node(self, name: str) -> Proc:
        """The latest process started under ``name``."""
        return next(p for p in reversed(self.procs) if p.name == name)

    def stop(self, grace_s: float = 15.0) -> None:
        """Idempotent. SIGTERM the routers and wait for them (no new requests; those in
        flight finish while the nodes still run), then the nodes (they drain, deregister and
        withdraw their index entries while Redis still answers), then stop Redis. Each
        group gets ``grace_s``; what has not exited by then is killed."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.close()
            self._supervisor = None
        _stop_group([p for p in self.procs if p.role == "router"], grace_s)
        if self.key_file is not None:
            self.key_file.close()  # a router started again would find no keys: none will be
        _stop_group([p for p in self.procs if p.role != "router"], grace_s)
        for proc in (self.responses_redis, self.redis):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(5)
        self._stopped.set()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class SimCluster(Cluster):
    """Redis, the router and ``prefill_nodes`` + ``decode_nodes`` simulated nodes
    (engine/sim_runner.py), spread over ``fleet_procs`` ``splitserve sim-nodes``
    processes. ``sim_args`` go to every fleet (e.g. ``--sim-speedup 10``).

    With ``per_node`` each node is a one-node ``sim-nodes`` process of its own, member
    ``<role>-<i>`` like a real node of ``up``, so a planner starts and drains them one by
    one (``start_node``, ``retire``); ``role_profiles`` (role -> profile) then gives each
    role's nodes their ``--profile`` (a deployment's two profiles)."""

    def __init__(self, prefill_nodes: int, decode_nodes: int, fleet_procs: int = 2, sim_args=(),
                 kv_cache_memory="1GiB", policy=None, router_args=(), cluster_token=None,
                 router_replicas=1, per_node: bool = False, role_profiles: dict[str, str] | None = None):
        super().__init__(prefill_nodes, decode_nodes, kv_cache_memory=kv_cache_memory, policy=policy,
                         router_args=router_args, cluster_token=cluster_token,
                         router_replicas=router_replicas)
        self.fleet_procs = max(1, min(fleet_procs, prefill_nodes + decode_nodes))
        self.sim_args = list(sim_args)
        self.per_node = per_node
        self.role_profiles = dict(role_profiles or {})
        if self.role_profiles and not per_node:
            raise ValueError("SimCluster: role_profiles needs per_node (a fleet process has one profile)")

    def _fleet_args(self, prefill: int, decode: int, id_prefix: str) -> list[str]:
        c = self.cfg
        return ["sim-nodes", "--host", c["host"], "--kv-backend", c["kv_backend"],
                "--kv-cache-memory", c["kv_cache_memory"], "--prefill-nodes", str(prefill),
                "--decode-nodes", str(decode), "--id-prefix", id_prefix, *self.sim_args]

    def start_node(self, role: str, index: int, extra=()) -> Proc:
        """``per_node``: one simulated node of ``role`` in its own process, member
        ``<role>-<index>`` (node id: ``node_id_of``)."""
        assert self.per_node, "SimCluster.start_node: the nodes share fleet processes (per_node=False)"
        name = f"{role}-{index}"
        profile = ["--profile", self.role_profiles[role]] if role in self.role_profiles else []
        args = self._fleet_args(int(role == "prefill"), int(role == "decode"), name)
        return self._spawn(name, [*args, *profile, *extra], "fleet")

    def node_id_of(self, name: str) -> str:
        return f"{name}-{name.rsplit('-', 1)[0]}-0" if self.per_node else name  # sim_fleet's <prefix>-<role>-<i>

    def start(self, timeout: float = 180.0) -> "SimCluster":
        self._start_redises()
        c, k = self.cfg, self.fleet_procs
        if self.per_node:
            fleets = [self.start_node(role, i) for role in ("prefill", "decode") for i in range(c[f"{role}_nodes"])]
        else:
            fleets = []
            for i in range(k):
                share = lambda n: n // k + (i < n % k)
                fleets.append(self._spawn(f"fleet-{i}", self._fleet_args(
                    share(c["prefill_nodes"]), share(c["decode_nodes"]), f"f{i}"), "fleet"))
        routers = self.start_routers()
        # a fleet's READY line counts its nodes: only the routers can tell which registered
        self.wait_serving([*fleets, *routers], {}, {"prefill": c["prefill_nodes"], "decode": c["decode_nodes"]},
                          timeout)
        return self


class TierFlags(NamedTuple):
    """``up``'s KV tier flags, passed to every node (sizes as given, e.g. "8GiB")."""
    memory: str | None  # --kv-offload-memory
    dir: str | None  # --kv-offload-dir: each node gets its own folder under it (its node id)
    disk_bytes: str | None  # --kv-offload-disk-bytes

    def node_args(self, node_id: str) -> list[str]:
        args = ["--kv-offload-memory", self.memory] if self.memory else []
        if self.dir:
            args += ["--kv-offload-dir", os.path.join(self.dir, node_id)]
        return args + (["--kv-offload-disk-bytes", self.disk_bytes] if self.disk_bytes else [])


def _stop_group(procs: list[Proc], grace_s: float) -> None:
    """SIGTERM every running process of ``procs``, wait up to ``grace_s`` for all of them,
    kill the rest, and whatever is left of each one's process group (its worker ranks)."""
    running = [p for p in procs if p.popen.poll() is None]
    for p in running:
        p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        kill_group(p.popen.pid)  # a worker rank that outlived its node


def _port_of(url: str | None) -> int:
    assert url is not None, "a Redis this cluster started has a URL"
    return int(url.rsplit(":", 1)[1].split("/")[0])


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in process group ``pgid`` (a member started in its own
    session: its worker ranks); nothing left is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parse_cpus(items: list[str]) -> dict[str, tuple[int, ...]]:
    """["prefill=0", "decode=1", "router=0,1"] -> {"prefill": (0,), ...}."""
    out = {}
    for item in items:
        role, _, ids = item.partition("=")
        try:
            out[role] = tuple(int(x) for x in ids.split(","))
        except ValueError:
            ids = ""
        if role not in ("prefill", "decode", "colocated", "router") or not ids:
            raise ValueError(f"--cpus: {item!r}; use ROLE=CPU[,CPU...] with ROLE one of prefill, "
                             "decode, colocated, router")
        bad = set(out[role]) - os.sched_getaffinity(0)
        if bad:
            raise ValueError(f"--cpus: {item!r}: CPU {sorted(bad)} is not available here "
                             f"(available: {sorted(os.sched_getaffinity(0))})")
    return out


def served_name(args) -> str:
    """The name clients give as "model": the first --served-model-name, else --model as given."""
    from ..common.bundled import BUNDLED_MODEL_ID
    return (getattr(args, "served_model_name", None) or [args.model or BUNDLED_MODEL_ID])[0]


def launch(args) -> int:
    """``splitserve up``."""
    api_keys = api_keys_from_args(args)  # --api-key, --api-key-file, else $SPLITSERVE_API_KEY
    keyed = bool(api_keys)
    defaults = tomllib.loads(Path(args.config or DEFAULT_CONFIG).read_text())["cluster"]
    pick = lambda flag, key: getattr(args, flag) if getattr(args, flag) is not None else defaults[key]
    enforce_eager = bool(getattr(args, "enforce_eager", None) or defaults.get("enforce_eager", False))
    device_flag = lambda flag, key=None: getattr(args, flag, None) or defaults.get(key or flag)
    tp = {role: getattr(args, f"{role}_tp", None) or defaults.get(f"{role}_tp", 1) for role in ("prefill", "decode")}
    devices = plan_devices(device_flag("device"), device_flag("prefill_devices"), device_flag("decode_devices"),
                           args.kv_backend, defaults["kv_backend"], dtype=device_flag("dtype"),
                           gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                           kv_cache_memory_given=args.kv_cache_memory is not None,
                           default_utilization=defaults.get("gpu_memory_utilization", 0.9), tp=tp)
    cluster = Cluster(prefill_nodes=pick("prefill_nodes", "prefill_nodes"),
                      decode_nodes=pick("decode_nodes", "decode_nodes"), router_port=pick("port", "router_port"),
                      kv_backend=devices.kv_backend, kv_cache_memory=pick("kv_cache_memory", "kv_cache_memory"),
                      threads_per_node=pick("threads_per_node", "threads_per_node"),
                      redis_url=redis_url_from(args.redis_url),
                      model=args.model, served_model_names=getattr(args, "served_model_name", None) or (),
                      host=getattr(args, "host", None) or defaults["host"], cpus=parse_cpus(args.cpus or []),
                      devices=devices if devices.devices or devices.dtype else None,
                      cluster_token=os.environ.get(CLUSTER_TOKEN_ENV) or new_cluster_token(),
                      redis_password=new_cluster_token(), api_keys=api_keys,
                      router_replicas=getattr(args, "router_replicas", None) or 1,
                      policy=getattr(args, "policy", None),
                      load_format=getattr(args, "load_format", None) or defaults.get("load_format"),
                      enforce_eager=enforce_eager, tp=tp,
                      expert_parallel=bool(getattr(args, "enable_expert_parallel", None)
                                           or defaults.get("enable_expert_parallel", False)),
                      dp={role: getattr(args, f"{role}_dp", None) or defaults.get(f"{role}_dp", 1)
                          for role in ("prefill", "decode")},
                      local_prefill_budget=(getattr(args, "local_prefill_budget", None)
                                            if getattr(args, "local_prefill_budget", None) is not None
                                            else defaults.get("local_prefill_budget")),
                      kv_pull_memory=parse_size(getattr(args, "kv_pull_memory", None)
                                                or defaults.get("kv_pull_memory", "256MiB"), "--kv-pull-memory"),
                      kv_offload=TierFlags(getattr(args, "kv_offload_memory", None),
                                           getattr(args, "kv_offload_dir", None),
                                           getattr(args, "kv_offload_disk_bytes", None)),
                      redis_maxmemory=parse_size(defaults["redis_maxmemory"], "redis_maxmemory"),
                      responses_maxmemory=parse_size(pick("responses_maxmemory", "responses_maxmemory"),
                                                     "--responses-maxmemory"),
                      # a node drained by the planner past its grace hands its streams to another
                      router_args=((["--migration-limit", "2"] if getattr(args, "planner", False) else [])
                                   + (["--shared-prefix-cache"] if getattr(args, "shared_prefix_cache", False)
                                      else [])))
    if getattr(args, "planner", False):  # bad planner flags fail before anything starts
        from .planner.config import planner_config
        planner_config(args, "planner-", dp={role: cluster.dp_size(role) for role in ("prefill", "decode")},
                       router_urls=(), redis_url=None, model=None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("[splitserve] starting redis, nodes and router ...", file=sys.stderr, flush=True)
    try:
        cluster.start(timeout=pick("startup_timeout", "startup_timeout_s"))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cluster.supervise()
    status_port = cluster.status_port
    planner = None
    if getattr(args, "planner", False):
        from .planner.service import start_local_planner
        try:
            planner = start_local_planner(args, cluster, served_name(args))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            cluster.stop()
            return 1
    replicas = "".join(f"\n  router replica: {u}/v1" for u in cluster.urls[1:])
    planner_line = (f"\n  planner: http://127.0.0.1:{planner.port}/debug/planner  (its metrics at /metrics)"
                    if planner is not None else "")
    auth = "\n    -H 'Authorization: Bearer <your API key>' \\" if keyed else ""
    print(f"""
splitserve is serving the OpenAI API at {cluster.url}/v1{replicas}
  supervisor status: http://127.0.0.1:{status_port}/status  (restart counters also at /metrics){planner_line}

  curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' \\{auth}
    -d '{{"model": "{served_name(args)}", "messages": [{{"role": "user", "content": "Write a haiku about the sea."}}]}}'

A member that dies is restarted; Ctrl-C stops everything.""", flush=True)
    while not stop.wait(0.5):
        pass
    print("[splitserve] stopping (draining) ...", file=sys.stderr, flush=True)
    if planner is not None:
        planner.stop()  # no scaling while the cluster stops
    cluster.stop(grace_s=NODE_DRAIN_GRACE_S + 5)
    return 0

"""Does a supervised cluster lose requests, KV blocks or shm segments when a member is
killed or clients hang up? A local cluster as ``splitserve up`` runs it (Redis with a
password, the cluster token, shm KV).

    python -m splitserve.benchmarks.reliability.bench_faults [--rate 4] [--phase-s 20] [--requests 1000]
        [--migration-limit N] [--phases kill_decode disconnects] [--out FILE]

Phases, one cluster (2 prefill + 2 decode nodes by default):
  kill_prefill  open-loop load at --rate; kill -9 prefill-0 a third in: failed requests
                (want 0) and seconds until it is back and listed by the router (want < 30)
  kill_decode   the same with decode-0: failed requests vs. its in-flight ones at the kill,
                the slowest error after the kill (want < 2 s), failures among requests
                sent after the kill (want 0). With --migration-limit N >= 1 (the router's
                mid-stream migration) its in-flight requests move to decode-1: want 0
                failed, and the router's migration counter counts them
  kill_router   kill -9 the router; a client retrying every 0.1 s: seconds to its first
                success (want < 5)
  disconnects   --requests requests at --disconnect-rate, 20% hanging up at a random
                point (before the first byte, after the role chunk, mid-stream): seconds
                until every pool is 100% free (want < one lease) and shm segments left
                of dead processes, then after the cluster stopped (want 0)

After each kill phase and the disconnects: seconds until every pool on every node is
100% free with no stream or transfer left (want < one lease).

Prints each figure and writes benchmarks/results/faults.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp

from splitserve.benchmarks.harness import MODEL, RESULTS, Outcome, run_load, wait_pools_free
from splitserve.common import metric_names as names
from splitserve.common.auth import new_cluster_token
from splitserve.deploy.launcher import Cluster
from splitserve.node.shm_segments import list_segments, owner_pid

PHASES = ("kill_prefill", "kill_decode", "kill_router", "disconnects")
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?",
           "Name three colors of the rainbow.", "Explain rain to a child in one sentence.",
           "List four animals that live in the ocean.", "Why is the sky blue? Answer briefly."]


def node_names(args) -> list[str]:
    return [f"prefill-{i}" for i in range(args.prefill_nodes)] + [f"decode-{i}" for i in range(args.decode_nodes)]


def wait_back(c: Cluster, name: str, old_pid: int, n_nodes: int, t0: float, timeout: float = 120) -> float:
    while not (c.node(name).popen.pid != old_pid and c.node(name).ready.is_set()):
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{name} not back after {timeout}s")
        time.sleep(0.05)
    c.wait_for_nodes(n_nodes, timeout)
    return time.monotonic() - t0


async def router_migrations(c: Cluster) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{c.url}/metrics") as r:
        text = await r.text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(names.REQUEST_MIGRATIONS + "{"))


async def pools_free_s(c: Cluster, args) -> float:
    """Seconds until every pool on every node is 100% free (raises after 4 leases)."""
    free_s, _ = await wait_pools_free([c.node(n).addr for n in node_names(args)], c.auth_headers(),
                                      timeout_s=4 * args.lease)
    return round(free_s, 2)


def longest_gap(results) -> float:
    return round(max((r.longest_gap_s for r in results if r.outcome is Outcome.OK), default=0.0), 3)


async def kill_phase(c: Cluster, args, name: str) -> dict:
    old = c.node(name).popen.pid
    migrations_before = await router_migrations(c)
    load = asyncio.create_task(run_load(c.url, args.rate, args.phase_s, PROMPTS, args.max_tokens, seed=hash(name) & 0xFF))
    await asyncio.sleep(args.phase_s / 3)
    async with aiohttp.ClientSession() as s:
        st = await s.get(f"{c.node(name).addr}/debug/state", headers=c.auth_headers())
        state = await st.json()
        inflight = state.get("streams", state.get("outgoing"))
    t_kill = time.monotonic()
    os.killpg(old, signal.SIGKILL)
    back_s = await asyncio.to_thread(wait_back, c, name, old, len(node_names(args)), t_kill)
    results = await load
    failed = [r for r in results if r.outcome is not Outcome.OK]
    return {"requests": len(results), "failed": len(failed), "inflight_on_killed_node": inflight,
            "failed_sent_after_kill": sum(r.started >= t_kill for r in failed),
            "slowest_error_after_kill_s": round(max((r.ended - t_kill for r in failed), default=0.0), 3),
            "back_serving_s": round(back_s, 2),
            "migrations": await router_migrations(c) - migrations_before,
            # A migrated stream stalls from the kill to its new leg's first token. The longest
            # silence in the streams that completed across the kill bounds that stall (it also
            # includes a stream's wait for its first token: compare with the requests before it).
            "longest_gap_across_kill_s": longest_gap(r for r in results if r.started < t_kill < r.ended),
            "longest_gap_before_kill_s": longest_gap(r for r in results if r.ended < t_kill),
            "pools_free_after_s": await pools_free_s(c, args), "lease_s": args.lease,
            # the first few errors (a failed request always has one; this load disconnects none)
            "errors": sorted({r.error for r in failed if r.error is not None})[:5]}


async def router_phase(c: Cluster) -> dict:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    os.killpg(c.node("router").popen.pid, signal.SIGKILL)
    t_kill, attempts = time.monotonic(), 0
    async with aiohttp.ClientSession() as s:
        while True:
            attempts += 1
            try:
                async with s.post(f"{c.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        await r.read()
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() - t_kill > 120:
                raise RuntimeError("the router did not come back within 120 s")
            await asyncio.sleep(0.1)
    return {"first_success_after_kill_s": round(time.monotonic() - t_kill, 2), "attempts": attempts}


async def disconnect_phase(c: Cluster, args) -> dict:
    duration = args.requests / args.disconnect_rate
    results = await run_load(c.url, args.disconnect_rate, duration, PROMPTS, args.max_tokens,
                             disconnect_fraction=0.2, seed=7, count=args.requests)
    free_s = await pools_free_s(c, args)
    pids = {p.popen.pid for p in c.procs if p.popen.poll() is None}
    dead_left = [n for n in list_segments() if owner_pid(n) not in pids and _ours(n, c)]
    counts = {o.value: sum(r.outcome is o for r in results) for o in Outcome}
    return {"requests": len(results), "outcomes": counts, "pools_free_after_s": free_s,
            "lease_s": args.lease, "pools_free_within_lease": free_s <= args.lease,
            "dead_owner_segments_left": len(dead_left),
            "errors": sorted({r.error for r in results if r.outcome is Outcome.FAILED and r.error is not None})[:5]}


def _ours(name: str, c: Cluster) -> bool:
    return owner_pid(name) in {p.popen.pid for p in c.procs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-nodes", type=int, default=2)
    ap.add_argument("--decode-nodes", type=int, default=2)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second in the kill phases")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of load per kill phase")
    ap.add_argument("--requests", type=int, default=1000, help="requests of the disconnect phase")
    ap.add_argument("--disconnect-rate", type=float, default=8.0, help="requests per second there")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lease", type=float, default=10.0, help="transfer lease of the nodes (s)")
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--migration-limit", type=int, default=0,
                    help="the router's --migration-limit (0: off, a killed decode node's requests fail)")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="phases to run, in order")
    ap.add_argument("--out", default=str(RESULTS / "faults.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    c = Cluster(prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes, kv_backend="shm",
                kv_cache_memory=args.kv_cache_memory, cluster_token=new_cluster_token(),
                redis_password=new_cluster_token(), extra_node_args=["--transfer-lease", str(args.lease)],
                router_args=["--migration-limit", str(args.migration_limit)])
    t0 = time.monotonic()
    c.start()
    sup = c.supervise()
    out = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "startup_s": round(time.monotonic() - t0, 1)}
    try:
        phases = {"kill_prefill": lambda: kill_phase(c, args, "prefill-0"),
                  "kill_decode": lambda: kill_phase(c, args, "decode-0"),
                  "kill_router": lambda: router_phase(c),
                  "disconnects": lambda: disconnect_phase(c, args)}
        for phase in args.phases:
            out[phase] = asyncio.run(phases[phase]())
            print(f"{phase}: {json.dumps(out[phase])}", flush=True)
        with open("/proc/loadavg") as f:
            out["loadavg"] = f.read().split()[:3]
    finally:
        out["restarts"] = {m["name"]: m["restarts"] for m in sup.status()["members"]}
        pids = {p.popen.pid for p in c.procs}
        c.stop()
        out["segments_left_after_stop"] = sum(owner_pid(n) in pids for n in list_segments())
    print(f"segments left after stop: {out['segments_left_after_stop']}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

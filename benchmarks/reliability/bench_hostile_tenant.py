"""Can one tenant hurt the others? Two attacks of a hostile API key, each beside two
well-behaved keys, each judged against its own targets.

    .venv/bin/python benchmarks/reliability/bench_hostile_tenant.py [--phases flood tier]
        [--seconds 60] [--rounds 2]

flood   The stored-responses flood. A Redis of the responses' own (maxmemory 64 MiB,
        volatile-lru, as ``splitserve up`` starts it) and the router's budgets
        (``--responses-max-bytes`` 75% of it, ``--responses-key-max-bytes 16MiB``), a
        simulated decode node (the real server, a timing model for the forward). Per
        round: a quiet run (keys B and C hold conversations, each turn chained to the last
        with ``previous_response_id``) for ``--seconds``, then the same with key A storing
        ~28 KB inputs 8 at a time (one input with a counter at its end, so the prefix cache
        serves all but the first: what makes the attack cheap). Targets: the responses Redis stays under its maxmemory
        and evicts nothing, the main Redis (node registry, prefix index) holds no response and
        loses no record, A is refused with 429 + Retry-After + an OpenAI error body, B and C
        get no error and every response they stored reads back (each conversation's, at
        its end, before they delete them: a client keeping within its quota). Their latency
        p50 and p99 in both runs are reported beside (the flood's requests share the
        router's and the node's CPU with theirs: a figure, not a target of the store).
tier    Damaged disk-tier files. A real cluster (the bundled model, one prefill and one
        decode node) with a small device cache over a host and a disk tier: prompts are
        sent until the first one's blocks sit on disk, then every block file of both nodes
        is cut to its magic and two bytes (what a crash or a full disk leaves), and every
        prompt is sent again, three at a time. Targets: 0 failed requests, every answer
        token-exact with the first pass (greedy), the faults counted
        (``kv_offload_faults_total``), both nodes alive.

Writes ``benchmarks/results/hostile_tenant.json``. A run whose round the machine could
not sustain (the quiet run's own requests failing or timing out) says so and reports no
latency ratio for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import redis

from splitserve.benchmarks.harness import MODEL, RESULTS, check_alive, node_counters
from splitserve.common.metric_names import KV_OFFLOAD_FAULTS

KEYS = {"A": "hostile-key-a-0123456789", "B": "tenant-key-b-0123456789", "C": "tenant-key-c-0123456789"}
MiB = 1 << 20
RESPONSES_MAXMEMORY = 64 * MiB
KEY_QUOTA = "16MiB"
FLOOD_CONCURRENCY = 8
FLOOD_INPUT_WORDS = 5600  # ~28 KB, ~5,600 tokens: under the model's context


def _words(rng: random.Random, n: int) -> str:
    vocab = ["sea", "stone", "river", "light", "cloud", "field", "north", "glass", "ember", "pine"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ---- flood ---------------------------------------------------------------------------------

class Tenant:
    """One well-behaved key: conversations of short turns, each turn chained to the last;
    at a conversation's end it reads every response back (one missing: lost) and deletes
    them, as a client that keeps within its quota does."""

    TURNS = 7

    def __init__(self, name: str):
        self.name = name
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.stored = 0
        self.lost = 0

    async def converse(self, session: aiohttp.ClientSession, url: str, until: float) -> None:
        auth = {"Authorization": f"Bearer {KEYS[self.name]}"}
        while time.monotonic() < until:
            ids: list[str] = []
            for turn in range(self.TURNS):
                body = {"model": MODEL, "input": f"turn {turn}: say something about the sea",
                        "max_output_tokens": 8}
                if ids:
                    body["previous_response_id"] = ids[-1]
                t0 = time.monotonic()
                async with session.post(f"{url}/v1/responses", json=body, headers=auth) as r:
                    data = await r.json(content_type=None)
                if r.status != 200:
                    self.errors.append(f"{r.status}: {data}")
                    await asyncio.sleep(0.5)
                    break
                self.latencies.append(time.monotonic() - t0)
                ids.append(data["id"])
                await asyncio.sleep(0.05)
            self.stored += len(ids)
            for rid in ids:
                async with session.get(f"{url}/v1/responses/{rid}", headers=auth) as r:
                    self.lost += r.status != 200
                async with session.delete(f"{url}/v1/responses/{rid}", headers=auth) as r:
                    pass


async def _flooder(session: aiohttp.ClientSession, url: str, until: float, counts: dict, big: str) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1  # one big input, served from the prefix cache after its first time: cheap to send
        body = {"model": MODEL, "input": f"{big} {n}", "max_output_tokens": 4}
        async with session.post(f"{url}/v1/responses", json=body,
                                headers={"Authorization": f"Bearer {KEYS['A']}"}) as r:
            data = await r.json(content_type=None)
            counts[r.status] = counts.get(r.status, 0) + 1
            if r.status == 429:
                ok = ("Retry-After" in r.headers and isinstance(data, dict)
                      and isinstance(data.get("error"), dict) and data["error"].get("message"))
                counts["429_well_formed"] = counts.get("429_well_formed", 0) + bool(ok)
                await asyncio.sleep(min(1.0, float(r.headers.get("Retry-After", "1"))))


async def _sample_memory(r: redis.Redis, until: float, into: list[int]) -> None:
    while time.monotonic() < until:
        into.append(int(r.info("memory")["used_memory"]))
        await asyncio.sleep(0.5)


async def _flood_run(url: str, seconds: float, attack: bool, responses: redis.Redis) -> dict:
    until = time.monotonic() + seconds
    tenants = [Tenant("B"), Tenant("C")]
    counts: dict = {}
    memory: list[int] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = [t.converse(session, url, until) for t in tenants] + [_sample_memory(responses, until, memory)]
        if attack:
            big = _words(random.Random(1), FLOOD_INPUT_WORDS)
            jobs += [_flooder(session, url, until, counts, big) for _ in range(FLOOD_CONCURRENCY)]
        await asyncio.gather(*jobs)
    lat = [x for t in tenants for x in t.latencies]
    return {"requests": len(lat), "errors": [e for t in tenants for e in t.errors][:5],
            "error_count": sum(len(t.errors) for t in tenants), "lost_stored": sum(t.lost for t in tenants),
            "stored": sum(t.stored for t in tenants),
            "p50_s": _p(lat, 0.5), "p99_s": _p(lat, 0.99), "max_used_memory": max(memory, default=0),
            "flood": {str(k): v for k, v in counts.items()}}


def phase_flood(seconds: float, rounds: int) -> dict:
    from splitserve.common.kv_index import SET_PREFIX
    from splitserve.common.node_registry import KEY_PREFIX as NODE_PREFIX
    from splitserve.deploy.launcher import SimCluster
    from splitserve.deploy.local_redis import RESPONSES_EVICTION, RedisPolicy, responses_budget, start_redis

    folder = Path(tempfile.mkdtemp(prefix="hostile-keys-"))
    keys = folder / "api-keys"
    keys.write_text("".join(f"{k}\n" for k in KEYS.values()))
    keys.chmod(0o600)
    proc, responses_url = start_redis(policy=RedisPolicy(RESPONSES_MAXMEMORY, RESPONSES_EVICTION))
    responses = redis.Redis.from_url(responses_url)
    c = SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "20"], kv_cache_memory="512MiB",
                   router_args=["--api-key-file", str(keys), "--responses-redis-url", responses_url,
                                "--responses-max-bytes", str(responses_budget(RESPONSES_MAXMEMORY)),
                                "--responses-key-max-bytes", KEY_QUOTA])
    out: dict = {"responses_maxmemory": RESPONSES_MAXMEMORY, "key_quota": KEY_QUOTA, "rounds": []}
    try:
        with c:
            main = redis.Redis.from_url(c.redis_url)
            nodes_before = sorted(main.scan_iter(f"{NODE_PREFIX}*"))
            index_before = len(list(main.scan_iter(f"{SET_PREFIX}*")))
            for i in range(rounds):
                quiet = asyncio.run(_flood_run(c.url, seconds, False, responses))
                attack = asyncio.run(_flood_run(c.url, seconds, True, responses))
                check_alive(c)
                sustained = quiet["error_count"] == 0 and quiet["requests"] >= 10
                row = {"quiet": quiet, "attack": attack, "sustained": sustained,
                       "p50_ratio": attack["p50_s"] / quiet["p50_s"] if sustained else None,
                       "p99_ratio": attack["p99_s"] / quiet["p99_s"] if sustained else None}
                out["rounds"].append(row)
                print(f"[flood] round {i + 1}: quiet p99 {quiet['p99_s']:.3f} s ({quiet['requests']} turns), "
                      f"attack p99 {attack['p99_s']:.3f} s ({attack['requests']} turns, "
                      f"{attack['error_count']} errors, {attack['lost_stored']} lost), "
                      f"A: {attack['flood']}, responses Redis max {attack['max_used_memory'] / MiB:.1f} MiB",
                      flush=True)
            info = responses.info()
            out["responses_evicted_keys"] = int(info["evicted_keys"])
            out["responses_max_used_memory"] = max(r["attack"]["max_used_memory"] for r in out["rounds"])
            out["main_responses_keys"] = len(list(main.scan_iter("splitserve:response*")))
            out["main_evicted_keys"] = int(main.info()["evicted_keys"])
            out["registry_records_kept"] = sorted(main.scan_iter(f"{NODE_PREFIX}*")) == nodes_before
            out["index_sets_before_after"] = [index_before, len(list(main.scan_iter(f"{SET_PREFIX}*")))]
    finally:
        proc.kill()
        proc.wait()
        keys.unlink(missing_ok=True)
        folder.rmdir()
    for q in ("p50", "p99"):
        ratios = [r[f"{q}_ratio"] for r in out["rounds"] if r[f"{q}_ratio"] is not None]
        out[f"{q}_ratio_median"] = statistics.median(ratios) if ratios else None
    a429 = sum(r["attack"]["flood"].get("429", 0) for r in out["rounds"])
    well = sum(r["attack"]["flood"].get("429_well_formed", 0) for r in out["rounds"])
    out["targets"] = {
        "responses_redis_under_maxmemory": out["responses_max_used_memory"] < RESPONSES_MAXMEMORY,
        "responses_redis_evicted_nothing": out["responses_evicted_keys"] == 0,
        "main_redis_untouched": (out["main_responses_keys"] == 0 and out["main_evicted_keys"] == 0
                                 and out["registry_records_kept"]),
        "flooder_refused_429_retry_after": a429 > 0 and well == a429,
        "others_unaffected": all(r["attack"]["error_count"] == 0 and r["attack"]["lost_stored"] == 0
                                 for r in out["rounds"]),
    }
    if out["p99_ratio_median"] is None:
        print("[flood] the machine could not sustain a quiet run: no latency ratio", flush=True)
    else:
        print(f"[flood] the others' latency under the flood / quiet (median of rounds): "
              f"p50 {out['p50_ratio_median']:.2f}x, p99 {out['p99_ratio_median']:.2f}x", flush=True)
    return out


# ---- tier ----------------------------------------------------------------------------------

def _complete(url: str, prompt: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def phase_tier(prompts: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from splitserve.deploy.launcher import Cluster, TierFlags
    from splitserve.engine.kv.disk_file import MAGIC

    rng = random.Random(7)
    texts = [f"Story {i}. " + _words(rng, 700) for i in range(prompts)]  # ~700 tokens each
    tier_dir = Path(tempfile.mkdtemp(prefix="hostile-tier-"))
    tier_dir.chmod(0o700)
    out: dict = {"prompts": prompts}
    c = Cluster(1, 1, kv_cache_memory="48MiB", threads_per_node=1,
                kv_offload=TierFlags("48MiB", str(tier_dir), "1GiB"))
    with c:
        first = []
        for i, t in enumerate(texts):  # one at a time: each pushes the earlier ones down the tiers
            first.append(_complete(c.url, t))
            print(f"[tier] first pass {i + 1}/{prompts}: {first[-1][0]}", flush=True)
        deadline = time.monotonic() + 60
        files: list[Path] = []
        while time.monotonic() < deadline:
            files = [p for p in tier_dir.rglob("*.kvb") if p.is_file()]
            if files:
                break
            time.sleep(0.5)
        time.sleep(2)  # the writers finish what they queued
        files = [p for p in tier_dir.rglob("*.kvb") if p.is_file()]
        for p in files:
            p.write_bytes(p.read_bytes()[:len(MAGIC) + 2])
        out["files_cut"] = len(files)
        print(f"[tier] cut {len(files)} block files to {len(MAGIC) + 2} bytes", flush=True)
        with ThreadPoolExecutor(3) as pool:
            again = list(pool.map(lambda t: _complete(c.url, t), texts))
        check_alive(c)
        faults = {k: v for k, v in node_counters(c, (KV_OFFLOAD_FAULTS,)).items() if v}
    out["failed"] = sum(s != 200 for s, _ in again) + sum(s != 200 for s, _ in first)
    out["token_exact"] = sum(a == b for a, b in zip(first, again))
    out["faults"] = faults
    out["targets"] = {"no_failed_request": out["failed"] == 0,
                      "token_exact": out["token_exact"] == prompts,
                      "faults_counted": sum(faults.values()) > 0,
                      "files_were_on_disk": out["files_cut"] > 0}
    print(f"[tier] {out['failed']} failed, {out['token_exact']}/{prompts} token-exact, faults {faults}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", nargs="+", choices=("flood", "tier"), default=["flood", "tier"])
    ap.add_argument("--seconds", type=float, default=60.0, help="each quiet and attack run of the flood")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="the tier phase's prompts")
    ap.add_argument("--out", default=str(RESULTS / "hostile_tenant.json"))
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_QUIET", "1")
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average": os.getloadavg()}
    if "flood" in args.phases:
        result["flood"] = phase_flood(args.seconds, args.rounds)
    if "tier" in args.phases:
        result["tier"] = phase_tier(args.prompts)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    missed = [f"{phase}.{name}" for phase in ("flood", "tier") if phase in result
              for name, ok in result[phase]["targets"].items() if not ok]
    print(json.dumps({p: result[p]["targets"] for p in ("flood", "tier") if p in result}, indent=2))
    print(f"wrote {args.out}; " + ("every target met" if not missed else f"missed: {', '.join(missed)}"))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())

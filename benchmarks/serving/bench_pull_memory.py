"""What does a holder hold in memory while it serves pulls of a 100k-token prefix, beside its
``--kv-pull-memory``? (issue 53)

    .venv/bin/python benchmarks/serving/bench_pull_memory.py            # ~15 min (two 100k prefills)
    .venv/bin/python benchmarks/serving/bench_pull_memory.py --quick    # 4k tokens, a smoke run

A decode node on the CPU (its own process) computes a ``--prefix-tokens`` prompt, then serves
``--pullers`` concurrent pulls of that whole prefix to pullers in this process (harness.py
``PullSink``: a real receiver over a scratch pool). Its model is a small random Llama
(``--load-format dummy``) whose context holds the prefix: 2 layers, 4 KV heads of 64, fp32,
4 KiB of KV a token, so a 100k-token prefix is 391 MiB (a Llama-3-8B's, bf16, is 12.2 GiB,
32x; what a holder packs scales with the bytes, not with the model). Two holders, one after
the other:

    capped      ``--kv-pull-memory`` ``--cap`` (default 32MiB): what it holds packed for its pulls,
                all of them together, stays under it (node/pull_budget.py)
    uncapped    ``--kv-pull-memory 1TiB``: as before issue 53, an idle holder packs up to a
                step's worth of copies per chunk, per pull, at once

Reported per holder: the most bytes it held packed for pulls (its /debug/state
``pull_budget.packed_bytes_peak``) beside the cap, its resident memory (VmRSS, sampled every
10 ms from /proc) before the pulls and at its peak during them, and how long the pulls took.
The run is sustained when every pull landed whole; otherwise it says so and prints no
figures. Writes benchmarks/results/pull_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import msgspec

from splitserve.benchmarks.harness import RESULTS, PullSink
from splitserve.engine.models.convert import bundled_model_dir
from splitserve.common.config import parse_size
from splitserve.common.kv_compat import KVCompat
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import GenerateRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster
from splitserve.router.streams.node_client import NodeClient

BS = 16
# the holder's model: the bundled config with these (a long context, 4 KiB of fp32 KV a token)
LAYERS, KV_HEADS, HEAD_DIM = 2, 4, 64
SHAPE = dict(num_hidden_layers=LAYERS, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=131072, rope_scaling=None,
             tie_word_embeddings=False)
TOKEN_KV_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, fp32
UNCAPPED = "1TiB"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def model_folder(root: Path) -> Path:
    cfg = json.loads((bundled_model_dir() / "config.json").read_text())
    cfg.update(SHAPE)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssWatch:
    """The peak of a process's VmRSS, sampled every 10 ms on a thread until ``stop``."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, rss_bytes(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def serve_pulls(addr: str, prefix: list[int], pullers: int) -> dict:
    """The holder at ``addr`` computes ``prefix``, then serves ``pullers`` pulls of it at once."""
    state = get_json(f"{addr}/debug/state")
    kv, pid = msgspec.convert(state["kv"], KVCompat), state["pid"]
    blocks = len(prefix) // BS
    sink = PullSink(kv, pullers * blocks)
    await sink.start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            t0 = time.monotonic()
            warm = GenerateRequest(request_id="warm", prompt=WirePrompt.of(prefix + [7]),
                                   sampling_params=SamplingParams(max_tokens=1, temperature=0))
            stream = await NodeClient(session, read_timeout_s=3600).generate(addr, warm)
            [d async for d in stream.deltas()]  # the holder caches the prefix
            stream.close()
            prefill_s = time.monotonic() - t0
            await asyncio.sleep(1.0)
            before = rss_bytes(pid)
            watch = RssWatch(pid)
            t0 = time.monotonic()
            got = await asyncio.gather(*(sink.pull(session, addr, prefix, list(range(k * blocks, (k + 1) * blocks)),
                                                   lease_s=600.0) for k in range(pullers)), return_exceptions=True)
            pull_s = time.monotonic() - t0
            peak = watch.stop()
    finally:
        await sink.stop()
    budget = get_json(f"{addr}/debug/state")["pull_budget"]
    failed = [repr(g)[:200] if isinstance(g, BaseException) else f"{g} of {blocks} blocks"
              for g in got if g != blocks]
    return {"prefill_s": prefill_s, "pull_s": pull_s, "rss_before": before, "rss_peak": peak,
            "rss_growth": peak - before, "packed_peak": budget["packed_bytes_peak"], "cap": budget["max_bytes"],
            "blocks": blocks, "block_bytes": kv.num_layers * 2 * BS * kv.num_kv_heads * kv.head_dim * 4,
            "failed": failed}


def report(result: dict) -> None:
    if not result["sustained"]:
        print("NOT SUSTAINED: " + "; ".join(result["why"]) + "\nno figures")
        return
    mib = lambda n: n / 2**20
    print(f"\n{result['prefix_tokens']}-token prefix ({mib(result['prefix_bytes']):.0f} MiB), "
          f"{result['pullers']} pulls at once")
    print(f"{'holder':>9s} {'cap MiB':>8s} {'packed peak':>12s} {'RSS before':>11s} {'RSS peak':>9s} "
          f"{'growth':>8s} {'pulls s':>8s}")
    for name, r in result["holders"].items():
        cap = "none" if r["cap"] >= parse_size(UNCAPPED) else f"{mib(r['cap']):.0f}"
        print(f"{name:>9s} {cap:>8s} {mib(r['packed_peak']):11.1f}M {mib(r['rss_before']):10.0f}M "
              f"{mib(r['rss_peak']):8.0f}M {mib(r['rss_growth']):7.0f}M {r['pull_s']:8.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=100_000)
    ap.add_argument("--pullers", type=int, default=2, help="pulls of the whole prefix at once")
    ap.add_argument("--cap", default="32MiB", help="the capped holder's --kv-pull-memory")
    ap.add_argument("--quick", action="store_true", help="a 4096-token prefix, a 1 MiB cap: a smoke run")
    ap.add_argument("--out", default=str(RESULTS / "pull_memory_cpu.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.cap = 4096, "1MiB"
    if args.prefix_tokens % BS:
        raise ValueError(f"--prefix-tokens: a multiple of {BS}, got {args.prefix_tokens}")
    prefix = [(37 * j + 11) % 40000 + 100 for j in range(args.prefix_tokens)]
    pool = f"{(args.prefix_tokens + 4 * BS) * TOKEN_KV_BYTES * 5 // 4 // 2**20 + 16}MiB"
    holders: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp))
        for name, cap in (("capped", args.cap), ("uncapped", UNCAPPED)):
            cluster = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory=pool,
                              model=str(folder), load_format="dummy", kv_pull_memory=parse_size(cap, "--cap"))
            try:
                cluster.start_redis()
                node = cluster.start_node("decode", 0, ["--max-model-len", str(args.prefix_tokens + 64)])
                cluster.wait_ready(node, 300)
                holders[name] = asyncio.run(serve_pulls(cluster.node("decode-0").addr, prefix, args.pullers))
            finally:
                cluster.stop()
            r = holders[name]
            print(f"{name}: prefill {r['prefill_s']:.1f} s, pulls {r['pull_s']:.1f} s, packed peak "
                  f"{r['packed_peak'] / 2**20:.1f} MiB, RSS +{r['rss_growth'] / 2**20:.0f} MiB", flush=True)
    why = [f"{name}: {r['failed'][0]}" for name, r in holders.items() if r["failed"]]
    capped = holders["capped"]
    result = {"holders": holders, "sustained": not why, "why": why, "prefix_tokens": args.prefix_tokens,
              "prefix_bytes": args.prefix_tokens * TOKEN_KV_BYTES, "pullers": args.pullers, "shape": SHAPE,
              "cap_held": capped["packed_peak"] <= capped["cap"], "args": vars(args),
              "command": "benchmarks/serving/bench_pull_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    report(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if result["sustained"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

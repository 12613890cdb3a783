"""What does moving KV between nodes of different tensor parallelism cost, beside the
same-TP transfer? The transfer rate of P TP=1 -> D TP=2 (each prefill block split in two
head slices) and P TP=2 -> D TP=1 (each decode block gathered from two slices), beside
1 -> 1 and 2 -> 2, over tcp and shm, every rank its own process.

    .venv/bin/python benchmarks/kvtransfer/bench_kvtransfer_tp.py [--runs 5] [--blocks 32] [--backends tcp,shm]

Layout: 30 layers, block 16, 4 KV heads, head dim 64, fp32 (960 KiB per block at TP=1).
A node is its ranks, each a process with its shard of the cache: prefill ranks pack the
slices the plan gives them (kvtransfer/tp_plan.py) and send them (``ShardSender``);
decode rank 0 holds the ``TransferTable(ranks=TP)``, fed by its own receiver and by the
worker ranks' ``RankBlocks`` over the node's rank pipe. One figure is the
time from the first prefill rank's start (pack included: a slice is a strided gather)
to rank 0's ``Transfer.done`` (every block on every decode rank, checksums verified),
for ``--blocks`` blocks; the rate is the blocks' TP=1 bytes over that time (each decode
rank receives only its heads, so those bytes cross the wire once). Median of ``--runs``
after one warm-up. Writes ``benchmarks/results/kvtransfer_tp.json``.

On a 2-core host the ranks of both nodes share the cores (TP=2 -> TP=2 runs four busy
processes), so read the figures as the cost of the slicing and the rank bookkeeping on
this CPU, not as what more GPUs would gain.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

import torch

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.kv_backends import backend_spec
from splitserve.common.kv_compat import KVCompat
from splitserve.common.protocol import PrefillResult
from splitserve.kvtransfer import (KVBlockStore, KVShard, OnBlock, RankReporter, SenderOptions, ShardSender,
                                   TransferFailure, TransferTable, allocate_kv_cache, free_shared_kv_cache,
                                   make_receiver, make_sender, rank_report)

PAIRS = ((1, 1), (2, 2), (1, 2), (2, 1))  # (prefill TP, decode TP)
HEADS = 4


def key(tp: int) -> KVCompat:
    return KVCompat(model="bench", dtype="float32", block_size=16, num_layers=30, num_kv_heads=HEADS,
                    head_dim=64, tp=tp)


def prefill_rank_main(backend: str, tp: int, rank: int, num_blocks: int, ctrl) -> None:
    """One prefill rank: a random shard; on ("send", ...) sends its share, answers the times."""
    torch.set_num_threads(1)
    shard = KVShard(key(tp), rank)
    store = KVBlockStore(torch.randn(shard.layout.cache_shape(num_blocks)), shard.layout)
    sender = ShardSender(make_sender(backend, shard.layout, SenderOptions(timeout_s=60), shard=shard),
                         store, shard)

    async def main():
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, ctrl.recv)
            if msg[0] == "stop":
                break
            _, tid, addrs, src, dest = msg
            start = time.perf_counter()
            try:
                sent = await sender.send(addrs, tid, src, dest)
            except Exception as e:
                ctrl.send(("failed", f"{type(e).__name__}: {e}"))
                continue
            ctrl.send(("sent", start, time.perf_counter(), sent))
        await sender.sender.close()

    asyncio.run(main())


def decode_rank_main(backend: str, tp: int, rank: int, num_blocks: int, ctrl, reports: list) -> None:
    """One decode rank. Rank 0: the table, fed by its receiver and the workers' report pipes;
    on ("reserve", tid, dest) it reserves (the prefill answer already in) and later answers
    ("done", time, reason|None). A worker: its receiver's reports go to rank 0's pipe."""
    torch.set_num_threads(1)
    shard = KVShard(key(tp), rank)
    shm_name = f"splitserve-bench-{uuid.uuid4().hex[:8]}" if backend_spec(backend).shm_cache else None
    store = KVBlockStore(allocate_kv_cache(shard.layout, num_blocks, shm_name), shard.layout, shm_name=shm_name)

    async def main():
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        table = TransferTable(ranks=tp)  # used on rank 0 only

        def to_table(tid: str, dest: int, ok: bool, reason: str | None) -> None:
            table.on_block(tid, dest, ok, reason)

        def on_report(conn) -> None:
            msg = rank_report.decode(conn.recv_bytes())
            assert isinstance(msg, rank_report.RankBlocks)
            table.on_rank_blocks(msg)

        on_block: OnBlock = to_table
        if rank == 0:
            for conn in reports:
                loop.add_reader(conn.fileno(), on_report, conn)
        else:
            (out,) = reports
            on_block = RankReporter(rank, lambda msg: out.send_bytes(rank_report.encode(msg))).on_block
        receiver = make_receiver(backend, shard.layout, store, "127.0.0.1", on_block, shard=shard)
        await receiver.start()
        ctrl.send(receiver.address)

        async def finish(t):
            outcome = await t.done
            reason = outcome.reason if isinstance(outcome, TransferFailure) else None
            ctrl.send(("done", time.perf_counter(), reason))
            table.own(t.transfer_id) if reason is None else None
            table.remove(t.transfer_id)

        def on_ctrl():
            msg = ctrl.recv()
            if msg[0] == "stop":
                stop.set_result(None)
                return
            _, tid, dest = msg
            t = table.reserve(tid, tid, dest, lease_s=60)
            table.prefilled(tid, PrefillResult(transfer_id=tid, first_token=0))
            loop.create_task(finish(t))
            ctrl.send("reserved")

        loop.add_reader(ctrl.fileno(), on_ctrl)
        await stop
        await receiver.stop()

    try:
        asyncio.run(main())
    finally:
        if shm_name:
            free_shared_kv_cache(shm_name)


def bench_pair(backend: str, p_tp: int, d_tp: int, blocks: int, runs: int) -> dict | str:
    ctx = mp.get_context("spawn")
    num_blocks = blocks + 8
    procs, ctrls = [], []
    try:
        worker_ends = [ctx.Pipe(duplex=False) for _ in range(d_tp - 1)]  # (rank 0 reads, worker writes)
        decode_ctrl = []
        for r in range(d_tp):
            parent, child = ctx.Pipe()
            reports = [recv for recv, _ in worker_ends] if r == 0 else [worker_ends[r - 1][1]]
            procs.append(ctx.Process(target=decode_rank_main, args=(backend, d_tp, r, num_blocks, child, reports)))
            decode_ctrl.append(parent)
        prefill_ctrl = []
        for r in range(p_tp):
            parent, child = ctx.Pipe()
            procs.append(ctx.Process(target=prefill_rank_main, args=(backend, p_tp, r, num_blocks, child)))
            prefill_ctrl.append(parent)
        ctrls = decode_ctrl + prefill_ctrl
        for p in procs:
            p.start()
        addrs = []
        for c in decode_ctrl:
            if not c.poll(60):
                return "a decode rank did not start"
            addrs.append(c.recv())
        src, dest = list(range(blocks)), list(range(num_blocks - 1, num_blocks - 1 - blocks, -1))
        times = []
        for i in range(runs + 1):  # the first run warms up (connects, faults pages in)
            tid = f"t{i}"
            decode_ctrl[0].send(("reserve", tid, dest))
            assert decode_ctrl[0].recv() == "reserved"
            for c in prefill_ctrl:
                c.send(("send", tid, addrs, src, dest))
            sent = [c.recv() for c in prefill_ctrl]
            if any(s[0] != "sent" for s in sent):
                return f"send failed: {sent}"
            if not decode_ctrl[0].poll(60):
                return "the transfer did not complete within 60 s"
            _, done_at, reason = decode_ctrl[0].recv()
            if reason is not None:
                return f"transfer failed: {reason}"
            if i:
                times.append(done_at - min(s[1] for s in sent))
        full = blocks * key(1).num_layers * 2 * 16 * HEADS * 64 * 4
        med = statistics.median(times)
        return {"gbps": full / med / 1e9, "ms": med * 1e3, "ms_all": [round(t * 1e3, 2) for t in times],
                "bytes": full, "slices_per_block": max(p_tp, d_tp) // min(p_tp, d_tp) if p_tp != d_tp else 1}
    finally:
        for c in ctrls:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--backends", default="tcp,shm")
    args = ap.parse_args()
    block = key(1).num_layers * 2 * 16 * HEADS * 64 * 4
    print(f"{args.blocks} blocks of {block / 2**10:.0f} KiB ({args.blocks * block / 2**20:.0f} MiB) per transfer, "
          f"{HEADS} KV heads, {args.runs} runs, {os.cpu_count()} CPUs", flush=True)
    results: dict = {"layout": {f: getattr(key(1), f) for f in key(1).__struct_fields__ if f != "tp"},
                     "blocks": args.blocks, "block_nbytes_tp1": block, "runs": args.runs,
                     "cpus": os.cpu_count(), "backends": {}}
    for backend in args.backends.split(","):
        rows = results["backends"][backend] = {}
        for p_tp, d_tp in PAIRS:
            got = bench_pair(backend, p_tp, d_tp, args.blocks, args.runs)
            rows[f"{p_tp}->{d_tp}"] = got
            line = (f"{got['gbps']:6.2f} GB/s  {got['ms']:7.1f} ms" if isinstance(got, dict) else f"failed: {got}")
            print(f"  {backend:4s} P TP={p_tp} -> D TP={d_tp}: {line}", flush=True)
    print(f"\n{'GB/s (median)':14s}" + "".join(f"{p}->{d:<6d}" for p, d in PAIRS) + "  1->2 / 1->1   2->1 / 2->2")
    for backend, rows in results["backends"].items():
        g = {k: (v["gbps"] if isinstance(v, dict) else float("nan")) for k, v in rows.items()}
        print(f"{backend:14s}" + "".join(f"{g[f'{p}->{d}']:<9.2f}" for p, d in PAIRS)
              + f"  {g['1->2'] / g['1->1']:10.0%}  {g['2->1'] / g['2->2']:10.0%}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtransfer_tp.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS / 'kvtransfer_tp.json'}")
    return 0 if all(isinstance(v, dict) for rows in results["backends"].values() for v in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""How close does each KV transfer backend come to a same-host memory copy? Bandwidth
per backend, sender and receiver in two processes, the copy measured in the same run.

    .venv/bin/python benchmarks/kvtransfer/bench_kvtransfer.py [--runs 7] [--backends tcp,shm,ucx,nccl]

Realistic layout: 30 layers, block 16, 3 KV heads, head dim 64, fp32 (720 KiB per
block). For 1, 16 and 256 blocks it times ``send_blocks`` from call to last
acknowledgement (checksums on both sides, the transport, the receiver's write
into its cache; the one-time connect and the caller's ``pack`` excluded, pack
reported on its own row) and a torch copy of the same number of bytes (one
block, 720 KiB, stays in the CPU cache, so its copy figure is a cache figure).
Each figure is the median of ``--runs``. Writes ``benchmarks/results/kvtransfer.json``
and ``kvtransfer.png``.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from splitserve.benchmarks.harness import RESULTS, stop_receiver
from splitserve.common.kv_backends import backend_spec
from splitserve.kvtransfer import (KVBlockStore, KVLayout, SenderOptions, TransferError,
                                   allocate_kv_cache, free_shared_kv_cache, make_receiver, make_sender)

LAYOUT = KVLayout(dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
SIZES = (1, 16, 256)
NUM_BLOCKS = 264  # per cache: room for the largest transfer


def receiver_main(backend: str, shm_name: str | None, conn) -> None:
    """Child process: a receiver over its own cache until the parent says stop."""
    torch.set_num_threads(1)

    async def main():
        store = KVBlockStore(allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_name), LAYOUT, shm_name=shm_name)
        landed = [0]
        receiver = make_receiver(backend, LAYOUT, store, "127.0.0.1",
                                 lambda tid, dest, ok, reason: landed.__setitem__(0, landed[0] + ok))
        await receiver.start()
        conn.send(receiver.address)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # the stop signal
        await receiver.stop()
        conn.send(landed[0])

    try:
        asyncio.run(main())
    finally:
        if shm_name:
            free_shared_kv_cache(shm_name)


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, runs: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return nbytes / median_time(lambda: dst.copy_(src), runs) / 1e9


def bench_backend(backend: str, store: KVBlockStore, runs: int,
                  options: SenderOptions) -> dict[int, float] | str:
    """GB/s per transfer size, or why the backend could not run."""
    shm_name = f"splitserve-bench-{uuid.uuid4().hex[:8]}" if backend_spec(backend).shm_cache else None
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver_main, args=(backend, shm_name, child))
    proc.start()
    try:
        if not parent.poll(60):
            return "receiver process did not start"
        address = parent.recv()
        sender = make_sender(backend, LAYOUT, options)

        async def transfer_all() -> dict[int, float]:
            out = {}
            await sender.connect(address)
            for n in SIZES:
                blocks = list(zip(range(n), store.split(store.pack(range(n)))))
                await sender.send_blocks(address, "warmup", blocks)
                times = []
                for i in range(runs):
                    start = time.perf_counter()
                    await sender.send_blocks(address, f"t{n}-{i}", blocks)
                    times.append(time.perf_counter() - start)
                out[n] = n * LAYOUT.block_nbytes / statistics.median(times) / 1e9
                print(f"  {backend:4s} {n:4d} blocks: {out[n]:6.2f} GB/s", flush=True)
            await sender.close()
            return out

        try:
            return asyncio.run(transfer_all())
        except TransferError as e:
            return str(e)
    finally:
        stop_receiver(proc, parent, 10)
        if shm_name:
            free_shared_kv_cache(shm_name)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ["memcpy (torch copy)", "pack (gather)"] + [b for b in results["backends"]
                                                       if isinstance(results["backends"][b], dict)]
    series = {"memcpy (torch copy)": results["memcpy_gbps"], "pack (gather)": results["pack_gbps"],
              **results["backends"]}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(SIZES))]
        ax.bar(xs, [series[row][str(n)] for n in SIZES], width, label=row)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(SIZES))])
    ax.set_xticklabels([f"{n} block{'s' * (n > 1)}\n({n * LAYOUT.block_nbytes / 2**20:.1f} MiB)" for n in SIZES])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("KV transfer bandwidth, sender and receiver in separate processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--backends", default="tcp,shm,ucx,nccl")
    ap.add_argument("--frame-mib", type=float, default=None,
                    help="sender frame size in MiB (default: each backend's own)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = KVBlockStore(torch.randn(LAYOUT.cache_shape(NUM_BLOCKS)), LAYOUT)
    print(f"layout {LAYOUT}, {LAYOUT.block_nbytes / 2**10:.0f} KiB per block, {args.runs} runs each",
          flush=True)
    memcpy, pack = {}, {}
    for n in SIZES:
        nbytes = n * LAYOUT.block_nbytes
        memcpy[str(n)] = copy_bandwidth(nbytes, args.runs)
        out = torch.empty(n, *LAYOUT.block_shape)
        store.pack(range(n), out=out)
        pack[str(n)] = nbytes / median_time(lambda: store.pack(range(n), out=out), args.runs) / 1e9
        print(f"  memcpy {n:4d} blocks: {memcpy[str(n)]:6.2f} GB/s   pack: {pack[str(n)]:6.2f} GB/s", flush=True)
    backends = {}
    for backend in args.backends.split(","):
        print(f"{backend}:", flush=True)
        got = bench_backend(backend, store, args.runs,
                            SenderOptions(max_frame_bytes=args.frame_mib and int(args.frame_mib * 2**20)))
        backends[backend] = {str(n): v for n, v in got.items()} if isinstance(got, dict) else got
        if isinstance(got, str):
            print(f"  {backend} failed: {got}", flush=True)
    results = {"layout": {f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__},
               "block_nbytes": LAYOUT.block_nbytes, "runs": args.runs, "frame_mib": args.frame_mib, "sizes": list(SIZES),
               "memcpy_gbps": memcpy, "pack_gbps": pack, "backends": backends}

    print(f"\n{'GB/s (median)':24s}" + "".join(f"{n:>10d} blk" for n in SIZES))
    for name, row in [("memcpy", memcpy), ("pack", pack), *backends.items()]:
        if isinstance(row, dict):
            cells = "".join(f"{row[str(n)]:14.2f}" for n in SIZES)
            print(f"{name:24s}{cells}")
    for name, row in backends.items():
        if isinstance(row, dict):
            print(f"{name + ' / memcpy':24s}" + "".join(f"{row[str(n)] / memcpy[str(n)]:13.0%} " for n in SIZES))

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtransfer.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "kvtransfer.png")
    print(f"wrote {RESULTS / 'kvtransfer.json'} and kvtransfer.png")
    return 0 if all(isinstance(r, dict) for r in backends.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""How fast does KV leave GPU memory, against the device's own copy rate? On one GPU: the
device copy bandwidth, the pack (gather) and wsum32_v1 checksum rates on the device, and
the transfer rate of a prefill process's pool into a decode process's pool over ipc (CUDA
IPC, device to device) and tcp (pinned host staging on both sides), each in GB/s and as a
fraction of the device copy rate.

    .venv/bin/python benchmarks/gpu/bench_gpu_transfer.py [--device cuda:0] [--runs 7] [--backends ipc,tcp] [--out F]
    .venv/bin/python benchmarks/gpu/bench_gpu_transfer.py --smoke --out /tmp/x.json   # CPU, seconds

Layout: the bundled model's (30 layers, block 16, 3 KV heads, head dim 64) in bf16 on a
GPU, 360 KiB per block. A transfer of n blocks is timed from ``pack`` (the gather in the
sender's pool) to the last acknowledgement (checksums on the device on both sides, the
transport, the landing in the receiver's pool); the receiver is a separate process, as a
decode node is. Figures are medians of ``--runs`` (fewer runs: a shorter stage). Writes
``--out`` (default ``benchmarks/results/gpu_transfer.json``; gpu/contract.py's "environment"
and "targets", the latter empty: no numeric target) after the device rates and after
each backend. ``--smoke`` runs the same code on the CPU with small sizes (tcp only: ipc
needs CUDA) so a test keeps the script working where no GPU is.
"""

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

from splitserve.benchmarks.gpu.contract import environment, write_json
from splitserve.benchmarks.harness import RESULTS, stop_receiver, sync
from splitserve.kvtransfer import KVBlockStore, KVLayout, SenderOptions, TransferError, make_receiver, make_sender
from splitserve.kvtransfer.checksum import wsum

SIZES: tuple[int, ...] = (16, 128, 512)  # blocks: 256, 2k and 8k tokens
SMOKE_SIZES: tuple[int, ...] = (1, 8)


def layout_for(device: str) -> KVLayout:
    dtype = "float32" if device == "cpu" else "bfloat16"
    return KVLayout(dtype=dtype, block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


def median_time(fn, runs: int, device: str) -> float:
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_store(layout: KVLayout, num_blocks: int, device: str) -> KVBlockStore:
    cache = torch.randn(layout.cache_shape(num_blocks), device=device).to(getattr(torch, layout.dtype))
    return KVBlockStore(cache, layout)  # wsum32_v1 on a GPU, xxh3 on the CPU (the nodes' defaults)


def receiver_main(backend: str, device: str, num_blocks: int, conn) -> None:
    """Child process, a decode node's half: a receiver over its own pool until told to stop."""
    torch.set_num_threads(1)

    async def main():
        layout = layout_for(device)
        store = KVBlockStore(torch.zeros(layout.cache_shape(num_blocks), dtype=getattr(torch, layout.dtype),
                                         device=device), layout)
        landed = [0]
        receiver = make_receiver(backend, layout, store, "127.0.0.1",
                                 lambda tid, dest, ok, reason: landed.__setitem__(0, landed[0] + ok))
        await receiver.start()
        conn.send(receiver.address)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the stop signal
        await receiver.stop()
        conn.send(landed[0])

    try:
        asyncio.run(main())
    except Exception as e:  # tell the parent why (e.g. no CUDA for ipc)
        conn.send(f"error: {type(e).__name__}: {e}")


def bench_backend(backend: str, store: KVBlockStore, device: str, sizes, runs: int) -> dict:
    """GB/s per transfer size (pack to last ack), or {"error": why}."""
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver_main, args=(backend, device, store.num_blocks, child))
    proc.start()
    try:
        if not parent.poll(120):
            return {"error": "receiver process did not start"}
        address = parent.recv()
        if address.startswith("error:"):
            return {"error": address}
        sender = make_sender(backend, store.layout, SenderOptions(connect_timeout_s=30), device=device)

        async def transfer_all() -> dict:
            out = {}
            await sender.connect(address)
            for n in sizes:
                async def once(tid):
                    await sender.send_blocks(address, tid, list(zip(range(n), store.split(store.pack(range(n))))))
                await once("warmup")
                times = []
                for i in range(runs):
                    start = time.perf_counter()
                    await once(f"t{n}-{i}")
                    times.append(time.perf_counter() - start)
                out[str(n)] = n * store.layout.block_nbytes / statistics.median(times) / 1e9
                print(f"  {backend:4s} {n:4d} blocks: {out[str(n)]:7.2f} GB/s", flush=True)
            await sender.close()
            return out

        try:
            return asyncio.run(transfer_all())
        except TransferError as e:
            return {"error": str(e)}
    finally:
        stop_receiver(proc, parent, 20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--backends", default="ipc,tcp")
    ap.add_argument("--smoke", action="store_true", help="CPU, small sizes, one run: checks the script")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_transfer.json)")
    args = ap.parse_args(argv)
    device, sizes, runs, backends = args.device, SIZES, args.runs, args.backends.split(",")
    if args.smoke:
        device, sizes, runs, backends = "cpu", SMOKE_SIZES, 1, ["tcp"]
    elif not torch.cuda.is_available():
        print("error: no CUDA device; use --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    layout = layout_for(device)
    store = random_store(layout, max(sizes), device)
    copy_bytes = (64 << 20) if args.smoke else (1 << 30)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbps = copy_bytes / median_time(lambda: dst.copy_(src), runs, device) / 1e9
    del src, dst
    n = max(sizes)
    nbytes = n * layout.block_nbytes
    pack_gbps = nbytes / median_time(lambda: store.pack(range(n)), runs, device) / 1e9
    blocks = store.kv_caches.permute(2, 0, 1, 3, 4, 5)[:n].contiguous()  # [n, *block_shape], packed
    wsum_gbps = nbytes / median_time(lambda: wsum(blocks, layout), runs, device) / 1e9
    print(f"{device}: copy {copy_gbps:.1f} GB/s, pack {pack_gbps:.1f} GB/s, wsum32_v1 {wsum_gbps:.1f} GB/s "
          f"({n} blocks of {layout.block_nbytes} bytes)", flush=True)
    results = {"environment": environment(device), "targets": [], "smoke": args.smoke,
               "layout": msgspec.structs.asdict(layout), "block_nbytes": layout.block_nbytes, "runs": runs,
               "copy_gbps": copy_gbps, "pack_gbps": pack_gbps, "wsum_gbps": wsum_gbps,
               "pack_over_copy": pack_gbps / copy_gbps, "backends": {}, "transfer_over_copy": {}}
    out = Path(args.out) if args.out else RESULTS / "gpu_transfer.json"
    write_json(out, results)
    for b in backends:
        got = results["backends"][b] = bench_backend(b, store, device, sizes, runs)
        if "error" not in got:  # blocks -> transfer GB/s / device copy GB/s
            results["transfer_over_copy"][b] = {n: gbps / copy_gbps for n, gbps in got.items()}
        write_json(out, results)
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in results["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

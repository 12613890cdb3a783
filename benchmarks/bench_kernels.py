"""Paged decode attention on a GPU: achieved K/V bandwidth against the device's peak,
and time against torch (the reference backend's gather + SDPA, and SDPA alone over
K/V gathered beforehand, i.e. a contiguous cache).

    .venv/bin/python benchmarks/bench_kernels.py [--quick] [--backends cuda,triton]

One layer of a Llama-3-8B-shaped cache (32 query heads, 8 KV heads, head dim 128,
bf16, blocks of 16), every sequence at the same context length, its blocks shuffled
across the pool. For each context length (512 .. 32k) and batch size (1 .. 64):

    bandwidth = bytes of K and V the sequences hold / time of one call

Peak: the device's datasheet HBM bandwidth (PEAK_TB_S, by device name) next to a
measured device-to-device copy (bytes read + written / time). Calls cycle through
disjoint block sets of at least 256 MiB in all, so small cases do not run from L2.
Each kernel's output is checked against the torch reference before it is timed.
Writes benchmarks/results/kernels.json and kernels.png. Without CUDA it says so and
exits 0, writing nothing.

Engine decode tokens/s on a GPU against transformers: bench_engine.py --device cuda.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
# Substring of torch.cuda.get_device_name() -> HBM bandwidth in TB/s (vendor datasheets), most specific first.
PEAK_TB_S = [("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039),
             ("A100 80GB PCIe", 1.935), ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10G", 0.6),
             ("A10", 0.6), ("RTX 4090", 1.008)]
NUM_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DEVICE = "cuda"
COLD_BYTES = 256 << 20  # K/V touched across the rotating block sets: several times any GPU's L2
SCALE = HEAD_DIM ** -0.5


def peak_from_table(name: str) -> float | None:
    return next((tb for key, tb in PEAK_TB_S if key in name), None)


def time_us(fn, calls: int) -> float:
    """Median over 5 runs of the mean time of one call, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(runs)


def measured_copy_tb_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (us * 1e-6) / 1e12  # read + write


class Case:
    """Paged K/V of ``batch`` sequences of ``context`` tokens, in ``sets`` disjoint block sets."""

    def __init__(self, batch: int, context: int):
        blocks = context // BLOCK_SIZE
        self.batch, self.context = batch, context
        self.kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V
        self.sets = max(1, min(64, -(-COLD_BYTES // self.kv_bytes)))
        num_blocks = self.sets * batch * blocks
        self.kv = torch.randn((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
        order = torch.randperm(num_blocks, device=DEVICE)
        self.tables = list(order.view(self.sets, batch, blocks))  # [batch, blocks] each
        self.seq_lens = torch.full((batch,), context, dtype=torch.long, device=DEVICE)
        self.q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
        self.out = torch.empty_like(self.q)
        self.turn = 0

    def next_set(self) -> int:
        """The block set of the next call (round robin)."""
        self.turn = (self.turn + 1) % self.sets
        return self.turn

    def meta(self, table):
        from splitserve.engine.attention.base import AttentionMetadata

        return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE), num_decodes=self.batch,
                                 decode_block_tables=table, decode_seq_lens=self.seq_lens, decode_mask=None,
                                 prefills=[])  # every row full: no mask

    def gathered(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one block set as [batch, kv_heads, context, head_dim], contiguous."""
        shape = (self.batch, self.context, KV_HEADS, HEAD_DIM)
        return tuple(self.kv[i][table.flatten()].view(shape).transpose(1, 2).contiguous() for i in (0, 1))


def run_case(case: Case, kernels: dict, num_sms: int) -> dict:
    from splitserve.engine.attention.partition import decode_partition_size
    from splitserve.engine.attention.torch_backend import TorchAttention

    torch_backend = TorchAttention()
    metas = [case.meta(t) for t in case.tables]
    reference = torch.empty_like(case.q)
    torch_backend.decode(case.q, case.kv, metas[0], reference)
    size = decode_partition_size(case.batch, KV_HEADS, case.context, BLOCK_SIZE, num_sms)
    row = {"context": case.context, "batch": case.batch, "kv_bytes": case.kv_bytes, "block_sets": case.sets,
           "partition_size": size}

    def record(name, fn, calls):
        us = time_us(fn, calls)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_tb_s"] = round(case.kv_bytes / (us * 1e-6) / 1e12, 3)

    calls = max(5, min(200, int(2e9 // case.kv_bytes)))  # ~2 GB of K/V per timed run
    for name, kernel in kernels.items():
        def call(kernel=kernel):
            table = case.tables[case.next_set()]
            kernel(case.out, case.q, case.kv[0], case.kv[1], table, case.seq_lens, scale=SCALE, partition_size=size)
        case.turn = case.sets - 1  # the next call uses set 0, as the reference did
        call()
        torch.testing.assert_close(case.out.float(), reference.float(), atol=1.6e-2, rtol=1.6e-2)
        record(name, call, calls)

    record("torch", lambda: torch_backend.decode(case.q, case.kv, metas[case.next_set()], case.out), calls)
    gathered = [case.gathered(t) for t in case.tables]
    q4 = case.q.view(case.batch, KV_HEADS, NUM_HEADS // KV_HEADS, HEAD_DIM)  # query heads folded per KV head
    record("sdpa", lambda: F.scaled_dot_product_attention(q4, *gathered[case.next_set()]), calls)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 512, 4k, 32k and batches 1, 64 only")
    ap.add_argument("--backends", default="cuda,triton", help="comma-separated: cuda, triton")
    ap.add_argument("--out", default=str(RESULTS / "kernels.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here (torch.cuda.is_available() is False); it measures GPU "
              "kernels, so there is nothing to run. Nothing written.")
        return 0

    kernels = {}
    for name in args.backends.split(","):
        if name == "cuda":
            from splitserve.csrc import ops
            from splitserve.csrc.build import load_ops

            load_ops()
            kernels["cuda"] = ops.paged_decode_attention
        elif name == "triton":
            from splitserve.engine.attention import triton_kernels

            kernels["triton"] = triton_kernels.paged_decode_attention
        else:
            ap.error(f"--backends: unknown backend {name!r}; use cuda, triton")

    props = torch.cuda.get_device_properties(0)
    device = torch.cuda.get_device_name(0)
    peak, copy = peak_from_table(device), measured_copy_tb_s()
    print(f"{device}: datasheet peak {peak if peak else 'unknown'} TB/s, measured copy {copy:.2f} TB/s, "
          f"{props.multi_processor_count} SMs", flush=True)
    contexts = [512, 4096, 32768] if args.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    batches = [1, 64] if args.quick else [1, 4, 16, 64]
    rows = []
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                case = Case(batch, context)
                row = run_case(case, kernels, props.multi_processor_count)
                del case
                torch.cuda.empty_cache()
                for name in kernels:
                    if peak:
                        row[f"{name}_pct_peak"] = round(100 * row[f"{name}_tb_s"] / peak, 1)
                    row[f"{name}_pct_copy"] = round(100 * row[f"{name}_tb_s"] / copy, 1)
                    row[f"{name}_speedup_vs_torch"] = round(row["torch_us"] / row[f"{name}_us"], 2)
                    row[f"{name}_speedup_vs_sdpa"] = round(row["sdpa_us"] / row[f"{name}_us"], 2)
                rows.append(row)
                print("  ".join([f"ctx {context:6d} x{batch:<3d}"] + [
                    f"{name} {row[f'{name}_us']:9.1f} us {row[f'{name}_tb_s']:5.2f} TB/s" for name in kernels] + [
                    f"torch {row['torch_us']:9.1f} us", f"sdpa {row['sdpa_us']:9.1f} us"]), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device, "peak_tb_s_datasheet": peak, "copy_tb_s_measured": round(copy, 3),
        "shape": {"num_heads": NUM_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                  "dtype": str(DTYPE).removeprefix("torch.")},
        "torch": torch.__version__, "rows": rows}, indent=2))
    plot(rows, list(kernels), peak, copy, device, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(rows, names, peak, copy, device, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = sorted({r["batch"] for r in rows})
    for name, style in zip(names, ("-", "--")):
        for b in batches:
            sel = [r for r in rows if r["batch"] == b]
            x = [r["context"] for r in sel]
            bw.plot(x, [r[f"{name}_tb_s"] for r in sel], style, marker="o", label=f"{name} x{b}")
            speed.plot(x, [r[f"{name}_speedup_vs_sdpa"] for r in sel], style, marker="o", label=f"{name} x{b}")
    if peak:
        bw.axhline(peak, color="k", linewidth=1, label=f"datasheet {peak} TB/s")
    bw.axhline(copy, color="gray", linestyle=":", label=f"measured copy {copy:.2f} TB/s")
    speed.axhline(1, color="k", linewidth=1)
    for ax in (bw, speed):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.legend(fontsize=7)
    bw.set_title(f"paged decode K/V bandwidth, TB/s ({device})")
    speed.set_title("speedup over SDPA on pre-gathered K/V (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

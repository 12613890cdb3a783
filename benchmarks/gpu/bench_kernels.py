"""Does paged decode attention read K/V near the device's bandwidth, and is it as fast as
torch's SDPA? Achieved K/V bandwidth against the device's peak, and time against torch
(the reference backend's gather + SDPA, and SDPA alone over K/V gathered beforehand, i.e.
a contiguous cache).

    .venv/bin/python benchmarks/gpu/bench_kernels.py [--quick] [--backends cuda,triton] [--out F]
    .venv/bin/python benchmarks/gpu/bench_kernels.py --smoke --out /tmp/k.json   # CPU, seconds

One layer of a Llama-3-8B-shaped cache (32 query heads, 8 KV heads, head dim 128,
bf16, blocks of 16), every sequence at the same context length, its blocks shuffled
across the pool. For each context length (512 .. 32k) and batch size (1 .. 64):

    bandwidth = bytes of K and V the sequences hold / time of one call

Peak: the device's datasheet HBM bandwidth (PEAK_TB_S, by device name) next to a
measured device-to-device copy (bytes read + written / time). Calls cycle through
disjoint block sets of at least 256 MiB in all, so small cases do not run from L2.
Each kernel's output is checked against the torch reference before it is timed.

Targets (gpu/contract.py's TARGETS), for the backend ``--attention-backend auto`` picks on
CUDA (the CUDA kernels, else Triton): >= 80% of the measured copy at the largest
context and batch, and no slower than SDPA on pre-gathered K/V at the smallest context
(512), every batch. A backend that fails to build or load is recorded and left out.
Writes benchmarks/results/kernels.json (after every case) and kernels.png. Without CUDA
it says so and exits 0, writing nothing.

``--smoke``: the same code on the CPU at tiny sizes, timed by perf_counter, the Triton
kernel run by its interpreter (TRITON_INTERPRET=1) when triton imports.

Engine decode tokens/s on a GPU against transformers: bench_gpu_engine.py.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F

from splitserve.benchmarks.gpu.contract import environment, target_row, write_json
from splitserve.benchmarks.harness import RESULTS

# Substring of torch.cuda.get_device_name() -> HBM bandwidth in TB/s (vendor datasheets), most specific first.
PEAK_TB_S = [("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039),
             ("A100 80GB PCIe", 1.935), ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10G", 0.6),
             ("A10", 0.6), ("RTX 4090", 1.008)]
NUM_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
SCALE = HEAD_DIM ** -0.5
AUTO_ORDER = ("cuda", "triton")  # what --attention-backend auto tries on CUDA (engine/attention/selector.py)


class KernelsResult(TypedDict):
    """kernels.json: contract.py's top level, the run's setup, and one row per case."""
    environment: dict
    mode: str  # smoke, quick or full
    targets: list[dict]
    auto_backend: str | None  # None: neither backend loaded
    backend_errors: dict[str, str]  # backend -> why it is left out
    peak_tb_s_datasheet: float | None  # None: the device is not in PEAK_TB_S
    copy_tb_s_measured: float
    shape: dict[str, int | str]
    rows: list[dict]  # run_case's rows, with the ratios main adds


class Plan:
    """Sizes of a run: the full GPU sweep, --quick, or the CPU --smoke."""

    def __init__(self, quick: bool, smoke: bool):
        self.device = "cpu" if smoke else "cuda"
        if smoke:
            self.contexts, self.batches = [64, 256], [1, 2]
        elif quick:
            self.contexts, self.batches = [512, 4096, 32768], [1, 64]
        else:
            self.contexts, self.batches = [512, 1024, 2048, 4096, 8192, 16384, 32768], [1, 4, 16, 64]
        self.cold_bytes = (1 << 20) if smoke else (256 << 20)  # K/V across the rotating sets: several L2s
        self.copy_bytes = (16 << 20) if smoke else (1 << 30)
        self.runs, self.warmup = (1, 0) if smoke else (5, 3)  # timed runs (median), untimed calls first
        self.max_calls = 1 if smoke else 200  # calls per timed run (at most); the interpreter is slow


def peak_from_table(name: str) -> float | None:
    return next((tb for key, tb in PEAK_TB_S if key in name), None)


def time_us(fn, calls: int, plan: Plan) -> float:
    """Median over ``plan.runs`` runs of the mean time of one call: CUDA events on a GPU,
    perf_counter on the CPU."""
    for _ in range(plan.warmup):
        fn()
    cuda = plan.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    runs = []
    for _ in range(plan.runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1000 / calls)
        else:
            runs.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(runs)


def measured_copy_tb_s(plan: Plan) -> float:
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 10, plan)
    return 2 * src.numel() / (us * 1e-6) / 1e12  # read + write


class Case:
    """Paged K/V of ``batch`` sequences of ``context`` tokens, in ``sets`` disjoint block sets."""

    def __init__(self, batch: int, context: int, plan: Plan):
        blocks = context // BLOCK_SIZE
        self.batch, self.context, self.device = batch, context, plan.device
        self.kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V
        self.sets = max(1, min(64, -(-plan.cold_bytes // self.kv_bytes)))
        num_blocks = self.sets * batch * blocks
        self.kv = torch.randn((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=self.device)
        order = torch.randperm(num_blocks, device=self.device)
        self.tables = list(order.view(self.sets, batch, blocks))  # [batch, blocks] each
        self.seq_lens = torch.full((batch,), context, dtype=torch.long, device=self.device)
        self.q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=self.device)
        self.out = torch.empty_like(self.q)
        self.turn = 0

    def next_set(self) -> int:
        """The block set of the next call (round robin)."""
        self.turn = (self.turn + 1) % self.sets
        return self.turn

    def meta(self, table):
        from splitserve.engine.attention.base import AttentionMetadata

        return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=self.device),
                                 num_decodes=self.batch, decode_block_tables=table, decode_seq_lens=self.seq_lens,
                                 decode_mask=None, prefills=[])  # every row full: no mask

    def gathered(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one block set as [batch, kv_heads, context, head_dim], contiguous."""
        shape = (self.batch, self.context, KV_HEADS, HEAD_DIM)
        k, v = (self.kv[i][table.flatten()].view(shape).transpose(1, 2).contiguous() for i in (0, 1))
        return k, v


def run_case(case: Case, kernels: dict, plan: Plan, num_sms: int) -> dict:
    """One context x batch: every kernel checked against the torch reference, then timed,
    then torch and SDPA timed. A kernel that fails or does not match gets ``<name>_error``."""
    from splitserve.engine.attention.partition import decode_partition_size
    from splitserve.engine.attention.torch_backend import TorchAttention

    torch_backend = TorchAttention()
    metas = [case.meta(t) for t in case.tables]
    reference = torch.empty_like(case.q)
    torch_backend.decode(case.q, case.kv, metas[0], reference)
    size = decode_partition_size(case.batch, KV_HEADS, case.context, BLOCK_SIZE, num_sms)
    row: dict[str, float | str] = {"context": case.context, "batch": case.batch, "kv_bytes": case.kv_bytes,
                                   "block_sets": case.sets, "partition_size": size}

    def record(name, fn, calls):
        us = time_us(fn, calls, plan)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_tb_s"] = case.kv_bytes / (us * 1e-6) / 1e12

    calls = max(1, min(plan.max_calls, int(2e9 // case.kv_bytes)))  # ~2 GB of K/V per timed run
    if plan.device.startswith("cuda"):
        calls = max(5, calls)
    for name, kernel in kernels.items():
        def call(kernel=kernel):
            table = case.tables[case.next_set()]
            kernel(case.out, case.q, case.kv[0], case.kv[1], table, case.seq_lens, scale=SCALE, partition_size=size)
        case.turn = case.sets - 1  # the next call uses set 0, as the reference did
        try:  # a kernel that fails to compile or to match is recorded; the others still run
            call()
            torch.testing.assert_close(case.out.float(), reference.float(), atol=1.6e-2, rtol=1.6e-2)
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"error: {name} at ctx {case.context} x{case.batch}: {row[f'{name}_error']}", file=sys.stderr)
            continue
        record(name, call, calls)

    record("torch", lambda: torch_backend.decode(case.q, case.kv, metas[case.next_set()], case.out), calls)
    gathered = [case.gathered(t) for t in case.tables]
    q4 = case.q.view(case.batch, KV_HEADS, NUM_HEADS // KV_HEADS, HEAD_DIM)  # query heads folded per KV head
    record("sdpa", lambda: F.scaled_dot_product_attention(q4, *gathered[case.next_set()]), calls)
    return row


def load_kernels(names: list[str], device: str) -> tuple[dict, dict[str, str]]:
    """({backend: paged_decode_attention}, {backend: why it is missing}) for ``names``."""
    kernels, errors = {}, {}
    for name in names:
        try:
            if name == "cuda":
                if not device.startswith("cuda"):
                    raise RuntimeError("the CUDA kernels need a GPU")
                from splitserve.csrc import ops
                from splitserve.csrc.build import load_ops

                load_ops()  # raises CsrcBuildError (a RuntimeError) when they cannot be built
                kernels["cuda"] = ops.paged_decode_attention
            elif name == "triton":
                from splitserve.engine.attention import triton_kernels

                kernels["triton"] = triton_kernels.paged_decode_attention
            else:
                raise ValueError(f"unknown backend {name!r}; use cuda, triton")
        except (ImportError, RuntimeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"bench_kernels: {name} left out: {errors[name]}", file=sys.stderr, flush=True)
    return kernels, errors


def targets(rows: list[dict], auto: str | None, plan: Plan) -> list[dict]:
    """The two kernel targets, for the ``auto`` backend, at the plan's extreme sizes."""
    big, small = max(plan.contexts), min(plan.contexts)
    top = next((r for r in rows if r["context"] == big and r["batch"] == max(plan.batches)), None)
    pct = top.get(f"{auto}_pct_copy") if top and auto else None
    short = [r for r in rows if r["context"] == small]
    speedups = [s for r in short if (s := r.get(f"{auto}_speedup_vs_sdpa")) is not None]
    every = auto is not None and len(short) == len(plan.batches) and len(speedups) == len(short)
    return [target_row("paged_attention_pct_of_copy", pct, f"ctx{big}_b{max(plan.batches)}"),
            target_row("paged_attention_speedup_vs_sdpa", min(speedups) if every else None, f"ctx{small}")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 512, 4k, 32k and batches 1, 64 only")
    ap.add_argument("--smoke", action="store_true", help="CPU, contexts 64 and 256, batches 1 and 2")
    ap.add_argument("--backends", default="cuda,triton", help="comma-separated: cuda, triton")
    ap.add_argument("--out", default=None, help="JSON path (default results/kernels.json; temp folder with --smoke)")
    args = ap.parse_args(argv)
    plan = Plan(args.quick, args.smoke)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton decorates the kernels: before their import
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here (torch.cuda.is_available() is False); it measures GPU "
              "kernels, so there is nothing to run (--smoke runs it on the CPU). Nothing written.")
        return 0
    out = Path(args.out or (Path(tempfile.gettempdir()) / "kernels_smoke.json" if args.smoke
                            else RESULTS / "kernels.json"))

    kernels, errors = load_kernels(args.backends.split(","), plan.device)
    auto = next((name for name in AUTO_ORDER if name in kernels), None)
    if plan.device == "cpu":
        device_name, num_sms = "cpu", os.cpu_count() or 1  # num_sms: sizes the split-K partitions
    else:
        device_name = torch.cuda.get_device_name(0)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak, copy = peak_from_table(device_name), measured_copy_tb_s(plan)
    print(f"{device_name}: datasheet peak {peak if peak else 'unknown'} TB/s, measured copy {copy:.2f} TB/s, "
          f"{num_sms} SMs; kernels {list(kernels)}, auto picks {auto}", flush=True)
    result: KernelsResult = {
        "environment": environment(plan.device), "mode": "smoke" if args.smoke else "quick" if args.quick
        else "full", "targets": [], "auto_backend": auto, "backend_errors": errors,
        "peak_tb_s_datasheet": peak, "copy_tb_s_measured": round(copy, 4),
        "shape": {"num_heads": NUM_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": str(DTYPE).removeprefix("torch.")},
        "rows": []}
    rows = result["rows"]
    result["targets"] = targets(rows, auto, plan)
    write_json(out, result)  # a stage cut short still leaves the environment and the errors
    with torch.inference_mode():
        for context in plan.contexts:
            for batch in plan.batches:
                case = Case(batch, context, plan)
                row = run_case(case, kernels, plan, num_sms)
                del case
                if plan.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                timed = [name for name in kernels if f"{name}_us" in row]
                for name in timed:
                    if peak:
                        row[f"{name}_pct_peak"] = round(100 * row[f"{name}_tb_s"] / peak, 3)
                    row[f"{name}_pct_copy"] = round(100 * row[f"{name}_tb_s"] / copy, 3)
                    row[f"{name}_speedup_vs_torch"] = round(row["torch_us"] / row[f"{name}_us"], 4)
                    row[f"{name}_speedup_vs_sdpa"] = round(row["sdpa_us"] / row[f"{name}_us"], 4)
                rows.append(row)
                result["targets"] = targets(rows, auto, plan)
                write_json(out, result)
                print("  ".join([f"ctx {context:6d} x{batch:<3d}"] + [
                    f"{name} {row[f'{name}_us']:9.1f} us {row[f'{name}_tb_s']:5.2f} TB/s" for name in timed] + [
                    f"torch {row['torch_us']:9.1f} us", f"sdpa {row['sdpa_us']:9.1f} us"]), flush=True)

    plot(rows, list(kernels), peak, copy, device_name, out.with_suffix(".png"))
    for t in result["targets"]:
        print(f"target {t['name']}: {t['value']} {t['op']} {t['target']}: {t['met']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(rows, names, peak, copy, device_name, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = sorted({r["batch"] for r in rows})
    for name, style in zip(names, ("-", "--")):
        for b in batches:
            sel = [r for r in rows if r["batch"] == b and f"{name}_us" in r]
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
    bw.set_title(f"paged decode K/V bandwidth, TB/s ({device_name})")
    speed.set_title("speedup over SDPA on pre-gathered K/V (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""How close is a MoE decode step to the weight-read floor of the experts it reads? The
shipped MoE shapes (model_configs/qwen3-30b-a3b, mixtral-8x7b) with random weights
(``load_format="dummy"``), bf16, one GPU, static decode (CUDA graphs of exactly the
measured batches, async scheduling), at batch 1 and 64:

    floor(B) = (dense bytes + sum over MoE layers l of read_l(B) * one expert's bytes) / copy bandwidth

dense bytes: every weight but the experts' stacks (w13, w2) and, when not tied to the
head, the embedding table (only the batch's rows of it are read). read_l(B): the experts
of layer l that got a token in the last decode step's forward (MoEBlock.expert_tokens,
filled by the CUDA graph's replay too), or, when no layer counted any token, the
expectation under uniform routing E * (1 - (1 - k/E)^B) (``counted``: "routing" or
"expected"). Copy bandwidth: (bytes read + written) / time of a device-to-device copy,
measured in this run. A shape whose weights, KV pool and ``HEADROOM`` do not fit the
device's free memory (torch.cuda.mem_get_info) is skipped with the reason (Mixtral-8x7B,
93 GB in bf16, on an 80 GB H100).

    .venv/bin/python -m splitserve.benchmarks.gpu.bench_gpu_moe [--shapes qwen3-30b-a3b,mixtral-8x7b] [--out F]
    .venv/bin/python -m splitserve.benchmarks.gpu.bench_gpu_moe --smoke   # CPU, each shape shrunk: proves it runs

Top level: "environment" and "targets" (gpu/contract.py: ``moe_decode_step_over_floor``
per shape and batch), rewritten after every figure. ``--device cuda`` without CUDA says
so and exits 0, writing nothing. Writes ``benchmarks/results/gpu_moe.json`` (the temp
folder's ``gpu_moe_smoke.json`` with --smoke).
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from splitserve.benchmarks.gpu.contract import environment, target_row, write_json
from splitserve.benchmarks.harness import RESULTS, copy_bandwidth, engine_decode, token_prompts
from splitserve.common.roofline import expected_experts

CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"
SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b")
HEADROOM = 6 << 30  # bytes beyond weights and KV: activations, CUDA graphs, the allocator's slack
# --smoke: each shape at these sizes (its routing fields kept, at most SMOKE_EXPERTS experts)
SMOKE_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=96, moe_intermediate_size=32, vocab_size=300, max_position_embeddings=256)
SMOKE_EXPERTS = 16


def floor_seconds(dense_bytes: int, expert_bytes: list[int], experts_read: list[float], bandwidth: float) -> float:
    """Seconds to read the dense weights and, for each MoE layer, its read experts (``experts_read[l]``
    of ``expert_bytes[l]`` bytes each) at ``bandwidth`` bytes/s."""
    assert len(expert_bytes) == len(experts_read)
    return (dense_bytes + sum(n * b for n, b in zip(experts_read, expert_bytes))) / bandwidth


def memory_needed(total_params: int, itemsize: int, kv_bytes: int) -> int:
    """Bytes a shape needs on the device: its weights, its KV pool and HEADROOM."""
    return total_params * itemsize + kv_bytes + HEADROOM


def shape_config(name: str, smoke: bool) -> dict:
    """The config.json of shape ``name``; with ``smoke`` shrunk to SMOKE_SIZES."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    if not smoke:
        return config
    experts = {k: min(config[k], SMOKE_EXPERTS) for k in ("num_experts", "num_local_experts") if k in config}
    return config | SMOKE_SIZES | experts


def weight_split(model) -> tuple[int, list[int]]:
    """(dense bytes a step reads, one expert's bytes per MoE layer in layer order)."""
    from splitserve.engine.models.moe import MoEBlock

    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    stacks = sum(p.numel() * p.element_size() for b in blocks for p in (b.w13, b.w2))
    table = model.embed_tokens.weight
    embed = 0 if model.cfg.tie_word_embeddings else table.numel() * table.element_size()
    per_expert = [(b.w13[0].numel() + b.w2[0].numel()) * b.w13.element_size() for b in blocks]
    return total - stacks - embed, per_expert


def routed(model) -> list[int]:
    """Experts with at least one token in each MoE layer's last forward (one host copy)."""
    from splitserve.engine.models.moe import MoEBlock

    counts = torch.stack([m.expert_tokens for m in model.modules() if isinstance(m, MoEBlock)]).cpu()
    return (counts > 0).sum(dim=1).tolist()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_shape(args, name: str, bandwidth: float, out: dict, save) -> None:
    """Fills ``out`` (one shape's record) figure by figure, ``save()`` after each."""
    from splitserve.common.config import EngineConfig
    from splitserve.engine.engine_core import EngineCore
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.models.families import family_of, model_config

    config = shape_config(name, args.smoke)
    cfg = model_config(config)
    assert cfg.moe is not None, f"{name}: not a MoE config"
    experts, top_k = cfg.moe.num_experts, cfg.moe.top_k
    counts = family_of(cfg.architecture).parameters(cfg)
    itemsize = getattr(torch, args.dtype).itemsize
    out.update(params_total=counts.total, params_active=counts.active, experts=experts, top_k=top_k)
    if args.device.startswith("cuda"):
        free_b, total_b = torch.cuda.mem_get_info(args.device)
        need = memory_needed(counts.total, itemsize, args.kv_cache_memory)
        if need > free_b:
            out["skipped"] = (f"needs {need / 2**30:.1f} GiB (weights {counts.total * itemsize / 2**30:.1f}, KV "
                              f"{args.kv_cache_memory / 2**30:.1f}, headroom {HEADROOM / 2**30:.0f}); "
                              f"{free_b / 2**30:.1f} GiB free of {total_b / 2**30:.1f} on this device")
            print(f"{name}: skipped: {out['skipped']}", flush=True)
            save()
            return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        engine = EngineCore(EngineConfig(
            model=tmp, load_format="dummy", device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
            cuda_graph_sizes=tuple(args.batches), max_num_batched_tokens=2048, prefill_chunk_size=2048,
            enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len))
        assert isinstance(engine.runner, ModelRunner), "a real (not simulated) engine"
        model = engine.runner.model
        dense, per_expert = weight_split(model)
        out.update(dense_bytes=dense, expert_bytes=per_expert[0] if per_expert else 0, moe_layers=len(per_expert))
        for n in args.batches:
            times = [t for run in range(args.runs) for t in
                     engine_decode(engine, token_prompts(n, args.prompt_len, cfg.vocab_size, 10 * n + run),
                                   args.steps)]
            read: list[float] = [float(r) for r in routed(model)]
            counted = "routing" if any(read) else "expected"
            if not any(read):
                read = [expected_experts(experts, top_k, n)] * len(per_expert)
            step_ms = statistics.median(times) * 1e3
            floor_ms = floor_seconds(dense, per_expert, read, bandwidth) * 1e3
            out[f"b{n}"] = dict(step_ms=round(step_ms, 3), tok_s=round(n / statistics.median(times), 1),
                                experts_read_per_layer=round(statistics.mean(read), 2), counted=counted,
                                experts_read_expected=round(expected_experts(experts, top_k, n), 2),
                                floor_ms=round(floor_ms, 3), step_over_floor=round(step_ms / floor_ms, 3))
            print(f"{name} b{n}: {out[f'b{n}']}", flush=True)
            save()
        del engine, model
    free(args.device)


def targets(result: dict) -> list[dict]:
    """One ``moe_decode_step_over_floor`` row per shape and batch asked for; None where not measured
    (skipped for memory, cut short)."""
    return [target_row("moe_decode_step_over_floor", result.get("shapes", {}).get(s, {}).get(f"b{n}", {})
                       .get("step_over_floor"), f"{s}_b{n}")
            for s in result["shapes_asked"] for n in result["batches"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="each shape shrunk, on the CPU, few steps")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --smoke")
    ap.add_argument("--runs", type=int, default=1, help="runs of --steps decode steps per batch (median step)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per run; default 32, 4 with --smoke")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes; default 4 GiB, 32 MiB with --smoke")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: {', '.join(sorted(set(shapes) - set(SHAPES)))}: not one of {', '.join(SHAPES)}")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    args.steps = args.steps or (4 if args.smoke else 32)
    args.kv_cache_memory = args.kv_cache_memory or ((32 << 20) if args.smoke else (4 << 30))
    args.batches = (1, 4) if args.smoke else (1, 64)
    args.prompt_len = 16 if args.smoke else 128
    args.max_model_len = 64 if args.smoke else 512
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu_moe: --device cuda but no CUDA device here; nothing run, nothing written "
              "(--smoke runs the shrunk CPU version).")
        return 0
    out_path = Path(args.out or (Path(tempfile.gettempdir()) / "gpu_moe_smoke.json" if args.smoke
                                 else RESULTS / "gpu_moe.json"))
    result = {"environment": environment(args.device), "mode": "smoke" if args.smoke else "full",
              "dtype": args.dtype, "runs": args.runs, "steps": args.steps, "batches": list(args.batches),
              "shapes_asked": shapes, "shapes": {}, "targets": []}

    def save() -> None:
        result["targets"] = targets(result)
        write_json(out_path, result)

    bandwidth = copy_bandwidth(args.device, (16 if args.smoke else 1024) << 20)
    result["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    free(args.device)
    save()
    for name in shapes:
        result["shapes"][name] = {}
        bench_shape(args, name, bandwidth, result["shapes"][name], save)
    save()
    for t in result["targets"]:
        print(f"target {t['name']}: {t['value']} {t['op']} {t['target']}: {t['met']}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

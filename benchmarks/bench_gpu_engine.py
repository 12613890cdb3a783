"""The engine on one GPU against the issue-11 targets, with transformers ``generate``
on the same GPU in the same run.

    .venv/bin/python benchmarks/bench_gpu_engine.py                 # one CUDA GPU, bf16
    .venv/bin/python benchmarks/bench_gpu_engine.py --smoke         # CPU, tiny random model: proves it runs

Bundled model (SmolLM2-135M), both sides in bf16:
  - decode step at batch 1 through the whole engine (EngineCore.step: schedule,
    forward, sample, stop checks), "static" (padded buckets, CUDA graphs, async
    scheduling: the GPU default) vs "static_sync" (--no-async-scheduling: step N+1 is
    scheduled only after step N's tokens land) vs "eager" (--enforce-eager);
    transformers per token
  - output tok/s at batch 64 and 256 (after every request has its first token)
  - prefill tok/s on 2048-token batches (1 x 2048, 4 x 512, 16 x 128 prompt tokens)
Llama-3-8B shape with random weights (``load_format="dummy"``, shape from
``model_configs/llama3-8b/config.json``):
  - batch-1 decode step vs the weight-read floor = weight bytes / copy bandwidth, the
    bandwidth measured in this run as (bytes read + bytes written) / time of a
    device-to-device copy, so reading W bytes takes at least W / bandwidth
  - output tok/s at batch 64 and 256
Records device name, driver, torch and CUDA versions and the command. Writes
``benchmarks/results/gpu_engine.json`` (``gpu_engine_smoke.json`` with --smoke).
``--device cuda`` without CUDA says so and exits 0, writing nothing.

On a device machine, first the GPU tests of the same paths, then this script:

    pytest -q -m gpu tests/test_static_decode.py tests/test_prefill_batch.py
    python benchmarks/bench_gpu_engine.py                       # ~10 min on an H100
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.benchmarks.bench_engine import ours_prefill  # prompt tokens/s of one batch
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.loader import resolve_model_dir

RESULTS = Path(__file__).parent / "results"
CONFIGS = Path(__file__).parent / "model_configs"
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=257, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=256)
TARGETS = {"bundled_decode_step_b1_ms": 2.5, "bundled_decode_b256_tok_s": 50000, "bundled_prefill_2048_tok_s": 50000,
           "llama3_8b_decode_step_over_floor": 1.2}


class Plan:
    """What a run measures: the full GPU plan or the tiny CPU smoke plan."""

    def __init__(self, smoke: bool):
        self.decode_batches = (4, 8) if smoke else (64, 256)
        self.prefill_batches = ((1, 64), (4, 16)) if smoke else ((1, 2048), (4, 512), (16, 128))  # (n, len)
        self.prompt_len = 16 if smoke else 128
        self.steps = 4 if smoke else 64  # decode steps timed per run
        self.copy_bytes = (16 if smoke else 1024) << 20


def environment(args) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "command": " ".join([sys.executable, *sys.argv]),
           "device": args.device}
    if args.device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(args.device)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    else:
        env["device_name"] = "cpu"
    return env


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 3, (n, length), generator=g).tolist()


def engine_decode(engine: EngineCore, batch: list[list[int]], steps: int) -> list[float]:
    """Seconds of each decode step once every request has its first token."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    started: set[str] = set()
    while len(started) < len(batch):  # prefill (chunks mixed with the first decodes)
        started.update(d.request_id for d in engine.step())
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()  # ends with the sampled ids on the host: the GPU work is done
        times.append(time.perf_counter() - t0)
    return times


@torch.inference_mode()
def hf_seconds(model, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch, device=model.device)
    sync(str(model.device))
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    sync(str(model.device))
    return time.perf_counter() - t0


def hf_decode_step(model, batch, steps: int) -> float:
    """Seconds per generated token step (prefill subtracted)."""
    return (hf_seconds(model, batch, steps + 1) - hf_seconds(model, batch, 1)) / steps


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> float:
    """(bytes read + bytes written) / second of a device-to-device copy."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def weight_bytes(engine: EngineCore) -> int:
    """Bytes a decode step must read: every weight, except the embedding table when it is
    not also the head (only the batch's rows of it are read)."""
    model = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    if not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def make_engine(args, model_dir, **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=2048, prefill_chunk_size=2048, enable_prefix_caching=False,
               kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def free(args) -> None:
    """Give a deleted engine's KV pool and graph pool back before the next one starts."""
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


VARIANTS = {"static": {"async_scheduling": True}, "static_sync": {"async_scheduling": False}, "eager": {"enforce_eager": True}}


def bench_bundled(args, plan: Plan, model_dir: Path, hf_model) -> dict:
    out = {"decode_step_b1_ms": {}, "decode_tok_s": {}, "prefill_tok_s": {}}
    for name, variant in VARIANTS.items():
        engine = make_engine(args, model_dir, **variant)
        vocab = engine.model_config.vocab_size
        times = [t for run in range(args.runs) for t in engine_decode(engine, prompts(1, plan.prompt_len, vocab, run),
                                                                      plan.steps)]
        out["decode_step_b1_ms"][name] = median_ms(times)
        if name == "static":
            for n in plan.decode_batches:
                times = engine_decode(engine, prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
                out["decode_tok_s"][f"b{n}"] = {"splitserve": round(n * len(times) / sum(times), 1)}
            for n, length in plan.prefill_batches:
                runs = [ours_prefill(engine, prompts(n, length, vocab, 100 + r)) for r in range(args.runs)]
                out["prefill_tok_s"][f"{n}x{length}"] = {"splitserve": round(statistics.median(runs), 1)}
        print(f"bundled {name}: decode step at batch 1 {out['decode_step_b1_ms'][name]} ms", flush=True)
        del engine
        free(args)
    batch1 = prompts(1, plan.prompt_len, vocab, 0)
    out["decode_step_b1_ms"]["transformers"] = round(
        statistics.median(hf_decode_step(hf_model, batch1, plan.steps) for _ in range(args.runs)) * 1e3, 3)
    for n in plan.decode_batches:
        step = hf_decode_step(hf_model, prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
        out["decode_tok_s"][f"b{n}"]["transformers"] = round(n / step, 1)
    for n, length in plan.prefill_batches:
        batch = prompts(n, length, vocab, 100)
        out["prefill_tok_s"][f"{n}x{length}"]["transformers"] = round(n * length / hf_seconds(hf_model, batch, 1), 1)
    print(json.dumps(out, indent=1), flush=True)
    return out


def bench_big(args, plan: Plan, config: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        bandwidth = copy_bandwidth(args.device, plan.copy_bytes)
        out = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "decode_step_b1_ms": {}, "decode_tok_s": {}}
        for name, variant in VARIANTS.items():
            engine = make_engine(args, Path(tmp), load_format="dummy", max_num_seqs=max(plan.decode_batches),
                                 **variant)
            vocab = engine.model_config.vocab_size
            times = [t for r in range(args.runs) for t in engine_decode(engine, prompts(1, plan.prompt_len, vocab, r),
                                                                        plan.steps)]
            out["decode_step_b1_ms"][name] = median_ms(times)
            if name == "static":
                wbytes = weight_bytes(engine)
                floor_ms = wbytes / bandwidth * 1e3
                out.update(weight_bytes=wbytes, weight_read_floor_ms=round(floor_ms, 3),
                           decode_step_over_floor=round(out["decode_step_b1_ms"]["static"] / floor_ms, 3))
                for n in plan.decode_batches:
                    times = engine_decode(engine, prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
                    out["decode_tok_s"][f"b{n}"] = round(n * len(times) / sum(times), 1)
            print(f"8B-shape {name}: decode step at batch 1 {out['decode_step_b1_ms'][name]} ms", flush=True)
            del engine
            free(args)
    print(json.dumps(out, indent=1), flush=True)
    return out


def tiny_bundled_dir(tmp: Path) -> Path:
    """--smoke: a tiny random Llama saved as safetensors, so both sides load it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})).save_pretrained(tmp)
    return tmp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU, few steps")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --smoke")
    ap.add_argument("--runs", type=int, default=None, help="repeats of each figure (median); default 3, 1 with --smoke")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes; default 12 GiB, 64 MiB with --smoke")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096, 256 with --smoke")
    ap.add_argument("--big-config", default=None,
                    help="config.json of the big shape (default: model_configs/llama3-8b/config.json)")
    ap.add_argument("--skip-big", action="store_true", help="only the bundled model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    args.runs = args.runs or (1 if args.smoke else 3)
    args.kv_cache_memory = args.kv_cache_memory or ((64 << 20) if args.smoke else (12 << 30))
    args.max_model_len = args.max_model_len or (256 if args.smoke else 4096)
    args.max_num_seqs = 8 if args.smoke else 256
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu_engine: --device cuda but no CUDA device here; nothing run, nothing written "
              "(--smoke runs the tiny CPU version).")
        return 0
    plan = Plan(args.smoke)
    out_path = Path(args.out or RESULTS / ("gpu_engine_smoke.json" if args.smoke else "gpu_engine.json"))
    result = {"environment": environment(args), "mode": "smoke" if args.smoke else "full", "dtype": args.dtype,
              "targets": TARGETS}
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_bundled_dir(Path(tmp)) if args.smoke else resolve_model_dir(None)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        result["bundled"] = bench_bundled(args, plan, model_dir, hf)
        del hf
    if not args.skip_big:
        if args.smoke:
            big = dict(TINY, hidden_size=128, intermediate_size=256)
        else:
            big = json.loads(Path(args.big_config or CONFIGS / "llama3-8b" / "config.json").read_text())
        result["llama3_8b_shape"] = bench_big(args, plan, big)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the engine meet the GPU targets (batch-1 step, decode and prefill tok/s, the
Llama-3-8B step against the weight-read floor) on one GPU? Beside transformers
``generate`` on the same GPU, on the same weights, in the same run.

    .venv/bin/python benchmarks/gpu/bench_gpu_engine.py [--part bundled|big|all] [--model-dir DIR] [--out F]
    .venv/bin/python benchmarks/gpu/bench_gpu_engine.py --smoke         # CPU, tiny random model: proves it runs

Part "bundled": the bundled model's shape (SmolLM2-135M; ``--model-dir DIR`` reads it
from DIR/config.json, no weights needed) with random weights drawn here by transformers
(seed 0) and saved as safetensors, which both sides load (ours through the real
loader), in bf16:
  - decode step at batch 1 through the whole engine (EngineCore.step: schedule,
    forward, sample, stop checks), "static" (padded buckets, CUDA graphs, async
    scheduling: the GPU default) vs "static_sync" (--no-async-scheduling: step N+1 is
    scheduled only after step N's tokens land) vs "eager" (--enforce-eager);
    transformers per token
  - output tok/s at batch 64 and 256 (after every request has its first token)
  - prefill tok/s on 2048-token batches (1 x 2048, 4 x 512, 16 x 128 prompt tokens)
Part "big": the Llama-3-8B shape with random weights (``load_format="dummy"``, shape
from ``model_configs/llama3-8b/config.json``):
  - batch-1 decode step vs the weight-read floor = weight bytes / copy bandwidth, the
    bandwidth measured in this run as (bytes read + bytes written) / time of a
    device-to-device copy, so reading W bytes takes at least W / bandwidth
  - output tok/s at batch 64 and 256
Top level: "environment" and "targets" (gpu/contract.py), the JSON rewritten after
every figure so a run cut short keeps what it measured. Writes
``benchmarks/results/gpu_engine.json`` (the temp folder's ``gpu_engine_smoke.json`` with
--smoke). ``--device cuda`` without CUDA says so and exits 0, writing nothing.
``--runs`` and ``--steps`` shrink a run (each figure is a median of --runs runs of
--steps decode steps).
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.benchmarks.gpu.contract import environment, target_row, write_json
from splitserve.benchmarks.harness import RESULTS, copy_bandwidth, engine_decode, ours_prefill, sync, token_prompts
from splitserve.common.config import EngineConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.models.loader import resolve_model_dir
from splitserve.engine.model_runner import ModelRunner

CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=257, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=256)
# --smoke with --model-dir: that config at TINY's sizes (its vocabulary, norms, RoPE kept)
TINY_SIZES = {k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings")} | {"head_dim": 16}
PARTS = ("bundled", "big", "all")


class Plan:
    """What a run measures: the full GPU plan or the tiny CPU smoke plan."""

    def __init__(self, smoke: bool, steps: int | None):
        self.decode_batches = (4, 8) if smoke else (64, 256)
        self.prefill_batches = ((1, 64), (4, 16)) if smoke else ((1, 2048), (4, 512), (16, 128))  # (n, len)
        self.prompt_len = 16 if smoke else 128
        self.steps = steps or (4 if smoke else 64)  # decode steps timed per run
        self.copy_bytes = (16 if smoke else 1024) << 20


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


def weight_bytes(engine: EngineCore) -> int:
    """Bytes a decode step must read: every weight, except the embedding table when it is
    not also the head (only the batch's rows of it are read)."""
    assert isinstance(engine.runner, ModelRunner), "a real (not simulated) engine"
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


VARIANTS = {"static": {"async_scheduling": True}, "static_sync": {"async_scheduling": False},
            "eager": {"enforce_eager": True}}


def variant_engine(args, model_dir: Path, name: str, **kw) -> EngineCore:
    """The engine of variant ``name``. Only "static" measures batches > 1: the others get 8
    sequences (4 graphs to capture) and at most 1 GiB of KV, so that an engine not yet
    freed (the 8B shape: 16 GB of weights each) leaves room for the next."""
    small = {} if name == "static" else dict(max_num_seqs=8, kv_cache_memory=min(args.kv_cache_memory, 1 << 30))
    return make_engine(args, model_dir, **{**VARIANTS[name], **small, **kw})


def step_b1(args, plan: Plan, engine: EngineCore) -> float:
    """Median ms of a batch-1 decode step over ``args.runs`` runs."""
    vocab = engine.model_config.vocab_size
    return median_ms([t for run in range(args.runs)
                      for t in engine_decode(engine, token_prompts(1, plan.prompt_len, vocab, run), plan.steps)])


def bench_bundled(args, plan: Plan, model_dir: Path, out: dict, save) -> None:
    """Fills ``out`` figure by figure (``save()`` after each): ours, then transformers on
    the same folder."""
    out.update(decode_step_b1_ms={}, decode_tok_s={}, prefill_tok_s={})
    for name in VARIANTS:
        engine = variant_engine(args, model_dir, name)
        vocab = engine.model_config.vocab_size
        out["decode_step_b1_ms"][name] = step_b1(args, plan, engine)
        print(f"bundled {name}: decode step at batch 1 {out['decode_step_b1_ms'][name]} ms", flush=True)
        save()
        if name == "static":
            for n in plan.decode_batches:
                times = engine_decode(engine, token_prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
                out["decode_tok_s"][f"b{n}"] = {"splitserve": round(n * len(times) / sum(times), 1)}
            for n, length in plan.prefill_batches:
                runs = [ours_prefill(engine, token_prompts(n, length, vocab, 100 + r)) for r in range(args.runs)]
                out["prefill_tok_s"][f"{n}x{length}"] = {"splitserve": round(statistics.median(runs), 1)}
            print(f"bundled static: decode tok/s {out['decode_tok_s']}, prefill tok/s {out['prefill_tok_s']}",
                  flush=True)
            save()
        del engine
        free(args)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    batch1 = token_prompts(1, plan.prompt_len, vocab, 0)
    out["decode_step_b1_ms"]["transformers"] = round(
        statistics.median(hf_decode_step(hf, batch1, plan.steps) for _ in range(args.runs)) * 1e3, 3)
    for n in plan.decode_batches:
        step = hf_decode_step(hf, token_prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
        out["decode_tok_s"][f"b{n}"]["transformers"] = round(n / step, 1)
    for n, length in plan.prefill_batches:
        batch = token_prompts(n, length, vocab, 100)
        out["prefill_tok_s"][f"{n}x{length}"]["transformers"] = round(n * length / hf_seconds(hf, batch, 1), 1)
    del hf
    free(args)
    save()
    print(json.dumps(out, indent=1), flush=True)


def bench_big(args, plan: Plan, config: dict, out: dict, save) -> None:
    """Fills ``out`` figure by figure (``save()`` after each)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        bandwidth = copy_bandwidth(args.device, plan.copy_bytes)
        free(args)
        out.update(copy_bandwidth_gb_s=round(bandwidth / 1e9, 1), decode_step_b1_ms={}, decode_tok_s={})
        for name in VARIANTS:
            engine = variant_engine(args, Path(tmp), name, load_format="dummy")
            vocab = engine.model_config.vocab_size
            out["decode_step_b1_ms"][name] = step_b1(args, plan, engine)
            if name == "static":
                wbytes = weight_bytes(engine)
                floor_ms = wbytes / bandwidth * 1e3
                out.update(weight_bytes=wbytes, weight_read_floor_ms=round(floor_ms, 3),
                           decode_step_over_floor=round(out["decode_step_b1_ms"]["static"] / floor_ms, 3))
                save()
                for n in plan.decode_batches:
                    times = engine_decode(engine, token_prompts(n, plan.prompt_len, vocab, 10 + n), plan.steps)
                    out["decode_tok_s"][f"b{n}"] = round(n * len(times) / sum(times), 1)
            print(f"8B-shape {name}: decode step at batch 1 {out['decode_step_b1_ms'][name]} ms", flush=True)
            save()
            del engine
            free(args)
    print(json.dumps(out, indent=1), flush=True)


def targets(result: dict, plan: Plan) -> list[dict]:
    """The targets of the parts this run covers (gpu/contract.py's TARGETS); None where a figure
    is not there (yet)."""
    rows = []
    if result["part"] in ("bundled", "all"):
        b = result.get("bundled", {})
        n = max(plan.decode_batches)
        prefill = [b.get("prefill_tok_s", {}).get(f"{k}x{length}", {}).get("splitserve")
                   for k, length in plan.prefill_batches]
        tokens = plan.prefill_batches[0][0] * plan.prefill_batches[0][1]
        rows += [target_row("bundled_decode_step_b1_ms", b.get("decode_step_b1_ms", {}).get("static")),
                 target_row("bundled_decode_tok_s", b.get("decode_tok_s", {}).get(f"b{n}", {}).get("splitserve"),
                            f"b{n}"),
                 target_row("bundled_prefill_tok_s", None if None in prefill else min(prefill), str(tokens))]
    if result["part"] in ("big", "all"):
        rows.append(target_row("llama3_8b_decode_step_over_floor",
                               result.get("llama3_8b_shape", {}).get("decode_step_over_floor")))
    return rows


def bundled_config(args) -> dict:
    """The bundled part's config.json: --model-dir's (default: the bundled model's), or
    with --smoke TINY (--model-dir's at TINY's sizes when given)."""
    if args.smoke and args.model_dir is None:
        return dict(TINY)
    path = (Path(args.model_dir) if args.model_dir else resolve_model_dir(None)) / "config.json"
    if not path.is_file():
        raise SystemExit(f"error: --model-dir: no config.json in {path.parent}")
    config = json.loads(path.read_text())
    return config | TINY_SIZES if args.smoke else config


def random_model(config: dict, dtype: str, folder: Path) -> Path:
    """A model of ``config`` with transformers' initial weights (seed 0) in ``dtype``, saved
    as safetensors in ``folder``: what both sides of the bundled part load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    hf_config = AutoConfig.for_model(config.pop("model_type", "llama"), **config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config).to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU, few steps")
    ap.add_argument("--part", choices=PARTS, default="all", help="bundled, big (the 8B shape) or all (default)")
    ap.add_argument("--model-dir", default=None,
                    help="folder whose config.json gives the bundled part's shape (default: the bundled model's)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --smoke")
    ap.add_argument("--runs", type=int, default=None, help="repeats of each figure (median); default 3, 1 with --smoke")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per run; default 64, 4 with --smoke")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes; default 12 GiB, 64 MiB with --smoke")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096, 256 with --smoke")
    ap.add_argument("--big-config", default=None,
                    help="config.json of the big shape (default: model_configs/llama3-8b/config.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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
    plan = Plan(args.smoke, args.steps)
    out_path = Path(args.out or (Path(tempfile.gettempdir()) / "gpu_engine_smoke.json" if args.smoke
                                 else RESULTS / "gpu_engine.json"))
    result = {"environment": environment(args.device), "mode": "smoke" if args.smoke else "full",
              "part": args.part, "dtype": args.dtype, "runs": args.runs, "steps": plan.steps, "targets": []}

    def save() -> None:
        result["targets"] = targets(result, plan)
        write_json(out_path, result)

    save()
    if args.part in ("bundled", "all"):
        config = bundled_config(args)
        with tempfile.TemporaryDirectory() as tmp:
            result["bundled"] = {"config": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers",
                                                                       "vocab_size")}}
            bench_bundled(args, plan, random_model(config, args.dtype, Path(tmp)), result["bundled"], save)
    if args.part in ("big", "all"):
        if args.smoke:
            big = dict(TINY, hidden_size=128, intermediate_size=256)
        else:
            big = json.loads(Path(args.big_config or CONFIGS / "llama3-8b" / "config.json").read_text())
        result["llama3_8b_shape"] = {}
        bench_big(args, plan, big, result["llama3_8b_shape"], save)
    save()
    for t in result["targets"]:
        print(f"target {t['name']}: {t['value']} {t['op']} {t['target']}: {t['met']}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

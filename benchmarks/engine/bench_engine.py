"""Is the engine faster than transformers ``generate`` (static batch) at decode and at
prefill? Same run, same weights, same threads (or the same GPU).

    .venv/bin/python benchmarks/engine/bench_engine.py [--runs 3] [--new-tokens 128]
    .venv/bin/python benchmarks/engine/bench_engine.py --device cuda [--dtype bfloat16] [--attention-backend cuda]

Decode tokens/s at 1, 8 and 32 concurrent requests (time after every request
has its first token, so prefill is excluded on both sides) and prefill tokens/s
for 512-token prompts. Each figure is the median of ``--runs``. Writes
``benchmarks/results/engine.json`` and ``engine.png`` (``engine_cuda.*`` on a GPU,
where both sides run in the engine's dtype: bfloat16 unless ``--dtype`` says otherwise).
``--device cuda`` without CUDA says so and exits 0, writing nothing.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from splitserve.benchmarks.harness import RESULTS, ours_prefill
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.model_runner import ModelRunner


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def ours_decode(engine: EngineCore, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", engine.prompt_ref(p), params)
    produced = 0
    while produced < len(batch):  # prefill: until every request has its first token
        produced += len(engine.step())
    start, decoded = time.perf_counter(), 0
    while engine.has_unfinished():
        decoded += len(engine.step())
    return decoded / (time.perf_counter() - start)


@torch.inference_mode()
def hf_generate_time(model, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch, device=model.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=model.config.eos_token_id)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_decode(model, batch, new_tokens: int) -> float:
    prefill = hf_generate_time(model, batch, 1)
    total = hf_generate_time(model, batch, new_tokens)
    return len(batch) * (new_tokens - 1) / (total - prefill)


def hf_prefill(model, batch) -> float:
    return sum(map(len, batch)) / hf_generate_time(model, batch, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt length for the decode runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides run there)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--attention-backend", default="auto", help="auto, cuda, triton or torch")
    ap.add_argument("--out", default=None, help="default: results/engine.json, or engine_cuda.json on a GPU")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_engine: --device cuda but no CUDA device here; nothing run, nothing written.")
        return 0
    args.out = args.out or str(RESULTS / ("engine.json" if args.device == "cpu" else "engine_cuda.json"))
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    engine = EngineCore(EngineConfig(kv_cache_memory=2 << 30, device=args.device, dtype=args.dtype,
                                     attention_backend=args.attention_backend))
    assert isinstance(engine.runner, ModelRunner), "a real (not simulated) engine"
    print(f"engine: {args.device}, {engine.config.dtype}, attention backend {engine.runner.backend.name}", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=getattr(torch, engine.config.dtype))
    hf = hf.to(args.device).eval()
    vocab = engine.model_config.vocab_size
    rows = []

    def record(kind, size, ours, theirs):
        o, t = statistics.median(ours), statistics.median(theirs)
        rows.append({"kind": kind, "concurrency": size, "splitserve_tok_s": round(o, 1),
                     "transformers_tok_s": round(t, 1), "ratio": round(o / t, 2),
                     "splitserve_runs": [round(x, 1) for x in ours], "transformers_runs": [round(x, 1) for x in theirs]})
        print(f"{kind:8s} x{size:<3d} splitserve {o:8.1f} tok/s   transformers {t:8.1f} tok/s   "
              f"ratio {o / t:5.2f}", flush=True)

    for size in (1, 8, 32):
        ours, theirs = [], []
        for run in range(args.runs):
            batch = prompts(size, args.prompt_len, vocab, seed=run)
            ours.append(ours_decode(engine, batch, args.new_tokens))
            theirs.append(hf_decode(hf, batch, args.new_tokens))
            print(f"  decode x{size} run {run + 1}/{args.runs}: {ours[-1]:.1f} vs {theirs[-1]:.1f} tok/s", flush=True)
        record("decode", size, ours, theirs)
    for size in (1, 4):
        ours, theirs = [], []
        for run in range(args.runs):
            batch = prompts(size, 512, vocab, seed=100 + run)  # fresh tokens: no prefix-cache hits
            ours.append(ours_prefill(engine, batch))
            theirs.append(hf_prefill(hf, batch))
        record("prefill", size, ours, theirs)

    decode = {r["concurrency"]: r for r in rows if r["kind"] == "decode"}
    best_hf = max(r["transformers_tok_s"] for r in decode.values())
    summary = {
        "decode32_vs_transformers_best": round(decode[32]["splitserve_tok_s"] / best_hf, 2),
        "decode1_vs_transformers": decode[1]["ratio"],
        "prefill512_vs_transformers": next(r["ratio"] for r in rows if r["kind"] == "prefill" and r["concurrency"] == 1),
        "targets": {"decode32_vs_transformers_best": 4.0, "decode1_vs_transformers": 1.0,
                    "prefill512_vs_transformers": 1.0},
    }
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "torch_threads": torch.get_num_threads(),
                               "dtype": engine.config.dtype, "attention_backend": engine.runner.backend.name,
                               "device_name": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                               "rows": rows, "summary": summary}, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("decode", "prefill")):
        sel = [r for r in rows if r["kind"] == kind]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["splitserve_tok_s"] for r in sel], 0.4, label="splitserve")
        ax.bar([i + 0.2 for i in x], [r["transformers_tok_s"] for r in sel], 0.4, label="transformers")
        ax.set_xticks(list(x), [f"x{r['concurrency']}" for r in sel])
        ax.set_title(f"{kind} tokens/s (higher is better)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

"""What timing model (``common.config.SimConfig``) makes a simulated node take as long
as the real engine on this machine? Fitted to the bundled model, fp32, one torch thread
(a node's share of the cores in ``splitserve up``).

    .venv/bin/python benchmarks/engine/fit_timing.py [--threads 1]

Times every ``ModelRunner.launch`` (on the CPU the whole step runs in it: the forward
pass and the sampling; it is what a simulated node's ``SimRunner.launch`` stands in for) of
  - prefill: prompts of 96 to 4096 tokens in chunks of 512 (the cached context
    grows chunk by chunk), fitted by least squares to
    ``step_s + prefill_token_s * n + prefill_attn_s * n * (ctx + n / 2)``;
  - decode: batches of 1 to 64 requests with 128-token contexts (prompts that share
    a cached prefix, so setting up is cheap), the median step minus ``step_s``.
Writes ``benchmarks/results/timing_model.json`` (``SimConfig.load`` reads it) and
prints the fit next to the built-in defaults.
"""

import argparse
import json
import statistics
import time
from typing import NamedTuple

import torch

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.config import EngineConfig, SimConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.runner import LaunchedStep, split
from splitserve.engine.scheduler import SchedulerOutput


class StepTime(NamedTuple):
    decodes: int  # decode rows
    chunks: list[tuple[int, int]]  # prefill chunks: (tokens, cached context tokens)
    seconds: float


def timed_engine(threads: int) -> tuple[EngineCore, list[StepTime]]:
    engine = EngineCore(EngineConfig(kv_cache_memory=1 << 30, num_threads=threads, max_num_seqs=64,
                                     max_num_batched_tokens=2048, prefill_chunk_size=512))
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "fitted to the real engine, not a simulated one"
    samples: list[StepTime] = []
    launch = runner.launch

    def timed(out: SchedulerOutput, kv: KVCacheManager) -> LaunchedStep:
        rows = split(out)
        chunks = [(r.num_tokens, r.request.num_computed_tokens) for r in rows.chunks]
        decodes = len(rows.decodes)
        t0 = time.perf_counter()
        launched = launch(out, kv)
        samples.append(StepTime(decodes, chunks, time.perf_counter() - t0))
        return launched
    setattr(runner, "launch", timed)  # an instance attribute over the method: this engine's every step timed
    return engine, samples


def drain(engine: EngineCore) -> None:
    while engine.has_unfinished():
        engine.step()


def measure_prefill(engine, samples, vocab: int) -> list[tuple[int, int, float]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in (96, 256, 512, 1024, 2048, 4096, 1024, 2048):
        prompt = torch.randint(100, vocab - 100, (length,), generator=g).tolist()
        samples.clear()
        engine.add_request(f"p{length}-{time.monotonic_ns()}", engine.prompt_ref(prompt), SamplingParams(max_tokens=1))
        drain(engine)
        rows += [(n, ctx, t) for d, chunks, t in samples if d == 0 and len(chunks) == 1 for n, ctx in chunks]
        print(f"  prefill {length:5d} tokens: {sum(t for *_, t in samples):6.2f} s", flush=True)
    return rows


def fit_prefill(rows: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    x = torch.tensor([[1.0, n, n * (ctx + n / 2)] for n, ctx, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).clamp(min=0)  # [3]: one per column of x
    step_s, token_s, attn_s = (float(c) for c in coef)
    return step_s, token_s, attn_s


def measure_decode(engine, samples, vocab: int, step_s: float, steps: int) -> list[tuple[int, float]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, vocab - 100, (112,), generator=g).tolist()
    table = []
    for batch in (1, 4, 16, 32, 64):
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for i in range(batch):
            tail = torch.randint(100, vocab - 100, (16,), generator=g).tolist()
            engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", engine.prompt_ref(prefix + tail), params)
        samples.clear()
        drain(engine)
        full = [t for d, chunks, t in samples if d == batch and not chunks]
        table.append((batch, max(0.0, statistics.median(full) - step_s)))
        print(f"  decode x{batch:2d}: {statistics.median(full) * 1000:6.1f} ms/step "
              f"({len(full)} steps)", flush=True)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=12)
    args = ap.parse_args()
    engine, samples = timed_engine(args.threads)
    vocab = engine.model_config.vocab_size
    print(f"fitting on the real engine, {args.threads} thread(s)", flush=True)
    rows = measure_prefill(engine, samples, vocab)
    step_s, token_s, attn_s = fit_prefill(rows)
    decode = measure_decode(engine, samples, vocab, step_s, args.decode_steps)
    fitted = SimConfig(step_s=step_s, prefill_token_s=token_s, prefill_attn_s=attn_s, decode_s=tuple(decode))
    worst = max(abs(fitted.step_seconds(0, [(n, ctx)]) - t) / t for n, ctx, t in rows)
    result = {"step_s": step_s, "prefill_token_s": token_s, "prefill_attn_s": attn_s,
              "decode_s": [list(p) for p in decode], "threads": args.threads,
              "prefill_fit_max_rel_error": worst, "prefill_samples": [list(r) for r in rows]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "timing_model.json").write_text(json.dumps(result, indent=1))
    d = SimConfig()
    print(f"\n{'':18s}{'fitted':>12s}{'built-in':>12s}")
    for name in ("step_s", "prefill_token_s", "prefill_attn_s"):
        print(f"{name:18s}{getattr(fitted, name):12.3g}{getattr(d, name):12.3g}")
    for (b, s), (_, s0) in zip(decode, d.decode_s):
        print(f"decode x{b:<10d}{s:12.3g}{s0:12.3g}")
    print(f"prefill fit: worst step off by {worst:.0%}; wrote {RESULTS / 'timing_model.json'}")


if __name__ == "__main__":
    main()

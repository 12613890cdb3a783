"""Is the padded static decode path (what decode runs by default) faster per step on the
CPU than --enforce-eager? The bundled model, through the whole engine (EngineCore.step).

    .venv/bin/python benchmarks/engine/bench_static_decode_cpu.py [--reps 4] [--steps 8] [--threads 1]

Both engines live in one process and take turns run by run, so load on a shared
machine hits both alike. Prints the median step at batch 1 and 16 and writes
``benchmarks/results/static_decode_cpu.json``. (On a GPU, gpu/bench_gpu_engine.py measures
the same comparison with CUDA graphs.)
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from splitserve.benchmarks.harness import RESULTS, engine_decode, token_prompts
from splitserve.common.config import EngineConfig
from splitserve.engine.engine_core import EngineCore

BATCHES = (1, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4, help="runs per engine and batch size, alternating")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "static_decode_cpu.json"))
    args = ap.parse_args()
    engines = {name: EngineCore(EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=max(BATCHES),
                                             enforce_eager=name == "eager", num_threads=args.threads))
               for name in ("eager", "static")}
    vocab = engines["eager"].model_config.vocab_size
    rows = []
    for n in BATCHES:
        times: dict[str, list[float]] = {name: [] for name in engines}  # engine -> seconds per step
        for e in engines.values():
            engine_decode(e, token_prompts(n, 16, vocab, 999), 2)  # warm-up
        for rep in range(args.reps):
            for name, e in engines.items():
                times[name] += engine_decode(e, token_prompts(n, args.prompt_len, vocab, rep), args.steps)
        row = {"batch": n, **{f"{name}_step_ms": round(statistics.median(t) * 1e3, 2) for name, t in times.items()},
               "steps_per_engine": len(times["eager"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "torch_threads": torch.get_num_threads(),
                               "load_average_1m": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

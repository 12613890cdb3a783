"""What does a tensor-parallel decode step cost on this CPU, beside TP=1, and where does the
overhead go (the step broadcast, the all-reduces, per step and per layer)?

    .venv/bin/python benchmarks/engine/bench_tp.py [--reps 3] [--steps 12] [--batches 1 8 32]

The model: the bundled model's shape (30 layers, hidden 576, head_dim 64, intermediate
1536, vocabulary 49152, tied embeddings) with 8 query heads over 2 KV heads instead of 9
over 3 (which no TP degree but 3 splits), random weights (``load_format dummy``), fp32.
Three engines live side by side and take turns run by run, so load on the shared
machine hits them alike:

    tp1-2t   TP=1, 2 torch threads (both cores)
    tp1-1t   TP=1, 1 thread
    tp2      TP=2, 1 thread per rank (rank 0 here, rank 1 a child process), each rank
             pinned to its core as the engine does (this process is re-pinned around turns)

Inside the TP=2 steps, rank 0 times its collectives (all_reduce: embedding + 2 per layer;
all_gather: the LM head; waiting for the other rank included) and its step broadcast
(msgpack encode + zmq send). Beside them, floors measured without a model: a gloo
all_reduce of one decode batch's activations between two processes, and the encode and
decode of one decode step's message. Writes ``benchmarks/results/tp_decode_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import torch

from splitserve.benchmarks.harness import RESULTS, engine_decode, token_prompts
from splitserve.common.config import EngineConfig
from splitserve.deploy.ports import free_port
from splitserve.engine.models.convert import bundled_model_dir
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.parallel.group import TPGroup, init_tp_group
from splitserve.engine.ranks.placement import pin_process, rank_cpus
from splitserve.engine.step_inputs import ForwardInputs
from splitserve.engine.parallel.step_channel import ToWorker

SHAPE = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}  # over the bundled config.json


def model_folder(root: Path) -> Path:
    """A folder with the bundled model's config.json, its heads changed to SHAPE."""
    cfg = json.loads((bundled_model_dir() / "config.json").read_text())
    cfg.update(SHAPE)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


class Timed:
    """Wraps TPGroup's collectives and a leader's send_step (this process only), summing
    seconds and calls while ``active`` (the decode steps of the TP=2 engine)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"all_reduce": 0.0, "all_gather": 0.0, "send_step": 0.0}
        self.calls: dict[str, int] = dict.fromkeys(self.seconds, 0)
        self.active = False

    def wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(owner, name, timed)

    def start(self) -> None:
        self.active = True

    def reset(self) -> None:
        self.active = False
        for k in self.seconds:
            self.seconds[k], self.calls[k] = 0.0, 0


def collective_peer(port: int, hidden: int, batches: list[int], reps: int) -> None:
    """Rank 1 of the all_reduce floor: the same all_reduces as rank 0, nothing else."""
    torch.set_num_threads(1)
    cpus = rank_cpus(1, 2, torch.device("cpu"))
    if cpus:
        pin_process(cpus)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    group = init_tp_group(1, 2, torch.device("cpu"), store)
    for b in batches:
        x = torch.ones(b, hidden)
        for _ in range(reps + 10):
            group.all_reduce(x)
    group.close()


def all_reduce_floor(hidden: int, batches: list[int], reps: int = 300) -> dict[int, float]:
    """Microseconds of one gloo all_reduce of [batch, hidden] fp32 between two processes (median)."""
    port = free_port()
    peer = mp.get_context("spawn").Process(target=collective_peer, args=(port, hidden, batches, reps), daemon=True)
    peer.start()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60))
    group = init_tp_group(0, 2, torch.device("cpu"), store)
    cpus = rank_cpus(0, 2, torch.device("cpu"))
    before = pin_process(cpus) if cpus else None
    out = {}
    for b in batches:
        x = torch.ones(b, hidden)
        times = []
        for i in range(reps + 10):
            t0 = time.perf_counter()
            group.all_reduce(x)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        out[b] = statistics.median(times) * 1e6
    if before:
        pin_process(before)
    group.close()
    peer.join(timeout=30)
    return out


def message_cost(batch: int, context: int, block_size: int) -> dict[str, float]:
    """Microseconds to encode and decode one decode step's ForwardInputs, and its bytes."""
    blocks = -(-context // block_size)
    msg = ForwardInputs(True, list(range(batch)), [context] * batch,
                        [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)], [], [], [], batch)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)
    data = enc.encode(msg)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        enc.encode(msg)
    t1 = time.perf_counter()
    for _ in range(n):
        dec.decode(data)
    t2 = time.perf_counter()
    return {"encode_us": round((t1 - t0) / n * 1e6, 1), "decode_us": round((t2 - t1) / n * 1e6, 1),
            "bytes": len(data)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="runs per engine and batch size, alternating")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", default=str(RESULTS / "tp_decode_cpu.json"))
    args = ap.parse_args()
    timed = Timed()
    for name in ("all_reduce", "all_gather"):
        timed.wrap(TPGroup, name)  # rank 0 is this process: only its calls are timed
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp))
        base = dict(model=str(folder), load_format="dummy", kv_cache_memory=512 << 20, max_num_seqs=max(args.batches),
                    block_size=16)
        all_cpus = os.sched_getaffinity(0)
        engines = {"tp1-2t": (EngineCore(EngineConfig(**base, num_threads=2)), 2),
                   "tp1-1t": (EngineCore(EngineConfig(**base, num_threads=1)), 1),
                   "tp2": (EngineCore(EngineConfig(**base, tensor_parallel_size=2, num_threads=1)), 1)}
        tp2 = engines["tp2"][0]
        assert tp2.tp is not None
        # rank 0 pinned this process to its share of the cores; the TP=1 engines get them all back
        cpus = {"tp1-2t": all_cpus, "tp1-1t": all_cpus, "tp2": os.sched_getaffinity(0)}
        timed.wrap(tp2.tp, "send_step")
        cfg = tp2.model_config
        vocab, layers = cfg.vocab_size, cfg.num_layers
        rows = []
        try:
            for b in args.batches:
                times: dict[str, list[float]] = {name: [] for name in engines}
                for name, (e, threads) in engines.items():
                    pin_process(cpus[name])
                    torch.set_num_threads(threads)
                    engine_decode(e, token_prompts(b, 16, vocab, 999), 2)  # warm-up
                timed.reset()
                for rep in range(args.reps):
                    for name, (e, threads) in engines.items():
                        pin_process(cpus[name])
                        torch.set_num_threads(threads)
                        start = timed.start if name == "tp2" else None
                        times[name] += engine_decode(e, token_prompts(b, args.prompt_len, vocab, rep), args.steps,
                                                     start)
                        timed.active = False
                steps = timed.calls["send_step"]  # TP=2 decode steps timed (the last one lands no step)
                med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                per_step = {k: timed.seconds[k] / max(1, steps) * 1e3 for k in timed.seconds}  # ms
                row = {"batch": b, **{f"{name}_step_ms": round(v, 2) for name, v in med.items()},
                       "tp2_vs_tp1_2t": round(med["tp2"] / med["tp1-2t"], 3),
                       "tp2_vs_tp1_1t": round(med["tp2"] / med["tp1-1t"], 3),
                       "tp2_all_reduce_ms_per_step": round(per_step["all_reduce"], 3),
                       "tp2_all_reduce_us_per_layer": round(per_step["all_reduce"] * 1e3 / layers, 1),
                       "tp2_all_reduce_us_per_call": round(timed.seconds["all_reduce"] * 1e6
                                                           / max(1, timed.calls["all_reduce"]), 1),
                       "all_reduces_per_step": round(timed.calls["all_reduce"] / max(1, steps), 2),
                       "tp2_all_gather_ms_per_step": round(per_step["all_gather"], 3),
                       "tp2_send_step_us_per_step": round(per_step["send_step"] * 1e3, 1),
                       "tp2_collectives_share_of_step": round((per_step["all_reduce"] + per_step["all_gather"])
                                                              / med["tp2"], 3),
                       "steps_per_engine": len(times["tp1-2t"])}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            tp2.close()
    floor = all_reduce_floor(cfg.hidden_size, args.batches)
    messages = {b: message_cost(b, args.prompt_len + args.steps, 16) for b in args.batches}
    for b in args.batches:
        print(f"batch {b}: gloo all_reduce floor {floor[b]:.1f} us, step message {messages[b]}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": vars(args), "model": {"shape": "bundled SmolLM2-135M with " + json.dumps(SHAPE),
                                         "layers": layers, "hidden": cfg.hidden_size, "vocab": vocab,
                                         "weights": "dummy", "dtype": "float32"},
        "cores": len(os.sched_getaffinity(0)), "load_average_1m": os.getloadavg()[0], "rows": rows,
        "all_reduce_floor_us": floor, "step_message": messages}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

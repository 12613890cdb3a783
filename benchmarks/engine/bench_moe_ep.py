"""What does the MoE part of a decode step cost on this CPU under expert parallelism (EP=2),
beside one process (EP=1) and the column split (TP=2), and where does each MoE layer's time
go: dispatch, experts or combine? How evenly do the bundled prompts load the experts?

    .venv/bin/python benchmarks/engine/bench_moe_ep.py [--reps 7] [--steps 12] [--batches 1 32]

The model: Qwen3-MoE shaped (transformers' ``Qwen3MoeConfig`` saved to a temporary folder;
SHAPE below: hidden 512, 4 layers, all MoE, 32 experts, top 4, expert intermediate 256,
8 query heads over 2 KV heads of 64), the bundled model's vocabulary (49152), random
weights (``load_format dummy``), fp32. Three engines live side by side and take turns run
by run, so load on the shared machine hits them alike:

    ep1   tensor_parallel_size 1, 1 torch thread: every expert, whole, in one process
    tp2   tensor_parallel_size 2, 1 thread per rank: every expert cut by columns (each rank
          runs every (token, expert) pair on its half of the columns)
    ep2   tensor_parallel_size 2 + enable_expert_parallel, 1 thread per rank: rank r holds
          experts [16r, 16r + 16) whole and runs only their pairs

(the two-rank engines' rank 0 is this process, rank 1 a child, each pinned to its core as
the engine does; ep1 runs on rank 0's core; this process is re-pinned around turns.) The
step time is the engine's decode step (scheduler, the forward over the paged KV cache,
sampling): the median of each run's median over ``--steps`` steps, over ``--reps`` runs;
each MoE-layer figure likewise the median over the runs of its per-run mean. Inside the
step, rank 0's MoE blocks run a timed copy of ``MoEBlock.forward`` (``timed_moe_forward``:
the same functions in the same order) that splits each MoE layer into

    dispatch   router gate + softmax + top-k (moe.route), the expert_tokens count, and under
               EP the mask of the other rank's pairs (id E_local: skipped)
    experts    fused_moe over this rank's experts (the torch path on the CPU)
    combine    the all-reduce of the ranks' partial sums (group.all_reduce; none at EP=1);
               on rank 0 it includes waiting for rank 1 to finish its experts; beside it,
               the floor: one all-reduce between two processes doing nothing else
    layer      the whole MoE block; ``decoder_layer_us``: the whole decoder layer
               (attention, its all-reduce, norms and the MoE block)

Expert load: the bundled prompts (PROMPTS, tokenized with the bundled model's tokenizer)
in one prefill forward of the EP=1 engine, then ``moe.expert_load_imbalance`` (max / mean
tokens per expert, per layer); beside it the same ratio for uniform random routing of as
many tokens. The weights are random, so the imbalance reflects random routing of a random
router, not a trained one. The decode runs also give the imbalance per step, and for EP=2
how unevenly the pairs fall on the two ranks (max / mean pairs per rank).

The combine's floor: one all-reduce between two pinned processes doing nothing else,
measured in every run. On this VM it was ~4 ms at idle on 2026-11-29 (bench_tp recorded
0.22 ms earlier; down to 0.25 ms with a busy loop on each core), which looks like the
wake-up of a halted vCPU (a scheduler tick is 4 ms here): a rank that blocks in the combine
then waits for its peer's wake-up as much as for the collective.

A configuration whose runs' medians differ by more than SPREAD_LIMIT (max / min) is flagged:
the machine did not hold still and the figures are not sustained. Writes
``benchmarks/results/moe_ep_cpu.json`` and ``moe_ep_cpu.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from splitserve.benchmarks.engine.bench_tp import all_reduce_floor
from splitserve.benchmarks.harness import RESULTS, engine_decode, token_prompts
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.models.convert import bundled_model_dir
from splitserve.engine.models.fused_moe import fused_moe
from splitserve.engine.models.llama import DecoderLayer
from splitserve.engine.models.moe import MoEBlock, expert_load_imbalance, route
from splitserve.engine.ranks.placement import pin_process, rank_cpus

SHAPE: dict[str, Any] = dict(
    hidden_size=512, num_hidden_layers=4, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
    intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=4096)
QUICK_SHAPE = dict(SHAPE, hidden_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16)
CONFIGS = {"ep1": (1, False), "tp2": (2, False), "ep2": (2, True)}  # name -> (ranks, expert parallel)
PIECES = ("dispatch", "experts", "combine", "layer", "decoder_layer")
SPREAD_LIMIT = 1.5  # max / min of a configuration's run medians beyond which the machine did not hold still
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?",
           "Name three colors of the rainbow.", "Explain rain to a child in one sentence.",
           "List four animals that live in the ocean.", "Why is the sky blue? Answer briefly.",
           "Translate 'good morning' into Spanish, French and German.",
           "Write a Python function that returns the factorial of n.",
           "Summarize the plot of Romeo and Juliet in two sentences.",
           "What is 17 times 23? Show your work.", "Give me a recipe for pancakes.",
           "How does a refrigerator keep food cold?", "Describe the water cycle.",
           "Suggest a name for a small coffee shop by the harbour.",
           "What are the main differences between TCP and UDP?",
           "Write a short apology email for missing a meeting.",
           "Explain what a hash table is and when to use one.", "Who painted the Mona Lisa?",
           "List the planets of the solar system in order from the sun.",
           "Write a limerick about a cat who loves cheese.",
           "What causes the seasons on Earth?", "Give three tips for a job interview.",
           "Convert 100 degrees Fahrenheit to Celsius.", "Why do leaves change colour in autumn?"]


def model_folder(root: Path, shape: dict, vocab: int) -> Path:
    """``root`` holding the config.json of a Qwen3-MoE model of ``shape`` and ``vocab`` (no weights)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=vocab, architectures=["Qwen3MoeForCausalLM"], **shape).save_pretrained(root)
    return root


def bundled_vocab() -> int:
    return json.loads((bundled_model_dir() / "config.json").read_text())["vocab_size"]


class Clock:
    """Seconds and calls per piece of rank 0's MoE layers (and decoder layers) while ``active``;
    ``counts``: a copy of every timed MoE forward's expert_tokens, per layer call, in order."""

    def __init__(self) -> None:
        self.active = False
        self.seconds = dict.fromkeys(PIECES, 0.0)
        self.calls = dict.fromkeys(PIECES, 0)
        self.counts: list[torch.Tensor] = []

    def add(self, piece: str, s: float) -> None:
        self.seconds[piece] += s
        self.calls[piece] += 1

    def reset(self) -> None:
        self.active = False
        self.seconds = dict.fromkeys(PIECES, 0.0)
        self.calls = dict.fromkeys(PIECES, 0)
        self.counts = []


CLOCK = Clock()


def timed_moe_forward(block: MoEBlock, x: torch.Tensor, clock: Clock) -> torch.Tensor:
    """``MoEBlock.forward`` step by step (router, count, EP mask, fused_moe, all-reduce, shared
    expert: the same functions), each piece's seconds added to ``clock``. Not for data-parallel
    blocks (this benchmark has none)."""
    assert getattr(block, "data_parallel", None) is None, "the data-parallel path is not timed here"
    t0 = time.perf_counter()
    weights, ids = route(block.moe, block.gate, x)  # each [T, k]
    flat = ids.flatten()
    block.expert_tokens.zero_().index_add_(0, flat, torch.ones_like(flat))
    if block.expert_parallel:  # dispatch: this rank's experts' pairs; the others' skipped (id E_local)
        local = ids - block.experts.start
        ids = torch.where((local >= 0) & (local < block.experts.size), local, block.experts.size)
    t1 = time.perf_counter()
    y = fused_moe(x, block.w13, block.w2, ids, weights)  # [T, H]: this rank's partial sums
    t2 = time.perf_counter()
    if block.group.size > 1:
        y = block.group.all_reduce(y)
    t3 = time.perf_counter()
    if block.shared_gated:
        y = y + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    elif block.has_shared:
        y = y + block.shared_expert(x)
    t4 = time.perf_counter()
    clock.add("dispatch", t1 - t0)
    clock.add("experts", t2 - t1)
    clock.add("combine", t3 - t2)
    clock.add("layer", t4 - t0)
    clock.counts.append(block.expert_tokens.clone())
    return y


def install(clock: Clock) -> Callable[[], None]:
    """Time rank 0's MoE blocks and decoder layers while ``clock.active`` (this process only:
    rank 1 runs the engine's own); returns what puts the engine's methods back."""
    moe_forward, layer_forward = MoEBlock.forward, DecoderLayer.forward

    def moe(self, x):
        return timed_moe_forward(self, x, clock) if clock.active else moe_forward(self, x)

    def layer(self, *args, **kwargs):
        if not clock.active:
            return layer_forward(self, *args, **kwargs)
        t0 = time.perf_counter()
        out = layer_forward(self, *args, **kwargs)
        clock.add("decoder_layer", time.perf_counter() - t0)
        return out

    MoEBlock.forward, DecoderLayer.forward = moe, layer  # type: ignore[method-assign]

    def uninstall() -> None:
        MoEBlock.forward, DecoderLayer.forward = moe_forward, layer_forward  # type: ignore[method-assign]
    return uninstall


def max_over_mean(counts: torch.Tensor) -> float:
    """max / mean of ``counts`` (the expert_load_imbalance ratio)."""
    c = counts.float()
    return float(c.max() / c.mean())


def uniform_imbalance(tokens: int, experts: int, k: int, draws: int = 200, seed: int = 0) -> float:
    """Median max / mean tokens per expert when each of ``tokens`` picks ``k`` distinct experts
    uniformly at random: the imbalance of chance alone."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.flatten()
        out.append(max_over_mean(torch.bincount(ids, minlength=experts)))
    return statistics.median(out)


def rank_pairs(counts: torch.Tensor, ranks: int) -> list[int]:
    """Pairs each of ``ranks`` EP ranks runs, from one layer's expert counts [E]."""
    return [int(c.sum()) for c in counts.view(ranks, -1)]


def spread(medians: list[float]) -> float:
    """max / min of a configuration's run medians (1.0: the runs agree)."""
    return max(medians) / min(medians) if medians and min(medians) > 0 else float("nan")


def per_layer(clock: Clock, steps: int, moe_layers: int, layers: int) -> dict[str, float]:
    """Microseconds per MoE layer (per decoder layer for decoder_layer) and step."""
    out = {}
    for piece in PIECES:
        n = (layers if piece == "decoder_layer" else moe_layers) * steps
        out[f"{piece}_us"] = round(clock.seconds[piece] / max(1, n) * 1e6, 1)
    return out


def prompt_imbalance(engine, tokenize, experts: int, k: int) -> dict:
    """The bundled prompts through the EP=1 engine as one prefill step (one forward): the
    engine's expert_load_imbalance per layer, beside uniform routing of as many tokens."""
    ids = [tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=1)
    CLOCK.reset()
    CLOCK.active = True
    for i, p in enumerate(ids):
        engine.add_request(f"imb-{i}", engine.prompt_ref(p), params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    CLOCK.active = False
    tokens = sum(map(len, ids))
    per_layer_ratio = expert_load_imbalance(engine.runner.model)  # the last forward's (the engine's metric)
    one_forward = len(CLOCK.counts) == len(per_layer_ratio) and all(int(c.sum()) == tokens * k for c in CLOCK.counts)
    counts = torch.stack(CLOCK.counts[-len(per_layer_ratio):])  # [MoE layers, E] of that forward
    return {"prompts": len(ids), "tokens": tokens, "steps": steps, "one_forward": one_forward,
            "max_over_mean_per_layer": {str(layer): round(r, 3) for layer, r in per_layer_ratio.items()},
            "max_over_mean_mean": round(statistics.mean(per_layer_ratio.values()), 3),
            "uniform_random_routing": round(uniform_imbalance(tokens, experts, k), 3),
            "tokens_per_expert_per_layer": counts.tolist(),
            "ep2_pairs_per_rank_per_layer": [rank_pairs(c, 2) for c in counts],
            "weights": "random (load_format dummy): the router is random, not trained"}


def decode_routing(counts: list[torch.Tensor], ranks: int) -> dict[str, float]:
    """Over the timed decode forwards' expert counts: mean max/mean per expert, and for two EP
    ranks mean max/mean pairs per rank."""
    if not counts:
        return {}
    out = {"expert_max_over_mean": round(statistics.mean(max_over_mean(c) for c in counts), 3)}
    if ranks > 1:
        out["rank_pairs_max_over_mean"] = round(statistics.mean(max_over_mean(torch.tensor(rank_pairs(c, ranks)))
                                                                for c in counts), 3)
    return out


def plot(result: dict, path: Path) -> str | None:
    """Stacked bars per configuration and batch (dispatch, experts, combine, rest of the MoE
    layer) with the step time above, and the prompts' imbalance per layer. None: written;
    else why not."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(4.2 * (len(batches) + 1), 4))
    colors = {"dispatch": "tab:blue", "experts": "tab:orange", "combine": "tab:red", "rest": "tab:gray"}
    for ax, b in zip(axes, batches):
        rows = [r for r in result["rows"] if r["batch"] == b]
        for i, r in enumerate(rows):
            bottom = 0.0
            parts = {p: r["moe_layer"][f"{p}_us"] for p in ("dispatch", "experts", "combine")}
            parts["rest"] = max(0.0, r["moe_layer"]["layer_us"] - sum(parts.values()))
            for p, v in parts.items():
                ax.bar(i, v / 1e3, bottom=bottom, color=colors[p], label=p if i == 0 else None)
                bottom += v / 1e3
            ax.text(i, bottom, f"step {r['step_ms']:.1f} ms", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the step labels
        ax.set_xticks(range(len(rows)), [r["config"] for r in rows])
        ax.set_ylabel("ms per MoE layer (rank 0)")
        ax.set_title(f"decode batch {b}")
        ax.legend(fontsize=8)
    imb = result["prompt_imbalance"]
    layers = list(imb["max_over_mean_per_layer"])
    axes[-1].bar(range(len(layers)), list(imb["max_over_mean_per_layer"].values()), color="tab:green")
    axes[-1].axhline(imb["uniform_random_routing"], color="k", ls="--", label="uniform random routing")
    axes[-1].set_xticks(range(len(layers)), layers)
    axes[-1].set_xlabel("layer")
    axes[-1].set_ylabel("max / mean tokens per expert")
    axes[-1].set_title(f"{imb['tokens']} prompt tokens, random router")
    axes[-1].legend(fontsize=8)
    fig.suptitle("MoE decode on the CPU: EP=1 vs TP=2 (columns) vs EP=2 (whole experts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7, help="runs per configuration and batch size, alternating")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="a tiny model, 1 run of 2 steps: checks the script runs")
    ap.add_argument("--out", default=str(RESULTS / "moe_ep_cpu.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.prompt_len = 1, 2, 8
    shape = QUICK_SHAPE if args.quick else SHAPE
    out = Path(args.out)
    from splitserve.benchmarks.loadgen.bench.datasets import load_tokenizer

    tok = load_tokenizer(None)
    vocab = bundled_vocab()
    uninstall = install(CLOCK)
    load_before = os.getloadavg()[0]
    all_cpus = os.sched_getaffinity(0)
    rows, problems = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), shape, vocab)
        base = dict(model=str(folder), load_format="dummy", kv_cache_memory=64 << 20, block_size=16, num_threads=1,
                    max_num_seqs=max(*args.batches, len(PROMPTS)))  # the prompts' prefill: one step
        engines, cpus = {}, {}
        t0 = time.perf_counter()
        try:
            for name in args.configs:
                ranks, ep = CONFIGS[name]
                pin_process(all_cpus)  # a child rank inherits this: it must see every core to pin its own
                engines[name] = EngineCore(EngineConfig(**base, tensor_parallel_size=ranks, enable_expert_parallel=ep))
                # rank 0 of two pinned this process to its core; one rank runs on that core too
                cpus[name] = os.sched_getaffinity(0) if ranks > 1 else (rank_cpus(0, 2, torch.device("cpu"))
                                                                         or all_cpus)
                pin_process(all_cpus)
            print(f"built {', '.join(engines)} in {time.perf_counter() - t0:.1f} s", flush=True)
            cfg = next(iter(engines.values())).model_config
            assert cfg.moe is not None
            moe_layers = sum(cfg.moe.is_sparse(i) for i in range(cfg.num_layers))
            for b in args.batches:
                for name, e in engines.items():  # warm-up
                    pin_process(cpus[name])
                    engine_decode(e, token_prompts(b, 8, vocab, 999), 2)
                medians: dict[str, list[float]] = {n: [] for n in engines}
                times: dict[str, list[float]] = {n: [] for n in engines}
                pieces: dict[str, list[dict[str, float]]] = {n: [] for n in engines}  # per run
                counts: dict[str, list[torch.Tensor]] = {n: [] for n in engines}
                for rep in range(args.reps):
                    for name, e in engines.items():
                        pin_process(cpus[name])
                        CLOCK.reset()
                        t = engine_decode(e, token_prompts(b, args.prompt_len, vocab, rep), args.steps,
                                          lambda: setattr(CLOCK, "active", True))
                        CLOCK.active = False
                        times[name] += t
                        medians[name].append(statistics.median(t))
                        pieces[name].append(per_layer(CLOCK, len(t), moe_layers, cfg.num_layers))
                        counts[name] += CLOCK.counts
                        pin_process(all_cpus)
                for name in engines:
                    ranks = CONFIGS[name][0]
                    layer = {k: round(statistics.median(run[k] for run in pieces[name]), 1) for k in pieces[name][0]}
                    step_ms = statistics.median(medians[name]) * 1e3
                    moe_ms = layer["layer_us"] * moe_layers / 1e3
                    row = {"config": name, "batch": b, "ranks": ranks, "expert_parallel": CONFIGS[name][1],
                           "step_ms": round(step_ms, 2), "moe_layers_ms_per_step": round(moe_ms, 2),
                           "moe_share_of_step": round(moe_ms / step_ms, 3), "moe_layer": layer,
                           "routing": decode_routing(counts[name], ranks if CONFIGS[name][1] else 1),
                           "steps": len(times[name]), "run_medians_ms": [round(m * 1e3, 2) for m in medians[name]],
                           "spread": round(spread(medians[name]), 3)}
                    if row["spread"] > SPREAD_LIMIT:
                        problems.append(f"{name} batch {b}: run medians {row['spread']}x apart "
                                        f"(limit {SPREAD_LIMIT})")
                    rows.append(row)
                    print(f"[{name} b={b}] step {row['step_ms']} ms, MoE {row['moe_share_of_step']:.0%} of it; per "
                          f"MoE layer: dispatch {layer['dispatch_us']} us, experts {layer['experts_us']} us, "
                          f"combine {layer['combine_us']} us, layer {layer['layer_us']} us (decoder layer "
                          f"{layer['decoder_layer_us']} us); spread {row['spread']}x", flush=True)
            first = engines.get("ep1") or next(iter(engines.values()))
            pin_process(cpus["ep1" if "ep1" in engines else next(iter(engines))])
            imbalance = prompt_imbalance(first, tok.encode, cfg.moe.num_experts, cfg.moe.top_k)
            pin_process(all_cpus)
        finally:
            for e in engines.values():
                e.close()
            uninstall()
    print(f"bundled prompts ({imbalance['tokens']} tokens, one forward: {imbalance['one_forward']}): max/mean "
          f"tokens per expert per layer {imbalance['max_over_mean_per_layer']} vs {imbalance['uniform_random_routing']}"
          " for uniform random routing (random weights: not a trained router)", flush=True)
    floor: dict[int, float] = {}
    if any(CONFIGS[n][0] > 1 for n in args.configs):
        floor = {b: round(us, 1) for b, us in all_reduce_floor(shape["hidden_size"], args.batches, 200).items()}
        for b in args.batches:
            print(f"batch {b}: gloo all-reduce of [{b}, {shape['hidden_size']}] between two processes doing "
                  f"nothing else: {floor[b]} us", flush=True)
    load_after = os.getloadavg()[0]
    sustained = not problems
    result = {
        "config": vars(args),
        "model": {"family": "Qwen3MoeForCausalLM", "shape": shape, "vocab": vocab, "weights": "dummy (random)",
                  "dtype": "float32", "moe_layers": moe_layers, "layers": cfg.num_layers},
        "configs": {n: {"ranks": CONFIGS[n][0], "expert_parallel": CONFIGS[n][1], "threads_per_rank": 1}
                    for n in args.configs},
        "what": {"step_ms": "median engine decode step (scheduler, forward over the paged KV cache, sampling)",
                 "moe_layer": "rank 0's microseconds per MoE layer per step: dispatch (router gate, softmax, "
                              "top-k, expert count, EP mask), experts (fused_moe), combine (all-reduce, incl. "
                              "waiting for rank 1), layer (whole MoE block); decoder_layer_us: per decoder layer",
                 "all_reduce_floor_us": "one gloo all-reduce of [batch, hidden] fp32, two pinned processes, no "
                                        "compute, median of 200 (on this VM mostly a halted vCPU's wake-up)",
                 "routing": "decode forwards: mean max/mean tokens per expert; for ep2 max/mean pairs per rank"},
        "cores": len(all_cpus), "load_average_1m": {"before": round(load_before, 2), "after": round(load_after, 2)},
        "rows": rows, "prompt_imbalance": imbalance, "all_reduce_floor_us": floor,
        "sustained": sustained, "problems": problems,
        "note": "" if sustained else "NOT SUSTAINED on this machine: run medians spread too far; the figures are "
                                     "not this code's",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    why = plot(result, out.with_suffix(".png"))
    print(why or f"wrote {out.with_suffix('.png')}")
    print("sustained" if sustained else "NOT SUSTAINED: " + "; ".join(problems))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

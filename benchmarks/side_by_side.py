"""Real clusters, the same workloads, side by side: what compare_serving.py (roles on
CPUs) and bench_gpu_serving.py (one GPU) share.

    Workload         what one workload sends: specs, send offsets, concurrency cap
    mixed_workload   short prompts decoding as a closed loop while long prompts arrive
    warm_endpoint    check an endpoint serves the model, send the warm-up requests
    run_workload     one workload against it -> (RunResult, Summary)
    node_counters    chosen counters summed over a cluster's nodes (their /metrics)
    check_alive      raise, with its last lines, when a member died during a run
    pool             every round's requests of a setup and workload as one run

Must not start or stop clusters (the scripts do, through deploy/launcher.py) or judge
the figures.
"""

from __future__ import annotations

import random
import urllib.request
from typing import NamedTuple

from splitserve.benchmarks.serve import Endpoint, RequestSpec, RunResult, Summary, check_endpoint, run, summarize
from splitserve.benchmarks.serve.arrivals import fixed_offsets
from splitserve.benchmarks.serve.datasets import Tokenizer, random_specs
from splitserve.deploy.launcher import Cluster


class Workload(NamedTuple):
    specs: list[RequestSpec]
    offsets: list[float]  # seconds from the start, one per spec
    cap: int | dict[str, int] | None  # in flight: one cap, or per tag (runner.py)
    send_text: bool = False  # completions: text prompts instead of token ids


class MixedShape(NamedTuple):
    """The mixed workload: ``short`` requests of ``short_input`` -> ``short_output`` tokens
    as a closed loop of ``short_concurrency`` streams; ``long`` prompts of ``long_input``
    tokens (``long_output`` generated), one every ``long_interval`` s from ``long_start``."""
    short: int
    short_concurrency: int
    short_input: int
    short_output: int
    long: int
    long_input: int
    long_output: int
    long_start: float
    long_interval: float


def mixed_workload(rng: random.Random, tok: Tokenizer, shape: MixedShape) -> Workload:
    """Token-id prompts (exact lengths), tagged "short" and "long"; shorts drawn first."""
    s = shape
    short = random_specs(rng, tok, s.short, s.short_input, s.short_output, tag="short")
    long = random_specs(rng, tok, s.long, s.long_input, s.long_output, tag="long")
    return Workload(short + long, [0.0] * len(short) + fixed_offsets(len(long), s.long_interval, s.long_start),
                    {"short": s.short_concurrency})


async def warm_endpoint(url: str, tok: Tokenizer, warmup: list[RequestSpec], model: str | None = None) -> Endpoint:
    """The endpoint at ``url`` (/v1) serving ``model`` (None: the first it lists), after
    ``warmup`` was sent to it all at once (load, compile, touch; not measured)."""
    model = await check_endpoint(url, model)
    ep = Endpoint(url, model, "completions", ignore_eos=True)
    await run(ep, warmup, [0.0] * len(warmup), tok.decode, progress=False)
    return ep


async def run_workload(ep: Endpoint, name: str, w: Workload, tok: Tokenizer,
                       progress: bool = True) -> tuple[RunResult, Summary]:
    r = await run(ep._replace(send_text=w.send_text), w.specs, w.offsets, tok.decode, w.cap,
                  progress=progress, desc=name)
    return r, summarize(r.results, r.duration_s)


def node_counters(c: Cluster, prefixes: tuple[str, ...]) -> dict[str, float]:
    """{'name{labels}': value} of the series starting with ``prefixes``, summed over the
    cluster's nodes (the routers left out)."""
    out: dict[str, float] = {}
    for p in c.procs:
        if p.role == "router":
            continue
        with urllib.request.urlopen(f"{p.addr}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(prefixes):
                    key, value = line.rsplit(" ", 1)
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def check_alive(c: Cluster) -> None:
    """Raise RuntimeError naming every member that exited, with its last lines: its
    figures are not the setup's."""
    dead = [p for p in c.procs if p.popen.poll() is not None]
    if dead:
        raise RuntimeError("; ".join(
            f"{p.name} exited with status {p.popen.returncode} during the run (negative: killed "
            "by that signal), its last lines:\n  " + "\n  ".join(p.log[-15:]) for p in dead))


def pool(rounds: list[dict]) -> dict:
    """Rounds of {setup: {workload: (RunResult, Summary)}} -> the same with every round's
    requests of a setup and workload as one run (durations added)."""
    out: dict[str, dict] = {}
    for got in rounds:
        for setup, loads in got.items():
            for w, (r, _) in loads.items():
                prev = out.setdefault(setup, {}).get(w)
                out[setup][w] = r if prev is None else RunResult(prev.results + r.results,
                                                                 prev.duration_s + r.duration_s)
    return {s: {w: (r, summarize(r.results, r.duration_s)) for w, r in loads.items()}
            for s, loads in out.items()}

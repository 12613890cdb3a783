"""Workloads for ``splitserve plan`` and ``make-trace --phase``: a rate with input and
output length distributions, in phases.

    Phase(duration_s, rate, input_mean, output_mean, sigma)
        requests arrive Poisson at ``rate`` per second for ``duration_s``; input and output
        lengths are lognormal around their means (sigma 0: fixed), cut to the context
    "DURATION:RATE:IN:OUT[:SIGMA]"   one phase on the command line (parse_phase)

Every request gets hash ids of its own (a trace block each, ``HASH_BLOCK`` tokens), so
no two share a prefix: the planner's model counts no cache hit, and neither does a
replay of the trace. ``PRESETS`` names the workloads the planner benchmarks use (rates
for the llama3-8b-h100 profile; ``--rate-scale`` stretches them). Deterministic in
``seed``. Must not talk to a cluster.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ....common.trace import HASH_BLOCK, TraceRequest
from .fleetsim import Req


@dataclass(frozen=True, slots=True)
class Phase:
    duration_s: float
    rate: float  # requests per second
    input_mean: int
    output_mean: int
    sigma: float = 0.5  # lognormal sigma of both lengths

    def __post_init__(self):
        if self.duration_s <= 0 or self.rate <= 0:
            raise ValueError(f"phase: duration and rate must be > 0, got {self.duration_s} s at {self.rate}/s")
        if self.input_mean < 1 or self.output_mean < 1 or self.sigma < 0:
            raise ValueError("phase: input and output means must be >= 1 and sigma >= 0")


def parse_phase(text: str) -> Phase:
    """``DURATION:RATE:IN:OUT[:SIGMA]`` (seconds, requests/s, mean tokens) -> Phase."""
    parts = text.split(":")
    try:
        if len(parts) not in (4, 5):
            raise ValueError
        return Phase(float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3]),
                     *([float(parts[4])] if len(parts) == 5 else []))
    except ValueError as e:
        detail = f": {e}" if str(e) else ""
        raise ValueError(f"--phase {text!r}: use DURATION:RATE:IN:OUT[:SIGMA] (seconds, requests/s, "
                         f"mean input and output tokens){detail}") from None


# name -> phases: two minutes each, at rates that need a few llama3-8b-h100 nodes (with
# TTFT p90 <= 1 s, ITL p90 <= 15 ms: 3P:1D, 1P:2D and 2P:2D; benchmarks/planner/bench_plan.py).
PRESETS: dict[str, tuple[Phase, ...]] = {
    "prompt-heavy": (Phase(120, 12.0, 6000, 40, 0.4),),  # long documents, short answers
    "output-heavy": (Phase(120, 10.0, 300, 900, 0.4),),  # short questions, long answers
    "mixed": (Phase(120, 9.0, 3500, 250, 0.5),),  # chat with some context
}


def generate(phases: tuple[Phase, ...] | list[Phase], seed: int = 0, context: int = 131072,
             rate_scale: float = 1.0) -> list[TraceRequest]:
    """The requests of ``phases`` one after the other, in the trace format; input +
    output lengths fit ``context``."""
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    out: list[TraceRequest] = []
    start = 0.0
    for ph in phases:
        t = start + float(rng.exponential(1.0 / (ph.rate * rate_scale)))
        while t < start + ph.duration_s:
            isl = _lognormal(rng, ph.input_mean, ph.sigma)
            osl = _lognormal(rng, ph.output_mean, ph.sigma)
            osl = min(osl, context // 2)
            isl = max(1, min(isl, context - osl))
            out.append(TraceRequest(timestamp=round(t * 1000, 3), input_length=isl, output_length=osl,
                                    hash_ids=[next(ids) for _ in range(-(-isl // HASH_BLOCK))]))
            t += float(rng.exponential(1.0 / (ph.rate * rate_scale)))
        start += ph.duration_s
    return out


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    if sigma == 0:
        return max(1, round(mean))
    return max(1, int(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma)))


def as_reqs(trace: list[TraceRequest]) -> list[Req]:
    """The model's view of a trace: arrival seconds from its first request, lengths."""
    t0 = trace[0].timestamp if trace else 0.0
    return [Req((r.timestamp - t0) / 1000, r.input_length, r.output_length) for r in trace]

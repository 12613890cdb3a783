"""Request results -> `Summary`: latency percentiles, throughput, goodput, cache share.

Definitions (per successful request; milliseconds in the summary):
    TTFT   send -> first chunk carrying text
    TPOT   (E2E - TTFT) / (output_tokens - 1), for requests with >= 2 output tokens
    ITL    every gap between consecutive text chunks, pooled over requests
    E2E    send -> end of stream
    throughput      completed requests and output tokens per second of the run
    goodput         requests/s meeting both SLO bounds (TTFT <= t and TPOT <= p;
                    a 1-token answer has no TPOT and meets that bound)
    cached share    usage cached_tokens / prompt_tokens, summed over requests
Failed requests count in ``failed`` and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from splitserve.deploy.planner.slo import Slo

from .client import RequestResult


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    total_input_tokens: int
    total_output_tokens: int
    cached_tokens: int
    cached_share: float  # cached / input tokens, in [0, 1]
    usage_reported: int  # requests whose stream ended with a usage chunk
    ttft_ms: dict[str, float]  # "mean", "p50", ... ; empty when nothing completed
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    slo: dict[str, float] | None = None  # {"ttft_ms", "tpot_ms"}
    good_requests: int | None = None
    goodput: float | None = None  # good requests / s
    errors: dict[str, int] = field(default_factory=dict)  # message -> count (first 5 kinds)
    by_tag: dict[str, "Summary"] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["by_tag"] = {k: v.to_dict() for k, v in self.by_tag.items()}
        return d


def stats_ms(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """{"mean": ..., "p50": ..., ...} in milliseconds; {} for no values."""
    if not values_s:
        return {}
    a = np.asarray(values_s) * 1000.0
    out = {"mean": float(a.mean())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def is_good(r: RequestResult, slo: Slo) -> bool:
    tpot = r.tpot_s  # the SLO's ITL: a request's mean inter-token latency
    return r.ok and r.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.itl_s)


def slo_ms(slo: Slo) -> dict[str, float]:
    """The goodput bounds as bench's summary and JSON name them (vLLM's keys), milliseconds."""
    return {"ttft_ms": round(slo.ttft_s * 1000, 6), "tpot_ms": round(slo.itl_s * 1000, 6)}


def summarize(results: list[RequestResult], duration_s: float, slo: Slo | None = None,
              percentiles: tuple[float, ...] = (50.0, 90.0, 99.0), by_tag: bool = True) -> Summary:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    rate = lambda x: x / duration_s if duration_s > 0 else math.nan
    good = sum(is_good(r, slo) for r in ok) if slo is not None else None
    errors = Counter(r.error for r in results if not r.ok)
    tags = sorted({r.tag for r in results})
    return Summary(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        request_throughput=rate(len(ok)), output_throughput=rate(n_out),
        total_token_throughput=rate(n_in + n_out), total_input_tokens=n_in,
        total_output_tokens=n_out, cached_tokens=cached, cached_share=cached / n_in if n_in else 0.0,
        usage_reported=sum(r.usage_reported for r in ok),
        ttft_ms=stats_ms([r.ttft_s for r in ok], percentiles),
        tpot_ms=stats_ms([t for r in ok if (t := r.tpot_s) is not None], percentiles),
        itl_ms=stats_ms([x for r in ok for x in r.itl_s], percentiles),
        e2e_ms=stats_ms([r.e2e_s for r in ok], percentiles),
        slo=slo_ms(slo) if slo is not None else None, good_requests=good,
        goodput=rate(good) if good is not None else None,
        errors=dict(errors.most_common(5)),
        by_tag={t: summarize([r for r in results if r.tag == t], duration_s, slo, percentiles,
                             by_tag=False) for t in tags} if by_tag and len(tags) > 1 else {})

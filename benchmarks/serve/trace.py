"""A routing trace -> `RequestSpec`s on its schedule, for ``--dataset trace:PATH``.

The format, its checks and the expansion of hash ids into token blocks are the
replay's (``benchmarks/replay/trace.py``), so ``splitserve bench`` and ``splitserve
replay`` send the same prompts for the same trace.
"""

from __future__ import annotations

from pathlib import Path

from ..replay.trace import load_trace, prompt_tokens
from .datasets import RequestSpec


def trace_specs(path: Path, vocab_size: int, limit: int | None,
                time_scale: float = 1.0) -> list[RequestSpec]:
    """The first ``limit`` requests (None: all) by timestamp, each sent at its
    timestamp * ``time_scale`` after the first one's."""
    try:
        requests = load_trace(path)[:limit]
    except ValueError as e:
        raise ValueError(f"--dataset trace:{path}: {e}") from None
    t0 = requests[0].timestamp
    return [RequestSpec(prompt_tokens(r, vocab_size), r.input_length, r.output_length,
                        timestamp_s=(r.timestamp - t0) / 1000 * time_scale) for r in requests]

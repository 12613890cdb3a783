"""A routing trace (JSONL, one request a line) -> `RequestSpec`s on its schedule.

    {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [h0, h1, ...]}

Each hash id stands for one block of ``TRACE_BLOCK_TOKENS`` tokens, the same block in
every request that lists it, so requests sharing leading ids share a prompt prefix.
The prompt is the blocks in order, cut to ``input_length``; a prompt longer than its
blocks is padded with tokens of its own (seeded by its line number).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from splitserve.benchmarks.serve.datasets import RequestSpec, random_tokens

TRACE_BLOCK_TOKENS = 512


def block_tokens(hash_id: int, vocab_size: int) -> list[int]:
    """The fixed token block of ``hash_id``: the same in every process and run."""
    return random_tokens(random.Random(f"trace-block-{hash_id}"), TRACE_BLOCK_TOKENS, vocab_size)


def expand(hash_ids: list[int], input_length: int, vocab_size: int, line: int) -> list[int]:
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= input_length:
            break
        ids += block_tokens(h, vocab_size)
    if len(ids) < input_length:
        ids += random_tokens(random.Random(f"trace-tail-{line}"), input_length - len(ids), vocab_size)
    return ids[:input_length]


def trace_specs(path: Path, vocab_size: int, limit: int | None,
                time_scale: float = 1.0) -> list[RequestSpec]:
    """The first ``limit`` lines (None: all), sent at ``timestamp * time_scale`` after the
    first line's timestamp."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise ValueError(f"--dataset trace:{path}: {e}") from e
    specs, t0 = [], None
    for i, ln in enumerate(lines[:limit] if limit else lines):
        try:
            row = json.loads(ln)
            ts, n_in, n_out = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
            hash_ids = [int(h) for h in row.get("hash_ids", [])]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--dataset trace:{path}: line {i + 1} is not a trace record "
                             f"({{timestamp, input_length, output_length, hash_ids}}): {e}") from e
        if n_in < 1 or n_out < 1:
            raise ValueError(f"--dataset trace:{path}: line {i + 1}: input_length and "
                             "output_length must be >= 1")
        t0 = ts if t0 is None else t0
        ids = expand(hash_ids, n_in, vocab_size, i)
        specs.append(RequestSpec(ids, n_in, n_out, timestamp_s=(ts - t0) / 1000 * time_scale))
    if not specs:
        raise ValueError(f"--dataset trace:{path}: the file has no records")
    return specs

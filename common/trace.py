"""The routing trace: one JSON object per line,

    {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}
    optional: "conversation": id, "think_ms": ms  (turns of one conversation: TraceRequest)

Each hash id stands for one block of ``hash_block`` prompt tokens (the trace's
block size, ``--trace-block-size``, default ``HASH_BLOCK`` = 512 as in the published
Mooncake traces) shared by every request that lists it. The node's own, smaller KV
block size then cuts each expanded block again (512 = 32 blocks of 16): a hash id
shared by two requests is a run of identical node blocks. A request's prompt is its ids expanded in order, each
into a fixed deterministic token block, the last cut to ``input_length``:

    hash_ids     [ 7 ][ 7 ][ 12 ][ 40 ]          (4 ids -> 1537..2048 tokens)
    tokens       |512 |512 |512 |cut |
                  tokens_of(7) is the same list in every request and every run

Owns: parsing with errors that name the line and field, the expansion, the
oracle hit rate (one shared cache that never evicts: a block hits when any earlier
request listed its id), the hit rate of one shared LRU cache of a given size, and a
trace's summary figures. Shared by the load tools (make-trace, replay, bench) and the
offline planner (``splitserve plan``). Must not talk to a cluster.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import msgspec
import numpy as np

from .jsonl import read_jsonl

HASH_BLOCK = 512  # prompt tokens per hash id
_SEED = 0x5EED  # the expansion never changes between runs or machines
_TOKEN_LOW, _TOKEN_HIGH = 100, 49000  # clear of the bundled vocabulary's special tokens (at both ends)
BUNDLED_VOCAB = 49152


class TraceRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    timestamp: float  # ms since the trace began
    input_length: int
    output_length: int
    hash_ids: list[int]
    # Optional (written only when set): the conversation this line is a turn of, and for a
    # later turn the user's pause after the previous turn's answer. A replay then sends the
    # turn that long after the answer ended, its prompt holding the answer's real tokens
    # (benchmarks/loadgen/replay/conversation.py); lines without them are sent at timestamp.
    conversation: int | None = None
    think_ms: float = 0.0


def load_trace(path: str | Path, hash_block: int = HASH_BLOCK) -> list[TraceRequest]:
    """Every request of the JSONL file at ``path``, sorted by timestamp. Raises
    ValueError naming the line and the field of the first bad record."""
    if hash_block < 1:
        raise ValueError(f"trace_block_size: must be >= 1, got {hash_block}")
    requests = []
    for number, req in read_jsonl(path, TraceRequest, "trace"):
        _check(req, number, hash_block)
        requests.append(req)
    if not requests:
        raise ValueError(f"trace: {path} holds no request")
    requests.sort(key=lambda r: r.timestamp)
    return requests


def _check(req: TraceRequest, number: int, hash_block: int) -> None:
    where = f"trace line {number}"
    if req.timestamp < 0:
        raise ValueError(f"{where}: timestamp must be >= 0, got {req.timestamp}")
    if req.input_length < 1 or req.output_length < 1:
        raise ValueError(f"{where}: input_length and output_length must be >= 1")
    if req.think_ms < 0:
        raise ValueError(f"{where}: think_ms must be >= 0, got {req.think_ms}")
    need = -(-req.input_length // hash_block)
    if len(req.hash_ids) != need:
        raise ValueError(f"{where}: hash_ids has {len(req.hash_ids)} ids; input_length "
                         f"{req.input_length} needs {need} (one per {hash_block} tokens; "
                         "--trace-block-size sets it)")


def dump_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(msgspec.to_builtins(r)) + "\n")


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, vocab_size: int = BUNDLED_VOCAB,
                 hash_block: int = HASH_BLOCK) -> tuple[int, ...]:
    """The fixed token block of ``hash_id`` for a vocabulary of ``vocab_size``."""
    rng = np.random.default_rng([_SEED, hash_id & 0xFFFFFFFFFFFFFFFF])
    high = min(_TOKEN_HIGH, vocab_size - _TOKEN_LOW)
    return tuple(rng.integers(_TOKEN_LOW, high, hash_block).tolist())


def prompt_tokens(req: TraceRequest, vocab_size: int = BUNDLED_VOCAB,
                  hash_block: int = HASH_BLOCK) -> list[int]:
    """The request's prompt: its hash ids expanded, cut to ``input_length``."""
    tokens: list[int] = []
    for hid in req.hash_ids:
        tokens.extend(block_tokens(hid, vocab_size, hash_block))
    return tokens[:req.input_length]


def prefix_keys(requests: Iterable[TraceRequest]) -> list[list[int]]:
    """Per request, one key per hash id that stands for the id with every id before it:
    two requests share a key exactly where they list the same leading ids (a block's
    KV depends on every token before it, so only such blocks are the same KV)."""
    children: dict[tuple[int, int], int] = {}  # (prefix key, id) -> the longer prefix's key
    keys = []
    for r in requests:
        prefix, own = 0, []
        for hid in r.hash_ids:
            prefix = children.setdefault((prefix, hid), len(children) + 1)
            own.append(prefix)
        keys.append(own)
    return keys


def oracle_hits(requests: Iterable[TraceRequest], hash_block: int = HASH_BLOCK) -> list[int]:
    """Per request, the prompt tokens one shared, never-evicting prefix cache would
    hold: its leading blocks whose ``prefix_keys`` an earlier request listed. (The
    published Mooncake traces number blocks per prefix already, so there this is every
    block whose id was seen before; the generator's shared documents sit after
    per-user prefixes, and an id seen after another prefix is no hit any cache could
    make.)"""
    requests = list(requests)
    seen: set[int] = set()
    hits = []
    for r, keys in zip(requests, prefix_keys(requests)):
        hit = 0
        for i, key in enumerate(keys):
            if key not in seen:
                break
            hit += min(hash_block, r.input_length - i * hash_block)
        seen.update(keys)
        hits.append(hit)
    return hits


def lru_hits(requests: Iterable[TraceRequest], capacity_tokens: int, hash_block: int = HASH_BLOCK) -> list[int]:
    """Per request, the prompt tokens one shared prefix cache of ``capacity_tokens`` would
    hold, evicting the least recently used blocks: its leading blocks (``prefix_keys``) in
    the cache; then every block of the prompt is the most recent, its last block least
    (an engine frees a request's blocks tail first, so a prefix outlives its tails)."""
    requests = list(requests)
    cache: OrderedDict[int, int] = OrderedDict()  # prefix key -> its tokens, least recent first
    held = 0
    hits = []
    for r, keys in zip(requests, prefix_keys(requests)):
        hit = 0
        for i, key in enumerate(keys):
            if key not in cache:
                break
            hit += min(hash_block, r.input_length - i * hash_block)
        hits.append(hit)
        for i in reversed(range(len(keys))):
            tokens = min(hash_block, r.input_length - i * hash_block)
            held += tokens - cache.pop(keys[i], 0)
            cache[keys[i]] = tokens
        while held > capacity_tokens and cache:
            held -= cache.popitem(last=False)[1]
    return hits


def summarize(requests: list[TraceRequest]) -> dict:
    """Trace-level figures printed by ``make-trace`` (and by ``replay``)."""
    total = sum(r.input_length for r in requests)
    span_s = (requests[-1].timestamp - requests[0].timestamp) / 1000 if len(requests) > 1 else 0.0
    lengths = sorted(r.input_length for r in requests)
    return {"requests": len(requests), "span_s": round(span_s, 1),
            "input_p50": lengths[len(lengths) // 2], "input_p90": lengths[int(len(lengths) * 0.9)],
            "input_max": lengths[-1],
            "rate_per_s": round(len(requests) / span_s, 3) if span_s else None,
            "mean_input_tokens": round(total / len(requests), 1),
            "mean_output_tokens": round(sum(r.output_length for r in requests) / len(requests), 1),
            "oracle_hit_rate": round(sum(oracle_hits(requests)) / total, 4)}


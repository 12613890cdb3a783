"""A generator of long-context prefix-group traffic in the trace format (``splitserve
make-trace --preset prefix-groups``): the capacity-bound workload a prefix cache's
host-memory and disk tiers are for (issue 26), and the statistics that say it is one.

    group g:   a context of ~shared_fraction of a prompt (whole hash blocks, ids of the
               group only: a long document, a codebase, an agent's transcript), prompt
               length ~ lognormal around mean_prompt_tokens
    size:      2..max_group requests, P(n) ~ n ** -size_zipf (most groups are pairs,
               a few reach max_group)
    request:   the group's context + a tail of its own (new ids, the rest of the prompt)
    timing:    groups start as a Poisson process over duration_s; each later request of a
               group follows the one before after a reuse gap: a user's next step, ~
               lognormal(gap_s, gap_sigma); in return_share of the groups one of those
               gaps (any) is a return after a break instead, ~ lognormal(return_gap_s,
               gap_sigma). Together a median of about a minute, and a cache that holds
               only the last few minutes misses the returns. No gap exceeds max_gap_s.

        group 7, 3 requests   [ctx][ctx]...[ctx][t1]      t
                              [ctx][ctx]...[ctx][t2 ]     t + gap
                              [ctx][ctx]...[ctx][t3]      t + gap + gap'

Deterministic in ``seed``. ``group_stats`` recomputes the properties from any trace
(groups = requests with the same first hash id): mean prompt, group sizes, the share of
a prompt its group shares, reuse gaps, the working set (distinct prompt tokens) against a
stated KV capacity, and the prompt tokens an unlimited cache and an LRU of that capacity
would serve (trace.py ``oracle_hits``, ``lru_hits``). Must not talk to a cluster.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from splitserve.common.trace import HASH_BLOCK, TraceRequest, lru_hits, oracle_hits, prefix_keys


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """The defaults are the ``prefix-groups`` preset: against 16 ``llama3-8b-h100`` nodes'
    KV pools (6.9M tokens) seeds 0-2 give a working set of 3.0-3.2x, ~15k-token prompts,
    groups of 2 to 20-24 (mean 3.0) sharing 97% of a prompt, a median reuse gap of 55 s;
    an unlimited cache serves 65% of the prompt tokens, an LRU of the 6.9M tokens 47-48%.
    The groups start within 10 minutes and the trace spans ~32 (its last groups' returns):
    a replay at real time takes that long."""
    groups: int = 1300
    duration_s: float = 600.0  # groups start within this window
    mean_prompt_tokens: int = 15500
    length_sigma: float = 0.5  # lognormal sigma of a group's prompt length
    max_prompt_tokens: int = 120000
    shared_fraction: float = 0.97  # of a group's prompt length, rounded to whole hash blocks
    max_group: int = 24
    size_zipf: float = 3.0  # P(n) ~ n ** -size_zipf for n in 2..max_group
    gap_s: float = 40.0  # median gap to the group's next request, without a break
    return_share: float = 0.6  # of the groups: one gap is a return after a break
    return_gap_s: float = 300.0  # median gap of a return
    gap_sigma: float = 0.6  # lognormal sigma of both
    max_gap_s: float = 900.0
    mean_output_tokens: int = 200
    seed: int = 0

    def __post_init__(self):
        for name in ("groups", "mean_prompt_tokens", "mean_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("duration_s", "gap_s", "return_gap_s", "max_gap_s", "length_sigma", "gap_sigma"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.return_share <= 1:
            raise ValueError(f"return_share: must be within [0, 1], got {self.return_share}")
        if not 0 < self.shared_fraction < 1:
            raise ValueError(f"shared_fraction: must be within (0, 1), got {self.shared_fraction}")
        if self.max_group < 2:
            raise ValueError(f"max_group: must be >= 2, got {self.max_group}")
        if self.max_prompt_tokens < 2 * HASH_BLOCK:
            raise ValueError(f"max_prompt_tokens: must be >= {2 * HASH_BLOCK}, got {self.max_prompt_tokens}")


def generate_groups(spec: GroupSpec) -> list[TraceRequest]:
    """The trace of ``spec``, sorted by timestamp."""
    rng = np.random.default_rng(spec.seed)
    ids = itertools.count()
    sizes = np.arange(2, spec.max_group + 1)
    p = sizes.astype(float) ** -spec.size_zipf
    p /= p.sum()

    def lognormal(mean: float, sigma: float) -> float:
        return float(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma))

    out: list[TraceRequest] = []
    starts = np.sort(rng.uniform(0.0, spec.duration_s, spec.groups))  # a Poisson process, conditioned on its count
    for t in starts:
        length = min(spec.max_prompt_tokens, max(2 * HASH_BLOCK, int(lognormal(spec.mean_prompt_tokens,
                                                                                spec.length_sigma))))
        shared = max(1, round(spec.shared_fraction * length / HASH_BLOCK))  # whole blocks of the context
        context = [next(ids) for _ in range(shared)]
        tail_mean = max(16.0, length - shared * HASH_BLOCK)
        at = float(t)
        n = int(rng.choice(sizes, p=p))
        back = int(rng.integers(1, n)) if rng.random() < spec.return_share else 0  # the return's request
        for k in range(n):
            if k:
                median = spec.return_gap_s if k == back else spec.gap_s
                at += min(spec.max_gap_s, float(rng.lognormal(math.log(median), spec.gap_sigma)))
            tail = max(16, int(lognormal(tail_mean, 0.3)))
            prompt = shared * HASH_BLOCK + tail
            out.append(TraceRequest(timestamp=round(at * 1000, 3), input_length=prompt,
                                    output_length=max(1, int(lognormal(spec.mean_output_tokens, 0.5))),
                                    hash_ids=context + [next(ids) for _ in range(-(-tail // HASH_BLOCK))]))
    out.sort(key=lambda r: r.timestamp)
    return out


def group_stats(requests: list[TraceRequest], capacity_tokens: int, hash_block: int = HASH_BLOCK) -> dict:
    """The trace's prefix-group properties, from the trace alone: requests with the same
    first hash id form a group; its shared prefix is the hash ids every member lists
    first. ``capacity_tokens``: a KV capacity to measure the working set against (e.g. a
    fleet's KV pools together), and the size of the LRU cache whose hits are reported."""
    groups: dict[int, list[TraceRequest]] = {}
    for r in requests:
        groups.setdefault(r.hash_ids[0], []).append(r)
    shared: list[float] = []
    gaps: list[float] = []
    for members in groups.values():
        common = len(members[0].hash_ids)
        for m in members[1:]:
            common = min(common, next((i for i, (a, b) in enumerate(zip(members[0].hash_ids, m.hash_ids)) if a != b),
                                      min(len(m.hash_ids), common)))
        shared.extend(min(common * hash_block, m.input_length) / m.input_length for m in members)
        gaps.extend((b.timestamp - a.timestamp) / 1000 for a, b in zip(members, members[1:]))
    keys = prefix_keys(requests)
    block_tokens: dict[int, int] = {}  # distinct prefix key -> the tokens of its block
    for r, own in zip(requests, keys):
        for i, key in enumerate(own):
            block_tokens[key] = min(hash_block, r.input_length - i * hash_block)
    total = sum(r.input_length for r in requests)
    sizes = sorted(len(m) for m in groups.values())
    working = sum(block_tokens.values())
    return {
        "requests": len(requests), "groups": len(groups),
        "mean_prompt_tokens": round(total / len(requests), 1),
        "group_size_min": sizes[0], "group_size_max": sizes[-1],
        "group_size_mean": round(statistics.fmean(sizes), 3), "group_size_p50": sizes[len(sizes) // 2],
        "shared_fraction_mean": round(statistics.fmean(shared), 4),
        "reuse_gap_p50_s": round(statistics.median(gaps), 1) if gaps else None,
        "reuse_gap_p90_s": round(float(np.percentile(gaps, 90)), 1) if gaps else None,
        "working_set_tokens": working, "capacity_tokens": capacity_tokens,
        "working_set_over_capacity": round(working / capacity_tokens, 3),
        "unlimited_hit_rate": round(sum(oracle_hits(requests, hash_block)) / total, 4),
        "capacity_lru_hit_rate": round(sum(lru_hits(requests, capacity_tokens, hash_block)) / total, 4),
    }

"""Which KV heads each rank of a tensor-parallel node holds.

Owns the one rule every process applies (the engine when it shards the model, the KV
transports when they cut a transfer, the router when it checks a pair): ``rank_heads``,
``check_tp`` and ``HeadRange``. Must not: import torch, or know about transfers (the
transfer plan is ``kvtransfer/tp_plan.py``).

With ``H`` KV heads and tensor parallelism ``t`` (vLLM's rule)::

    H >= t (H % t == 0): rank r holds heads [r*H/t, (r+1)*H/t)          sharded
    H <  t (t % H == 0): rank r holds head   r // (t/H)                   replicated t/H times

    H=8, t=2:  rank 0 [0..3]  rank 1 [4..7]
    H=2, t=4:  rank 0 [0]  rank 1 [0]  rank 2 [1]  rank 3 [1]

Heads are numbered in the model's order (0 .. H-1); a rank's KV cache holds its heads in
that order, so a rank's local head i is global head ``rank_heads(...).start + i``.
"""

from __future__ import annotations

from typing import NamedTuple


class HeadRange(NamedTuple):
    """KV heads ``[start, stop)``: global (the model's numbering) or local to a rank's cache."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def contains(self, other: HeadRange) -> bool:
        return self.start <= other.start and other.stop <= self.stop and other.size > 0

    def shift(self, offset: int) -> HeadRange:
        """The same heads numbered ``offset`` lower (global -> local: the rank's first head)."""
        return HeadRange(self.start - offset, self.stop - offset)


def tp_problem(tp: int, num_kv_heads: int) -> str | None:
    """Why ``num_kv_heads`` KV heads cannot be split over ``tp`` ranks (None: they can)."""
    if tp < 1:
        return f"tensor_parallel_size: must be >= 1, got {tp}"
    if num_kv_heads < 1:
        return f"num_kv_heads: must be >= 1, got {num_kv_heads}"
    if num_kv_heads >= tp and num_kv_heads % tp:
        return (f"tensor_parallel_size {tp} does not divide the model's {num_kv_heads} KV heads; "
                f"use a divisor of {num_kv_heads}")
    if num_kv_heads < tp and tp % num_kv_heads:
        return (f"tensor_parallel_size {tp} is not a multiple of the model's {num_kv_heads} KV heads "
                f"(with fewer KV heads than ranks each head is replicated on tp/heads ranks); "
                f"use a multiple of {num_kv_heads}")
    return None


def check_tp(tp: int, num_kv_heads: int) -> None:
    """Raise ``ValueError`` (what to change, in the message) unless the split is possible."""
    problem = tp_problem(tp, num_kv_heads)
    if problem is not None:
        raise ValueError(problem)


def heads_per_rank(tp: int, num_kv_heads: int) -> int:
    """KV heads in each rank's cache: ``H / t``, or 1 when heads are replicated."""
    check_tp(tp, num_kv_heads)
    return max(1, num_kv_heads // tp)


def replicas(tp: int, num_kv_heads: int) -> int:
    """How many ranks hold each head: ``t / H`` when replicated, else 1."""
    check_tp(tp, num_kv_heads)
    return max(1, tp // num_kv_heads)


def rank_heads(rank: int, tp: int, num_kv_heads: int) -> HeadRange:
    """The global heads rank ``rank`` of a ``tp``-rank node holds (see the module docstring)."""
    check_tp(tp, num_kv_heads)
    if not 0 <= rank < tp:
        raise ValueError(f"rank: must be in [0, {tp}), got {rank}")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return HeadRange(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return HeadRange(head, head + 1)


def ranks_holding(head: int, tp: int, num_kv_heads: int) -> range:
    """The ranks holding global head ``head``: one when sharded, ``t / H`` when replicated."""
    check_tp(tp, num_kv_heads)
    if not 0 <= head < num_kv_heads:
        raise ValueError(f"head: must be in [0, {num_kv_heads}), got {head}")
    if num_kv_heads >= tp:
        rank = head // (num_kv_heads // tp)
        return range(rank, rank + 1)
    k = tp // num_kv_heads
    return range(head * k, (head + 1) * k)

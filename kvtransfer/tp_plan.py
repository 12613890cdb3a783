"""The transfer plan between two tensor-parallel nodes: which prefill rank sends which KV
heads to which decode rank.

Owns ``transfer_plan`` (pure arithmetic over ``common/kv_heads.py``'s rule) and its
result types. Must not: import torch, move bytes (``tp_send.py`` runs a plan) or decide
compatibility beyond the TP split (``common/kv_compat.py``).

For each decode rank ``s``, the heads it holds are cut into parts, one per prefill rank
that sends some of them; each (decode rank, head) is covered exactly once, so the bytes
moved are the minimum: every decode rank receives its own heads once, whatever the
prefill side replicates::

    H=8, P tp=2 -> D tp=4           H=8, P tp=4 -> D tp=2         H=2, P tp=4 -> D tp=1
    P0 [0..3] -> D0 [0,1], D1 [2,3]  P0 [0,1] \\                    P0 [0] -> D0 [0]    (P1 [0] idle)
    P1 [4..7] -> D2 [4,5], D3 [6,7]  P1 [2,3]  > D0 [0..3]          P2 [1] -> D0 [1]    (P3 [1] idle)
                                     P2, P3   -> D1 [4..7]

The sending replica of a replicated head is chosen deterministically, so both ends (and
every rank of each) compute the same plan: among the ``k`` prefill ranks holding head h,
decode rank ``s`` takes replica ``s mod k``; decode ranks that need the same head then
spread over its replicas. A decode rank's consecutive heads held by one prefill rank form
one part (contiguous on both sides), so an even split moves one slice per pair of ranks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ..common.kv_heads import HeadRange, check_tp, rank_heads, ranks_holding


class PlanPart(NamedTuple):
    """Heads ``heads`` (global) go from ``prefill_rank`` to one decode rank."""

    prefill_rank: int
    heads: HeadRange  # global head numbers
    prefill_local: HeadRange  # the same heads in the prefill rank's cache
    decode_local: HeadRange  # the same heads in the decode rank's cache


class RankSend(NamedTuple):
    """One slice a prefill rank sends: ``part`` to ``decode_rank``."""

    decode_rank: int
    part: PlanPart


class TransferPlan(NamedTuple):
    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    parts: tuple[tuple[PlanPart, ...], ...]  # [decode rank] -> its parts, in head order

    def sends_of(self, prefill_rank: int) -> list[RankSend]:
        """What prefill rank ``prefill_rank`` sends, by decode rank (may be empty: an idle replica)."""
        assert 0 <= prefill_rank < self.prefill_tp, f"rank {prefill_rank} of a tp={self.prefill_tp} node"
        return [RankSend(d, p) for d, parts in enumerate(self.parts) for p in parts
                if p.prefill_rank == prefill_rank]

    def heads_sent(self) -> int:
        """KV heads moved per block, all ranks together (the per-head bytes times this is the traffic)."""
        return sum(p.heads.size for parts in self.parts for p in parts)


@lru_cache(maxsize=256)
def transfer_plan(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> TransferPlan:
    """The plan moving every decode rank's heads from a ``prefill_tp``-rank node. Raises
    ``ValueError`` naming the side whose TP cannot split ``num_kv_heads`` heads."""
    for side, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        try:
            check_tp(tp, num_kv_heads)
        except ValueError as e:
            raise ValueError(f"no KV transfer plan from prefill tp={prefill_tp} to decode "
                             f"tp={decode_tp}: {side} side: {e}") from None
    plan = []
    for d in range(decode_tp):
        mine = rank_heads(d, decode_tp, num_kv_heads)
        parts: list[PlanPart] = []
        for h in range(mine.start, mine.stop):
            holders = ranks_holding(h, prefill_tp, num_kv_heads)
            p = holders[d % len(holders)]
            if parts and parts[-1].prefill_rank == p and parts[-1].heads.stop == h:
                last = parts[-1]
                parts[-1] = last._replace(heads=HeadRange(last.heads.start, h + 1))
            else:
                parts.append(PlanPart(p, HeadRange(h, h + 1), HeadRange(0, 0), HeadRange(0, 0)))
        plan.append(tuple(
            part._replace(prefill_local=part.heads.shift(rank_heads(part.prefill_rank, prefill_tp,
                                                                    num_kv_heads).start),
                          decode_local=part.heads.shift(mine.start))
            for part in parts))
    return TransferPlan(prefill_tp, decode_tp, num_kv_heads, tuple(plan))

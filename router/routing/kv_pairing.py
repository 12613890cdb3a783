"""The pairing filter: which prefill node's KV can land in which decode node.

Owns the rule the policies apply before choosing a pair: a prefill node and a decode
node are paired only when their node registry records' KV keys (``NodeInfo.kv``,
``common/kv_compat.py``) allow a transfer: the same model, dtype, block size, layers,
KV heads and head dim, any TP degrees that split the heads. Must not weigh nodes (the
policies do) or do I/O.

    compatible(p, d)         one pair (the load-only policies filter the prefill nodes by it)
    pair_mask(P, D)          [P, D] bool for a whole fleet, None when every pair is compatible
                             (the usual fleet: one model, one layout), so the common case
                             keeps cache_aware's O(P + D) choice
    cheapest_pair(mask, ...) the cheapest compatible pair of two cost arrays, O(P x D),
                             only for mixed fleets

A node that publishes no key (an older record, a test double) is paired with any node:
the KV handshake still refuses a real mismatch, and the decode node then prefills
locally. A node whose own TP cannot split its heads is paired with none.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import msgspec
import numpy as np

from ...common.kv_compat import KVCompat, can_exchange
from ...common.node_registry import NodeInfo

_TIE_EPS = 1e-9  # costs this close are equal (as cache_aware's)
_WILD = -1  # label of a node without a key: compatible with every node


def compatible(prefill: NodeInfo, decode: NodeInfo) -> bool:
    """Whether ``prefill``'s KV can be sent to ``decode``."""
    return can_exchange(prefill.kv, decode.kv)


def compatible_prefills(prefills: Sequence[NodeInfo], decode: NodeInfo) -> list[NodeInfo]:
    """The prefill nodes that can send KV to ``decode``."""
    if decode.kv is None:
        return list(prefills)
    return [p for p in prefills if compatible(p, decode)]


def _labels(nodes: Sequence[NodeInfo], keys: dict[Hashable, int]) -> np.ndarray:
    """[nodes] int: the index of each node's key without its TP (equal labels: compatible),
    _WILD for no key, a label of its own (-2, -3, ...) for a key whose TP is impossible."""
    out = np.empty(len(nodes), np.int64)
    for i, n in enumerate(nodes):
        kv: KVCompat | None = n.kv
        if kv is None:
            out[i] = _WILD
        elif kv.tp_problem() is not None:
            out[i] = -2 - len(keys)
            keys[object()] = len(keys)  # a label no other node shares
        else:
            out[i] = keys.setdefault(msgspec.structs.replace(kv, tp=1), len(keys))
    return out


def pair_mask(prefills: Sequence[NodeInfo], decodes: Sequence[NodeInfo]) -> np.ndarray | None:
    """[prefills, decodes] bool: which pairs can exchange KV; None when all can."""
    keys: dict[Hashable, int] = {}
    lp, ld = _labels(prefills, keys), _labels(decodes, keys)
    labels = set(lp.tolist()) | set(ld.tolist())
    labels.discard(_WILD)
    if len(labels) <= 1 and all(label >= 0 for label in labels):
        return None
    p, d = lp[:, None], ld[None, :]
    return ((p == d) & (p >= 0)) | ((p == _WILD) & (d >= _WILD)) | ((d == _WILD) & (p >= _WILD))


def cheapest_pair(mask: np.ndarray, prefill_costs: np.ndarray, decode_costs: np.ndarray,
                  turn: int) -> tuple[int, int, float] | None:
    """(prefill index, decode index, their summed cost) of the cheapest compatible pair,
    ties rotating with ``turn``; None when no pair is compatible."""
    if not mask.any():
        return None
    total = np.where(mask, prefill_costs[:, None] + decode_costs[None, :], np.inf)
    best = float(total.min())
    tied = np.flatnonzero(total.ravel() <= best + _TIE_EPS)
    p, d = divmod(int(tied[turn % len(tied)]), mask.shape[1])
    return p, d, best

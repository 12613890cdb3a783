"""The prefix mirror: a router's in-memory copy of the prefix index (the Redis record
of which node holds which block hashes, common/kv_index.py), and the lookup over it: a
prompt -> predicted cached prompt tokens per node, and the tier each of those blocks
is in, with no Redis round trip per request. Its follower (mirror_follower.py) keeps
it current from the nodes' index updates and resyncs it; this module does no I/O.

Data: ``_holders`` maps a block hash to a bitmask of node slots (one bit per
mirrored (node, epoch)). A lookup takes the prompt's chained hashes (computed once
per request by the caller, or here), keeps the mirrored nodes holding the first
block, then bisects for the last block every remaining one holds: a node's set is
prefix-closed (engines evict a sequence's tail first, KVCacheManager.free), so the
nodes missing block i miss every later one. Those leave with their depth and the
rest go on, so a lookup costs ~log2(blocks) dict reads per distinct depth, not
prompt length x nodes; only the nodes with a hit are then matched to the request's
candidates (node registry epoch, block size), so a fleet of hundreds adds no loop over
every node. A set with a hole may be read long, which the router counts as a
misprediction.

Tiers: a block held only in a lower tier (host memory, disk) is held: it has the
node's bit like a device block, so the walk is the same. Each mirrored node also
keeps ``lower``, its hashes held below the device with their tier (empty for a node
without lower tiers); a lookup splits each hit node's matched blocks by tier
(`TierBlocks`) with one dict read per block, only for nodes whose ``lower`` is not
empty.

Owns the router's half of "one hash, everywhere" (``common.hashing`` with a request's
keys, router/prompt.py ``prompt_keys``, and RouterConfig.block_size, as every node does),
the mirrored state and the changes its follower makes to it (``replace``, ``apply``,
``drop``, ``retire_other_epochs``, ``forget_all``). Must not talk to Redis (the follower
does) or raise from ``lookup``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...common.hashing import hash_blocks_array
from ...common.kv_events import IndexUpdate, Tier
from ...common.node_registry import NodeInfo
from ...common.outcomes import IndexLookupResult
from ..metrics import RouterMetrics
from ..prompt import prompt_keys
from .policy import NO_TIERS
from .tier_cost import TierBlocks

log = logging.getLogger(__name__)

NodeKey = tuple[str, str]  # (node_id, epoch)


class PrefixHits(NamedTuple):
    cached: dict[str, int]  # node_id -> predicted cached prompt tokens (nodes with a hit only)
    num_blocks: int  # full blocks of the prompt
    looked_up: bool  # False: the mirror is not usable (Redis down): no prediction
    tiers: Mapping[str, TierBlocks] = NO_TIERS  # node_id -> its hit's blocks by tier (every node in cached)


@dataclass(slots=True)
class MirroredNode:
    slot: int  # bit position in the hash -> nodes masks
    seq: int = 0  # the last batch applied
    hashes: set[int] = field(default_factory=set)  # held in any tier
    lower: dict[int, Tier] = field(default_factory=dict)  # of hashes, those held only below the device
    behind: int | None = None  # a seq Redis had applied at the last check that we had not


@dataclass(slots=True)
class PrefixMirror:
    metrics: RouterMetrics
    model_id: str  # the extra key of every block hash
    block_size: int
    connected: bool = False  # set by the follower: subscribed and caught up, lookups use the mirror
    _holders: dict[int, int] = field(default_factory=dict)  # block hash -> bitmask of slots
    _nodes: dict[NodeKey, MirroredNode] = field(default_factory=dict)
    _retired: set[NodeKey] = field(default_factory=set)  # epochs superseded by a newer one
    _free_slots: list[int] = field(default_factory=list)
    _next_slot: int = 0
    _slot_key: dict[int, NodeKey] = field(default_factory=dict)  # slot -> the node it mirrors
    _all: int = 0  # bitmask of every slot in use
    _mismatched: set[str] = field(default_factory=set)  # node ids warned about

    # -- lookups (request path, no I/O) -------------------------------------------------

    def lookup(self, prompt: Sequence[int] | np.ndarray, nodes: Sequence[NodeInfo],
               hashes: Sequence[int] | np.ndarray | None = None,
               cache_salt: str | None = None) -> PrefixHits:
        """Predicted cached prompt tokens per node: the longest run of the prompt's
        leading blocks each node holds in any tier (at the epoch of its node
        registry record), in tokens, capped like the engine caps a hit (at least one token is
        computed), and those blocks by the tier each is in.
        ``hashes``: the prompt's block hashes when the caller has them (computed
        once per request, `router.prompt.Prompt.ref`); otherwise they are computed here, with
        ``cache_salt`` (a salted prompt only finds blocks of its own salt)."""
        bs = self.block_size
        num_blocks = len(prompt) // bs
        if not self.connected:
            self.metrics.index_lookups.labels(result=IndexLookupResult.SKIPPED).inc()
            return PrefixHits({}, num_blocks, False)
        max_blocks = min(num_blocks, (len(prompt) - 1) // bs)
        self.metrics.index_lookups.labels(result=IndexLookupResult.OK).inc()
        if max_blocks == 0 or not self._all:
            return PrefixHits({}, num_blocks, True)
        if hashes is None:
            keys = prompt_keys(self.model_id, cache_salt).hash_keys()
            hashes = hash_blocks_array(prompt[: max_blocks * bs], bs, keys)
        found: dict[int, int] = {}  # slot -> tokens, every mirrored node with a hit
        _walk(self._holders.get, hashes, max_blocks, self._all, bs, found)
        # Only the nodes with a hit are matched to the candidates (their node registry epoch,
        # their block size): no per-request loop over every node of a large fleet.
        cached: dict[str, int] = {}
        tiers: dict[str, TierBlocks] = {}
        if found:
            live = {n.node_id: n for n in nodes}  # node_id -> its node registry record
            leading: list[int] | None = None  # the hit's hashes as ints, once
            for slot, tokens in found.items():
                key = self._slot_key[slot]
                n = live.get(key[0])
                if n is None or n.epoch != key[1] or not self._same_block_size(n):
                    continue
                cached[key[0]] = tokens
                blocks, lower = tokens // bs, self._nodes[key].lower
                if not lower:
                    tiers[key[0]] = TierBlocks(blocks)
                    continue
                if leading is None:
                    head = hashes[:max_blocks]
                    leading = head.tolist() if isinstance(head, np.ndarray) else list(head)
                below = [0, 0, 0]  # blocks by tier value (the device's stays 0)
                for h in leading[:blocks]:
                    t = lower.get(h)
                    if t is not None:
                        below[t] += 1
                tiers[key[0]] = TierBlocks(blocks - below[Tier.HOST] - below[Tier.DISK],
                                           below[Tier.HOST], below[Tier.DISK])
        return PrefixHits(cached, num_blocks, True, tiers)

    def nodes_mirrored(self) -> dict[NodeKey, int]:
        """(node_id, epoch) -> blocks mirrored (tests, debugging)."""
        return {k: len(e.hashes) for k, e in self._nodes.items()}

    # -- mirrored state, changed by the follower (mirror_follower.py) ---------------------

    def node(self, key: NodeKey) -> MirroredNode | None:
        """The mirrored (node_id, epoch) ``key``; None: not mirrored."""
        return self._nodes.get(key)

    def keys(self) -> list[NodeKey]:
        """Every mirrored (node_id, epoch)."""
        return list(self._nodes)

    def retired(self, key: NodeKey) -> bool:
        """``key``'s node id has started again under a newer epoch: ``key`` holds nothing."""
        return key in self._retired

    def replace(self, key: NodeKey, seq: int, hashes: set[int], lower: dict[int, Tier] | None = None) -> None:
        """Mirror ``key`` as holding exactly ``hashes`` at batch ``seq``, ``lower`` (None:
        none) of them below the device."""
        self.drop(key)
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        entry = self._nodes[key] = MirroredNode(slot, seq, lower={} if lower is None else lower)
        self._slot_key[slot] = key
        self._all |= 1 << slot
        self._add(entry, hashes)

    def apply(self, entry: MirroredNode, u: IndexUpdate) -> None:
        """Apply ``u``, the update after the one ``entry`` holds (its seq is entry.seq + 1)."""
        bit = 1 << entry.slot
        holders, lower = self._holders, entry.lower
        for h in u.removed:
            if h in entry.hashes:
                entry.hashes.discard(h)
                lower.pop(h, None)
                left = holders[h] & ~bit
                if left:
                    holders[h] = left
                else:
                    del holders[h]
        self._add(entry, u.stored)
        if lower:  # back on the device
            for h in u.stored:
                lower.pop(h, None)
        if u.stored_host or u.stored_disk:
            self._add(entry, u.stored_host)
            self._add(entry, u.stored_disk)
            lower.update(lower_of(u))
        entry.seq = u.seq

    def _add(self, entry: MirroredNode, hashes) -> None:
        bit = 1 << entry.slot
        holders = self._holders
        for h in hashes:
            if h not in entry.hashes:
                entry.hashes.add(h)
                holders[h] = holders.get(h, 0) | bit

    def drop(self, key: NodeKey) -> None:
        """Forget ``key`` (not mirrored: nothing to do)."""
        entry = self._nodes.pop(key, None)
        if entry is None:
            return
        keep = ~(1 << entry.slot)
        holders = self._holders
        for h in entry.hashes:
            left = holders[h] & keep
            if left:
                holders[h] = left
            else:
                del holders[h]
        self._free_slots.append(entry.slot)
        del self._slot_key[entry.slot]
        self._all &= keep

    def retire_other_epochs(self, key: NodeKey) -> None:
        """``key`` is a node id at a new epoch: its earlier epochs hold nothing now."""
        for old in [k for k in self._nodes if k[0] == key[0] and k != key]:
            self.drop(old)
            self._retired.add(old)

    def forget_all(self) -> None:
        """Empty the mirror (Redis lost): lookups say "not looked up" until reconnected."""
        self.connected = False
        self._nodes.clear()
        self._holders.clear()
        self._free_slots.clear()
        self._next_slot = 0
        self._slot_key.clear()
        self._all = 0

    def _same_block_size(self, node: NodeInfo) -> bool:
        if node.block_size in (0, self.block_size):  # 0: a node that does not say
            return True
        if node.node_id not in self._mismatched:
            self._mismatched.add(node.node_id)
            log.warning("router: node %s uses block size %d, this router %d (--block-size): "
                        "its prefix cache is invisible to routing", node.node_id,
                        node.block_size, self.block_size)
        return False


def lower_of(u: IndexUpdate) -> dict[int, Tier]:
    """The hashes ``u`` stores below the device, with their tier."""
    lower = dict.fromkeys(u.stored_host, Tier.HOST)
    lower.update(dict.fromkeys(u.stored_disk, Tier.DISK))
    return lower


def _walk(get, hashes, max_blocks: int, alive: int, bs: int, found: dict[int, int]) -> None:
    """Record in ``found`` (slot -> tokens) the depth of every node in ``alive``: the
    first block must be held; then, sets being prefix-closed, the last block every
    remaining node holds is found by bisection, the nodes missing the next one leave,
    and the rest go on. ~log2(blocks) dict reads per distinct depth among the nodes."""
    alive &= get(int(hashes[0]), 0)
    depth = 1  # blocks every node in ``alive`` holds
    while alive and depth < max_blocks:
        if get(int(hashes[max_blocks - 1]), 0) & alive == alive:
            depth = max_blocks
            break
        lo, hi = depth - 1, max_blocks - 1  # every node holds block lo; some miss block hi
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if get(int(hashes[mid]), 0) & alive == alive:
                lo = mid
            else:
                hi = mid
        held = get(int(hashes[hi]), 0) & alive
        _settle(alive & ~held, hi * bs, found)
        alive, depth = held, hi + 1
    _settle(alive, depth * bs, found)


def _settle(slots: int, tokens: int, found: dict[int, int]) -> None:
    """Record ``tokens`` as the hit of every slot set in ``slots``."""
    while slots:
        low = slots & -slots
        found[low.bit_length() - 1] = tokens
        slots ^= low


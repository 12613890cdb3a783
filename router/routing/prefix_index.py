"""The router's in-memory mirror of the global prefix index: a prompt -> predicted
cached prompt tokens per node, and the tier each of those blocks is in, with no
Redis round trip per request.

    nodes --EVALSHA apply (SET, tiers + seq + PUBLISH IndexUpdate, atomic)--> Redis
    Redis --pub/sub splitserve:kvevents--> this mirror (one task per router)
        update seq == mirrored seq + 1     apply (SREM, SADD on the node's bit; the
                                           tier of what it holds below the device)
        update with clear                  replace the node (a full write)
        seq older                          ignore (already in a snapshot)
        gap, unknown node or epoch         resync the node: KVIndex.snapshot (one
                                           MULTI: its SET and the seq it is as of)
        a newer epoch of a node id         the old epoch's entries are dropped
    every check_interval_s: KVIndex.published_seqs; a node still behind what Redis
        applied one check ago (a lost last update), or not mirrored at all (a late
        start), is resynced; a node whose keys are gone (expired, dropped) leaves
    Redis unreachable: the mirror empties and lookups say "not looked up" (routing
        by load only) until it reconnects, resubscribes and resyncs every node.

Data: ``_holders`` maps a block hash to a bitmask of node slots (one bit per
mirrored (node, epoch)). A lookup takes the prompt's chained hashes (computed once
per request by the caller, or here), keeps the mirrored nodes holding the first
block, then bisects for the last block every remaining one holds: a node's set is
prefix-closed (engines evict a sequence's tail first, KVCacheManager.free), so the
nodes missing block i miss every later one. Those leave with their depth and the
rest go on, so a lookup costs ~log2(blocks) dict reads per distinct depth, not
prompt length x nodes; only the nodes with a hit are then matched to the request's
candidates (registry epoch, block size), so a fleet of hundreds adds no loop over
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
the mirror task and its resync rules. Must not create its Redis client (the app's
lifespan owns the `KVIndex`) or raise from ``lookup``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np

from ...common.hashing import hash_blocks_array
from ...common.kv_events import IndexUpdate, Tier
from ...common.kv_index import EVENTS_CHANNEL, REDIS_ERRORS, KVIndex
from ...common.outcomes import IndexLookupResult
from ...common.registry import NodeInfo
from ..metrics import RouterMetrics
from ..prompt import prompt_keys
from .policy import NO_TIERS
from .tier_cost import TierBlocks

log = logging.getLogger(__name__)

NodeKey = tuple[str, str]  # (node_id, epoch)
STOP_ATTEMPTS = 20  # cancellations stop() sends, STOP_WAIT_S apart
STOP_WAIT_S = 0.25


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
class PrefixIndex:
    index: KVIndex
    metrics: RouterMetrics
    model_id: str  # the extra key of every block hash
    block_size: int
    check_interval_s: float = 1.0  # catch-up against Redis's seqs, off the request path
    retry_s: float = 1.0  # reconnect delay after Redis failed
    # Fault injection for benchmarks and tests: drop this share of received updates.
    event_loss: float = 0.0
    connected: bool = False  # subscribed and caught up: lookups use the mirror
    resyncs: int = 0  # snapshots read (late start, gaps, epochs, lost connection)
    updates: int = 0  # updates received (dropped ones included)
    dropped: int = 0  # updates dropped by ``event_loss``
    _holders: dict[int, int] = field(default_factory=dict)  # block hash -> bitmask of slots
    _nodes: dict[NodeKey, MirroredNode] = field(default_factory=dict)
    _retired: set[NodeKey] = field(default_factory=set)  # epochs superseded by a newer one
    _free_slots: list[int] = field(default_factory=list)
    _next_slot: int = 0
    _slot_key: dict[int, NodeKey] = field(default_factory=dict)  # slot -> the node it mirrors
    _all: int = 0  # bitmask of every slot in use
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    _mismatched: set[str] = field(default_factory=set)  # node ids warned about
    _task: asyncio.Task | None = None

    # -- lookups (request path, no I/O) -------------------------------------------------

    def lookup(self, prompt: Sequence[int] | np.ndarray, nodes: Sequence[NodeInfo],
               hashes: Sequence[int] | np.ndarray | None = None,
               cache_salt: str | None = None) -> PrefixHits:
        """Predicted cached prompt tokens per node: the longest run of the prompt's
        leading blocks each node holds in any tier (at the epoch of its registry
        record), in tokens, capped like the engine caps a hit (at least one token is
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
        # Only the nodes with a hit are matched to the candidates (their registry epoch,
        # their block size): no per-request loop over every node of a large fleet.
        cached: dict[str, int] = {}
        tiers: dict[str, TierBlocks] = {}
        if found:
            live = {n.node_id: n for n in nodes}  # node_id -> the registry's record
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

    # -- the mirror task -----------------------------------------------------------------

    def start(self) -> None:
        assert self._task is None, "PrefixIndex.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefix-mirror")

    async def stop(self) -> None:
        """Cancel the mirror task and wait for it. A cancellation that lands while
        redis-py's pub/sub read is inside its own read timeout can be swallowed (the
        task then waits for the next message forever), so cancel again until it ends."""
        if self._task is None:
            return
        for _ in range(STOP_ATTEMPTS):
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=STOP_WAIT_S)
            if done:
                break
        else:
            log.warning("router: the prefix index task did not stop after %d cancellations", STOP_ATTEMPTS)
        self._task = None

    async def _run(self) -> None:
        down = False
        while True:
            pubsub = self.index.pubsub()
            try:
                await pubsub.subscribe(EVENTS_CHANNEL)
                await _confirmed(pubsub, self.retry_s + 1.0)  # live before the snapshots are read
                await self._catch_up()  # everything published before the subscription
                self.connected = True
                if down:
                    down = False
                    log.info("router: prefix index reachable again; routing by cache and load")
                await self._follow(pubsub)
            except REDIS_ERRORS as e:
                self.metrics.redis_errors.labels(op="index_events").inc()
                if not down:
                    down = True
                    log.warning("router: prefix index events unavailable (%r); routing by load "
                                "only, reconnecting every %.1fs", e, self.retry_s)
            finally:
                self._forget_all()
                await asyncio.shield(_close(pubsub))
            await asyncio.sleep(self.retry_s)

    async def _follow(self, pubsub) -> None:
        next_check = time.monotonic() + self.check_interval_s
        while True:
            wait = max(0.0, next_check - time.monotonic())
            msg = await pubsub.get_message(timeout=wait)
            if msg is not None and msg.get("type") == "message":
                await self._on_update(msg["data"])
            if time.monotonic() >= next_check:
                await self._catch_up()
                next_check = time.monotonic() + self.check_interval_s

    async def _on_update(self, data: bytes) -> None:
        self.updates += 1
        if self.event_loss and self._rng.random() < self.event_loss:
            self.dropped += 1
            return
        try:
            u = msgspec.msgpack.decode(data, type=IndexUpdate)
        except msgspec.ValidationError as e:
            log.warning("router: ignoring a malformed prefix index update: %s", e)
            return
        key = (u.node_id, u.epoch)
        if key in self._retired:
            return
        entry = self._nodes.get(key)
        if entry is None:
            self._retire_other_epochs(key)
        if u.clear:
            self._replace(key, u.seq, {*u.stored, *u.stored_host, *u.stored_disk}, _lower_of(u))
        elif entry is not None and u.seq == entry.seq + 1:
            self._apply(entry, u)
        elif entry is None or u.seq > entry.seq:  # unknown node, or a gap
            await self._resync(key)

    async def _catch_up(self) -> None:
        seqs = await self.index.published_seqs()
        for key in [k for k in self._nodes if k not in seqs]:
            self._drop(key)  # expired or dropped: the node is gone
        for key, seq in seqs.items():
            if key in self._retired:
                continue
            entry = self._nodes.get(key)
            if entry is None or (entry.behind is not None and entry.seq < entry.behind):
                await self._resync(key)
            else:
                entry.behind = seq if entry.seq < seq else None

    async def _resync(self, key: NodeKey) -> None:
        snap = await self.index.snapshot(*key)
        self.resyncs += 1
        if snap.seq is None:
            self._drop(key)
        else:
            self._replace(key, snap.seq, snap.hashes, dict(snap.lower))

    # -- mirror state ----------------------------------------------------------------------

    def _replace(self, key: NodeKey, seq: int, hashes: set[int], lower: dict[int, Tier] | None = None) -> None:
        """Mirror ``key`` as holding exactly ``hashes`` at batch ``seq``, ``lower`` (None:
        none) of them below the device."""
        self._drop(key)
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        entry = self._nodes[key] = MirroredNode(slot, seq, lower={} if lower is None else lower)
        self._slot_key[slot] = key
        self._all |= 1 << slot
        self._add(entry, hashes)

    def _apply(self, entry: MirroredNode, u: IndexUpdate) -> None:
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
            lower.update(_lower_of(u))
        entry.seq = u.seq

    def _add(self, entry: MirroredNode, hashes) -> None:
        bit = 1 << entry.slot
        holders = self._holders
        for h in hashes:
            if h not in entry.hashes:
                entry.hashes.add(h)
                holders[h] = holders.get(h, 0) | bit

    def _drop(self, key: NodeKey) -> None:
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

    def _retire_other_epochs(self, key: NodeKey) -> None:
        """``key`` is a node id at a new epoch: its earlier epochs hold nothing now."""
        for old in [k for k in self._nodes if k[0] == key[0] and k != key]:
            self._drop(old)
            self._retired.add(old)

    def _forget_all(self) -> None:
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


def _lower_of(u: IndexUpdate) -> dict[int, Tier]:
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


async def _confirmed(pubsub, timeout_s: float) -> None:
    """Wait for the subscription's confirmation; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await pubsub.get_message(timeout=timeout_s)
            if msg is not None and msg.get("type") == "subscribe":
                return


async def _close(pubsub) -> None:
    try:
        await pubsub.aclose()
    except REDIS_ERRORS:
        pass

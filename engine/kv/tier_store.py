"""The tier store: the lower tiers of one engine's prefix cache, a host-memory tier below the
KV cache and an optional disk tier below that (engine/kv/disk_tier.py). The KV cache manager
builds it over its block pool and is the only one that calls it (cache_manager.py).

Owns which block goes where and when: write-through to the host, spills to disk, lookups and
loads back to the device; the disk tier's bookkeeping (the spills its writer has not indexed
yet), the tier events (common/kv_events.py ``Tier``, recorded in the block pool's event log),
the moves and the tier stats a heartbeat reports. Its parts: the host slots and their LRU
(host_tier.py), the copies and their order against the forward (tier_streams.py), the measured
rates and the load-vs-recompute prices (tier_policy.py), the words it shares (tier_spec.py).
Engine thread only (the disk tier's writer has its own thread). Must not: choose or allocate
device blocks, or know about requests.

::

    a block is cached on the device (BlockPool.cache_block -> cached): queued for the host
    flush() (the engine, after each step's forward is queued): every queued block (those the
      forward completes, a prefilled request's that landed since) is copied to a host slot
      (tier_streams.py: in the background on CUDA, behind the work issued so far)
    device KV cache --(a cached block is evicted: BlockPool.get_new_blocks -> store)--> host
      already holds it (the usual case): nothing is copied; the next forward waits for the
      store batch that copied it (a no-op once it landed)
      does not (dropped from the host meanwhile): copied now, a batch the forward waits for
    host slot --(LRU evicted: spill)--> disk file (queued to the writer) or dropped
    admission: KVCacheManager.get_computed_blocks -> device hits, then lookup() here: the next
      blocks of the prompt's hash chain found in host memory, else in the disk tier's index
      (nothing is read, so a request waiting to be admitted reads nothing), taken only when
      loading them pays (tier_policy.py ``load_pays``)
    allocate_slots: the hits loaded this step get fresh device blocks; load() finds each again
      (its host entry, else its disk file read and checked now: a bad or vanished file ends
      the run, and the rest is computed) and queues its copy; the next forward's take_loads()
      issues them, one layer after another beside the forward (tier_streams.py ``LayerLoads``)

A block is useful only with its parents: lookups walk the chain from the first block the
device lacks and stop at the first miss (a block of other tokens or another salt identity
under the hash is one: common/hashing.py ``salt_id``); device evictions go tail first (a
request frees its last block first), so a chain's children reach the host tier's LRU end, and
leave it, before their parents. Before a KV receiver writes a decode node's reserved blocks,
the store batch reading the cached blocks they evicted must land (``before_write``).

On a simulated node the runner prices every move (engine/sim_runner.py) and reports what it
priced as the measurement: the stand-in blocks' own copies time nothing
(``TierSpec.timed_by_runner``).

Events: a device eviction of a block a lower tier now holds is ``BlockStored(tier=HOST)`` (or
DISK) instead of ``BlockRemoved``; a host eviction makes it DISK, or removed, unless the device
still holds it; a disk file that goes away (evicted for room, a failed write or check) removes
it unless a faster tier still has it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...common.kv_events import BlockRemoved, BlockStored, Tier
from ...common.kv_tier_stats import TierStats
from .block_pool import BlockPool
from .host_tier import DeviceBlock, HostEntry, HostTier
from .tier_policy import TierPolicy
from .tier_spec import LowerHit, Move, TierObserver, TierSpec
from .tier_streams import LayerLoads, TierStreams


class TierStore:
    """The host and disk tiers of one engine (see the module docstring)."""

    def __init__(self, spec: TierSpec, block_size: int, device: BlockPool, observer: TierObserver | None = None):
        """``device``: the block pool above, whose prefix cache tells which blocks the device
        holds and whose event log records the tiers' events too (one ordered stream)."""
        kv_caches, host_blocks, disk, timed_by_runner = spec
        self.timed_here = not timed_by_runner  # the store measures its own moves' rates
        self.block_size = block_size
        self.block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.cuda = kv_caches.device.type == "cuda"
        self.policy = TierPolicy(block_size, self.block_bytes)
        self.host = HostTier(host_blocks, kv_caches[:, :, 0].shape, kv_caches.dtype, pin=self.cuda)
        self.host_blocks = host_blocks
        self.streams = TierStreams(kv_caches, self.host.slots, self.policy, self.timed_here, self._record_move)
        self._queued: dict[int, DeviceBlock] = {}  # block id -> the block, to copy to the host
        self.disk = disk
        self._on_disk_pending: set[int] = set()  # hashes queued to the writer, not yet indexed
        self.device = device
        self._moves: list[Move] = []
        self.observer = observer

    # ---- stores (BlockPool.cache_block -> cached, flush, BlockPool.get_new_blocks -> store) --
    def cached(self, block_id: int, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> None:
        """Device block ``block_id`` now holds ``block_hash`` (its KV written, or queued to be
        by a forward or a load already issued): queue its copy to host memory unless the host
        has it (a block loaded from here)."""
        if self.host.entry(block_hash, tokens, salt) is not None:
            self.host.touch(block_hash)
        else:
            self._queued[block_id] = DeviceBlock(block_id, block_hash, tokens, salt)

    def flush(self) -> None:
        """Copy every queued block to a host slot: in the background on CUDA (the copy stream
        waits for the work issued so far, then copies), plain copies on the CPU."""
        if self._queued:
            self._copy_out(list(self._queued.values()))

    def store(self, block_id: int, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> Tier | None:
        """The device is about to reuse cached block ``block_id``: its KV must be in host
        memory first. Returns the fastest lower tier that holds it now (the event's tier),
        None if none."""
        if block_id in self._queued:
            self.flush()
        entry = self.host.entry(block_hash, tokens, salt)
        if entry is None:  # dropped from the host since it was cached
            self._copy_out([DeviceBlock(block_id, block_hash, tokens, salt)])
            entry = self.host.entry(block_hash, tokens, salt)
            if entry is None:  # everything is protected by the lookup in progress
                return Tier.DISK if self._on_disk(block_hash) else None
        self.host.touch(block_hash)  # from now on the only copy: the host's most recent
        self.streams.forward_overwrites(entry.slot)
        return Tier.HOST

    def _copy_out(self, blocks: list[DeviceBlock]) -> None:
        """Copy ``blocks`` from the device into fresh host slots (as many as the LRU can give),
        as one batch on the copy stream, and forget them from the queue."""
        for block in blocks:
            self._queued.pop(block.block_id, None)
        moves = self.host.place(blocks, self._spill)
        if moves:
            self.streams.store(moves)

    def _spill(self, evicted: list[tuple[int, HostEntry]]) -> None:
        """Host entries just evicted (their slots reused next): to disk when there is one."""
        on_disk: list[int] = []  # hashes now only on disk
        removed: list[int] = []  # hashes in no tier now
        for h, entry in evicted:
            to_disk = self.disk is not None and not self._on_disk(h)
            self.streams.give_up(entry.slot, read=to_disk)
            if self.disk is not None and to_disk:
                payload = self.host.slots[entry.slot].view(torch.uint8).numpy().tobytes()
                if self.disk.put(h, entry.tokens, entry.salt, payload):
                    self._on_disk_pending.add(h)
                    self._record_move(Move(Tier.DISK, False, 1, self.block_bytes, 0.0))
            if h not in self.device.cached:
                (on_disk if self._on_disk(h) else removed).append(h)
        if evicted:
            self._count_evicted(Tier.HOST, len(evicted))
        if on_disk:
            self.device.record_event(BlockStored(on_disk, Tier.DISK))
        if removed:
            self.device.record_event(BlockRemoved(removed))

    def _on_disk(self, block_hash: int) -> bool:
        return self.disk is not None and (block_hash in self._on_disk_pending or self.disk.contains(block_hash))

    def before_forward(self) -> int:
        """The newest store batch the forward about to be issued waits for (tier_streams.py)."""
        return self.streams.before_forward()

    def before_write(self) -> None:
        """Before a KV receiver writes device blocks just allocated (tier_streams.py)."""
        self.streams.before_write()

    # ---- loads (KVCacheManager.get_computed_blocks / allocate_slots) -------------------------
    def lookup(self, block_hashes: Sequence[int], token_ids: Sequence[int], salt: bytes, start: int,
               max_blocks: int) -> list[LowerHit]:
        """Prompt blocks ``start ..`` (the first the device lacks) of salt identity ``salt``
        found in host memory or in the disk tier's index, as a run from ``start`` (host hits
        protected from eviction until they are loaded or the next lookup; nothing is read:
        ``load`` reads a disk hit when it is loaded); none when loading them would cost more
        than recomputing them. A block the device holds again ends the run."""
        self.poll()
        bs = self.block_size
        found: list[tuple[int, tuple[int, ...], Tier]] = []
        for i in range(start, max_blocks):
            h, tokens = block_hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])
            if h in self.device.cached:
                break  # another request loaded or computed it meanwhile: the device's next lookup has it
            if self.host.entry(h, tokens, salt) is not None:
                found.append((h, tokens, Tier.HOST))
            elif self.disk is not None and h not in self._on_disk_pending and self.disk.holds(h, tokens, salt):
                found.append((h, tokens, Tier.DISK))
            else:
                break
        found = found if self.policy.load_pays([tier for _, _, tier in found]) else []
        self.host.protected = set()
        hits: list[LowerHit] = []
        for i, (h, tokens, tier) in enumerate(found, start):
            if tier is Tier.HOST:
                self.host.touch(h)
                self.host.protected.add(h)
            hits.append(LowerHit(h, block_hashes[i - 1] if i > 0 else None, tokens, salt, tier))
        if self.observer is not None and max_blocks > start:
            self.observer.looked_up(max_blocks - start, {})  # its hits count as they load (``load``)
        return hits

    def protect(self, hits: Sequence[LowerHit]) -> None:
        """Keep the host entries of ``hits`` (about to be loaded) from being given up by the
        allocation that precedes their load (instead of the last lookup's)."""
        self.host.protected = {hit.block_hash for hit in hits if hit.block_hash in self.host}

    def _read_disk(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> torch.Tensor | None:
        """A block read from disk (one block of the host tier's shape), or None when its file
        is another block's or unusable (then deleted and counted by the disk tier)."""
        assert self.disk is not None
        t0 = time.perf_counter()
        payload = self.disk.read(block_hash, tokens, salt)
        if payload is None:
            self.poll()  # the file was dropped: its event and fault
            return None
        slots = self.host.slots
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(slots.dtype)  # aligned
        data = data.view(slots[0].shape)
        if self.cuda:
            data = data.pin_memory()
        seconds = time.perf_counter() - t0
        if self.timed_here:
            self.policy.rates[Tier.DISK].add(len(payload), seconds)
        self._record_move(Move(Tier.DISK, True, 1, len(payload), seconds, whole=True))  # read on this thread
        return data

    def load(self, hits: Sequence[LowerHit], block_ids: Sequence[int]) -> int:
        """Queue the leading ``hits`` to be copied into their new device blocks (``block_ids``,
        in order) by the next forward (``take_loads``): each found again now, its host slot
        (protected from eviction until then) or its disk file, read and checked here. The run
        ends at the first a lower tier no longer holds (given up since the lookup; a disk file
        gone, bad, or another block's): returns how many were queued."""
        counts = {Tier.HOST: 0, Tier.DISK: 0}
        for hit, block_id in zip(hits, block_ids, strict=True):
            entry = self.host.entry(hit.block_hash, hit.tokens, hit.salt)
            if entry is not None:
                self.host.touch(hit.block_hash)
                self.streams.queue_host_load(entry.slot, block_id)
                self.host.loading.add(hit.block_hash)
                counts[Tier.HOST] += 1
                continue
            data = None
            if self._on_disk(hit.block_hash) and hit.block_hash not in self._on_disk_pending:
                data = self._read_disk(hit.block_hash, hit.tokens, hit.salt)
            if data is None:
                break  # gone meanwhile, a bad file, or another block's: the rest is computed
            self.streams.queue_disk_load(data, block_id)
            counts[Tier.DISK] += 1
        loaded = counts[Tier.HOST] + counts[Tier.DISK]
        if loaded:  # and the store batches still reading the blocks this allocation evicted
            self.streams.after_evictions()
        if self.observer is not None and loaded:
            self.observer.looked_up(0, counts)
        self.host.protected = set()
        return loaded

    @property
    def loads_queued(self) -> bool:
        """Whether loads wait for the next forward (``take_loads``)."""
        return self.streams.loads_queued

    def take_loads(self, whole: bool = False) -> LayerLoads | None:
        """The loads queued since the last call, issued for the forward about to be issued
        (None: none; tier_streams.py); ``whole``: waited for whole before it instead. Their
        host slots may be given up again."""
        loads = self.streams.take_loads(whole)
        if loads is not None:
            self.host.loading = set()
        return loads

    # ---- the tiers' contents -----------------------------------------------------------------
    def clear(self) -> None:
        """Forget every block in every lower tier (the prefix cache was reset: the caller
        records ``AllBlocksCleared``); the disk tier's files are deleted."""
        self.host.clear()
        self._queued.clear()
        self.streams.clear()
        if self.disk is not None:
            self.disk.clear()
            self.disk.take_dropped()
            self._on_disk_pending.clear()

    def poll(self) -> None:
        """Fold in what the disk writer did: files that went away (evictions, failed writes)
        become removal events unless a faster tier holds the block; faults are counted."""
        if self.disk is None:
            return
        dropped, faults = self.disk.take_dropped()
        self._on_disk_pending = {h for h in self._on_disk_pending if not self.disk.contains(h)}
        for h in dropped:
            self._on_disk_pending.discard(h)
            if h not in self.host and h not in self.device.cached:
                self.device.record_event(BlockRemoved([h]))
        if dropped:
            self._count_evicted(Tier.DISK, len(dropped))
        if self.observer is not None:
            for fault in faults:
                self.observer.fault(Tier.DISK, fault)

    def held(self) -> dict[int, Tier]:
        """Every block hash in a lower tier, with the fastest lower tier holding it."""
        self.poll()
        held = dict.fromkeys(self.disk.hashes(), Tier.DISK) if self.disk is not None else {}
        held.update(dict.fromkeys(self._on_disk_pending, Tier.DISK))
        held.update(dict.fromkeys(self.host, Tier.HOST))
        return held

    def take_moves(self) -> list[Move]:
        """The moves since the last call (a simulated node prices them with its profile)."""
        moves, self._moves = self._moves, []
        return moves

    def stats(self) -> list[TierStats]:
        self.streams.measure_loads()
        rates = self.policy.rates
        out = [TierStats(tier=Tier.HOST, capacity_blocks=self.host_blocks, used_blocks=len(self.host),
                         block_bytes=self.block_bytes, load_bytes_per_s=rates[Tier.HOST].value,
                         store_bytes_per_s=self.policy.store_rate.value)]
        if self.disk is not None:
            store = self.disk.stored_bytes / self.disk.store_s if self.disk.store_s > 0 else 0.0
            out.append(TierStats(tier=Tier.DISK, capacity_blocks=self.disk.capacity_blocks,
                                 used_blocks=self.disk.used_blocks, block_bytes=self.block_bytes,
                                 load_bytes_per_s=rates[Tier.DISK].value, store_bytes_per_s=store))
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # ---- helpers ---------------------------------------------------------------------------
    def _record_move(self, move: Move) -> None:
        self._moves.append(move)
        if len(self._moves) > 4096:  # nobody takes them (a real node): keep the recent ones
            del self._moves[:2048]
        if self.observer is not None:
            self.observer.moved(move)

    def _count_evicted(self, tier: Tier, blocks: int = 1) -> None:
        if self.observer is not None:
            self.observer.evicted(tier, blocks)

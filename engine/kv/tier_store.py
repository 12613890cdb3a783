"""The tier store: the lower tiers of one engine's prefix cache, a host-memory pool below the
KV cache and an optional disk tier below that (engine/kv/disk_tier.py). The KV cache manager
builds it over its block pool and is the only one that calls it (cache_manager.py).

Owns the host pool (slots shaped like the KV cache's blocks, slot-major so each is one
contiguous, pinned on CUDA, range), its LRU map (block hash -> slot, tokens, salt), the moves
between the tiers and their measured rates, the tier events (common/kv_events.py
``Tier``, recorded in the block pool's event log) and the tier stats a heartbeat reports.
Engine thread only (the disk tier's writer has its own thread). Must not: choose or allocate
device blocks, or know about requests.

::

    a block is cached on the device (BlockPool.cache_block -> cached): queued for the host
    flush() (the engine, after each step's forward is queued): every queued block (those
      the forward completes, a prefilled request's that landed since) is copied to a host
      slot in the background: on CUDA on a copy stream that waits for the work issued so
      far (write-through)
    device KV cache --(a cached block is evicted: BlockPool.get_new_blocks -> store)--> host
      already holds it (the usual case): nothing is copied; the next forward waits for the
      store batch that copied it (``before_forward``: a no-op once it landed)
      does not (dropped from the host meanwhile): copied now, a batch the forward waits for
    host slot --(LRU evicted: spill)--> disk file (queued to the writer) or dropped
    admission: KVCacheManager.get_computed_blocks -> device hits, then lookup() here:
      the next blocks of the prompt's hash chain found in host memory, else on disk (found
      in the index only: nothing is read, so a request waiting to be admitted reads nothing)
      -> taken only when loading them is cheaper than recomputing them, by the rates
         measured here (host->device and disk->host bytes/s, the engine's prefill tokens/s)
    load_tokens(): what loading a block of a tier costs, in the prompt tokens the engine
      computes in the same time (the same rates): the scheduler draws a step's loads from its
      prefill budget and loads a long run over several steps (scheduler.py), beside a running
      batch no more than a step of it hides (``hidden_load_tokens``: its measured duration)
    allocate_slots: the hits loaded this step get fresh device blocks; load() checks each
      again (its host entry still there, else its disk file read and checked now: a bad or
      vanished file ends the run, and the rest is computed) and queues its copy; those are
      registered in the prefix cache at once; the next forward's take_loads() issues the step's
      copies together, one layer after another (CUDA: on the load stream, after the store
      batches they depend on, one kernel per layer reading the pinned slots:
      engine/kv/host_load_kernel.py), and the forward waits for a layer's copies only as it
      reaches that layer (LayerLoads): the loads overlap the forward's earlier layers

The host tier is inclusive: a block on the device usually has its host copy too, so an
eviction costs the step nothing. Host slots are given up least recently used first,
whether or not the device still holds their block; a device eviction touches the block's
host entry, since from then on it is the only copy. A store batch waits for the work
issued before it, so it never overwrites a slot a load is still reading.

A block is useful only with its parents: lookups walk the chain from the first block the
device lacks and stop at the first miss (a block of other tokens or another salt identity
under the hash is one: common/hashing.py ``salt_id``); device evictions go tail first (a request frees
its last block first), so a chain's children reach the host tier's LRU end, and leave it,
before their parents. Before a KV receiver writes a decode node's reserved blocks, the
store batch reading the cached blocks they evicted must land (``before_write``).

On a simulated node the runner prices every move (engine/sim_runner.py) and reports what it
priced as the measurement (``observe_load``, the engine's prefill as ``observe_prefill``, a
step of the running batch as ``observe_batch``): the stand-in blocks' own copies time
nothing (``TierSpec.timed_by_runner``).

Events: a device eviction of a block a lower tier now holds is ``BlockStored(tier=HOST)``
(or DISK) instead of ``BlockRemoved``; a host eviction makes it DISK, or removed, unless
the device still holds it; a disk file that goes away (evicted for room, a failed write
or check) removes it unless a faster tier still has it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from ...common.config import EngineConfig
from ...common.kv_events import BlockRemoved, BlockStored, Tier
from ...common.kv_tier_stats import TierStats
from ...common.outcomes import TierFault
from .block_pool import BlockPool
from .disk_tier import DiskLayout, DiskTier
from .disk_trust import disk_key, private_dir
from ..upload import upload

log = logging.getLogger(__name__)

RATE_EWMA = 0.2  # weight of the newest measurement in a rate
GATHER_BYTES = 128 << 20  # staged at a time by a store (bounds its scratch memory): 64 blocks of Llama-3-8B


class Move(NamedTuple):
    """One batch of blocks moved between the device and a lower tier."""
    tier: Tier  # HOST or DISK: the lower tier involved
    load: bool  # True: from the tier towards the device; False: a store into the tier
    blocks: int
    nbytes: int
    seconds: float  # measured on this host (a simulated node prices the move itself)
    batch: int = 0  # a store: its number on the copy stream, counting from 1 (0: a load)
    # a load the next forward waits for whole before it starts (a reservation's, a disk read
    # on the engine thread), not one that runs beside it layer by layer
    whole: bool = False


class LowerHit(NamedTuple):
    """A prompt block found below the device by a lookup; ``load`` finds it again (it may
    have moved or gone since) and copies it in."""
    block_hash: int
    parent: int | None  # the previous block's hash in the chain
    tokens: tuple[int, ...]
    salt: bytes  # the salt identity of the request that looked it up (common/hashing.py salt_id)
    tier: Tier  # where it was found: what loading it is priced at (``load_tokens``)


class TierObserver(Protocol):
    """What watches the tiers: the node's metrics (node/metrics.py), handed to the engine at
    construction and on to its tier store. Called on the engine thread."""

    def moved(self, move: Move) -> None: ...

    def looked_up(self, queried_blocks: int, hits: dict[Tier, int]) -> None: ...

    def evicted(self, tier: Tier, blocks: int) -> None: ...

    def fault(self, tier: Tier, fault: TierFault) -> None: ...


class _HostEntry(NamedTuple):
    slot: int
    tokens: tuple[int, ...]
    salt: bytes  # the salt identity of the request that cached the block


class _Block(NamedTuple):
    """A device block to copy to the host tier."""
    block_id: int
    block_hash: int
    tokens: tuple[int, ...]
    salt: bytes


class _Rate:
    """Bytes (or tokens) per second, a moving average of measurements."""

    def __init__(self) -> None:
        self.value = 0.0  # 0: nothing measured yet

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value == 0 else (1 - RATE_EWMA) * self.value + RATE_EWMA * rate


class _Mean:
    """Seconds, a moving average of measurements."""

    def __init__(self) -> None:
        self.value = 0.0  # 0: nothing measured yet

    def add(self, seconds: float) -> None:
        if seconds > 0:
            self.value = seconds if self.value == 0 else (1 - RATE_EWMA) * self.value + RATE_EWMA * seconds


class TierSpec(NamedTuple):
    """What a tier store is built over: the KV cache, how many blocks host memory holds, and
    the disk tier below it, if any."""
    kv_caches: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    host_blocks: int
    disk: DiskTier | None = None
    # a simulated node: its runner reports the moves' (and the prefill's) modelled times as
    # the measured rates; the stand-in blocks' real copies measure nothing
    timed_by_runner: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig, kv_caches: torch.Tensor) -> TierSpec | None:
        """The tiers ``config`` asks for over ``kv_caches``, or None (no host tier)."""
        if not config.kv_offload_memory:
            return None
        block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        host_blocks = config.kv_offload_memory // block_bytes
        if host_blocks < 1:
            raise ValueError(f"kv_offload_memory: {config.kv_offload_memory} bytes hold no block of "
                             f"{block_bytes} bytes")
        disk = None
        if config.kv_offload_dir is not None:
            block = list(kv_caches[:, :, 0].shape)
            layout = DiskLayout(config.model_id, str(kv_caches.dtype).removeprefix("torch."), tuple(block))
            root = Path(config.kv_offload_dir)
            private_dir(root)  # before its key file is read or made there
            disk = DiskTier(root, layout, block_bytes, config.kv_offload_disk_bytes, disk_key(root))
        log.info("KV tiers: host %d blocks (%.0f MiB)%s", host_blocks, host_blocks * block_bytes / 2**20,
                 f", disk up to {config.kv_offload_disk_bytes / 2**20:.0f} MiB in {disk.dir}" if disk else "")
        return cls(kv_caches, host_blocks, disk, timed_by_runner=config.sim is not None)


class TierStore:
    """The host and disk tiers of one engine (see the module docstring)."""

    def __init__(self, spec: TierSpec, block_size: int, device: BlockPool, observer: TierObserver | None = None):
        """``device``: the block pool above, whose prefix cache tells which blocks the device
        holds and whose event log records the tiers' events too (one ordered stream)."""
        kv_caches, host_blocks, disk, timed_by_runner = spec
        assert host_blocks > 0, "a host tier of no blocks"
        self.timed_here = not timed_by_runner  # the store measures its own moves' rates
        self.kv = kv_caches  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.cuda = kv_caches.device.type == "cuda"
        block_shape = kv_caches[:, :, 0].shape
        self.host = torch.empty((host_blocks, *block_shape), dtype=kv_caches.dtype, pin_memory=self.cuda)
        # stores run here (CUDA): after the forward that wrote their blocks, beside the next ones
        self.copy_stream = torch.cuda.Stream(kv_caches.device) if self.cuda else None
        self._queued: dict[int, _Block] = {}  # block id -> the block, to copy to the host
        self._batch = 0  # stores issued so far, in batches (Move.batch)
        self._slot_batch: dict[int, int] = {}  # host slot -> the store batch that wrote it
        self._landed: dict[int, torch.cuda.Event] = {}  # batch -> recorded after it (CUDA), until it landed
        self._wait_for = 0  # the newest batch the next forward must wait for (0: none)
        self.host_blocks = host_blocks
        self._free_slots = list(range(host_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, _HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self._protected: set[int] = set()  # hashes of the hits being allocated: not evicted meanwhile
        self.disk = disk
        self._on_disk_pending: set[int] = set()  # hashes queued to the writer, not yet indexed
        self.device = device
        self._moves: list[Move] = []
        self.observer = observer
        self.rates = {Tier.HOST: _Rate(), Tier.DISK: _Rate()}  # loads towards the device, bytes/s
        self.store_rate = _Rate()  # device -> host, bytes/s
        self.prefill_rate = _Rate()  # the engine's, tokens/s
        self.batch_s = _Mean()  # a step of the running batch alone: the loads it hides (``hidden_load_tokens``)
        self._timed_loads: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # CUDA: (start, end, bytes)
        # loads (CUDA): on their own stream, so the forward waits for each layer's, not for them all
        self.load_stream = torch.cuda.Stream(kv_caches.device) if self.cuda else None
        self._pending: list[tuple[int, int]] = []  # host hits queued for the next forward: (slot, block id)
        self._pending_disk: list[tuple[torch.Tensor, int]] = []  # disk hits, read: (data, block id)
        self._loading: set[int] = set()  # hashes of the queued host hits: their slots are not given up
        self._load_after = 0  # the newest store batch the queued loads must wait for
        if self.cuda:  # compile the load kernel now, and fail at start-up if the GPU cannot read the slots
            from .host_load_kernel import load_layer

            zero = torch.zeros(1, dtype=torch.long, device=kv_caches.device)
            load_layer(self.host, kv_caches, zero, zero, 0)  # nothing is cached yet: block 0 is free
            torch.cuda.synchronize(kv_caches.device)

    # ---- stores (BlockPool.cache_block -> cached, flush, BlockPool.get_new_blocks -> store) --
    def cached(self, block_id: int, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> None:
        """Device block ``block_id`` now holds ``block_hash`` (its KV written, or queued to be
        by a forward or a load already issued): queue its copy to host memory unless the host
        has it (a block loaded from here)."""
        if self._entry(block_hash, tokens, salt) is not None:
            self._lru.move_to_end(block_hash)
        else:
            self._queued[block_id] = _Block(block_id, block_hash, tokens, salt)

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
        entry = self._entry(block_hash, tokens, salt)
        if entry is None:  # dropped from the host since it was cached
            self._copy_out([_Block(block_id, block_hash, tokens, salt)])
            entry = self._entry(block_hash, tokens, salt)
            if entry is None:  # everything is protected by the lookup in progress
                return Tier.DISK if self._on_disk(block_hash) else None
        self._lru.move_to_end(block_hash)  # from now on the only copy: the host's most recent
        batch = self._slot_batch.get(entry.slot, 0)
        if batch > self._wait_for:
            self._wait_for = batch
        return Tier.HOST

    def _entry(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> _HostEntry | None:
        """The host entry of ``block_hash`` if it holds ``tokens`` of ``salt`` (usually the very
        tuple the device block holds: compared by identity first)."""
        entry = self._lru.get(block_hash)
        if entry is None or (entry.tokens is not tokens and entry.tokens != tokens) or entry.salt != salt:
            return None
        return entry

    def _copy_out(self, blocks: list[_Block]) -> None:
        """Copy ``blocks`` from the device into fresh host slots (as many as the LRU can give),
        as one batch on the copy stream, and forget them from the queue."""
        for block in blocks:
            self._queued.pop(block.block_id, None)
        todo: dict[int, _Block] = {}  # hash -> the block: the host lacks it
        for block in blocks:
            h = block.block_hash
            if h in todo or self._entry(h, block.tokens, block.salt) is not None:
                continue
            stale = self._lru.pop(h, None)  # a hash collision: the other tokens' (or salt's) copy goes
            if stale is not None:
                self._free_slots.append(stale.slot)
            todo[h] = block
        moves: list[tuple[int, int]] = []  # (block id, slot)
        for (h, block), slot in zip(todo.items(), self._take_slots(len(todo))):
            self._lru[h] = _HostEntry(slot, block.tokens, block.salt)
            moves.append((block.block_id, slot))
        if not moves:
            return
        t0 = time.perf_counter()
        self._batch += 1
        if self.copy_stream is not None:
            while self._landed and next(iter(self._landed.values())).query():  # forget the landed ones
                del self._landed[next(iter(self._landed))]
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(self.copy_stream):
                self._gather_to_host(moves)
                self._landed[self._batch] = torch.cuda.Event()
                self._landed[self._batch].record()
        else:
            self._gather_to_host(moves)
        for _, slot in moves:
            self._slot_batch[slot] = self._batch
        seconds = time.perf_counter() - t0
        nbytes = len(moves) * self.block_bytes
        if not self.cuda:  # a CUDA copy returns before it ran: its time is not the rate
            self.store_rate.add(nbytes, seconds)
        self._record_move(Move(Tier.HOST, False, len(moves), nbytes, seconds, self._batch))

    def _gather_to_host(self, moves: list[tuple[int, int]]) -> None:
        """Device blocks -> host slots, ``GATHER_BYTES`` at a time: one gather into a staging
        tensor, then one scatter into the slots on the CPU, or on CUDA one copy per run of
        consecutive slots (non-blocking: the host slots are pinned and the staging tensor
        belongs to the current stream)."""
        per_chunk = max(1, GATHER_BYTES // self.block_bytes)
        for i in range(0, len(moves), per_chunk):
            chunk = moves[i:i + per_chunk]
            ids = upload([b for b, _ in chunk], self.kv.device)  # no host wait on CUDA
            staged = self.kv.movedim(2, 0).index_select(0, ids)  # [blocks, layers, 2, ...], contiguous
            if not self.cuda:
                self.host.index_copy_(0, torch.tensor([slot for _, slot in chunk]), staged)
                continue
            start = 0
            for j in range(1, len(chunk) + 1):
                if j == len(chunk) or chunk[j][1] != chunk[j - 1][1] + 1:
                    first = chunk[start][1]
                    self.host[first:first + j - start].copy_(staged[start:j], non_blocking=self.cuda)
                    start = j

    def _take_slots(self, n: int) -> list[int]:
        """Up to ``n`` host slots: free ones, then those of the least recently used entries
        neither protected by the lookup in progress nor queued to load, spilled; fewer if
        every entry is."""
        slots = [self._free_slots.pop() for _ in range(min(n, len(self._free_slots)))]
        if len(slots) < n:
            victims = list(itertools.islice((h for h in self._lru if h not in self._protected and h not in self._loading),
                                            n - len(slots)))
            slots += self._spill(victims)
        return slots

    def _spill(self, hashes: list[int]) -> list[int]:
        """Evict these host entries (to disk when there is one); their slots, free again."""
        slots: list[int] = []
        on_disk: list[int] = []  # hashes now only on disk
        removed: list[int] = []  # hashes in no tier now
        for h in hashes:
            entry = self._lru.pop(h)
            landed = self._landed.get(self._slot_batch.pop(entry.slot, 0))
            if self.disk is not None and not self._on_disk(h):
                if landed is not None:  # the slot's store must have landed before its bytes are read
                    landed.synchronize()
                payload = self.host[entry.slot].view(torch.uint8).numpy().tobytes()
                if self.disk.put(h, entry.tokens, entry.salt, payload):
                    self._on_disk_pending.add(h)
                    self._record_move(Move(Tier.DISK, False, 1, self.block_bytes, 0.0))
            if h not in self.device.cached:
                (on_disk if self._on_disk(h) else removed).append(h)
            slots.append(entry.slot)
        if hashes:
            self._count_evicted(Tier.HOST, len(hashes))
        if on_disk:
            self.device.record_event(BlockStored(on_disk, Tier.DISK))
        if removed:
            self.device.record_event(BlockRemoved(removed))
        return slots

    def _on_disk(self, block_hash: int) -> bool:
        return self.disk is not None and (block_hash in self._on_disk_pending or self.disk.contains(block_hash))

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
            if self._entry(h, tokens, salt) is not None:
                found.append((h, tokens, Tier.HOST))
            elif self.disk is not None and h not in self._on_disk_pending and self.disk.holds(h, tokens, salt):
                found.append((h, tokens, Tier.DISK))
            else:
                break
        found = found if self._load_pays(found) else []
        self._protected = set()
        hits: list[LowerHit] = []
        for i, (h, tokens, tier) in enumerate(found, start):
            if tier is Tier.HOST:
                self._lru.move_to_end(h)
                self._protected.add(h)
            hits.append(LowerHit(h, block_hashes[i - 1] if i > 0 else None, tokens, salt, tier))
        if self.observer is not None and max_blocks > start:
            self.observer.looked_up(max_blocks - start, {})  # its hits count as they load (``load``)
        return hits

    def protect(self, hits: Sequence[LowerHit]) -> None:
        """Keep the host entries of ``hits`` (about to be loaded) from being given up by the
        allocation that precedes their load (instead of the last lookup's)."""
        self._protected = {hit.block_hash for hit in hits if hit.block_hash in self._lru}

    def load_tokens(self, tier: Tier) -> float:
        """What loading one block found in ``tier`` costs, in prompt tokens the engine computes
        in the same time: its moves (a disk block is read, then copied on as a host block is)
        at the measured rates times the measured prefill rate. A rate not measured yet prices
        its move as recomputing the block (``block_size`` tokens) until it is."""
        prefill = self.prefill_rate.value
        if prefill == 0:
            return float(self.block_size)
        tokens = 0.0
        for t in (Tier.HOST, Tier.DISK) if tier is Tier.DISK else (Tier.HOST,):
            rate = self.rates[t].value
            tokens += self.block_size if rate == 0 else self.block_bytes / rate * prefill
        return tokens

    def _load_pays(self, found: list[tuple[int, tuple[int, ...], Tier]]) -> bool:
        """Whether loading ``found`` is expected to take less than recomputing its tokens, by
        the measured rates (nothing measured yet: loading is assumed to pay)."""
        prefill = self.prefill_rate.value
        if not found or prefill == 0:
            return bool(found)
        load_s = 0.0
        for _, _, tier in found:
            rates = [self.rates[Tier.HOST].value] + ([self.rates[Tier.DISK].value] if tier is Tier.DISK else [])
            if any(r == 0 for r in rates):
                return True
            load_s += sum(self.block_bytes / r for r in rates)
        return load_s < len(found) * self.block_size / prefill

    def _read_disk(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> torch.Tensor | None:
        """A block read from disk (one block of the host tier's shape), or None when its file
        is another block's or unusable (then deleted and counted by the disk tier)."""
        assert self.disk is not None
        t0 = time.perf_counter()
        payload = self.disk.read(block_hash, tokens, salt)
        if payload is None:
            self.poll()  # the file was dropped: its event and fault
            return None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.host.dtype)  # aligned
        data = data.view(self.host[0].shape)
        if self.cuda:
            data = data.pin_memory()
        seconds = time.perf_counter() - t0
        if self.timed_here:
            self.rates[Tier.DISK].add(len(payload), seconds)
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
            entry = self._entry(hit.block_hash, hit.tokens, hit.salt)
            if entry is not None:
                self._lru.move_to_end(hit.block_hash)
                self._pending.append((entry.slot, block_id))
                self._loading.add(hit.block_hash)
                self._load_after = max(self._load_after, self._slot_batch.get(entry.slot, 0))  # its store
                counts[Tier.HOST] += 1
                continue
            data = None
            if self._on_disk(hit.block_hash) and hit.block_hash not in self._on_disk_pending:
                data = self._read_disk(hit.block_hash, hit.tokens, hit.salt)
            if data is None:
                break  # gone meanwhile, a bad file, or another block's: the rest is computed
            self._pending_disk.append((data, block_id))
            counts[Tier.DISK] += 1
        loaded = counts[Tier.HOST] + counts[Tier.DISK]
        if loaded:  # and the store batches still reading the blocks this allocation evicted
            self._load_after = max(self._load_after, self._wait_for)
        if self.observer is not None and loaded:
            self.observer.looked_up(0, counts)
        self._protected = set()
        return loaded

    @property
    def loads_queued(self) -> bool:
        """Whether loads wait for the next forward (``take_loads``)."""
        return bool(self._pending or self._pending_disk)

    def take_loads(self, whole: bool = False) -> LayerLoads | None:
        """The loads queued since the last call, issued for the forward about to be issued
        (None: none); ``whole``: waited for whole before it instead (``Move.whole``: a
        reservation's). CUDA: queued now on the load stream, behind the work issued so far and
        the store batches they depend on: disk hits whole, then the host hits one layer at a
        time (engine/kv/host_load_kernel.py), each layer's end recorded for the forward to wait
        on. CPU: disk hits copied now, host hits when the forward reaches each layer."""
        if not self._pending and not self._pending_disk:
            return None
        pending, disk, after = self._pending, self._pending_disk, self._load_after
        self._pending, self._pending_disk, self._loading, self._load_after = [], [], set(), 0
        nbytes = (len(pending) + len(disk)) * self.block_bytes
        if self.load_stream is None:
            return LayerLoads(self, pending, disk, None, nbytes, whole)
        from .host_load_kernel import load_layer

        t0 = time.perf_counter()
        self.load_stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self.load_stream):
            self._wait_on(after)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for data, block_id in disk:
                self.kv[:, :, block_id].copy_(data, non_blocking=True)
            slots = upload([s for s, _ in pending], self.kv.device, torch.long)
            blocks = upload([b for _, b in pending], self.kv.device, torch.long)
            layers: list[torch.cuda.Event] = []
            for layer in range(self.kv.shape[0]):
                load_layer(self.host, self.kv, slots, blocks, layer)
                layers.append(torch.cuda.Event())
                layers[-1].record()
            end.record()
        self._measure_loads()  # a CUDA copy returns before it ran: its rate is read from the events once it did
        self._timed_loads.append((start, end, nbytes))
        self._record_move(Move(Tier.HOST, True, len(pending) + len(disk), nbytes, time.perf_counter() - t0,
                               whole=whole))
        return LayerLoads(self, pending, disk, layers, nbytes, whole)

    def _loaded_on_cpu(self, blocks: int, nbytes: int, seconds: float, whole: bool) -> None:
        """A CPU load's copies are done (``LayerLoads``): its rate and its move."""
        if self.timed_here:
            self.rates[Tier.HOST].add(nbytes, seconds)
        self._record_move(Move(Tier.HOST, True, blocks, nbytes, seconds, whole=whole))

    def before_forward(self) -> int:
        """Called as a forward is about to be issued: the newest store batch it must wait for
        (it overwrites a block, or reads a slot, that batch copies), 0 for none. On CUDA the
        wait is queued on the forward's stream: the host does not wait."""
        batch, self._wait_for = self._wait_for, 0
        self._wait_on(batch)
        return batch

    def _wait_on(self, batch: int) -> None:
        """Make the current stream wait for store ``batch`` (and so every one before it)."""
        landed = self._landed.get(batch)
        if landed is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(landed)

    def before_write(self) -> None:
        """Called before another thread (a KV receiver) writes device blocks just allocated:
        wait, on the host, for the store batch that reads the cached blocks they evicted
        (usually landed long ago: no wait). Not for the rest of the copy stream, nor for the
        step in flight; a receiver never writes the allocation's hit blocks, whose loads the
        caller issues and waits for (``take_loads``) before handing the blocks over."""
        landed = self._landed.get(self._wait_for)
        if landed is not None:
            landed.synchronize()

    def _measure_loads(self) -> None:
        """CUDA: the host-to-device rate of the loads that ran since the last call."""
        while self._timed_loads and self._timed_loads[0][1].query():
            start, end, nbytes = self._timed_loads.pop(0)
            if self.timed_here:
                self.rates[Tier.HOST].add(nbytes, start.elapsed_time(end) / 1e3)

    # ---- the engine's other hooks ----------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``seconds``: the recompute rate."""
        self.prefill_rate.add(tokens, seconds)

    def observe_batch(self, seconds: float) -> None:
        """A step of the running batch alone (no prompt tokens, no loads) took ``seconds``."""
        self.batch_s.add(seconds)

    def hidden_load_tokens(self) -> float:
        """What a step of the running batch hides of its loads, in prompt tokens: its measured
        duration (loads overlap the forward layer by layer, so loads that take no longer than
        it lengthen it by a layer's share at most); inf while either is unmeasured."""
        if self.batch_s.value == 0 or self.prefill_rate.value == 0:
            return float("inf")
        return self.batch_s.value * self.prefill_rate.value

    def observe_load(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A load's move out of ``tier`` took ``seconds`` (a simulated node's runner: the time
        it priced the move at, module docstring)."""
        self.rates[tier].add(nbytes, seconds)

    def clear(self) -> None:
        """Forget every block in every lower tier (the prefix cache was reset: the caller
        records ``AllBlocksCleared``); the disk tier's files are deleted."""
        for entry in self._lru.values():
            self._free_slots.append(entry.slot)
        self._lru.clear()
        self._queued.clear()
        self._slot_batch.clear()
        self._protected = set()
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
            if h not in self._lru and h not in self.device.cached:
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
        held.update(dict.fromkeys(self._lru, Tier.HOST))
        return held

    def take_moves(self) -> list[Move]:
        """The moves since the last call (a simulated node prices them with its profile)."""
        moves, self._moves = self._moves, []
        return moves

    def stats(self) -> list[TierStats]:
        self._measure_loads()
        out = [TierStats(tier=Tier.HOST, capacity_blocks=self.host_blocks, used_blocks=len(self._lru),
                         block_bytes=self.block_bytes, load_bytes_per_s=self.rates[Tier.HOST].value,
                         store_bytes_per_s=self.store_rate.value)]
        if self.disk is not None:
            store = self.disk.stored_bytes / self.disk.store_s if self.disk.store_s > 0 else 0.0
            out.append(TierStats(tier=Tier.DISK, capacity_blocks=self.disk.capacity_blocks,
                                 used_blocks=self.disk.used_blocks, block_bytes=self.block_bytes,
                                 load_bytes_per_s=self.rates[Tier.DISK].value, store_bytes_per_s=store))
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


class LayerLoads:
    """The lower-tier loads one forward reads (``TierStore.take_loads``), in place layer by
    layer, so the forward's first layers compute while later layers still cross the bus:

    - ``wait(layer)``: before the forward's layer ``layer`` reads the cache. CUDA: the
      current stream waits for that layer's copies; CPU: layers up to ``layer`` are copied
      now (each once);
    - ``wait_all()``: before a forward that cannot wait per layer (a static decode step), or
      a loaded block is handed to another owner (a reservation a receiver writes around);
    - ``then(fn)``: work that reads the loaded blocks without holding up the forward (a
      prefill node packing a cached prefix to send). CUDA: ``fn`` queues it on the load
      stream, behind the copies; CPU: after every layer is copied.
    """

    def __init__(self, tiers: TierStore, host: list[tuple[int, int]], disk: list[tuple[torch.Tensor, int]],
                 layers: list[torch.cuda.Event] | None, nbytes: int, whole: bool = False):
        self._tiers = tiers
        self._whole = whole  # waited for whole before a forward (``Move.whole``)
        self._layers = layers  # CUDA: recorded after each layer's copies
        self._num_layers = tiers.kv.shape[0]
        self._next = 0  # CPU: the first layer not copied yet
        self._blocks, self._nbytes, self._seconds = len(host) + len(disk), nbytes, 0.0
        if layers is None:  # CPU: the host hits' copies wait for the forward's layers
            self._slots = torch.tensor([s for s, _ in host], dtype=torch.long)
            self._ids = torch.tensor([b for _, b in host], dtype=torch.long)
            t0 = time.perf_counter()
            for data, block_id in disk:
                tiers.kv[:, :, block_id].copy_(data)
            self._seconds = time.perf_counter() - t0

    def wait(self, layer: int) -> None:
        if self._layers is not None:
            torch.cuda.current_stream(self._tiers.kv.device).wait_event(self._layers[layer])
            return
        if self._next > layer:
            return
        t0 = time.perf_counter()
        kv, host = self._tiers.kv, self._tiers.host
        for at in range(self._next, layer + 1):
            if len(self._ids):
                kv[at].index_copy_(1, self._ids, host[self._slots, at].transpose(0, 1))
        self._next = layer + 1
        self._seconds += time.perf_counter() - t0
        if self._next == self._num_layers:
            self._tiers._loaded_on_cpu(self._blocks, self._nbytes, self._seconds, self._whole)

    def wait_all(self) -> None:
        self.wait(self._num_layers - 1)

    def then(self, fn: Callable[[], None]) -> None:
        if self._layers is None:
            self.wait_all()
            fn()
            return
        with torch.cuda.stream(self._tiers.load_stream):
            fn()

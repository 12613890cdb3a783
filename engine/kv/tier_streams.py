"""The lower tiers' copies and their order against the forward: stores from the KV cache into
host slots, loads from host slots (or blocks read from disk) back into device blocks.

Owns the copy and load streams (CUDA; plain copies on the CPU), the store batches (which batch
last wrote each host slot, the event recorded after each until it landed, the newest one the
next forward must wait for), the loads queued for the next forward, and ``LayerLoads``: the
forward's view of the loads it reads, layer by layer. Engine thread only. Must not: choose
which blocks move or where (tier_store.py; the slots are host_tier.py's), or price a move (it
reports what it measured: tier_policy.py's rates, a ``Move`` per batch)::

    current stream  ... forward N ....................| forward N+1: layer 0 | layer 1 | ...
    copy stream        store batch b: waits for the work issued so far (forward N wrote the
                       blocks), gathers them into host slots beside the next forwards
    load stream        the next forward's loads: wait for the work issued so far and the store
                       batches that wrote their slots (or read the blocks their allocation
                       evicted), then one layer after another (one kernel per layer reading the
                       pinned slots: host_load_kernel.py); the forward waits for a layer's
                       copies only as it reaches that layer

A store batch waits for the work issued before it, so it never overwrites a slot a load is
still reading. A forward that overwrites a block a store batch still reads waits for that batch
(``before_forward``: queued on the forward's stream, the host does not wait); a receiver about
to write such a block waits for it on the host (``before_write``). On the CPU every copy is done
when it returns, but for a load's host hits, copied as the forward reaches each layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...common.kv_events import Tier
from ..upload import upload
from .tier_policy import TierPolicy
from .tier_spec import Move

GATHER_BYTES = 128 << 20  # staged at a time by a store (bounds its scratch memory): 64 blocks of Llama-3-8B


class TierStreams:
    """The copies between one engine's KV cache and its host slots (module docstring)."""

    def __init__(self, kv_caches: torch.Tensor, host: torch.Tensor, policy: TierPolicy, timed_here: bool,
                 record: Callable[[Move], None]):
        """``host``: the host tier's slots; ``policy``: where the measured rates go (``timed_here``:
        measured by these copies, not by a simulated node's runner); ``record``: each move."""
        self.kv = kv_caches  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.host = host  # [slots, layers, 2, block_size, kv_heads, head_dim]
        self.block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.cuda = kv_caches.device.type == "cuda"
        self.policy = policy
        self.timed_here = timed_here
        self._record = record
        # stores run here (CUDA): after the forward that wrote their blocks, beside the next ones
        self.copy_stream = torch.cuda.Stream(kv_caches.device) if self.cuda else None
        self._batch = 0  # stores issued so far, in batches (Move.batch)
        self._slot_batch: dict[int, int] = {}  # host slot -> the store batch that wrote it
        self._landed: dict[int, torch.cuda.Event] = {}  # batch -> recorded after it (CUDA), until it landed
        self._wait_for = 0  # the newest batch the next forward must wait for (0: none)
        self._timed_loads: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # CUDA: (start, end, bytes)
        # loads (CUDA): on their own stream, so the forward waits for each layer's, not for them all
        self.load_stream = torch.cuda.Stream(kv_caches.device) if self.cuda else None
        self._pending: list[tuple[int, int]] = []  # host hits queued for the next forward: (slot, block id)
        self._pending_disk: list[tuple[torch.Tensor, int]] = []  # disk hits, read: (data, block id)
        self._load_after = 0  # the newest store batch the queued loads must wait for
        if self.cuda:  # compile the load kernel now, and fail at start-up if the GPU cannot read the slots
            from .host_load_kernel import load_layer

            zero = torch.zeros(1, dtype=torch.long, device=kv_caches.device)
            load_layer(self.host, kv_caches, zero, zero, 0)  # nothing is cached yet: block 0 is free
            torch.cuda.synchronize(kv_caches.device)

    # ---- stores ----------------------------------------------------------------------------
    def store(self, moves: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots, ``(block id, slot)`` pairs, as one batch: in the
        background on CUDA (the copy stream waits for the work issued so far, then copies),
        plain copies on the CPU."""
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
            self.policy.store_rate.add(nbytes, seconds)
        self._record(Move(Tier.HOST, False, len(moves), nbytes, seconds, self._batch))

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

    def forward_overwrites(self, slot: int) -> None:
        """The next forward may overwrite the device block whose copy into ``slot`` is the store
        batch that wrote it: that forward waits for the batch (``before_forward``)."""
        batch = self._slot_batch.get(slot, 0)
        if batch > self._wait_for:
            self._wait_for = batch

    def give_up(self, slot: int, read: bool) -> None:
        """``slot`` leaves the host tier; ``read``: its bytes are read on the host next (a spill
        to disk), so the host waits here for the store batch that wrote it."""
        landed = self._landed.get(self._slot_batch.pop(slot, 0))
        if read and landed is not None:  # the slot's store must have landed before its bytes are read
            landed.synchronize()

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

    def clear(self) -> None:
        """Every slot is free again: none was written by a batch."""
        self._slot_batch.clear()

    # ---- loads -----------------------------------------------------------------------------
    def queue_host_load(self, slot: int, block_id: int) -> None:
        """Copy ``slot`` into device block ``block_id`` in the next forward (after its store)."""
        self._pending.append((slot, block_id))
        self._load_after = max(self._load_after, self._slot_batch.get(slot, 0))  # its store

    def queue_disk_load(self, data: torch.Tensor, block_id: int) -> None:
        """Copy ``data`` (a block read from disk) into device block ``block_id`` in the next forward."""
        self._pending_disk.append((data, block_id))

    def after_evictions(self) -> None:
        """The queued loads also wait for the store batches still reading the blocks their
        allocation evicted."""
        self._load_after = max(self._load_after, self._wait_for)

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
        self._pending, self._pending_disk, self._load_after = [], [], 0
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
        self.measure_loads()  # a CUDA copy returns before it ran: its rate is read from the events once it did
        self._timed_loads.append((start, end, nbytes))
        self._record(Move(Tier.HOST, True, len(pending) + len(disk), nbytes, time.perf_counter() - t0,
                          whole=whole))
        return LayerLoads(self, pending, disk, layers, nbytes, whole)

    def _loaded_on_cpu(self, blocks: int, nbytes: int, seconds: float, whole: bool) -> None:
        """A CPU load's copies are done (``LayerLoads``): its rate and its move."""
        if self.timed_here:
            self.policy.rates[Tier.HOST].add(nbytes, seconds)
        self._record(Move(Tier.HOST, True, blocks, nbytes, seconds, whole=whole))

    def measure_loads(self) -> None:
        """CUDA: the host-to-device rate of the loads that ran since the last call."""
        while self._timed_loads and self._timed_loads[0][1].query():
            start, end, nbytes = self._timed_loads.pop(0)
            if self.timed_here:
                self.policy.rates[Tier.HOST].add(nbytes, start.elapsed_time(end) / 1e3)


class LayerLoads:
    """The lower-tier loads one forward reads (``TierStreams.take_loads``), in place layer by
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

    def __init__(self, tiers: TierStreams, host: list[tuple[int, int]], disk: list[tuple[torch.Tensor, int]],
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

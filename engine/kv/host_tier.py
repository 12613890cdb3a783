"""The host tier's memory and its LRU: slots shaped like the KV cache's blocks, and which block
each holds.

Owns the slots (one tensor, slot-major so each slot is one contiguous range, pinned on CUDA),
the LRU map (block hash -> slot, tokens, salt identity, least recently used first), the free
slots, and the two sets of entries that must not be given up: those a lookup is about to
allocate (``protected``) and those queued to load (``loading``). Engine thread only. Must not:
copy a block (tier_streams.py), spill one to disk or record an event (tier_store.py: an
evicted entry is handed to its ``spill``).

A slot is given up least recently used first, whether or not the device still holds its
block (the tier is inclusive: a device eviction then finds its copy here and touches it, since
from then on it is the only copy). A hash holding other tokens or another salt identity than
a block's is another block (common/hashing.py ``salt_id``): its entry is no hit, and a store
of the block drops it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch


class HostEntry(NamedTuple):
    slot: int
    tokens: tuple[int, ...]
    salt: bytes  # the salt identity of the request that cached the block


class DeviceBlock(NamedTuple):
    """A device block to copy to the host tier."""
    block_id: int
    block_hash: int
    tokens: tuple[int, ...]
    salt: bytes


# the entries a placement evicted, (hash, entry) least recently used first: their slots are
# reused as soon as the call returns
Spill = Callable[[list[tuple[int, HostEntry]]], None]


class HostTier:
    """Host memory below one engine's KV cache (module docstring)."""

    def __init__(self, blocks: int, block_shape: torch.Size, dtype: torch.dtype, pin: bool):
        """``blocks`` slots of ``block_shape`` ([layers, 2, block_size, kv_heads, head_dim]: one
        block of the KV cache); ``pin``: in pinned memory (CUDA copies run beside the host)."""
        assert blocks > 0, "a host tier of no blocks"
        self.blocks = blocks
        self.slots = torch.empty((blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self._free = list(range(blocks - 1, -1, -1))
        self._lru: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self.protected: set[int] = set()  # hashes of the hits being allocated: not evicted meanwhile
        self.loading: set[int] = set()  # hashes of the queued host hits: their slots are not given up

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[int]:
        """The hashes held, least recently used first."""
        return iter(self._lru)

    def entry(self, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> HostEntry | None:
        """The entry of ``block_hash`` if it holds ``tokens`` of ``salt`` (usually the very
        tuple the device block holds: compared by identity first)."""
        entry = self._lru.get(block_hash)
        if entry is None or (entry.tokens is not tokens and entry.tokens != tokens) or entry.salt != salt:
            return None
        return entry

    def touch(self, block_hash: int) -> None:
        """``block_hash`` becomes the most recently used."""
        self._lru.move_to_end(block_hash)

    def place(self, blocks: list[DeviceBlock], spill: Spill) -> list[tuple[int, int]]:
        """Slots for those of ``blocks`` the tier lacks, now entries (an entry of other tokens or
        salt under a block's hash is dropped first): free slots, then those of the least
        recently used entries neither protected nor loading, evicted and handed to ``spill``;
        fewer if every entry is. Returns (block id, slot) pairs: the copies to make."""
        todo: dict[int, DeviceBlock] = {}  # hash -> the block: the tier lacks it
        for block in blocks:
            h = block.block_hash
            if h in todo or self.entry(h, block.tokens, block.salt) is not None:
                continue
            stale = self._lru.pop(h, None)  # a hash collision: the other tokens' (or salt's) copy goes
            if stale is not None:
                self._free.append(stale.slot)
            todo[h] = block
        moves: list[tuple[int, int]] = []  # (block id, slot)
        for (h, block), slot in zip(todo.items(), self._take_slots(len(todo), spill)):
            self._lru[h] = HostEntry(slot, block.tokens, block.salt)
            moves.append((block.block_id, slot))
        return moves

    def _take_slots(self, n: int, spill: Spill) -> list[int]:
        """Up to ``n`` slots: free ones, then those of the least recently used entries neither
        protected nor loading, evicted (``spill``)."""
        slots = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(slots) < n:
            victims = list(itertools.islice((h for h in self._lru if h not in self.protected and h not in self.loading),
                                            n - len(slots)))
            evicted = [(h, self._lru.pop(h)) for h in victims]
            spill(evicted)
            slots += [entry.slot for _, entry in evicted]
        return slots

    def clear(self) -> None:
        """Forget every entry: every slot is free again."""
        for entry in self._lru.values():
            self._free.append(entry.slot)
        self._lru.clear()
        self.protected = set()

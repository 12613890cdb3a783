"""The pool of KV cache blocks of one node: free queue, reference counts, prefix
cache map, and the prefix-cache event log.

Owns: every ``KVBlock`` (ids ``0 .. num_blocks-1``), which of them are free, and
which full blocks are registered under a block hash. Must not: know about requests
(``cache_manager`` maps requests to blocks), touch tensors (a block id is an
index into the KV tensors the model owns), or compute hashes (``common.hashing``).

Block states::

    state              ref_cnt   in free queue   in ``cached`` map
    free, uncached     0         yes             no
    free, cached       0         yes             yes   (evictable)
    in use, uncached   > 0       no              no
    in use, cached     > 0       no              yes

    free, *           --get_new_blocks-->  in use, uncached  (a cached one is evicted: BlockRemoved,
                                                            or BlockStored(tier) if ``lower.store``
                                                            kept its KV in a lower tier)
    in use, uncached  --cache_block----->  in use, cached    (BlockStored; ``lower.cached`` queues
                                                            the block's copy to a lower tier)
    in use, *         --free_blocks----->  free, *           (once ref_cnt reaches 0; queue tail)
    free, cached      --touch----------->  in use, cached    (prefix hit)

A block is in the free queue iff its ``ref_cnt`` is 0. A free block may still be
cached: it keeps its hash, tokens and salt until ``get_new_blocks`` pops it for reuse
(eviction), so the queue head is both the next block handed out and the next
cached block evicted (least recently freed first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of KV cache slots. Compared by identity (``eq=False``)."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache, else None.
    block_hash: int | None = None
    # The block's tokens while cached; a prefix hit must match them exactly.
    token_ids: tuple[int, ...] | None = None
    # The salt identity of the request that cached it (common/hashing.py salt_id), while
    # cached; a prefix hit must match it too (the 64-bit hash alone could collide across salts).
    salt: bytes | None = None
    # Links of the free queue; both None while the block is not in it.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class LowerTiers(Protocol):
    """The tiers below the device, as the pool's operations tell them of a block cached or
    evicted (engine/kv/tier_store.py ``TierStore``; the cache manager hands them in)."""

    def cached(self, block_id: int, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> None:
        """Device block ``block_id`` was registered in the prefix cache."""

    def store(self, block_id: int, block_hash: int, tokens: tuple[int, ...], salt: bytes) -> Tier | None:
        """Cached block ``block_id`` is about to be reused: keep its KV; the lower tier that now
        holds it, or None."""


class FreeBlockQueue:
    """A doubly linked list of free blocks, in eviction order (head first).

    All operations are O(1). Sentinels at both ends mean a block is in the queue
    iff its ``prev_free`` is not None::

        head_sentinel <-> b7 <-> b2 <-> b5 <-> tail_sentinel
                          ^ popleft              ^ append goes here
    """

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        """Remove and return the head (the least recently freed block)."""
        assert self._len > 0, "popleft from an empty free queue"
        block = self._head.next_free
        assert block is not None and block is not self._tail
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, (
            f"block {block.block_id} is already in the free queue"
        )
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All KV blocks of a node, their free queue and the prefix cache map.

    Contracts:
      - ``ref_cnt == 0`` iff the block is in the free queue.
      - ``cached[h] is b`` implies ``b.block_hash == h``; a block with a hash is in
        ``cached`` under that hash. Only full blocks are cached.
      - Every change of ``cached`` is recorded as an event, in order, until
        ``take_events`` drains them (nothing recorded with caching disabled).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block_hash -> block
        self._events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now, including cached-but-evictable ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, n: int, lower: LowerTiers | None = None) -> list[KVBlock]:
        """Pop ``n`` blocks from the free queue head, each returned with ref_cnt 1.

        A popped block still holding a hash is evicted from the prefix cache (a
        ``BlockRemoved`` event, or ``BlockStored(tier)`` when ``lower`` kept its KV). The
        caller checks ``num_free_blocks`` first.
        """
        assert 0 <= n <= len(self.free_queue), (
            f"asked for {n} blocks, {len(self.free_queue)} free"
        )
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                self._evict(block, lower)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock, lower: LowerTiers | None) -> None:
        h = block.block_hash
        assert h is not None and self.cached.get(h) is block, (
            f"block {block.block_id} has hash {h} but is not the cached entry"
        )
        assert block.token_ids is not None and block.salt is not None
        tier = lower.store(block.block_id, h, block.token_ids, block.salt) if lower is not None else None
        del self.cached[h]
        block.block_hash = None
        block.token_ids = None
        block.salt = None
        self.record_event(BlockRemoved([h]) if tier is None else BlockStored([h], tier))

    def record_event(self, event: BlockRemoved | BlockStored) -> None:
        """Append a removal, or a move to a lower tier, to the event log (merged into the last
        event of its kind and tier). Device stores go through ``cache_block``."""
        last = self._events[-1] if self._events else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            last.block_hashes.extend(event.block_hashes)
        elif (isinstance(event, BlockStored) and isinstance(last, BlockStored) and last.tier is event.tier
              and event.tier is not Tier.DEVICE):
            last.block_hashes.extend(event.block_hashes)
        else:
            self._events.append(event)

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int], salt: bytes) -> KVBlock | None:
        """The block cached under ``block_hash`` if it holds exactly ``token_ids`` and was
        cached by a request of salt identity ``salt``.

        Does not change ref counts. A hash collision (same hash, other tokens or another
        salt) is a miss.
        """
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids) or block.salt != salt:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block (prefix hits); a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; those reaching 0 join the queue tail in
        the given order (first given is evicted first). They stay cached."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: int,
        parent_hash: int | None,
        token_ids: Sequence[int],
        salt: bytes,
        lower: LowerTiers | None = None,
    ) -> bool:
        """Register the full, in-use ``block`` under ``block_hash`` (and tell ``lower``).

        ``token_ids`` are the block's tokens (their count is the block size), ``salt``
        the salt identity of the request whose KV it holds (common/hashing.py ``salt_id``);
        ``parent_hash`` is the previous block's hash in the chain, for the event.
        Returns True if registered. Returns False and records nothing when caching
        is disabled, or when another block already holds ``block_hash`` (that one
        stays; this block stays uncached). Caching a block again under its own hash
        is a no-op returning True.
        """
        if not self.enable_caching:
            return False
        assert block.ref_cnt > 0, f"caching free block {block.block_id}"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (
                f"block {block.block_id} is cached as {block.block_hash}, not {block_hash}"
            )
            return True
        if block_hash in self.cached:
            return False
        tokens = tuple(token_ids)
        block.block_hash = block_hash
        block.token_ids = tokens
        block.salt = salt
        self.cached[block_hash] = block
        if lower is not None:
            lower.cached(block.block_id, block_hash, tokens, salt)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.tier is Tier.DEVICE and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)  # the chain goes on: one event
        else:
            self._events.append(BlockStored([block_hash]))
        return True

    def take_events(self) -> list[KVEvent]:
        """Return the events recorded since the last call, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed with no block in use: returns False
        (changing nothing) otherwise. Records ``AllBlocksCleared``."""
        if len(self.free_queue) != self.num_blocks:
            return False
        if not self.enable_caching:
            return True
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
            block.salt = None
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

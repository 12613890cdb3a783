"""The per-request view of the KV cache, used by the schedulers: prefix-cache
lookup, block allocation as a request grows, registering full blocks, freeing.

Owns: ``req_id -> blocks``, ``req_id -> how many of them are cached`` and ``req_id -> the
lower-tier hits it has still to load`` (its *pending run*: a long run loads over several
steps, a budget's worth each, scheduler.py). Must not: hash tokens (callers pass the
chained hashes from ``common.hashing``, computed with the same extra keys as the router,
and the salt identity of those keys, ``salt_id``, which every hit must match beside the
tokens), decide admission, preemption or how much of a run a step loads (the scheduler
does, from ``num_blocks_needed``, ``num_free_blocks`` and ``lower_plan``), or touch tensors.

It builds and owns the tier store below the device (kv/tier_store.py), if configured, and is
the engine's and the runners' one way to it: lookups run inside ``get_computed_blocks``, what
loading a run costs is ``lower_plan``, the loads are queued by ``allocate_slots`` and issued by
the step's ``take_loads`` (and ``before_forward``), its stores ``save_cached``, and
``tier_stats`` reports every tier. The block pool and the tier store hold no hooks into each
other: the manager hands the store to the pool's operations that cache or evict a block.

A request's blocks, by token position (block_size = 4)::

    tokens:  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 t13 _ _ |
    blocks:  |  blocks[0]  |  blocks[1]  |   blocks[2]   |  blocks[3]  |
             |<- computed (prefix hits) ->|<------ newly allocated ---->|
             |<---------- cached ------------------------>|  partial: never cached
                                                          ^ num_computed_tokens // 4 = 3

    blocks needed for n tokens:  ceil(n / block_size)
    block i holds tokens:        token_ids[i * block_size : (i + 1) * block_size]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...common.config import EngineConfig
from ...common.kv_events import KVEvent, Tier
from ...common.kv_tier_stats import TierStats
from .block_pool import BlockPool, KVBlock
from .tier_spec import LowerHit, Move, TierObserver, TierSpec
from .tier_store import TierStore
from .tier_streams import LayerLoads


class ComputedBlocks(NamedTuple):
    """Leading blocks of a prompt found in the prefix cache: on the device (``blocks``),
    then the run after them found in a lower tier (``lower``: each gets a new device block
    and its KV loaded there when allocated)."""

    blocks: list[KVBlock]
    num_tokens: int  # == (len(blocks) + len(lower)) * block_size
    lower: list[LowerHit] = []


class LowerPlan(NamedTuple):
    """How many leading blocks of a run of lower-tier hits a step loads, and what that costs
    in prompt tokens (``KVCacheManager.lower_plan``)."""

    blocks: int
    tokens: float


class KVCacheManager:
    """Maps requests to KV blocks of one ``BlockPool``.

    Contracts:
      - A request owns one reference on each of its blocks, from its first
        ``allocate_slots`` until ``free``.
      - Its first ``num_cached`` blocks are registered in the prefix cache (or were
        refused as duplicates); the rest are not.
      - After every request is freed, every ref count is 0 and
        ``num_free_blocks == num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: TierSpec | None = None, observer: TierObserver | None = None) -> None:
        """``tiers``: the lower tiers of the prefix cache to build (kv/tier_store.py), if any,
        watched by ``observer``."""
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.tiers = None if tiers is None else TierStore(tiers, block_size, self.pool, observer)
        self._req_blocks: dict[str, list[KVBlock]] = {}  # req_id -> blocks, in token order
        self._num_cached: dict[str, int] = {}  # req_id -> leading blocks already cached
        self._pending: dict[str, list[LowerHit]] = {}  # req_id -> lower-tier hits still to load, in order

    @classmethod
    def build(cls, config: EngineConfig, num_blocks: int, kv_caches: torch.Tensor,
              observer: TierObserver | None = None) -> KVCacheManager:
        """The manager of an engine's ``num_blocks`` blocks of ``kv_caches``, with the lower tiers
        ``config`` asks for."""
        return cls(num_blocks, config.block_size, config.enable_prefix_caching,
                   TierSpec.from_config(config, kv_caches), observer)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._req_blocks

    def get_computed_blocks(self, block_hashes: list[int], token_ids: Sequence[int], salt: bytes,
                            whole: bool = False) -> ComputedBlocks:
        """The longest run of leading prompt blocks held in the prefix cache.

        ``block_hashes`` are the prompt's chained full-block hashes, ``token_ids``
        the prompt, ``salt`` the salt identity of its extra keys (``salt_id``). Each hit
        is verified against the block's stored tokens and salt identity. Ref
        counts are not changed: pass the result to ``allocate_slots`` before any
        other allocation can evict the blocks.

        With lower tiers, the run of blocks after the device hits that a lower tier holds
        follows in ``lower`` (when loading them pays: kv/tier_store.py ``lookup``).

        At least one prompt token is always left to compute (its logits give the
        first sampled token), so at most ``(len(token_ids) - 1) // block_size``
        blocks are returned::

            8 tokens, block_size 4, both blocks cached -> 1 block (t4..t7 recomputed)
            9 tokens, block_size 4, both blocks cached -> 2 blocks (t8 computed)

        ``whole``: every full block may hit (nothing will be computed: a prefix exported
        to another node).
        """
        if not self.enable_prefix_caching or not token_ids:
            return ComputedBlocks([], 0)
        bs = self.block_size
        max_blocks = min(len(block_hashes), (len(token_ids) if whole else len(token_ids) - 1) // bs)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(block_hashes[i], token_ids[i * bs : (i + 1) * bs], salt)
            if block is None:
                break
            hits.append(block)
        lower = [] if self.tiers is None or len(hits) == max_blocks else \
            self.tiers.lookup(block_hashes, token_ids, salt, len(hits), max_blocks)
        return ComputedBlocks(hits, (len(hits) + len(lower)) * bs, lower)

    def num_blocks_needed(
        self, req_id: str, num_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> int:
        """Free-queue blocks that ``allocate_slots(req_id, num_tokens,
        computed_blocks)`` would take: the new blocks, plus (on a first allocation)
        the computed blocks at ref_cnt 0, which leave the free queue when touched.
        The allocation succeeds iff this is ``<= num_free_blocks``."""
        owned = self._req_blocks.get(req_id)
        if owned is not None:
            assert not computed_blocks, f"{req_id}: computed blocks on a later allocation"
            have, evictable = len(owned), 0
        else:
            have = len(computed_blocks)
            evictable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        total = -(-num_tokens // self.block_size)  # ceil
        return max(0, total - have) + evictable

    def allocate_slots(
        self, req_id: str, num_tokens: int, computed_blocks: Sequence[KVBlock] = (),
        lower: Sequence[LowerHit] = (), num_load: int | None = None,
    ) -> list[KVBlock] | None:
        """Make ``req_id`` own blocks for ``num_tokens`` tokens in total.

        On the first call for ``req_id``, ``computed_blocks`` (from
        ``get_computed_blocks``, unchanged since) become its leading blocks and are
        touched, and ``lower``, the hits that followed them, its pending run. The first
        ``num_load`` hits of the pending run (all when None) take the first new blocks:
        each found again in its tier, registered in the prefix cache and its KV loaded
        (tier_store.py ``load``); the run ends at one no tier holds any more, and the
        blocks after it are plain new blocks (their tokens are computed). Later calls
        pass no blocks or hits, only ``num_load`` (``num_tokens`` must cover the blocks
        loaded). Returns the newly allocated blocks (possibly empty), or None, changing
        nothing, if the pool is short.
        """
        if self.num_blocks_needed(req_id, num_tokens, computed_blocks) > self.pool.num_free_blocks:
            return None
        owned = self._req_blocks.get(req_id)
        if lower:
            assert owned is None, f"{req_id}: lower-tier hits on a later allocation"
            self._pending[req_id] = list(lower)
        pending = self._pending.get(req_id, [])
        load = pending[:len(pending) if num_load is None else num_load]
        if load:
            assert self.tiers is not None
            self.tiers.protect(load)  # their host entries outlive the evictions below
        if owned is None:
            assert num_tokens >= len(computed_blocks) * self.block_size, (
                f"{req_id}: {num_tokens} tokens but {len(computed_blocks)} computed blocks"
            )
            for b in computed_blocks:
                assert b.block_hash is not None, (
                    f"{req_id}: computed block {b.block_id} was evicted before allocation"
                )
            self.pool.touch(computed_blocks)
            owned = self._req_blocks[req_id] = list(computed_blocks)
            self._num_cached[req_id] = len(computed_blocks)
        total = -(-num_tokens // self.block_size)
        new = self.pool.get_new_blocks(max(0, total - len(owned)), self.tiers)
        if load:
            assert self.tiers is not None and len(owned) == self._num_cached[req_id] and len(new) >= len(load), (
                f"{req_id}: {len(load)} lower-tier hits to load into {len(new)} new blocks")
            # a hit the device holds again (loaded or computed by another request since) ends the run
            fresh = next((i for i, hit in enumerate(load) if hit.block_hash in self.pool.cached), len(load))
            loaded = self.tiers.load(load[:fresh], [b.block_id for b in new[:fresh]])
            for hit, block in zip(load[:loaded], new):
                stored = self.pool.cache_block(block, hit.block_hash, hit.parent, hit.tokens, hit.salt, self.tiers)
                assert stored, f"{req_id}: a lower-tier hit {hit.block_hash:x} is already on the device"
            self._num_cached[req_id] += loaded
            if loaded < len(load) or loaded == len(pending):
                del self._pending[req_id]  # loaded whole, or it ended: the rest is computed
            else:
                del pending[:loaded]
        owned.extend(new)
        return new

    def pending_lower(self, req_id: str) -> Sequence[LowerHit]:
        """The lower-tier hits ``req_id`` has still to load (its pending run), in order; the
        next ``allocate_slots`` of ``req_id`` changes it."""
        return self._pending.get(req_id, [])

    def lower_plan(self, hits: Sequence[LowerHit], budget: float, at_least_one: bool = False) -> LowerPlan:
        """How many leading ``hits`` a step loads within ``budget`` prompt tokens (at least one
        with ``at_least_one``: the step's oldest prompt work progresses), and their cost, each
        block priced by the tier it was found in at the measured rates (tier_policy.py
        ``load_tokens``)."""
        if not hits:
            return LowerPlan(0, 0.0)
        assert self.tiers is not None
        cost, n = 0.0, 0
        price = {t: self.tiers.policy.load_tokens(t) for t in (Tier.HOST, Tier.DISK)}
        for hit in hits:
            c = price[hit.tier]
            if cost + c > budget and not (n == 0 and at_least_one):
                break
            cost += c
            n += 1
        return LowerPlan(n, cost)

    def num_cached_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id``'s leading blocks held in the prefix cache: its device hits and
        the lower-tier hits loaded so far."""
        return self._num_cached.get(req_id, 0) * self.block_size

    def cache_blocks(
        self, req_id: str, block_hashes: list[int], token_ids: Sequence[int], num_computed_tokens: int,
        salt: bytes,
    ) -> None:
        """Register each of the request's blocks now full of computed tokens.

        Blocks ``[num_cached, num_computed_tokens // block_size)`` are registered
        with hash ``block_hashes[i]``, parent ``block_hashes[i - 1]`` (None for
        block 0), tokens ``token_ids[i*bs : (i+1)*bs]`` and the request's salt
        identity ``salt``. ``block_hashes`` must
        cover those blocks (extend them first as tokens grow). Calling again with
        the same or fewer tokens does nothing.
        """
        if not self.enable_prefix_caching:
            return
        owned = self._req_blocks[req_id]
        bs = self.block_size
        num_full = num_computed_tokens // bs
        assert num_full <= len(owned), (
            f"{req_id}: {num_computed_tokens} computed tokens but {len(owned)} blocks"
        )
        assert num_full <= len(block_hashes) and num_full * bs <= len(token_ids), (
            f"{req_id}: {num_full} full blocks, {len(block_hashes)} hashes, {len(token_ids)} tokens"
        )
        start = self._num_cached[req_id]
        for i in range(start, num_full):
            parent = block_hashes[i - 1] if i > 0 else None
            self.pool.cache_block(owned[i], block_hashes[i], parent, token_ids[i * bs : (i + 1) * bs], salt,
                                  self.tiers)
        if num_full > start:
            self._num_cached[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, last block first, so that a sequence's tail
        is evicted before its (possibly shared) prefix. Unknown ids are ignored."""
        owned = self._req_blocks.pop(req_id, None)
        self._num_cached.pop(req_id, None)
        self._pending.pop(req_id, None)
        if owned is not None:
            self.pool.free_blocks(reversed(owned))

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block ids in token order (its block table row)."""
        return [b.block_id for b in self._req_blocks[req_id]]

    def take_events(self) -> list[KVEvent]:
        """The prefix-cache events since the last call, oldest first (see BlockPool), the
        lower tiers' included."""
        if self.tiers is not None:
            self.tiers.poll()
        return self.pool.take_events()

    def cached_hashes(self) -> list[int]:
        """Every block hash held in the prefix cache now: the state the events since
        the start (or the last ``AllBlocksCleared``) add up to."""
        return list(self.pool.cached)

    def held_blocks(self) -> dict[int, Tier]:
        """Every block hash this engine holds in any tier, with the fastest tier holding it
        (what the tier events since the start add up to)."""
        held = self.tiers.held() if self.tiers is not None else {}
        held.update(dict.fromkeys(self.pool.cached, Tier.DEVICE))
        return held

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, the lower tiers' too; False (nothing changed) while
        any block is in use."""
        done = self.pool.reset_prefix_cache()
        if done and self.tiers is not None:
            self.tiers.clear()
        return done

    # ---- the lower tiers, around each step (no-ops without them) -------------------------------
    def take_loads(self) -> LayerLoads | None:
        """The lower-tier loads the allocations since the last call queued, issued for the forward
        about to be issued (None: none; kv/tier_streams.py ``LayerLoads``)."""
        return self.tiers.take_loads() if self.tiers is not None else None

    def before_forward(self) -> int:
        """Called as a forward is about to be issued: the newest store batch it must wait for (it
        overwrites a block, or reads a slot, that batch copies), 0 for none."""
        return self.tiers.before_forward() if self.tiers is not None else 0

    def before_write(self) -> None:
        """Called before another thread (a KV receiver) writes blocks just allocated, with no
        forward to follow: their loads done now, and the store batch reading the cached blocks
        they evicted landed."""
        if self.tiers is None:
            return
        loads = self.tiers.take_loads(whole=True)
        if loads is not None:
            loads.wait_all()
        self.tiers.before_write()

    def save_cached(self) -> None:
        """Called after each step's forward is queued: the blocks cached since (completed by it,
        or landed) are copied to host memory behind it."""
        if self.tiers is not None:
            self.tiers.flush()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``seconds``: the recompute rate a lower-tier
        load competes with."""
        if self.tiers is not None:
            self.tiers.policy.observe_prefill(tokens, seconds)

    def observe_batch(self, seconds: float) -> None:
        """A step of the running batch alone (no prompt tokens, no loads) took ``seconds``: the
        load time a step beside it hides (``hidden_load_tokens``)."""
        if self.tiers is not None:
            self.tiers.policy.observe_batch(seconds)

    def hidden_load_tokens(self) -> float:
        """The loads a step of the running batch hides behind its forward, in prompt tokens (inf:
        not measured, or no tiers)."""
        return self.tiers.policy.hidden_load_tokens() if self.tiers is not None else float("inf")

    def observe_load(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A load out of ``tier`` moved ``nbytes`` in ``seconds`` (a simulated node's runner
        reports the time it priced; a real node's tiers time their own moves)."""
        if self.tiers is not None:
            self.tiers.policy.observe_load(tier, nbytes, seconds)

    @property
    def loads_queued(self) -> bool:
        """Whether lower-tier loads wait for the next forward."""
        return self.tiers is not None and self.tiers.loads_queued

    def take_moves(self) -> list[Move]:
        """The moves between the tiers since the last call (a simulated node prices them)."""
        return self.tiers.take_moves() if self.tiers is not None else []

    def tier_stats(self, block_bytes: int) -> list[TierStats]:
        """Each tier of the prefix cache, device first, in blocks of ``block_bytes`` (a device
        block over every rank). The device tier's load rate is the recompute rate (prefill
        tokens/s in bytes of blocks), measured with lower tiers only."""
        tiers = self.tiers
        recompute = tiers.policy.prefill_rate.value * block_bytes / self.block_size if tiers is not None else 0.0
        device = TierStats(tier=Tier.DEVICE, capacity_blocks=self.pool.num_blocks, used_blocks=len(self.pool.cached),
                           block_bytes=block_bytes, load_bytes_per_s=recompute)
        return [device] + (self.tiers.stats() if self.tiers is not None else [])

    def close(self) -> None:
        """Let the disk tier's writer finish its queue (idempotent)."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

"""What a tier store is built over and what it hands out: the words the KV cache manager, the
engine, the simulated runner and the node's metrics share with the lower tiers (tier_store.py).

Owns ``TierSpec`` (the KV cache, the host tier's size and the disk tier below it, resolved from
the engine config), ``LowerHit`` (a prompt block a lookup found below the device), ``Move`` (one
batch of blocks moved between the device and a lower tier, as measured or, on a simulated node,
to be priced) and ``TierObserver`` (what watches the tiers: the node's metrics). Must not: move,
price or look up a block.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from ...common.config import EngineConfig
from ...common.kv_events import Tier
from ...common.outcomes import TierFault
from .disk_tier import DiskLayout, DiskTier
from .disk_trust import disk_key, private_dir

log = logging.getLogger(__name__)


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
    tier: Tier  # where it was found: what loading it is priced at (tier_policy.py ``load_tokens``)


class TierObserver(Protocol):
    """What watches the tiers: the node's metrics (node/metrics.py), handed to the engine at
    construction and on to its tier store. Called on the engine thread."""

    def moved(self, move: Move) -> None: ...

    def looked_up(self, queried_blocks: int, hits: dict[Tier, int]) -> None: ...

    def evicted(self, tier: Tier, blocks: int) -> None: ...

    def fault(self, tier: Tier, fault: TierFault) -> None: ...


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

"""A decode node's worker rank (ranks 1..N-1 of a tensor-parallel decode or colocated
node): it receives its own KV heads of every transferred block, and tells rank 0 what
landed.

Owns ``DecodeRank`` (the role's node/ranks.py ``RankRole``). Must not: reserve or free
blocks, or decide a transfer's outcome (rank 0's ``TransferTable`` does, from every rank's
reports: kvtransfer/rank_report.py)::

    this rank's event loop                                   rank 0
    receiver over its KV shard (/dev/shm per rank on shm)
      started once loaded            -- RankReady(rank, its address) -->  PrefillRequest.kv_addrs
      on_block = RankReporter         -- RankBlocks(landed, failed) ---->  table.on_rank_blocks
      accepts = ClosedTransfers      <-- TransfersClosed(seq, ids) ------  a transfer ended
                                      -- ClosedApplied(rank, seq) ----->  its blocks may be reused

A colocated node's workers receive nothing: they only run the steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ..common.config import NodeConfig
from ..engine.model_runner import KVCacheFactory, ModelRunner
from ..engine.ranks.worker import ControlHandler
from ..kvtransfer import (ClosedTransfers, KVBlockStore, KVLayout, KVReceiver, KVShard, RankReporter, TransfersClosed,
                          allocate_kv_cache, free_shared_kv_cache)
from ..kvtransfer.rank_report import RankMessage, RankReady
from ..node.ranks import RankLink, node_kv_key
from ..node.receive_side import start_receiver
from ..node.shm_segments import segment_name

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # the receiver binds and starts (ucx and nccl set up more than tcp)


class DecodeRank:
    """The decode (or colocated) role on worker rank ``rank`` (built in the worker process)."""

    def __init__(self, config: NodeConfig, rank: int, link: RankLink):
        self.config = config
        self.rank = rank
        self.link = link
        self.receives = config.role == "decode"
        # its own /dev/shm segment (named after this process: a node starting later removes it
        # if this rank dies without doing so)
        self.shm_name = segment_name(os.getpid()) if self.receives and config.kv_spec.shm_cache else None
        self.closed = ClosedTransfers(rank)
        self.receiver: KVReceiver | None = None

    def kv_cache_factory(self) -> KVCacheFactory | None:
        name = self.shm_name
        if name is None:
            return None
        return lambda shape, dtype: allocate_kv_cache(KVLayout.of_cache(shape, dtype), shape[2], name)

    def on_runner_built(self, runner: ModelRunner) -> None:
        if not self.receives:
            self.link.call(self.link.send, RankReady(rank=self.rank))
            return
        kv = runner.kv_caches
        key = node_kv_key(self.config.engine, runner.model_config, kv.dtype, self.config.engine.tensor_parallel_size)
        shard = KVShard(key, self.rank)
        store = KVBlockStore(kv, shard.layout, self.shm_name)
        self.link.run(self._start(store, shard, str(kv.device))).result(timeout=START_TIMEOUT_S)

    async def _start(self, store: KVBlockStore, shard: KVShard, device: str) -> None:
        reporter = RankReporter(self.rank, self.link.send)
        receiver = await start_receiver(self.config, self.config.kv_backend, shard.layout, store, reporter.on_block,
                                        self.closed.accepts, device, shard)
        self.receiver = receiver
        log.info("tensor-parallel rank %d receives its KV heads at %s (%s)", self.rank, receiver.address,
                 shard.describe())
        self.link.send(RankReady(rank=self.rank, kv_addr=receiver.address))

    def controls(self) -> Mapping[str, ControlHandler]:
        return {}

    def on_message(self, msg: RankMessage) -> None:
        if isinstance(msg, TransfersClosed):  # no later frame of them lands here; then say so
            self.link.send(self.closed.apply(msg))

    async def stop(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()

    def release(self) -> None:
        if self.shm_name is not None:
            free_shared_kv_cache(self.shm_name)

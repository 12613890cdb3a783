"""A prefill node's worker rank (ranks 1..N-1 of a tensor-parallel prefill node): it packs
and sends its own KV heads of the blocks rank 0 names, and says when they are sent.

Owns ``PrefillRank`` (the role's node/ranks.py ``RankRole``) and the sender options every
prefill rank uses. Must not: schedule, decide what to send (rank 0's ``KVExport`` says,
in step order; kvtransfer/tp_plan.py says which heads go to which decode rank) or answer
the decode node (rank 0 does, once every rank reported)::

    main thread (between two steps)             this rank's event loop
    controls["kv_export"](KVExport)
      pack_sends(its store, its shard, ...)  -> ShardSender.send_packed(decode addrs, ...)
      (fresh buffers: the blocks may be          -> RankSent(rank, transfer, blocks, bytes, error)
       written again by the next step)              to rank 0
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from ..common.config import Fault, NodeConfig
from ..engine.model_runner import KVCacheFactory, ModelRunner
from ..engine.ranks.worker import ControlHandler
from ..kvtransfer import (KVBlockStore, KVShard, PackedSend, SenderOptions, ShardSender, TransferError, make_sender,
                          pack_sends, sender_options)
from ..kvtransfer.rank_report import KVExport, RankMessage, RankReady, RankSent, decode_export
from ..node.ranks import RankLink, node_kv_key

log = logging.getLogger(__name__)


def rank_sender_options(config: NodeConfig) -> SenderOptions:
    """Every prefill rank's sender options. A send gets one lease, as the decode node's
    transfer does: past it the decode node has given up (and prefilled itself), so a
    partitioned peer cannot hold this request's blocks and its /prefill handler for the
    sender's default minute."""
    return sender_options(corrupt_every=1 if config.fault == Fault.CORRUPT_BLOCK else 0,
                          cluster_token=config.cluster_token, timeout_s=config.transfer_lease_s)


class PrefillRank:
    """The prefill role on worker rank ``rank`` (built in the worker process)."""

    def __init__(self, config: NodeConfig, rank: int, link: RankLink):
        self.config = config
        self.rank = rank
        self.link = link
        self.store: KVBlockStore | None = None  # over this rank's KV cache, once loaded
        self.shard: KVShard | None = None
        self.device = "cpu"
        self._sender: ShardSender | None = None  # made on the loop at the first send
        self._sends: set[asyncio.Task[None]] = set()  # in flight (held: tasks are weak refs)

    def kv_cache_factory(self) -> KVCacheFactory | None:
        return None

    def on_runner_built(self, runner: ModelRunner) -> None:
        kv = runner.kv_caches
        key = node_kv_key(self.config.engine, runner.model_config, kv.dtype, self.config.engine.tensor_parallel_size)
        self.shard = KVShard(key, self.rank)
        self.store = KVBlockStore(kv, self.shard.layout)
        self.device = str(kv.device)
        self.link.call(self.link.send, RankReady(rank=self.rank))

    def controls(self) -> Mapping[str, ControlHandler]:
        return {"kv_export": self._export}

    def _export(self, payload: bytes) -> None:
        """Rank 0's KVExport, between the step that completed its blocks and the next one."""
        job = decode_export(payload)
        assert self.store is not None and self.shard is not None, "a KVExport before the rank was ready"
        try:
            packed = pack_sends(self.store, self.shard, len(job.addrs), job.src_ids)
        except ValueError as e:  # rank 0 checked the plan: a broken invariant, reported, not fatal here
            self.link.call(self._report, job, 0, str(e))
            return
        self.link.call(self._start_send, job, packed)

    def _start_send(self, job: KVExport, packed: list[PackedSend]) -> None:
        task = self.link.loop.create_task(self._send(job, packed))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _shard_sender(self) -> ShardSender:
        if self._sender is None:
            assert self.store is not None and self.shard is not None
            sender = make_sender(self.config.kv_backend, self.shard.layout, rank_sender_options(self.config),
                                 device=self.device, shard=self.shard)
            self._sender = ShardSender(sender, self.store, self.shard)
        return self._sender

    async def _send(self, job: KVExport, packed: list[PackedSend]) -> None:
        error, nbytes = None, 0
        try:
            nbytes = await self._shard_sender().send_packed(job.addrs, job.transfer_id, packed, job.dest_ids)
        except TransferError as e:
            error = str(e)
        except Exception as e:  # reported: rank 0 fails the request, the decode node falls back
            log.exception("tensor-parallel rank %d: sending transfer %s failed", self.rank, job.transfer_id)
            error = f"{type(e).__name__}: {e}"
        self._report(job, nbytes, error)

    def _report(self, job: KVExport, nbytes: int, error: str | None) -> None:
        self.link.send(RankSent(rank=self.rank, request_id=job.request_id, transfer_id=job.transfer_id,
                                blocks=len(job.src_ids), nbytes=nbytes, error=error))

    def on_message(self, msg: RankMessage) -> None:
        pass  # rank 0 tells a prefill worker everything through the step channel

    async def stop(self) -> None:
        for task in list(self._sends):
            task.cancel()
        if self._sender is not None:
            await self._sender.sender.close()

    def release(self) -> None:
        pass  # a prefill rank's KV cache is a plain tensor

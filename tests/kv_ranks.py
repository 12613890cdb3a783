"""A factory for KV transfer tests between tensor-parallel nodes, in one process: the ranks
of a prefill node (one store, sender and ``ShardSender`` each, over their shards of one
random TP=1 cache) and of a decode node (one store and started receiver each; rank 0
owns the ``TransferTable``, worker ranks report through ``RankReporter`` and a msgpack
round trip of ``RankBlocks``, and refuse closed transfers through ``ClosedTransfers``),
wired as the node engineer is to wire them, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import uuid

import torch

from splitserve.common.kv_compat import KVCompat
from splitserve.common.protocol import PrefillResult
from splitserve.kvtransfer import (ClosedTransfers, KVBlockStore, KVShard, RankReporter, SenderOptions,
                                   ShardSender, TransferTable, TransfersClosed, allocate_kv_cache,
                                   free_shared_kv_cache, make_receiver, make_sender)
from splitserve.kvtransfer import rank_report


def compat(heads: int, tp: int, dtype: str = "float32", **changes) -> KVCompat:
    base = dict(model="tiny", dtype=dtype, block_size=4, num_layers=2, num_kv_heads=heads, head_dim=8, tp=tp)
    return KVCompat(**{**base, **changes})


def full_cache(key: KVCompat, num_blocks: int, seed: int) -> torch.Tensor:
    """The TP=1 cache every rank's shard is cut from: [layers, 2, blocks, bs, heads, hd]."""
    shape = (key.num_layers, 2, num_blocks, key.block_size, key.num_kv_heads, key.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, key.dtype))


def shard_of(full: torch.Tensor, shard: KVShard) -> torch.Tensor:
    h = shard.heads
    return full[:, :, :, :, h.start:h.stop].contiguous()


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class PrefillRanks:
    """The ranks of a prefill node holding shards of ``full``."""

    def __init__(self, backend: str, key: KVCompat, full: torch.Tensor,
                 options: dict[int, SenderOptions] | None = None):
        self.key = key
        self.ranks: list[ShardSender] = []
        for r in range(key.tp):
            shard = KVShard(key, r)
            store = KVBlockStore(shard_of(full, shard), shard.layout)
            opts = (options or {}).get(r) or SenderOptions(connect_timeout_s=10, timeout_s=20)
            sender = make_sender(backend, shard.layout, opts, shard=shard)
            self.ranks.append(ShardSender(sender, store, shard))

    async def send(self, addrs, transfer_id, src_ids, dest_ids) -> list:
        """Every rank's share, concurrently: its bytes sent, or its exception."""
        return await asyncio.gather(*(r.send(addrs, transfer_id, src_ids, dest_ids) for r in self.ranks),
                                    return_exceptions=True)

    async def close(self):
        for r in self.ranks:
            await r.sender.close()


class DecodeRanks:
    """The ranks of a decode node: random caches (another seed), a receiver each, rank 0's table.
    ``hold``: worker ranks' reports are kept in ``held`` until ``release()``."""

    def __init__(self, backend: str, key: KVCompat, num_blocks: int, seed: int = 99, hold: bool = False):
        self.key, self.backend = key, backend
        self.table = TransferTable(ranks=key.tp, on_closed=self._closed)
        self.held: list[bytes] = []
        self.hold = hold
        self.shm_names: list[str] = []
        self.stores: list[KVBlockStore] = []
        self.receivers = []
        self.gates: list[ClosedTransfers] = []
        self.reporters: list[RankReporter] = []
        self.closed_seq = 0
        self.applied: list[int] = []  # acknowledged TransfersClosed seqs, from every worker
        full = full_cache(key, num_blocks, seed)
        for s in range(key.tp):
            shard = KVShard(key, s)
            name = f"splitserve-test-{uuid.uuid4().hex[:12]}" if backend == "shm" else None
            if name:
                self.shm_names.append(name)
            cache = allocate_kv_cache(shard.layout, num_blocks, name)
            cache.copy_(shard_of(full, shard))
            store = KVBlockStore(cache, shard.layout, shm_name=name)
            if s == 0:
                on_block = lambda tid, dest, ok, reason: self.table.on_block(tid, dest, ok, reason)  # noqa: E731
            else:
                reporter = RankReporter(s, self._deliver)
                self.reporters.append(reporter)
                on_block = reporter.on_block
            receiver = make_receiver(backend, shard.layout, store, "127.0.0.1", on_block, shard=shard)
            if s == 0:
                receiver.accepts = self.table.is_live
            else:
                gate = ClosedTransfers(s)
                self.gates.append(gate)
                receiver.accepts = gate.accepts
            self.stores.append(store)
            self.receivers.append(receiver)
        self.before = [s.kv_caches.clone() for s in self.stores]

    def _deliver(self, msg):
        data = rank_report.encode(msg)  # what crosses the node's rank pipe
        if self.hold:
            self.held.append(data)
        else:
            self.table.on_rank_blocks(rank_report.decode(data))

    def release(self):
        held, self.held, self.hold = self.held, [], False
        for data in held:
            self.table.on_rank_blocks(rank_report.decode(data))

    def _closed(self, transfer_id: str):
        self.closed_seq += 1
        msg = rank_report.decode(rank_report.encode(TransfersClosed(seq=self.closed_seq,
                                                                    transfer_ids=[transfer_id])))
        self.applied += [gate.apply(msg).seq for gate in self.gates]

    @property
    def addrs(self) -> list[str]:
        return [r.address for r in self.receivers]

    async def start(self):
        for r in self.receivers:
            await r.start()

    async def close(self):
        for r in self.receivers:
            await r.stop()
        for name in self.shm_names:
            free_shared_kv_cache(name)

    def landed_exactly(self, full: torch.Tensor, src_ids, dest_ids) -> bool:
        """Every decode rank holds, in each destination block, exactly its heads of the source
        block of the TP=1 cache; and every other block is as before."""
        for s, store in enumerate(self.stores):
            shard = KVShard(self.key, s)
            want = shard_of(full, shard)
            for src, dest in zip(src_ids, dest_ids):
                if raw(store.kv_caches[:, :, dest]) != raw(want[:, :, src]):
                    return False
            others = sorted(set(range(store.num_blocks)) - set(dest_ids))
            if raw(store.kv_caches[:, :, others]) != raw(self.before[s][:, :, others]):
                return False
        return True


async def transfer(prefill: PrefillRanks, decode: DecodeRanks, transfer_id: str, src_ids, dest_ids,
                   lease_s: float = 30):
    """One transfer as the nodes run it: reserve, every prefill rank sends, the prefill answer
    comes; (the transfer's outcome, what each prefill rank's send returned)."""
    t = decode.table.reserve(transfer_id, "req-" + transfer_id, dest_ids, lease_s)
    sent = await prefill.send(decode.addrs, transfer_id, src_ids, dest_ids)
    await asyncio.sleep(0)  # the worker reporters flush on the next loop turn
    errors = [s for s in sent if isinstance(s, BaseException)]
    if errors:  # the prefill node's answer is an error: the decode node fails the transfer
        decode.table.fail(transfer_id, f"prefill failed: {errors[0]}")
    else:
        decode.table.prefilled(transfer_id, PrefillResult(transfer_id=transfer_id, first_token=1))
    if decode.hold:
        return t, sent
    return await asyncio.wait_for(asyncio.shield(t.done), 10), sent

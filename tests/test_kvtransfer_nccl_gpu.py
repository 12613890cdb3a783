"""The nccl backend on CUDA: NCCL groups between two GPUs of this machine (NCCL cannot
pair two ranks on one GPU), and the refusal of a sender whose device kind differs from
the receiver's. The CPU path (gloo) runs in tests/test_kvtransfer_conformance.py."""

import asyncio

import pytest
import torch

from splitserve.kvtransfer import (KVBlockStore, KVLayout, SenderOptions, TransferError,
                                   allocate_kv_cache, make_receiver, make_sender)

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(dtype="float16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)  # 32 KiB
NUM_BLOCKS = 300


def cuda_devices() -> int:
    import torch.distributed as dist
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


needs_one_gpu = pytest.mark.skipif(cuda_devices() < 1, reason="needs a CUDA device and NCCL")
needs_two_gpus = pytest.mark.skipif(cuda_devices() < 2, reason="needs two CUDA devices and NCCL")


def random_store(seed: int) -> KVBlockStore:
    cache = allocate_kv_cache(LAYOUT, NUM_BLOCKS)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)).to(cache.dtype))
    return KVBlockStore(cache, LAYOUT)


def run(coro, timeout: float = 60):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


@needs_two_gpus
@pytest.mark.parametrize("n", [1, 16, 256])
def test_blocks_cross_two_gpus_over_nccl(n):
    async def body():
        src, dst = random_store(1), random_store(2)
        reports = []
        receiver = make_receiver("nccl", LAYOUT, dst, "127.0.0.1", lambda *r: reports.append(r),
                                 device="cuda:0")
        sender = make_sender("nccl", LAYOUT, SenderOptions(connect_timeout_s=30), device="cuda:1")
        await receiver.start()
        try:
            src_ids, dest_ids = list(range(n)), list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - n, -1))
            for tid in ("first", "reused"):  # the second transfer reuses the connection and its group
                reports.clear()
                await sender.send_blocks(receiver.address, tid, list(zip(dest_ids, src.split(src.pack(src_ids)))))
                assert sorted(reports) == sorted((tid, d, True, None) for d in dest_ids)
                assert all(src.read(s) == dst.read(d) for s, d in zip(src_ids, dest_ids))
            assert receiver.stats.connections == 1
        finally:
            await sender.close()
            await receiver.stop()
    run(body())


@needs_two_gpus
def test_receiver_stopped_midway_over_nccl():
    async def body():
        src, dst = random_store(1), random_store(2)
        reports = []

        def on_block(*report):
            reports.append(report)
            if len(reports) == 1:
                asyncio.ensure_future(receiver.stop())
        receiver = make_receiver("nccl", LAYOUT, dst, "127.0.0.1", on_block, device="cuda:0")
        options = SenderOptions(max_frame_bytes=LAYOUT.block_nbytes, connect_timeout_s=30, timeout_s=20)
        sender = make_sender("nccl", LAYOUT, options, device="cuda:1")
        await receiver.start()
        try:
            with pytest.raises(TransferError):
                await sender.send_blocks(receiver.address, "cut",
                                         list(zip(range(256), src.split(src.pack(range(256))))))
            assert 1 <= len(reports) < 256
        finally:
            await sender.close()
            await receiver.stop()
    run(body())


@needs_one_gpu
def test_cpu_sender_refused_by_cuda_receiver():
    async def body():
        receiver = make_receiver("nccl", LAYOUT, random_store(2), "127.0.0.1", lambda *r: None,
                                 device="cuda:0")
        sender = make_sender("nccl", LAYOUT, SenderOptions(connect_timeout_s=10), device="cpu")
        await receiver.start()
        try:
            with pytest.raises(TransferError, match="gloo.*nccl"):
                await sender.send_blocks(receiver.address, "t", [(0, bytes(LAYOUT.block_nbytes))])
            assert receiver.stats.refused == 1 and "gloo" in receiver.last_refusal
        finally:
            await sender.close()
            await receiver.stop()
    run(body())

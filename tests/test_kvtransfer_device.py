"""KV transfer from a device pool: the wsum32_v1 checksum (torch ops, any device), the
device-generic store path (gather, PackedBlocks, verified landing), tcp transfers that
hash on the device, and the CUDA IPC backend (its refusals on CPU; transfers on a GPU).

The device-generic path runs on the CPU here by giving the stores ``checksum_algo=wsum32_v1``
(what a GPU store uses by default); the tests marked ``gpu`` rerun it on CUDA."""

import asyncio
import json
import os
import select
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.kvtransfer import (KVBlockStore, KVLayout, SenderOptions, TransferError, make_receiver,
                                   make_sender)
from splitserve.kvtransfer.checksum import WEIGHT_PERIOD, bytes_sum, checksum, word_dtype, wsum
from splitserve.kvtransfer.packed import PackedBlock, PackedBlocks, flip_rows, frame_tensor
from splitserve.kvtransfer.wire import CHECKSUM_WSUM, CHECKSUM_XXH3, IpcInfo, Welcome, decode, encode

torch.set_num_threads(1)

SMALL = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
HALF = KVLayout(dtype="bfloat16", block_size=3, num_layers=2, num_kv_heads=1, head_dim=2)  # 12-byte runs
ODD = KVLayout(dtype="float8_e4m3fn", block_size=1, num_layers=1, num_kv_heads=1, head_dim=3)  # 3-byte runs
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(coro, timeout: float = 30):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def random_cache(layout: KVLayout, num_blocks: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * layout.block_nbytes,), dtype=torch.uint8, generator=g)
    if layout.dtype != "float8_e4m3fn":  # keep floats finite (any bits would do for the checksum)
        raw = torch.randn(layout.cache_shape(num_blocks), generator=g).to(getattr(torch, layout.dtype))
        return raw.to(device)
    return raw.view(getattr(torch, layout.dtype)).view(layout.cache_shape(num_blocks)).to(device)


def reference_wsum(block: bytes, layout: KVLayout) -> int:
    """wsum32_v1 in plain Python integers (no overflow possible): the definition in checksum.py."""
    width = {torch.int32: 4, torch.int16: 2, torch.uint8: 1}[word_dtype(layout)]
    fmt = {4: "<i", 2: "<h", 1: "<B"}[width]
    sums = []
    for r in range(2 * layout.num_layers):
        run_bytes = block[r * layout.run_nbytes:(r + 1) * layout.run_nbytes]
        words = [struct.unpack_from(fmt, run_bytes, i)[0] for i in range(0, len(run_bytes), width)]
        sums.append(sum(w * (1 + i % WEIGHT_PERIOD) for i, w in enumerate(words)))
    return checksum(struct.pack(f"<{len(sums)}q", *sums))


@pytest.mark.parametrize("layout", [SMALL, HALF, ODD], ids=["int32-words", "int16-words", "byte-words"])
def test_wsum_matches_its_definition_and_every_way_of_computing_it(layout):
    store = KVBlockStore(random_cache(layout, 6, seed=1), layout, checksum_algo=CHECKSUM_WSUM)
    packed = store.pack([4, 1, 4])
    assert isinstance(packed, PackedBlocks)
    for item, b in zip(store.split(packed), [4, 1, 4]):
        data = bytes(item.view())
        assert data == bytes(store.kv_caches[:, :, b].contiguous().view(-1).view(torch.uint8).numpy())
        expected = reference_wsum(data, layout)
        assert packed.sums(CHECKSUM_WSUM)[item.row] == expected
        assert bytes_sum(data, layout, CHECKSUM_WSUM) == expected == store.checksums([b])[0]
        assert packed.sums(CHECKSUM_XXH3)[item.row] == checksum(data)


def test_wsum_is_exact_at_extreme_words_and_detects_every_single_byte_flip():
    layout = KVLayout(dtype="float32", block_size=64, num_layers=1, num_kv_heads=2, head_dim=64)  # 8k words/run
    extreme = torch.full((1, *layout.block_shape), -1, dtype=torch.int32)
    extreme.view(-1)[::2] = 2**31 - 1  # alternating int32 max and -1: large sums, no overflow
    blocks = extreme.view(torch.float32)
    assert wsum(blocks, layout) == [reference_wsum(bytes(extreme.numpy()), layout)]
    base = random_cache(layout, 1, seed=3).permute(2, 0, 1, 3, 4, 5).contiguous()  # [1, *block_shape]
    good = wsum(base, layout)[0]
    flat = base.view(-1).view(torch.uint8)
    for pos in range(0, flat.numel(), 997):  # a spread of byte positions, every run
        flat[pos] ^= 0x01
        assert wsum(base, layout)[0] != good, f"flip at byte {pos} went unnoticed"
        flat[pos] ^= 0x01
    assert wsum(base, layout)[0] == good
    swapped = base.clone().view(-1, 64)  # two words exchanged within a run
    swapped[[0, 1]] = swapped[[1, 0]]
    assert wsum(swapped.view(base.shape), layout)[0] != good


def test_device_generic_store_packs_lands_and_verifies():
    src = KVBlockStore(random_cache(SMALL, 8, seed=1), SMALL, checksum_algo=CHECKSUM_WSUM)
    dst = KVBlockStore(random_cache(SMALL, 8, seed=2), SMALL, checksum_algo=CHECKSUM_WSUM)
    before = dst.kv_caches.clone()
    packed = src.pack([3, 5, 6])
    rows = src.split(packed)
    assert all(isinstance(r, PackedBlock) for r in rows)
    # on the CPU the host bytes are the gather buffer itself: no extra copy
    assert packed.host().obj is not None and packed.host().nbytes == 3 * SMALL.block_nbytes
    assert torch.frombuffer(packed.host(), dtype=torch.uint8).data_ptr() == packed.blocks.data_ptr()
    sums = packed.sums(CHECKSUM_WSUM)
    bad = list(sums)
    bad[1] ^= 1  # the second block's checksum no longer matches
    ok = dst.land([0, 1, None], packed.host(), bad, CHECKSUM_WSUM)
    assert ok == [True, False, False]
    assert dst.read(0) == src.read(3)
    assert torch.equal(dst.kv_caches[:, :, 1:], before[:, :, 1:])  # the rejected and skipped rows: untouched
    assert dst.land([7], rows[2].view(), [checksum(rows[2].view())], CHECKSUM_XXH3) == [True]
    assert dst.read(7) == src.read(6)
    dst.scatter([2, 3], packed.blocks[:2])
    assert dst.read(2) == src.read(3) and dst.read(3) == src.read(5)


def test_frame_tensor_and_device_fault_injection():
    store = KVBlockStore(random_cache(SMALL, 8, seed=1), SMALL, checksum_algo=CHECKSUM_WSUM)
    packed = store.pack([1, 2, 3, 4])
    rows = store.split(packed)
    frame = frame_tensor(rows[1:3])
    assert frame.data_ptr() == packed.blocks[1].data_ptr() and frame.shape[0] == 2  # a slice: no copy
    other = store.split(store.pack([7]))
    mixed = frame_tensor([rows[0], other[0]])  # rows of two packs: one gather
    assert torch.equal(mixed[1], other[0].tensor()) and torch.equal(mixed[0], rows[0].tensor())
    damaged = flip_rows(packed.blocks, [2])
    assert torch.equal(packed.blocks, store.pack([1, 2, 3, 4]).blocks)  # the original is untouched
    assert wsum(damaged, SMALL)[:2] == packed.sums(CHECKSUM_WSUM)[:2]
    assert wsum(damaged, SMALL)[2] != packed.sums(CHECKSUM_WSUM)[2]


def test_shm_in_place_verification_with_device_checksums():
    """Landing in place (shm here, ipc on a GPU) verifies with the connection's algorithm."""
    import uuid

    from splitserve.kvtransfer import allocate_kv_cache, free_shared_kv_cache
    name = f"splitserve-test-{uuid.uuid4().hex[:12]}"
    try:
        dst = KVBlockStore(allocate_kv_cache(SMALL, 16, name), SMALL, shm_name=name, checksum_algo=CHECKSUM_WSUM)
        src = KVBlockStore(random_cache(SMALL, 16, 1), SMALL, checksum_algo=CHECKSUM_WSUM)
        reports = []
        receiver = make_receiver("shm", SMALL, dst, "127.0.0.1", lambda *r: reports.append(r))

        async def body():
            await receiver.start()
            good = make_sender("shm", SMALL, SenderOptions(checksum=CHECKSUM_WSUM))
            bad = make_sender("shm", SMALL, SenderOptions(checksum=CHECKSUM_WSUM, corrupt_every=1))
            try:
                await good.send_blocks(receiver.address, "t", list(zip([3, 4], src.split(src.pack([0, 1])))))
                with pytest.raises(TransferError, match="shared-memory block differs"):
                    await bad.send_blocks(receiver.address, "u", list(zip([5], src.split(src.pack([2])))))
            finally:
                await good.close()
                await bad.close()
                await receiver.stop()
        run(body())
        assert [(t, d, ok) for t, d, ok, _ in reports] == [("t", 3, True), ("t", 4, True), ("u", 5, False)]
        assert dst.read(3) == src.read(0) and dst.read(4) == src.read(1)
    finally:
        free_shared_kv_cache(name)


class Pair:
    def __init__(self, send_algo: str, recv_algo: str, device="cpu", options=None):
        self.src = KVBlockStore(random_cache(SMALL, 64, 1, device), SMALL, checksum_algo=send_algo)
        self.dst = KVBlockStore(random_cache(SMALL, 64, 2, device), SMALL, checksum_algo=recv_algo)
        self.reports = []
        self.receiver = make_receiver("tcp", SMALL, self.dst, "127.0.0.1", lambda *r: self.reports.append(r))
        self.sender = make_sender("tcp", SMALL, options or SenderOptions(checksum=send_algo, connect_timeout_s=3))

    async def __aenter__(self):
        await self.receiver.start()
        return self

    async def __aexit__(self, *exc):
        await self.sender.close()
        await self.receiver.stop()

    async def send(self, tid, src_ids, dest_ids):
        blocks = self.src.split(self.src.pack(src_ids))
        await self.sender.send_blocks(self.receiver.address, tid, list(zip(dest_ids, blocks)))


@pytest.mark.parametrize("send_algo,recv_algo", [(CHECKSUM_WSUM, CHECKSUM_WSUM), (CHECKSUM_XXH3, CHECKSUM_WSUM),
                                                 (CHECKSUM_WSUM, CHECKSUM_XXH3)])
def test_tcp_transfer_hashing_on_the_device_path(send_algo, recv_algo):
    async def body():
        async with Pair(send_algo, recv_algo, options=SenderOptions(
                checksum=send_algo, max_frame_bytes=3 * SMALL.block_nbytes)) as p:
            await p.send("t", list(range(10)), list(range(20, 30)))
            assert all(p.src.read(s) == p.dst.read(d) for s, d in zip(range(10), range(20, 30)))
            assert [ok for *_, ok, _ in p.reports] == [True] * 10
    run(body())


def test_corrupted_block_fails_the_transfer_with_device_checksums():
    async def body():
        options = SenderOptions(checksum=CHECKSUM_WSUM, corrupt_every=2, connect_timeout_s=3)
        async with Pair(CHECKSUM_WSUM, CHECKSUM_WSUM, options=options) as p:
            before = p.dst.kv_caches.clone()
            with pytest.raises(TransferError, match="checksum mismatch"):
                await p.send("t", [0, 1, 2, 3], [4, 5, 6, 7])
            assert [ok for *_, ok, _ in p.reports] == [True, False, True, False]
            assert torch.equal(p.dst.kv_caches[:, :, [5, 7]], before[:, :, [5, 7]])  # never written
    run(body())


def test_unknown_checksum_algorithm_is_refused():
    async def body():
        async with Pair(CHECKSUM_WSUM, CHECKSUM_WSUM, options=SenderOptions(checksum="crc7")) as p:
            with pytest.raises(TransferError, match="checksum algorithm 'crc7'"):
                await p.send("t", [0], [1])
    run(body())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals without CUDA")
def test_ipc_without_cuda_is_a_clear_error():
    with pytest.raises(TransferError, match="ipc backend .*needs CUDA"):
        make_sender("ipc", SMALL)
    store = KVBlockStore(random_cache(SMALL, 4, 1), SMALL)
    with pytest.raises(TransferError, match="needs CUDA"):
        make_receiver("ipc", SMALL, store, "127.0.0.1", lambda *r: None)
    with pytest.raises(ValueError, match="kv_backend: ipc .*--device cuda"):
        NodeConfig(role="decode", engine=EngineConfig(), kv_backend="ipc")
    with pytest.raises(ValueError, match="kv_backend: shm"):
        NodeConfig(role="decode", engine=EngineConfig(device="cuda"), kv_backend="shm")


def test_ipc_info_roundtrips_on_the_wire():
    info = IpcInfo(host_id="b", device_uuid="GPU-1", shape=[2, 2, 8, 4, 2, 8], stride=[1] * 6, offset=0,
                   dtype="bfloat16", handle=b"\x00\x01" * 32, storage_size_bytes=1 << 20,
                   storage_offset_bytes=512, ref_counter_handle=b"/torch_1", ref_counter_offset=3)
    msg = Welcome(layout=SMALL, num_blocks=8, ipc=info)
    assert decode(encode(msg)) == msg


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_cuda_store_matches_the_cpu_one():
    cpu = KVBlockStore(random_cache(SMALL, 8, seed=1), SMALL, checksum_algo=CHECKSUM_WSUM)
    gpu = KVBlockStore(cpu.kv_caches.to("cuda"), SMALL)
    assert gpu.checksum_algo == CHECKSUM_WSUM
    packed = gpu.pack([5, 0, 2])
    assert packed.blocks.is_cuda and packed.host().nbytes == 3 * SMALL.block_nbytes
    assert packed.sums(CHECKSUM_WSUM) == cpu.checksums([5, 0, 2]) == gpu.checksums([5, 0, 2])
    assert bytes(packed.host()) == b"".join(cpu.read(b) for b in (5, 0, 2))
    dst = KVBlockStore(torch.zeros_like(gpu.kv_caches), SMALL)
    assert dst.land([1, 2, 3], packed.host(), packed.sums(CHECKSUM_WSUM), CHECKSUM_WSUM) == [True] * 3
    assert dst.read(1) == cpu.read(5) and dst.read(3) == cpu.read(2)


def pinned(view: memoryview) -> bool:
    """Whether a host buffer is page-locked (CUDA-registered) memory."""
    return torch.frombuffer(view, dtype=torch.uint8).is_pinned()


@pytest.mark.gpu
@needs_cuda
def test_tcp_between_cuda_pools_stages_through_pinned_memory(monkeypatch):
    staged = []  # (side, pinned) of every host buffer the blocks went through
    real_host, real_buffer = PackedBlocks.host, KVBlockStore.host_buffer

    def host(self):  # the sender's one copy of a device pack to the host
        view = real_host(self)
        staged.append(("send", pinned(view)))
        return view

    def host_buffer(self, nbytes):  # where the receiver reads a frame before uploading it
        view = real_buffer(self, nbytes)
        staged.append(("receive", pinned(view)))
        return view

    monkeypatch.setattr(PackedBlocks, "host", host)
    monkeypatch.setattr(KVBlockStore, "host_buffer", host_buffer)

    async def body():
        async with Pair(CHECKSUM_WSUM, CHECKSUM_WSUM, device="cuda") as p:
            await p.send("t", list(range(12)), list(range(30, 42)))
            assert all(p.src.read(s) == p.dst.read(d) for s, d in zip(range(12), range(30, 42)))
            assert [ok for *_, ok, _ in p.reports] == [True] * 12
    run(body())
    assert {side for side, _ in staged} == {"send", "receive"} and all(ok for _, ok in staged), staged


IPC_CHILD = textwrap.dedent("""
    import asyncio, json, sys
    import torch
    from splitserve.kvtransfer import KVBlockStore, KVLayout, make_receiver
    layout = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    store = KVBlockStore(torch.zeros(layout.cache_shape(64), device="cuda"), layout)
    reports = []
    async def main():
        receiver = make_receiver("ipc", layout, store, "127.0.0.1", lambda *r: reports.append(r))
        await receiver.start()
        print(receiver.address, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        print(json.dumps({"reports": reports, "blocks": {d: store.read(d).hex() for d in range(64)}}), flush=True)
        await receiver.stop()
    asyncio.run(main())
""")


@pytest.mark.gpu
@needs_cuda
def test_ipc_transfer_lands_device_to_device_and_catches_corruption():
    child = subprocess.Popen([sys.executable, "-c", IPC_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)

    def child_line(timeout_s=30.0) -> str:  # a child that hangs (CUDA IPC, start-up) fails the test
        ready, _, _ = select.select([child.stdout], [], [], timeout_s)
        assert ready, f"the receiver process said nothing for {timeout_s} s"
        return child.stdout.readline()

    try:
        address = child_line().strip()
        assert address.startswith("ipc://"), address
        src = KVBlockStore(random_cache(SMALL, 64, 1, "cuda"), SMALL)

        async def body():
            sender = make_sender("ipc", SMALL, device="cuda")
            bad = make_sender("ipc", SMALL, SenderOptions(corrupt_every=1, checksum=CHECKSUM_WSUM), device="cuda")
            try:
                await sender.send_blocks(address, "t", list(zip(range(10, 20), src.split(src.pack(range(10))))))
                with pytest.raises(TransferError, match="checksum mismatch"):
                    await bad.send_blocks(address, "u", list(zip([40], src.split(src.pack([0])))))
            finally:
                await sender.close()
                await bad.close()
        run(body())
        child.stdin.write("done\n")
        child.stdin.flush()
        result = json.loads(child_line())
        assert [(t, d, ok) for t, d, ok, _ in result["reports"]] == \
            [("t", d, True) for d in range(10, 20)] + [("u", 40, False)]
        assert all(result["blocks"][str(10 + i)] == src.read(i).hex() for i in range(10))
    finally:
        child.kill()
        child.wait()

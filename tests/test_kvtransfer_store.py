"""KVLayout, KVBlockStore and shared-memory caches, plus the shm backend's own refusals
(another host's or container's file, a store not in /dev/shm, a tcp receiver)."""

import asyncio
import os
import subprocess
import sys
import uuid

import msgspec
import pytest
import torch

from splitserve.kvtransfer import (KVBlockStore, KVLayout, LayoutMismatch, SenderOptions,
                                   TransferError, allocate_kv_cache, checksum, free_shared_kv_cache,
                                   make_receiver, make_sender, map_shared_kv_cache,
                                   shared_kv_cache)
from splitserve.kvtransfer.connection import coalesce

torch.set_num_threads(1)

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def shm_name() -> str:
    return f"splitserve-test-{uuid.uuid4().hex[:12]}"


def random_cache(layout=LAYOUT, num_blocks=10, seed=0):
    return torch.randn(layout.cache_shape(num_blocks), generator=torch.Generator().manual_seed(seed))


def test_layout_sizes_and_wire_roundtrip():
    assert LAYOUT.block_nbytes == 3 * 2 * 4 * 2 * 8 * 4 and LAYOUT.run_nbytes == 4 * 2 * 8 * 4
    bf16 = KVLayout(dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    assert bf16.block_nbytes == 30 * 2 * 16 * 3 * 64 * 2
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(LAYOUT), type=KVLayout) == LAYOUT
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(dtype="int8", block_size=4, num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout(dtype="float32", block_size=4, num_layers=1, num_kv_heads=1, head_dim=0)


def test_check_compatible_names_each_field():
    LAYOUT.check_compatible(KVLayout(**msgspec.structs.asdict(LAYOUT)))
    other = KVLayout(dtype="float16", block_size=8, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(LayoutMismatch) as err:
        LAYOUT.check_compatible(other)
    msg = str(err.value)
    assert "dtype: 'float32' != 'float16'" in msg and "block_size: 4 != 8" in msg
    assert "num_layers" not in msg and "head_dim" not in msg
    assert isinstance(err.value, TransferError)


def test_pack_matches_the_documented_wire_layout():
    cache = random_cache()
    store = KVBlockStore(cache, LAYOUT)
    assert KVLayout.of_cache(cache.shape, cache.dtype) == LAYOUT
    packed = store.pack([7, 2, 7])
    assert len(packed) == 3 * LAYOUT.block_nbytes and not packed.readonly
    for view, b in zip(store.split(packed), [7, 2, 7]):
        # [layers, 2, block_size, heads, head_dim], C order: the diagram in layout.py
        expected = cache[:, :, b].contiguous().numpy().tobytes()
        assert bytes(view) == expected == store.read(b)
        assert checksum(view) == store.checksums([b])[0]
    assert store.checksums([7, 2]) != store.checksums([2, 7])


def test_write_and_write_many_touch_only_their_blocks():
    src, dst = KVBlockStore(random_cache(seed=1), LAYOUT), KVBlockStore(random_cache(seed=2), LAYOUT)
    before = dst.kv_caches.clone()
    dst.write(5, src.read(0))  # read-only bytes are fine
    dst.write_many([1, 8], src.pack([3, 4]))
    assert dst.read(5) == src.read(0) and dst.read(1) == src.read(3) and dst.read(8) == src.read(4)
    rest = [0, 2, 3, 4, 6, 7, 9]
    assert torch.equal(dst.kv_caches[:, :, rest], before[:, :, rest])
    with pytest.raises(AssertionError, match="out of range"):
        dst.write(10, src.read(0))
    with pytest.raises(AssertionError, match="bytes"):
        dst.write(0, b"short")


def test_pack_reuses_an_out_buffer():
    store = KVBlockStore(random_cache(), LAYOUT)
    out = torch.empty(2, *LAYOUT.block_shape)
    view = store.pack([1, 3], out=out)
    assert torch.equal(out[1], store.kv_caches[:, :, 3]) and bytes(view) == store.read(1) + store.read(3)


def test_coalesce_joins_adjacent_slices_only():
    store = KVBlockStore(random_cache(), LAYOUT)
    views = store.split(store.pack([0, 1, 2]))
    whole = coalesce(views)
    assert whole is not None and bytes(whole) == b"".join(bytes(v) for v in views)
    assert coalesce([views[0], views[2]]) is None
    assert coalesce([views[0], memoryview(bytes(views[1]))]) is None


def test_shared_cache_is_visible_to_another_process():
    name = shm_name()
    with shared_kv_cache(LAYOUT, 6, name) as cache:
        assert cache.abs().sum() == 0 and os.path.exists(f"/dev/shm/{name}")
        code = ("import torch, sys; from splitserve.kvtransfer import *; "
                "L = KVLayout(dtype='float32', block_size=4, num_layers=3, num_kv_heads=2, head_dim=8); "
                "c = map_shared_kv_cache(sys.argv[1], L); assert c.shape[2] == 6; c[:, :, 4] = 7.0")
        subprocess.run([sys.executable, "-c", code, name], check=True, timeout=60)
        assert torch.all(cache[:, :, 4] == 7.0) and cache[:, :, :4].abs().sum() == 0
        with pytest.raises(FileExistsError, match="already exists"):
            allocate_kv_cache(LAYOUT, 6, name)
    assert not os.path.exists(f"/dev/shm/{name}")
    free_shared_kv_cache(name)  # idempotent
    with pytest.raises(FileNotFoundError):
        map_shared_kv_cache(name, LAYOUT)


async def _send_one(backend, address):
    sender = make_sender(backend, LAYOUT, SenderOptions(connect_timeout_s=3))
    try:
        await sender.send_blocks(address, "t", [(0, bytes(LAYOUT.block_nbytes))])
    finally:
        await sender.close()


@pytest.mark.parametrize("replace", [False, True], ids=["file-gone", "other-file"])
def test_shm_sender_refuses_a_cache_it_cannot_see(replace):
    """What a sender on another host or in another container meets: the name is missing,
    or names a different file."""
    name = shm_name()

    async def body():
        store = KVBlockStore(allocate_kv_cache(LAYOUT, 4, name), LAYOUT, shm_name=name)
        receiver = make_receiver("shm", LAYOUT, store, "127.0.0.1", lambda *r: None)
        await receiver.start()
        try:
            free_shared_kv_cache(name)  # the receiver keeps its mapping
            if replace:
                allocate_kv_cache(LAYOUT, 4, name)
            with pytest.raises(TransferError, match="use tcp or ucx"):
                await _send_one("shm", receiver.address)
        finally:
            await receiver.stop()
            free_shared_kv_cache(name)
    asyncio.run(asyncio.wait_for(body(), 20))


def test_shm_receiver_needs_a_shared_store_and_backends_must_match():
    with pytest.raises(ValueError, match="shm_name"):
        make_receiver("shm", LAYOUT, KVBlockStore(random_cache(), LAYOUT), "127.0.0.1", print)
    with pytest.raises(ValueError, match="not the shared file"):
        make_receiver("shm", LAYOUT, KVBlockStore(random_cache(), LAYOUT, shm_name="x"), "127.0.0.1", print)

    async def body():
        receiver = make_receiver("tcp", LAYOUT, KVBlockStore(random_cache(), LAYOUT), "127.0.0.1",
                                 lambda *r: None)
        await receiver.start()
        try:
            shm_address = receiver.address.replace("tcp://", "shm://")
            with pytest.raises(TransferError, match="no shared-memory cache"):
                await _send_one("shm", shm_address)
            with pytest.raises(TransferError, match="not a tcp:// address"):
                await _send_one("tcp", receiver.address.replace("tcp://", "ucx://"))
        finally:
            await receiver.stop()
    asyncio.run(asyncio.wait_for(body(), 20))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("algo", ["xxh3_64", "wsum32_v1"])
def test_head_slices_pack_land_and_hash_as_blocks_of_a_narrower_layout(algo, device):
    """A slice of heads [a, c) of a block is the packed block of layout.with_heads(c - a):
    pack, land (at a head offset of another cache), write and in-place checksums agree."""
    from splitserve.common.kv_heads import HeadRange
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layout = KVLayout(dtype="float32", block_size=4, num_layers=3, num_kv_heads=4, head_dim=8)
    src = KVBlockStore(random_cache(layout, seed=1).to(device), layout, checksum_algo=algo)
    dst = KVBlockStore(random_cache(layout, seed=2).to(device), layout, checksum_algo=algo)
    before = dst.kv_caches.clone()
    heads = HeadRange(1, 3)
    narrow = layout.with_heads(2)
    assert src.slice_layout(heads) == narrow and src.slice_layout(HeadRange(0, 4)) is layout
    packed = src.pack([5, 2], heads=heads)
    data = bytes(packed.host() if hasattr(packed, "host") else packed)
    assert len(data) == 2 * narrow.block_nbytes
    want = src.kv_caches[:, :, [5, 2], :, 1:3].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    assert data == bytes(want.view(torch.uint8).numpy())
    items = src.split(packed, heads=heads)
    sums = src.checksums([5, 2], heads=heads)
    ok = dst.land([7, None], data, sums, algo, heads=HeadRange(2, 4))  # another offset, one skipped
    assert ok == [True, False]
    assert torch.equal(dst.kv_caches[:, :, 7, :, 2:4], src.kv_caches[:, :, 5, :, 1:3])
    assert torch.equal(dst.kv_caches[:, :, 7, :, :2], before[:, :, 7, :, :2])  # other heads untouched
    assert torch.equal(dst.kv_caches[:, :, [0, 1, 2, 3, 4, 5, 6, 8, 9]], before[:, :, [0, 1, 2, 3, 4, 5, 6, 8, 9]])
    assert dst.checksums([7], algo, heads=HeadRange(2, 4)) == sums[:1]  # verifies in place (shm, ipc)
    assert dst.land([8], data[:narrow.block_nbytes], [sums[0] ^ 1], algo, heads=HeadRange(0, 2)) == [False]
    from splitserve.kvtransfer.packed import frame_views
    second = frame_views(items)[1]  # a byte view, or a PackedBlock row's host bytes (wsum32_v1)
    dst.write(9, second, heads=HeadRange(0, 2))
    assert dst.read(9, heads=HeadRange(0, 2)) == bytes(second) == data[narrow.block_nbytes:]
    with pytest.raises(AssertionError, match="out of this cache"):
        dst.pack([0], heads=HeadRange(3, 5))

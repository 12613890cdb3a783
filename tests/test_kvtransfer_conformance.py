"""One conformance suite for every KV transfer backend (tcp, shm, ucx, nccl; nccl on
its CPU code path, gloo; and tests/toy_backend.py, a backend from outside the package
named in $SPLITSERVE_KV_BACKENDS): real sockets on 127.0.0.1, two real block stores with
different random contents, and a receiver in a child process for the crash case;
also tensor-parallel ranks on both sides (different TP degrees: head slices) over each
backend (tests/test_kvtransfer_tp.py covers the TP cases in depth on tcp and shm).
Each test is bounded by a timeout, so a hang is a failure, not a stuck run."""

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

from splitserve.common.kv_backends import BACKENDS_ENV, BUILTIN
from splitserve.deploy.ports import free_port
from splitserve.kvtransfer import (KVBlockStore, KVLayout, LayoutMismatch, SenderOptions,
                                   TransferError, TransferFailure, allocate_kv_cache, free_shared_kv_cache,
                                   make_receiver, make_sender, sender_options)
from splitserve.tests.kv_ranks import DecodeRanks, PrefillRanks, compat, full_cache, transfer

torch.set_num_threads(1)

SMALL = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)  # 1 KiB
REALISTIC = KVLayout(dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
TIMEOUT_S = 30  # per test body


def run(coro, timeout: float = TIMEOUT_S):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def ucx_unavailable() -> str | None:
    from splitserve.kvtransfer.backends.ucx import load_ucxx
    try:
        load_ucxx()
    except TransferError as e:
        return str(e)
    return None


def nccl_unavailable() -> str | None:
    from splitserve.kvtransfer.backends.pair_group import check_available
    try:
        check_available(torch.device("cpu"))
    except TransferError as e:
        return str(e)
    return None


TOY_BACKEND = Path(__file__).with_name("toy_backend.py")


@pytest.fixture(params=[spec.name for spec in BUILTIN] + ["toy"])
def backend(request, monkeypatch):
    if request.param == "toy":  # this process and the receiver processes it starts load it
        monkeypatch.setenv(BACKENDS_ENV, str(TOY_BACKEND))
    if request.param == "ipc":  # a CUDA IPC handle cannot be opened by the process that made it
        pytest.skip("ipc needs CUDA and two processes: tests/test_kvtransfer_device.py")
    unavailable = {"ucx": ucx_unavailable, "nccl": nccl_unavailable}.get(request.param)
    if unavailable is not None and (why := unavailable()):
        pytest.skip(why)
    return request.param


def random_store(layout: KVLayout, num_blocks: int, seed: int, shm_name: str | None = None) -> KVBlockStore:
    cache = allocate_kv_cache(layout, num_blocks, shm_name)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)).to(cache.dtype))
    return KVBlockStore(cache, layout, shm_name=shm_name)


class Pair:
    """A sender-side store and a started receiver (with its store and on_block log)."""

    def __init__(self, backend: str, layout: KVLayout = SMALL, num_blocks: int = 300,
                 options: SenderOptions | None = None):
        self.backend, self.layout = backend, layout
        self.shm_name = f"splitserve-test-{uuid.uuid4().hex[:12]}" if backend == "shm" else None
        self.src = random_store(layout, num_blocks, seed=1)
        self.dst = random_store(layout, num_blocks, seed=2, shm_name=self.shm_name)
        self.dst_before = self.dst.kv_caches.clone()
        self.reports: list[tuple[str, int, bool, str | None]] = []
        self.receiver = make_receiver(backend, layout, self.dst, "127.0.0.1", self._on_block)
        self.sender = make_sender(backend, layout, options or SenderOptions(connect_timeout_s=3))
        self.hook = None  # optional extra on_block callback

    def _on_block(self, *report):
        self.reports.append(report)
        if self.hook is not None:
            self.hook(*report)

    def blocks(self, src_ids):
        return self.src.split(self.src.pack(src_ids))

    async def send(self, transfer_id, src_ids, dest_ids, sender=None):
        await (sender or self.sender).send_blocks(self.receiver.address, transfer_id,
                                                  list(zip(dest_ids, self.blocks(src_ids))))

    def landed_equal(self, src_ids, dest_ids) -> bool:
        return all(self.src.read(s) == self.dst.read(d) for s, d in zip(src_ids, dest_ids))

    async def __aenter__(self):
        await self.receiver.start()
        return self

    async def __aexit__(self, *exc):
        await self.sender.close()
        await self.receiver.stop()
        if self.shm_name:
            free_shared_kv_cache(self.shm_name)


@pytest.mark.parametrize("n", [1, 16, 256])
def test_blocks_land_exactly(backend, n):
    async def body():
        async with Pair(backend) as p:
            gen = torch.Generator().manual_seed(n)
            src_ids = torch.randperm(300, generator=gen)[:n].tolist()
            dest_ids = torch.randperm(300, generator=gen)[:n].tolist()
            await p.send("t-1", src_ids, dest_ids)
            assert p.landed_equal(src_ids, dest_ids)
            assert sorted(p.reports) == sorted(("t-1", d, True, None) for d in dest_ids)
            untouched = sorted(set(range(300)) - set(dest_ids))
            assert torch.equal(p.dst.kv_caches[:, :, untouched], p.dst_before[:, :, untouched])
    run(body())


def test_realistic_layout(backend):
    async def body():
        async with Pair(backend, REALISTIC, num_blocks=40) as p:
            src_ids, dest_ids = list(range(32)), list(range(39, 7, -1))
            await p.send("big", src_ids, dest_ids)
            assert p.landed_equal(src_ids, dest_ids)
            assert Counter(r[1] for r in p.reports) == Counter(dest_ids)
            assert all(r[2] for r in p.reports)
    run(body())


def test_concurrent_transfers_one_receiver(backend):
    async def body():
        # 4 blocks per frame, so the frames of concurrent transfers interleave on the wire.
        options = SenderOptions(max_frame_bytes=4 * SMALL.block_nbytes, connect_timeout_s=3)
        async with Pair(backend, options=options) as p:
            other = make_sender(backend, SMALL, options)
            try:
                jobs = [(f"t{i}", list(range(i * 30, i * 30 + 30)), list(range(299 - i * 30, 269 - i * 30, -1)))
                        for i in range(6)]
                await asyncio.gather(*(p.send(tid, s, d, sender=other if i % 3 == 2 else None)
                                       for i, (tid, s, d) in enumerate(jobs)))
                for tid, s, d in jobs:
                    assert p.landed_equal(s, d)
                    assert sorted(r[1] for r in p.reports if r[0] == tid) == sorted(d)
                assert all(r[2] for r in p.reports) and len(p.reports) == 180
                await p.send("again", [0], [0])  # connections are kept and reused
                assert p.receiver.stats.connections == 2
            finally:
                await other.close()
    run(body())


def test_layout_mismatch_refused_on_both_sides(backend):
    async def body():
        async with Pair(backend) as p:
            wrong = KVLayout(dtype="float16", block_size=4, num_layers=2, num_kv_heads=2, head_dim=16)
            sender = make_sender(backend, wrong, SenderOptions(connect_timeout_s=3))
            try:
                with pytest.raises(LayoutMismatch) as err:
                    await sender.send_blocks(p.receiver.address, "x", [(0, bytes(wrong.block_nbytes))])
            finally:
                await sender.close()
            for message in (str(err.value), p.receiver.last_refusal):
                assert "dtype" in message and "head_dim" in message and "num_layers" not in message
            assert p.receiver.stats.refused == 1 and p.reports == []
    run(body())


def test_corrupted_blocks_detected(backend):
    async def body():
        options = sender_options(env={"SPLITSERVE_FAULT": "corrupt_block:3"}, connect_timeout_s=3)
        assert options.corrupt_every == 3
        async with Pair(backend, options=options) as p:
            src_ids, dest_ids = list(range(9)), list(range(100, 109))
            with pytest.raises(TransferError, match="rejected 3 of 9"):
                await p.send("bad", src_ids, dest_ids)
            bad = {102, 105, 108}
            assert sorted(r[1] for r in p.reports) == dest_ids
            for _, dest, ok, reason in p.reports:
                assert ok == (dest not in bad)
                assert ok or "checksum" in reason
            good = [(s, d) for s, d in zip(src_ids, dest_ids) if d not in bad]
            assert p.landed_equal(*zip(*good))
            if backend != "shm":  # garbage never lands; shm wrote in place and reports ok=False
                assert all(p.dst.read(d) == bytes(p.dst_before[:, :, d].contiguous().numpy()) for d in bad)
    run(body())


@pytest.mark.parametrize("p_tp, d_tp, heads, corrupt", [
    (1, 2, 2, False), (2, 1, 2, False), (4, 2, 2, False), (2, 4, 4, False), (2, 1, 4, True)])
def test_tensor_parallel_ranks_receive_exactly_their_heads(backend, p_tp, d_tp, heads, corrupt):
    """Prefill and decode nodes of different TP: each decode rank's receiver lands the head
    slices the plan sends it (from one or several prefill ranks) at its head offset; the
    checksum covers each slice, so a corrupted one fails the transfer."""
    async def body():
        full = full_cache(compat(heads, 1), 48, seed=p_tp + d_tp)
        options = {0: SenderOptions(corrupt_every=2, connect_timeout_s=10)} if corrupt else None
        prefill = PrefillRanks(backend, compat(heads, p_tp), full, options)
        decode = DecodeRanks(backend, compat(heads, d_tp), 48)
        await decode.start()
        try:
            src, dest = list(range(40, 20, -1)), list(range(3, 23))
            outcome, sent = await transfer(prefill, decode, "tp", src, dest)
            if corrupt:
                assert isinstance(outcome, TransferFailure) and "checksum" in outcome.reason
                assert isinstance(sent[0], TransferError)
            else:
                assert not isinstance(outcome, TransferFailure), outcome
                assert decode.landed_exactly(full, src, dest)
        finally:
            await prefill.close()
            await decode.close()
    run(body())


def test_blocks_of_a_dead_transfer_are_refused(backend):
    """The receiver's owner says a transfer no longer takes blocks (aborted, failed):
    its frames are reported not ok and, except over shm, never written."""
    async def body():
        async with Pair(backend) as p:
            p.receiver.accepts = lambda tid: tid != "dead"
            with pytest.raises(TransferError):
                await p.send("dead", [0, 1], [10, 11])
            assert [ok for *_, ok, _ in p.reports] == [False, False]
            if backend != "shm":
                assert all(p.dst.read(d) == bytes(p.dst_before[:, :, d].contiguous().numpy()) for d in (10, 11))
            await p.send("live", [2], [12])
            assert p.landed_equal([2], [12])
    run(body())


def test_receiver_stopped_midway(backend):
    async def body():
        options = SenderOptions(max_frame_bytes=SMALL.block_nbytes, connect_timeout_s=3, timeout_s=10)
        async with Pair(backend, options=options) as p:
            p.hook = lambda *r: len(p.reports) == 1 and asyncio.ensure_future(p.receiver.stop())
            with pytest.raises(TransferError):
                await p.send("cut", list(range(256)), list(range(256)))
            assert 1 <= len(p.reports) < 256  # the first block landed, the rest never did
    run(body(), timeout=15)


def test_nobody_listening_fails_fast(backend):
    async def body():
        sender = make_sender(backend, SMALL, SenderOptions(connect_timeout_s=2))
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(TransferError):
                await sender.send_blocks(f"{backend}://127.0.0.1:{free_port()}", "t", [(0, bytes(1024))])
            assert loop.time() - start < 1  # refused at once, not after the connect timeout
        finally:
            await sender.close()
    run(body())


CHILD = textwrap.dedent("""
    import asyncio, os, sys
    import torch
    from splitserve.kvtransfer import KVBlockStore, KVLayout, allocate_kv_cache, make_receiver
    backend, shm_name = sys.argv[1], (sys.argv[2] if sys.argv[2] != "-" else None)
    layout = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    store = KVBlockStore(allocate_kv_cache(layout, 300, shm_name), layout, shm_name=shm_name)
    def on_block(tid, dest, ok, reason):
        os._exit(3)  # dies hard on the first block: no goodbye on any socket
    async def main():
        receiver = make_receiver(backend, layout, store, "127.0.0.1", on_block)
        await receiver.start()
        print(receiver.address, flush=True)
        await asyncio.sleep(60)
    asyncio.run(main())
""")


def test_receiver_process_dies_midway(backend):
    shm_name = f"splitserve-test-{uuid.uuid4().hex[:12]}" if backend == "shm" else "-"
    child = subprocess.Popen([sys.executable, "-c", CHILD, backend, shm_name], stdout=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        address = child.stdout.readline().decode().strip()
        assert address.startswith(f"{backend}://"), address

        async def body():
            src = random_store(SMALL, 300, seed=1)
            options = SenderOptions(max_frame_bytes=SMALL.block_nbytes, connect_timeout_s=5, timeout_s=10)
            sender = make_sender(backend, SMALL, options)
            try:
                with pytest.raises(TransferError):
                    await sender.send_blocks(address, "t", list(zip(range(256), src.split(src.pack(range(256))))))
            finally:
                await sender.close()
        run(body(), timeout=20)
        assert child.wait(timeout=10) == 3
    finally:
        child.kill()
        child.wait()
        if shm_name != "-":
            free_shared_kv_cache(shm_name)

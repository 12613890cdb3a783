"""PairGroup on CPU (gloo), both ranks in this process: bytes cross intact, the
rendezvous leaves no keys in the store, close fails what the loop awaits at once
and the pair threads end, a rank whose peer never comes gives up after its timeout."""

import asyncio
import datetime
import threading
import time

import pytest
import torch

from splitserve.kvtransfer.connection import ConnectionClosed
from splitserve.kvtransfer.backends.pair_group import PairGroup, check_available

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
CPU = torch.device("cpu")


def run(coro, timeout: float = 30):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def store_server():
    return torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5),
                                      wait_for_workers=False)


def pair_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == f"kv-pair {name}"]


async def wait_threads_gone(*names: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while any(pair_threads(n) for n in names):
        assert time.monotonic() < deadline, f"pair threads still running: {names}"
        await asyncio.sleep(0.05)


async def joined_pair(store, prefix: str) -> tuple[PairGroup, PairGroup]:
    receiver, sender = PairGroup(CPU, f"{prefix}-r"), PairGroup(CPU, f"{prefix}-s")
    await asyncio.gather(receiver.open(0, "127.0.0.1", store.port, prefix, "127.0.0.1", 5),
                         sender.open(1, "127.0.0.1", store.port, prefix, "127.0.0.1", 5))
    return receiver, sender


def test_bytes_cross_and_the_store_is_left_empty():
    check_available(CPU)

    async def body():
        store = store_server()
        receiver, sender = await joined_pair(store, "p1")
        assert store.num_keys() == 0  # rank 0 deleted the rendezvous keys
        data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # the group is reused
            out = bytearray(len(data))
            await asyncio.gather(sender.send(memoryview(data.numpy()), 5), receiver.recv(memoryview(out), 5))
            assert bytes(out) == data.numpy().tobytes()
        receiver.close()
        sender.close()
        await wait_threads_gone("p1-r", "p1-s")
    run(body())


def test_close_fails_a_pending_recv_at_once_and_threads_end():
    async def body():
        store = store_server()
        receiver, sender = await joined_pair(store, "p2")
        pending = receiver.recv(memoryview(bytearray(1024)), 20)  # nobody sends
        await asyncio.sleep(0.1)
        start = time.monotonic()
        receiver.close()
        with pytest.raises(ConnectionClosed):
            await pending
        assert time.monotonic() - start < 0.1
        # The receiver's thread still waits in gloo; the sender dropping its group ends it.
        sender.close()
        await wait_threads_gone("p2-r", "p2-s")
    run(body())


def test_a_rank_without_peer_gives_up_after_its_timeout():
    async def body():
        store = store_server()
        alone = PairGroup(CPU, "p3-r")
        start = time.monotonic()
        with pytest.raises(ConnectionClosed):
            await alone.open(0, "127.0.0.1", store.port, "p3", "127.0.0.1", 1)
        assert time.monotonic() - start < 5
        assert store.num_keys() == 0
        alone.close()
        await wait_threads_gone("p3-r")
    run(body())

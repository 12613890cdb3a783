"""KV transfer between tensor-parallel nodes (issue 25): the ranks of a prefill node and of
a decode node as several block stores over shards of one random TP=1 cache, real
senders and receivers on 127.0.0.1 (tcp and shm; the conformance suite runs every
backend), rank 0's TransferTable fed by its receiver and by the worker ranks'
``RankBlocks``. Each decode rank must end with exactly its heads of the TP=1 cache,
byte for byte; a corrupted slice fails the transfer; an incompatible pair is refused
at the handshake before a byte moves; a misrouted slice is refused before it is sent;
and prefill ranks in another process send to decode ranks here."""

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from splitserve.common.kv_heads import HeadRange
from splitserve.kvtransfer import (KVLayout, KVShard, LayoutMismatch, SenderOptions, TransferError,
                                   TransferFailure, TransferState, make_sender)
from splitserve.kvtransfer.backends.tcp import dial
from splitserve.kvtransfer.wire import Hello, Refused, Welcome
from splitserve.tests.kv_ranks import DecodeRanks, PrefillRanks, compat, full_cache, transfer

torch.set_num_threads(1)

NUM_BLOCKS = 40
TIMEOUT_S = 30
# (prefill tp, decode tp, KV heads): heads divisible by both TPs, and fewer than a TP
CASES = [(1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 4), (4, 2, 8),
         (1, 2, 1), (2, 1, 1), (2, 4, 2), (4, 2, 2), (2, 4, 1), (4, 2, 1)]


def run(coro, timeout: float = TIMEOUT_S):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def ids(seed: int, n: int = 12) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randperm(NUM_BLOCKS, generator=gen)[:n].tolist()
    return src, torch.randperm(NUM_BLOCKS, generator=gen)[:n].tolist()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("p_tp, d_tp, heads", CASES)
def test_each_decode_rank_gets_exactly_its_heads(backend, p_tp, d_tp, heads):
    async def body():
        full = full_cache(compat(heads, 1), NUM_BLOCKS, seed=1)
        prefill = PrefillRanks(backend, compat(heads, p_tp), full)
        decode = DecodeRanks(backend, compat(heads, d_tp), NUM_BLOCKS)
        await decode.start()
        try:
            src, dest = ids(p_tp * 10 + d_tp + heads)
            outcome, sent = await transfer(prefill, decode, "t1", src, dest)
            assert not isinstance(outcome, TransferFailure), outcome
            assert decode.table.get("t1").state is TransferState.COMPLETE
            assert decode.landed_exactly(full, src, dest)
            # minimal traffic: each decode rank received its heads once, replicas sent nothing twice
            per_head = compat(heads, 1).block_size * compat(heads, 1).head_dim * 2 * 2 * 4 * len(src)
            held = max(1, heads // d_tp)
            assert sum(sent) == d_tp * held * per_head
            assert all(g.accepts("t1") is False for g in decode.gates)  # closed on every worker rank
        finally:
            await prefill.close()
            await decode.close()
    run(body())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_transfer_completes_only_when_every_decode_rank_has_every_block(backend):
    async def body():
        full = full_cache(compat(4, 1), NUM_BLOCKS, seed=2)
        prefill = PrefillRanks(backend, compat(4, 2), full)
        decode = DecodeRanks(backend, compat(4, 4), NUM_BLOCKS, hold=True)
        await decode.start()
        try:
            src, dest = ids(5)
            t, sent = await transfer(prefill, decode, "t", src, dest)
            assert all(isinstance(s, int) for s in sent)  # every slice was acknowledged
            assert decode.held and not t.done.done()  # rank 0 has its heads, the workers' reports wait
            assert t.landed == set() and len(t.ranks_landed) == len(dest)
            assert decode.table.snapshot()[0]["landed_on_some_ranks"] == len(dest)
            decode.release()
            assert t.done.done() and t.done.result().first_token == 1
            assert t.state is TransferState.COMPLETE and t.landed == set(dest)
        finally:
            await prefill.close()
            await decode.close()
    run(body())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("p_tp, d_tp, heads", [(1, 2, 4), (2, 1, 4), (4, 2, 2)])
def test_a_corrupted_slice_fails_the_transfer(backend, p_tp, d_tp, heads):
    async def body():
        full = full_cache(compat(heads, 1), NUM_BLOCKS, seed=3)
        bad_rank = p_tp - 1 if p_tp > 1 else 0
        prefill = PrefillRanks(backend, compat(heads, p_tp), full,
                               options={bad_rank: SenderOptions(corrupt_every=3, connect_timeout_s=10)})
        decode = DecodeRanks(backend, compat(heads, d_tp), NUM_BLOCKS)
        await decode.start()
        try:
            src, dest = ids(7, n=9)
            outcome, sent = await transfer(prefill, decode, "bad", src, dest)
            assert isinstance(outcome, TransferFailure) and outcome.state is TransferState.FAILED
            assert "checksum mismatch" in outcome.reason
            errors = [s for s in sent if isinstance(s, BaseException)]
            assert errors and all(isinstance(e, TransferError) for e in errors)
            assert "rejected 3 of 9" in str(errors[0])
        finally:
            await prefill.close()
            await decode.close()
    run(body())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("change", [dict(head_dim=16), dict(model="other"), dict(num_kv_heads=2),
                                    dict(dtype="float16", num_layers=3)])
def test_an_incompatible_pair_is_refused_before_a_byte_moves(backend, change):
    async def body():
        full = full_cache(compat(4, 1, **change), NUM_BLOCKS, seed=4)
        prefill = PrefillRanks(backend, compat(4, 2, **change), full)
        decode = DecodeRanks(backend, compat(4, 2), NUM_BLOCKS)
        await decode.start()
        try:
            src, dest = ids(9)
            sent = await prefill.send(decode.addrs, "x", src, dest)
            assert all(isinstance(s, LayoutMismatch) for s in sent), sent
            named = {f for f in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim")
                     if f"{f}: " in str(sent[0])}
            assert named == set(change)  # each mismatch named, nothing else
            for field, value in change.items():
                assert all(repr(value) in str(s) for s in sent), (field, sent)
            for r in decode.receivers:
                assert r.stats.refused >= 1 and r.stats.frames == 0
                assert all(f"{f}: " in r.last_refusal for f in change)
            assert decode.landed_exactly(full, [], [])  # no block changed on any rank
        finally:
            await prefill.close()
            await decode.close()
    run(body())


def test_a_sender_with_an_impossible_tp_is_refused_by_the_receiver():
    """A hostile or broken Hello (3 ranks over 4 heads) gets Refused(code="tp"), never a Welcome."""
    async def body():
        decode = DecodeRanks("tcp", compat(4, 2), NUM_BLOCKS)
        await decode.start()
        try:
            host, port = decode.addrs[0].removeprefix("tcp://").split(":")
            conn = await dial(host, int(port))
            bad = KVShard(compat(4, 3), rank=0)
            layout = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
            await conn.send(Hello(layout=layout, checksum="xxh3_64", shard=bad))
            reply = await conn.recv()
            conn.close()
            assert isinstance(reply, Refused) and reply.code == "tp", reply
            assert "does not divide the model's 4 KV heads" in reply.reason
            conn = await dial(host, int(port))  # a Hello without a shard (an older sender)
            await conn.send(Hello(layout=layout, checksum="xxh3_64"))
            reply = await conn.recv()
            conn.close()
            assert isinstance(reply, Refused) and reply.code == "version"
            good = KVShard(compat(4, 1), rank=0)
            conn = await dial(host, int(port))
            await conn.send(Hello(layout=good.layout, checksum="xxh3_64", shard=good))
            reply = await conn.recv()
            conn.close()
            assert isinstance(reply, Welcome) and reply.shard == KVShard(compat(4, 2), rank=0)
        finally:
            await decode.close()
    run(body())


def test_a_slice_sent_to_the_wrong_rank_is_refused_before_it_is_sent():
    async def body():
        full = full_cache(compat(4, 1), NUM_BLOCKS, seed=5)
        prefill = PrefillRanks("tcp", compat(4, 1), full)
        decode = DecodeRanks("tcp", compat(4, 2), NUM_BLOCKS)
        await decode.start()
        try:
            src, dest = ids(11)
            sent = await prefill.send(decode.addrs[::-1], "swapped", src, dest)  # ranks out of order
            assert all(isinstance(s, TransferError) and "does not hold KV heads" in str(s) for s in sent)
            assert all(r.stats.frames == 0 for r in decode.receivers)
            sender = prefill.ranks[0].sender
            with pytest.raises(TransferError, match="not all held by this sender"):
                await sender.send_blocks(decode.addrs[0], "t", [(0, bytes(16))], heads=HeadRange(2, 6))
        finally:
            await prefill.close()
            await decode.close()
    run(body())


def test_a_sender_shard_must_hold_its_layout():
    layout = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="does not hold a cache"):
        make_sender("tcp", layout, shard=KVShard(compat(4, 2), rank=1))  # rank 1 of 2 holds 2 heads


CHILD = textwrap.dedent("""
    import asyncio, sys
    import torch
    from splitserve.tests.kv_ranks import PrefillRanks, compat, full_cache
    backend, p_tp, heads, addrs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    src, dest = [int(x) for x in sys.argv[5].split(",")], [int(x) for x in sys.argv[6].split(",")]
    torch.set_num_threads(1)
    async def main():
        prefill = PrefillRanks(backend, compat(heads, p_tp), full_cache(compat(heads, 1), 40, seed=21))
        try:
            sent = await prefill.send(addrs, "from-child", src, dest)
        finally:
            await prefill.close()
        errors = [s for s in sent if isinstance(s, BaseException)]
        print("ok" if not errors else f"failed: {errors}", flush=True)
    asyncio.run(main())
""")


@pytest.mark.parametrize("backend, p_tp, d_tp, heads", [("tcp", 2, 4, 2), ("shm", 2, 1, 4)])
def test_prefill_ranks_in_another_process(backend, p_tp, d_tp, heads):
    src, dest = ids(13)

    async def body():
        full = full_cache(compat(heads, 1), NUM_BLOCKS, seed=21)
        decode = DecodeRanks(backend, compat(heads, d_tp), NUM_BLOCKS)
        await decode.start()
        try:
            t = decode.table.reserve("from-child", "r", dest, lease_s=30)
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CHILD, backend, str(p_tp), str(heads), ",".join(decode.addrs),
                ",".join(map(str, src)), ",".join(map(str, dest)), stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            out, _ = await asyncio.wait_for(child.communicate(), 25)
            assert child.returncode == 0 and out.decode().strip() == "ok", out
            await asyncio.sleep(0)
            from splitserve.common.protocol import PrefillResult
            decode.table.prefilled("from-child", PrefillResult(transfer_id="from-child", first_token=3))
            assert (await asyncio.wait_for(asyncio.shield(t.done), 5)).first_token == 3
            assert decode.landed_exactly(full, src, dest)
        finally:
            await decode.close()
    run(body(), timeout=40)


def test_leftover_slices_of_a_dead_transfer_never_complete_a_new_one():
    """P TP=2 -> D TP=1: transfer "a" gets only prefill rank 0's slices (its rank 1 died), so
    the decode blocks are half landed; "b" reuses those blocks and must wait for both of its
    own slices. The partial-block map stays bounded by the cache (keyed by block)."""
    async def body():
        full = full_cache(compat(4, 1), NUM_BLOCKS, seed=31)
        prefill = PrefillRanks("tcp", compat(4, 2), full)
        decode = DecodeRanks("tcp", compat(4, 1), NUM_BLOCKS)
        await decode.start()
        try:
            src, dest = ids(17)
            a = decode.table.reserve("a", "r", dest, lease_s=30)
            await prefill.ranks[0].send(decode.addrs, "a", src, dest)
            receiver = decode.receivers[0]
            assert len(receiver._parts) == len(dest) and not a.landed
            decode.table.fail("a", "prefill rank 1 died")
            b = decode.table.reserve("b", "r", dest, lease_s=30)
            await prefill.ranks[0].send(decode.addrs, "b", src, dest)  # rank 0's half again: not enough
            assert not b.landed and len(receiver._parts) == len(dest)
            await prefill.ranks[1].send(decode.addrs, "b", src, dest)
            assert b.landed == set(dest) and receiver._parts == {}
            assert decode.landed_exactly(full, src, dest)
        finally:
            await prefill.close()
            await decode.close()
    run(body())

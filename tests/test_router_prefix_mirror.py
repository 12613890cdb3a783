"""The prefix mirror (a router's in-memory copy of the prefix index) and its follower
against a real redis-server: predicted cached tokens per node (capped like the engine),
epochs, block-size mismatches, a late start, lost updates (a gap, a lost last update),
two routers agreeing, and a Redis that goes away and comes back (load-only meanwhile,
then a full resync)."""

import asyncio
import logging
import time

import pytest

from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_index import IndexDelta, KVIndex
from splitserve.common.node_registry import NodeInfo, new_epoch
from splitserve.deploy.launcher import free_port, start_redis
from splitserve.router.metrics import RouterMetrics
from splitserve.router.routing.mirror_follower import MirrorFollower
from splitserve.router.routing.prefix_mirror import PrefixMirror

pytestmark = pytest.mark.anyio

BS = 16
MODEL = "SmolLM2-135M-Instruct"


def node(node_id: str, block_size: int = BS, epoch: str | None = None) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="prefill", http_addr="http://127.0.0.1:1", model=MODEL,
                    epoch=epoch or new_epoch(), block_size=block_size)


def mirror(url: str, **kw) -> MirrorFollower:
    kw.setdefault("check_interval_s", 0.2)
    kw.setdefault("retry_s", 0.2)
    px = MirrorFollower(PrefixMirror(RouterMetrics.create(MODEL), MODEL, BS), KVIndex(url, timeout_s=0.5), **kw)
    px.start()
    return px


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def close(*pxs: MirrorFollower) -> None:
    for px in pxs:
        await px.stop()
        await px.index.close()


async def test_predicted_cached_tokens_per_node(redis_url):
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks
    hashes = hash_blocks(prompt, BS, (MODEL,))
    writer = KVIndex(redis_url)
    px = mirror(redis_url)
    try:
        await until(lambda: px.mirror.connected)
        a, b, c, old = node("a"), node("b"), node("c"), node("d")
        await writer.apply("a", a.epoch, IndexDelta.full(hashes[:3]), seq=1)
        await writer.apply("b", b.epoch, IndexDelta.full(hashes[1:]), seq=1)  # no root: nothing usable
        await writer.apply("d", old.epoch, IndexDelta.full(hashes), seq=1)
        await writer.apply("c", c.epoch, IndexDelta.full(hashes), seq=1)
        await until(lambda: len(px.mirror.nodes_mirrored()) == 4)
        restarted = node("d")  # the node registry now lists d with a new epoch
        hits = px.mirror.lookup(prompt, [a, b, restarted])
        assert hits.looked_up and hits.num_blocks == 4
        assert hits.cached == {"a": 48}
        # a node holding every block of a 64-token prompt: one token is always computed
        assert px.mirror.lookup(prompt[:64], [c]).cached == {"c": 48}
        assert px.mirror.lookup(prompt, [c, a]).cached == {"c": 64, "a": 48}
        assert px.mirror.lookup(prompt[:BS], [a, c]) == ({}, 1, True, {})
        # a node hashing with another block size is left out (with one warning)
        other = node("x", block_size=32)
        await writer.apply("x", other.epoch, IndexDelta.full(hash_blocks(prompt, 32, (MODEL,))), seq=1)
        assert px.mirror.lookup(prompt, [other, a]).cached == {"a": 48}
        # deltas follow: a loses block 2, gains it back
        await writer.apply("a", a.epoch, IndexDelta(removed={hashes[2]}), seq=2)
        await until(lambda: px.mirror.lookup(prompt, [a]).cached == {"a": 32})
        await writer.apply("a", a.epoch, IndexDelta(stored={hashes[2], hashes[3]}), seq=3)
        await until(lambda: px.mirror.lookup(prompt, [a]).cached == {"a": 64})
        # the restarted node's first write retires the old epoch's entries
        await writer.apply("d", restarted.epoch, IndexDelta.full(hashes[:1]), seq=1)
        await until(lambda: ("d", old.epoch) not in px.mirror.nodes_mirrored())
        assert px.mirror.lookup(prompt, [restarted]).cached == {"d": 16}
    finally:
        await close(px)
        await writer.close()


async def test_late_start_gaps_and_a_lost_last_update_resync(redis_url):
    prompt = list(range(500, 600))  # 6 blocks
    hashes = hash_blocks(prompt, BS, (MODEL,))
    writer = KVIndex(redis_url)
    n = node("late")
    await writer.apply("late", n.epoch, IndexDelta.full(hashes[:2]), seq=1)  # before any router
    px = mirror(redis_url, check_interval_s=0.2)
    try:
        await until(lambda: px.mirror.lookup(prompt, [n]).cached == {"late": 32})  # caught up from the snapshot
        px.event_loss = 1.0  # the next update is lost
        seen = px.updates
        await writer.apply("late", n.epoch, IndexDelta(stored={hashes[2]}), seq=2)
        await until(lambda: px.updates == seen + 1)
        px.event_loss = 0.0
        before = px.resyncs
        await writer.apply("late", n.epoch, IndexDelta(stored={hashes[3]}), seq=3)  # seq 2 missing: gap
        await until(lambda: px.mirror.lookup(prompt, [n]).cached == {"late": 64})
        assert px.resyncs == before + 1
        # a lost last update has no successor to reveal it: the periodic check does
        px.event_loss = 1.0
        seen = px.updates
        await writer.apply("late", n.epoch, IndexDelta(stored={hashes[4]}), seq=4)
        await until(lambda: px.updates == seen + 1)
        px.event_loss = 0.0
        await until(lambda: px.mirror.lookup(prompt, [n]).cached == {"late": 80}, timeout_s=5)
        # dropped keys (a clean shutdown) leave the mirror at the next check
        await writer.drop("late", n.epoch)
        await until(lambda: px.mirror.lookup(prompt, [n]).cached == {})
    finally:
        await close(px)
        await writer.close()


async def test_two_routers_agree_and_a_third_starting_late_matches_them(redis_url):
    writer = KVIndex(redis_url)
    nodes = [node(f"n{i}") for i in range(6)]
    prompts = [list(range(1000 * k, 1000 * k + 200)) for k in range(5)]
    first, second = mirror(redis_url), mirror(redis_url)
    try:
        await until(lambda: first.mirror.connected and second.mirror.connected)
        seqs = {n.node_id: 0 for n in nodes}
        for step in range(30):  # each node stores a prefix of some prompt, evicts some
            n = nodes[step % len(nodes)]
            h = hash_blocks(prompts[step % 5], BS, (MODEL,))
            delta = IndexDelta(stored=set(h[: 3 + step % 9]), removed=set(h[10:]))
            seqs[n.node_id] += 1
            if seqs[n.node_id] == 1:
                delta.clear = True  # a node's first write is full
            assert await writer.apply(n.node_id, n.epoch, delta, seqs[n.node_id])
        third = mirror(redis_url)
        try:
            for px in (first, second, third):
                await until(lambda: all(px.mirror._nodes.get((n.node_id, n.epoch)) is not None
                                        and px.mirror._nodes[(n.node_id, n.epoch)].seq == seqs[n.node_id]
                                        for n in nodes))
            for p in prompts:
                hits = first.mirror.lookup(p, nodes)
                assert hits.cached and hits == second.mirror.lookup(p, nodes) == third.mirror.lookup(p, nodes)
        finally:
            await close(third)
    finally:
        await close(first, second)
        await writer.close()


async def test_redis_down_means_load_only_then_a_full_resync(caplog):
    port = free_port()
    proc, url = start_redis(port)
    prompt = list(range(64))
    hashes = hash_blocks(prompt, BS, (MODEL,))
    a = node("a")
    writer = KVIndex(url)
    await writer.apply("a", a.epoch, IndexDelta.full(hashes), seq=1)
    px = mirror(url)
    try:
        await until(lambda: px.mirror.lookup(prompt, [a]).cached == {"a": 48})
        with caplog.at_level(logging.WARNING, logger="splitserve.router.routing.mirror_follower"):
            proc.kill()
            proc.wait()
            await until(lambda: not px.mirror.connected)
            t0 = time.monotonic()
            hits = px.mirror.lookup(prompt, [a])
            assert not hits.looked_up and hits.cached == {} and time.monotonic() - t0 < 0.05
            await asyncio.sleep(0.5)  # several reconnect attempts: still one warning
        assert len([r for r in caplog.records if "prefix index" in r.message]) == 1
        assert px.mirror.metrics.index_lookups.labels(result="skipped")._value.get() >= 1
        proc, url = start_redis(port)  # an empty Redis: the node rewrites its state
        await writer.apply("a", a.epoch, IndexDelta.full(hashes[:2]), seq=7)
        await until(lambda: px.mirror.lookup(prompt, [a]).cached == {"a": 32})
    finally:
        await close(px)
        await writer.close()
        proc.kill()
        proc.wait()

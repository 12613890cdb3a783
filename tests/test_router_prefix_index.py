"""The router's prefix-index lookups against a real redis-server: predicted cached
tokens per node (capped like the engine), epochs, block-size mismatches, and a Redis
that is down or hung: an empty result within the timeout, a metric, one log line,
then back-off."""

import asyncio
import logging
import os
import signal
import time

import pytest

from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_index import IndexDelta, KVIndex
from splitserve.common.registry import NodeInfo, new_epoch
from splitserve.deploy.launcher import free_port, start_redis
from splitserve.router.metrics import RouterMetrics
from splitserve.router.prefix_index import PrefixIndex

pytestmark = pytest.mark.anyio

BS = 16
MODEL = "SmolLM2-135M-Instruct"


def node(node_id: str, block_size: int = BS) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="prefill", http_addr="http://127.0.0.1:1", model=MODEL,
                    epoch=new_epoch(), block_size=block_size)


def prefix_index(url: str, **kw) -> tuple[PrefixIndex, RouterMetrics]:
    metrics = RouterMetrics.create("test-model")
    kw.setdefault("timeout_s", 0.25)
    return PrefixIndex(KVIndex(url, timeout_s=kw["timeout_s"]), metrics, MODEL, BS, **kw), metrics


async def test_predicted_cached_tokens_per_node(redis_url):
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks
    hashes = hash_blocks(prompt, BS, (MODEL,))
    assert len(hashes) == 4
    px, metrics = prefix_index(redis_url)
    writer = px.index
    try:
        a, b, c, old = node("a"), node("b"), node("c"), node("d")
        await writer.apply("a", a.epoch, IndexDelta.full(hashes[:3]), seq=1)
        await writer.apply("b", b.epoch, IndexDelta.full(hashes[1:]), seq=1)  # no root: nothing usable
        await writer.apply("d", old.epoch, IndexDelta.full(hashes), seq=1)
        restarted = node("d")  # the registry now lists d with a new epoch
        hits = await px.lookup(prompt, [a, b, c, restarted])
        assert hits.looked_up and hits.num_blocks == 4
        assert hits.cached == {"a": 48}
        # a node holding every block of a 64-token prompt: one token is always computed
        await writer.apply("c", c.epoch, IndexDelta.full(hashes), seq=1)
        assert (await px.lookup(prompt[:64], [c])).cached == {"c": 48}
        assert (await px.lookup(prompt, [c])).cached == {"c": 64}
        # a prompt of less than one block needs no round trip
        assert await px.lookup(prompt[:BS], [a, c]) == ({}, 1, True)
        assert metrics.index_lookups.labels(result="ok")._value.get() == 3  # the last one: no I/O
        # a node hashing with another block size is left out (with one warning)
        other = node("x", block_size=32)
        await writer.apply("x", other.epoch, IndexDelta.full(hash_blocks(prompt, 32, (MODEL,))), seq=1)
        assert (await px.lookup(prompt, [other, a])).cached == {"a": 48}
    finally:
        await writer.close()


async def test_redis_down_is_an_empty_result_a_metric_and_one_log_line(caplog):
    px, metrics = prefix_index(f"redis://127.0.0.1:{free_port()}/0", retry_s=0.3)  # nothing listens
    prompt = list(range(64))
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.router.prefix_index"):
            hits = await px.lookup(prompt, [node("a")])
            assert hits.cached == {} and not hits.looked_up
            t0 = time.monotonic()
            skipped = await px.lookup(prompt, [node("a")])  # backing off: no Redis call
            assert not skipped.looked_up and time.monotonic() - t0 < 0.05
            await asyncio.sleep(0.35)
            assert not (await px.lookup(prompt, [node("a")])).looked_up  # tried again
        assert metrics.index_lookups.labels(result="error")._value.get() == 2
        assert metrics.index_lookups.labels(result="skipped")._value.get() == 1
        assert metrics.redis_errors.labels(op="index_lookup")._value.get() == 2
        assert len([r for r in caplog.records if "prefix index" in r.message]) == 1
    finally:
        await px.index.close()


async def test_hung_redis_costs_one_timeout_then_recovers():
    port = free_port()
    proc, url = start_redis(port)
    px, metrics = prefix_index(url, timeout_s=0.2, retry_s=0.2)
    prompt = list(range(64))
    a = node("a")
    try:
        await px.index.apply("a", a.epoch, IndexDelta.full(hash_blocks(prompt, BS, (MODEL,))), seq=1)
        assert (await px.lookup(prompt, [a])).cached == {"a": 48}
        os.kill(proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            t0 = time.monotonic()
            hits = await px.lookup(prompt, [a])
            assert not hits.looked_up and time.monotonic() - t0 < 1.0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.25)
        assert (await px.lookup(prompt, [a])).cached == {"a": 48}
        assert metrics.index_lookups.labels(result="error")._value.get() == 1
    finally:
        await px.index.close()
        proc.kill()
        proc.wait()

"""A long body is prepared off the event loop: ``off_loop`` hands a body over
RouterConfig.prepare_thread_bytes to a worker thread, and the router's tokenizer lets
the loop run while it tokenizes (tokenizers' plain ``encode`` would hold the GIL)."""

import asyncio
import json
import random
import threading
import time

import pytest

from splitserve.router.config import RouterConfig
from splitserve.router.http.request_body import off_loop
from splitserve.router.tokenizer import RouterTokenizer

WORDS = "the quick brown fox jumps over a lazy dog near seven old river banks".split()


@pytest.mark.anyio
async def test_large_bodies_go_to_a_worker_thread_small_ones_stay():
    loop_thread = threading.get_ident()
    where = lambda body: threading.get_ident()  # noqa: E731
    assert await off_loop(b"x" * 100, 1024, where) == loop_thread
    assert await off_loop(b"x" * 2048, 1024, where) != loop_thread
    assert await off_loop(b"x", 0, where) != loop_thread  # 0: every body


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="prepare_thread_bytes"):
        RouterConfig(prepare_thread_bytes=-1)


@pytest.mark.anyio
async def test_tokenizing_a_long_prompt_on_a_thread_leaves_the_loop_running(bundled_dir):
    tok = RouterTokenizer(bundled_dir)
    text = " ".join(random.Random(0).choice(WORDS) for _ in range(60_000))
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def watch():
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t0 - 0.005)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    ids = await asyncio.to_thread(tok.encode, text)
    took = time.perf_counter() - t0
    watcher.cancel()
    assert len(ids) > 50_000
    # the loop kept waking its timer while the thread tokenized (held GIL: one lag ~ took)
    assert max(lags) < took / 2, (max(lags), took)
    assert len(lags) > 5


@pytest.mark.anyio
async def test_a_long_stored_conversation_is_prepared_off_the_loop_after_a_tiny_body(redis_url, http):
    """previous_response_id: a body of a few bytes continues a stored conversation of
    ~60k tokens. Whether to prepare on a thread follows the whole conversation's size,
    so the router's loop keeps waking its timers while it renders and tokenizes."""
    from splitserve.common.outcomes import StoreResult
    from splitserve.router.app import start_router
    from splitserve.router.responses.store import ResponseStore

    config = RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url)
    running = await start_router(config)
    store = ResponseStore(redis_url, config.responses_max_bytes, config.responses_key_max_bytes,
                          config.responses_key_max_entries, config.prepare_thread_bytes)
    text = " ".join(random.Random(1).choice(WORDS) for _ in range(60_000))
    history = [{"type": "message", "role": "user", "content": text},
               {"type": "message", "role": "assistant", "content": "Noted."}]
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def watch():
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t0 - 0.005)

    try:
        stored = await store.put({"id": "resp_long", "object": "response", "output": []}, history, None)
        assert stored.result is StoreResult.STORED
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "input": "And then?",
                           "previous_response_id": "resp_long", "store": False})
        assert len(body) < config.prepare_thread_bytes  # the body alone would stay on the loop
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.05)
        lags.clear()
        t0 = time.perf_counter()
        async with http.post(running.url + "/v1/responses", data=body,
                             headers={"Content-Type": "application/json"}) as r:
            status, answer = r.status, await r.json()
        took = time.perf_counter() - t0
        await asyncio.sleep(0.02)  # a wake-up the loop owes the watcher is recorded
        watcher.cancel()
    finally:
        await store.close()
        await running.stop()
    # prepared in full: a 400 for the context it overflows (nothing would serve it anyway)
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert took > 0.04, took  # real work: rendering and tokenizing ~60k tokens (~0.09 s on this CPU, quiet)
    assert max(lags) < took / 2, (max(lags), took)

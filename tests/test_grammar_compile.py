"""Grammar compiles on a node: in a worker process under a CPU-time limit
(engine/sampling/grammar_worker.py, node/grammar_service.py), never on the engine thread.

- a compile past its limit is killed (the process is gone, not burning a core), the
  request is refused as too complex, a resend is refused from memory, and the next
  grammar compiles in a fresh worker;
- concurrent requests for one new grammar compile it once;
- on a real node, a constraint the limits accept but that compiles past the node's
  --grammar-compile-timeout is a 400 naming the field, the node keeps serving, and the
  engine thread never compiles a grammar even when the node's cache evicts one between
  the request's check and its admission.

The slow constraints here bypass common/grammar_limits.py (which refuses them) by going
to the worker and the service directly, as a node's own caller could not.
"""

import asyncio
import json
import os
import threading
import time

import msgspec
import pytest
from aiohttp.test_utils import TestServer

from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.errors import InvalidRequest
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.outcomes import GrammarCompileOutcome as Outcome
from splitserve.common.protocol import FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.decode_node.server import build_app as build_decode_app
from splitserve.engine.sampling import grammar_worker
from splitserve.engine.sampling.grammar_worker import CompileWorker
from splitserve.engine.sampling.structured import GrammarCache, start_state
from splitserve.node import grammar_service
from splitserve.node.grammar_service import GrammarService

pytestmark = pytest.mark.slow

# 15 s of one core to compile (xgrammar 0.2.8, this vocabulary); the limits refuse it
SLOW = json.dumps({"type": "string", "pattern": "(.{0,4}){16}"})
SMALL = {"enum": ["alpha", "beta"]}


@pytest.fixture(scope="module")
def tokenizer_info(bundled_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(bundled_dir)
    return GrammarCache(bundled_dir, len(tok), [tok.eos_token_id]).tokenizer_info


@pytest.fixture(autouse=True)
def patient_wall(monkeypatch):
    """The worker runs niced behind everything else: on a CI machine whose cores the other
    test worker keeps busy, 1 CPU second can take longer than the production wall cap
    (WALL_FACTOR x the limit) and the compile ends STARVED (a 503), not TIMEOUT. These tests
    are about the CPU limit, so they give the wall cap room."""
    monkeypatch.setattr(grammar_worker, "WALL_FACTOR", 60)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_kills_a_compile_past_its_cpu_limit_and_recovers(tokenizer_info):
    worker = CompileWorker(tokenizer_info())
    try:
        worker.start()
        pid = worker.pid
        t0 = time.monotonic()
        result = worker.compile(StructuredOutputsParams(json=SLOW).spec(), limit_s=1.0)
        assert result.outcome is Outcome.TIMEOUT, result
        assert not alive(pid), "the timed-out worker must not go on compiling"
        print(f"killed after {time.monotonic() - t0:.1f} s")
        ok = worker.compile(StructuredOutputsParams(json=json.dumps(SMALL)).spec(), limit_s=30.0)
        assert ok.outcome is Outcome.COMPILED and worker.pid != pid  # a fresh process
    finally:
        worker.kill()


def test_service_refuses_too_complex_once_remembers_and_shares_compiles(tokenizer_info):
    async def body():
        service = GrammarService(tokenizer_info, workers=1, timeout_s=1.0)
        try:
            slow = StructuredOutputsParams(json=SLOW)  # not validate()d: the limits would refuse it
            with pytest.raises(InvalidRequest) as err:
                await service.grammar(slow)
            assert err.value.field == "structured_outputs.json" and "too complex" in err.value.message
            assert service.counts[Outcome.TIMEOUT] == 1
            t0 = time.monotonic()
            with pytest.raises(InvalidRequest):
                await service.grammar(slow)  # from memory: no second compile
            assert service.counts[Outcome.REFUSED] == 1 and time.monotonic() - t0 < 0.5
            small = StructuredOutputsParams(json=SMALL).validate()
            a, b = await asyncio.gather(service.grammar(small), service.grammar(small))
            assert a is b and service.counts[Outcome.COMPILED] == 1  # one compile for both
            state = start_state(a, small)  # the node's copy drives a matcher
            assert state.matcher.accept_string('"beta"') and state.matcher.is_completed()
            await service.grammar(small)
            assert service.counts[Outcome.CACHED] == 1
        finally:
            service.close()

    asyncio.run(body())


def test_service_refuses_with_503_when_too_many_compiles_wait(tokenizer_info, monkeypatch):
    monkeypatch.setattr(grammar_service, "MAX_WAITING_PER_WORKER", 1)

    async def body():
        service = GrammarService(tokenizer_info, workers=1, timeout_s=1.0)
        try:
            await service.grammar(StructuredOutputsParams(regex="[0-9]{2}"))  # the worker is up
            first = asyncio.create_task(service.grammar(StructuredOutputsParams(json=SLOW)))
            await asyncio.sleep(0.2)  # it holds the one worker (over a second: its CPU limit)
            second = asyncio.create_task(service.grammar(StructuredOutputsParams(regex="[0-9]{3}")))
            await asyncio.sleep(0.2)  # it waits for the worker: the one wait allowed
            with pytest.raises(grammar_service.CompileUnavailable):
                await service.grammar(StructuredOutputsParams(regex="[0-9]{4}"))
            assert service.counts[Outcome.BUSY] == 1
            with pytest.raises(InvalidRequest):
                await first
            await second  # compiled once the worker was back
        finally:
            service.close()

    asyncio.run(body())


# accepted by the limits (two distinct maxLength-128 strings: 256 positions), 3 s or more of one core
HEAVY = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "string", "maxLength": 128}, "b": {"type": "string", "minLength": 1, "maxLength": 127}}}


def test_a_grammar_copy_never_queues_behind_another_one(tokenizer_info):
    """With two worker slots, a light grammar proven while a heavy one's copy compiles in
    the node gets its own copy at once: the node's copies do not queue on one thread."""
    async def body():
        service = GrammarService(tokenizer_info, workers=2, timeout_s=60.0)
        try:
            await service.grammar(StructuredOutputsParams(regex="[0-9]{2}"))  # started; a worker is up
            heavy = asyncio.create_task(service.grammar(StructuredOutputsParams(json=json.dumps(HEAVY))))
            while service.copying == 0:  # its worker proved it: the node's copy compiles now (seconds)
                assert not heavy.done()
                await asyncio.sleep(0.02)
            light = asyncio.create_task(service.grammar(StructuredOutputsParams(json=json.dumps(SMALL))))
            done, _ = await asyncio.wait({heavy, light}, return_when=asyncio.FIRST_COMPLETED)
            assert done == {light}, "the light grammar waited for the heavy one's copy"
            await heavy
            assert service.counts[Outcome.COMPILED] == 3
        finally:
            service.close()

    asyncio.run(body())


def test_a_grammar_not_ready_within_the_nodes_wait_is_a_503_and_compiles_on(tokenizer_info, monkeypatch):
    """A request waits for its grammar at most max(MIN_WAIT_S, WAIT_FACTOR x the compile
    limit) (wall), then gets CompileUnavailable (a 503 + Retry-After), never a hang; the
    compile goes on and a retry gets it, compiled once."""
    monkeypatch.setattr(grammar_service, "WAIT_FACTOR", 0.05, raising=False)  # 0.05 x 20 s: 1 s
    monkeypatch.setattr(grammar_service, "MIN_WAIT_S", 0.0, raising=False)

    async def patiently(service, params):  # a client retrying after each Retry-After
        deadline = time.monotonic() + 120
        while True:
            try:
                return await service.grammar(params)
            except grammar_service.CompileUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(grammar_service.RETRY_AFTER_S)

    async def body():
        service = GrammarService(tokenizer_info, workers=1, timeout_s=20.0)
        try:
            await patiently(service, StructuredOutputsParams(regex="[0-9]{2}"))  # the worker is up
            late = service.counts[Outcome.LATE]  # its start may have taken longer than the wait
            heavy = StructuredOutputsParams(json=json.dumps(HEAVY))
            t0 = time.monotonic()
            with pytest.raises(grammar_service.CompileUnavailable, match="still compiling"):
                await service.grammar(heavy)
            assert time.monotonic() - t0 < 5.0
            assert service.counts[Outcome.LATE] == late + 1
            await patiently(service, heavy)
            assert service.counts[Outcome.COMPILED] == 2  # the regex and the heavy schema, once
        finally:
            service.close()

    asyncio.run(body())


async def generate(s, server, rid: str, so: StructuredOutputsParams | None, tokens=range(5, 20)):
    req = GenerateRequest(request_id=rid, prompt=WirePrompt.of(tokens),
                          sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=len(rid),
                                                         structured_outputs=so))
    async with s.post(server.make_url("/generate"), data=msgspec.msgpack.encode(req),
                      headers={"Content-Type": "application/msgpack"}) as r:
        if r.status != 200:
            return r.status, msgspec.msgpack.decode(await r.read())  # an ErrorBody
        reader = FrameReader(TokenDelta)
        frames = [f async for chunk in r.content.iter_any() for f in reader.feed(chunk)]
    return 200, frames


def test_node_refuses_a_slow_grammar_keeps_serving_and_never_compiles_on_the_engine_thread(
        tiny_llama_with_tokenizer, tokenizer, monkeypatch):
    path, _ = tiny_llama_with_tokenizer()
    cfg = NodeConfig(role="colocated", engine=EngineConfig(model=str(path), kv_cache_memory=4 << 20, num_threads=1),
                     grammar_compile_timeout_s=0.5)
    monkeypatch.setattr(grammar_service, "MAX_CACHED_GRAMMARS", 1)  # every other grammar evicts the last
    compiled_on: list[str] = []  # the thread of every in-process compile (a spy: the real one runs)
    real_compile = GrammarCache.compile

    def spy(self, params):
        compiled_on.append(threading.current_thread().name)
        return real_compile(self, params)

    monkeypatch.setattr(GrammarCache, "compile", spy)
    # accepted by the limits (two distinct maxLength-128 strings: 256 positions), 3 s or more of
    # one core to compile: far past the node's 0.5 CPU s
    heavy = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "maxLength": 128}, "b": {"type": "string", "minLength": 1, "maxLength": 127}}}
    enums = [{"enum": [f"{w}{i}" for w in ("alpha", "beta")]} for i in range(3)]

    async def body():
        import aiohttp
        server = TestServer(build_decode_app(cfg))
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                status, answer = await generate(s, server, "heavy", StructuredOutputsParams(json=heavy))
                assert status == 400, answer
                assert answer["param"] == "structured_outputs.json", answer
                assert "too complex" in answer["message"]
                status, _ = await generate(s, server, "plain", None)  # the node serves on
                assert status == 200
                # three grammars through a cache of one, in turn and at once: each request is
                # checked, then admitted after the others evicted its grammar
                outs = await asyncio.gather(*(generate(s, server, f"e{i}-{k}", StructuredOutputsParams(json=e))
                                              for k in range(2) for i, e in enumerate(enums)))
                return outs
        finally:
            await server.close()

    outs = asyncio.run(body())
    for k, (status, frames) in enumerate(outs):
        assert status == 200, frames
        text = tokenizer.decode([t for f in frames for t in f.token_ids], skip_special_tokens=True)
        assert json.loads(text) in enums[k % 3]["enum"] and frames[-1].finish_reason == "stop", text
    assert "engine" not in compiled_on, f"the engine thread compiled a grammar: {compiled_on}"
    assert compiled_on == []  # a node compiles in its worker processes only

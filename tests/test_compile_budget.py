"""The per-key compile budget (router/http/compile_budget.py): one API key's new
structured-output constraints are limited at once and per minute (429 with
Retry-After), other keys and constraints nodes already answered are not; and the
real router applies it per API key on every generating endpoint."""

import asyncio

import aiohttp
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.router.app import start_router
from splitserve.router.http.compile_budget import CompileAdmit, CompileBudget
from splitserve.router.config import RouterConfig
from splitserve.router.errors import ApiError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def schema(i: int) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json={"enum": [f"v{i}"]}).validate())


def test_one_key_gets_its_concurrent_new_compiles_and_no_more():
    async def body():
        budget = CompileBudget(concurrent=1, per_minute=100, clock=Clock())
        release = asyncio.Event()

        async def hold(owner, i):
            async with budget.compile_slot(owner, schema(i)) as outcome:
                await release.wait()
                return outcome

        first = asyncio.create_task(hold("a", 1))
        await asyncio.sleep(0)
        same = asyncio.create_task(hold("a", 1))  # the same constraint: one compile serves both
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as err:
            async with budget.compile_slot("a", schema(2)):
                pass
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
        other = asyncio.create_task(hold("b", 3))  # another key compiles meanwhile
        await asyncio.sleep(0)
        async with budget.compile_slot("a", SamplingParams()) as plain:  # no constraint: free
            assert plain is CompileAdmit.KNOWN
        release.set()
        assert await first is CompileAdmit.NEW and await other is CompileAdmit.NEW
        assert await same is CompileAdmit.SHARED
        async with budget.compile_slot("a", schema(1)) as again:  # answered before: known, free
            assert again is CompileAdmit.KNOWN

    asyncio.run(body())


def test_per_minute_limit_with_retry_after_and_what_becomes_known():
    async def body():
        clock = Clock()
        budget = CompileBudget(concurrent=4, per_minute=2, clock=clock)
        async with budget.compile_slot("a", schema(1)):
            pass
        clock.now += 20
        with pytest.raises(ApiError):  # a node's 503: the constraint is not known yet
            async with budget.compile_slot("a", schema(2)):
                raise ApiError(503, "no decode node")
        with pytest.raises(ApiError) as err:
            async with budget.compile_slot("a", schema(3)):
                pass
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "40"  # schema 1 ages out
        async with budget.compile_slot("a", schema(1)) as known:
            assert known is CompileAdmit.KNOWN  # compiled before: never counted
        async with budget.compile_slot("b", schema(3)) as other:
            assert other is CompileAdmit.NEW
        clock.now += 40
        with pytest.raises(ApiError) as err:  # a node's 400 (refused): known from now on
            async with budget.compile_slot("a", schema(4)):
                raise ApiError(400, "structured_outputs.json: cannot be compiled")
        async with budget.compile_slot("c", schema(4)) as refused_before:
            assert refused_before is CompileAdmit.KNOWN

    asyncio.run(body())


@pytest.fixture(scope="module")
async def router(redis_url):
    config = RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, api_keys=("key-a-0123456789", "key-b-0123456789"),
                          schema_compiles_per_key_per_minute=2)
    running = await start_router(config)
    yield running.url
    await running.stop()


@pytest.mark.anyio
async def test_router_answers_429_to_one_key_past_its_budget_and_serves_others(router):
    def chat(i):
        return {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [i]}}}}

    async with aiohttp.ClientSession() as http:
        async def post(key, path, body):
            async with http.post(router + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        # a router without nodes answers 503 to what it would start: the budget is spent first
        for i in range(2):
            assert (await post("key-a-0123456789", "/v1/chat/completions", chat(i)))[0] == 503
        status, retry, answer = await post("key-a-0123456789", "/v1/chat/completions", chat(2))
        assert status == 429 and int(retry) >= 1 and "new structured-output constraints" in answer["error"]["message"]
        responses = {"model": "SmolLM2-135M-Instruct", "input": "Hi",
                     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"enum": [3]}}}}
        assert (await post("key-a-0123456789", "/v1/responses", responses))[0] == 429
        assert (await post("key-b-0123456789", "/v1/chat/completions", chat(2)))[0] == 503  # another key: its own budget
        plain = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert (await post("key-a-0123456789", "/v1/chat/completions", plain))[0] == 503  # no constraint: no budget
        async with http.get(router + "/metrics") as r:
            assert 'reason="schema_compiles"' in await r.text()

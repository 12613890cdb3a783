"""The per-key compile budget (router/http/compile_budget.py): one API key's
structured-output compiles are limited at once and per minute (429 with Retry-After),
other keys and constraints the nodes hold compiled are not; a constraint the router has
seen but the node does not hold is counted; the key's slot lasts until every leg
settled; and the real router applies it per API key on every generating endpoint.
tests/test_compile_budget_cluster.py runs it against real nodes."""

import asyncio

import aiohttp
import pytest

from splitserve.common.protocol import GRAMMAR_NOT_COMPILED
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


def not_compiled() -> ApiError:
    """A decode node's answer to a request that may not compile a grammar it does not hold."""
    return ApiError(409, "not compiled here", type_=GRAMMAR_NOT_COMPILED)


def test_one_key_gets_its_concurrent_new_compiles_and_no_more():
    async def body():
        budget = CompileBudget(concurrent=1, per_minute=100, clock=Clock())
        release = asyncio.Event()

        async def hold(owner, i):
            async def start(grant):
                await release.wait()
                return grant

            return await budget.start(owner, schema(i), start)

        first = asyncio.create_task(hold("a", 1))
        await asyncio.sleep(0)
        same = asyncio.create_task(hold("a", 1))  # the same constraint: a node compiling it serves both
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as err:
            await budget.start("a", schema(2), started)
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
        other = asyncio.create_task(hold("b", 3))  # another key compiles meanwhile
        await asyncio.sleep(0)
        plain = await budget.start("a", SamplingParams(), started)  # no constraint: free
        assert plain.admit is CompileAdmit.NONE and plain.compile
        release.set()
        assert (await first).admit is CompileAdmit.NEW and (await first).compile
        assert (await other).admit is CompileAdmit.NEW
        shared = await same
        assert shared.admit is CompileAdmit.SHARED and not shared.compile  # it may not compile elsewhere
        again = await budget.start("a", schema(1), started)  # answered before: known, free
        assert again.admit is CompileAdmit.KNOWN and not again.compile

    asyncio.run(body())


async def started(grant):
    """A start that succeeds at once."""
    return grant


def test_per_minute_limit_with_retry_after_and_what_becomes_known():
    async def body():
        clock = Clock()
        budget = CompileBudget(concurrent=4, per_minute=2, clock=clock)
        await budget.start("a", schema(1), started)
        clock.now += 20

        async def no_node(grant):
            raise ApiError(503, "no decode node")

        with pytest.raises(ApiError):  # a node's 503: the constraint is not known yet
            await budget.start("a", schema(2), no_node)
        with pytest.raises(ApiError) as err:
            await budget.start("a", schema(3), started)
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "40"  # schema 1 ages out
        known = await budget.start("a", schema(1), started)
        assert known.admit is CompileAdmit.KNOWN  # compiled before, held there: never counted
        assert (await budget.start("b", schema(3), started)).admit is CompileAdmit.NEW
        clock.now += 40

        async def refused(grant):
            raise ApiError(400, "structured_outputs.json: cannot be compiled")

        with pytest.raises(ApiError):  # a node's 400 (refused): known from now on
            await budget.start("a", schema(4), refused)
        assert (await budget.start("c", schema(4), started)).admit is CompileAdmit.KNOWN

    asyncio.run(body())


def test_a_known_constraint_a_node_does_not_hold_is_counted_like_a_new_one():
    """The router has seen it, but the decode node it goes to never compiled it (or evicted
    it): that node's 409 makes it a new one, counted, or a 429 past the budget."""
    async def body():
        clock = Clock()
        budget = CompileBudget(concurrent=1, per_minute=2, clock=clock)
        await budget.start("a", schema(1), started)  # new: 1
        tries: list[CompileAdmit] = []

        async def lacking_node(grant):
            tries.append(grant.admit)
            if not grant.compile:
                raise not_compiled()
            return grant

        grant = await budget.start("a", schema(1), lacking_node)
        assert tries == [CompileAdmit.KNOWN, CompileAdmit.NEW] and grant.compile  # 2
        tries.clear()
        with pytest.raises(ApiError) as err:
            await budget.start("a", schema(1), lacking_node)
        assert tries == [CompileAdmit.KNOWN] and err.value.status == 429  # the budget is spent
        holding = await budget.start("a", schema(1), started)  # a node that holds it: still free
        assert holding.admit is CompileAdmit.KNOWN

    asyncio.run(body())


def test_the_slot_is_held_until_every_leg_settles_and_a_missed_grammar_is_forgotten():
    async def body():
        budget = CompileBudget(concurrent=1, per_minute=100, clock=Clock())
        tickets = []

        async def two_legs(grant):
            tickets.extend([grant.ticket(), grant.ticket()])
            return grant

        await budget.start("a", schema(1), two_legs)  # started: its legs still compile
        with pytest.raises(ApiError) as err:
            await budget.start("a", schema(2), started)
        assert err.value.status == 429
        tickets[0].settle(False)  # one leg's first token
        tickets[0].settle(False)  # idempotent
        with pytest.raises(ApiError):
            await budget.start("a", schema(2), started)
        tickets[1].settle(False)  # the other leg ended
        assert (await budget.start("a", schema(2), started)).admit is CompileAdmit.NEW
        assert (await budget.start("a", schema(2), started)).admit is CompileAdmit.KNOWN
        known = []

        async def one_leg(grant):
            known.append(grant.ticket())
            return grant

        await budget.start("a", schema(2), one_leg)
        known[0].settle(True)  # its prefill node did not hold it: the decode node prefilled it
        assert (await budget.start("a", schema(2), started)).admit is CompileAdmit.NEW

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
        assert status == 429 and int(retry) >= 1 and "structured-output constraints" in answer["error"]["message"]
        responses = {"model": "SmolLM2-135M-Instruct", "input": "Hi",
                     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"enum": [3]}}}}
        assert (await post("key-a-0123456789", "/v1/responses", responses))[0] == 429
        assert (await post("key-b-0123456789", "/v1/chat/completions", chat(2)))[0] == 503  # another key: its own budget
        plain = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert (await post("key-a-0123456789", "/v1/chat/completions", plain))[0] == 503  # no constraint: no budget
        async with http.get(router + "/metrics") as r:
            assert 'reason="schema_compiles"' in await r.text()

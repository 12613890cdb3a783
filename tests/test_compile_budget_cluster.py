"""The per-key compile budget against real nodes (issue 53, finding 6): every grammar a node
compiles for a key is one the key's budget paid for, whichever node compiles it and
whenever (router/http/compile_budget.py).

A cluster of real processes: Redis, the router (two API keys' budgets of 2 new constraints
a minute, one at a time), one prefill node and two decode nodes serving the bundled
SmolLM2, routed round robin so consecutive requests go to the other decode node.

- a constraint the router has seen is free only where a node holds it compiled: sent to a
  decode node that never compiled it, it is counted like a new one (or refused with 429);
- a request of several prompts with a new constraint compiles it on one decode node, once;
- the key's compile slot is held until the prefill node compiled too (the first token),
  not released when the decode node answered;
- a node told not to compile compiles nothing: a decode node answers 409, a prefill node
  leaves the prefill to its decode node, which says so on the first frame.
"""

import json
import urllib.error
import urllib.request

import aiohttp
import msgspec
import pytest

from splitserve.common import metric_names as names
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import GRAMMAR_NOT_COMPILED, ErrorBody, FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.deploy.launcher import Cluster
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow

KEYS = ("key-cycle-0123456789", "key-fanout-0123456789", "key-prefill-0123456789")
DECODES = ("decode-0", "decode-1")
# accepted by the limits (two distinct maxLength-128 strings: 256 positions), seconds of a core
HEAVY = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "string", "maxLength": 128}, "b": {"type": "string", "minLength": 1, "maxLength": 127}}}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill_nodes=1, decode_nodes=2, kv_cache_memory="64MiB", policy="round_robin", api_keys=KEYS,
                 router_args=["--schema-compiles-per-key", "1", "--schema-compiles-per-key-per-minute", "2"]) as c:
        yield c


def compiled(cluster: Cluster, names_: tuple[str, ...]) -> float:
    """Grammars the named nodes compiled (a worker's proof and the node's copy: one)."""
    total = 0.0
    for name in names_:
        with urllib.request.urlopen(f"{cluster.node(name).addr}/metrics", timeout=10) as r:
            total += sample_sum(r.read().decode(), names.GRAMMAR_COMPILES, outcome="compiled")
    return total


def chat(schema: dict, content: str = "Pick one.", **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": content}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **extra}


async def post(http: aiohttp.ClientSession, url: str, key: str, path: str, body: dict):
    async with http.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, r.headers.get("Retry-After"), await r.json()


def assert_refusal(status, retry, answer) -> None:
    """A 429 of the key's budget: Retry-After and an OpenAI-style error body."""
    assert status == 429 and retry is not None and int(retry) >= 1, (status, retry, answer)
    assert answer["error"]["type"] == "rate_limit_error" and "structured-output" in answer["error"]["message"]


@pytest.mark.anyio
async def test_a_seen_constraint_is_free_only_where_a_node_holds_it(cluster):
    """Two constraints, each sent twice in a row: round robin puts the second send on the other
    decode node, which never compiled it. Before the fix the router counted each constraint
    once (it had seen it) and both decode nodes compiled both: 4 compiles for a budget of 2,
    and cycling them went on without limit. Now each compile is paid for: the decode nodes
    compile at most the 2 the key may spend; a node holding a constraint serves it free, one
    that does not answers 409 and the router counts the compile (or answers 429)."""
    before = compiled(cluster, DECODES)
    x, y = {"enum": ["cycle-x1", "cycle-x2"]}, {"enum": ["cycle-y1", "cycle-y2"]}
    answers = []
    async with aiohttp.ClientSession() as http:
        for schema in (x, x, y, y, x, x, y, y):
            answers.append(await post(http, cluster.url, KEYS[0], "/v1/chat/completions", chat(schema)))
    for status, retry, answer in answers:
        if status != 200:
            assert_refusal(status, retry, answer)
    statuses = [a[0] for a in answers]
    assert statuses[0] == 200 and 429 in statuses, statuses
    # x's last two sends went to both decode nodes (a 429 is routed too, or refused before
    # routing for y): the one that holds x served it free, after the budget was spent
    assert 200 in statuses[4:6], statuses
    assert compiled(cluster, DECODES) - before <= 2, statuses


@pytest.mark.anyio
async def test_several_prompts_with_a_new_constraint_compile_it_on_one_decode_node(cluster):
    """/v1/completions with two prompts: round robin would start them on both decode nodes,
    each compiling the constraint under the request's one count. Now the request's prompts go
    to the nodes of its first: one decode node compiles it."""
    before = compiled(cluster, DECODES)
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "prompt": ["Pick a fruit:", "Pick a vegetable, quickly:"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "enum": ["fanout-a", "fanout-b"]}}}}
    async with aiohttp.ClientSession() as http:
        status, _, answer = await post(http, cluster.url, KEYS[1], "/v1/completions", body)
    assert status == 200, answer
    assert sorted(json.loads(c["text"]) in ("fanout-a", "fanout-b") for c in answer["choices"]) == [True, True]
    assert compiled(cluster, DECODES) - before == 1


@pytest.mark.anyio
async def test_the_compile_slot_lasts_until_the_prefill_node_compiled(cluster):
    """A streamed request with a heavy new constraint: its decode node compiles it and answers,
    then its prefill node compiles it (seconds) before the first token. Before the fix the
    key's one compile slot was free again once the decode node answered, so a second new
    constraint compiled beside the prefill node's; now it gets 429 until the first token."""
    async with aiohttp.ClientSession() as http:
        body = chat(HEAVY, "Write a JSON object.", stream=True, max_tokens=4)
        async with http.post(cluster.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEYS[2]}"}) as stream:
            assert stream.status == 200, await stream.text()  # the decode node compiled it
            second = await post(http, cluster.url, KEYS[2], "/v1/chat/completions",
                                chat({"enum": ["slot-a", "slot-b"]}))
            text = await stream.text()
        assert_refusal(*second)
        assert '"content"' in text and "data: [DONE]" in text, text
        status, _, answer = await post(http, cluster.url, KEYS[2], "/v1/chat/completions",
                                       chat({"enum": ["slot-a", "slot-b"]}))
        assert status == 200, answer  # the slot is free once the first request's first token came


def test_a_node_told_not_to_compile_compiles_nothing_and_the_request_still_runs(cluster, tokenizer):
    """The nodes' side, called as the router calls them: a decode node asked not to compile a
    grammar it does not hold answers 409 grammar_not_compiled; one that holds it serves the
    request, and when its prefill node does not hold it, prefills it itself (the prefill node
    compiles nothing) and says so on the first frame (TokenDelta.grammar_missed)."""
    so = StructuredOutputsParams(json={"enum": ["node-a", "node-b"]}).validate()
    prompt = WirePrompt.of(tokenizer("Pick one, node:")["input_ids"])
    prefill = cluster.node("prefill-0").addr

    def generate(node: str, rid: str, **kw):
        req = GenerateRequest(request_id=rid, prompt=prompt, sampling_params=SamplingParams(
            max_tokens=8, temperature=0, structured_outputs=so), **kw)
        http_req = urllib.request.Request(f"{cluster.node(node).addr}/generate", data=msgspec.msgpack.encode(req),
                                          headers={"Content-Type": "application/msgpack"})
        try:
            with urllib.request.urlopen(http_req, timeout=120) as r:
                return 200, list(FrameReader(TokenDelta).feed(r.read()))
        except urllib.error.HTTPError as e:
            return e.code, msgspec.msgpack.decode(e.read(), type=ErrorBody)

    status, body = generate("decode-0", "uncompiled", compile_grammar=False)
    assert status == 409 and body.type == GRAMMAR_NOT_COMPILED, body
    status, frames = generate("decode-0", "local", compile_grammar=True)  # compiled, prefilled here
    assert status == 200 and not frames[0].grammar_missed
    before = compiled(cluster, ("prefill-0",))
    status, frames = generate("decode-0", "missed", compile_grammar=False, prefill_addr=prefill)
    assert status == 200 and frames[0].grammar_missed, frames
    text = tokenizer.decode([t for f in frames for t in f.token_ids], skip_special_tokens=True)
    assert json.loads(text) in ("node-a", "node-b") and frames[-1].finish_reason == "stop", text
    assert compiled(cluster, ("prefill-0",)) == before

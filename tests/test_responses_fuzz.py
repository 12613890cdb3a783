"""Property-based fuzz of POST /v1/responses (hypothesis, ~200 cases), as
tests/test_router_fuzz.py does for the chat and completion endpoints: a real router
in front of a real simulated decode node and a real Redis.

Cases are plausible Responses bodies (input as text or items of every kind, tools,
tool_choice, text.format, reasoning, store, previous_response_id, stream...) with some
values replaced by hostile ones (benchmarks/reliability/openai_fuzz.py's: wrong types,
ints beyond 64 bits, NaN literals, deep nesting, long strings), unknown item types and
unknown fields, plus valid bodies that generate. Every case must get an answer below
500; afterwards the router answers /health and every process is alive."""

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.benchmarks.reliability.openai_fuzz import FuzzCase, hostile, send, to_json

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
text = st.text(max_size=30)
call_ids = st.sampled_from(["call_1", "call_2", "", "call_x"])


def _field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, plausible, plausible, hostile)


part = st.fixed_dictionaries({"type": _field(st.sampled_from(["input_text", "output_text", "input_image",
                                                              "refusal", "audio"])),
                              "text": _field(text)})
message = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "system", "developer", "assistant", "tool", "wizard"])),
     "content": _field(text | st.lists(part, max_size=3))},
    optional={"type": st.just("message"), "id": text, "status": st.sampled_from(["completed", "incomplete"])})
function_call = st.fixed_dictionaries(
    {"type": st.just("function_call"), "call_id": _field(call_ids), "name": _field(st.just("get_weather")),
     "arguments": _field(st.just('{"city": "Oslo"}') | text)}, optional={"id": text, "status": text})
function_output = st.fixed_dictionaries(
    {"type": st.just("function_call_output"), "call_id": _field(call_ids),
     "output": _field(text | st.lists(part, max_size=2))})
other_item = st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call",
                                                             "computer_call_output", "mcp_call", "x"])},
                                   optional={"id": text, "summary": st.just([])})
items = st.lists(st.one_of(message, message, function_call, function_output, other_item), max_size=5)
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}
FORMATS = [{"type": "text"}, {"type": "json_object"},
           {"type": "json_schema", "name": "o", "schema": {"type": "object", "properties": {
               "a": {"type": "integer"}}, "required": ["a"]}, "strict": True},
           {"type": "json_schema", "name": "o"}, {"type": "xml"}]

PLAUSIBLE = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-5", ""]),
    "instructions": text,
    "max_output_tokens": st.integers(min_value=-1, max_value=8),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0, max_value=1),
    "tools": st.none() | st.just([TOOL]) | st.just([{"type": "web_search"}]) | st.just([TOOL, TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required", "sometimes", {"type": "function", "name": "get_weather"},
                                    {"type": "function", "name": "nope"}, {"type": "file_search"}]),
    "parallel_tool_calls": st.booleans(),
    "text": st.fixed_dictionaries({"format": st.sampled_from(FORMATS)}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high"])}),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2),
    "top_logprobs": st.integers(min_value=-1, max_value=21),
    "store": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_unknown", "", "x" * 300]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_obfuscation": st.booleans()}),
    "metadata": st.dictionaries(st.text(max_size=8), text, max_size=3),
    "truncation": st.sampled_from(["disabled", "auto"]),
    "top_k": st.integers(min_value=-2, max_value=50),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
}
bodies = st.builds(
    lambda body, extra: {**extra, **body},
    st.fixed_dictionaries({"input": _field(text | items)}, optional={k: _field(v) for k, v in PLAUSIBLE.items()}),
    st.dictionaries(st.text(max_size=10), hostile, max_size=2))
valid = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_output_tokens": st.integers(min_value=1, max_value=8),
     "input": st.text(min_size=1, max_size=30) | st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}), min_size=1, max_size=3)},
    optional={"instructions": text, "temperature": st.floats(min_value=0, max_value=2),
              "stream": st.booleans(), "store": st.booleans(), "metadata": st.just({"k": "v"})})


@st.composite
def cases(draw) -> FuzzCase:
    kind = draw(st.sampled_from(["plausible"] * 6 + ["valid"] * 3 + ["truncated"]))
    whole = to_json(draw(valid if kind == "valid" else bodies)).encode()
    if kind == "truncated":
        whole = whole[:draw(st.integers(min_value=0, max_value=max(0, len(whole) - 1)))]
    return FuzzCase("/v1/responses", whole, {"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def cluster():
    from splitserve.deploy.launcher import SimCluster

    with SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "50"], kv_cache_memory="256MiB",
                    router_args=["--max-model-len", "128"]) as c:
        yield c


def test_fuzzed_responses_never_get_5xx(cluster):
    host, port = cluster.url.removeprefix("http://").split(":")
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(case=cases())
    def check(case: FuzzCase):
        status = send(host, int(port), case)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (status, case.body[:500])

    check()
    print("statuses:", statuses)
    assert sum(statuses.values()) >= 100
    assert statuses.get(200, 0) >= 5, statuses  # valid bodies were among the cases, and served
    assert statuses.get(400, 0) >= 20, statuses
    with urllib.request.urlopen(cluster.url + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    assert all(p.popen.poll() is None for p in cluster.procs), "a process died"

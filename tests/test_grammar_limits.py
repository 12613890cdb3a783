"""Complexity limits of a structured-output constraint (common/grammar_limits.py), checked
before anything compiles it: each refusal is an `InvalidRequest` naming the keyword's
path inside the schema, and the router answers it as a 400 naming the user's field
(response_format / text.format / tools), before any node sees the request."""

import json

import aiohttp
import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.grammar_limits import (MAX_ENUM_VALUES, MAX_ITEMS_BOUND, MAX_LENGTH_BOUND, MAX_MASK_POSITIONS,
                                              MAX_OBJECT_PROPERTIES, MAX_PROPERTIES_BOUND, MAX_REPEAT,
                                              MAX_SCHEMA_DEPTH)
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig

MODEL = "SmolLM2-135M-Instruct"


def strings(*bounds: dict) -> dict:
    """An object whose property k<i> is a string with ``bounds[i]``."""
    return {"type": "object", "required": [f"k{i}" for i in range(len(bounds))],
            "properties": {f"k{i}": {"type": "string", **b} for i, b in enumerate(bounds)}}


def refused(**kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        StructuredOutputsParams(**kwargs).validate()
    return err.value


@pytest.mark.parametrize("schema, field, words", [
    # the issue's schema: four strings of maxLength ~1e5 (6.6 s to compile)
    (strings(*({"maxLength": 99_991 + i} for i in range(4))), "properties.k1.maxLength", "grammar positions"),
    ({"type": "string", "maxLength": MAX_LENGTH_BOUND + 1}, "maxLength", str(MAX_LENGTH_BOUND)),
    ({"type": "string", "minLength": MAX_LENGTH_BOUND + 1}, "minLength", str(MAX_LENGTH_BOUND)),
    (strings(*({"minLength": 60 + i, "maxLength": 70 + i} for i in range(6))), "properties.k3.maxLength",
     "grammar positions"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": MAX_ITEMS_BOUND + 1}, "maxItems",
     str(MAX_ITEMS_BOUND)),
    ({"type": "array", "items": {"type": "integer"}, "minItems": MAX_ITEMS_BOUND + 1}, "minItems",
     str(MAX_ITEMS_BOUND)),
    ({"type": "object", "maxProperties": MAX_PROPERTIES_BOUND + 1}, "maxProperties", str(MAX_PROPERTIES_BOUND)),
    ({"type": "object", "minProperties": MAX_PROPERTIES_BOUND + 1}, "minProperties", str(MAX_PROPERTIES_BOUND)),
    ({"type": "object", "properties": {"a": {"enum": list(range(MAX_ENUM_VALUES + 1))}}}, "properties.a.enum",
     str(MAX_ENUM_VALUES)),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_OBJECT_PROPERTIES + 1)}},
     "properties", str(MAX_OBJECT_PROPERTIES)),
    ({"type": "string", "pattern": f"a[0-9]{{{MAX_REPEAT + 1}}}"}, "pattern", str(MAX_REPEAT)),
    ({"type": "string", "pattern": ".{0,100}x.{0,100}y.{0,100}"}, "pattern", "grammar positions"),
    ({"type": "string", "pattern": "(.{0,4}){16}"}, "pattern", "variable length"),  # 15 s, though 64 positions
    ({"type": "string", "pattern": "(.?){128}"}, "pattern", "variable length"),  # 96 s
    ({"type": "string", "pattern": "(.|..|...){40}"}, "pattern", "variable length"),  # 8 s
    ({"type": "string", "pattern": "(.{0,65})+"}, "pattern", "grammar positions"),  # 3.3 s at 64
    ({"type": "string", "pattern": "[^a]" * (MAX_MASK_POSITIONS + 1)}, "pattern", "grammar positions"),
    ({"anyOf": [{"type": "string", "pattern": ".{0,10}"}, {"type": "string", "pattern": "(a|[^b]{0,300})"}]},
     "anyOf[1].pattern", "grammar positions"),
    ({"type": "object", "patternProperties": {".{0,200}.{0,100}": {"type": "integer"}}}, "patternProperties",
     "grammar positions"),
    ({"anyOf": [{"properties": {f"q{i}": {"type": "string", "format": "uri"}}} for i in range(300)]},
     "anyOf[256].properties.q256.format", "grammar positions"),  # formats compile apart: 8 ms each
    ({"$defs": {"s": {"type": "string", "maxLength": 200}},
      "properties": {"a": {"type": "string", "maxLength": 100}}}, "properties.a.maxLength", "grammar positions"),
])
def test_costly_schemas_are_refused_naming_the_keyword(schema, field, words):
    err = refused(json=schema)
    assert err.field == f"structured_outputs.json.{field}", err
    assert words in err.message, err.message
    err = refused(json=json.dumps(schema))  # the same, given as JSON text (what nodes receive)
    assert err.field == f"structured_outputs.json.{field}"


def test_deep_schemas_are_refused_not_crashing():
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    assert "deep" in refused(json=deep).message
    # JSON text nested past Python's recursion limit: a 400, not a RecursionError (a 500)
    err = refused(json="[" * 30_000 + "]" * 30_000)
    assert err.field == "structured_outputs.json"


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex=f"[0-9]{{{MAX_REPEAT + 1}}}"), "structured_outputs.regex"),
    (dict(regex="(x.{0,200}){0,2}"), "structured_outputs.regex"),
    (dict(regex="[^\"]" * 300), "structured_outputs.regex"),
    (dict(grammar='root ::= [a-z]{0,2000}'), "structured_outputs.grammar"),
    (dict(grammar='root ::= "x" ' + " ".join(f"r{i}" for i in range(40)) + "\n"
          + "\n".join(f"r{i} ::= [^\"]{{0,{10 + i}}}" for i in range(40))), "structured_outputs.grammar"),
])
def test_costly_regexes_and_grammars_are_refused(kwargs, field):
    err = refused(**kwargs)
    assert err.field == field, err
    assert any(words in err.message for words in ("grammar positions", str(MAX_REPEAT), "variable length")), err


@pytest.mark.parametrize("kwargs", [
    # 20 properties sharing one bound compile as one rule: counted once
    dict(json=strings(*({"maxLength": 100} for _ in range(20)))),
    dict(json=strings({"maxLength": 64}, {"minLength": 1, "maxLength": 80}, {"format": "email"},
                      {"pattern": r"^\d{3}-\d{4}$"}, {"enum": ["a", "b"]})),
    dict(json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 100}),
    dict(json={"type": "string", "maxLength": MAX_LENGTH_BOUND}),
    dict(json={"type": "object", "properties": {"maxLength": {"type": "string"}, "enum": {"type": "integer"}}}),
    dict(regex=r"[A-Z][a-z]{2,5} [0-9]{2}"),
    dict(json={"type": "string", "pattern": r"^(\d{3}-){2}\d{4}$"}),  # a fixed repetition inside a counted one
    dict(json={"type": "string", "pattern": r"^([a-z0-9]+\.)*[a-z]{2,}$"}),
    dict(json={"type": "string", "pattern": r"^(a|bc){64}(x?y){8}$"}),  # literals: no positions
    dict(regex="(("),  # a syntax error is xgrammar's to report ("cannot be compiled")
    dict(regex="abcdefghij" * 1000),  # literal characters cost no mask positions
    dict(grammar='root ::= "x=" [0-9] [0-9]? ";"'),
    dict(choice=["yes", "no"]),
])
def test_ordinary_constraints_pass(kwargs):
    StructuredOutputsParams(**kwargs).validate()


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url))
    yield running.url
    await running.stop()


BIG = strings(*({"maxLength": 99_991 + i} for i in range(4)))
TOOL = {"type": "function", "function": {"name": "f", "parameters": BIG}}


@pytest.mark.anyio
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG}},
                              "messages": [{"role": "user", "content": "Hi"}]},
     "response_format.json_schema.schema.properties.k1.maxLength"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "guided_json": BIG}, "guided_json.properties.k1.maxLength"),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "messages": [{"role": "user", "content": "Hi"}]},
     "tools[0].function.parameters.properties.k1.maxLength"),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required",
                              "messages": [{"role": "user", "content": "Hi"}]},
     "tools[0].function.parameters.properties.k1.maxLength"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": BIG}}},
     "text.format.schema.properties.k1.maxLength"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": ".{0,100}x.{0,100}y.{0,100}"}},
     "structured_outputs.regex"),
])
async def test_router_refuses_costly_schemas_with_a_400_naming_the_path(router, path, body, param):
    body = {"model": MODEL, **body} if path == "/v1/responses" else {"model": MODEL, "max_tokens": 4, **body}
    async with aiohttp.ClientSession() as http:
        async with http.post(router + path, json=body) as r:
            status, answer = r.status, await r.json()
    assert status == 400, answer  # a router without nodes answers 503 to what it would route
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["message"].startswith(param) and "at most" in answer["error"]["message"]

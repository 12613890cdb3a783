"""Hostile requests for the OpenAI endpoints, as hypothesis strategies, and sending one.

    fuzz_cases()            -> strategy of FuzzCase(path, body bytes, headers)
    send(host, port, case)  -> the HTTP status (reads the whole answer, streams included)

A case is mostly a plausible body with some fields replaced by hostile values: wrong
JSON types, ints beyond 64 bits (also as 400-5000 digit literals Python cannot
format), floats at the edges of double range, NaN / Infinity literals, long strings
and lists, deep nesting; sometimes a body that is no object at all, raw bytes, a
compressed body, a non-JSON content type, odd headers. Valid bodies keep max_tokens
small so a run stays short (a router with a small --max-model-len bounds the rest).

Used by bench_router_abuse.py (10k cases) and tests/test_router_fuzz.py (about 200).
Must not assert anything: callers decide what a failure is.
"""

from __future__ import annotations

import gzip
import http.client
import json
from typing import Any, NamedTuple

from hypothesis import strategies as st

from splitserve.common.chat import CHAT_ROLES

MODEL = "SmolLM2-135M-Instruct"
PATHS = ("/v1/completions", "/v1/chat/completions")
ROLES = (*CHAT_ROLES, "wizard", "")  # and two the router must refuse


class Raw(NamedTuple):
    """A JSON token written as is: a number JSON allows but Python cannot hold or print
    (5000 digits, 1e999), or a literal JSON forbids (NaN, Infinity)."""

    text: str


class FuzzCase(NamedTuple):
    path: str
    body: bytes
    headers: dict[str, str]


def to_json(value: Any) -> str:
    """JSON text of ``value``, writing `Raw` tokens verbatim (iteratively: no depth limit)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Raw):
            out.append(v.text)
        elif isinstance(v, _Text):
            out.append(v)
        elif isinstance(v, dict):
            parts: list[Any] = [_Text("}")]
            for i, (k, item) in enumerate(reversed(list(v.items()))):
                parts += [item, _Text(json.dumps(str(k)) + ":")]
                if i < len(v) - 1:
                    parts.append(_Text(","))
            stack += parts + [_Text("{")]
        elif isinstance(v, list):
            parts = [_Text("]")]
            for i, item in enumerate(reversed(v)):
                parts.append(item)
                if i < len(v) - 1:
                    parts.append(_Text(","))
            stack += parts + [_Text("[")]
        else:
            out.append(json.dumps(v, allow_nan=True))
    return "".join(out)


class _Text(str):
    """Already JSON (a bracket, a comma, a key): emitted as is by `to_json`."""


# -- values ------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
            | st.text(max_size=20))
json_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
huge_ints = (st.integers(min_value=2**63 - 2, max_value=2**200)
             | st.integers(min_value=-(2**200), max_value=-(2**63) + 2)
             | st.integers(min_value=400, max_value=5000).map(lambda n: Raw("9" * n))
             | st.integers(min_value=400, max_value=5000).map(lambda n: Raw("-" + "9" * n)))
odd_floats = (st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e9, 2.0000001, 1e-6])
              | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999",
                                 "0.0e0", "1E400"]).map(Raw))
long_strings = st.integers(min_value=200, max_value=20_000).map(lambda n: "x" * n)
deep = st.integers(min_value=20, max_value=20_000).map(lambda d: Raw("[" * d + "]" * d))
long_lists = st.integers(min_value=200, max_value=5000).map(lambda n: list(range(-7, n - 7)))
hostile = json_values | huge_ints | odd_floats | long_strings | deep | long_lists

text = st.text(max_size=40)
token_ids = st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=30)
_content = text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                   "text": text}), max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": _content}),
                    min_size=0, max_size=4)

PLAUSIBLE = {  # field -> values a client might really send
    "model": st.sampled_from([MODEL, MODEL, "gpt-4", ""]),
    "max_tokens": st.integers(min_value=0, max_value=8),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0, max_value=1),
    "top_k": st.integers(min_value=-2, max_value=100),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
    "stop": text | st.lists(text, max_size=4),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=50_000), max_size=4),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "n": st.sampled_from([1, 1, 2]),
    "logit_bias": st.none() | st.dictionaries(st.text(max_size=4) | st.integers(0, 50_000).map(str),
                                              st.integers(-100, 100), max_size=2),
    "min_tokens": st.none() | st.integers(min_value=-1, max_value=10),
    "prompt_logprobs": st.none() | st.integers(min_value=0, max_value=3),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": text,
}
COMPLETION = {
    "prompt": text | token_ids | st.lists(text, min_size=1, max_size=3)
    | st.lists(token_ids, min_size=1, max_size=3),
    "logprobs": st.none() | st.integers(min_value=0, max_value=5),
    "echo": st.booleans(),
    "best_of": st.none() | st.sampled_from([1, 2]),
}
CHAT = {
    "messages": messages,
    "max_completion_tokens": st.integers(min_value=0, max_value=8),
    "logprobs": st.booleans(),
    "top_logprobs": st.none() | st.integers(min_value=0, max_value=5),
    "tools": st.none() | st.just([]),
    "response_format": st.none() | st.just({"type": "text"}),
}


def _field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes a hostile one."""
    return st.one_of(plausible, plausible, plausible, hostile)


def _body(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy:
    optional = {k: _field(v) for k, v in fields.items() if k != required}
    return st.builds(lambda body, extra: {**extra, **body},
                     st.fixed_dictionaries({required: _field(fields[required])}, optional=optional),
                     st.dictionaries(st.text(max_size=10), hostile, max_size=2))


completion_bodies = _body({**PLAUSIBLE, **COMPLETION}, "prompt")
chat_bodies = _body({**PLAUSIBLE, **CHAT}, "messages")

VALID = {  # in range: these bodies generate (a few tokens)
    "max_tokens": st.integers(min_value=1, max_value=8),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=50),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=49_151), max_size=3),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "stream": st.booleans(),
    "user": text,
}
valid_completions = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=40) | token_ids},
    optional={**VALID, "logprobs": st.integers(min_value=0, max_value=5)})
valid_chats = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": text}), min_size=1, max_size=3),
     "max_completion_tokens": st.integers(min_value=1, max_value=8)},
    optional={**VALID, "logprobs": st.booleans()})

# -- whole requests ----------------------------------------------------------------

_header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)
_header_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=30)
CONTENT_TYPES = ["application/json", "application/json", "application/json",
                 "application/json; charset=utf-8", "text/plain", "", "application/x-www-form-urlencoded",
                 "application/json; charset=latin-1", "application/problem+json", "*/*"]


@st.composite
def fuzz_cases(draw) -> FuzzCase:
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["matching"] * 5 + ["valid"] * 3
                                + ["crossed", "any_json", "raw_bytes", "truncated"]))
    chat = path.endswith("chat/completions")
    if kind == "valid":
        body = to_json(draw(valid_chats if chat else valid_completions)).encode()
    elif kind == "matching":
        body = to_json(draw(chat_bodies if chat else completion_bodies)).encode()
    elif kind == "crossed":
        body = to_json(draw(completion_bodies if chat else chat_bodies)).encode()
    elif kind == "any_json":
        body = to_json(draw(json_values | hostile)).encode()
    elif kind == "raw_bytes":
        body = draw(st.binary(max_size=200))
    else:
        whole = to_json(draw(chat_bodies if chat else completion_bodies)).encode()
        body = whole[:draw(st.integers(min_value=0, max_value=max(0, len(whole) - 1)))]
    json_type = kind == "valid" or draw(st.integers(min_value=0, max_value=3)) > 0
    headers = {"Content-Type": "application/json" if json_type
               else draw(st.sampled_from(CONTENT_TYPES))}
    encoding = None if kind == "valid" else draw(st.sampled_from(
        [None] * 8 + ["gzip", "br", "identity", "x-unknown"]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if encoding == "gzip":
            body = gzip.compress(body)
    if draw(st.booleans()):
        headers["X-Request-Id"] = draw(_header_text)
    if kind != "valid" and draw(st.integers(min_value=0, max_value=4)) == 0:
        headers["Authorization"] = "Bearer " + draw(_header_text)
    for name, value in draw(st.dictionaries(_header_name, _header_text, max_size=3)).items():
        if name.lower() not in ("content-length", "transfer-encoding", "host", "connection",
                                "expect", "content-encoding", "content-type"):
            headers["X-Fuzz-" + name] = value
    return FuzzCase(path, body, headers)


def send(host: str, port: int, case: FuzzCase, timeout_s: float = 60.0) -> int:
    """POST ``case``; the status after reading the whole answer (a stream to its end)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", case.path, body=case.body, headers=case.headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()

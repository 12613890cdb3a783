"""One streamed request against an OpenAI-compatible endpoint, timed.

    send ----- first content chunk ---- chunk ---- chunk ... ---- usage ---- [DONE]
    |<-- ttft -->|<-- itl[0] -->|<- itl[1] ->|
    |<------------------------------- e2e ------------------------------------>|

TTFT is taken at the first chunk that carries text (a chat stream's opening role
chunk carries none). Output tokens come from the final ``usage`` chunk
(``stream_options.include_usage``): one chunk may carry several tokens, or none
while the detokenizer holds back a partial character. Without usage (llama-cpp-python
sends none) a request that ended with finish_reason "length" produced exactly
max_tokens tokens; any other is counted by its text chunks, a lower bound.

A stream that ends without ``data: [DONE]`` failed. Failures are returned, not
raised; only `check_endpoint` raises (`EndpointError`), before a run starts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import aiohttp

from .datasets import RequestSpec


class EndpointError(Exception):
    """The endpoint cannot be used: down, wrong URL, or it does not serve the model."""


class Endpoint(NamedTuple):
    base_url: str  # .../v1
    model: str
    endpoint_type: str  # chat | completions
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    send_text: bool = False  # completions: decode token-id prompts to text first

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestResult:
    tag: str
    prompt_len: int  # as built
    max_tokens: int
    ok: bool = False
    error: str = ""
    start_s: float = 0.0  # sent, seconds from the start of the run
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0  # from usage (prompt_len without it)
    output_tokens: int = 0  # from usage (content chunks without it)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    content_chunks: int = 0
    finish_reason: str | None = None
    usage_reported: bool = False
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def check_endpoint(base_url: str, model: str | None, api_key: str | None = None,
                         timeout_s: float = 10.0) -> str:
    """The model to ask for (``model``, or the first one listed); raises `EndpointError`
    with one line saying what is wrong."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"{base_url}/models", headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise EndpointError(f"{base_url}/models answered HTTP {r.status}: "
                                    f"{(await r.text())[:200]}")
            listed = [m.get("id") for m in (await r.json()).get("data", [])]
    except aiohttp.ClientConnectorError as e:
        raise EndpointError(f"cannot connect to {base_url} ({e.os_error or e}); is the server "
                            "running? Check --base-url") from None
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, AttributeError) as e:
        raise EndpointError(f"{base_url}/models did not answer as an OpenAI endpoint: "
                            f"{type(e).__name__}: {e}") from None
    if model is None:
        if not listed:
            raise EndpointError(f"{base_url}/models lists no model; pass --model")
        return listed[0]
    if model not in listed:
        raise EndpointError(f"the endpoint does not serve model {model!r}; it lists {listed}")
    return model


def _payload(ep: Endpoint, spec: RequestSpec, tok_decode) -> dict:
    prompt = spec.prompt
    if not isinstance(prompt, str) and (ep.endpoint_type == "chat" or ep.send_text):
        prompt = tok_decode(prompt)
    body = {"model": ep.model, "max_tokens": spec.output_len, "temperature": ep.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ep.ignore_eos:  # vLLM and splitserve read ignore_eos, llama-cpp-python min_tokens
        body["ignore_eos"] = True
        body["min_tokens"] = spec.output_len
    if ep.endpoint_type == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send_request(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec,
                       t0: float, tok_decode, timeout_s: float = 600.0) -> RequestResult:
    """Stream ``spec`` to the endpoint; ``t0`` is the run's start (perf_counter)."""
    res = RequestResult(spec.tag, spec.prompt_len, spec.output_len)
    path = "/chat/completions" if ep.endpoint_type == "chat" else "/completions"
    body = _payload(ep, spec, tok_decode)
    start = time.perf_counter()
    res.start_s = start - t0
    last, pieces, done = None, [], False
    try:
        async with session.post(ep.base_url + path, json=body, headers=ep.headers(),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            buf = b""
            async for data in r.content.iter_any():
                now = time.perf_counter()
                buf += data
                *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                for ev in events:
                    payload = _data(ev)
                    done = done or payload == "[DONE]"
                    if payload is None or payload == "[DONE]":
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        res.error = f"error event: {obj['error']}"[:300]
                        return res
                    text = _text(obj, ep.endpoint_type)
                    res.finish_reason = _finish_reason(obj) or res.finish_reason
                    if text:
                        if last is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.content_chunks += 1
                        pieces.append(text)
                    if obj.get("usage"):
                        _read_usage(res, obj["usage"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e_s = time.perf_counter() - start
    if not done:
        res.error = "the stream ended without data: [DONE]"
        return res
    res.ok = True
    res.text = "".join(pieces)
    if last is None:  # nothing but empty text: the first token is the end
        res.ttft_s = res.e2e_s
    if not res.usage_reported:
        res.prompt_tokens = spec.prompt_len
        res.output_tokens = spec.output_len if res.finish_reason == "length" else res.content_chunks
    return res


def _data(event: bytes) -> str | None:
    lines = [ln[5:].strip() for ln in event.decode().split("\n") if ln.startswith("data:")]
    return "\n".join(lines) if lines else None


def _text(obj: dict, endpoint_type: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if endpoint_type == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _finish_reason(obj: dict) -> str | None:
    choices = obj.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def _read_usage(res: RequestResult, usage: dict) -> None:
    res.usage_reported = True
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = int(details.get("cached_tokens") or 0)

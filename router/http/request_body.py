"""The body of a generating request, before any JSON is parsed.

    Content-Type not JSON                -> 415 (application/json or any */*+json)
    Content-Encoding other than identity -> 415 with "Accept-Encoding: identity":
                                            compressed bodies are refused, never
                                            inflated (no decompression bomb to cap;
                                            app.py turns aiohttp's auto-decompression off)
    Content-Length over the limit        -> 413 before reading; a chunked body
                                            over it -> 413 as soon as it passes it
    body not received within the timeout -> 408, connection closed
    body broken (bad chunking, cut short) -> 400, connection closed

and where the body's preparation (parse, render, tokenize) runs: ``off_loop`` puts a
large body's on a worker thread, so a long prompt never stalls the event loop that
streams every other request.

Must not parse the JSON (prepare.py does) or know the endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from ..errors import ApiError

T = TypeVar("T")


def check_headers(request: web.Request, limit: int) -> None:
    """The checks that need no body: 415 (type, encoding) and 413 (declared length)."""
    ctype = request.content_type  # lower case, parameters stripped; absent: octet-stream
    if not (ctype == "application/json" or (ctype.startswith("application/")
                                            and ctype.endswith("+json"))):
        given = request.headers.get("Content-Type")
        raise ApiError(415, "Content-Type: must be application/json, got "
                       + (repr(given[:100]) if given else "none"), param="Content-Type")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding: {encoding[:100]!r} is not accepted; send the "
                       "body uncompressed", param="Content-Encoding",
                       headers={"Accept-Encoding": "identity"})
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The checked body: `check_headers`, then at most ``limit`` bytes within ``timeout_s``."""
    check_headers(request, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()  # the app's client_max_size is ``limit``
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except web.RequestPayloadError as e:  # a broken chunked encoding, a short body
        raise ApiError(400, f"the request body could not be read: {e}",
                       close_connection=True) from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                       close_connection=True) from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes")


async def off_loop(body: bytes, threshold: int, prepare: Callable[..., T], *args, size: int | None = None) -> T:
    """``prepare(body, *args)``: inline for a body of at most ``threshold`` bytes
    (RouterConfig.prepare_thread_bytes), on a worker thread for a larger one (a 100k-token
    prompt takes ~0.5 s to render and tokenize; a thread hand-off costs ~0.1 ms). ``size``:
    the work's size in bytes when it is more than the body's (a stored conversation the
    body continues: a tiny body may stand for a 100k-token prompt)."""
    if (len(body) if size is None else size) > threshold:
        return await asyncio.to_thread(prepare, body, *args)
    return prepare(body, *args)

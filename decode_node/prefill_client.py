"""The decode node's HTTP client to prefill nodes: ask for a prefill, abort one.

Owns the wire side of the transfer's control path: ``POST {node}/prefill``
(msgpack `PrefillRequest`) answered by a msgpack `PrefillResult` once every block
was handed to the transport, or by an error status with a msgpack `ErrorBody`;
``POST {node}/abort`` (msgpack `Abort`, idempotent). The cluster token, when there
is one, goes in the session's headers. Every failure of a prefill call becomes
`PrefillFailed` (a `TransferError`: the decode node prefills the request itself);
an abort never raises. Shaped like router/streams/node_client.py, the router's client to
decode nodes.

Must not own the `aiohttp.ClientSession` (the decode node's lifecycle does),
change a transfer's state, or decide a fallback.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import msgspec

from ..common.http import MSGPACK, read_error_body
from ..common.protocol import GRAMMAR_NOT_COMPILED, Abort, PrefillRequest, PrefillResult
from ..kvtransfer.errors import TransferError

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


class PrefillFailed(TransferError):
    """The prefill node could not be reached, answered an error, or sent a bad answer."""


class PrefillGrammarMissing(PrefillFailed):
    """The prefill node holds the request's grammar neither compiled nor compiling, and the
    request may not compile it (``compile_grammar`` false): it compiled nothing."""


@dataclass(slots=True)
class PrefillClient:
    session: aiohttp.ClientSession  # the decode node's, with the cluster token in its headers

    async def prefill(self, addr: str, task: PrefillRequest) -> PrefillResult:
        """Run ``task`` on the prefill node at ``addr``; its answer once every block was
        sent. Raises `PrefillFailed`; cancelling the call hangs up on the node (its
        handler stops sending)."""
        try:
            async with self.session.post(f"{addr}/prefill", data=msgspec.msgpack.encode(task),
                                         headers={"Content-Type": MSGPACK}) as r:
                body = await r.read()
                if r.status != 200:
                    error = read_error_body(body)
                    failed = (PrefillGrammarMissing if r.status == 409 and error.type == GRAMMAR_NOT_COMPILED
                              else PrefillFailed)
                    raise failed(f"prefill node answered {r.status}: {error.message}")
            return msgspec.msgpack.decode(body, type=PrefillResult)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise PrefillFailed(f"prefill node {addr}: {type(e).__name__}: {e}") from e
        except msgspec.DecodeError as e:
            raise PrefillFailed(f"prefill node {addr} sent a bad answer: {e}") from e

    async def abort(self, addr: str, request_id: str) -> bool:
        """Abort ``request_id`` on the prefill node; True if it confirmed. Never raises:
        a node that cannot be reached holds nothing of ours any more (its handler ends
        when our call hangs up)."""
        try:
            async with self.session.post(f"{addr}/abort", data=msgspec.msgpack.encode(Abort(request_id)),
                                         headers={"Content-Type": MSGPACK},
                                         timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as r:
                await r.read()
                return r.status < 300
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            log.debug("abort of %s on %s: the prefill node did not answer", request_id, addr)
            return False

"""HTTP helpers shared by the node servers: msgpack bodies in and out, and error
answers as ``ErrorBody``; and the client connector to peers that notices a dead or
partitioned peer. No torch, no engine."""

import socket

import aiohttp
import msgspec
from aiohttp import web

from .errors import InvalidRequest
from .protocol import ErrorBody

MSGPACK = "application/msgpack"
# A connection whose peer stays silent this long is dead: sent data unacknowledged
# (TCP_USER_TIMEOUT) or an idle or streaming connection whose keepalive probes go
# unanswered. A live peer's kernel acknowledges even when its process is busy, so only
# a dead host or a partition trips it; without it a request written to a pooled
# connection into a partition waits for the read timeout (minutes).
PEER_DEAD_AFTER_S = 5


def msgpack_response(msg, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.msgpack.encode(msg), status=status, content_type=MSGPACK)


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return msgpack_response(ErrorBody(message=message, param=param, type=kind), status)


async def read_msgpack(request: web.Request, type_):
    """Decode the body as ``type_``; raise InvalidRequest naming the field on bad input."""
    try:
        return msgspec.msgpack.decode(await request.read(), type=type_)
    except msgspec.ValidationError as e:
        path = str(e).rsplit("at `$.", 1)
        raise InvalidRequest(path[1].rstrip("`") if len(path) == 2 else "body", str(e)) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest("body", f"not valid msgpack: {e}") from None


def read_error_body(data: bytes) -> ErrorBody:
    """A node's ErrorBody, or one holding the raw text when it is not one."""
    try:
        return msgspec.msgpack.decode(data, type=ErrorBody)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ErrorBody(message=data[:200].decode(errors="replace"), type="upstream_error")


def decode_error_body(data: bytes) -> str:
    """The message of a node's ErrorBody, or the raw text when it is not one."""
    return read_error_body(data).message


def _peer_socket(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, PEER_DEAD_AFTER_S * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, PEER_DEAD_AFTER_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    return sock


def peer_connector(limit: int = 100) -> aiohttp.TCPConnector:
    """A connector for a service's client session to its peers: a dead or partitioned
    peer fails the request within about ``PEER_DEAD_AFTER_S`` (an OSError in aiohttp)."""
    return aiohttp.TCPConnector(limit=limit, socket_factory=_peer_socket)

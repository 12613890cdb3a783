"""HTTP helpers shared by the node servers: msgpack bodies in and out, and error
answers as ``ErrorBody``. No torch, no engine."""

import msgspec
from aiohttp import web

from .errors import InvalidRequest
from .protocol import ErrorBody

MSGPACK = "application/msgpack"


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


def decode_error_body(data: bytes) -> str:
    """The message of a node's ErrorBody, or the raw text when it is not one."""
    try:
        return msgspec.msgpack.decode(data, type=ErrorBody).message
    except (msgspec.DecodeError, msgspec.ValidationError):
        return data[:200].decode(errors="replace")

"""OpenAI-style error answers of the router.

Owns `ApiError` (an error with its HTTP status, raised anywhere in a handler) and
the JSON body every error answer carries::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Must not decide which inputs are bad (request parsing does) or log (the middleware
in app.py does).
"""

from __future__ import annotations

import json

from aiohttp import web

from ..common.errors import InvalidRequest

# HTTP status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class ApiError(Exception):
    """An error answer: raise it from a handler; the middleware turns it into JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None, close_connection: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}  # extra response headers: Retry-After, WWW-Authenticate
        self.close_connection = close_connection  # no keep-alive after this answer
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500
                                        else "internal_error")

    @classmethod
    def invalid(cls, e: InvalidRequest) -> ApiError:
        return cls(400, f"{e.field}: {e.message}", param=e.field)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, headers: dict | None = None) -> web.Response:
        resp = web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json",
                            headers={**self.headers, **(headers or {})})
        if self.close_connection:
            resp.force_close()
        return resp


def sse_error(err: ApiError) -> bytes:
    """An error as an SSE event, for a stream that already answered 200."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"

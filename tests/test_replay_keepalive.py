"""The replay client never reuses a connection the server is closing: a server closes
a connection idle for its keep-alive time (the router: its header timeout), and a
request sent on one at that moment fails with ServerDisconnectedError without reaching
it (the 2 failed requests of the 64-node long-context replay). The replay's client
drops idle connections earlier, so requests spaced right around the server's
keep-alive all succeed; with aiohttp's default 15 s, some of them fail."""

import asyncio
import json

import pytest
from aiohttp import web

from splitserve.benchmarks.loadgen.replay.run import KEEPALIVE_S, client_session, send
from splitserve.router.config import RouterConfig

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SERVER_KEEPALIVE_S = 0.2


async def completions(request: web.Request) -> web.StreamResponse:
    await request.read()
    r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await r.prepare(request)
    await r.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    await r.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    return r


async def test_idle_connections_are_dropped_before_the_server_closes_them():
    assert KEEPALIVE_S < RouterConfig().keepalive_timeout_s  # the router's keep-alive
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, keepalive_timeout=SERVER_KEEPALIVE_S)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with client_session(url, keepalive_s=SERVER_KEEPALIVE_S / 2) as session:
            errors = []
            for i in range(40):  # idle for just under to just over the server's keep-alive
                out = await send(session, "", "m", [1, 2, 3], 1)
                if not out.ok:
                    errors.append(out.error)
                await asyncio.sleep(SERVER_KEEPALIVE_S - 0.01 + (i % 20) * 0.001)
        assert errors == []
    finally:
        await runner.cleanup()

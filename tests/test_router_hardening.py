"""The router against hostile clients, in-process on real sockets with a real
redis-server and no nodes: 415 for non-JSON and compressed bodies, 400 for deep
nesting, a bounded /debug/decisions, API keys (401), admission (429 over
--max-inflight, 503 while draining, both with Retry-After), the header timeout
(slowloris), the body timeout (408), the connection cap (503), and Redis URLs with
a password, an ACL user and TLS."""

import asyncio
import gzip
import json
import logging
import socket
import subprocess
import time
import zlib

import aiohttp
import openai
import pytest

from splitserve.common.auth import CLUSTER_TOKEN_ENV, redact_url
from splitserve.common.kv_index import IndexDelta, KVIndex
from splitserve.deploy.launcher import free_port
from splitserve.router.api_keys import derived_salt
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig, add_router_args, router_config

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
KEYS = ("key-one-0123456789", "key-two-0123456789")


def config(redis_url: str, **kw) -> RouterConfig:
    return RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, **kw)


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(config(redis_url))
    yield running.url
    await running.stop()


async def request(http, method: str, url: str, data: bytes = b"", headers=None):
    async with http.request(method, url, data=data, headers=headers or {}) as resp:
        return resp.status, await resp.json(), resp.headers


def assert_error(status, body, want_status, param=None, code=None):
    assert status == want_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code


# -- body checks --------------------------------------------------------------------


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonx"])
async def test_non_json_content_type_is_415(router, http, ctype):
    headers = {"Content-Type": ctype} if ctype else {"Content-Type": ""}
    status, body, _ = await request(http, "POST", router + "/v1/completions",
                                    json.dumps(BODY).encode(), headers)
    assert_error(status, body, 415, "Content-Type")


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "APPLICATION/JSON",
                                   "application/vnd.api+json"])
async def test_json_content_types_are_accepted(router, http, ctype):
    status, body, headers = await request(http, "POST", router + "/v1/completions",
                                          json.dumps(BODY).encode(), {"Content-Type": ctype})
    assert_error(status, body, 503, code="no_decode_node")  # past every check; no node
    assert headers["Retry-After"] == "1"


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                               ("br", lambda b: b"\x0b\x02\x80" + b),
                                               ("GZIP", gzip.compress)])
async def test_compressed_body_is_415(router, http, encoding, compress):
    status, body, headers = await request(
        http, "POST", router + "/v1/chat/completions",
        compress(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()),
        {"Content-Type": "application/json", "Content-Encoding": encoding})
    assert_error(status, body, 415, "Content-Encoding")
    assert headers["Accept-Encoding"] == "identity"


@pytest.mark.parametrize("depth", [33, 1000, 10_000, 100_000])
async def test_deep_nesting_is_400(router, http, depth):
    raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "extra": ' + b"[" * depth \
        + b"]" * depth + b"}"
    status, body, _ = await request(http, "POST", router + "/v1/completions", raw,
                                    {"Content-Type": "application/json"})
    assert status == 400, body
    assert "nested deeper than 32 levels" in body["error"]["message"]
    # beyond msgspec's own recursion guard the path is unknown: "body"
    assert body["error"]["param"].startswith("extra" if depth < 1000 else ("extra", "body"))


async def test_huge_numbers_in_any_field_are_400_naming_it(router, http):
    digits = b"9" * 400  # decodes to a Python int that msgpack cannot encode
    for field, value in [(b"top_k", digits), (b"n", b"-" + digits), (b"seed", digits),
                         (b"stop_token_ids", b"[1, " + digits + b"]"), (b"unknown", digits)]:
        raw = b'{"prompt": "x", "' + field + b'": ' + value + b"}"
        status, body, _ = await request(http, "POST", router + "/v1/completions", raw,
                                        {"Content-Type": "application/json"})
        want = field.decode() + ("[1]" if field == b"stop_token_ids" else "")
        assert_error(status, body, 400, want)
    raw = b'{"prompt": "x", "top_k": ' + b"9" * 5000 + b"}"  # beyond what msgspec decodes
    status, body, _ = await request(http, "POST", router + "/v1/completions", raw,
                                    {"Content-Type": "application/json"})
    assert_error(status, body, 400, None)


async def test_body_read_timeout_is_408(redis_url):
    running = await start_router(config(redis_url, body_timeout_s=0.5))
    try:
        host, port = running.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # the router closes after answering
        writer.close()
    finally:
        await running.stop()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 0.5 s" in answer


# -- /debug/decisions ---------------------------------------------------------------


@pytest.mark.parametrize("limit", ["-1", "abc", "257", "1e3", "9" * 5000, "\u00b2", ""])
async def test_decisions_limit_is_range_checked(router, http, limit):
    status, body, _ = await request(http, "GET", f"{router}/debug/decisions?limit={limit}")
    assert_error(status, body, 400, "limit")


@pytest.mark.parametrize("limit", ["0", "256", "007"])
async def test_decisions_limit_in_range(router, http, limit):
    status, body, _ = await request(http, "GET", f"{router}/debug/decisions?limit={limit}")
    assert status == 200 and body == {"decisions": []}


# -- API keys -----------------------------------------------------------------------


@pytest.fixture(scope="module")
async def keyed_router(redis_url):
    running = await start_router(config(redis_url, api_keys=KEYS))
    yield running.url
    await running.stop()


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                                         ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"),
                                         ("GET", "/debug/decisions"), ("GET", "/v2/unknown")])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key-0123456789", "Basic a2V5",
                                           "Bearer", f"Token {KEYS[0]}", f"Bearer {KEYS[0]}x"])
async def test_without_a_valid_key_is_401(keyed_router, http, method, path, authorization):
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    status, body, resp_headers = await request(http, method, keyed_router + path,
                                               json.dumps(BODY).encode(), headers)
    assert_error(status, body, 401, code="invalid_api_key")
    assert body["error"]["type"] == "invalid_request_error"
    assert resp_headers["WWW-Authenticate"] == "Bearer"
    assert KEYS[0] not in body["error"]["message"]


async def test_every_configured_key_works(keyed_router, http):
    for key in KEYS:
        status, body, _ = await request(http, "GET", keyed_router + "/v1/models",
                                        headers={"Authorization": f"bearer  {key} "})
        assert status == 200 and body["data"][0]["id"] == MODEL
        status, body, _ = await request(http, "POST", keyed_router + "/v1/completions",
                                        json.dumps(BODY).encode(),
                                        {"Authorization": f"Bearer {key}",
                                         "Content-Type": "application/json"})
        assert_error(status, body, 503, code="no_decode_node")  # authenticated; no node


async def test_health_and_metrics_are_open_unless_protected(keyed_router, http, redis_url):
    async with http.get(keyed_router + "/health") as resp:
        assert resp.status == 503  # open: answers (no decode node), not 401
    async with http.get(keyed_router + "/metrics") as resp:
        assert resp.status == 200
    running = await start_router(config(redis_url, api_keys=KEYS, protect_health=True,
                                        protect_metrics=True))
    try:
        for path in ("/health", "/metrics"):
            async with http.get(running.url + path) as resp:
                assert resp.status == 401
            async with http.get(running.url + path,
                                headers={"Authorization": f"Bearer {KEYS[1]}"}) as resp:
                assert resp.status in (200, 503)
    finally:
        await running.stop()


async def test_openai_client_with_and_without_key(keyed_router):
    async with openai.AsyncOpenAI(base_url=keyed_router + "/v1", api_key="nope-nope-nope",
                                  max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as exc:
            await bad.models.list()
        assert exc.value.body["code"] == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=keyed_router + "/v1", api_key=KEYS[0],
                                  max_retries=0) as good:
        assert [m.id for m in (await good.models.list()).data] == [MODEL]


# -- configuration ------------------------------------------------------------------


def parse(argv) -> RouterConfig:
    import argparse
    p = argparse.ArgumentParser()
    add_router_args(p)
    return router_config(p.parse_args(argv))


def keys_of(c: RouterConfig) -> tuple[str, ...]:
    assert all(k.cache_salt == derived_salt(c.cluster_token, k.key) for k in c.api_keys)  # none given
    return tuple(k.key for k in c.api_keys)


def test_router_defaults_to_loopback_and_no_key(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    c = parse([])
    assert c.host == "127.0.0.1" and c.api_keys == () and c.cluster_token is None
    assert not c.exposed_without_key
    assert parse(["--host", "0.0.0.0"]).exposed_without_key
    assert not parse(["--host", "0.0.0.0", "--api-key", KEYS[0]]).exposed_without_key
    assert "key-one" not in repr(parse(["--api-key", KEYS[0]]))  # secrets stay out of logs


def test_keys_and_token_from_flags_files_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_API_KEY", f" {KEYS[0]} \n{KEYS[1]}")  # one spec per line
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "env-token-0123456789")
    c = parse([])
    assert keys_of(c) == KEYS and c.cluster_token == "env-token-0123456789"
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS[1]}\n\n{KEYS[0]}\n")
    token = tmp_path / "token"
    token.write_text("file-token-0123456789\n")
    c = parse(["--api-key-file", str(keys), "--cluster-token-file", str(token)])
    assert keys_of(c) == (KEYS[1], KEYS[0]) and c.cluster_token == "file-token-0123456789"
    c = parse(["--api-key", "flag-key-0123456789", "--cluster-token", "flag-token-0123456789"])
    assert keys_of(c) == ("flag-key-0123456789",) and c.cluster_token == "flag-token-0123456789"
    for argv, what in [(["--api-key", "short"], "api key"),
                       (["--cluster-token", "short"], "cluster token"),
                       (["--cluster-token-file", str(tmp_path / "missing")], "cluster token"),
                       (["--protect-metrics"], "protect_metrics")]:
        monkeypatch.delenv("SPLITSERVE_API_KEY")
        with pytest.raises(ValueError, match=what):
            parse(argv)
        monkeypatch.setenv("SPLITSERVE_API_KEY", KEYS[0])


async def test_binding_beyond_loopback_without_key_warns(redis_url, caplog):
    with caplog.at_level(logging.WARNING, logger="splitserve.router"):
        running = await start_router(RouterConfig(host="0.0.0.0", port=0, redis_url=redis_url))
        await running.stop()
    assert any("NO API KEY" in r.getMessage() for r in caplog.records)


# -- admission and drain ------------------------------------------------------------


async def until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def hold_open(url: str, path="/v1/completions"):
    """A generating request whose body never finishes: it stays in flight."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n{".encode())
    await writer.drain()
    return reader, writer


async def test_over_max_inflight_is_429_then_recovers(redis_url, http):
    running = await start_router(config(redis_url, max_inflight=2))
    try:
        held = [await hold_open(running.url) for _ in range(2)]
        await until(lambda: running.admission.inflight == 2)  # both reached the handler
        status, body, headers = await request(http, "POST", running.url + "/v1/completions",
                                              json.dumps(BODY).encode(),
                                              {"Content-Type": "application/json"})
        assert_error(status, body, 429, code="too_many_requests")
        assert headers["Retry-After"] == "1"
        async with http.get(running.url + "/v1/models") as resp:
            assert resp.status == 200  # only generating requests count
        for _, writer in held:
            writer.close()
        await until(lambda: running.admission.inflight == 0)
        status, body, _ = await request(http, "POST", running.url + "/v1/completions",
                                        json.dumps(BODY).encode(),
                                        {"Content-Type": "application/json"})
        assert_error(status, body, 503, code="no_decode_node")
        async with http.get(running.url + "/metrics") as resp:
            assert ('splitserve:router_admission_rejections_total{model_name="%s",reason="busy"} 1.0'
                    % MODEL) in await resp.text()
    finally:
        await running.stop()


async def test_drain_refuses_new_requests_and_waits_for_inflight(redis_url, http):
    running = await start_router(config(redis_url))
    try:
        reader, writer = await hold_open(running.url)
        await until(lambda: running.admission.inflight == 1)
        assert not await running.drain(0.3)  # the held request is still in flight
        status, body, headers = await request(http, "POST", running.url + "/v1/completions",
                                              json.dumps(BODY).encode(),
                                              {"Content-Type": "application/json"})
        assert_error(status, body, 503, code="draining")
        assert headers["Retry-After"] == "1"
        async with http.get(running.url + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "draining"
        async with http.get(running.url + "/metrics") as resp:
            assert resp.status == 200
        drained = asyncio.create_task(running.drain(10))
        writer.write(b" " * 999)  # the held request completes (a 400: not JSON)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 400")
        assert await asyncio.wait_for(drained, 15)
        writer.close()
    finally:
        await running.stop()


# -- slow clients and the connection cap ---------------------------------------------


async def test_slowloris_connections_are_closed_at_the_header_timeout(redis_url, http):
    running = await start_router(config(redis_url, header_timeout_s=1.0))
    host, port = running.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()

    async def slow_client() -> float:
        """Sends a header byte every 0.2 s; returns the seconds until the router closed."""
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = loop.time()
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for _ in range(100):
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.2)
                if reader.at_eof():
                    break
                try:
                    await asyncio.wait_for(reader.read(1), 0.01)
                except asyncio.TimeoutError:
                    pass
        except ConnectionError:
            pass
        finally:
            writer.close()
        return loop.time() - t0

    try:
        slow = [loop.create_task(slow_client()) for _ in range(20)]
        for _ in range(5):  # normal requests keep working meanwhile
            async with http.get(running.url + "/v1/models") as resp:
                assert resp.status == 200
        closed_after = await asyncio.gather(*slow)
    finally:
        await running.stop()
    assert all(0.8 < t < 6 for t in closed_after), closed_after


async def test_an_idle_connection_outlives_the_header_timeout_and_a_late_trickle_does_not(redis_url):
    """Keep-alive and header timeout are apart: a connection idle for longer than the
    header timeout still serves its next request (a client pooling connections for 15 s
    must not race the router closing them), a new connection that sends nothing is
    closed at the header timeout, and headers trickled after an idle spell are cut the
    header timeout after their first byte."""
    running = await start_router(config(redis_url, header_timeout_s=0.5, keepalive_timeout_s=30))
    host, port = running.url.removeprefix("http://").split(":")
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

    async def answer(reader) -> bytes:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await asyncio.wait_for(reader.readexactly(length), 5)
        return head

    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        for _ in range(2):  # the same socket, idle 3x the header timeout in between
            writer.write(request)
            assert (await answer(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(1.5)
        # headers trickled after the idle spell: closed ~0.5 s after their first byte
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        writer.write(b"GET /v1/models HTTP/1.1\r\n")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            for _ in range(40):
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    raise ConnectionResetError
        assert 0.3 < loop.time() - t0 < 2.5
        writer.close()
        silent_reader, silent = await asyncio.open_connection(host, int(port))
        t0 = loop.time()
        assert await asyncio.wait_for(silent_reader.read(), 5) == b""  # closed, nothing sent
        assert 0.3 < loop.time() - t0 < 2.5
        silent.close()
    finally:
        await running.stop()


async def test_connections_over_the_cap_get_503(redis_url):
    running = await start_router(config(redis_url, max_connections=4, header_timeout_s=30))
    host, port = running.url.removeprefix("http://").split(":")
    try:
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"Retry-After: 1" in answer and b"too_many_connections" in answer
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as http:
            async with http.get(running.url + "/v1/models") as resp:
                assert resp.status == 200
    finally:
        await running.stop()


# -- Redis with a password, an ACL user and TLS ----------------------------------------


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory):
    """redis-server with a password, an ACL user and TLS only (no plain port);
    (port, folder with the self-signed cert)."""
    folder = tmp_path_factory.mktemp("redis_tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", folder / "cert.pem", "--tls-key-file", folder / "key.pem",
         "--tls-ca-cert-file", folder / "cert.pem", "--tls-auth-clients", "no",
         "--requirepass", "default-pass-123", "--user", "alice", "on", ">alice-pass-123",
         "~*", "&*", "+@all", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port, folder
    proc.kill()
    proc.wait()


async def test_redis_urls_with_password_acl_user_and_tls(secure_redis, http, caplog):
    port, folder = secure_redis
    ca = f"ssl_ca_certs={folder / 'cert.pem'}"
    good = [f"rediss://alice:alice-pass-123@127.0.0.1:{port}/0?{ca}",
            f"rediss://:default-pass-123@127.0.0.1:{port}/0?{ca}"]
    bad = [f"rediss://alice:wrong-pass@127.0.0.1:{port}/0?{ca}",
           f"redis://alice:alice-pass-123@127.0.0.1:{port}/0"]  # no TLS
    for url in good:
        index = KVIndex(url)
        try:  # the prefix-index client: a Lua script and a read, authenticated
            assert await asyncio.wait_for(index.apply("n1", "e1", IndexDelta.full([11, 12]), seq=1), 10)
            assert await asyncio.wait_for(index.members("n1", "e1"), 10) == {11, 12}
        finally:
            await index.close()
    for url, ok in [(u, True) for u in good] + [(u, False) for u in bad]:
        with caplog.at_level(logging.INFO, logger="splitserve.router"):
            running = await asyncio.wait_for(start_router(config(url, poll_interval_s=0.1)), 30)
        try:
            async with http.get(running.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                assert (await resp.json())["redis"] == ("ok" if ok else "unreachable"), url
        finally:
            await asyncio.wait_for(running.stop(), 30)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "pass-123" not in logged and "alice:***@" in logged


def test_redact_url():
    assert redact_url("rediss://alice:s3cret@h:6380/0?x=1") == "rediss://alice:***@h:6380/0?x=1"
    assert redact_url("redis://:s3cret@h/0") == "redis://:***@h/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


# -- the cluster token on internal requests ------------------------------------------


@pytest.mark.parametrize("token", [None, "cluster-token-0123456789"])
async def test_node_client_sends_the_cluster_token_on_every_request(token):
    from aiohttp import web

    from splitserve.common.auth import CLUSTER_TOKEN_HEADER
    from splitserve.common.http import error_response
    from splitserve.common.prompt_ref import WirePrompt
    from splitserve.common.protocol import GenerateRequest
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.router.streams.node_client import NodeClient, NodeRejected

    seen = []  # (path, the token header or None)

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get(CLUSTER_TOKEN_HEADER)))
        if request.path == "/abort":
            return web.Response(status=200)
        return error_response(403, "wrong token")

    app = web.Application()
    app.router.add_post("/generate", record)
    app.router.add_post("/abort", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    addr = "http://127.0.0.1:%d" % runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            client = NodeClient(session, cluster_token=token)
            with pytest.raises(NodeRejected) as exc:
                await client.generate(addr, GenerateRequest(request_id="r1", prompt=WirePrompt.of([1, 2]),
                                                            sampling_params=SamplingParams()))
            assert exc.value.status == 403
            assert await client.abort(addr, "r1")
    finally:
        await runner.cleanup()
    assert seen == [("/generate", token), ("/abort", token)]


# -- malformed HTTP ------------------------------------------------------------------

_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # long line
    _HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n",  # many headers
    _HEAD + b"X-Big: " + b"v" * 20_000 + b"\r\n\r\n",  # long header
    _HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # bad chunk size
    _HEAD + b"Content-Length: -5\r\n\r\n{}",
    _HEAD + b"Content-Length: 99999999999999999999999\r\n\r\n{}",
    _HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    _HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"GARBAGE\r\n\r\n",
])
async def test_malformed_http_is_4xx_and_the_router_keeps_serving(router, http, raw):
    host, port = router.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status_line.split()[1][:1] == b"4", status_line
    async with http.get(router + "/v1/models") as resp:
        assert resp.status == 200

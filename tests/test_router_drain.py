"""SIGTERM drains a real router process in front of a simulated decode node: new
requests get 503 ``draining`` with Retry-After and /health says so, the stream in
flight finishes to ``[DONE]``, then the process exits 0; past --drain-grace the
router stops anyway, cutting what still streams. A stream longer than the header
timeout is not cut by it."""

import http.client
import json
import signal
import subprocess
import sys
import time

import pytest

from splitserve.deploy.launcher import SimCluster, free_port

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster():
    # speedup 2: a decode step takes ~45 ms, so 80 tokens stream for ~3.5 s; a header
    # timeout of 1 s must not cut a response that takes longer
    with SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "2"], kv_cache_memory="256MiB",
                    router_args=["--drain-grace", "30", "--header-timeout", "1"]) as c:
        yield c


def open_stream(url: str, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": [1000 + i for i in range(20)], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the first token arrived
    return conn, resp


def post(url: str) -> tuple[int, dict, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), dict(resp.getheaders())
    finally:
        conn.close()


def test_sigterm_finishes_the_stream_in_flight_and_refuses_new_requests(cluster):
    router = cluster.node("router").popen
    conn, resp = open_stream(cluster.url, max_tokens=80)
    time.sleep(1.2)  # past the header timeout, mid-stream
    t0 = time.monotonic()
    router.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, body, headers = post(cluster.url)
    assert status == 503 and body["error"]["code"] == "draining", body
    assert headers["Retry-After"] == "1"
    host, port = cluster.url.removeprefix("http://").split(":")
    probe = http.client.HTTPConnection(host, int(port), timeout=10)
    probe.request("GET", "/health")
    health = probe.getresponse()
    assert health.status == 503 and json.loads(health.read())["status"] == "draining"
    probe.close()
    rest = resp.read().split(b"\n\n")
    chunks = [c for c in rest if c.startswith(b"data: {")]
    assert rest[-2] == b"data: [DONE]" and len(chunks) >= 70  # the whole stream, ended cleanly
    conn.close()
    assert router.wait(15) == 0
    assert time.monotonic() - t0 < 25


def test_past_the_grace_period_the_router_stops_anyway(cluster):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "router", "--port", str(port), "--redis-url",
         cluster.redis_url, "--drain-grace", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in router.stdout:
            if line.startswith("READY"):
                break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it has read the node list
            try:
                conn, resp = open_stream(url, max_tokens=400)  # ~20 s of tokens
                break
            except AssertionError:
                time.sleep(0.3)
        t0 = time.monotonic()
        router.send_signal(signal.SIGTERM)
        assert router.wait(15) == 0
        assert time.monotonic() - t0 < 8  # grace 0.5 s + handler shutdown + cleanup
        try:
            rest = resp.read()
        except http.client.IncompleteRead as e:  # the chunked body ended without its last chunk
            rest = e.partial
        assert b"data: [DONE]" not in rest  # cut short
        conn.close()
    finally:
        if router.poll() is None:
            router.kill()
        router.wait()

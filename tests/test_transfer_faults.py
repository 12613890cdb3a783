"""Every way a KV transfer can end, on real processes: one prefill node and one decode
node (``splitserve`` processes, a real Redis), the decode node's calls to the prefill
node going through a real TCP hop in this test (``Hop``) that can hold the prefill
node's answer or cut the sockets.

At each point of a transfer

    before reserve | during blocks | after the last block, before the result | after the result

one of three things fails:

    prefill   the prefill node is killed (SIGKILL) and started again afterwards
    network   the sockets to the prefill node are reset (refused from then on)
    client    the decode node's HTTP client hangs up

and the test checks, through the decode node's ``GET /debug/transfers``, that the
transfer's one future was resolved exactly once, by the path the fault implies
(prefilled, failed, aborted; none when no transfer was reserved), that a request
whose client stayed got every token (a failed transfer falls back to local prefill),
and that neither node holds a KV block, a stream or a transfer afterwards.
"""

import asyncio
import os
import random
import signal
import socket
import struct
import time
from collections.abc import Callable

import aiohttp
import msgspec
import pytest

from splitserve.common import metric_names as names
from splitserve.common.auth import new_cluster_token
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
PROMPT_TOKENS = 512  # 32 blocks of 16, prefilled 32 tokens a step: the blocks arrive over 16 steps
# the prefill node's chunking (the decode node keeps the defaults: its fallback prefill is one step)
SLOW_PREFILL = ("--prefill-chunk-size", "32", "--max-num-batched-tokens", "32")
MAX_TOKENS = 24
SETTLE_S = 30.0  # a node frees everything within this (the lease is longer: nothing waits for it)
POINTS = ("before_reserve", "during_blocks", "before_result", "after_result")
FAULTS = ("prefill", "network", "client")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(prefill_nodes=0, decode_nodes=1, kv_backend="tcp", kv_cache_memory="96MiB",
                cluster_token=new_cluster_token(), extra_node_args=["--transfer-lease", "60"])
    c.start()
    try:
        ensure_prefill(c)
        c.wait_for_nodes(2, 60)
        yield c
    finally:
        c.stop()


# ---- the hop between the decode node and the prefill node ----------------------------------

def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (the peer sees its connection reset, not a clean end)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class Hop:
    """A real TCP relay to the prefill node's HTTP port. ``hold``: the answers to
    ``POST /prefill`` are kept here, never forwarded (and a connection whose prefill
    node went away is reset, not ended); ``cut()``: reset every connection, both
    ways, and every new one."""

    def __init__(self, upstream: str, hold: bool = False, cut: bool = False):
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.hold = hold
        self.cut_all = cut
        self.prefill_calls = 0  # connections that carried POST /prefill
        self.held = 0  # bytes of answers held back
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        self.cut_all = True
        for w in self._writers:
            _reset(w)

    async def close(self) -> None:
        self._server.close()
        for w in self._writers:
            w.transport.abort()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        if self.cut_all:
            _reset(down_w)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(down_w)
            return
        self._writers += [down_w, up_w]
        first = await down_r.read(1 << 16)
        prefill = first.startswith(b"POST /prefill")
        self.prefill_calls += prefill
        up_w.write(first)
        for task in (self._pipe(down_r, up_w, down_w, False), self._pipe(up_r, down_w, up_w, prefill and self.hold)):
            t = asyncio.create_task(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, src_w: asyncio.StreamWriter,
                    hold: bool) -> None:
        try:
            while data := await src.read(1 << 16):
                if hold:
                    self.held += len(data)
                    continue
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        if hold:
            _reset(dst)  # the prefill node went away with its answer held: the caller sees a reset
        else:
            dst.close()
        src_w.close()


# ---- the decode node, seen from outside ---------------------------------------------------

async def get_json(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_for(what: str, probe: Callable, timeout: float):
    """``await probe()`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.01)


async def transfer_state(s: aiohttp.ClientSession, decode: str, tid: str) -> dict | None:
    table = await get_json(s, f"{decode}/debug/transfers")
    return next((t for t in table["transfers"] if t["transfer_id"] == tid), None)


async def settled(s: aiohttp.ClientSession, addrs: list[str]) -> dict:
    """Every node's state once it holds no KV block, stream or transfer (else fail)."""
    async def probe():
        states = {a: await get_json(s, f"{a}/debug/state") for a in addrs}
        free = all(st["kv_blocks_free"] == st["kv_blocks_total"] and not st.get("streams")
                   and not st.get("transfers") and not st.get("outgoing") for st in states.values())
        return states if free else None
    return await wait_for(f"every pool free, nothing in flight on {addrs}", probe, SETTLE_S)


def generate_body(tid: str, prefill_addr: str) -> bytes:
    rng = random.Random(tid)  # a prompt of its own: no prefix cache hit on either node
    ids = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    return msgspec.msgpack.encode(GenerateRequest(
        request_id=tid, transfer_id=tid, prompt=WirePrompt.of(ids), prefill_addr=prefill_addr,
        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)))


async def read_frames(resp: aiohttp.ClientResponse, reader: FrameReader, until_first: bool = False) -> list[TokenDelta]:
    out: list[TokenDelta] = []
    async for chunk in resp.content.iter_any():
        out += reader.feed(chunk)
        if until_first and out:
            break
    return out


def kill_prefill(cluster: Cluster) -> None:
    p = cluster.node("prefill-0")
    os.killpg(p.popen.pid, signal.SIGKILL)
    p.popen.wait()


def ensure_prefill(cluster: Cluster) -> str:
    """The prefill node's address, started again if a test killed it."""
    p = next((p for p in reversed(cluster.procs) if p.name == "prefill-0"), None)
    if p is None or p.popen.poll() is not None:
        p = cluster.start_node("prefill", 0, SLOW_PREFILL)
        cluster.wait_ready(p, 180)
    return p.addr


# ---- the scenarios ------------------------------------------------------------------------

# (point, fault) -> the one resolution of the transfer's future (None: no transfer was reserved)
EXPECTED = {
    ("before_reserve", "prefill"): "failed", ("before_reserve", "network"): "failed",
    ("before_reserve", "client"): None,
    ("during_blocks", "prefill"): "failed", ("during_blocks", "network"): "failed",
    ("during_blocks", "client"): "aborted",
    ("before_result", "prefill"): "failed", ("before_result", "network"): "failed",
    ("before_result", "client"): "aborted",
    ("after_result", "prefill"): "prefilled", ("after_result", "network"): "prefilled",
    ("after_result", "client"): "prefilled",
}


async def scenario(cluster: Cluster, point: str, fault: str) -> dict:
    tid = f"{point}-{fault}"
    decode = cluster.node("decode-0").addr
    prefill = ensure_prefill(cluster)
    headers = {**cluster.auth_headers(), "Content-Type": "application/msgpack"}
    async with aiohttp.ClientSession(headers=cluster.auth_headers()) as s:
        before = await get_json(s, f"{decode}/debug/transfers")
        fallbacks = sample_sum(await (await s.get(f"{decode}/metrics")).text(), names.FALLBACK_PREFILLS)
        if point == "before_reserve" and fault == "prefill":
            kill_prefill(cluster)
        hop = Hop(prefill, hold=point == "before_result", cut=point == "before_reserve" and fault == "network")
        via_hop = await hop.start()
        # killed before reserve: the decode node calls the dead node itself (connection refused)
        body = generate_body(tid, prefill if (point, fault) == ("before_reserve", "prefill") else via_hop)
        frames: list[TokenDelta] = []
        try:
            if point == "before_reserve" and fault == "client":
                # the request's head and half its body, then the client is gone: it never reserves
                host, port = decode.removeprefix("http://").rsplit(":", 1)
                _, w = await asyncio.open_connection(host, int(port))
                head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                w.write(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{head}\r\n"
                        .encode() + body[:len(body) // 2])
                await w.drain()
                await asyncio.sleep(0.5)
                _reset(w)
            else:
                async with s.post(f"{decode}/generate", data=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    reader = FrameReader(TokenDelta)
                    if point == "during_blocks":
                        await wait_for("some blocks landed, not all", lambda: _landed(s, decode, tid, some=True), 60)
                    elif point == "before_result":
                        await wait_for("every block landed, no result", lambda: _landed(s, decode, tid, some=False), 60)
                        await wait_for("the answer came and is held", lambda: _true(hop.held > 0), 30)
                    elif point == "after_result":
                        frames += await read_frames(resp, reader, until_first=True)  # the transfer is owned
                    if point != "before_reserve":  # (before reserve, the fault came first)
                        if fault == "prefill":
                            kill_prefill(cluster)
                        elif fault == "network":
                            hop.cut()
                        else:
                            resp.close()
                    if fault != "client":
                        frames += await read_frames(resp, reader)
            addrs = [decode] if fault == "prefill" else [decode, prefill]
            await settled(s, addrs)
        finally:
            await hop.close()
        after = await get_json(s, f"{decode}/debug/transfers")
        fallbacks = sample_sum(await (await s.get(f"{decode}/metrics")).text(), names.FALLBACK_PREFILLS) - fallbacks
    return {"before": before, "after": after, "frames": frames, "hop": hop, "fallbacks": fallbacks}


async def _true(value: bool) -> bool:
    return value


async def _landed(s: aiohttp.ClientSession, decode: str, tid: str, some: bool) -> bool:
    t = await transfer_state(s, decode, tid)
    if t is None:
        return False
    assert t["state"] == "transferring" or t["state"] == "reserved", t  # nothing ended it yet
    assert not t["prefilled"], t
    return 0 < t["landed"] < t["blocks"] if some else t["landed"] == t["blocks"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("point", POINTS)
def test_every_path_resolves_the_transfer_once_and_leaks_nothing(cluster, point, fault):
    r = asyncio.run(scenario(cluster, point, fault))
    before, after = r["before"], r["after"]
    want = EXPECTED[point, fault]
    reserved = after["reserved"] - before["reserved"]
    resolved = {k: after["resolutions"][k] - before["resolutions"][k] for k in after["resolutions"]}
    assert reserved == (0 if want is None else 1), (reserved, resolved)
    # the one future, resolved exactly once, by the path this fault takes
    assert resolved == {k: int(k == want) for k in resolved}, resolved
    assert after["transfers"] == [] and all(n == 0 for n in after["counts"].values())
    if fault != "client":  # the client stayed: every token, whatever the transfer did
        tokens = [t for f in r["frames"] for t in f.token_ids]
        assert all(f.error is None for f in r["frames"]) and r["frames"][-1].finish_reason == "length"
        assert len(tokens) == MAX_TOKENS
        assert r["fallbacks"] == int(want == "failed")  # a failed transfer is prefilled locally
    if point == "before_reserve":
        assert r["hop"].prefill_calls == 0  # refused, reset, or never sent
    else:
        assert r["hop"].prefill_calls == 1

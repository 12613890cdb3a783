"""The fault suite: a supervised cluster of real processes (as ``splitserve up`` runs
it: Redis with a password, the cluster token, shm KV transport), one prefill and two
decode nodes, attacked while it serves.

What each test asserts is what a user sees: how many requests failed, how fast the
failures came, whether the nodes came back, whether every KV pool is 100% free
afterwards and no /dev/shm segment is left behind.
"""

import asyncio
import os
import signal
import socket
import time

import aiohttp
import msgspec
import pytest

from splitserve.benchmarks.harness import Disconnect, Outcome, run_load, stream_request, wait_pools_free
from splitserve.common.auth import CLUSTER_TOKEN_HEADER, new_cluster_token
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster, free_port
from splitserve.kvtransfer import TransferError, make_sender, sender_options
from splitserve.kvtransfer.layout import KVLayout
from splitserve.node.shm_segments import list_segments, owner_pid

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
LEASE_S = 8.0
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?",
           "Name three colors of the rainbow.", "Explain rain to a child in one sentence."]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(prefill_nodes=1, decode_nodes=2, kv_backend="shm", kv_cache_memory="48MiB",
                cluster_token=new_cluster_token(), redis_password=new_cluster_token(),
                extra_node_args=["--transfer-lease", str(LEASE_S), "--drain-grace", "20"])
    c.start()
    c.supervise()
    yield c
    c.stop()


def addrs(c: Cluster) -> list[str]:
    return [c.node(n).addr for n in ("prefill-0", "decode-0", "decode-1")]


def run(coro):
    return asyncio.run(coro)


async def _get(url: str, headers=None) -> tuple[int, dict | None]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        body = await r.read()
        json_body = r.status == 200 and r.content_type == "application/json"
        return r.status, (msgspec.json.decode(body) if json_body else None)


def wait_back(c: Cluster, name: str, old_pid: int, timeout: float = 60.0) -> float:
    """Seconds until a new process of ``name`` is READY and the router lists every node."""
    t0 = time.monotonic()
    while True:
        p = c.node(name)
        if p.popen.pid != old_pid and p.ready.is_set():
            break
        assert time.monotonic() - t0 < timeout, f"{name} did not come back:\n" + "\n".join(p.log[-20:])
        time.sleep(0.1)
    c.wait_for_nodes(3, timeout)
    return time.monotonic() - t0


def test_internal_endpoints_require_the_cluster_token(cluster):
    d = cluster.node("decode-0").addr
    assert run(_get(f"{d}/health"))[0] == 200 and run(_get(f"{d}/metrics"))[0] == 200
    assert run(_get(f"{d}/debug/state"))[0] == 401
    assert run(_get(f"{d}/debug/state", {CLUSTER_TOKEN_HEADER: "x" * 32}))[0] == 403
    assert run(_get(f"{d}/debug/state", cluster.auth_headers()))[0] == 200

    # /generate naming a "prefill node" we listen on: refused, and the node never connects out
    with socket.socket() as bait:
        bait.bind(("127.0.0.1", 0))
        bait.listen()
        bait.settimeout(1.0)
        req = GenerateRequest(request_id="evil", prompt=WirePrompt.of(range(1, 200)),
                              sampling_params=SamplingParams(max_tokens=4),
                              prefill_addr=f"http://127.0.0.1:{bait.getsockname()[1]}", transfer_id="t")

        async def post(headers):
            async with aiohttp.ClientSession() as s, s.post(f"{d}/generate", data=msgspec.msgpack.encode(req),
                                                            headers={"Content-Type": "application/msgpack",
                                                                     **headers}) as r:
                return r.status
        assert run(post({})) == 401
        assert run(post({CLUSTER_TOKEN_HEADER: "wrong-token-wrong-token"})) == 403
        with pytest.raises(socket.timeout):
            bait.accept()
    for path in ("/abort", "/prefill"):
        addr = cluster.node("prefill-0").addr if path == "/prefill" else d
        async def post_empty():
            async with aiohttp.ClientSession() as s, s.post(f"{addr}{path}", data=b"") as r:
                return r.status
        assert run(post_empty()) == 401

    # the KV handshake: a sender without the token is refused before anything else
    kv_addr = run(_get(f"{d}/debug/state", cluster.auth_headers()))[1]["kv_addr"]
    layout = KVLayout(dtype="float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)

    async def handshake(token):
        sender = make_sender("shm", layout, sender_options(env={}, connect_timeout_s=5, cluster_token=token))
        try:
            await sender.connect(kv_addr)
        finally:
            await sender.close()
    for token in (None, "not-the-cluster-token"):
        with pytest.raises(TransferError, match="token"):
            run(handshake(token))


async def generate_on(cluster: Cluster, decode_addr: str, ids: list[int], prefill_addr: str | None,
                      rid: str) -> list[int]:
    """Greedy tokens of ``ids`` from the decode node, told to get the KV from ``prefill_addr``."""
    req = GenerateRequest(request_id=rid, prompt=WirePrompt.of(ids), sampling_params=SamplingParams(temperature=0, max_tokens=8),
                          prefill_addr=prefill_addr, transfer_id=rid)
    reader, out = FrameReader(TokenDelta), []
    async with aiohttp.ClientSession(headers=cluster.auth_headers()) as s:
        async with s.post(f"{decode_addr}/generate", data=msgspec.msgpack.encode(req),
                          headers={"Content-Type": "application/msgpack"}) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                for delta in reader.feed(chunk):
                    assert delta.error is None
                    out += delta.token_ids
    return out


def test_corrupted_block_falls_back_with_correct_output(cluster):
    """A prefill node that corrupts every block (not registered: only this test names it)."""
    port = free_port()
    faulty = cluster._spawn("prefill-faulty", ["prefill", "--host", "127.0.0.1", "--port", str(port),
                                               "--kv-backend", "shm", "--kv-cache-memory", "48MiB",
                                               "--threads", "1", "--fault", "corrupt_block"], "prefill")
    cluster.procs.remove(faulty)  # not a supervised member: this test stops it
    cluster.wait_ready(faulty, 180)
    d = cluster.node("decode-0").addr
    ids = list(range(100, 180))  # 5 blocks

    try:
        want = run(generate_on(cluster, d, ids, None, "local"))
        assert run(generate_on(cluster, d, ids, faulty.addr, "via-faulty")) == want
        run(wait_pools_free([d, faulty.addr], cluster.auth_headers(), 2.0))
    finally:
        faulty.popen.send_signal(signal.SIGTERM)
        assert faulty.popen.wait(30) == 0


def test_stalled_prefill_node_expires_the_lease_and_falls_back(cluster):
    """A prefill node that accepts the connection but never sends a block (SIGSTOP): the
    lease (no block for LEASE_S) ends the transfer, the decode node prefills itself."""
    d, p = cluster.node("decode-1").addr, cluster.node("prefill-0")
    ids = list(range(300, 380))
    want = run(generate_on(cluster, d, ids, None, "stall-local"))
    os.kill(p.popen.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert run(generate_on(cluster, d, ids, p.addr, "stall-remote")) == want
        took = time.monotonic() - t0
    finally:
        os.kill(p.popen.pid, signal.SIGCONT)
    assert LEASE_S - 0.5 < took < LEASE_S + 10
    run(wait_pools_free(addrs(cluster), cluster.auth_headers(), LEASE_S))
    cluster.wait_for_nodes(3, 30)  # its heartbeat resumed


def test_client_disconnects_at_every_point_free_every_block(cluster):
    """Long generations (300 tokens): a request not aborted on the nodes would hold its
    blocks far longer than the lease the pools get to come back."""
    async def scenario():
        results = await run_load(cluster.url, rate=4, duration_s=5, prompts=PROMPTS, max_tokens=300,
                                 disconnect_fraction=1.0, seed=1)
        async with aiohttp.ClientSession() as s:  # the reported bug: a drop right after the role chunk
            results += await asyncio.gather(*(stream_request(s, cluster.url, p * 8, 300, Disconnect.AFTER_ROLE)
                                              for p in PROMPTS))
            results += await asyncio.gather(*(stream_request(s, cluster.url, p, 8) for p in PROMPTS))
        return results, await wait_pools_free(addrs(cluster), cluster.auth_headers(), LEASE_S)
    results, (took, _) = run(scenario())
    outcomes = [r.outcome for r in results]
    assert Outcome.FAILED not in outcomes, [r.error for r in results if r.outcome is Outcome.FAILED]
    assert outcomes.count(Outcome.DISCONNECTED) >= 20 and outcomes.count(Outcome.OK) == len(PROMPTS)
    assert took < LEASE_S


def epoch(cluster: Cluster, name: str) -> str:
    return run(_get(f"{cluster.node(name).addr}/debug/state", cluster.auth_headers()))[1]["epoch"]


def test_kill_prefill_under_load_fails_nothing_and_it_comes_back(cluster):
    old, old_epoch = cluster.node("prefill-0").popen.pid, epoch(cluster, "prefill-0")

    async def scenario():
        load = asyncio.create_task(run_load(cluster.url, rate=2, duration_s=8, prompts=PROMPTS, max_tokens=8))
        await asyncio.sleep(2)
        os.killpg(old, signal.SIGKILL)
        return await load
    results = run(scenario())
    failed = [r.error for r in results if r.outcome is not Outcome.OK]
    assert failed == [], failed
    assert wait_back(cluster, "prefill-0", old) < 30
    assert epoch(cluster, "prefill-0") != old_epoch  # its old prefix-index entries are never read


def test_kill_decode_under_load_fails_only_its_requests_fast(cluster):
    old = cluster.node("decode-0").popen.pid

    async def scenario():
        load = asyncio.create_task(run_load(cluster.url, rate=2, duration_s=8, prompts=PROMPTS, max_tokens=24))
        await asyncio.sleep(3)
        t_state = time.monotonic()
        async with aiohttp.ClientSession() as s:
            st = await s.get(f"{cluster.node('decode-0').addr}/debug/state", headers=cluster.auth_headers())
            inflight = (await st.json())["streams"]
        t_kill = time.monotonic()
        os.killpg(old, signal.SIGKILL)
        return t_state, t_kill, inflight, await load
    t_state, t_kill, inflight, results = run(scenario())
    failed = [r for r in results if r.outcome is not Outcome.OK]
    # its streams when the state was read, and any request sent while that read ran (on a
    # loaded machine the kill can come a while after the read)
    late = sum(t_state <= r.started < t_kill for r in results)
    assert len(failed) <= inflight + late, [r.error for r in failed]
    assert all(r.started < t_kill and r.ended - t_kill < 2.0 for r in failed), \
        [(r.started - t_kill, r.ended - t_kill, r.error) for r in failed]
    wait_back(cluster, "decode-0", old)
    run(wait_pools_free(addrs(cluster), cluster.auth_headers(), LEASE_S))


def test_kill_redis_under_load_fails_nothing_and_it_comes_back(cluster):
    old = cluster.redis.pid

    async def scenario():
        load = asyncio.create_task(run_load(cluster.url, rate=2, duration_s=5, prompts=PROMPTS, max_tokens=8))
        await asyncio.sleep(1)
        cluster.redis.kill()
        return await load
    results = run(scenario())
    assert [r.error for r in results if r.outcome is not Outcome.OK] == []
    t0 = time.monotonic()
    while cluster.redis.pid == old or cluster.redis.poll() is not None:
        assert time.monotonic() - t0 < 10, "Redis was not restarted"
        time.sleep(0.1)
    cluster.wait_for_nodes(3, 30)  # the nodes re-registered in the empty Redis


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(cluster):
    async def scenario():
        async with aiohttp.ClientSession() as s:
            reqs = [asyncio.create_task(stream_request(s, cluster.url, p, 48)) for p in PROMPTS]
            victim = None
            while victim is None:  # a decode node with requests in flight
                await asyncio.sleep(0.2)
                for name in ("decode-0", "decode-1"):
                    st = await s.get(f"{cluster.node(name).addr}/debug/state", headers=cluster.auth_headers())
                    if (await st.json())["streams"]:
                        victim = cluster.node(name)
                        break
            victim.popen.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            req = GenerateRequest(request_id="late", prompt=WirePrompt.of(range(1, 40)),
                                  sampling_params=SamplingParams(max_tokens=4))
            async with s.post(f"{victim.addr}/generate", data=msgspec.msgpack.encode(req),
                              headers={"Content-Type": "application/msgpack", **cluster.auth_headers()}) as r:
                late = (r.status, r.headers.get("Retry-After"))
            code = await asyncio.to_thread(victim.popen.wait, 30)
            return victim, code, late, await asyncio.gather(*reqs)
    victim, code, late, results = run(scenario())
    assert late == (503, "1")  # draining: new work is refused, in-flight work finishes
    assert code == 0
    assert [r.outcome for r in results] == [Outcome.OK] * len(PROMPTS), [r.error for r in results]
    wait_back(cluster, victim.name, victim.popen.pid)


def test_stop_leaves_no_shm_segment(cluster):
    pids = {p.popen.pid for p in cluster.procs}
    assert any(owner_pid(n) in pids for n in list_segments())  # the decode nodes' live pools
    cluster.stop()
    left = [n for n in list_segments() if owner_pid(n) in pids]
    assert left == []

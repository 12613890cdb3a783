"""Network faults between real processes in network namespaces (issue 12): one
prefill and two decode nodes, each in its own namespace, the router, Redis and the
client in the root namespace; KV blocks travel over TCP on direct prefill <-> decode
links (tests/kit/netns_lab.py), where the faults go:

    root ns: Redis, router, client
      |            |             |
    [prefill-0] --link-- [decode-0]
          \\-----link----- [decode-1]

Each test asserts what a user sees: how many requests failed, how long they took,
every KV pool 100% free afterwards. Skipped, saying why, where the machine cannot
create namespaces (not root, no ``ip``/``tc``). Delay uses ``tc netem`` where the
kernel has it, else a userspace shaper over TUN devices (tests/kit/netns_shaper.py).
"""

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid

import aiohttp
import pytest
import torch

from splitserve.benchmarks.harness import MODEL, Outcome, node_state, stream_request, wait_pools_free
from splitserve.tests.kit.netns_lab import Fault, Lab, Unavailable
from splitserve.common import metric_names as names
from splitserve.common.auth import CLUSTER_TOKEN_ENV, auth_headers, new_cluster_token
from splitserve.deploy.launcher import free_port
from splitserve.node.shm_segments import list_segments, owner_pid

pytestmark = [pytest.mark.netns, pytest.mark.slow]
os.environ.setdefault("SPLITSERVE_QUIET", "1")
LEASE_S = 8.0  # longer than a dead peer takes to notice (common/http.py PEER_DEAD_AFTER_S)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def lab():
    try:
        lab = Lab().open()
    except Unavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bundled_dir):
    """A tiny random Llama (hidden 64, 2 layers) with the bundled tokenizer: fast nodes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048, eos_token_id=2, bos_token_id=1,
                                         tie_word_embeddings=True))
    path = tmp_path_factory.mktemp("tiny_netns")
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir / name, path / name)
    return path


PROBE = """import socket, sys, time
t0 = time.monotonic()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print(round(time.monotonic() - t0, 3))
except OSError:
    print("unreachable")
"""


def test_lab_links_carry_faults(lab):
    """The lab itself: a link partitions and heals, a port filter cuts one service only,
    a shaped link delays (each connect crosses it twice: SYN, SYN-ACK)."""
    a, b = lab.add("lab-a"), lab.add("lab-b")
    veth = lab.link(a, b)
    server = subprocess.Popen(b.cmd(sys.executable, "-c", "import socket, time\n"
                                    f"s = socket.create_server(({b.addr!r}, 7007)); time.sleep(60)"))
    try:
        def connect(ns) -> str:  # from namespace ns (None: the root namespace)
            argv = [sys.executable, "-c", PROBE, b.addr, "7007"]
            return subprocess.run(ns.cmd(*argv) if ns else argv, capture_output=True, text=True, check=False,
                                  timeout=30).stdout.strip()
        t0 = time.monotonic()
        while connect(a) == "unreachable":
            assert time.monotonic() - t0 < 10, "the server in lab-b never listened"
        lab.set_link_fault(veth, Fault(loss=1.0))
        assert connect(a) == "unreachable" and connect(None) != "unreachable"  # only the link is cut
        lab.set_link_fault(veth, Fault())
        assert connect(a) != "unreachable"
        lab.set_fault(b, b.veth, Fault(drop_port=7007))
        assert connect(None) == "unreachable" and connect(a) != "unreachable"
        lab.set_fault(b, b.veth, Fault())
        if lab.has_tun:
            shaped = lab.link(a, b, shaped=True)
            lab.set_link_fault(shaped, Fault(delay_ms=150))
            assert float(connect(a)) > 0.3
            lab.route_over(veth)
            assert float(connect(a)) < 0.3
    finally:
        server.kill()
        server.wait()


class NetCluster:
    """Redis, router and client in the root namespace; each node in its namespace."""

    def __init__(self, lab: Lab, model_dir):
        self.lab = lab
        self.token = new_cluster_token()
        self.env = dict(os.environ, SPLITSERVE_QUIET="1", **{CLUSTER_TOKEN_ENV: self.token})
        self.prefill = lab.add("prefill0")
        self.decodes = [lab.add("decode0"), lab.add("decode1")]
        self.links = [lab.link(self.prefill, d) for d in self.decodes]  # prefill <-> decode i
        password = new_cluster_token()
        self.redis_port = free_port()
        binds = ["127.0.0.1", self.prefill.gateway, *(d.gateway for d in self.decodes)]
        self.redis = subprocess.Popen(["redis-server", "--port", str(self.redis_port), "--bind", *binds,
                                       "--requirepass", password, "--save", "", "--appendonly", "no"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        redis_url = lambda host: f"redis://:{password}@{host}:{self.redis_port}/0"
        model = ["--model", str(model_dir), "--served-model-name", MODEL]
        node = lambda role, ns, name: lab.spawn(ns, name, [
            role, "--host", ns.addr, "--redis-url", redis_url(ns.gateway), "--node-id", name, "--kv-backend", "tcp",
            "--kv-cache-memory", "16MiB", "--threads", "1", "--transfer-lease", str(LEASE_S),
            "--prefill-chunk-size", "64", "--drain-grace", "2", *model], self.env)
        self.nodes = [node("prefill", self.prefill, "prefill-0")] + \
            [node("decode", ns, f"decode-{i}") for i, ns in enumerate(self.decodes)]
        self.router_port = free_port()
        self.router = lab.spawn(None, "router", ["router", "--host", "127.0.0.1", "--port", str(self.router_port),
                                                 "--redis-url", redis_url("127.0.0.1"), *model,
                                                 # the transfers between the namespaces are the subject:
                                                 # every prompt goes through the prefill node
                                                 "--no-prefix-pull", "--score-weights", "local_prefill_tokens=0"],
                                self.env)
        self.url = f"http://127.0.0.1:{self.router_port}"

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        for p in [*self.nodes, self.router]:
            while not p.ready.wait(0.2):
                assert p.popen.poll() is None and time.monotonic() < deadline, \
                    f"{p.name} did not start:\n" + "\n".join(p.log[-20:])
        run(self.wait_for_nodes(3, deadline - time.monotonic()))

    async def wait_for_nodes(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(f"{self.url}/health") as r:
                    h = await r.json()
                if h.get("prefill_nodes", 0) + h.get("decode_nodes", 0) >= n:
                    return
                assert time.monotonic() < deadline, f"the router lists {h}"
                await asyncio.sleep(0.2)

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.token)

    @property
    def addrs(self) -> list[str]:
        return [p.addr for p in self.nodes]

    def set_links(self, fault: Fault) -> None:
        for link in self.links:
            self.lab.set_link_fault(link, fault)

    def counters(self) -> dict[str, float]:
        """Summed over the decode nodes: KV transfers by end state and fallback prefills."""
        from prometheus_client.parser import text_string_to_metric_families

        async def fetch():
            async with aiohttp.ClientSession() as s:
                return [await (await s.get(f"{a}/metrics")).text() for a in self.addrs[1:]]
        out: dict[str, float] = {}
        for text in run(fetch()):
            for fam in text_string_to_metric_families(text):
                for sample in fam.samples:
                    if sample.name == names.KV_TRANSFERS:
                        key = sample.labels["state"]
                    elif sample.name == names.FALLBACK_PREFILLS:
                        key = "fallback"
                    else:
                        continue
                    out[key] = out.get(key, 0) + sample.value
        return out

    def stop(self) -> None:
        self.lab.close()
        self.redis.kill()
        self.redis.wait()


@pytest.fixture(scope="module")
def cluster(lab, model_dir):
    c = NetCluster(lab, model_dir)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def healthy_links(request):
    """Every cluster test starts and ends with healthy links and the routes over the veths."""
    if "cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("cluster")
    c.set_links(Fault())
    yield
    c.set_links(Fault())
    for link in c.links:
        c.lab.route_over(link)
    for ns in [c.prefill, *c.decodes]:
        c.lab.set_fault(ns, ns.veth, Fault())


def prompt(words: int) -> str:
    """A prompt no node has cached: every block travels."""
    return f"{uuid.uuid4().hex} " + " ".join(["the sea is calm today"] * (words // 5))


async def send_requests(url: str, n: int, words: int, max_tokens: int, timeout_s: float = 120.0):
    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(stream_request(s, url, prompt(words), max_tokens, timeout_s=timeout_s)
                                      for _ in range(n)))


def failures(results) -> list[str]:
    return [r.error for r in results if r.outcome is not Outcome.OK]


def latencies(results) -> list[float]:
    return sorted(r.ended - r.started for r in results)


def test_healthy_links_transfer_every_prompt(cluster):
    before = cluster.counters()
    results = run(send_requests(cluster.url, 4, 200, 4))
    assert failures(results) == []
    after = cluster.counters()
    assert after.get("owned", 0) - before.get("owned", 0) == 4  # every prompt came over a link
    assert after.get("fallback", 0) == before.get("fallback", 0)


def test_delay_between_prefill_and_decode_slows_ttft_only(cluster):
    """50 +- 10 ms each way between prefill and decode: tc netem on the links where the
    kernel has it, else shaped links (the same delay applied in userspace)."""
    if not (cluster.lab.has_netem or cluster.lab.has_tun):
        pytest.skip("neither tc netem nor /dev/net/tun: delay cannot be simulated")
    links = cluster.links if cluster.lab.has_netem else \
        [cluster.lab.link(cluster.prefill, d, shaped=True) for d in cluster.decodes]
    base = latencies(run(send_requests(cluster.url, 4, 200, 1)))  # max_tokens 1: latency = TTFT
    for link in links:  # (healthy_links routes over the veths again afterwards)
        cluster.lab.set_link_fault(link, Fault(delay_ms=50, jitter_ms=10))
    before = cluster.counters()
    results = run(send_requests(cluster.url, 4, 200, 1))
    assert failures(results) == []
    slow = latencies(results)
    print(f"TTFT median {base[len(base) // 2]:.3f}s -> {slow[len(slow) // 2]:.3f}s with 50+-10 ms each way "
          f"({'netem' if cluster.lab.has_netem else 'userspace shaper'})")
    # the task, each chunk's blocks and their acknowledgement, and the answer cross the link
    assert slow[len(slow) // 2] > base[len(base) // 2] + 0.1
    after = cluster.counters()
    assert after.get("owned", 0) - before.get("owned", 0) == 4 and after.get("fallback", 0) == before.get("fallback", 0)
    run(wait_pools_free(cluster.addrs, cluster.headers, 10))


def test_packet_loss_between_prefill_and_decode_fails_nothing(cluster):
    cluster.set_links(Fault(loss=0.05))
    before = cluster.counters()
    results = run(send_requests(cluster.url, 6, 300, 4))
    assert failures(results) == []
    lat = latencies(results)
    print(f"5% loss each way: latency median {lat[len(lat) // 2]:.2f}s, max {lat[-1]:.2f}s")
    after = cluster.counters()
    # TCP retransmits: transfers complete (a fallback only where a retransmission outlasted the lease)
    assert after.get("owned", 0) - before.get("owned", 0) + after.get("fallback", 0) - before.get("fallback", 0) == 6
    assert lat[-1] < 2 * LEASE_S + 15
    run(wait_pools_free(cluster.addrs, cluster.headers, 10))


def test_partition_mid_transfer_falls_back_frees_blocks_and_heals(cluster):
    """A long prompt's blocks trickle over a slowed link; cut the link once some landed:
    the request still succeeds (local prefill), both nodes free its blocks within the
    lease, and once the link heals prompts travel again."""
    cluster.set_links(Fault(rate_kbit=200))
    before = cluster.counters()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(stream_request(s, cluster.url, prompt(1500), 4))
            t0 = time.monotonic()
            while True:  # until a decode node has some blocks of it, not all
                states = [await node_state(s, a, cluster.headers) for a in cluster.addrs[1:]]
                landed = [t["landed"] for st in states for t in st["transfers"]]
                if any(landed):
                    break
                assert time.monotonic() - t0 < 60 and not req.done(), states
                await asyncio.sleep(0.05)
            await asyncio.to_thread(cluster.set_links, Fault(loss=1.0))
            t_cut = time.monotonic()
            result = await req
            return t_cut, result, await wait_pools_free(cluster.addrs, cluster.headers, LEASE_S + 10)
    t_cut, result, (freed_s, _) = run(scenario())
    took = result.ended - t_cut
    print(f"partition mid-transfer: request ended {took:.2f}s after the cut, pools free {freed_s:.2f}s later")
    assert result.outcome is Outcome.OK, result.error  # the decode node prefilled it itself
    # the decode node notices the dead prefill node (PEER_DEAD_AFTER_S of silence on its
    # task's connection) or its lease runs out (LEASE_S after the last block landed)
    assert took < LEASE_S + 10
    after = cluster.counters()
    assert after.get("fallback", 0) - before.get("fallback", 0) == 1

    cluster.set_links(Fault())  # healed: prompts travel again
    results = run(send_requests(cluster.url, 2, 200, 4))
    assert failures(results) == []
    assert cluster.counters().get("owned", 0) - after.get("owned", 0) == 2
    pids = {p.popen.pid for p in cluster.nodes}
    assert not [n for n in list_segments() if owner_pid(n) in pids]  # KV over TCP: no /dev/shm segment


def test_prefill_node_cut_from_the_decode_nodes_falls_back_before_the_lease(cluster):
    """Both links down before the requests (the decode nodes hold pooled connections to
    the prefill node): each request falls back to local prefill once its task to the
    prefill node cannot be delivered, well before the lease."""
    run(send_requests(cluster.url, 2, 100, 2))  # the decode nodes' pooled connections to prefill-0
    cluster.set_links(Fault(loss=1.0))
    before = cluster.counters()
    results = run(send_requests(cluster.url, 4, 100, 4, timeout_s=60))
    assert failures(results) == []
    lat = latencies(results)
    print(f"prefill node cut from the decode nodes: latency median {lat[len(lat) // 2]:.2f}s, max {lat[-1]:.2f}s")
    assert lat[-1] < LEASE_S - 1
    assert cluster.counters().get("fallback", 0) - before.get("fallback", 0) == 4
    run(wait_pools_free(cluster.addrs, cluster.headers, LEASE_S + 5))


def test_router_cut_from_a_decode_node_routes_to_the_other(cluster):
    """decode-0 drops every packet to its HTTP port: the router's connections to it time
    out; it stops routing there and the requests go to decode-1."""
    d0 = cluster.decodes[0]
    port = int(cluster.nodes[1].addr.rsplit(":", 1)[1])
    cluster.lab.set_fault(d0, d0.veth, Fault(drop_port=port))
    results = run(send_requests(cluster.url, 6, 100, 4, timeout_s=60))
    assert failures(results) == []
    lat = latencies(results)
    print(f"router cut from decode-0: latency median {lat[len(lat) // 2]:.2f}s, max {lat[-1]:.2f}s")
    assert lat[-1] < 15  # one connect timeout at most, then decode-1
    cluster.lab.set_fault(d0, d0.veth, Fault())
    run(wait_pools_free(cluster.addrs, cluster.headers, 10))

"""Adding a KV backend and a routing policy from outside the package: each one file
(tests/toy_backend.py: tcp's framing under its own name, scheme and abilities;
tests/toy_policy.py: the least KV in use) named in $SPLITSERVE_KV_BACKENDS and
$SPLITSERVE_ROUTING_POLICIES. The toy backend moves blocks in-process and the toy policy
picks by its rule; through real processes (redis-server, router -> prefill -> decode) the
cluster serves greedy completions token for token like the engine offline, the KV moving
over the toy backend and every decision the toy policy's. Without the variables both names
are refused naming them; a name taken twice is refused; the built-in backends are imported
only when built (ucxx is heavy and optional). The toy backend also runs the conformance
suite every backend passes (tests/test_kvtransfer_conformance.py)."""

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from splitserve.common import metric_names as names
from splitserve.common.config import EngineConfig, NodeConfig
from splitserve.common.kv_backends import BACKENDS_ENV, backend_names, backend_spec
from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import NodeInfo
from splitserve.common.sampling_params import SamplingParams
from splitserve.kvtransfer import KVBlockStore, KVLayout, TransferError, allocate_kv_cache, make_receiver, make_sender
from splitserve.router.config import POLICIES_ENV
from splitserve.router.routing.policy_registry import make_policy, policy_names
from splitserve.tests.metrics_text import node_metric
from splitserve.tests.served_cluster import assert_serves_greedy

TOY_BACKEND = str(Path(__file__).with_name("toy_backend.py"))
TOY_POLICY = str(Path(__file__).with_name("toy_policy.py"))
BACKEND, POLICY = "toy", "toy_least_kv"
LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)  # 1 KiB blocks
PROMPTS = [[5, 17, 42, 99, 3, 8, 200, 13, 77] * 7, [1, 2, 3, 4, 5, 6, 7] * 3]
NEW_TOKENS = 12
os.environ.setdefault("SPLITSERVE_QUIET", "1")


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setenv(BACKENDS_ENV, TOY_BACKEND)
    monkeypatch.setenv(POLICIES_ENV, TOY_POLICY)


def node(node_id: str, role: str = "decode", **load) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model="m", epoch="e",
                    load=NodeLoad(**load))


def test_without_the_variables_the_names_are_refused_naming_them(monkeypatch):
    monkeypatch.delenv(BACKENDS_ENV, raising=False)
    monkeypatch.delenv(POLICIES_ENV, raising=False)
    with pytest.raises(ValueError, match=f"kv_backend: must be one of tcp, .*got 'toy'.*{BACKENDS_ENV}"):
        NodeConfig(role="decode", engine=EngineConfig(), kv_backend=BACKEND)
    with pytest.raises(ValueError, match=f"policy: unknown routing policy 'toy_least_kv'.*{POLICIES_ENV}"):
        make_policy(POLICY)
    assert BACKEND not in backend_names() and POLICY not in policy_names()


def test_a_name_taken_twice_or_a_module_without_a_spec_is_refused(tmp_path, monkeypatch):
    twice = tmp_path / "twice.py"
    twice.write_text("from splitserve.common.kv_backends import KVBackendSpec\n"
                     "BACKEND = KVBackendSpec('tcp', 'mod:Sender', 'mod:Receiver')\n")
    monkeypatch.setenv(BACKENDS_ENV, str(twice))
    with pytest.raises(ValueError, match=f"{BACKENDS_ENV}: .*twice.py registers 'tcp'"):
        backend_names()
    monkeypatch.setenv(BACKENDS_ENV, TOY_POLICY)
    with pytest.raises(ValueError, match=f"{BACKENDS_ENV}: .*toy_policy.py defines no BACKEND"):
        backend_names()
    monkeypatch.setenv(POLICIES_ENV, f"{TOY_POLICY},{TOY_POLICY}")
    with pytest.raises(ValueError, match=f"{POLICIES_ENV}: .*registers 'toy_least_kv'"):
        policy_names()


def test_the_cli_takes_the_names_from_the_plugin_registries(toys):
    from splitserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["prefill", "--kv-backend", BACKEND]).kv_backend == BACKEND
    assert parser.parse_args(["router", "--policy", POLICY]).policy == POLICY
    assert parser.parse_args(["replay", "t.jsonl", "--policy", POLICY]).policy == POLICY
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--kv-backend", "carrier-pigeon"])


def test_the_toy_backend_moves_blocks_through_its_own_classes(toys):
    spec = backend_spec(BACKEND)
    assert (spec.serves_pulls, spec.same_host, spec.shm_cache, spec.release_grace_s) == (False, False, False, 0.0)
    assert NodeConfig(role="decode", engine=EngineConfig(), kv_backend=BACKEND).kv_spec is spec
    stores = []
    for seed in (1, 2):
        cache = allocate_kv_cache(LAYOUT, 64)
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
        stores.append(KVBlockStore(cache, LAYOUT))
    src, dst = stores
    reports = []
    src_ids, dest_ids = list(range(40)), list(range(10, 50))

    async def body():
        receiver = make_receiver(BACKEND, LAYOUT, dst, "127.0.0.1", lambda *r: reports.append(r))
        sender = make_sender(BACKEND, LAYOUT)
        assert (type(sender).__name__, type(receiver).__name__) == ("ToySender", "ToyReceiver")
        await receiver.start()
        try:
            assert receiver.address.startswith("toy://127.0.0.1:")
            await sender.send_blocks(receiver.address, "t1", list(zip(dest_ids, src.split(src.pack(src_ids)))))
            tcp = make_sender("tcp", LAYOUT)
            with pytest.raises(TransferError, match="not a tcp:// address"):
                await tcp.send_blocks(receiver.address, "t2", list(zip([60], src.split(src.pack([0])))))
            await tcp.close()
        finally:
            await sender.close()
            await receiver.stop()

    asyncio.run(asyncio.wait_for(body(), 30))
    assert sorted(reports) == [("t1", d, True, None) for d in dest_ids]
    assert all(src.read(s) == dst.read(d) for s, d in zip(src_ids, dest_ids))


def test_the_toy_policy_picks_the_least_kv_in_use(toys):
    policy = make_policy(POLICY)
    assert type(policy).__name__ == "LeastKV" and not policy.uses_prefix_index
    nodes = [node("d0", kv_usage=0.5), node("d1", running=9, kv_usage=0.1), node("d2", kv_usage=0.1),
             node("p0", "prefill", queued_prefill_tokens=900), node("p1", "prefill", queued_prefill_tokens=100),
             node("p2", "prefill", queued_prefill_tokens=100)]
    d = policy.choose([1, 2, 3], nodes)
    assert (d.decode.node_id, d.prefill.node_id, d.prefill_work) == ("d2", "p1", 3)  # ties: the first id
    d = policy.choose([1, 2, 3], nodes, inflight={"d2": 10}, inflight_tokens={"p1": 500})
    assert (d.decode.node_id, d.prefill.node_id) == ("d1", "p2")  # this router's own work counts
    assert policy.choose([1], [node("p0", "prefill")]) is None
    # inputs it does not name (pulls, one a later router adds) reach it without breaking it
    d = policy.choose([1, 2, 3], nodes, pulls={"d2": 1}, an_input_added_later=object())
    assert (d.decode.node_id, d.prefill.node_id) == ("d2", "p1")


def test_builtin_backends_are_imported_only_when_built():
    code = ("import sys\n"
            "from splitserve.common.config import EngineConfig, NodeConfig\n"
            "from splitserve.common.kv_backends import backend_names\n"
            "from splitserve.kvtransfer import KVLayout, make_sender\n"
            "NodeConfig(role='decode', engine=EngineConfig(), kv_backend='ucx'); backend_names()\n"
            "make_sender('tcp', KVLayout(dtype='float32', block_size=4, num_layers=1, num_kv_heads=1,"
            " head_dim=8))\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'ucxx' or m.startswith('splitserve.kvtransfer.backends')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != BACKENDS_ENV})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['splitserve.kvtransfer.backends', 'splitserve.kvtransfer.backends.tcp']"


@pytest.mark.slow
def test_toy_backend_and_policy_serve_through_real_processes(toys, served_tiny_model):
    from splitserve.engine.llm import LLM

    path = served_tiny_model("llama")
    with LLM(str(path), kv_cache_memory=8 << 20) as llm:
        refs = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))]
    assert all(len(r) > 4 for r in refs), "the prompts should decode for a while before any EOS"

    def moved_by_the_toys(c):
        req = urllib.request.Request(f"{c.node('decode-0').addr}/debug/state", headers=c.auth_headers())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["kv_addr"].startswith("toy://")  # the only receiver: a ToyReceiver
        sent = node_metric(c, "prefill-0", names.KV_BLOCKS_SENT)
        assert sent >= sum(-(-len(p) // 16) for p in PROMPTS)  # every prompt block, none computed locally
        assert node_metric(c, "decode-0", names.KV_BLOCKS_RECEIVED, ok="true") == sent
        with urllib.request.urlopen(f"{c.url}/debug/decisions", timeout=10) as r:
            decisions = json.loads(r.read())["decisions"]
        assert [(d["policy"], d["prefill"], d["decode"]) for d in decisions] == \
            [(POLICY, "prefill-0", "decode-0")] * len(PROMPTS)

    assert_serves_greedy(path, PROMPTS, refs, NEW_TOKENS, moved_by_the_toys, kv_backend=BACKEND, policy=POLICY)

"""The router's pairing filter (router/routing/kv_pairing.py) in every policy: a prefill node is
paired only with decode nodes that can take its KV (same model, dtype, block size, layers,
KV heads and head dim; different TP is fine), in a mixed fleet as in a uniform one; with
no compatible prefill node the decode node prefills itself. The key round-trips through
the node registry record."""

import msgspec
import pytest

from splitserve.common.kv_compat import KVCompat
from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.routing.kv_pairing import cheapest_pair, compatible, pair_mask
from splitserve.router.routing.node_terms import FleetTerms
from splitserve.router.routing.policy_registry import make_policy

L = 1000
PROMPT = list(range(L))
POLICIES = ["cache_aware", "least_load", "round_robin"]


def key(tp: int = 1, **changes) -> KVCompat:
    base = dict(model="m", dtype="bfloat16", block_size=16, num_layers=80, num_kv_heads=8, head_dim=128, tp=tp)
    return KVCompat(**{**base, **changes})


def node(node_id: str, role: str, kv: KVCompat | None, **load) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model="m", epoch="e",
                    kv=kv, load=NodeLoad(**load))


def test_the_key_travels_in_the_node_registry_record():
    n = node("d0", "decode", key(tp=8))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(n), type=NodeInfo) == n
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(node("d1", "decode", None)), type=NodeInfo).kv is None


def test_different_tp_pairs_other_layouts_do_not():
    p = node("p", "prefill", key(tp=4))
    assert compatible(p, node("d", "decode", key(tp=8)))
    assert compatible(p, node("d", "decode", key(tp=1)))
    for change in (dict(head_dim=64), dict(dtype="float16"), dict(block_size=32), dict(num_layers=32),
                   dict(num_kv_heads=4), dict(model="other")):
        assert not compatible(p, node("d", "decode", key(tp=8, **change))), change
    assert not compatible(p, node("d", "decode", key(tp=3)))  # 3 ranks cannot split 8 heads
    assert compatible(p, node("d", "decode", None))  # no key published: the handshake decides


def test_a_uniform_fleet_keeps_the_fast_path():
    prefills = [node(f"p{i}", "prefill", key(tp=4)) for i in range(3)]
    decodes = [node(f"d{i}", "decode", key(tp=8)) for i in range(3)] + [node("d9", "decode", None)]
    assert pair_mask(prefills, decodes) is None
    assert FleetTerms.of(prefills + decodes).pairs is None
    mixed = pair_mask(prefills, decodes + [node("dx", "decode", key(head_dim=64))])
    assert mixed is not None and mixed.shape == (3, 5)
    assert mixed[:, :4].all() and not mixed[:, 4].any()


def test_cheapest_pair_skips_incompatible_ones():
    import numpy as np
    mask = np.array([[True, False], [False, True]])
    assert cheapest_pair(mask, np.array([0.0, 5.0]), np.array([10.0, 0.0]), 0) == (1, 1, 5.0)
    assert cheapest_pair(np.zeros((2, 2), bool), np.zeros(2), np.zeros(2), 0) is None


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_pairs_only_compatible_nodes(policy):
    """Two model layouts in one fleet (say a fp16 pool beside a bf16 one): the least loaded
    prefill node is of the other layout; each decision still pairs alike nodes."""
    nodes = [node("p-bf16", "prefill", key(tp=2), running=4),
             node("p-fp16", "prefill", key(tp=1, dtype="float16")),  # idle, but the wrong dtype
             node("d-bf16", "decode", key(tp=4)),
             node("d-fp16", "decode", key(tp=2, dtype="float16"), running=9)]
    p = make_policy(policy)
    seen = set()
    for i in range(8):
        d = p.choose(PROMPT, nodes, tie_key=i)
        assert d.prefill is not None and compatible(d.prefill, d.decode), (d.prefill.node_id, d.decode.node_id)
        seen.add((d.prefill.node_id, d.decode.node_id))
    assert seen <= {("p-bf16", "d-bf16"), ("p-fp16", "d-fp16")} and seen


@pytest.mark.parametrize("policy", POLICIES)
def test_no_compatible_prefill_node_means_the_decode_node_prefills(policy):
    nodes = [node("p0", "prefill", key(head_dim=64)), node("d0", "decode", key(tp=2))]
    d = make_policy(policy).choose(PROMPT, nodes)
    assert d.decode.node_id == "d0" and d.prefill is None


def test_cache_aware_takes_the_cheapest_compatible_pair():
    """The cheapest prefill node (it holds the prompt) cannot send to the cheapest decode
    node; the policy compares the compatible pairs and takes the cheaper one."""
    nodes = [node("p-a", "prefill", key()), node("p-b", "prefill", key(num_layers=40), running=1),
             node("d-a", "decode", key(tp=2), running=10), node("d-b", "decode", key(num_layers=40, tp=4))]
    policy = CacheAware()
    d = policy.choose(PROMPT, nodes, cached={"p-a": 960})
    assert (d.prefill.node_id, d.decode.node_id) == ("p-a", "d-a")  # the hit outweighs d-a's load
    d = policy.choose(PROMPT, nodes, cached={})
    assert (d.prefill.node_id, d.decode.node_id) == ("p-b", "d-b")  # no hit: the idle pair


def test_a_node_joining_an_incompatible_pool_is_told_why():
    from splitserve.common.node_registry import kv_pool_problem
    pool = [node("p0", "prefill", key(tp=4)), node("p1", "prefill", key(tp=2, head_dim=64)),
            node("d0", "decode", key(tp=8, dtype="float16"))]
    assert kv_pool_problem("decode", key(tp=8), pool) is None  # p0 can send to it
    why = kv_pool_problem("decode", key(tp=8, num_layers=40), pool)
    assert "any registered prefill node" in why and "p0: num_layers: 40 != 80" in why and "p1:" in why
    assert "float16" in kv_pool_problem("prefill", key(tp=4), pool)  # d0 is the only decode node
    assert kv_pool_problem("prefill", key(tp=4), pool[:2]) is None  # no decode node yet
    assert kv_pool_problem("colocated", key(num_layers=1), pool) is None

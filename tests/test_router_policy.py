"""Routing policies on real NodeInfo records: least load (reported and in-flight),
ties that rotate, round robin, and no decode node."""

from collections import Counter

import pytest

from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.load_policies import LeastLoad, RoundRobin
from splitserve.router.routing.policy import Decision
from splitserve.router.routing.policy_registry import make_policy

PROMPT = [1, 2, 3]


def node(node_id: str, role: str = "decode", **load) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model="m",
                    epoch="e", load=NodeLoad(**load))


def test_least_load_picks_least_busy_decode_and_prefill():
    nodes = [node("d0", running=5), node("d1", running=1, waiting=1), node("d2", running=3),
             node("p0", "prefill", running=2), node("p1", "prefill", queued_prefill_tokens=900),
             node("p2", "prefill", queued_prefill_tokens=100)]
    d = LeastLoad().choose(PROMPT, nodes)
    assert isinstance(d, Decision)
    assert (d.decode.node_id, d.prefill.node_id) == ("d1", "p2")


def test_least_load_breaks_request_ties_on_kv_usage():
    nodes = [node("d0", running=2, kv_usage=0.9), node("d1", running=2, kv_usage=0.2)]
    assert LeastLoad().choose(PROMPT, nodes).decode.node_id == "d1"


def test_inflight_counts_when_heartbeats_lag():
    """A burst between heartbeats spreads: this router's in-flight count is fresher."""
    nodes = [node("d0"), node("d1"), node("d2", running=2)]  # all from stale heartbeats
    policy, inflight = LeastLoad(), Counter()
    for _ in range(4):
        inflight[policy.choose(PROMPT, nodes, inflight).decode.node_id] += 1
    assert inflight == {"d0": 2, "d1": 2}  # not 4 on whichever looked idle


def test_equal_nodes_take_turns():
    nodes = [node("d0"), node("d1"), node("d2")]
    policy = LeastLoad()
    picks = [policy.choose(PROMPT, nodes).decode.node_id for _ in range(6)]
    assert sorted(Counter(picks).values()) == [2, 2, 2]


def test_colocated_serves_as_decode_and_prefill_is_optional():
    d = LeastLoad().choose(PROMPT, [node("c0", "colocated")])
    assert d.decode.node_id == "c0" and d.prefill is None


@pytest.mark.parametrize("policy", ["least_load", "round_robin"])
def test_no_decode_capable_node_is_none(policy):
    assert make_policy(policy).choose(PROMPT, [node("p0", "prefill")]) is None
    assert make_policy(policy).choose(PROMPT, []) is None


def test_round_robin_cycles_ignoring_load():
    nodes = [node("d0", running=100), node("d1"), node("p0", "prefill"), node("p1", "prefill")]
    policy = RoundRobin()
    picks = [policy.choose(PROMPT, nodes) for _ in range(4)]
    assert [d.decode.node_id for d in picks] == ["d0", "d1", "d0", "d1"]
    assert [d.prefill.node_id for d in picks] == ["p0", "p1", "p0", "p1"]


def test_unknown_policy_names_the_setting():
    with pytest.raises(ValueError, match="policy"):
        make_policy("cache_aware_v9")

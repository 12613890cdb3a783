"""The cache_aware policy on real NodeInfo records: a repeated prefix goes to the
node that holds it, unless that node is overloaded (no hot spot, also in a burst
between heartbeats); weights are configurable; decisions settle into hit / miss."""

import itertools
from collections import Counter

import pytest

from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.config import CacheAwareWeights, RouterConfig
from splitserve.router.routing.decisions import DecisionLog
from splitserve.router.metrics import RouterMetrics
from splitserve.router.routing.policy import Decision
from splitserve.router.routing.policy_registry import make_policy
from splitserve.router.routing.prefix_mirror import PrefixHits

L = 1000  # prompt tokens
PROMPT = list(range(L))


def node(node_id: str, role: str = "prefill", **load) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model="m",
                    epoch="e", load=NodeLoad(**load))


def pick(policy, nodes, cached, **kw) -> tuple[str | None, str]:
    d = policy.choose(PROMPT, nodes, cached=cached, **kw)
    return (d.prefill.node_id if d.prefill else None, d.decode.node_id)


def test_default_policy_is_cache_aware():
    assert RouterConfig().policy == "cache_aware"
    assert isinstance(make_policy(RouterConfig().policy), CacheAware)


def test_repeated_prefix_goes_to_the_nodes_that_hold_it():
    nodes = [node("p0"), node("p1"), node("p2"), node("d0", "decode"), node("d1", "decode")]
    policy = CacheAware(CacheAwareWeights(local_prefill_tokens=0))  # d1 would prefill the 40 tokens itself
    for _ in range(4):  # not a tie: no rotation away from the holders
        assert pick(policy, nodes, {"p1": 960, "d1": 960}) == ("p1", "d1")
    # a longer run beats a shorter one
    assert pick(policy, nodes, {"p0": 320, "p2": 640}) [0] == "p2"
    # a lightly loaded holder still wins (the prefix saves more than its queue costs) unless
    # an idle node can pull the prefix from it for less
    nodes[1] = node("p1", queued_prefill_tokens=300, running=1)
    assert pick(CacheAware(CacheAwareWeights(local_prefill_tokens=0, prefix_pull=0)), nodes, {"p1": 960})[0] == "p1"
    d = policy.choose(PROMPT, nodes, cached={"p1": 960})
    assert d.prefill.node_id != "p1" and d.pull.holder.node_id == "p1"


@pytest.mark.parametrize("load", [dict(queued_prefill_tokens=2 * L), dict(running=45),
                                  dict(running=3, waiting=42), dict(kv_usage=1.0, running=8)])
def test_overloaded_prefill_holder_loses_to_an_idle_node(load):
    # More load than the whole prompt's work (L tokens plus their attention, 1270
    # token-equivalents) outweighs holding the whole prompt (minus the token always computed).
    nodes = [node("p0", **load), node("p1"), node("d0", "decode")]
    assert CacheAware().work(L, 0) == pytest.approx(1270)
    assert pick(CacheAware(), nodes, {"p0": L - 8})[0] == "p1"


def test_overloaded_decode_holder_loses_to_an_idle_node():
    nodes = [node("p0"), node("d0", "decode", running=40, kv_usage=0.9), node("d1", "decode")]
    assert pick(CacheAware(), nodes, {"d0": 992})[1] == "d1"
    nodes[1] = node("d0", "decode", running=1)  # lightly loaded: the saved transfer wins
    assert pick(CacheAware(), nodes, {"d0": 992})[1] == "d0"


def test_a_burst_between_heartbeats_spreads_once_the_holder_queue_outweighs_the_hit():
    """Heartbeats are stale (all idle); this router's in-flight counts keep it honest."""
    nodes = [node("p0"), node("p1"), node("p2"), node("d0", "decode")]
    policy, inflight, tokens = CacheAware(CacheAwareWeights(prefix_pull=0)), Counter(), Counter()
    cached = {"p0": 960}
    picks = []
    for _ in range(60):
        d = policy.choose(PROMPT, nodes, inflight, cached=cached, inflight_tokens=tokens)
        p = d.prefill.node_id
        picks.append(p)
        inflight[p] += 1  # as dispatch counts it until the first token
        tokens[p] += L - cached.get(p, 0)
    count = Counter(picks)
    assert picks[:5] == ["p0"] * 5  # affinity first
    assert count["p1"] > 0 and count["p2"] > 0  # then the idle nodes take the load
    # No hot spot: the work queued on each node (what a new request would wait for)
    # stays within one request of the others; the holder takes more requests only
    # because each costs it 40 tokens instead of 1000.
    costs = [policy.prefill_cost(n, L, cached, inflight, tokens) for n in nodes[:3]]
    assert max(costs) - min(costs) <= L + policy.w.prefill_request
    assert count["p0"] > count["p1"] + count["p2"]


def test_local_prefill_weighs_the_hit_against_the_decode_node_queue():
    nodes = [node("c0", "colocated"), node("c1", "colocated")]
    assert pick(CacheAware(), nodes, {"c0": 960}) == (None, "c0")
    nodes[0] = node("c0", "colocated", queued_prefill_tokens=3 * L)
    assert pick(CacheAware(), nodes, {"c0": 960}) == (None, "c1")


def test_a_decode_node_holding_most_of_the_prompt_prefills_the_rest_itself_by_default():
    """Decode-side reuse: the next turn of a conversation the decode node served."""
    nodes = [node("p0"), node("p1"), node("d0", "decode"), node("d1", "decode")]
    policy = CacheAware()
    d = policy.choose(PROMPT, nodes, cached={"p1": 960, "d1": 960})
    assert (d.prefill, d.decode.node_id, d.pull) == (None, "d1", None)  # 40 tokens to compute: no hop
    assert d.predicted_ttft == pytest.approx(policy.work(L, 960))
    # a short prompt nobody holds still goes to a prefill node: reuse needs a hit on the decode node
    assert policy.choose(PROMPT[:200], nodes).prefill is not None
    # a decode node busy prefilling its own queue does not take it: remote prefill wins
    busy = [node("p0"), node("d1", "decode", queued_prefill_tokens=4 * L)]
    assert pick(policy, busy, {"d1": 960})[0] == "p0"
    # above local_prefill_tokens uncached, the remote pair is always used
    far = policy.choose(PROMPT, nodes, cached={"d1": 400})
    assert far.prefill is not None
    never = CacheAware(CacheAwareWeights(local_prefill_tokens=0))
    assert pick(never, nodes, {"p1": 960, "d1": 960}) == ("p1", "d1")


def test_the_node_that_computes_pulls_a_prefix_another_node_holds():
    nodes = [node("p0"), node("d0", "decode"), node("d1", "decode", running=40, kv_usage=0.9)]
    policy = CacheAware()
    # only the busy decode node holds the prompt: the prefill node pulls it from there
    d = policy.choose(PROMPT, nodes, cached={"d1": 960})
    assert (d.prefill.node_id, d.decode.node_id) == ("p0", "d0")
    assert d.pull is not None and (d.pull.holder.node_id, d.pull.tokens) == ("d1", 960)
    assert d.prefill_work == pytest.approx(policy.pull_work(L, 0, 960))
    assert d.predicted_ttft < policy.work(L, 0)  # cheaper than computing it
    # a node that holds part of it pulls only the difference
    part = policy.choose(PROMPT, nodes, cached={"d1": 960, "p0": 480})
    assert part.pull.tokens == 960 and part.prefill_work == pytest.approx(policy.pull_work(L, 480, 960))
    # off: nothing is pulled
    assert CacheAware(CacheAwareWeights(prefix_pull=0)).choose(PROMPT, nodes, cached={"d1": 960}).pull is None
    # a short prefix is not worth the round trip
    assert policy.choose(PROMPT, nodes, cached={"d1": 32}).pull is None
    # a holder with tensor-parallel ranks serves no pulls
    from splitserve.common.kv_compat import KVCompat
    kv2 = KVCompat(model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, tp=2)
    ranked = [nodes[0], nodes[1], node("d1", "decode", running=40, kv_usage=0.9)._replace(kv=kv2)
              if hasattr(NodeInfo, "_replace") else None]
    ranked[2] = NodeInfo(node_id="d1", role="decode", http_addr="http://d1:1", model="m", epoch="e", kv=kv2,
                         load=NodeLoad(running=40, kv_usage=0.9))
    assert policy.choose(PROMPT, ranked, cached={"d1": 960}).pull is None


def test_a_pull_is_priced_with_what_its_holder_serves_and_how_fast_it_copies():
    """The holder's side of a pull (router/routing/pull_cost.py): the pulls it serves already
    share its copies and link with one more, and while it runs requests it copies at a tenth
    of its steps (the rate it reports). Past a point, computing the prefix is cheaper."""
    from splitserve.router.routing.tier_cost import RECOMPUTE_BYTES_PER_S

    def fleet(**holder) -> list[NodeInfo]:
        return [node("p0"), node("d0", "decode"), node("d1", "decode", running=40, kv_usage=0.9, **holder)]

    policy = CacheAware()
    idle_rate = 100 * RECOMPUTE_BYTES_PER_S  # a block copied out in 1% of its recompute time
    # serving seven pulls, its copies slowed to a share of its steps (it reports a tenth of the
    # rate): computing the prefix wins
    slow = policy.choose(PROMPT, fleet(pulls_serving=7, pull_bytes_per_s=idle_rate / 10), cached={"d1": 960})
    assert slow.pull is None and slow.prefill_work == pytest.approx(policy.work(L, 0))
    plain = policy.choose(PROMPT, fleet(), cached={"d1": 960})
    assert plain.pull is not None and plain.pull.share == 1 and plain.pull.copy_ratio == 0.0
    # fast copies and nobody else pulling: the copy costs ~1% of the work saved
    fast = policy.choose(PROMPT, fleet(pull_bytes_per_s=idle_rate), cached={"d1": 960})
    assert fast.pull is not None and fast.pull.copy_ratio == pytest.approx(0.01)
    assert fast.prefill_work == pytest.approx(policy.pull_work(L, 0, 960, ratio=0.01))
    # seven pulls served already: eight share its link and copies
    crowded = policy.choose(PROMPT, fleet(pulls_serving=7, pull_bytes_per_s=idle_rate), cached={"d1": 960})
    assert crowded.pull is not None and (crowded.pull.share, crowded.pull.copy_ratio) == (8, pytest.approx(0.08))
    assert crowded.prefill_work > fast.prefill_work


def test_a_burst_stops_pulling_from_a_holder_its_own_pulls_crowd():
    """Between two heartbeats the router counts its own pulls from a holder until their first
    token (Dispatcher.pulls), like the pulls the holder reports: a burst of one prefix pulls
    it until one more pull would cost more than computing it, then computes it."""
    nodes = [node("p0"), node("p1"), node("d0", "decode"), node("d1", "decode", running=40, kv_usage=0.9)]
    policy, pulls = CacheAware(), Counter()
    pulled = []
    for _ in range(30):
        d = policy.choose(PROMPT, nodes, cached={"d1": 960}, pulls=pulls)
        pulled.append(d.pull is not None)
        if d.pull is not None:
            pulls[d.pull.holder.node_id] += 1
    assert pulled[0] and not pulled[-1]
    first_no = pulled.index(False)
    assert all(pulled[:first_no]) and not any(pulled[first_no:])  # the holder's pulls only grow here
    share = pulls["d1"] + 1  # what one more pull would share the holder's link with
    assert policy.pull_work(L, 0, 960, share=share) >= policy.work(L, 0)


def test_a_hot_prefix_spreads_by_pulls_instead_of_recompute():
    """A burst of one prefix held by p0: once p0's queue outweighs the hit, the idle nodes
    pull the prefix from p0 instead of computing it, so each request costs them ~40 tokens
    of work plus the pull, not 1000."""
    nodes = [node("p0"), node("p1"), node("p2"), node("d0", "decode")]
    policy, inflight, tokens = CacheAware(), Counter(), Counter()
    cached = {"p0": 960}
    picks, pulls = [], Counter()
    for _ in range(60):
        d = policy.choose(PROMPT, nodes, inflight, cached=cached, inflight_tokens=tokens)
        p = d.prefill.node_id
        picks.append(p)
        inflight[p] += 1
        tokens[p] += round(d.prefill_work)
        if d.pull is not None:
            assert (d.pull.holder.node_id, p) != ("p0", "p0")
            pulls[p] += 1
    count = Counter(picks)
    assert picks[:2] == ["p0"] * 2  # affinity first
    assert pulls["p1"] == count["p1"] > 0 and pulls["p2"] == count["p2"] > 0  # every one of theirs pulled
    # no hot spot: the load on each node (work queued, requests) stays within one pulled request
    # of the others; the holder takes more requests because each costs it less
    loads = [tokens[n] + policy.w.prefill_request * inflight[n] for n in ("p0", "p1", "p2")]
    assert max(loads) - min(loads) <= policy.pull_work(L, 0, 960) + policy.w.prefill_request


def test_equal_nodes_take_turns_and_no_decode_node_is_none():
    nodes = [node("p0"), node("p1"), node("d0", "decode"), node("d1", "decode")]
    policy = CacheAware()
    picks = Counter(pick(policy, nodes, {}) for _ in range(4))
    assert picks == {("p0", "d0"): 2, ("p1", "d1"): 2}
    assert policy.choose(PROMPT, [node("p0")]) is None


def test_weights_are_configurable():
    nodes = [node("p0", queued_prefill_tokens=100), node("p1"), node("d0", "decode")]
    assert pick(CacheAware(), nodes, {"p0": 960})[0] == "p0"
    # a policy told that cached tokens save nothing routes by load alone
    blind = CacheAware(CacheAwareWeights(cached_token=0.0))
    assert pick(blind, nodes, {"p0": 960})[0] == "p1"
    w = CacheAwareWeights.parse("prefill_request=8, transfer=0.5")
    assert (w.prefill_request, w.transfer, w.decode_request) == (8.0, 0.5, 64.0)
    for bad in ("nope=1", "transfer", "transfer=x", "cached_token=2", "kv_usage=-1"):
        with pytest.raises(ValueError, match="weight"):
            CacheAwareWeights.parse(bad)


def test_decisions_settle_into_hits_and_mispredictions():
    metrics = RouterMetrics.create("test-model")
    log = DecisionLog(metrics)
    d = Decision(node("p0"), node("d0", "decode"))
    hits = PrefixHits({"p0": 64, "d0": 32}, num_blocks=10, looked_up=True)
    rec = log.record("r1", "cache_aware", d, 170, hits, 0.001)
    assert rec.predicted_cached_tokens == 64  # the prefill node's hit
    local = DecisionLog(RouterMetrics.create("test-model")).record("r0", "cache_aware", Decision(None, node("d0", "decode")), 170, hits, 0.001)
    assert local.predicted_cached_tokens == 32  # no prefill node: the decode node's hit
    log.settle(rec, 64, 0.25)
    assert rec.delivered_ttft_s == 0.25 and rec.predicted_ttft is None  # a hand-made Decision predicts nothing
    timed = CacheAware(CacheAwareWeights(token_s=1e-4)).choose(PROMPT, [node("p0"), node("d0", "decode")])
    trec = log.record("rt", "cache_aware", timed, L, PrefixHits({}, 62, True), 0.001)
    assert trec.predicted_ttft_s == pytest.approx(timed.predicted_ttft * 1e-4) and trec.predicted_ttft > L
    stale = log.record("r2", "cache_aware", d, 170, hits, 0.001)
    log.settle(stale, 32)  # the prefill node no longer held it
    log.settle(log.record("r3", "cache_aware", d, 170, PrefixHits({}, 10, True), 0.001), 16)
    log.settle(log.record("r4", "cache_aware", d, 170, PrefixHits({}, 10, False), 0.001), 16)
    failed = log.record("r5", "cache_aware", d, 170, hits, 0.001)
    log.settle(failed, None)
    outcomes = [r.outcome for r in log.last(10)]
    assert outcomes == ["hit", None, "miss", "unseen", None, "failed"]
    assert metrics.predictions.labels(outcome="miss")._value.get() == 1
    assert metrics.prediction_hit_rate._value.get() == 0.5
    assert metrics.predicted_cached_tokens.labels(tier="device")._value.get() == 64 * 3


def test_tie_key_breaks_ties_the_same_way_in_every_router():
    """Router replicas choose alike among equal nodes: the tie follows the prompt's key,
    not each router's own counter; different keys still spread."""
    nodes = [node(f"p{i}") for i in range(4)] + [node(f"d{i}", "decode") for i in range(4)]
    a, b = CacheAware(), CacheAware()
    b._tie = itertools.count(3)  # b's counter is ahead of a's (as after other requests)
    # Both decide at the same moments: their recent work then decays alike (on a slow machine
    # b's later clock would make its balance terms differ from a's by more than a tie).
    for key in range(8):
        assert pick(a, nodes, {}, tie_key=key, now=100.0 + key) == pick(b, nodes, {}, tie_key=key, now=100.0 + key)
    assert len({pick(a, nodes, {}, tie_key=k, now=200.0 + k)[0] for k in range(8)}) == 4


def test_a_node_joining_a_busy_pool_takes_its_share_not_every_prompt():
    """The balance term counts work sent over minutes. A node the pool grew by starts at the
    others' mean: counted from zero it would be the only node under the mean, and the others
    would pay for their whole excess (it took every prompt for minutes)."""
    pool = [node(f"p{i}") for i in range(4)] + [node("d0", "decode")]
    policy, inflight, tokens = CacheAware(CacheAwareWeights(prefix_pull=0)), Counter(), Counter()

    def route(nodes, n: int, now: float) -> Counter:
        got: Counter = Counter()
        for _ in range(n):
            p = policy.choose(PROMPT, nodes, inflight, inflight_tokens=tokens, now=now).prefill.node_id
            got[p] += 1
            inflight[p] += 1
            tokens[p] += L
        return got

    for k in range(10):  # busy minutes: each prompt computed before the next batch of 8
        route(pool, 8, now=10.0 * k)
        inflight.clear()
        tokens.clear()
    joined = [node("p4"), *pool]
    got = route(joined, 10, now=100.0)  # ten prompts at once: queues build on every node
    assert got["p4"] <= 3 and len(got) == 5, got  # its share (two), not all ten
    assert policy.recent.get("p4", 100.0) == pytest.approx(policy.recent.get("p0", 100.0), rel=0.5)

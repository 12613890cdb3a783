"""cache_aware prices a prefix hit by the tier holding it (router/routing/tier_cost.py): the
ratios from a node's heartbeat tiers (defaults where it reports none), device hit <
host hit < disk hit < recompute when the rates say so, a host hit above recompute
when host memory loads slower than the node prefills, never a lower-tier hit below
the same device hit; the decision records its hit by tier for /debug/decisions and
counts predicted tokens by tier."""

import msgspec
import pytest

from splitserve.common.kv_events import Tier
from splitserve.common.kv_tier_stats import TierStats
from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.routing.decisions import DecisionLog
from splitserve.router.metrics import RouterMetrics
from splitserve.router.routing.node_terms import RoleTerms
from splitserve.router.routing.policy import Decision
from splitserve.router.routing.prefix_mirror import PrefixHits
from splitserve.router.routing.tier_cost import (DISK_LOAD_BYTES_PER_S, HOST_LOAD_BYTES_PER_S,
                                         RECOMPUTE_BYTES_PER_S, TierBlocks, TierCost, tier_cost)

BS = 16
L = 2048  # prompt tokens
PROMPT = list(range(L))
HIT_BLOCKS = 96
HIT = HIT_BLOCKS * BS
BLOCK_BYTES = 2 << 20


def stats(tier: Tier, load: float = 0.0) -> TierStats:
    return TierStats(tier=tier, capacity_blocks=1000, used_blocks=10, block_bytes=BLOCK_BYTES,
                     load_bytes_per_s=load)


def node(node_id: str, role: str = "prefill", device: float = 0.0, host: float | None = None,
         disk: float | None = None) -> NodeInfo:
    """A node reporting its device tier (load rate ``device``: its prefill rate) and, when
    given, a host and a disk tier with those load rates (0.0: not measured yet)."""
    tiers = [stats(Tier.DEVICE, device)]
    tiers += [stats(t, rate) for t, rate in ((Tier.HOST, host), (Tier.DISK, disk)) if rate is not None]
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model="m", epoch="e",
                    block_size=BS, tiers=tiers)


def all_in(tier: Tier, blocks: int = HIT_BLOCKS) -> TierBlocks:
    counts = [0, 0, 0]
    counts[tier] = blocks
    return TierBlocks(*counts)


def test_ratios_from_the_heartbeat_and_the_defaults_where_none():
    bare = NodeInfo(node_id="old", role="prefill", http_addr="http://old:1", model="m", epoch="e")
    host = RECOMPUTE_BYTES_PER_S / HOST_LOAD_BYTES_PER_S
    default = TierCost(host, RECOMPUTE_BYTES_PER_S / DISK_LOAD_BYTES_PER_S + host)  # disk: read, then as host
    assert tier_cost(bare) == pytest.approx(default)  # no tiers at all: a node from before tiers
    assert tier_cost(node("unmeasured", host=0.0, disk=0.0)) == pytest.approx(default)
    assert default.host < default.disk < 1.0  # with nothing measured: device < host < disk < recompute
    prefill_only = tier_cost(node("p", device=8e9))  # its prefill rate, the tiers' defaults
    assert prefill_only == pytest.approx(TierCost(8e9 / HOST_LOAD_BYTES_PER_S,
                                                  8e9 / DISK_LOAD_BYTES_PER_S + 8e9 / HOST_LOAD_BYTES_PER_S))
    assert tier_cost(node("m", device=4e9, host=40e9, disk=2e9)) == pytest.approx(TierCost(0.1, 2.1))
    mixed = TierBlocks(device=4, host=3, disk=1)
    assert mixed.total == 8 and mixed.lower == 4
    assert TierCost(0.1, 2.0).of(mixed) == pytest.approx((3 * 0.1 + 2.0) / 4)
    assert TierCost(0.1, 2.0).of(TierBlocks(device=5)) == 0.0


def test_device_hit_below_host_below_disk_below_recompute():
    policy = CacheAware()
    p = node("p")  # rates unknown: the defaults
    cost = {tier: policy.prefill_cost(p, L, {"p": HIT}, {}, {}, {"p": all_in(tier)}) for tier in Tier}
    recompute = policy.prefill_cost(p, L, {}, {}, {})
    assert cost[Tier.DEVICE] == pytest.approx(policy.work(L, HIT))  # as the router always priced a hit
    assert cost[Tier.DEVICE] < cost[Tier.HOST] < cost[Tier.DISK] < recompute
    # the policy chooses by the same order among equally loaded holders
    d = node("d", "decode")
    nodes = [node("none"), node("disk"), node("host"), node("dev"), d]
    tiers = {"dev": all_in(Tier.DEVICE), "host": all_in(Tier.HOST), "disk": all_in(Tier.DISK)}
    cached = dict.fromkeys(tiers, HIT)
    order = []
    while len(nodes) > 1:
        chosen = CacheAware().choose(PROMPT, nodes, cached=cached, tiers=tiers)
        assert chosen is not None and chosen.prefill is not None
        order.append(chosen.prefill.node_id)
        nodes.remove(chosen.prefill)
    assert order == ["dev", "host", "disk", "none"]


def test_a_host_slower_than_prefill_costs_more_than_recomputing():
    policy = CacheAware()
    slow = node("slow", device=4e9, host=2e9)  # host memory loads at half the prefill rate
    even = node("even", device=4e9, host=4e9)  # as fast as recomputing
    host_hit = {"slow": all_in(Tier.HOST), "even": all_in(Tier.HOST)}
    cached = {"slow": HIT, "even": HIT}
    recompute = policy.prefill_cost(slow, L, {}, {}, {})
    assert policy.prefill_cost(slow, L, cached, {}, {}, host_hit) > recompute
    assert policy.prefill_cost(even, L, cached, {}, {}, host_hit) == pytest.approx(recompute)
    chosen = CacheAware().choose(PROMPT, [slow, node("cold"), node("d", "decode")], cached=cached,
                                 tiers=host_hit)
    assert chosen is not None and chosen.prefill is not None and chosen.prefill.node_id == "cold"
    # disk slower than prefill too, host faster: a split hit sits between
    fast_host = node("f", device=4e9, host=40e9, disk=1e9)
    split = {"f": TierBlocks(device=32, host=32, disk=32)}
    on_device = policy.prefill_cost(fast_host, L, {"f": HIT}, {}, {})
    assert on_device < policy.prefill_cost(fast_host, L, {"f": HIT}, {}, {}, split)


@pytest.mark.parametrize("host_rate", [1e15, 50e9, 1e9])
def test_a_lower_tier_hit_never_costs_less_than_the_same_device_hit(host_rate):
    policy = CacheAware()
    p = node("p", device=4e9, host=host_rate, disk=host_rate)
    on_device = policy.prefill_cost(p, L, {"p": HIT}, {}, {})
    for split in (all_in(Tier.HOST), all_in(Tier.DISK), TierBlocks(50, 40, 6)):
        assert policy.prefill_cost(p, L, {"p": HIT}, {}, {}, {"p": split}) >= on_device
    # the decode node's side: a hit it holds below the device is loaded, not free
    d = RoleTerms.of([node("d", "decode", device=4e9, host=host_rate)])
    for local in (False, True):  # receiving the rest, or prefilling it itself
        on_device = policy.decode_costs(d, L, {"d": HIT}, {}, local)[0]
        assert policy.decode_costs(d, L, {"d": HIT}, {}, local, tiers={"d": all_in(Tier.HOST)})[0] >= on_device


def test_the_decision_carries_the_load_in_its_work_and_ttft():
    policy = CacheAware()
    p, d = node("p", device=4e9, host=1e9), node("d", "decode")
    tiers = {"p": all_in(Tier.HOST)}
    chosen = policy.choose(PROMPT, [p, d], cached={"p": HIT}, tiers=tiers)
    assert chosen is not None and chosen.prefill is p
    want = policy.work(L, HIT) + policy.lower_load(L, HIT, p, tiers["p"])
    assert chosen.prefill_work == pytest.approx(want) and want > policy.work(L, HIT)


def test_decisions_show_and_count_the_predicted_hit_by_tier():
    metrics = RouterMetrics.create("m")
    log = DecisionLog(metrics)
    p, d = node("p"), node("d", "decode")
    hits = PrefixHits({"p": HIT, "d": 4 * BS}, L // BS, True,
                      {"p": TierBlocks(60, 30, 6), "d": TierBlocks(4)})
    rec = log.record("r1", "cache_aware", Decision(p, d), L, hits, 0.001)
    assert rec.predicted_cached_tokens == HIT
    assert rec.predicted_hit_blocks_by_tier == {"device": 60, "host": 30, "disk": 6}
    shown = msgspec.json.decode(msgspec.json.encode(rec))
    assert shown["predicted_hit_blocks_by_tier"] == {"device": 60, "host": 30, "disk": 6}
    local = log.record("r2", "cache_aware", Decision(None, d), L, hits, 0.001)  # the decode node prefills
    assert local.predicted_hit_blocks_by_tier == {"device": 4, "host": 0, "disk": 0}
    miss = log.record("r3", "cache_aware", Decision(p, d), L, PrefixHits({}, L // BS, True), 0.001)
    assert miss.predicted_hit_blocks_by_tier == {"device": 0, "host": 0, "disk": 0}
    unknown = log.record("r4", "cache_aware", Decision(p, d), L, PrefixHits({}, L // BS, False), 0.001)
    assert unknown.predicted_hit_blocks_by_tier is None and unknown.predicted_cached_tokens is None
    tokens = {t: metrics.predicted_cached_tokens.labels(tier=t)._value.get() for t in ("device", "host", "disk")}
    assert tokens == {"device": 60 * BS + 4 * BS, "host": 30 * BS, "disk": 6 * BS}
    text = metrics.render()[0].decode()
    assert 'tier="disk"' in text and 'tier="host"' in text


def test_decode_side_reuse_prices_the_history_a_decode_node_holds_below_its_device_by_its_load():
    """Issue 53 (5): a decode node holding a long conversation on its disk and a short new turn.
    Prefilling that turn there loads the whole history from disk first, about as dear as
    recomputing it, while the node's running decodes wait: a prefill node takes the turn. The
    same history on the device stays there (decode-side reuse), and so does a shorter one in
    host memory, whose load costs less than ``local_prefill_tokens`` of prefill."""
    history, new = 10_000, 100  # 625 blocks held by the decode node, 100 tokens it lacks
    prompt = list(range(history + new))
    d = node("d", "decode", device=RECOMPUTE_BYTES_PER_S, host=HOST_LOAD_BYTES_PER_S, disk=DISK_LOAD_BYTES_PER_S)
    nodes = [node("p"), d]
    policy = CacheAware()
    on_disk = policy.choose(prompt, nodes, cached={"d": history}, tiers={"d": all_in(Tier.DISK, history // BS)})
    assert on_disk is not None and on_disk.prefill is not None and on_disk.decode is d
    assert policy.local_work(len(prompt), history, d, all_in(Tier.DISK, history // BS)) > 8 * new
    on_device = policy.choose(prompt, nodes, cached={"d": history}, tiers={"d": all_in(Tier.DEVICE, history // BS)})
    assert on_device is not None and (on_device.prefill, on_device.decode) == (None, d)
    short = list(range(2000 + new))  # 2000 tokens in host memory: ~170 tokens of prefill to load
    in_host = policy.choose(short, nodes, cached={"d": 2000}, tiers={"d": all_in(Tier.HOST, 2000 // BS)})
    assert in_host is not None and (in_host.prefill, in_host.decode) == (None, d)

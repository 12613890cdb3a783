"""cache_aware's vectorised cost (router/routing/node_terms.py arrays, recent work on one time
base) makes the same decisions as the formula written out node by node, the way the
policy computed it before (one ``exp`` per node for the recent work, a Python loop
per node): on random fleets with random heartbeat loads, in-flight work, predicted
hits and recent work, over a stream of decisions that each feed the balance term
(a router alone counts its work at once, as the node-by-node formula does). And
router replicas that hear each other's work late still decide alike once it
counts only after the settle time."""

import itertools
import math
import random
import time
from collections import Counter

import pytest

from splitserve.common.load import NodeLoad
from splitserve.common.node_registry import NodeInfo
from splitserve.router.routing.cache_aware import CacheAware
from splitserve.router.config import CacheAwareWeights
from splitserve.router.routing.tier_cost import RECOMPUTE_BYTES_PER_S


class NodeByNode:
    """The reference: the module docstring's cost, one node at a time."""

    def __init__(self, w: CacheAwareWeights):
        self.w, self.tie = w, itertools.count()
        self.rate = math.log(2) / w.balance_half_life_s
        self.recent: dict[str, tuple[float, float]] = {}  # node_id -> (value, time of value)
        self.seen: set[str] = set()  # sent work, or welcomed at the mean of the others

    def get(self, nid, now):
        value, at = self.recent.get(nid, (0.0, now))
        return value * math.exp(-self.rate * (now - at))

    def merge(self, nid, tokens, at):
        self.seen.add(nid)
        self.recent[nid] = (self.get(nid, at) + tokens, at)

    def welcome(self, prefills, now):
        old = [p.node_id for p in prefills if p.node_id in self.seen]
        new = [p.node_id for p in prefills if p.node_id not in self.seen]
        mean = sum(self.get(nid, now) for nid in old) / len(old) if old else 0.0
        self.seen.update(new)
        for nid in new:
            if mean > 0:
                self.merge(nid, mean, now)

    def work(self, L, hit):
        new, ctx = L - self.w.cached_token * hit, self.w.cached_token * hit
        return new + self.w.attention * new * (ctx + new / 2)

    def load(self, n, inflight, tokens, per_request, queue):
        reqs = max(n.load.running + n.load.waiting, inflight.get(n.node_id, 0))
        cost = per_request * reqs + self.w.kv_usage * n.load.kv_usage
        return cost + max(n.load.queued_prefill_tokens, tokens.get(n.node_id, 0)) if queue else cost

    def holder(self, L, nodes, cached, pulls):
        """The node caching the longest prefix (among equals the one a pull from costs least,
        the first such in ``cached``), with it and its pull's share and copy ratio."""
        ids = {n.node_id: n for n in nodes}
        best = (None, 0, 1, 0.0)
        for nid, hit in cached.items():
            if not self.w.prefix_pull or nid not in ids or not hit or hit < best[1]:
                continue
            n = ids[nid]
            share = 1 + max(n.load.pulls_serving, pulls.get(nid, 0))
            ratio = share * RECOMPUTE_BYTES_PER_S / n.load.pull_bytes_per_s if n.load.pull_bytes_per_s else 0.0
            plan = (n, hit, share, ratio)
            if hit > best[1] or self._pull_of(L, 0, plan) < self._pull_of(L, 0, best):
                best = plan
        return best

    def _pull_of(self, L, hit, held):
        h, H, share, ratio = held
        return (self.work(L, H) + self.w.transfer * share * (H - hit) + self.w.pull_request
                + ratio * (self.work(L, hit) - self.work(L, H)))

    def pull(self, n, L, cached, held):
        h, H = held[:2]
        hit = cached.get(n.node_id, 0)
        if h is None or h is n or hit >= H:
            return math.inf
        return self._pull_of(L, hit, held)

    def prefill(self, p, L, cached, inflight, tokens, r, mean, held):
        hit, H = cached.get(p.node_id, 0), held[1]
        excess = self.w.balance * max(0.0, r - mean)
        return (self.load(p, inflight, tokens, self.w.prefill_request, True)
                + min(self.work(L, hit) + excess * (L - hit) / L,
                      self.pull(p, L, cached, held) + excess * (L - H) / L))

    def decode(self, d, L, cached, inflight, tokens, local, held):
        cost = self.load(d, inflight, tokens, self.w.decode_request, local)
        hit = cached.get(d.node_id, 0)
        if local:
            return cost + min(self.work(L, hit), self.pull(d, L, cached, held))
        return cost + self.w.transfer * (L - hit)

    def choose(self, L, nodes, inflight, cached, tokens, tie_key, now, pulls):
        prefills = [n for n in nodes if n.role == "prefill"]
        decodes = [n for n in nodes if n.decode_capable]
        self.welcome(prefills, now)  # a node joining the pool starts at the others' mean
        if not decodes:
            return None
        turn = next(self.tie) if tie_key is None else tie_key
        held = self.holder(L, nodes, cached, pulls)
        recent = [self.get(p.node_id, now) for p in prefills]
        mean = sum(recent) / len(recent) if recent else 0.0
        prefill, p_cost = cheapest(prefills, [self.prefill(p, L, cached, inflight, tokens, r, mean, held)
                                              for p, r in zip(prefills, recent)], turn)
        local = not prefills
        decode, d_cost = cheapest(decodes, [self.decode(d, L, cached, inflight, tokens, local, held)
                                            for d in decodes], turn)
        if prefill is not None and self.w.local_prefill_tokens > 0:
            near = [d for d in decodes
                    if 0 < cached.get(d.node_id, 0) and L - cached[d.node_id] <= self.w.local_prefill_tokens]
            alone, a_cost = cheapest(near, [self.decode(d, L, cached, inflight, tokens, True, held)
                                            for d in near], turn)
            if alone is not None and a_cost < p_cost + d_cost + self.w.remote_prefill:
                prefill, decode = None, alone
        if prefill is not None:
            self.merge(prefill.node_id, min(self.work(L, cached.get(prefill.node_id, 0)),
                                            self.pull(prefill, L, cached, held)), now)
        return (prefill.node_id if prefill else None, decode.node_id)


def cheapest(nodes, costs, turn):
    if not nodes:
        return None, math.inf
    best = min(costs)
    tied = [n for n, c in zip(nodes, costs) if c <= best + 1e-9]
    return tied[turn % len(tied)], best


def fleet(rng: random.Random) -> list[NodeInfo]:
    def load():  # drawn from few values, so that equal nodes (exact ties) are common
        return NodeLoad(running=rng.choice([0, 0, 1, 3, 20]), waiting=rng.choice([0, 0, 2]),
                        queued_prefill_tokens=rng.choice([0, 0, 500, rng.randrange(100_000)]),
                        kv_usage=rng.choice([0.0, 0.0, 0.5, rng.random()]),
                        pulls_serving=rng.choice([0, 0, 3, 8]),
                        pull_bytes_per_s=rng.choice([0.0, 0.0, 0.5, 5.0, 100.0]) * RECOMPUTE_BYTES_PER_S)
    nodes = [NodeInfo(node_id=f"p{i}", role="prefill", http_addr="http://h:1", model="m", epoch="e",
                      load=load()) for i in range(rng.choice([0, 1, 2, 5, 16, 64]))]
    nodes += [NodeInfo(node_id=f"d{i}", role=rng.choice(["decode", "decode", "colocated"]),
                       http_addr="http://h:1", model="m", epoch="e", load=load())
              for i in range(rng.choice([1, 2, 4, 16]))]
    rng.shuffle(nodes)
    return nodes


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_cost_decides_as_node_by_node(seed, monkeypatch):
    rng = random.Random(seed)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # both sides at the same instants
    decisions = 0
    for _ in range(40):
        w = CacheAwareWeights(local_prefill_tokens=rng.choice([0.0, 0.0, 512.0]), prefix_pull=rng.choice([0.0, 1.0]),
                              balance=rng.choice([0.0, 2.0, 4.0]), balance_half_life_s=rng.choice([30.0, 300.0]))
        new, ref = CacheAware(w), NodeByNode(w)
        nodes = fleet(rng)
        for n in nodes:  # recent work of various ages, the same on both sides
            if n.role == "prefill" and rng.random() < 0.7:
                for _ in range(rng.randrange(1, 4)):
                    tokens, at = rng.uniform(100, 1e6), clock[0] - rng.uniform(0, 900)
                    new.recent.merge(n.node_id, tokens, at)
                    ref.merge(n.node_id, tokens, at)
        for _ in range(25):
            clock[0] += rng.choice([0.0, 0.001, 0.5, 20.0])
            L = rng.choice([1, 16, 300, 4096, rng.randrange(1, 130_000)])
            holders = rng.sample(nodes, rng.randrange(min(len(nodes), 5) + 1))
            cached = {n.node_id: rng.randrange(0, L) for n in holders}
            inflight = Counter({n.node_id: rng.randrange(0, 6) for n in rng.sample(nodes, len(nodes) // 3)})
            tokens = Counter({nid: rng.randrange(0, 50_000) for nid in inflight})
            key = rng.choice([None, rng.getrandbits(64)])
            live = rng.choice([nodes, [n for n in nodes if rng.random() < 0.9]])  # a node left out
            pulls = Counter({n.node_id: rng.randrange(1, 6) for n in holders if rng.random() < 0.3})
            d = new.choose(range(L), live, inflight, cached=cached, inflight_tokens=tokens, tie_key=key,
                           pulls=pulls)
            want = ref.choose(L, live, inflight, cached, tokens, key, clock[0], pulls)
            if want is None:
                assert d is None
                continue
            assert (d.prefill.node_id if d.prefill else None, d.decode.node_id) == want
            decisions += 1
    assert decisions > 500


def test_recent_work_rebases_without_changing_values():
    """Far past the time base (64 half-lives), entries are rescaled to a new base: the
    values read the same, and no growth factor overflows after a long idle router."""
    w = CacheAwareWeights(balance_half_life_s=1.0)
    new, ref = CacheAware(w), NodeByNode(w)
    for at, nid, tokens in [(0.0, "p0", 1e6), (10.0, "p1", 5e5), (70.0, "p0", 2e3), (5000.0, "p2", 7.0),
                            (4999.5, "p1", 3.0)]:
        new.recent.merge(nid, tokens, at)
        ref.merge(nid, tokens, at)
    for nid in ("p0", "p1", "p2", "p9"):
        assert new.recent.get(nid, 5001.0) == pytest.approx(ref.get(nid, 5001.0), rel=1e-12, abs=1e-300)
    assert new.recent.get("p2", 5000.0) == pytest.approx(7.0)


def test_replicas_hearing_each_other_late_decide_alike(monkeypatch):
    """Two routers take alternate requests; each hears the other's decisions 30 ms
    late (a loaded pub/sub). Counting work at once, a router sometimes weighs its own
    last decision that the other has not heard yet and they differ; with the settle
    time above the delay, both weigh the same work and agree on every request."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def run(settle_s: float) -> float:
        rng = random.Random(7)
        nodes = [NodeInfo(node_id=f"p{i}", role="prefill", http_addr="http://h:1", model="m", epoch="e",
                          load=NodeLoad(queued_prefill_tokens=rng.randrange(3000))) for i in range(16)]
        nodes += [NodeInfo(node_id=f"d{i}", role="decode", http_addr="http://h:1", model="m", epoch="e")
                  for i in range(4)]
        w = CacheAwareWeights(balance_settle_s=settle_s)
        routers = [CacheAware(w), CacheAware(w)]
        for r in routers:
            r.recent.replicas = True  # as shared_work.py sets once it hears the other
        in_flight: list[tuple[float, int, str, float]] = []  # (arrival, receiving router, node, work)
        same = 0
        for i in range(400):
            clock[0] += 0.005  # 200 requests/s
            for item in [m for m in in_flight if m[0] <= clock[0]]:
                in_flight.remove(item)
                routers[item[1]].recent.merge(item[2], item[3], item[0] - 0.03)
            serve, other = routers[i % 2], routers[1 - i % 2]
            L = rng.choice([2000, 8000, 30000])
            cached = {f"p{rng.randrange(16)}": L // 2}
            peek = CacheAware(w)
            peek.recent = other.recent.copy()
            d = serve.choose(range(L), nodes, cached=cached, tie_key=i)
            o = peek.choose(range(L), nodes, cached=cached, tie_key=i)
            same += d.prefill.node_id == o.prefill.node_id
            in_flight.append((clock[0] + 0.03, 1 - i % 2, d.prefill.node_id, d.prefill_work))
        return same / 400

    assert run(0.0) < 0.99  # the last decisions not heard yet make them differ
    assert run(0.1) == 1.0

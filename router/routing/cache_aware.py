"""The cache_aware routing policy: prefix-cache hits weighed against load, in one
unit, so that cache affinity never creates a hot spot.

Owns the cost formula. Must not do I/O: the predicted hits come from the prefix
mirror's lookup (router/routing/prefix_mirror.py) that dispatch runs before ``choose``.

Every term is in token-equivalents (1.0 = the time to prefill one prompt token);
weights ``w`` are `CacheAwareWeights` (RouterConfig.weights, ``--score-weights``)::

    L       prompt tokens
    C(n)    predicted cached prompt tokens on node n (leading blocks it holds in any
            tier, from the index, capped so that one token is always computed)
    work(C) prefill work with c = w.cached_token * C of the prompt cached: each new
            token, plus its attention over the context before it,
              work(C) = (L - c) + w.attention * (L - c) * (c + (L - c) / 2)
            (``attention`` is the fitted ratio of the two costs; without it a long
            cached prefix would look worth only its length, though it also saves
            the new tokens' attention over it)
    X(n)    the load of C(n)'s blocks held only below the device (host memory, disk):
            each costs r(t) of the work recomputing it would, r(t) = its load time
            over its recompute time at n's measured rates (router/routing/tier_cost.py:
            defaults where n reports none), with C_low(n) the tokens of those blocks
            and r(n) their mean ratio:
              X(n) = r(n) * (work(C(n) - C_low(n)) - work(C(n)))
            0 when n holds the hit on the device; never below 0, so a lower-tier hit
            never costs less than the same hit on the device; above recomputing those
            blocks when the tier loads slower than n prefills (r > 1)
    W(n)    work(C(n)) + X(n)
    reqs(n) max(running + waiting at n's last heartbeat, this router's in flight there)
    u(n)    n's KV usage, 0..1
    R(p)    the W of the requests sent to p (by this router and, through
            router/routing/shared_work.py, its replicas; with replicas, those sent at least
            w.balance_settle_s ago), each decayed with a half-life of
            w.balance_half_life_s (router/routing/recent_work.py); R_mean its mean over the
            prefill nodes. A node the router sees for the first time starts at R_mean (a
            pool grown by a node does not send it every prompt)

    prefill(p) = W(p)                                              work left for p
               + max(queued_prefill_tokens(p), in-flight work)     work ahead of it
               + w.prefill_request * reqs(p) + w.kv_usage * u(p)
               + w.balance * max(0, R(p) - R_mean) * (L - C(p)) / L  recent share over the mean
    decode(d)  = w.transfer * (L - C(d)) + X(d)                    blocks sent to d
               + w.decode_request * reqs(d) + w.kv_usage * u(d)    (or loaded there)
      with no prefill node (d prefills itself), the transfer term is replaced by
               W(d) + max(queued_prefill_tokens(d), in-flight work on d)

    H, h    the longest predicted hit on any node that serves pulls (single-rank), and
            that node (among equals, the one with least of it below its device): with
            w.prefix_pull, a node n computing the prompt may first pull h's prefix
            (node/kv_pull.py) instead of computing it, for
              pull(n) = work(H) + w.transfer * share(h) * (H - C(n)) + w.pull_request + X(h)
                        + ratio(h) * (work(C(n)) - work(H))
            where share(h) is 1 + the pulls h serves (its heartbeat, or this router's pulls
            from it in flight, the larger: they share its copies and its link) and ratio(h)
            its copy of a block for one more pull over recomputing it, from the rate it
            measured (a busy holder copies at a tenth of its steps;
            router/routing/pull_cost.py); so W(n) above is min(W(n), pull(n)) for every n
            but h (balance scaled by H), and for the nodes that can take h's blocks (a
            compatible KV layout; a prefill node of one rank)

    pick (p, d) minimizing prefill(p) + decode(d) + w.remote_prefill
    or, when some decode node d holds part of the prompt and the work it would take on is
    at most w.local_prefill_tokens (the next turn of a conversation it served: decode-side
    reuse), d alone (it prefills itself, no remote hop) if its local cost W(d) + queued(d)
    + decode load is lower. That work is the tokens d lacks plus, for the blocks of C(d) it
    holds only below the device, what loading them costs in prompt tokens, r(d) x C_low(d)
    (tier_cost.py: a disk-held history is about as dear as recomputing it, so a long one on
    d's disk goes to a prefill node instead of stalling d's running decodes while it loads).
    The node that computes then pulls h's prefix when pull(n) was its cheaper W
    (``Decision.pull``)

    predicted TTFT (token-equivalents; x w.token_s = seconds, /debug/decisions):
      remote: W(p) + max(queued(p), in-flight work) + w.prefill_request * reqs(p)
              + w.remote_prefill          local: W(d) + queued_prefill_tokens(d)

The pair cost is a sum of a prefill-only and a decode-only term, so the joint
minimum is the cheapest prefill node with the cheapest decode node: O(P + D), not
O(P x D), and it runs as array operations over the nodes' heartbeat terms
(router/routing/node_terms.py, rebuilt when the node list changes), with the few nodes
holding part of the prompt corrected one by one. The decode term is where the pair
is chosen together: a decode node holding the prefix needs fewer blocks sent (the
prefill node skips them), and the decision's predicted hit is C(p) (C(d) when d
prefills itself), what the response will report: the prompt tokens not computed.

No hot spot: a hit lowers a node's cost by at most the prompt's own work W with
nothing cached, so a node whose load exceeds an idle node's by more than that (a
queue of that much work, or W / w.prefill_request requests) loses even when it
holds the whole prefix. "In-flight work" is the W of the requests this router sent
to p that have not produced their first token yet, always fresh, so a
burst of one prefix between two heartbeats spreads once the holder's queue costs
more than the prefix saves. The queue only sees the present, though: holders of
popular prefixes (a big tenant's system prompt) keep attracting new conversations,
each of which then sticks to them, so their work share grows while every queue
stays short. The balance term charges a node for the work it recently got above
the average, scaled by the share of the prompt it would have to compute: a new
conversation that only shares a system prompt goes elsewhere once the holder runs
ahead, while the next turn of a long conversation it holds (mostly cached) stays.
Equal costs rotate, by ``tie_key`` when the caller gives one (dispatch: the prompt's
last block hash, so every router replica breaks a tie for the same prompt the same
way), else by a counter.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ...common.kv_compat import can_exchange
from ...common.node_registry import NodeInfo
from ..config import CacheAwareWeights
from .kv_pairing import cheapest_pair
from .node_terms import FleetTerms, RoleTerms
from .policy import NO_CACHED, NO_INFLIGHT, NO_TIERS, Decision, PullPlan
from .pull_cost import pull_cost
from .recent_work import RecentWork
from .tier_cost import TierBlocks, tier_cost

_TIE_EPS = 1e-9  # costs this close are equal


class CacheAware:
    name = "cache_aware"
    uses_prefix_index = True

    def __init__(self, weights: CacheAwareWeights | None = None):
        self.w = weights or CacheAwareWeights()
        self._tie = itertools.count()
        self.recent = RecentWork(self.w.balance_half_life_s, self.w.balance_settle_s)
        self._terms: FleetTerms | None = None  # of the last node list routed over

    def choose(self, request_token_ids: Sequence[int], nodes: Sequence[NodeInfo],
               inflight: Mapping[str, int] = NO_INFLIGHT, *,
               cached: Mapping[str, int] = NO_CACHED,
               inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
               tie_key: int | None = None, tiers: Mapping[str, TierBlocks] = NO_TIERS,
               pulls: Mapping[str, int] = NO_INFLIGHT, now: float | None = None,
               **more: object) -> Decision | None:
        """`RoutingPolicy.choose`; ``now``: the monotonic time of the decision (default:
        the clock), which decides what recent work has settled."""
        terms = self._terms
        now = time.monotonic() if now is None else now
        if terms is None or not terms.describes(nodes):
            terms = self._terms = FleetTerms.of(nodes)
            self.recent.welcome(terms.prefill, now)  # a node joining the pool starts at the mean
        prefills, decodes = terms.prefill, terms.decode
        if not decodes.nodes:
            return None
        n = len(request_token_ids)
        turn = next(self._tie) if tie_key is None else tie_key
        local = not prefills.nodes
        held = self.holder(terms, n, cached, tiers, pulls)
        mixed = terms.pairs is not None
        p_costs = self.prefill_costs(prefills, n, cached, inflight, inflight_tokens, now, tiers, held, mixed)
        d_costs = self.decode_costs(decodes, n, cached, inflight, local, inflight_tokens, tiers, held, mixed)
        prefill, p_cost = _cheapest(prefills, p_costs, turn)
        decode, d_cost = _cheapest(decodes, d_costs, turn)
        if prefill is not None and terms.pairs is not None:  # a mixed fleet: only pairs that can exchange KV
            pair = cheapest_pair(terms.pairs, p_costs, d_costs, turn)
            if pair is None:  # no prefill node can send to any decode node: they prefill themselves
                prefill, p_cost = None, 0.0
                decode, d_cost = _cheapest(decodes, self.decode_costs(decodes, n, cached, inflight, True,
                                                                      inflight_tokens, tiers, held, mixed), turn)
            else:
                prefill, decode = prefills.nodes[pair[0]], decodes.nodes[pair[1]]
                p_cost, d_cost = float(p_costs[pair[0]]), float(d_costs[pair[1]])
        assert decode is not None  # decodes is not empty
        if prefill is not None and self.w.local_prefill_tokens > 0:
            # Skip the remote prefill when a decode node holds most of the prompt (decode-side reuse).
            near = RoleTerms.of([d for d in decodes.nodes if 0 < cached.get(d.node_id, 0) and self.local_work(
                n, cached[d.node_id], d, tiers.get(d.node_id)) <= self.w.local_prefill_tokens])
            alone, a_cost = _cheapest(near, self.decode_costs(near, n, cached, inflight, True,
                                                              inflight_tokens, tiers, held, mixed), turn)
            if alone is not None and a_cost < p_cost + d_cost + self.w.remote_prefill:
                prefill, decode = None, alone
        computes = prefill or decode
        hit = cached.get(computes.node_id, 0)
        work = self.work(n, hit) + self.lower_load(n, hit, computes, tiers.get(computes.node_id))
        pull = None
        if (held is not None and held.holder.node_id != computes.node_id and held.tokens > hit
                and math.isfinite(self._pull_costs(RoleTerms.of([computes]), n, cached, held, mixed)[0])):
            pulled = self._pull(n, hit, held)
            if pulled < work:
                pull, work = held, pulled
        if prefill is not None:
            self.recent.add(prefill.node_id, work, now)
            ahead = max(prefill.load.queued_prefill_tokens, inflight_tokens.get(prefill.node_id, 0))
            ttft = (work + ahead + self.w.prefill_request * _requests(prefill, inflight)
                    + self.w.remote_prefill)
        else:
            ttft = work + max(decode.load.queued_prefill_tokens, inflight_tokens.get(decode.node_id, 0))
        return Decision(prefill, decode, work, ttft, ttft * self.w.token_s if self.w.token_s else None, pull)

    def work(self, prompt_len: int, hit: float) -> float:
        """Prefill work of a prompt with ``hit`` tokens cached on the device, in
        token-equivalents: every new token, plus its attention over the context before it."""
        new, ctx = prompt_len - self.w.cached_token * hit, self.w.cached_token * hit
        return new + self.w.attention * new * (ctx + new / 2)

    def pull_work(self, prompt_len: int, hit: int, held: int, holder_load: float = 0.0, share: int = 1,
                  ratio: float = 0.0) -> float:
        """pull(n) of the module docstring: work left after pulling a ``held``-token prefix
        to a node that caches ``hit`` of it, plus moving the difference (over a link ``share``
        pulls share) and the round trip, ``holder_load`` (the holder's loads of the blocks it
        keeps below its device) and the holder's copy, ``ratio`` of the work it saves."""
        saved = self.work(prompt_len, hit) - self.work(prompt_len, held)
        return (self.work(prompt_len, held) + self.w.transfer * share * (held - hit) + self.w.pull_request
                + holder_load + ratio * saved)

    def _pull(self, prompt_len: int, hit: int, held: PullPlan) -> float:
        return self.pull_work(prompt_len, hit, held.tokens, held.holder_load, held.share, held.copy_ratio)

    def holder(self, terms: FleetTerms, prompt_len: int, cached: Mapping[str, int],
               tiers: Mapping[str, TierBlocks] = NO_TIERS, pulls: Mapping[str, int] = NO_INFLIGHT
               ) -> PullPlan | None:
        """(h, H) of the module docstring: the node predicted to hold the longest prefix among
        those that serve pulls (one rank: a node's worker ranks hold the other heads), among
        equals the one a pull from costs least (the part it keeps below its device, the pulls
        it serves, ``pulls``: this router's in flight per holder, its copy rate); None without
        w.prefix_pull or any hit."""
        if not self.w.prefix_pull:
            return None
        best: PullPlan | None = None
        for nid, tokens in cached.items():
            if tokens and (best is None or tokens >= best.tokens):
                node = terms.node(nid)
                if node is None or (node.kv is not None and node.kv.tp != 1):
                    continue
                load = self.lower_load(prompt_len, tokens, node, tiers.get(nid))
                share, ratio = pull_cost(node, pulls.get(nid, 0))
                plan = PullPlan(node, tokens, load, share, ratio)
                if best is None or tokens > best.tokens or self._pull(prompt_len, 0, plan) < self._pull(
                        prompt_len, 0, best):
                    best = plan
        return best

    def _pull_costs(self, terms: RoleTerms, prompt_len: int, cached: Mapping[str, int],
                    held: PullPlan, mixed: bool) -> np.ndarray:
        """[nodes] pull(n) for each node of ``terms``; inf for the holder itself, nodes caching
        at least as much, and nodes that cannot take its blocks (``mixed``: a fleet of several
        KV layouts, where only compatible nodes exchange; a prefill node with worker ranks)."""
        costs = np.full(len(terms.ids), self._pull(prompt_len, 0, held))
        for nid, hit in cached.items():
            i = terms.index.get(nid)
            if i is not None and hit:
                costs[i] = self._pull(prompt_len, hit, held) if hit < held.tokens else math.inf
        for i, node in enumerate(terms.nodes):
            kv = node.kv
            if node is held.holder or (kv is not None and (
                    (node.role == "prefill" and kv.tp > 1) or (mixed and not can_exchange(kv, held.holder.kv)))):
                costs[i] = math.inf
        return costs

    def local_work(self, prompt_len: int, hit: int, node: NodeInfo, split: TierBlocks | None) -> float:
        """The work a decode node holding ``hit`` tokens of the prompt takes on by prefilling it
        itself, in prompt tokens: those it lacks, plus the blocks ``split`` places below its
        device priced at what loading them costs (the decode-side-reuse test of the module
        docstring)."""
        low = hit * split.lower / split.total if split is not None and split.lower else 0.0
        return prompt_len - hit + (tier_cost(node).of(split) * low if split is not None and low else 0.0)

    def lower_load(self, prompt_len: int, hit: int, node: NodeInfo, split: TierBlocks | None) -> float:
        """X(n) of the module docstring: loading the blocks of ``node``'s ``hit`` that
        ``split`` places below the device (None: all on the device, 0.0)."""
        if split is None or not split.lower:
            return 0.0
        low = hit * split.lower / split.total
        return tier_cost(node).of(split) * (self.work(prompt_len, hit - low) - self.work(prompt_len, hit))

    def prefill_costs(self, prefills: RoleTerms, prompt_len: int, cached: Mapping[str, int],
                      inflight: Mapping[str, int], inflight_tokens: Mapping[str, int],
                      now: float, tiers: Mapping[str, TierBlocks] = NO_TIERS,
                      held: PullPlan | None = None, mixed: bool = False) -> np.ndarray:
        """[prefill nodes] prefill(p) of the module docstring: load and balance as array
        operations, every node charged the uncached prompt's work, then the work and
        balance terms corrected for the handful of nodes with a hit; with ``held`` (the
        holder), each node's work is the cheaper of its own and a pull (``mixed``: as
        ``_pull_costs``)."""
        w = self.w
        recent = self.recent.values(prefills, now)  # [nodes]
        mean = float(recent.sum()) / len(recent) if len(recent) else 0.0
        full = self.work(prompt_len, 0)
        loads = _loads(prefills, inflight, inflight_tokens, w.prefill_request, w.kv_usage, True)
        excess = np.maximum(recent - mean, 0.0)
        costs = loads + full + w.balance * excess
        index = prefills.index
        for nid, hit in cached.items():
            i = index.get(nid)
            if i is not None and hit:
                r = float(recent[i])
                costs[i] += (self.work(prompt_len, hit) - full
                             + self.lower_load(prompt_len, hit, prefills.nodes[i], tiers.get(nid))
                             + self.balance_cost(r - mean, prompt_len, hit)
                             - self.balance_cost(r - mean, prompt_len, 0))
        if held is not None:
            pulled = (loads + self._pull_costs(prefills, prompt_len, cached, held, mixed)
                      + w.balance * excess * (prompt_len - held.tokens) / prompt_len)
            costs = np.minimum(costs, pulled)
        return costs

    def prefill_cost(self, p: NodeInfo, prompt_len: int, cached: Mapping[str, int],
                     inflight: Mapping[str, int], inflight_tokens: Mapping[str, int],
                     tiers: Mapping[str, TierBlocks] = NO_TIERS) -> float:
        """prefill(p) without the balance term: p's work for this prompt plus its load."""
        load = _loads(RoleTerms.of([p]), inflight, inflight_tokens, self.w.prefill_request,
                      self.w.kv_usage, True)[0]
        hit = cached.get(p.node_id, 0)
        return self.work(prompt_len, hit) + self.lower_load(prompt_len, hit, p, tiers.get(p.node_id)) + float(load)

    def balance_cost(self, excess: float, prompt_len: int, hit: int) -> float:
        """A node ``excess`` tokens of recent work above the mean pays for it in
        proportion to the new work the request would bring (its uncached share)."""
        return self.w.balance * max(0.0, excess) * (prompt_len - hit) / prompt_len

    def decode_costs(self, decodes: RoleTerms, prompt_len: int, cached: Mapping[str, int],
                     inflight: Mapping[str, int], local_prefill: bool,
                     inflight_tokens: Mapping[str, int] = NO_INFLIGHT,
                     tiers: Mapping[str, TierBlocks] = NO_TIERS, held: PullPlan | None = None,
                     mixed: bool = False) -> np.ndarray:
        """[decode nodes] decode(d) of the module docstring; with ``local_prefill`` d
        prefills itself: its own prefill work (or, with ``held``, a pull's, when cheaper)
        and queue, fresh from this router's in-flight work, replace the transfer."""
        w = self.w
        costs = _loads(decodes, inflight, inflight_tokens, w.decode_request, w.kv_usage, local_prefill)
        index = decodes.index
        if local_prefill:
            own = np.fromiter((self.work(prompt_len, cached.get(nid, 0))
                               + self.lower_load(prompt_len, cached.get(nid, 0), node, tiers.get(nid))
                               for nid, node in zip(decodes.ids, decodes.nodes)), np.float64, len(decodes.ids))
            if held is not None:
                own = np.minimum(own, self._pull_costs(decodes, prompt_len, cached, held, mixed))
            return costs + own
        loads, tr = costs, w.transfer
        costs = loads + tr * prompt_len
        for nid, hit in cached.items():  # the nodes holding part of the prompt: fewer blocks to send
            i = index.get(nid)
            if i is not None and hit:
                costs[i] = loads[i] + tr * (prompt_len - hit)
        for nid, split in tiers.items():  # and the part of it below the device: loaded there
            i = index.get(nid)
            if i is not None and split.lower:
                costs[i] += self.lower_load(prompt_len, cached.get(nid, 0), decodes.nodes[i], split)
        return costs


def _loads(terms: RoleTerms, inflight: Mapping[str, int], inflight_tokens: Mapping[str, int],
           per_request: float, per_kv: float, queue: bool) -> np.ndarray:
    """[nodes] each node's load in token-equivalents: ``per_request`` x requests (the
    larger of its heartbeat and this router's in-flight count) + ``per_kv`` x KV usage,
    plus, with ``queue``, the prefill work ahead (queued prompt tokens or this router's
    in-flight work there, the larger)."""
    cost = per_request * np.maximum(terms.requests, terms.per_node(inflight)) + per_kv * terms.kv_usage
    if queue:
        cost += np.maximum(terms.queued, terms.per_node(inflight_tokens))
    return cost


def _requests(node: NodeInfo, inflight: Mapping[str, int]) -> int:
    return max(node.load.running + node.load.waiting, inflight.get(node.node_id, 0))


def _cheapest(terms: RoleTerms, costs: np.ndarray, turn: int) -> tuple[NodeInfo | None, float]:
    """(the cheapest node, ties rotating with ``turn``, its cost); (None, inf) for none."""
    if not terms.nodes:
        return None, math.inf
    best = float(costs.min())
    tied = np.flatnonzero(costs <= best + _TIE_EPS)
    return terms.nodes[int(tied[turn % len(tied)])], best

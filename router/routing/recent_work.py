"""Recent prefill work per node: the input of cache_aware's balance term
(router/routing/cache_aware.py), the same in every router replica through
router/routing/shared_work.py.

Owns the decayed sums and when an entry starts to count (settling). Must not do
I/O (shared_work.py publishes and merges) or weigh anything (the policy does).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from .node_terms import RoleTerms


class RecentWork:
    """node_id -> prompt tokens sent there to compute, each decaying with a half-life.
    ``listener(node_id, tokens, at)`` hears this router's own additions (router/routing/shared_work.py
    publishes them to the other replicas, whose entries come in through ``merge``).

    Once another router replica has been heard (``replicas``, set by shared_work.py),
    reads at ``now`` count the entries sent by ``now - settle_s``: by then every replica
    has heard them (the pub/sub delay is milliseconds), so replicas deciding at the
    same moment weigh the same work and choose alike; an entry younger than that would
    count on the router that made it and not yet on the others. A router alone counts
    its work at once: the settle time would cost it balance (a prefill that finished
    within it is in neither its in-flight nor its recent work).

    Settled values are kept decayed to one common time base (``_base``), so reading all
    the nodes takes one ``exp`` (the base's decay to now), not one per node; the base
    moves forward (every value rescaled) once it is ``REBASE_HALF_LIVES`` behind a new
    entry, before the growth factor of new entries could overflow. Reads must not go
    back in time (settling is for good)."""

    REBASE_HALF_LIVES = 64.0  # new entries weigh up to 2**64 x on the base: far from overflow

    def __init__(self, half_life_s: float, settle_s: float = 0.0):
        self.rate = math.log(2) / half_life_s
        self.settle_s = settle_s
        self.replicas = False  # another router's work was heard: wait settle_s for everyone's
        self._rebase_s = self.REBASE_HALF_LIVES * half_life_s
        self._work: dict[str, float] = {}  # node_id -> settled value at the monotonic time _base
        self._base: float | None = None
        self._pending: list[tuple[float, str, float]] = []  # heap of (time, node_id, tokens) not settled
        self._seen: set[str] = set()  # nodes welcomed or sent work
        self.listener: Callable[[str, float, float], None] | None = None

    def values(self, terms: RoleTerms, now: float) -> np.ndarray:
        """[nodes] ``get`` of every node of ``terms``."""
        self._settle(now)
        if self._base is None:
            return np.zeros(len(terms.ids))
        return terms.per_node(self._work) * math.exp(self.rate * (self._base - now))

    def get(self, node_id: str, now: float) -> float:
        """The work sent to ``node_id`` by ``now - settle_s``, decayed to ``now``."""
        self._settle(now)
        if self._base is None:
            return 0.0
        return self._work.get(node_id, 0.0) * math.exp(self.rate * (self._base - now))

    def add(self, node_id: str, tokens: float, now: float) -> None:
        self.merge(node_id, tokens, now)
        if self.listener is not None:
            self.listener(node_id, tokens, now)

    def merge(self, node_id: str, tokens: float, at: float) -> None:
        """Add ``tokens`` sent at monotonic time ``at`` (another router's, possibly
        earlier than the last entry: the decay runs from ``at`` either way)."""
        self._seen.add(node_id)
        heapq.heappush(self._pending, (at, node_id, tokens))

    def welcome(self, terms: RoleTerms, now: float) -> None:
        """The nodes of ``terms`` seen for the first time start at the mean of the others'
        recent work, as if they had had their share of it. Counted from zero, a node
        joining a busy pool would be the only one under the mean, and every other node
        would pay the balance term on its whole excess: the newcomer would take every
        prompt until its queue outweighed that (at one new node among four that had
        each been sent X, the others pay 2 x X / 5 each: ~20 prompts' work; a pool
        grown by one node lost TTFT for minutes). Local to this router (the same rule
        in every replica, applied when each first routes over the node)."""
        new = [nid for nid in terms.ids if nid not in self._seen]
        if not new:
            return
        old = [nid for nid in terms.ids if nid in self._seen]
        self._seen.update(new)
        mean = sum(self.get(nid, now) for nid in old) / len(old) if old else 0.0
        if mean > 0:
            for nid in new:
                heapq.heappush(self._pending, (now, nid, mean))

    def copy(self) -> "RecentWork":
        """The same values, without the listener (a what-if choice that records nothing)."""
        out = RecentWork(math.log(2) / self.rate, self.settle_s)
        out._work, out._base, out._pending = dict(self._work), self._base, list(self._pending)
        out._seen = set(self._seen)
        out.replicas = self.replicas
        return out

    def _settle(self, now: float) -> None:
        """Fold the entries sent by ``now - settle_s`` (with replicas; else by ``now``) into
        the settled values, oldest first."""
        pending, horizon = self._pending, now - self.settle_s if self.replicas else now
        while pending and pending[0][0] <= horizon:
            at, node_id, tokens = heapq.heappop(pending)
            if self._base is None:
                self._base = at
            elif at - self._base > self._rebase_s:
                decay = math.exp(self.rate * (self._base - at))
                self._work = {k: v * decay for k, v in self._work.items()}
                self._base = at
            self._work[node_id] = self._work.get(node_id, 0.0) + tokens * math.exp(self.rate * (at - self._base))

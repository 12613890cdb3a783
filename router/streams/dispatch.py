"""Dispatch: from a prepared prompt to a started `Generation` on a decode node.

Owns the routing step of one prompt: look up its prefix hits (once, for a policy
that uses them), ask the policy, record the decision, mint the transfer id, send the
`GenerateRequest` (with whether its nodes may compile its grammar: its request's
compile grant, router/http/compile_budget.py), retry on another decode node when the
chosen one surely never started it (unreachable, 503), the same for a migrated
generation's next leg (`open`, called by `Generation.new_leg`). Keeps the books of
every leg it opened, updated here when the generation reports what it saw
(`first_token`, `end_leg`): this router's in-flight counts per node, in requests and
in prompt tokens still to prefill (the fresh half of the load the policy sees), the
decision log's settlement, the leg's compile ticket, and the abort sent to a node
whose request did not finish. Answers "no
decode node" with a 503 and a node's refusal with its own 4xx.

Must not talk to Redis itself (discovery.py keeps the node list, prefix_mirror.py
mirrors the index) or detokenize.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ...common.detokenizer import IncrementalDetokenizer
from ...common.outcomes import FailureReason
from ...common.protocol import GenerateRequest, PullSource
from ...common.sampling_params import SamplingParams
from .background import BackgroundTasks
from ..routing.decisions import DecisionLog
from ..routing.discovery import NodeDirectory
from ..errors import ApiError
from .generation import Generation
from .leg import CompileTicket, InflightSlot, Leg
from ..metrics import RouterMetrics
from .node_client import NodeClient, NodeRejected, NodeUnavailable, TokenStream
from ..routing.policy import NO_CACHED, NO_TIERS, Decision, RoutingPolicy
from ..routing.prefix_mirror import PrefixHits, PrefixMirror
from ..prompt import Prompt
from ..tokenizer import RouterTokenizer

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # decode nodes tried for one prompt


@dataclass(slots=True)
class Dispatcher:
    directory: NodeDirectory
    policy: RoutingPolicy
    client: NodeClient
    tokenizer: RouterTokenizer
    metrics: RouterMetrics
    background: BackgroundTasks
    prefix: PrefixMirror
    decisions: DecisionLog
    retry_after_s: int = 1  # Retry-After of the 503 "no decode node"
    migration_limit: int = 0  # legs a generation may move to after its decode node fails (migration.py)
    inflight: Counter[str] = field(default_factory=Counter)  # node_id -> this router's requests there
    # node_id -> prefill work (Decision.prefill_work) of this router's requests still prefilling there
    inflight_tokens: Counter[str] = field(default_factory=Counter)
    # node_id -> this router's requests pulling a prefix from it, until their first token
    pulls: Counter[str] = field(default_factory=Counter)

    async def start(self, index: int, request_id: str, prompt: Prompt, params: SamplingParams,
                    t_start: float, pin: Decision | None = None, score_only: bool = False,
                    compile_grammar: bool = True,
                    ticket: Callable[[], CompileTicket] | None = None) -> Generation:
        """Route ``prompt`` and start it; raises `ApiError` (503 no decode node, the
        node's 4xx, 502 when every tried node failed). ``pin``: the nodes to try first
        (another choice of the same prompt went there, so the prefill node's prefix
        cache holds it); the policy chooses when they are gone or fail.
        ``compile_grammar``: whether its nodes may compile its structured output's
        grammar (on the pinned nodes only, when pinned); ``ticket``: makes the compile
        ticket of the leg it opens (compile_budget.py)."""
        try:
            leg = await self.open(request_id, prompt, params, t_start, pin=pin,
                                  compile_grammar=compile_grammar, ticket=ticket)
        except ApiError as e:
            if e.status == 502:
                self.metrics.failures.labels(reason=FailureReason.NODE_UNAVAILABLE).inc()
            raise
        return Generation(
            index=index, request_id=request_id, prompt=prompt, params=params, legs=[leg],
            detok=IncrementalDetokenizer(self.tokenizer, prompt.ids, params.stop,
                                         include_stop=params.include_stop_str_in_output),
            metrics=self.metrics, dispatch=self, t_start=t_start,
            migration_limit=self.migration_limit, score_only=score_only)

    async def open(self, request_id: str, prompt: Prompt, params: SamplingParams,
                   t_open: float, exclude: frozenset[str] = frozenset(),
                   pin: Decision | None = None, compile_grammar: bool = True,
                   ticket: Callable[[], CompileTicket] | None = None) -> Leg:
        """Route ``prompt`` to a decode node not in ``exclude`` (node ids) and send it
        there; raises `ApiError` (503 no decode node, or each node tried answered 503, with
        its Retry-After; the node's 4xx; 502 when every tried node failed otherwise).
        ``compile_grammar``, ``ticket``: as `start`."""
        tried: set[str] = set(exclude)  # decode node ids
        last_error: NodeUnavailable | None = None
        busy = True  # every node tried answered 503
        hits: PrefixHits | None = None  # looked up once, on the first attempt
        t_hash = time.perf_counter()
        # once: the lookup and every node reuse its hashes (salted: only the salt's own blocks match)
        ref = prompt.ref(self.prefix.model_id, self.prefix.block_size)
        hashes = ref.block_hashes()
        wire = ref.wire(prompt.wire())  # ids, keys and hashes, for every attempt
        hash_s = time.perf_counter() - t_hash  # counted in the first decision's time
        pinned = pin is not None
        for _ in range(MAX_ATTEMPTS):
            t_route = time.perf_counter()
            nodes = [n for n in self.directory.live() if n.node_id not in tried]
            decision = _pinned(pin, nodes)
            # pinned: the grammar compiles on the pinned nodes only (one count, compile_budget.py)
            may_compile = compile_grammar and (decision is not None or not pinned)
            pin = None  # only the first attempt
            if decision is None and hits is None and self.policy.uses_prefix_index:
                hits = self.prefix.lookup(prompt.array, nodes, hashes)
            if decision is None:
                decision = self.policy.choose(prompt.ids, nodes, self.inflight,
                                              cached=hits.cached if hits else NO_CACHED,
                                              inflight_tokens=self.inflight_tokens,
                                              tie_key=int(hashes[-1]) if len(hashes) else None,
                                              tiers=hits.tiers if hits else NO_TIERS, pulls=self.pulls)
            if decision is None:
                break
            decision_s, hash_s = time.perf_counter() - t_route + hash_s, 0.0
            self.metrics.decision_seconds.observe(decision_s)
            tried.add(decision.decode.node_id)
            req = GenerateRequest(
                request_id=request_id, prompt=wire, sampling_params=params,
                prefill_addr=decision.prefill.http_addr if decision.prefill else None,
                transfer_id=uuid.uuid4().hex,
                pull=None if decision.pull is None else PullSource(
                    node_id=decision.pull.holder.node_id, addr=decision.pull.holder.http_addr,
                    tokens=decision.pull.tokens), compile_grammar=may_compile)
            try:
                stream, prefill_slot, decode_slot, pull_slot = await self._open(decision, req)
            except NodeRejected as e:
                raise ApiError(e.status, e.body.message, param=e.body.param,
                               type_=e.body.type) from e
            except NodeUnavailable as e:
                last_error = e
                busy = busy and e.retry_after is not None
                if not e.retryable:
                    raise ApiError(502, str(e)) from e
                log.warning("router: %s; trying another node", e)
                if e.unreachable:
                    self.directory.mark_unreachable(decision.decode)
                continue
            self._count(decision, len(prompt))
            rec = self.decisions.record(request_id, self.policy.name, decision, len(prompt), hits,
                                        decision_s)
            return Leg(request_id=request_id, decision=decision, stream=stream,
                       prefill_slot=prefill_slot, decode_slot=decode_slot, pull_slot=pull_slot, record=rec,
                       t_open=t_open, ticket=None if ticket is None else ticket())
        if last_error is None:
            raise self._no_decode_node()
        if busy:  # each node tried is up and asked to be retried: so must the client be
            raise ApiError(503, f"no decode node can take the request now; retry (last: {last_error})",
                           headers={"Retry-After": last_error.retry_after or "1"})
        raise ApiError(502, f"every decode node tried failed; last error: {last_error}")

    def first_token(self, leg: Leg, grammar_missed: bool = False) -> None:
        """``leg`` produced its first token: its prefill work (and pull) is no longer in flight,
        nor its grammar's compiles (``grammar_missed``: `CompileTicket.settle`)."""
        leg.prefill_slot.release()
        leg.pull_slot.release()
        if leg.ticket is not None:
            leg.ticket.settle(grammar_missed)

    def end_leg(self, leg: Leg, finished: bool) -> None:
        """Let go of ``leg`` (idempotent): close its stream, abort the request on its
        node unless the node finished it, release its in-flight slots, and settle its
        decision with the cached tokens and TTFT it delivered when the generation
        ``finished`` on it (as failed otherwise)."""
        if leg.ended:
            return
        leg.ended = True
        leg.stream.close()
        if not leg.node_done:
            self._schedule_abort(leg.decision.decode.http_addr, leg.request_id)
        leg.prefill_slot.release()
        leg.pull_slot.release()
        leg.decode_slot.release()
        if leg.ticket is not None:
            leg.ticket.settle(False)
        if finished and leg.t_first is not None:
            self.decisions.settle(leg.record, leg.cached_tokens, leg.t_first - leg.t_open)
        else:
            self.decisions.settle(leg.record, None)

    def _no_decode_node(self) -> ApiError:
        d = self.directory
        if not any(n.decode_capable for n in d.nodes):
            where = "" if d.redis_ok else " (Redis is unreachable; this is the last known list)"
            msg = (f"no decode node is registered for model `{d.model_id}`{where}; start one "
                   "with `splitserve decode` and retry")
        else:
            msg = (f"no decode node for model `{d.model_id}` is reachable right now; "
                   "retry shortly")
        return ApiError(503, msg, code="no_decode_node",
                        headers={"Retry-After": str(self.retry_after_s)})

    async def _open(self, d: Decision, req: GenerateRequest
                    ) -> tuple[TokenStream, InflightSlot, InflightSlot, InflightSlot]:
        """Send ``req`` to the decode node, counting it in flight on its nodes while
        it runs (and its ``d.prefill_work`` on the prefill node, its pull on the holder,
        until the first token): (stream, prefill slot, decode slot, pull slot). On any
        error the slots are released and the error re-raised."""
        # The prefill work is in flight on the node that computes it (the decode node
        # when it prefills itself) until the first token.
        prefill = InflightSlot(self.inflight, self.inflight_tokens, (d.prefill or d.decode).node_id,
                               round(d.prefill_work), count_request=d.prefill is not None)
        decode = InflightSlot(self.inflight, self.inflight_tokens, d.decode.node_id)
        pull = InflightSlot(self.pulls, Counter(), d.pull.holder.node_id if d.pull is not None else None)
        try:
            return await self.client.generate(d.decode.http_addr, req), prefill, decode, pull
        except BaseException as e:
            prefill.release()
            decode.release()
            pull.release()
            if isinstance(e, asyncio.CancelledError):  # the node may have started it
                self._schedule_abort(d.decode.http_addr, req.request_id)
            raise

    def _count(self, d: Decision, prompt_len: int) -> None:
        m = self.metrics
        m.prompt_tokens.inc(prompt_len)
        m.decisions.labels(node_id=d.decode.node_id, role="decode").inc()
        if d.prefill is not None:
            m.decisions.labels(node_id=d.prefill.node_id, role="prefill").inc()
        else:
            m.local_prefill.inc()

    def _schedule_abort(self, addr: str, request_id: str) -> None:
        self.background.spawn(self.client.abort(addr, request_id), name=f"abort-{request_id}")


def _pinned(pin: Decision | None, nodes: list) -> Decision | None:
    """``pin`` when its nodes are still among ``nodes`` (its prefill work then is about
    nothing: the prefix is the pinned prefill node's), else None."""
    if pin is None:
        return None
    ids = {n.node_id for n in nodes}
    if pin.decode.node_id not in ids or (pin.prefill is not None and pin.prefill.node_id not in ids):
        return None
    return pin._replace(prefill_work=0.0, pull=None)

"""``splitserve replay TRACE``: replay a routing trace through the real router against
simulated nodes, and report how well the policy used the prefix caches.

    redis-server, router (--policy), N simulated prefill + M decode nodes (real servers,
    block pools, schedulers, KV transport; a timing model in place of the model)
       ^ one streamed /v1/completions per trace line, sent at timestamp / speedup,
         prompt = the line's hash ids expanded to tokens (trace.py), max_tokens =
         min(output_length, max_output_tokens); a later turn of a conversation (lines
         naming one) instead think_ms / speedup after the turn before it was answered, its
         prompt holding that turn's prompt and generated tokens (conversation.py)

Reported (JSON with ``--result-json``):
  hit_rate         cached prompt tokens (``usage.prompt_tokens_details``) / prompt tokens
  oracle_hit_rate  the same for one shared prefix cache that never evicts (trace.oracle_hits;
                   with conversations, over the prompts sent, generated tokens included:
                   Conversations.pooled_hits), and ``conversations``: how many, and answers
                   whose streamed text was not the ids the replay put in the next prompt
  prompt_tokens_by_source  shares of the prompt tokens the nodes were given (their
                   prefix_cache_queries): cached on the decode node that prefilled alone
                   (decode_node_hits), on the prefill node (prefill_node_hits), pulled from
                   another node (kv_pull_tokens_total, out of the pulling node's hits), computed
  ttft_p50/p90/p99 seconds of trace time (wall clock x speedup), failed requests excluded
  tpot_p50/p99     the same for each request's time per output token after the first
                   (Outcome.itl_s; requests of 2 tokens or more)
  max_mean_load    the busiest prefill node's forward-pass time / the mean over prefill
                   nodes (each node's ``busy_s``): how far a hot spot stands out
  max_mean_requests  the same for requests routed (the router's routing_decisions_total);
                   requests with long cached prefixes are cheap, so this spreads wider
  prefill_nodes_not_idle_at_end  node -> what it still holds once every request was
                   answered (requests, queued tokens, KV blocks in use, transfers): a leak
  hit_rate_by_tier with lower tiers (``kv_offload_memory``, per node, in the modelled model's
                   bytes like ``kv_cache_memory``; ``kv_offload_disk_bytes`` adds a disk tier
                   under a temporary folder): the prompt tokens served from each tier of the
                   prefill nodes' prefix caches (device: cached minus the lower tiers' hits,
                   from the nodes' kv_offload_hits_total) over all prompt tokens; and
                   ``lower_tier_blocks``: those hits and the lower tiers' evictions, in blocks
  sim_overrun_s    node -> wall seconds its steps ran beyond their simulated time (every node)
  transfers        with a profile that names a KV network: the prefill nodes' modelled
                   transfers (node/sim_link.py) and how many this machine moved later than
                   the model (``transfer_check``: ``behind_model`` when that lateness is
                   more than MAX_LATE_TRANSFER_SHARE of the TTFT reported)

The router's clock is not compressed: its node registry polls and heartbeats stay in
wall-clock time. The one policy time constant, cache_aware's balance half-life,
is divided by the speed-up so the policy remembers the same stretch of trace time
(its settle time applies only between router replicas; the replay runs one router);
with ``--profile`` the policy's attention ratio and seconds per token are the
profile's (``SimProfile.policy_weights``: the defaults are this CPU's fit, 16x the
H100 profile's attention ratio). ``ReplayConfig.score_weights`` sets weights over
these; a later ``--router-arg=--score-weights=...`` replaces all of that. ``--profile`` also takes a deployment (prefill nodes of one
profile, decode nodes of another, e.g. TP4 / TP8): each fleet process then serves
one role (cluster.py), and the policy's weights are the prefill profile's
(``SimDeployment.policy_weights`` says why the decode side needs none).

Output lengths are capped because the figures are about routing and prefill: decode
steps of the simulated nodes cost wall-clock time in this process's router and
nodes, not prefill capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common import metric_names as names
from splitserve.common.kv_events import Tier
from splitserve.common.outcomes import TransferStage
from splitserve.common.trace import HASH_BLOCK, TraceRequest, load_trace, oracle_hits, prompt_tokens
from splitserve.common.trace import summarize as trace_summary

from .conversation import Conversations

if TYPE_CHECKING:
    from splitserve.deploy.launcher import SimCluster

PROGRESS_S = 5.0  # wall seconds between progress lines
# A server closes a connection idle for its keep-alive time; a request sent on it as it
# closes fails (ServerDisconnectedError) without reaching the server. Drop idle connections
# well before the router's keep-alive (RouterConfig.keepalive_timeout_s) ends.
KEEPALIVE_S = 5.0


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: str
    prefill_nodes: int = 16
    decode_nodes: int | None = None  # None: prefill_nodes // 4, at least 1
    policy: str = "cache_aware"
    speedup: float = 10.0  # trace seconds per wall-clock second
    max_output_tokens: int = 16
    kv_cache_memory: str = "1GiB"  # per simulated node (its token capacity is the real model's)
    fleet_procs: int = 2
    sim_timing: str | None = None  # None: the built-in fit
    limit: int | None = None  # replay the first N requests only
    router_args: tuple[str, ...] = field(default=())
    # cache_aware weights set over the replay's own (sim_router_args), e.g. (("local_prefill_tokens", 0.0),)
    score_weights: tuple[tuple[str, float], ...] = field(default=())
    result_json: str | None = None
    profile: str | None = None  # simulated nodes stand for this profile or deployment (sim_profiles.toml)
    trace_block_size: int = 512  # tokens per hash id in the trace
    kv_offload_memory: str | None = None  # per node: a host-memory tier of the prefix cache (modelled bytes)
    kv_offload_disk_bytes: str | None = None  # per node: a disk tier below it (needs kv_offload_memory)

    def __post_init__(self):
        if self.prefill_nodes < 1:
            raise ValueError(f"prefill_nodes: must be >= 1, got {self.prefill_nodes}")
        if self.decode_nodes is not None and self.decode_nodes < 1:
            raise ValueError(f"decode_nodes: must be >= 1, got {self.decode_nodes}")
        if self.speedup <= 0:
            raise ValueError(f"speedup: must be > 0, got {self.speedup}")
        if self.max_output_tokens < 1 or self.fleet_procs < 1:
            raise ValueError("max_output_tokens and fleet_procs: must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit: must be >= 1, got {self.limit}")
        if self.trace_block_size < 1:
            raise ValueError(f"trace_block_size: must be >= 1, got {self.trace_block_size}")
        if self.kv_offload_disk_bytes and not self.kv_offload_memory:
            raise ValueError("kv_offload_disk_bytes: a disk tier needs kv_offload_memory (blocks reach the "
                             "disk through host memory)")
        from splitserve.common.config import parse_size
        for name in ("kv_offload_memory", "kv_offload_disk_bytes"):
            if getattr(self, name) is not None:
                parse_size(getattr(self, name), name)  # a bad size fails here, not in every node
        if self.profile is not None:
            from splitserve.common.sim_profiles import get_deployment
            get_deployment(self.profile)  # an unknown name fails here, naming the choices

    @property
    def num_decode_nodes(self) -> int:
        return self.decode_nodes if self.decode_nodes is not None else max(1, self.prefill_nodes // 4)


class Outcome(NamedTuple):
    ok: bool
    ttft_s: float  # wall clock; nan when failed
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    error: str
    output_tokens: int = 0
    itl_s: float = float("nan")  # wall: (e2e - ttft) / (output tokens - 1), the request's mean ITL
    late_s: float = 0.0  # wall: how long after its due time the request was sent
    text: str = ""  # the streamed answer


# A replay is behind its schedule when its sends come later than this (wall seconds, p99):
# its latencies are then those of a slower trace, and its figures are not the trace's.
LATE_P99_S = 0.1
# A replay's TTFT is the modelled network's only while this machine moves the stand-in blocks
# within the modelled time: past this share of the TTFT summed over requests spent beyond
# it, the figures are this machine's transport's.
MAX_LATE_TRANSFER_SHARE = 0.02


async def send(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage, error, text = float("nan"), None, None, []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return Outcome(False, ttft, 0.0, len(prompt), 0, f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft != ttft:
                    ttft = time.perf_counter() - start
                text += [c.get("text") or "" for c in chunk.get("choices") or ()]
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("error"):  # the router's in-stream error event
                    error = str(chunk["error"].get("message", chunk["error"]))
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        return Outcome(False, ttft, 0.0, len(prompt), 0, f"{type(e).__name__}: {e}")
    if usage is None:
        return Outcome(False, ttft, 0.0, len(prompt), 0,
                       f"error event: {error}" if error else "stream ended without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    e2e, n = time.perf_counter() - start, usage.get("completion_tokens", 0)
    itl = (e2e - ttft) / (n - 1) if n > 1 else float("nan")
    return Outcome(True, ttft, e2e, usage["prompt_tokens"], cached, "", n, itl, text="".join(text))


def client_session(url: str, keepalive_s: float = KEEPALIVE_S) -> aiohttp.ClientSession:
    """The replay's client: no connection limit, no overall timeout, idle connections
    dropped after ``keepalive_s``, before the router would close them."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def replay(requests: list[TraceRequest], url: str, model: str, speedup: float,
                 max_output_tokens: int, hash_block: int = HASH_BLOCK,
                 conversations: Conversations | None = None) -> list[Outcome]:
    """Send every request at its timestamp / speedup, a later turn of one of
    ``conversations`` think_ms / speedup after the turn before it was answered (its
    conversation's task sends it); the outcomes in trace order."""
    t0_trace = requests[0].timestamp
    sent = done = 0
    outcomes: list[Outcome | None] = [None] * len(requests)
    async with client_session(url) as session:
        async def one(i: int, due: float):
            nonlocal sent, done
            while True:
                late = time.perf_counter() - due
                sent += 1
                req = requests[i]
                prompt = (conversations.prompt(i) if conversations is not None
                          else prompt_tokens(req, hash_block=hash_block))
                o = await send(session, "", model, prompt, min(req.output_length, max_output_tokens))
                outcomes[i] = o._replace(late_s=late)
                done += 1
                if conversations is None or (nxt := conversations.next_turn.get(i)) is None:
                    return
                conversations.answered(i, prompt, o.output_tokens, o.text)
                i, due = nxt, time.perf_counter() + requests[nxt].think_ms / 1000 / speedup
                await asyncio.sleep(max(0.0, due - time.perf_counter()))

        tasks = []
        start = time.perf_counter()
        next_report = start + PROGRESS_S
        for i, req in enumerate(requests):
            if conversations is not None and i in conversations.previous:
                continue  # sent by its conversation's task
            due = start + (req.timestamp - t0_trace) / 1000 / speedup
            while (now := time.perf_counter()) < due:
                await asyncio.sleep(min(due - now, max(0.0, next_report - now)) or 0.001)
                if time.perf_counter() >= next_report:
                    next_report += PROGRESS_S
                    _progress(start, sent, done, len(requests), outcomes)
            tasks.append(asyncio.create_task(one(i, due)))
        while done < len(requests) and not any(t.done() and t.exception() for t in tasks):
            await asyncio.sleep(0.2)
            if time.perf_counter() >= next_report:
                next_report += PROGRESS_S
                _progress(start, sent, done, len(requests), outcomes)
        await asyncio.gather(*tasks)
    answered = [o for o in outcomes if o is not None]
    assert len(answered) == len(requests)  # every task has run
    return answered


def _progress(start: float, sent: int, done: int, total: int, outcomes) -> None:
    finished = [o for o in outcomes if o is not None]
    failed = sum(not o.ok for o in finished)
    ok = [o for o in finished if o.ok]
    hit = sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok))
    print(f"[replay] {time.perf_counter() - start:6.1f}s  sent {sent}/{total}  done {done}  "
          f"failed {failed}  hit rate {hit:.1%}", file=sys.stderr, flush=True)


async def prefill_node_states(redis_url: str) -> dict[str, dict]:
    """node_id -> /debug/state of every registered prefill node."""
    return await node_states(redis_url, "prefill")


async def node_states(redis_url: str, role: str | None = None) -> dict[str, dict]:
    """node_id -> /debug/state of every registered node (of ``role``, when given)."""
    from splitserve.common.node_registry import NodeRegistry

    registry = NodeRegistry(redis_url)
    try:
        nodes = [n for n in await registry.list_nodes() if role is None or n.role == role]
    finally:
        await registry.close()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async def state(addr: str) -> dict:
            async with s.get(f"{addr}/debug/state") as r:
                return await r.json()
        states = await asyncio.gather(*(state(n.http_addr) for n in nodes))
    return {n.node_id: st for n, st in zip(nodes, states)}


IDLE_RECHECK_S = 2.0


def not_idle(state: dict) -> dict:
    """What a prefill node's /debug/state still holds once every request was answered
    (empty: idle): requests, queued tokens, KV blocks in use, outgoing transfers. Anything
    here is a leak, and it also makes the node look loaded to the router for good."""
    load = state.get("load", {})
    held = {k: load.get(k, 0) for k in ("running", "waiting", "queued_prefill_tokens")}
    held["blocks_in_use"] = state["kv_blocks_total"] - state["kv_blocks_free"]
    held["outgoing"] = state.get("outgoing", 0)
    return {k: v for k, v in held.items() if v}


def schedule_check(outcomes: list[Outcome], speedup: float) -> dict:
    """Did the replay keep to its schedule? Send lateness (wall seconds) p99 and max, and
    ``behind_schedule`` when p99 passes LATE_P99_S: the client or this machine could not
    send at the trace's pace, so the figures are not the trace's."""
    late = [o.late_s for o in outcomes]
    p99 = percentile(late, 0.99)
    return {"late_p99_s": round(p99, 4), "late_max_s": round(max(late, default=0.0), 4),
            "late_p99_trace_s": round(p99 * speedup, 4), "behind_schedule": bool(p99 > LATE_P99_S)}


def transfer_check(states: dict[str, dict], speedup: float, ttft_trace_s: float) -> dict | None:
    """The prefill nodes' modelled transfers (``/debug/state`` ``sim_link``; None when no
    node models its network): how many, how many this machine moved later than the model,
    by how much in trace seconds, and ``behind_model`` when that lateness passes
    MAX_LATE_TRANSFER_SHARE of ``ttft_trace_s`` (the TTFT of every answered request, summed)."""
    links = [st["sim_link"] for st in states.values() if "sim_link" in st]
    if not links:
        return None
    n, late, late_s = (sum(lk[k] for lk in links) for k in ("transfers", "late", "late_s"))
    share = late_s * speedup / ttft_trace_s if ttft_trace_s else 0.0
    return {"transfers": n, "blocks": sum(lk["blocks"] for lk in links), "late": late,
            "late_trace_s": round(late_s * speedup, 3),
            "max_late_trace_s": round(max(lk["max_late_s"] for lk in links) * speedup, 4),
            "late_share_of_ttft": round(share, 4), "behind_model": share > MAX_LATE_TRANSFER_SHARE}


async def node_metrics(redis_url: str, role: str) -> dict[str, str]:
    """node_id -> the /metrics text of every registered node of ``role``."""
    from splitserve.common.node_registry import NodeRegistry

    registry = NodeRegistry(redis_url)
    try:
        nodes = [n for n in await registry.list_nodes() if n.role == role]
    finally:
        await registry.close()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async def text(addr: str) -> str:
            async with s.get(f"{addr}/metrics") as r:
                return await r.text()
        texts = await asyncio.gather(*(text(n.http_addr) for n in nodes))
    return {n.node_id: t for n, t in zip(nodes, texts)}


def tier_counts(metrics: dict[str, str], name: str, labels: tuple[str, ...] = ("tier",)) -> dict[str, float]:
    """The counter ``name`` summed over the nodes' /metrics by its ``labels`` (joined by a
    space): by tier (host, disk) for names.KV_OFFLOAD_HITS and KV_OFFLOAD_EVICTIONS (blocks),
    by ``("tier", "direction")`` for KV_OFFLOAD_BYTES."""
    counts: dict[str, float] = {}
    for text in metrics.values():
        for family in text_string_to_metric_families(text):
            if family.name == name.removesuffix("_total"):
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        key = " ".join(sample.labels[label] for label in labels)
                        counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def histogram_mean(metrics: dict[str, str], name: str, labels: dict[str, str] | None = None) -> float:
    """The mean of histogram ``name`` (seconds) over every node's /metrics text (only its
    samples with ``labels``, if given), 0.0 where it observed nothing."""
    total = count = 0.0
    for text in metrics.values():
        for family in text_string_to_metric_families(text):
            if family.name == name:
                for sample in family.samples:
                    if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                        continue
                    if sample.name.endswith("_sum"):
                        total += sample.value
                    elif sample.name.endswith("_count"):
                        count += sample.value
    return total / count if count else 0.0


def node_side(metrics: dict[str, dict[str, str]], speedup: float) -> dict[str, dict]:
    """Where requests spent their time on the nodes, per role (``metrics``: role -> node_metrics),
    in trace seconds: the mean wait from added to first scheduled (``queue_s``) and from
    first scheduled to the prompt done (``prefill_s``: the prompt's compute, its lower-tier
    loads and the steps it shared), the mean of each stage of a decode node's transfers
    (``transfer_s``: stage -> seconds; reserve, transfer: the prefill node's work and the
    move, admit), and the bytes each role moved to and from its lower tiers
    (``offload_bytes``: ``tier direction`` -> bytes)."""
    return {role: {"queue_s": round(histogram_mean(by_node, names.REQUEST_QUEUE_TIME) * speedup, 4),
                   "prefill_s": round(histogram_mean(by_node, names.REQUEST_PREFILL_TIME) * speedup, 4),
                   "transfer_s": {stage.value: round(histogram_mean(by_node, names.KV_TRANSFER_STAGE_SECONDS,
                                                                    {"stage": stage.value}) * speedup, 4)
                                  for stage in TransferStage},
                   "offload_bytes": tier_counts(by_node, names.KV_OFFLOAD_BYTES, ("tier", "direction"))}
            for role, by_node in metrics.items()}


def hits_by_tier(cached_tokens: int, prompt_tokens: int, lower_blocks: dict[str, float],
                 block_size: int) -> dict[str, float]:
    """Share of ``prompt_tokens`` served from each tier: the lower tiers' hits (blocks of
    ``block_size``), the rest of ``cached_tokens`` from the device."""
    lower = {t.name.lower(): lower_blocks.get(t.name.lower(), 0.0) * block_size for t in Tier if t is not Tier.DEVICE}
    shares = {"device": cached_tokens - sum(lower.values()), **lower}
    return {tier: round(tokens / prompt_tokens, 4) if prompt_tokens else 0.0 for tier, tokens in shares.items()}


def max_over_mean(values: list[float], n: int) -> float | None:
    values = values + [0.0] * (n - len(values))  # nodes that got nothing
    mean = statistics.fmean(values) if values else 0.0
    return round(max(values) / mean, 3) if mean else None


def local_prefills(metrics_text: str) -> float:
    """Requests the router sent to a decode node with no prefill node (the router's metrics)."""
    return sum(s.value for family in text_string_to_metric_families(metrics_text)
               if family.name == names.LOCAL_PREFILL_DECISIONS.removesuffix("_total")
               for s in family.samples if s.name.endswith("_total"))


def prefill_requests_per_node(metrics_text: str) -> dict[str, float]:
    """node_id -> requests the router sent to that prefill node."""
    counts = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == names.ROUTING_DECISIONS.removesuffix("_total"):
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("role") == "prefill":
                    counts[s.labels["node_id"]] = s.value
    return counts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(cfg: ReplayConfig, requests: list[TraceRequest], outcomes: list[Outcome],
              per_node: dict[str, float], states: dict[str, dict], wall_s: float,
              lower: dict[str, dict[str, float]] | None = None, overrun_s: dict[str, float] | None = None,
              at_nodes: dict[str, dict] | None = None, conversations: Conversations | None = None,
              sources: dict[str, float] | None = None) -> dict:
    """The replay's figures (module docstring); ``states``: the prefill nodes' /debug/state,
    ``lower``: their lower tiers' ``hits`` and ``evictions`` (``tier_counts``), ``overrun_s``:
    every node's sim_overrun_s, ``at_nodes``: ``node_side``'s split of the nodes' time,
    ``conversations``: the trace's, as replayed, ``sources``: ``prompt_token_sources``."""
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    oracle = (conversations.pooled_hit_rate() if conversations is not None else
              sum(oracle_hits(requests, cfg.trace_block_size)) / sum(r.input_length for r in requests))
    hit = sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0
    ttft = [o.ttft_s * cfg.speedup for o in ok]
    tpot = [o.itl_s * cfg.speedup for o in ok if o.output_tokens > 1]
    busy = {nid: st["busy_s"] * cfg.speedup for nid, st in states.items()}  # trace seconds
    errors = sorted({o.error for o in outcomes if not o.ok})
    failed_by_error: dict[str, int] = {}  # first 80 characters of the error -> requests
    for o in outcomes:
        if not o.ok:
            failed_by_error[o.error[:80]] = failed_by_error.get(o.error[:80], 0) + 1
    return {
        "policy": cfg.policy, "prefill_nodes": cfg.prefill_nodes, "decode_nodes": cfg.num_decode_nodes,
        "requests": len(requests), "failed": len(outcomes) - len(ok), "errors": errors[:5],
        "failed_by_error": failed_by_error, "profile": cfg.profile, **_role_profiles(cfg.profile),
        "hit_rate": round(hit, 4), "oracle_hit_rate": round(oracle, 4),
        "hit_rate_vs_oracle": round(hit / oracle, 4) if oracle else None,
        "conversations": conversations.summary() if conversations is not None else None,
        "prompt_tokens_by_source": sources,
        "hit_rate_by_tier": (hits_by_tier(sum(o.cached_tokens for o in ok), prompt, lower["hits"],
                                          next(iter(states.values()))["kv"]["block_size"])
                             if lower is not None and states else None),
        "lower_tier_blocks": lower,
        "kv_offload_memory": cfg.kv_offload_memory, "kv_offload_disk_bytes": cfg.kv_offload_disk_bytes,
        "output_tokens": sum(o.output_tokens for o in ok),  # of the requests that finished
        "ttft_p50": round(percentile(ttft, 0.5), 3), "ttft_p90": round(percentile(ttft, 0.9), 3),
        "ttft_p99": round(percentile(ttft, 0.99), 3), "ttft_mean": round(statistics.fmean(ttft), 3) if ttft else None,
        "tpot_p50": round(percentile(tpot, 0.5), 5), "tpot_p99": round(percentile(tpot, 0.99), 5),
        # where the mean TTFT went (trace seconds): the prefill nodes' queue and prompt, and the
        # rest of the path (router, decode reservation, KV transfer, the first token's hop)
        "at_nodes": at_nodes,
        "ttft_path_s": (round(statistics.fmean(ttft) - at_nodes["prefill"]["queue_s"] - at_nodes["prefill"]["prefill_s"], 4)
                        if ttft and at_nodes and "prefill" in at_nodes else None),
        "max_mean_load": max_over_mean(list(busy.values()), cfg.prefill_nodes),
        "max_mean_requests": max_over_mean(list(per_node.values()), cfg.prefill_nodes),
        "prefill_requests_per_node": dict(sorted(per_node.items())),
        "prefill_busy_s_per_node": {k: round(v, 1) for k, v in sorted(busy.items())},
        "prefill_nodes_not_idle_at_end": {nid: held for nid, st in sorted(states.items())
                                          if (held := not_idle(st))},
        "speedup": cfg.speedup, "wall_s": round(wall_s, 1), "max_output_tokens": cfg.max_output_tokens,
        "schedule": schedule_check(outcomes, cfg.speedup),
        "transfers": transfer_check(states, cfg.speedup, sum(ttft)),
        "sim_overrun_s": {k: round(v, 3) for k, v in sorted((overrun_s or {}).items())},
        "kv_cache_memory": cfg.kv_cache_memory, "trace": trace_summary(requests), "config": asdict(cfg),
        # trace order: [ttft seconds of trace time (null: failed), prompt tokens, cached tokens]
        "per_request": [[round(o.ttft_s * cfg.speedup, 3) if o.ok else None, o.prompt_tokens, o.cached_tokens]
                        for o in outcomes],
    }


def prompt_token_sources(metrics: dict[str, dict[str, str]]) -> dict[str, float] | None:
    """Shares of the prompt tokens the nodes were given (module docstring) from ``metrics``
    (role -> node_metrics); None when no node was given any."""
    def total(role: str, name: str) -> float:
        return tier_counts(metrics.get(role, {}), name, ()).get("", 0.0)

    given = sum(total(role, names.PREFIX_CACHE_QUERIES) for role in metrics)
    if not given:
        return None
    pulled = {role: total(role, names.KV_PULL_TOKENS) for role in metrics}  # counted in the puller's hits too
    shares = {"decode_node_hits": total("decode", names.PREFIX_CACHE_HITS) - pulled.get("decode", 0.0),
              "prefill_node_hits": total("prefill", names.PREFIX_CACHE_HITS) - pulled.get("prefill", 0.0),
              "pulled": sum(pulled.values())}
    shares["computed"] = given - sum(shares.values())
    return {k: round(v / given, 4) for k, v in shares.items()}


def node_block_size(profile: str | None) -> int:
    """Tokens per KV block of the simulated nodes: the profile's, else the engine's default."""
    if profile is None:
        from splitserve.common.config import EngineConfig
        return EngineConfig().block_size
    from splitserve.common.sim_profiles import get_deployment
    return get_deployment(profile).prefill.block_size


def sim_router_args(profile: str | None, speedup: float,
                    score_weights: tuple[tuple[str, float], ...] = ()) -> tuple[str, ...]:
    """The router's flags in front of simulated nodes sped up ``speedup`` times, standing
    for ``profile`` (a profile or deployment; None: this CPU's fit): the balance half-life
    in trace time, and the profile's context and cost ratios (module docstring), then
    ``score_weights`` over them."""
    from splitserve.router.config import CacheAwareWeights

    weights = {"balance_half_life_s": CacheAwareWeights().balance_half_life_s / speedup}
    profile_args: tuple[str, ...] = ()
    if profile:  # the nodes' model: its context on the router too, and its cost ratios
        from splitserve.common.sim_profiles import get_deployment
        deployment = get_deployment(profile)
        profile_args = ("--max-model-len", str(deployment.context), "--allow-long-max-model-len")
        weights.update(deployment.policy_weights())
    weights.update(score_weights)
    return (*profile_args, "--score-weights=" + ",".join(f"{k}={v:g}" for k, v in weights.items()))


def run_replay(cfg: ReplayConfig, at_end: Callable[[SimCluster], dict] | None = None) -> dict:
    """Start the cluster, replay, stop it; the summary (also written to ``cfg.result_json``).
    ``at_end``: called with the cluster once every request was answered, before it stops
    (e.g. to read the prefix index); what it returns is the summary's ``at_end``."""
    from splitserve.common.bundled import BUNDLED_MODEL_ID
    from splitserve.deploy.launcher import SimCluster

    requests = load_trace(cfg.trace, cfg.trace_block_size)[:cfg.limit]
    print(f"[replay] {cfg.trace}: {trace_summary(requests)}", file=sys.stderr, flush=True)
    conversations = Conversations.of(requests, node_block_size(cfg.profile), BUNDLED_MODEL_ID, cfg.trace_block_size)
    sim_args = ["--sim-speedup", str(cfg.speedup)]
    if cfg.sim_timing:
        sim_args += ["--sim-timing", cfg.sim_timing]
    disk = tempfile.TemporaryDirectory(prefix="replay-kv-") if cfg.kv_offload_disk_bytes else None
    if cfg.kv_offload_memory:  # each node's tiers, in the modelled model's bytes (node/sim_fleet.py)
        sim_args += ["--kv-offload-memory", cfg.kv_offload_memory]
    if disk is not None:
        sim_args += ["--kv-offload-dir", disk.name, "--kv-offload-disk-bytes", str(cfg.kv_offload_disk_bytes)]
    deployment = None
    if cfg.profile:
        from splitserve.common.sim_profiles import get_deployment
        deployment = get_deployment(cfg.profile)
    router_args = (*sim_router_args(cfg.profile, cfg.speedup, cfg.score_weights), *cfg.router_args)
    cluster: SimCluster
    if deployment is not None and deployment.prefill is not deployment.decode:
        from .cluster import DeploymentSimCluster
        cluster = DeploymentSimCluster(deployment, cfg.prefill_nodes, cfg.num_decode_nodes, cfg.fleet_procs,
                                       sim_args, kv_cache_memory=cfg.kv_cache_memory, policy=cfg.policy,
                                       router_args=router_args)
    else:
        if deployment is not None:
            sim_args += ["--profile", deployment.prefill.name]
        cluster = SimCluster(cfg.prefill_nodes, cfg.num_decode_nodes, cfg.fleet_procs, sim_args,
                             kv_cache_memory=cfg.kv_cache_memory, policy=cfg.policy, router_args=router_args)
    print(f"[replay] starting redis, router ({cfg.policy}), {cfg.prefill_nodes} prefill + "
          f"{cfg.num_decode_nodes} decode simulated nodes ...", file=sys.stderr, flush=True)
    with cluster, disk or contextlib.nullcontext():
        start = time.perf_counter()
        outcomes = asyncio.run(replay(requests, cluster.url, BUNDLED_MODEL_ID, cfg.speedup,
                                      cfg.max_output_tokens, cfg.trace_block_size, conversations))
        wall_s = time.perf_counter() - start
        import urllib.request
        with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=10) as r:
            router_text = r.read().decode()
        per_node = prefill_requests_per_node(router_text)
        local = local_prefills(router_text)
        states = asyncio.run(prefill_node_states(cluster.redis_url))
        if any(map(not_idle, states.values())):  # a transfer may still be closing: look again
            time.sleep(IDLE_RECHECK_S)
            states = asyncio.run(prefill_node_states(cluster.redis_url))
        every = asyncio.run(node_states(cluster.redis_url))
        metrics = {role: asyncio.run(node_metrics(cluster.redis_url, role)) for role in ("prefill", "decode")}
        lower = None
        if cfg.kv_offload_memory:
            lower = {"hits": tier_counts(metrics["prefill"], names.KV_OFFLOAD_HITS),
                     "evictions": tier_counts(metrics["prefill"], names.KV_OFFLOAD_EVICTIONS)}
        looked = at_end(cluster) if at_end is not None else None
    overrun = {nid: float(st.get("sim_overrun_s", 0.0)) for nid, st in every.items()}
    if conversations is not None and {st["kv"]["block_size"] for st in states.values()} - {conversations.block_size}:
        raise RuntimeError("replay: the nodes' block size is not the one the pooled bound was computed in")
    result = summarize(cfg, requests, outcomes, per_node, states, wall_s, lower, overrun,
                       node_side(metrics, cfg.speedup), conversations, prompt_token_sources(metrics))
    result["local_prefills"] = local  # requests the router had a decode node prefill itself (decode-side reuse)
    if looked is not None:
        result["at_end"] = looked
    if cfg.result_json:
        Path(cfg.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.result_json).write_text(json.dumps(result, indent=1))
    return result


def _role_profiles(name: str | None) -> dict[str, str]:
    """The profile each role's nodes stood for (the same for a plain profile)."""
    if name is None:
        return {}
    from splitserve.common.sim_profiles import get_deployment
    d = get_deployment(name)
    return {"prefill_profile": d.prefill.name, "decode_profile": d.decode.name}


def print_summary(r: dict) -> None:
    print(f"policy {r['policy']}: {r['prefill_nodes']} prefill + {r['decode_nodes']} decode nodes, "
          f"{r['requests']} requests ({r['failed']} failed), {r['wall_s']} s wall at {r['speedup']}x\n"
          f"  hit rate {r['hit_rate']:.1%}  (oracle {r['oracle_hit_rate']:.1%}, "
          f"ratio {r['hit_rate_vs_oracle']})\n"
          f"  TTFT p50 {r['ttft_p50']:.2f} s  p90 {r['ttft_p90']:.2f} s  p99 {r['ttft_p99']:.2f} s "
          f"(trace time)\n  max/mean per prefill node: busy time {r['max_mean_load']}, "
          f"requests {r['max_mean_requests']}")
    if r.get("profile"):
        print(f"  profile {r['profile']}: prefill nodes {r['prefill_profile']}, decode nodes {r['decode_profile']}")
    if r.get("conversations"):
        c = r["conversations"]
        print(f"  {c['conversations']} conversations: {c['later_turns']} later turns sent after the answer before "
              f"them, its generated tokens in their prompts")
        if c["answers_not_reproduced"]:
            print(f"  ANSWERS NOT REPRODUCED: {c['answers_not_reproduced']} streamed answers were not the tokens "
                  f"put in the next turn's prompt (common/sim_tokens.py): the later turns are not the conversation")
    if r.get("prompt_tokens_by_source"):
        print("  prompt tokens by source: " + ", ".join(f"{k} {v:.1%}" for k, v in r["prompt_tokens_by_source"].items()))
    if r.get("hit_rate_by_tier"):
        print("  prompt tokens served by tier: " + ", ".join(f"{t} {v:.1%}" for t, v in r["hit_rate_by_tier"].items()))
    if r.get("schedule", {}).get("behind_schedule"):
        print(f"  BEHIND SCHEDULE: sends p99 {r['schedule']['late_p99_s']:.3f} s late (wall): this machine did not "
              f"keep the trace's pace at --speedup {r['speedup']}; the figures above are not the trace's")
    t = r.get("transfers")
    if t is not None and t["behind_model"]:
        print(f"  TRANSFERS BEHIND THE MODEL: {t['late']} of {t['transfers']} transfers arrived after their "
              f"modelled time, {t['late_share_of_ttft']:.1%} of the TTFT (trace time): this machine did not "
              f"move the stand-in blocks at --speedup {r['speedup']}; the TTFT figures are not the network's")
    for e in r["errors"]:
        print(f"  error: {e}")
    for node, held in r["prefill_nodes_not_idle_at_end"].items():
        print(f"  not idle at the end: {node} {held}")

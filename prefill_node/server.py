"""The prefill node: computes prompts with chunked prefill and prefix caching,
and pushes each completed KV block to the decode node that asked, while later
chunks are still computing. It samples the first token and keeps the computed
blocks in its prefix cache. It never decodes.

HTTP API (msgpack, see common/protocol.py; ``PrefillNode.routes`` and node/app.py):
  POST /prefill  PrefillRequest -> PrefillResult, once every block was sent
  POST /abort    Abort -> 200 (idempotent)
  GET  /health, /metrics, /debug/state
(the cluster token guards all but /health and /metrics; the KV sender presents it in
its handshake)

Block streaming, per request (engine thread -> event loop -> transport):

  ExportKV(req, skip_blocks), then AddRequest (engine/engine_thread.py):
  step k computes tokens .. n_k:  blocks [sent, n_k // bs) are complete -> pack
  last step (prompt done):        also the partial last block            -> pack
  BlocksReady events -> per-transfer queue -> KVSender.send_blocks (in order)

A prompt that cannot start now (too many waiting, KV pool full, node draining) is
refused with 503 and Retry-After, so the decode node prefills it itself at once
instead of waiting out its lease.
"""

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from ..common.config import NodeConfig
from ..common.errors import InvalidRequest
from ..common.http import error_response, msgpack_response, read_msgpack
from ..common.outcomes import PrefillOutcome
from ..common.protocol import PrefillRequest, PrefillResult, prompt_ids
from ..common.sampling_params import SamplingParams
from ..engine.engine_core import RequestDelta
from ..engine.engine_thread import AbortRequest, AddRequest, BlockExporter, BlocksReady, ExportKV
from ..kvtransfer import KVSender, TransferError, make_sender, sender_options
from ..kvtransfer.block_store import KVBlockStore
from ..node.app import build_node_app
from ..node.prompt_hashes import adopt_prompt_hashes
from ..node.runtime import NodeRuntime

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outgoing:
    """One request's outgoing transfer (event loop only)."""
    task: PrefillRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (dest ids, packed bytes) | None
    first: RequestDelta | None = None  # the sampled first token, once the prompt is done


class PrefillNode:
    """The prefill role's server (a node/app.py NodeServer), built with the app."""
    store: KVBlockStore  # over the engine's KV cache, from start() on

    def __init__(self, config: NodeConfig, runtime: NodeRuntime):
        self.config = config
        self.rt = runtime
        self.out: dict[str, Outgoing] = {}  # req_id -> transfer state
        self._exporter: BlockExporter | None = None  # from start() on
        self.senders: dict[str, KVSender] = {}  # backend -> KVSender (one connection pool each)
        m = runtime.metrics
        self.metrics = m
        self.m_requests, self.m_blocks = m.prefill_requests, m.blocks_sent
        self.m_bytes, self.m_send_seconds = m.bytes_sent, m.send_seconds

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/prefill", self.prefill)]

    @property
    def exporter(self) -> BlockExporter | None:
        return self._exporter

    @property
    def kv_addr(self) -> str:
        return ""  # a prefill node sends KV blocks; it receives none

    def _sender(self, backend: str) -> KVSender:
        if backend not in self.senders:
            # A send gets one lease, as the decode node's transfer does: past it the decode node
            # has given up (and prefilled itself), so a partitioned peer cannot hold this
            # request's blocks and its /prefill handler for the sender's default minute.
            options = sender_options(corrupt_every=1 if self.config.fault == "corrupt_block" else 0,
                                     cluster_token=self.config.cluster_token,
                                     timeout_s=self.config.transfer_lease_s)
            self.senders[backend] = make_sender(backend, self.rt.layout, options,
                                                device=self.config.engine.device)
        return self.senders[backend]

    async def start(self) -> None:
        """Once the engine is built; senders connect lazily, per backend and decode node."""
        self.store = KVBlockStore(self.rt.kv_caches, self.rt.layout)
        # the engine thread packs completed prompt blocks (a fresh buffer, not a view of the cache:
        # safe once the blocks are freed) and hands them to _on_blocks here
        self._exporter = BlockExporter(self.store.pack, self._on_blocks)

    async def stop(self) -> None:
        for s in self.senders.values():
            await s.close()

    def inflight(self) -> int:
        return len(self.out)

    # ---- engine events (on this event loop) -----------------------------------------------
    def _on_blocks(self, ev: BlocksReady) -> None:
        o = self.out.get(ev.request_id)
        if o is None:
            return  # aborted meanwhile
        skip = o.task.skip_blocks
        o.queue.put_nowait((o.task.dest_block_ids[ev.start - skip:ev.end - skip], ev.packed))

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            o = self.out.get(d.request_id)
            if o is not None and d.finish_reason is not None and o.first is None:
                o.first = d
                o.queue.put_nowait(None)  # every block is queued before the first token is sampled

    # ---- event loop ----------------------------------------------------------------------------
    def _refusal(self, prompt_len: int) -> str | None:
        """Why this node cannot start a prompt of ``prompt_len`` tokens now (None: it can). Read from the engine's
        published load: a prompt that would wait for blocks is better prefilled elsewhere
        than accepted and left to time out."""
        load, cfg = self.rt.engine_thread.load, self.config.engine
        bs = cfg.block_size
        if load.waiting >= cfg.max_num_seqs:
            return f"{load.waiting} requests already wait here"
        need = math.ceil((load.queued_prefill_tokens + prompt_len) / bs)
        if need > load.kv_free_blocks:
            return f"KV pool full ({load.kv_free_blocks} free blocks, {need} needed with the queue)"
        return None

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            task = await read_msgpack(request, PrefillRequest)
            prompt = prompt_ids(task.token_ids)
            if task.sampling_params.structured_outputs is not None:  # a first compile: off the loop
                await asyncio.to_thread(self._check, task, prompt)
            else:
                self._check(task, prompt)
        except InvalidRequest as e:
            self.m_requests.labels(PrefillOutcome.BAD_REQUEST).inc()
            return error_response(400, str(e), e.field)
        rid = task.request_id
        if rid in self.out:
            return error_response(409, f"request {rid} is already being prefilled", "request_id")
        refusal = self._refusal(len(prompt))
        if refusal is not None:
            self.m_requests.labels(PrefillOutcome.REFUSED).inc()
            resp = error_response(503, f"prefill node busy: {refusal}")
            resp.headers["Retry-After"] = "1"
            return resp
        params = _first_token_params(task.sampling_params)
        o = Outgoing(task)
        self.out[rid] = o
        sender_task = None
        engine = self.rt.engine_thread
        try:
            export = engine.submit(ExportKV(rid, task.skip_blocks))  # queued before the request runs
            hashes = adopt_prompt_hashes(task.prompt_hashes, prompt, self.config.engine,
                                         self.metrics.prompt_hashes, task.cache_salt)
            await engine.submit(AddRequest(rid, prompt, params, hashes, task.cache_salt))
            await export
            sender = self._sender(task.kv_backend)
            sender_task = asyncio.create_task(self._send_all(sender, o))
            sent = await sender_task
            first = o.first
            if first is None:
                self.m_requests.labels(PrefillOutcome.ABORTED).inc()
                return error_response(409, f"request {rid} was aborted")
            if not first.new_token_ids:
                self.m_requests.labels(PrefillOutcome.ERROR).inc()
                return error_response(500, f"request {rid} failed in the engine")
            self.m_requests.labels(PrefillOutcome.OK).inc()
            return msgpack_response(PrefillResult(
                transfer_id=task.transfer_id, first_token=first.new_token_ids[0],
                logprobs=first.new_logprobs[0], num_cached_tokens=first.num_cached_tokens, num_blocks_sent=sent,
                prompt_logprobs=first.prompt_logprobs))
        except InvalidRequest as e:
            self.m_requests.labels(PrefillOutcome.BAD_REQUEST).inc()
            return error_response(400, str(e), e.field)
        except TransferError as e:
            self.m_requests.labels(PrefillOutcome.TRANSFER_FAILED).inc()
            log.warning("request %s: transfer %s failed: %s", rid, task.transfer_id, e)
            return error_response(502, f"KV transfer failed: {e}")
        finally:  # success, failure or the decode node hung up: nothing stays behind
            self.out.pop(rid, None)
            if sender_task is not None and not sender_task.done():
                sender_task.cancel()
            await asyncio.shield(engine.submit(AbortRequest(rid)))

    async def _send_all(self, sender: KVSender, o: Outgoing) -> int:
        sent = 0
        while (item := await o.queue.get()) is not None:
            dests, packed = item
            start = time.perf_counter()
            await sender.send_blocks(o.task.kv_addr, o.task.transfer_id, list(zip(dests, self.store.split(packed))))
            self.m_send_seconds.inc(time.perf_counter() - start)
            sent += len(dests)
            self.m_blocks.inc(len(dests))
            self.m_bytes.inc(len(dests) * self.rt.layout.block_nbytes)
        return sent

    def _check(self, task: PrefillRequest, prompt: list[int]) -> None:
        """400s for ``task`` (``prompt``: its token ids, read)."""
        self.rt.limits.check(prompt, _first_token_params(task.sampling_params))
        n_blocks = math.ceil(len(prompt) / self.config.engine.block_size)
        if not 0 <= task.skip_blocks < n_blocks:
            raise InvalidRequest("skip_blocks", f"must be in [0, {n_blocks})")
        if len(task.dest_block_ids) != n_blocks - task.skip_blocks:
            raise InvalidRequest("dest_block_ids", f"expected {n_blocks - task.skip_blocks} ids")
        if task.kv_backend != self.config.kv_backend:
            raise InvalidRequest("kv_backend", f"this node sends over {self.config.kv_backend}, "
                                 f"not {task.kv_backend}")

    def end_stream(self, request_id: str) -> bool:
        """POST /abort (node/app.py), after the engine let go of the request: stop
        sending its blocks; False when none are being sent."""
        o = self.out.get(request_id)
        if o is not None:
            o.queue.put_nowait(None)
        return o is not None

    def debug_state(self) -> dict:
        return {"outgoing": len(self.out)}


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """One token, sampled with the request's own parameters; stops are the decode node's
    job (EOS and stop_token_ids stay: min_tokens masks them for this first token too)."""
    return msgspec.structs.replace(params, max_tokens=1, stop=[], min_tokens=min(params.min_tokens, 1))


def build_app(config: NodeConfig) -> web.Application:
    """The app of a prefill node."""
    runtime = NodeRuntime(config)
    return build_node_app(runtime, PrefillNode(config, runtime), shm=False)

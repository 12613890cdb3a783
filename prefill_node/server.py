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

  ExportKV(req, transfer, addrs, skip_blocks, dest ids), then AddRequest (engine/block_export.py:
  the engine thread owns the export from then on; this loop learns of it from events):
  admitted with a cached prefix:  its blocks [skip, cached // bs) -> pack before the
                                  first forward (after any lower-tier loads): they leave
                                  while the rest of the prompt computes
  step k computes tokens .. n_k:  blocks [sent, n_k // bs) are complete -> pack
  last step (prompt done):        also the partial last block            -> pack
  pack (prefill_node/block_packer.py) -> BlocksReady events -> per-transfer queue
                                  -> ShardSender.send_packed (in order)

Each decode rank gets its KV heads of every block (``PrefillRequest.kv_addrs``: one
receiver per decode rank; kvtransfer/tp_plan.py says which prefill rank sends which heads
where). With ``--tensor-parallel-size`` N this process is rank 0: its pack also sends the
worker ranks a ``KVExport`` Control (ordered with the steps), each worker packs and sends
its own slices (prefill_node/ranks.py) and reports ``RankSent``; the answer waits for
every rank's sends (kvtransfer/rank_report.py).

A prompt that cannot start now (too many waiting, KV pool full, node draining) is
refused with 503 and Retry-After, so the decode node prefills it itself at once
instead of waiting out its lease.

Prefix pull (node/kv_pull.py): a task that names a ``pull`` source (the router predicts a
longer cached prefix there, on any node) first fetches those blocks into this node's prefix
cache through its receive side (node/receive_side.py: tcp, ucx or nccl), then computes the rest; they leave
for the decode node like any cached prefix. Other nodes pull from this one at ``POST /kv/pull``.
Single-rank prefill nodes only (with worker ranks the task's pull is skipped).

A simulated node whose profile names a KV network (``SimConfig.kv_network_bytes_per_s``)
books each step's blocks on its modelled link and answers once the last of them would
have crossed it (node/sim_link.py), not when this machine's transport is done with the
stand-in blocks.
"""

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from ..common.config import NodeConfig
from ..common.kv_backends import DEFAULT_BACKEND
from ..common.errors import InvalidRequest
from ..common.http import error_response, msgpack_response, read_msgpack
from ..common.outcomes import PrefillOutcome
from ..common.protocol import PrefillRequest, PrefillResult
from ..common.sampling_params import SamplingParams
from ..engine.block_export import BlockExporter, BlocksReady, ExportKV
from ..engine.engine_core import RequestDelta
from ..engine.engine_thread import AbortRequest, AddRequest, Release
from ..engine.parallel.group import TPFailure
from ..kvtransfer import ShardSender, TransferError, TransferTable, make_sender
from ..kvtransfer.block_store import KVBlockStore
from ..kvtransfer.rank_report import RankMessage, RankSent
from ..kvtransfer.tp_plan import transfer_plan
from ..node.app import build_node_app
from ..node.grammar_service import (CompileUnavailable, GrammarNotCompiled, not_compiled_response,
                                    unavailable_response)
from ..node.kv_pull import Puller, pull_reservation
from ..node.prompt_hashes import count_hashes, read_prompt
from ..node.pull_holder import PullHolder
from ..node.receive_side import ReceiveSide
from ..node.runtime import NodeRuntime
from ..node.sim_link import SimLink
from .block_packer import BlockPacker
from .ranks import PrefillRank, rank_sender_options

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outgoing:
    """One request's outgoing transfer (event loop only; its export is the engine thread's,
    learned from BlocksReady events)."""
    task: PrefillRequest
    addrs: list[str]  # every decode rank's receiver, in rank order
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # block_packer.PackedChunk | None (prompt done)
    first: RequestDelta | None = None  # the sampled first token, once the prompt is done
    exported: int = 0  # blocks packed so far (each also announced to the worker ranks)
    worker_blocks: dict[int, int] = field(default_factory=dict)  # worker rank -> blocks it reported sent
    worker_error: str | None = None  # the first failure a worker rank reported (or the node's)
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a worker reported
    due: float = 0.0  # a simulated link's modelled arrival of the last block booked (SimLink.book)


class PrefillNode:
    """The prefill role's server (a node/app.py NodeServer), built with the app."""
    store: KVBlockStore  # over the engine's KV cache, from start() on

    def __init__(self, config: NodeConfig, runtime: NodeRuntime):
        self.config = config
        self.rt = runtime
        self.out: dict[str, Outgoing] = {}  # req_id -> transfer state
        self._exporter: BlockExporter | None = None  # from start() on
        self.senders: dict[str, ShardSender] = {}  # backend -> rank 0's sender (one connection pool each)
        sim = config.engine.sim
        self.link = SimLink(sim, config.engine.block_size) if sim is not None and sim.kv_network_bytes_per_s else None
        m = runtime.metrics
        self.metrics = m
        self.m_requests, self.m_blocks = m.prefill_requests, m.blocks_sent
        self.m_bytes, self.m_send_seconds = m.bytes_sent, m.send_seconds
        self.holder = PullHolder(config, runtime)  # other nodes pull prefixes this node caches
        # this node's pulls land through its receive side (single-rank nodes: started in start()), over
        # its own KV backend, or the default, tcp, for one that cannot serve pulls (shm and ipc map
        # the receiver's cache)
        backend = config.kv_backend if config.kv_spec.serves_pulls else DEFAULT_BACKEND
        self.receive = ReceiveSide(config, runtime, backend, TransferTable())

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/prefill", self.prefill), *self.holder.routes()]

    @property
    def exporter(self) -> BlockExporter | None:
        return self._exporter

    @property
    def kv_addr(self) -> str:
        return ""  # a prefill node sends KV blocks; it receives none

    def _sender(self, backend: str) -> ShardSender:
        if backend not in self.senders:
            sender = make_sender(backend, self.rt.layout, rank_sender_options(self.config),
                                 device=self.config.engine.device, shard=self.rt.shard)
            self.senders[backend] = ShardSender(sender, self.store, self.rt.shard)
        return self.senders[backend]

    async def start(self) -> None:
        """Once the engine is built; senders connect lazily, per backend and decode rank."""
        self.store = KVBlockStore(self.rt.kv_caches, self.rt.layout)
        # the engine thread packs completed prompt blocks (fresh buffers, not views of the cache:
        # safe once the blocks are freed) and hands them to _on_blocks here
        self._exporter = BlockExporter(BlockPacker(self.store, self.rt.shard, self.rt.leader), self._on_blocks)
        self.rt.on_failure.append(self._on_failure)
        if self.rt.tp > 1:
            self.rt.set_rank_handler(self._on_rank)
        else:
            await self.receive.start()

    @property
    def puller(self) -> Puller | None:
        """What this node pulls prefixes with (single-rank nodes: with worker ranks a task's pull
        is skipped)."""
        return self.receive.puller if self.receive.receiver is not None else None

    async def stop(self) -> None:
        for s in self.senders.values():
            await s.sender.close()
        await self.holder.stop()
        await self.receive.stop()

    def inflight(self) -> int:
        return len(self.out)

    # ---- engine events (on this event loop) -----------------------------------------------
    def _on_blocks(self, ev: BlocksReady) -> None:
        o = self.out.get(ev.request_id)
        if o is None:
            return  # aborted meanwhile
        o.exported += ev.end - ev.start
        if self.link is not None:
            o.due = self.link.book(ev.end - ev.start)
        o.queue.put_nowait(ev.packed)

    def _on_rank(self, rank: int, msg: RankMessage) -> None:
        """A worker rank's report (rank 0's event loop)."""
        if not isinstance(msg, RankSent):
            return  # RankReady: its sender is made; nothing to wait for
        o = self.out.get(msg.request_id)
        if o is None or o.task.transfer_id != msg.transfer_id:
            return  # the request ended meanwhile (this report may be of an earlier try of it)
        if msg.error is not None and o.worker_error is None:
            o.worker_error = f"prefill rank {rank}: {msg.error}"
        o.worker_blocks[rank] = o.worker_blocks.get(rank, 0) + msg.blocks
        self.m_bytes.inc(msg.nbytes)
        o.progress.set()

    def _on_failure(self, reason: str) -> None:
        """The node failed (a rank died): every request waiting on its ranks fails now."""
        for o in self.out.values():
            if o.worker_error is None:
                o.worker_error = f"this prefill node failed: {reason}"
            o.progress.set()
            o.queue.put_nowait(None)

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
            prompt = read_prompt(task.prompt, self.config.engine)
            self._check(task, prompt.token_ids)
            grammar = await self.rt.grammar(task.sampling_params, task.compile_grammar)  # compiled, or cached
        except InvalidRequest as e:
            self.m_requests.labels(PrefillOutcome.BAD_REQUEST).inc()
            return error_response(400, str(e), e.field)
        except CompileUnavailable as e:
            self.m_requests.labels(PrefillOutcome.REFUSED).inc()
            return unavailable_response(str(e))
        except GrammarNotCompiled as e:  # the decode node prefills it: it holds the grammar
            self.m_requests.labels(PrefillOutcome.REFUSED).inc()
            return not_compiled_response(e)
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
        o = Outgoing(task, task.decode_addrs())
        self.out[rid] = o
        sender_task = None
        engine = self.rt.engine_thread
        try:
            count_hashes(prompt, task.prompt, self.metrics.prompt_hashes)
            if task.pull is not None and self.puller is not None:  # the prefix another node holds, first
                await self.puller.pull(rid, prompt, task.pull)
            export = engine.submit(ExportKV(rid, task.transfer_id, o.addrs, task.skip_blocks,
                                            task.dest_block_ids))  # queued before the request runs
            await engine.submit(AddRequest(rid, prompt, params=params, grammar=grammar))
            await export
            sender = self._sender(task.kv_backend)
            sender_task = asyncio.create_task(self._send_all(sender, o))
            sent = await sender_task
            first = o.first
            if o.worker_error is not None:  # the node failed while this request ran
                raise TransferError(o.worker_error)
            if first is None:
                self.m_requests.labels(PrefillOutcome.ABORTED).inc()
                return error_response(409, f"request {rid} was aborted")
            if not first.new_token_ids:
                self.m_requests.labels(PrefillOutcome.ERROR).inc()
                return error_response(500, f"request {rid} failed in the engine")
            if self.link is not None:  # the modelled network carries the blocks no faster than that
                await self.link.arrive(o.due)
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
        except TPFailure as e:  # a rank of this node died: the decode node prefills it itself
            self.m_requests.labels(PrefillOutcome.ERROR).inc()
            return error_response(503, f"this prefill node failed: {e}")
        finally:  # success, failure or the decode node hung up: nothing stays behind
            self.out.pop(rid, None)
            if sender_task is not None and not sender_task.done():
                sender_task.cancel()
            try:
                await asyncio.shield(asyncio.gather(engine.submit(AbortRequest(rid)),
                                                    engine.submit(Release(pull_reservation(rid)))))  # its pull's
            except TPFailure:
                pass  # the engine stopped for good: it holds nothing any more

    async def _send_all(self, sender: ShardSender, o: Outgoing) -> int:
        """Send rank 0's slices as the steps complete them, then wait for every worker rank's;
        the blocks sent."""
        sent = 0
        while (chunk := await o.queue.get()) is not None:
            start = time.perf_counter()
            nbytes = await sender.send_packed(o.addrs, o.task.transfer_id, chunk.sends, chunk.dest_ids)
            self.m_send_seconds.inc(time.perf_counter() - start)
            sent += len(chunk.dest_ids)
            self.m_blocks.inc(len(chunk.dest_ids))
            self.m_bytes.inc(nbytes)
        if self.rt.tp > 1:
            await self._workers_sent(o)
        return sent

    async def _workers_sent(self, o: Outgoing) -> None:
        """Until every worker rank reported sending every block rank 0 packed (its slices
        acknowledged by the decode ranks). Raises ``TransferError`` on a worker's failure,
        the node's, or after the transfer lease (a worker that stopped answering)."""
        try:
            async with asyncio.timeout(self.config.transfer_lease_s):
                while True:
                    if o.worker_error is not None:
                        raise TransferError(o.worker_error)
                    if all(o.worker_blocks.get(r, 0) >= o.exported for r in range(1, self.rt.tp)):
                        return
                    o.progress.clear()
                    await o.progress.wait()
        except TimeoutError:
            raise TransferError(f"the worker ranks did not report their sends within "
                                f"{self.config.transfer_lease_s:g} s") from None

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
        key = self.rt.kv_key
        try:
            transfer_plan(key.tp, len(task.decode_addrs()), key.num_kv_heads)
        except ValueError as e:
            raise InvalidRequest("kv_addrs", f"{len(task.decode_addrs())} decode ranks: {e}") from None

    def end_stream(self, request_id: str) -> bool:
        """POST /abort (node/app.py), after the engine let go of the request: stop
        sending its blocks; False when none are being sent."""
        o = self.out.get(request_id)
        if o is not None:
            o.queue.put_nowait(None)
        return o is not None

    def debug_state(self) -> dict:
        return {"outgoing": len(self.out), "pulls": self.receive.table.counts(),
                **({"puller": self.puller.state()} if self.puller is not None else {}), **self.holder.state(),
                **({"sim_link": self.link.state()} if self.link is not None else {})}


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """One token, sampled with the request's own parameters; stops are the decode node's
    job (EOS and stop_token_ids stay: min_tokens masks them for this first token too)."""
    return msgspec.structs.replace(params, max_tokens=1, stop=[], min_tokens=min(params.min_tokens, 1))


def build_app(config: NodeConfig) -> web.Application:
    """The app of a prefill node (rank 0 of its ranks: prefill_node/ranks.py runs on the others)."""
    runtime = NodeRuntime(config, rank_role=PrefillRank)
    return build_node_app(runtime, PrefillNode(config, runtime), shm=False)

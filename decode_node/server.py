"""The decode node: continuous batching over the engine thread, the transfers it receives
(through node/receive_side.py: the receiver, the table's lease sweep, the peer session), and
the local-prefill fallback. Also runs as a colocated node (role "colocated":
every request prefilled locally), the baseline for comparisons.

HTTP API (msgpack bodies, see common/protocol.py; ``DecodeNode.routes`` and node/app.py):
  POST /generate        GenerateRequest -> stream of length-prefixed TokenDelta frames
  GET  /debug/transfers the transfer table (kvtransfer/state.py): live transfers, totals
  POST /abort           Abort -> 200 (idempotent)
  GET  /health, /metrics (Prometheus), /debug/state (pool, streams and transfers, JSON)
With a cluster token set, everything but /health and /metrics needs it (node/app.py),
and so does the KV receiver's handshake: nobody without it can make this node reserve
blocks or connect out to a prefill address.

One request's path when a prefill node is named:

  Reserve blocks (own prefix cache subtracted) -> TransferTable.reserve (lease) -> a Transfer
  -> PrefillClient.prefill --> blocks land via kvtransfer (checksummed; each renews the lease)
                           --> PrefillResult (the first token)
  -> Transfer.done resolves: the PrefillResult (every block landed and the result in)
                             or a TransferFailure (failed, refused, lease expired, aborted)
  -> the result: admit into the batch -> stream
     a failure: release the blocks, prefill locally, count a fallback

With ``--tensor-parallel-size`` N this process is rank 0 of N: each rank has a receiver over
its own KV heads (decode_node/ranks.py on the workers), the ``PrefillRequest`` names all of
them (``kv_addrs``), and the table counts every block on every rank (``ranks=N``): the
workers report what landed (``RankBlocks``) and acknowledge each transfer the table closes
(``TransfersClosed`` -> ``ClosedApplied``); a failed or aborted transfer's blocks are
released only once every worker acknowledged (kvtransfer/rank_report.py). If a rank dies,
the node breaks every stream (the router migrates them, ``--migration-limit``) and exits.

Each transfer is one ``Transfer`` in the table; the request's driver (``_transfer``)
is its one owner, awaits its one ``done`` future, and removes it. The table
resolves ``done`` from whichever input ends the transfer: a block (the receive side's
receiver), the prefill node's answer or failure (``_ask_prefill``), the lease sweeper, or the
driver's own abort. Whatever stage a request reached when its client left, the
handler's ``_end`` sends the engine one ``AbortRequest`` after the driver stopped,
which frees every block it holds (a reservation included).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, NamedTuple

import msgspec
from aiohttp import web

from ..common.config import NodeConfig
from ..common.errors import InvalidRequest
from ..common.http import error_response, read_msgpack
from ..common.outcomes import FallbackReason, TransferEnd, TransferStage
from ..common.prompt_ref import PromptRef
from ..common.protocol import GenerateRequest, PrefillRequest, PrefillResult, TokenDelta, encode_frame
from ..engine.block_export import BlockExporter
from ..engine.engine_core import RequestDelta
from ..engine.engine_thread import AbortRequest, AddPrefilled, AddRequest, EngineThread, Release, Reserve
from ..engine.parallel.group import TPFailure
from ..kvtransfer import TransferError
from ..kvtransfer.rank_report import ClosedApplied, RankBlocks, RankMessage, RankReady, TransfersClosed
from ..kvtransfer.state import TransferFailure, TransferTable
from ..node.app import build_node_app
from ..node.grammar_service import (CompileUnavailable, GrammarNotCompiled, not_compiled_response,
                                    unavailable_response)
from ..node.kv_pull import pull_reservation
from ..node.prompt_hashes import count_hashes, read_prompt
from ..node.pull_holder import PullHolder
from ..node.receive_side import ReceiveSide
from ..node.runtime import NodeRuntime
from .prefill_client import PrefillClient, PrefillFailed, PrefillGrammarMissing
from .ranks import DecodeRank

log = logging.getLogger(__name__)
RANKS_READY_S = 120.0  # start-up: every worker rank's receiver is up (they load the model first)
CLOSED_APPLIED_S = 10.0  # a worker that has not acknowledged a closed transfer by then is broken


class Fallback(NamedTuple):
    """Why a request is prefilled here after all."""
    reason: FallbackReason
    detail: str  # for the log


class DecodeNode:
    """The decode (or colocated) role's server (a node/app.py NodeServer), built with the app."""
    exporter: BlockExporter | None = None  # a decode node exports no blocks
    prefill_client: PrefillClient  # from start() on

    def __init__(self, config: NodeConfig, runtime: NodeRuntime):
        self.config = config
        self.rt = runtime
        tp = runtime.tp
        # transfer_id -> Transfer, each owned by its request's driver; every rank lands every block
        self.transfers = TransferTable(ranks=tp, on_closed=self._closed if tp > 1 else None,
                                       on_removed=self._forget_close if tp > 1 else None)
        # req_id -> its HTTP stream's queue; None ends the stream without a final frame (the node failed)
        self.streams: dict[str, asyncio.Queue[TokenDelta | None]] = {}
        self.rank_addrs: dict[int, str] = {}  # worker rank -> its receiver's address (RankReady)
        self._ranks_ready = asyncio.Event()  # every worker said RankReady
        self._closed_seq = 0  # TransfersClosed sent to the workers so far
        self._close_seq: dict[str, int] = {}  # transfer_id -> the seq that closed it (while in the table)
        self._applied: dict[int, int] = {r: 0 for r in range(1, tp)}  # worker rank -> highest seq it applied
        self._applied_event = asyncio.Event()  # some worker acknowledged
        self._aborts: set[asyncio.Task[bool]] = set()  # prefill aborts in flight (held: tasks are weak refs)
        # requests whose prefill node did not hold their grammar (compile_grammar false): their
        # first frame says so (TokenDelta.grammar_missed), for the router's compile budget
        self._grammar_missed: set[str] = set()
        m = runtime.metrics
        self.metrics = m
        self.m_fallbacks, self.m_transfers, self.m_blocks = m.fallbacks, m.transfers, m.blocks_received
        self.holder = PullHolder(config, runtime)  # other nodes pull prefixes this node caches
        # transfers land through the receive side (a decode node's: a colocated one receives none),
        # and so do the pulls of the prefixes the router names before it prefills a request itself
        self.receive = ReceiveSide(config, runtime, config.kv_backend, self.transfers, blocks=self.m_blocks,
                                   kv_addrs=lambda: self.kv_addrs, settle=self._closed_everywhere)
        self.puller = self.receive.puller

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/generate", self.generate), web.get("/debug/transfers", self.debug_transfers),
                *self.holder.routes()]

    @property
    def engine_thread(self) -> EngineThread:
        return self.rt.engine_thread

    @property
    def kv_addrs(self) -> list[str]:
        """Every rank's receiver, in rank order (what a PrefillRequest names)."""
        return [self.kv_addr] + [self.rank_addrs[r] for r in range(1, self.rt.tp)]

    @property
    def kv_addr(self) -> str:
        """Rank 0's receiver ("" on a colocated node: it receives no KV)."""
        return self.receive.address

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.receive.start(receive=self.config.role == "decode")
        assert self.receive.session is not None
        self.prefill_client = PrefillClient(self.receive.session)
        self.rt.on_failure.append(self._on_failure)
        if self.rt.tp > 1:
            self.rt.set_rank_handler(self._on_rank)
            await self._wait_ranks_ready()

    async def _wait_ranks_ready(self) -> None:
        """Until every worker rank said RankReady (a decode rank: its receiver runs). Raises
        ``TPFailure`` when the node failed meanwhile (a rank died), ``TimeoutError`` past
        RANKS_READY_S."""
        waits = [asyncio.create_task(self._ranks_ready.wait()), asyncio.create_task(self.rt.failed.wait())]
        try:
            async with asyncio.timeout(RANKS_READY_S):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.rt.failure is not None:
            raise TPFailure(self.rt.failure)

    async def stop(self) -> None:
        await self.receive.stop()
        await self.holder.stop()

    def inflight(self) -> int:
        return len(self.streams)

    # ---- the worker ranks (rank 0's event loop) ----------------------------------------------
    def _on_rank(self, rank: int, msg: RankMessage) -> None:
        if isinstance(msg, RankBlocks):
            if msg.landed:
                self.m_blocks.labels("true").inc(len(msg.landed))
            if msg.failed:
                self.m_blocks.labels("false").inc(len(msg.failed))
            self.transfers.on_rank_blocks(msg)  # renews the lease
        elif isinstance(msg, ClosedApplied):
            self._applied[rank] = max(self._applied[rank], msg.seq)
            self._applied_event.set()
        elif isinstance(msg, RankReady):
            self.rank_addrs[rank] = msg.kv_addr
            if len(self.rank_addrs) == self.rt.tp - 1:
                self._ranks_ready.set()

    def _closed(self, transfer_id: str) -> None:
        """The table closed a transfer (it takes no more blocks): tell every worker rank."""
        self._closed_seq += 1
        self._close_seq[transfer_id] = self._closed_seq
        assert self.rt.ranks is not None
        self.rt.ranks.broadcast(TransfersClosed(seq=self._closed_seq, transfer_ids=[transfer_id]))

    def _forget_close(self, transfer_id: str) -> None:
        """The table let go of ``transfer_id`` (its owner removed it, whatever its end): so
        does its close record."""
        self._close_seq.pop(transfer_id, None)

    async def _closed_everywhere(self, transfer_id: str) -> None:
        """Until every worker rank applied the close of ``transfer_id``: no frame of it lands
        on any rank after this, so its blocks may hold another request's KV. Bounded: a
        worker that does not answer is broken (the node fails)."""
        seq = self._close_seq.get(transfer_id)
        if seq is None:
            return
        try:
            async with asyncio.timeout(CLOSED_APPLIED_S):
                while min(self._applied.values()) < seq and self.rt.failure is None:
                    self._applied_event.clear()
                    await self._applied_event.wait()
        except TimeoutError:
            self.rt.fail(f"tensor-parallel ranks did not acknowledge closing transfer {transfer_id} "
                         f"within {CLOSED_APPLIED_S:g} s")

    def _on_failure(self, reason: str) -> None:
        """The node failed (a rank died): end every stream without a final frame, so the router
        migrates it (or fails it fast), and fail every live transfer (its prefill node aborts)."""
        for q in self.streams.values():
            q.put_nowait(None)
        for row in self.transfers.snapshot():
            if self.transfers.is_live(row["transfer_id"]):
                self.transfers.fail(row["transfer_id"], f"this decode node failed: {reason}")
        self._applied_event.set()

    # ---- engine output ---------------------------------------------------------------------
    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        # a dead rank stopped the engine (EngineThread.fatal is set before these deltas are
        # queued): its "error" deltas become cut streams, which the router can migrate
        broken = self.rt.failure is not None or self.engine_thread.fatal is not None
        for d in deltas:
            q = self.streams.get(d.request_id)
            if q is not None and broken and d.finish_reason == "error":
                q.put_nowait(None)
            elif q is not None:
                q.put_nowait(TokenDelta(request_id=d.request_id, token_ids=d.new_token_ids,
                                        logprobs=d.new_logprobs, finish_reason=d.finish_reason,
                                        num_cached_tokens=d.num_cached_tokens,
                                        prompt_logprobs=d.prompt_logprobs))

    # ---- transfer inputs (on this event loop; the table resolves the transfer's future) ----
    async def _ask_prefill(self, addr: str, task: PrefillRequest) -> None:
        """Ask the prefill node; its answer (or failure) goes to the transfer's table."""
        try:
            result = await self.prefill_client.prefill(addr, task)
        except PrefillFailed as e:  # transport, HTTP or a bad answer: the transfer fails, we fall back
            if isinstance(e, PrefillGrammarMissing):
                self._grammar_missed.add(task.request_id)
            self.transfers.fail(task.transfer_id, str(e))
            return
        except Exception as e:
            log.exception("request %s: unexpected error calling the prefill node", task.request_id)
            self.transfers.fail(task.transfer_id, f"{type(e).__name__}: {e}")
            return
        self.transfers.prefilled(task.transfer_id, result)

    # ---- request path ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = await read_msgpack(request, GenerateRequest)
            prompt = read_prompt(req.prompt, self.config.engine)
            self.rt.limits.check(prompt.token_ids, req.sampling_params)  # a 400 now, not an error frame later
            grammar = await self.rt.grammar(req.sampling_params, req.compile_grammar)  # compiled, or cached
        except InvalidRequest as e:
            return error_response(400, str(e), e.field)
        except CompileUnavailable as e:
            return unavailable_response(str(e))
        except GrammarNotCompiled as e:
            return not_compiled_response(e)
        if req.request_id in self.streams:
            return error_response(409, f"request {req.request_id} is already running", "request_id")
        queue: asyncio.Queue[TokenDelta | None] = asyncio.Queue()
        self.streams[req.request_id] = queue
        resp = web.StreamResponse(headers={"Content-Type": "application/x-splitserve-frames"})
        driver = asyncio.create_task(self._drive(req, prompt, queue, grammar))
        generated = False  # the engine finished it (stop, length): its driver is returning now
        first = True
        try:
            await resp.prepare(request)
            while True:
                delta = await queue.get()
                if delta is None:  # the node failed: no final frame, the router sees a broken node
                    break
                if first and req.request_id in self._grammar_missed:
                    delta.grammar_missed = True
                first = False
                await resp.write(encode_frame(delta))
                if delta.finish_reason is not None:
                    generated = delta.finish_reason not in ("abort", "error")
                    break
            await resp.write_eof()
            return resp
        finally:  # client gone, handler cancelled, or done: nothing may leak
            self.streams.pop(req.request_id, None)
            self._grammar_missed.discard(req.request_id)
            # A request that ends on its first token finishes while AddPrefilled's awaiter
            # has yet to resume: let it count the transfer as owned rather than abort it.
            if not driver.done() and not generated:
                driver.cancel()
            await asyncio.shield(self._end(req.request_id, driver))

    async def _end(self, rid: str, driver: asyncio.Task[None]) -> None:
        """The request's one terminal step, whatever stage it reached: after the driver
        is done, AbortRequest frees what any earlier command took (a reservation made by
        a Reserve whose awaiter was cancelled included), and a Release its pull's
        reservation; no-ops for a finished request."""
        await asyncio.gather(driver, return_exceptions=True)
        try:
            await asyncio.gather(self.engine_thread.submit(AbortRequest(rid)),
                                 self.engine_thread.submit(Release(pull_reservation(rid))))  # its pull's
        except TPFailure:
            pass  # the engine stopped for good (a rank died): it holds nothing any more

    async def _drive(self, req: GenerateRequest, prompt: PromptRef,
                     queue: asyncio.Queue[TokenDelta | None], grammar: Any = None) -> None:
        """Get the request into the running batch: through a KV transfer, or locally.
        ``prompt``: ``req.prompt`` read (node/prompt_hashes.py); ``grammar``: its structured
        output's, compiled (the engine thread never compiles)."""
        rid = req.request_id
        count_hashes(prompt, req.prompt, self.metrics.prompt_hashes)
        if req.prefill_addr and self.config.role == "decode":
            fallback = await self._transfer(req, req.prefill_addr, prompt, grammar)
            if fallback is None:
                return
            self.m_fallbacks.labels(fallback.reason).inc()
            log.warning("request %s: falling back to local prefill (%s: %s)", rid, fallback.reason,
                        fallback.detail)
        elif req.pull is not None and self.receive.receiver is not None:  # prefilled here: the held prefix first
            await self.puller.pull(rid, prompt, req.pull)
        try:
            await self.engine_thread.submit(AddRequest(rid, prompt, params=req.sampling_params, grammar=grammar))
        except InvalidRequest as e:
            queue.put_nowait(TokenDelta(request_id=rid, finish_reason="error", error=str(e)))

    async def _transfer(self, req: GenerateRequest, prefill_addr: str, prompt: PromptRef,
                        grammar: Any = None) -> Fallback | None:
        """Run the transfer from the prefill node at ``prefill_addr``; None when the
        request was admitted, else why it was not. ``prompt``: ``req.prompt`` read. The
        transfer's one owner: it ends here, in the table, on every path."""
        rid, tid = req.request_id, req.transfer_id or uuid.uuid4().hex
        t0 = time.monotonic()
        res = await self.engine_thread.submit(Reserve(rid, prompt))
        t1 = time.monotonic()
        if res is None:
            return Fallback(FallbackReason.NO_BLOCKS, "pool full")
        skip = res.num_cached_tokens // self.config.engine.block_size
        transfer = self.transfers.reserve(tid, rid, res.block_ids[skip:], self.config.transfer_lease_s)
        # the router's prompt, forwarded (its hashes only when they checked out here)
        wire = req.prompt if prompt.adopted else msgspec.structs.replace(req.prompt, hashes=None)
        task = PrefillRequest(request_id=rid, transfer_id=tid, prompt=wire,
                              sampling_params=req.sampling_params, kv_backend=self.config.kv_backend,
                              kv_addr=self.kv_addr, skip_blocks=skip, dest_block_ids=res.block_ids[skip:],
                              kv_addrs=self.kv_addrs if self.rt.tp > 1 else [],
                              pull=req.pull, compile_grammar=req.compile_grammar)
        call = asyncio.create_task(self._ask_prefill(prefill_addr, task))
        admitted = False
        try:
            # shielded: cancelling this request aborts the transfer (below), which resolves
            # the future; the future itself is never cancelled
            outcome = await asyncio.shield(transfer.done)
            if isinstance(outcome, TransferFailure):
                raise TransferError(outcome.reason)
            assert isinstance(outcome, PrefillResult), "a prefill node's transfer is answered by a PrefillResult"
            t2 = time.monotonic()
            # The prompt tokens not computed for this request: the prefill node's hit (a hit
            # here only saves sending blocks; the prefill node still computes them).
            await self.engine_thread.submit(AddPrefilled(
                rid, prompt, params=req.sampling_params, first_token=outcome.first_token, logprobs=outcome.logprobs,
                num_cached_tokens=outcome.num_cached_tokens, prompt_logprobs=outcome.prompt_logprobs,
                grammar=grammar))
            admitted = True
            self.transfers.own(tid)
            self.m_transfers.labels(TransferEnd.OWNED).inc()
            for stage, seconds in ((TransferStage.RESERVE, t1 - t0), (TransferStage.TRANSFER, t2 - t1),
                                   (TransferStage.ADMIT, time.monotonic() - t2)):
                self.metrics.transfer_stages.labels(stage).observe(seconds)
            return None  # the first token went out through on_deltas, ahead of the decode steps
        except asyncio.CancelledError:
            self.transfers.abort(tid, "request cancelled")
            self.m_transfers.labels(TransferEnd.ABORTED).inc()
            raise
        except (TransferError, InvalidRequest) as e:
            self.transfers.fail(tid, str(e))
            self.m_transfers.labels(TransferEnd.FAILED).inc()
            return Fallback(FallbackReason.TRANSFER_FAILED, str(e))
        finally:
            if not call.done():
                call.cancel()
            if not admitted:
                self.transfers.fail(tid, "not admitted")  # no-op unless an unexpected error got here
                abort = asyncio.create_task(self.prefill_client.abort(prefill_addr, rid))
                self._aborts.add(abort)
                abort.add_done_callback(self._aborts.discard)
                # Over shm and ipc (release_grace_s) the prefill node writes into our memory first;
                # give a sender that is still mid-frame time to stop before the blocks are reused.
                if grace := self.config.kv_spec.release_grace_s:
                    await asyncio.shield(asyncio.sleep(grace))
                await asyncio.shield(self._closed_everywhere(tid))  # every rank stopped landing it
                try:
                    await asyncio.shield(self.engine_thread.submit(Release(rid)))
                except TPFailure:
                    pass  # the engine stopped for good: it holds nothing any more
            self.transfers.remove(tid)

    def end_stream(self, request_id: str) -> bool:
        """POST /abort (node/app.py), after the engine let go of the request: end its
        stream here; False when no stream of that id is open."""
        q = self.streams.get(request_id)
        if q is not None:
            q.put_nowait(TokenDelta(request_id=request_id, finish_reason="abort"))
        return q is not None

    def debug_state(self) -> dict:
        return {"transfers": self.transfers.snapshot(), "transfer_counts": self.transfers.counts(),
                "streams": len(self.streams), "puller": self.puller.state(),
                "closed_transfers_tracked": len(self._close_seq), **self.holder.state()}

    async def debug_transfers(self, request: web.Request) -> web.Response:
        """GET /debug/transfers: every transfer in the table (oldest first), the count per
        state, and the totals since start (``reserved`` equals the sum of ``resolutions``
        once no transfer is live: each transfer's future resolved once)."""
        return web.json_response({"transfers": self.transfers.snapshot(), "counts": self.transfers.counts(),
                                  **self.transfers.totals()})


def build_app(config: NodeConfig) -> web.Application:
    """The app of a decode or colocated node (rank 0 of its ranks: decode_node/ranks.py runs
    on the others)."""
    runtime = NodeRuntime(config, rank_role=DecodeRank)
    shm = config.role == "decode" and config.kv_spec.shm_cache
    return build_node_app(runtime, DecodeNode(config, runtime), shm)

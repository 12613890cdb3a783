"""The decode node: continuous batching over the engine thread, the KV receiver,
and the local-prefill fallback. Also runs as a colocated node (role "colocated":
every request prefilled locally), the baseline for comparisons.

HTTP API (msgpack bodies, see common/protocol.py):
  POST /generate  GenerateRequest -> stream of length-prefixed TokenDelta frames
  POST /abort     Abort -> 200 (idempotent)
  GET  /health, /metrics (Prometheus), /debug/state (pool and transfers, JSON)
With a cluster token set, everything but /health and /metrics needs it (node/runtime.py),
and so does the KV receiver's handshake: nobody without it can make this node reserve
blocks or connect out to a prefill address.

One request's path when a prefill node is named:

  Reserve blocks (own prefix cache subtracted) -> TransferTable.reserve (lease)
  -> POST prefill/prefill --> blocks land via kvtransfer (checksummed; each renews the lease)
                          --> PrefillResult (the first token)
  -> every block landed and the result in: admit into the batch -> stream
  any failure / refusal (503) / lease expiry: release the blocks, prefill locally, count a fallback

One signal ends a transfer's wait: ``finished[transfer_id]``, resolved only by
``_settle`` after each input (a block, the prefill node's answer or failure, the
lease sweeper). Whatever stage a request reached when its client left, the handler's
``_end`` sends the engine one ``AbortRequest`` after the driver stopped, which frees
every block it holds (a reservation included).
"""

import asyncio
import logging
import uuid
from typing import NamedTuple

import aiohttp
import msgspec
from aiohttp import web

from ..common.auth import auth_headers
from ..common.config import NodeConfig
from ..common.errors import InvalidRequest
from ..common.http import MSGPACK, decode_error_body, error_response, peer_connector, read_msgpack
from ..common.outcomes import FallbackReason, TransferEnd
from ..common.protocol import (Abort, GenerateRequest, PrefillRequest, PrefillResult, TokenDelta, encode_frame,
                               prompt_ids)
from ..engine.engine_core import RequestDelta
from ..engine.engine_thread import AbortRequest, AddPrefilled, AddRequest, EngineThread, Release, Reserve
from ..kvtransfer import TransferError, make_receiver
from ..kvtransfer.block_store import KVBlockStore
from ..kvtransfer.state import TransferState, TransferTable
from ..node.runtime import NodeRuntime, build_node_app

log = logging.getLogger(__name__)
RELEASE_GRACE_S = 0.5  # shm, ipc: wait before reusing the blocks of a failed or aborted transfer
LEASE_CHECK_S = 0.5  # how often expired leases are failed


class Fallback(NamedTuple):
    """Why a request is prefilled here after all."""
    reason: FallbackReason
    detail: str  # for the log


class DecodeNode:
    def __init__(self, config: NodeConfig, runtime: NodeRuntime):
        self.config = config
        self.rt = runtime
        self.exporter = None  # a decode node exports no blocks
        self.transfers = TransferTable()
        self.streams: dict[str, asyncio.Queue] = {}  # req_id -> TokenDelta queue of its HTTP stream
        # transfer_id -> the one "transfer finished" signal: True once every block landed and the
        # prefill node answered, False once it failed or was aborted (set only by _settle)
        self.finished: dict[str, asyncio.Future] = {}
        self.prefill_results: dict[str, PrefillResult] = {}  # transfer_id -> the prefill node's answer
        self.receiver = None
        self.session: aiohttp.ClientSession | None = None
        m = runtime.metrics
        self.metrics = m
        self.m_fallbacks, self.m_transfers, self.m_blocks = m.fallbacks, m.transfers, m.blocks_received

    @property
    def engine_thread(self) -> EngineThread:
        return self.rt.engine_thread

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        # peer_connector: a task written into a partition fails in seconds, not after the lease
        self.session = aiohttp.ClientSession(connector=peer_connector(),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             headers=auth_headers(self.config.cluster_token))
        if self.config.role == "decode":
            store = KVBlockStore(self.rt.kv_caches, self.rt.layout, self.rt.shm_name)
            self.receiver = make_receiver(self.config.kv_backend, self.rt.layout, store, self.config.host,
                                          self._on_block, device=self.config.engine.device)
            self.receiver.accepts = self.transfers.is_live
            self.receiver.cluster_token = self.config.cluster_token
            await self.receiver.start()
            self.rt.kv_addr = self.receiver.address
        self._lease_task = asyncio.create_task(self._expire_leases())

    async def stop(self) -> None:
        self._lease_task.cancel()
        if self.receiver is not None:
            await self.receiver.stop()
        await self.session.close()

    def inflight(self) -> int:
        return len(self.streams)

    # ---- engine output ---------------------------------------------------------------------
    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            q = self.streams.get(d.request_id)
            if q is not None:
                q.put_nowait(TokenDelta(request_id=d.request_id, token_ids=d.new_token_ids,
                                        logprobs=d.new_logprobs, finish_reason=d.finish_reason,
                                        num_cached_tokens=d.num_cached_tokens,
                                        prompt_logprobs=d.prompt_logprobs))

    # ---- transfer events (on this event loop) ------------------------------------------------
    def _settle(self, transfer_id: str) -> None:
        """Resolve the transfer's finished signal if its state says it is over."""
        fut = self.finished.get(transfer_id)
        if fut is None or fut.done():
            return
        t = self.transfers.get(transfer_id)
        if t is None or t.state in (TransferState.FAILED, TransferState.ABORTED):
            fut.set_result(False)
        elif self.transfers.ready(transfer_id):
            fut.set_result(True)

    def _on_block(self, transfer_id: str, dest_block_id: int, ok: bool, reason: str | None) -> None:
        self.m_blocks.labels(str(ok).lower()).inc()
        self.transfers.on_block(transfer_id, dest_block_id, ok, reason)  # renews the lease
        self._settle(transfer_id)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            for t in self.transfers.expired():
                self.transfers.fail(t.transfer_id, "lease expired: no block arrived for "
                                    f"{self.config.transfer_lease_s:g}s")
                self._settle(t.transfer_id)

    async def _call_prefill(self, addr: str, task: PrefillRequest) -> None:
        """Ask the prefill node; its answer (or failure) goes into the transfer's state."""
        tid = task.transfer_id
        try:
            async with self.session.post(f"{addr}/prefill", data=msgspec.msgpack.encode(task),
                                         headers={"Content-Type": MSGPACK}) as r:
                body = await r.read()
                if r.status != 200:
                    raise TransferError(f"prefill node answered {r.status}: {decode_error_body(body)}")
            result = msgspec.msgpack.decode(body, type=PrefillResult)
        except Exception as e:  # transport, HTTP or a bad answer: the transfer fails, we fall back
            if not isinstance(e, (TransferError, aiohttp.ClientError, OSError, TimeoutError, msgspec.DecodeError)):
                log.exception("request %s: unexpected error calling the prefill node", task.request_id)
            self.transfers.fail(tid, f"{type(e).__name__}: {e}")
            self._settle(tid)
            return
        if tid in self.finished:  # still waited for
            self.prefill_results[tid] = result
            self.transfers.prefilled(tid)
            self._settle(tid)

    # ---- request path ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = await read_msgpack(request, GenerateRequest)
            prompt = prompt_ids(req.token_ids)
            if req.sampling_params.structured_outputs is not None:  # a grammar's first compile: off the loop
                await asyncio.to_thread(self.rt.limits.check, prompt, req.sampling_params)
            else:
                self.rt.limits.check(prompt, req.sampling_params)  # a 400 now, not an error frame later
        except InvalidRequest as e:
            return error_response(400, str(e), e.field)
        if req.request_id in self.streams:
            return error_response(409, f"request {req.request_id} is already running", "request_id")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[req.request_id] = queue
        resp = web.StreamResponse(headers={"Content-Type": "application/x-splitserve-frames"})
        driver = asyncio.create_task(self._drive(req, prompt, queue))
        generated = False  # the engine finished it (stop, length): its driver is returning now
        try:
            await resp.prepare(request)
            while True:
                delta: TokenDelta = await queue.get()
                await resp.write(encode_frame(delta))
                if delta.finish_reason is not None:
                    generated = delta.finish_reason not in ("abort", "error")
                    break
            await resp.write_eof()
            return resp
        finally:  # client gone, handler cancelled, or done: nothing may leak
            self.streams.pop(req.request_id, None)
            # A request that ends on its first token finishes while AddPrefilled's awaiter
            # has yet to resume: let it count the transfer as owned rather than abort it.
            if not driver.done() and not generated:
                driver.cancel()
            await asyncio.shield(self._end(req.request_id, driver))

    async def _end(self, rid: str, driver: asyncio.Task) -> None:
        """The request's one terminal step, whatever stage it reached: after the driver
        is done, AbortRequest frees what any earlier command took (a reservation made by
        a Reserve whose awaiter was cancelled included); a no-op for a finished request."""
        await asyncio.gather(driver, return_exceptions=True)
        await self.engine_thread.submit(AbortRequest(rid))

    async def _drive(self, req: GenerateRequest, prompt: list[int], queue: asyncio.Queue) -> None:
        """Get the request into the running batch: through a KV transfer, or locally.
        ``prompt``: ``req.token_ids`` read (``prompt_ids``)."""
        rid = req.request_id
        cfg = self.config.engine
        hashes = self.metrics.adopt_hashes(req.prompt_hashes, prompt, cfg.block_size, cfg.model_id)
        if req.prefill_addr and self.config.role == "decode":
            fallback = await self._transfer(req, prompt, queue, hashes)
            if fallback is None:
                return
            self.m_fallbacks.labels(fallback.reason).inc()
            log.warning("request %s: falling back to local prefill (%s: %s)", rid, fallback.reason,
                        fallback.detail)
        try:
            await self.engine_thread.submit(AddRequest(rid, prompt, req.sampling_params, hashes))
        except InvalidRequest as e:
            queue.put_nowait(TokenDelta(request_id=rid, finish_reason="error", error=str(e)))

    async def _transfer(self, req: GenerateRequest, prompt: list[int], queue: asyncio.Queue,
                        hashes: list[int] | None) -> Fallback | None:
        """Run the transfer; None when the request was admitted, else why it was not.
        ``hashes``: the prompt's block hashes when the router's checked out."""
        rid, tid = req.request_id, req.transfer_id or uuid.uuid4().hex
        res = await self.engine_thread.submit(Reserve(rid, prompt, hashes))
        if res is None:
            return Fallback(FallbackReason.NO_BLOCKS, "pool full")
        bs = self.config.engine.block_size
        skip = res.num_cached_tokens // bs
        self.transfers.reserve(tid, rid, res.block_ids[skip:], self.config.transfer_lease_s)
        self.finished[tid] = done = asyncio.get_running_loop().create_future()
        task = PrefillRequest(request_id=rid, transfer_id=tid, token_ids=req.token_ids,
                              sampling_params=req.sampling_params, kv_backend=self.config.kv_backend,
                              kv_addr=self.rt.kv_addr, skip_blocks=skip, dest_block_ids=res.block_ids[skip:],
                              prompt_hashes=req.prompt_hashes if hashes is not None else None)
        call = asyncio.create_task(self._call_prefill(req.prefill_addr, task))
        admitted = False
        try:
            if not await done:
                raise TransferError(self.transfers.get(tid).reason or "failed")
            result = self.prefill_results[tid]  # settled True only after the prefill node answered
            self.transfers.complete(tid)
            # The prompt tokens not computed for this request: the prefill node's hit (a hit
            # here only saves sending blocks; the prefill node still computes them).
            await self.engine_thread.submit(AddPrefilled(
                rid, prompt, req.sampling_params, result.first_token, result.logprobs,
                result.num_cached_tokens, hashes, result.prompt_logprobs))
            admitted = True
            self.transfers.own(tid)
            self.m_transfers.labels(TransferEnd.OWNED).inc()
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
            self.finished.pop(tid, None)
            self.prefill_results.pop(tid, None)
            if not call.done():
                call.cancel()
            if not admitted:
                asyncio.create_task(self._abort_prefill(req.prefill_addr, rid))
                # Over shm and ipc the prefill node writes into our memory before it tells us;
                # give a sender that is still mid-frame time to stop before the blocks are reused.
                if self.config.kv_backend in ("shm", "ipc"):
                    await asyncio.shield(asyncio.sleep(RELEASE_GRACE_S))
                await asyncio.shield(self.engine_thread.submit(Release(rid)))
            self.transfers.remove(tid)

    async def _abort_prefill(self, prefill_addr: str, rid: str) -> None:
        try:
            async with self.session.post(f"{prefill_addr}/abort", data=msgspec.msgpack.encode(Abort(rid)),
                                         headers={"Content-Type": MSGPACK},
                                         timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass  # the prefill node is gone: nothing of ours is left there

    def end_stream(self, request_id: str) -> bool:
        """POST /abort (node/runtime.py), after the engine let go of the request: end its
        stream here; False when no stream of that id is open."""
        q = self.streams.get(request_id)
        if q is not None:
            q.put_nowait(TokenDelta(request_id=request_id, finish_reason="abort"))
        return q is not None

    def debug_state(self) -> dict:
        return {"transfers": self.transfers.snapshot(), "transfer_counts": self.transfers.counts(),
                "streams": len(self.streams)}


def build_app(config: NodeConfig) -> web.Application:
    shm = config.role == "decode" and config.kv_backend == "shm"
    return build_node_app(config, DecodeNode, shm, {"/generate": "generate"})

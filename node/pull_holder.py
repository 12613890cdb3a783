"""The holder's end of a prefix pull (node/kv_pull.py has the protocol and the puller's end):
``PullHolder`` serves ``POST /kv/pull``, copying the leading cached blocks of a prefix out on
the engine thread chunk by chunk, as the node's pull budget grants them (node/pull_budget.py:
one budget for every pull the node serves), and sending each over the KV transport to the
puller's receivers. Must not decide what is pulled (the router does) or pace the copies
itself (the budget does); touches the engine only through ``ExportCached``.

Faults for tests (``--fault``): ``stall_pull`` holds every pull back until the test kills
the node; ``stall_pull_midway`` sends a pull's first chunk, then holds the rest back for
STALL_MIDWAY_S (the test kills the puller meanwhile), then goes on.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..common.config import Fault, NodeConfig
from ..common.kv_backends import backend_names
from ..common.errors import InvalidRequest
from ..common.http import error_response, msgpack_response, read_msgpack
from ..common.outcomes import PullServed
from ..common.prompt_ref import PromptRef
from ..common.protocol import PullRequest, PullResult
from ..engine.engine_thread import ExportCached, Exported
from ..engine.parallel.group import TPFailure
from ..kvtransfer import ShardSender, TransferError, make_sender, sender_options
from ..kvtransfer.block_store import KVBlockStore
from .prompt_hashes import read_prompt
from .pull_budget import PULLS_SERVED_MAX
from .runtime import NodeRuntime
from .sim_link import SimLink

log = logging.getLogger(__name__)
STALL_MIDWAY_S = 3.0
STALL_FAULTS = (Fault.STALL_PULL, Fault.STALL_PULL_MIDWAY)


class PullHolder:
    """``POST /kv/pull``: send the leading blocks of a prefix this node caches, within the node's
    pull budget (``NodeRuntime.pull_budget``, node/pull_budget.py), which every pull it serves
    shares."""

    def __init__(self, config: NodeConfig, rt: NodeRuntime):
        self.config = config
        self.rt = rt
        self.senders: dict[str, ShardSender] = {}  # backend -> sender (one connection pool each)
        sim = config.engine.sim
        self.link = SimLink(sim, config.engine.block_size) if sim is not None and sim.kv_network_bytes_per_s else None
        m = rt.metrics
        self.m_served, self.m_blocks, self.m_copy_s = m.pulls_served, m.pull_blocks_served, m.pull_copy_seconds
        self.stalled = 0  # pulls held back by a stall fault

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/kv/pull", self.serve)]

    async def stop(self) -> None:
        for s in self.senders.values():
            await s.sender.close()

    def _sender(self, backend: str) -> ShardSender:
        if backend not in self.senders:
            opts = sender_options(corrupt_every=1 if self.config.fault == Fault.CORRUPT_BLOCK else 0,
                                  cluster_token=self.config.cluster_token, timeout_s=self.config.transfer_lease_s)
            sender = make_sender(backend, self.rt.layout, opts, device=self.config.engine.device, shard=self.rt.shard)
            self.senders[backend] = ShardSender(sender, KVBlockStore(self.rt.kv_caches, self.rt.layout),
                                                self.rt.shard)
        return self.senders[backend]

    async def serve(self, request: web.Request) -> web.Response:
        try:
            task = await read_msgpack(request, PullRequest)
            prefix = read_prompt(task.prompt, self.config.engine)
            self._check(task, prefix.token_ids)
        except InvalidRequest as e:
            return error_response(400, str(e), e.field)
        if self.rt.tp > 1:
            return error_response(409, f"this node has {self.rt.tp} tensor-parallel ranks: pulls from it "
                                  "are not supported")
        budget = self.rt.pull_budget
        if not budget.admit():
            self.m_served.labels(PullServed.REFUSED).inc()
            resp = error_response(503, f"this node serves {PULLS_SERVED_MAX} prefix pulls already; compute the "
                                  "prefix, or pull it later")
            resp.headers["Retry-After"] = "1"
            return resp
        try:
            return await self._serve(task, prefix)
        except asyncio.CancelledError:
            self.m_served.labels(PullServed.ABORTED).inc()
            raise
        finally:
            budget.leave()

    async def _serve(self, task: PullRequest, prefix: PromptRef) -> web.Response:
        if self.config.fault == Fault.STALL_PULL:
            self.stalled += 1
            await asyncio.Event().wait()  # until the test kills this node
        if prefix.hashes is None:  # none carried, or they did not check out: hashed once, off the loop
            await asyncio.to_thread(prefix.block_hashes)  # (a 100k-token prefix: tens of milliseconds)
        sender = self._sender(task.kv_backend)
        want, sent, due = len(task.dest_block_ids), 0, 0.0
        budget, block_bytes = self.rt.pull_budget, self.rt.layout.block_nbytes
        try:
            while sent < want:
                most, out = await self._copy(task, prefix, sender, sent)
                k = out.blocks
                try:
                    if k:
                        await sender.send_packed(task.kv_addrs, task.transfer_id, out.packed,
                                                 task.dest_block_ids[sent:sent + k])
                        self.m_blocks.inc(k)
                        if self.link is not None:
                            due = self.link.book(k)
                finally:
                    budget.release(k * block_bytes)
                    device_s = out.copy.device_s()  # a GPU's copies ran: their blocks were sent
                    if device_s:
                        budget.charge(device_s)
                        budget.measured(k, out.copy.host_s + device_s)
                        self.m_copy_s.inc(device_s)
                sent += k
                if k < most:
                    break  # the run of held blocks ends here
                if sent == k and self.config.fault == Fault.STALL_PULL_MIDWAY and sent < want:
                    self.stalled += 1
                    await asyncio.sleep(STALL_MIDWAY_S)
            if self.link is not None and sent:
                await self.link.arrive(due)
        except TransferError as e:
            self.m_served.labels(PullServed.FAILED).inc()
            log.warning("pull %s for request %s failed after %d blocks: %s", task.transfer_id, task.request_id,
                        sent, e)
            return error_response(502, f"KV transfer failed: {e}")
        except TPFailure as e:
            self.m_served.labels(PullServed.FAILED).inc()
            return error_response(503, f"this node failed: {e}")
        self.m_served.labels(PullServed.SENT).inc()
        return msgpack_response(PullResult(transfer_id=task.transfer_id, num_blocks=sent))

    async def _copy(self, task: PullRequest, prefix: PromptRef, sender: ShardSender,
                    sent: int) -> tuple[int, Exported]:
        """The next chunk of ``task``'s blocks after the ``sent`` first, copied out on the engine
        thread when the budget grants it: (the blocks granted, what was copied). The copied
        blocks' packed bytes stay held in the budget until the caller releases them."""
        budget, block_bytes, n_addrs = self.rt.pull_budget, self.rt.layout.block_nbytes, len(task.kv_addrs)
        async with budget.turn():
            most = await budget.grant(len(task.dest_block_ids) - sent, block_bytes)
            try:
                out = await self.rt.engine_thread.submit(ExportCached(
                    f"pull:{task.transfer_id}", prefix, start_block=task.skip_blocks + sent, max_blocks=most,
                    pack=lambda ids: sender.pack(n_addrs, ids)))
            except BaseException:
                budget.release(most * block_bytes)
                raise
            budget.release((most - out.blocks) * block_bytes)
            budget.charge(out.copy.host_s)
            budget.measured(out.blocks, out.copy.host_s)
            self.m_copy_s.inc(out.copy.host_s)
        return most, out

    @property
    def block_copy_s(self) -> float | None:
        """Seconds per block the last chunk cost (the budget's measure)."""
        return self.rt.pull_budget.block_copy_s

    def state(self) -> dict:
        """Its part of ``/debug/state``."""
        return {"pulls_stalled": self.stalled} if self.config.fault in STALL_FAULTS else {}


    def _check(self, task: PullRequest, prefix: list[int]) -> None:
        """400s for ``task`` (``prefix``: its token ids, read)."""
        bs = self.config.engine.block_size
        if not prefix or len(prefix) % bs:
            raise InvalidRequest("token_ids", f"{len(prefix)} tokens: a pulled prefix is whole blocks of {bs}")
        blocks = len(prefix) // bs
        if not 0 <= task.skip_blocks < blocks:
            raise InvalidRequest("skip_blocks", f"must be in [0, {blocks})")
        if not 0 < len(task.dest_block_ids) <= blocks - task.skip_blocks:
            raise InvalidRequest("dest_block_ids", f"expected 1 to {blocks - task.skip_blocks} ids")
        if task.kv_backend not in backend_names():
            raise InvalidRequest("kv_backend", f"must be one of {', '.join(backend_names())}")

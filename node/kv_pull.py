"""Prefix pull: a node fetches the KV of a prompt's leading blocks from another node that
caches them (any role, any tier), then computes only the rest.

Owns both ends, which every role has: ``PullHolder`` serves ``POST /kv/pull`` (the holder)
and ``Puller`` runs one pull into this node's blocks (the node about to compute a prompt:
a prefill node, or a decode node prefilling locally). The router decides who pulls what
from whom (``GenerateRequest.pull``, router/routing/cache_aware.py); must not decide that
here, or touch the engine but through its commands.

One pull (common/protocol.py)::

    puller: Reserve(prefix) -- its own cached blocks are kept, the rest reserved
            TransferTable.reserve(dest blocks) -- the lease, as any transfer
            POST holder/kv/pull PullRequest ------> holder: ExportCached(next chunk)  on its engine
                                                    thread, between two steps: the leading held
                                                    blocks copied out (lower tiers loaded first)
            <==== KV blocks (checksummed) ======    send them; again until done or a miss
            <---- PullResult(num_blocks) -------
            CommitPulled: the landed blocks join the prefix cache, the reservation is freed
    then the request is added as usual and finds them as its hit

The holder copies a pull's blocks out between its steps, one chunk per engine pass, each
chunk sized by time (``pull_chunk_blocks``): while it runs requests, a chunk's copy takes at
most ``PULL_STEP_SHARE`` of its mean step, so a pull from a busy decode node slows its running
batch by at most that share per step (the stated budget); an idle holder copies up to a whole
step's time per pass. The copy rate is measured on the chunks themselves (a memcpy on the
host, a gather on the device); the first chunk, before any measurement, is
``PULL_PROBE_BLOCKS``. Each chunk looks its blocks up again by hash and verifies their
tokens, so a block evicted mid-pull ends the run there: the holder sends the blocks it still
had and says how many, and the puller computes the rest. It never sends a block under another
block's hash.

Every failure (the holder unreachable or dead, a block failing its checksum, the lease
running out) frees the reserved blocks and the puller computes the prompt itself: a pull
never fails a request. ``splitserve:kv_pulls_total{outcome}`` counts each pull, and
``kv_pull_tokens_total`` the prompt tokens it saved.

A holder or puller with several tensor-parallel ranks is not supported yet: the holder answers
409 (its worker ranks hold the other heads); the router pulls only from single-rank nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import msgspec
from aiohttp import web

from ..common.config import NodeConfig
from ..common.kv_backends import backend_names, backend_spec
from ..common.errors import InvalidRequest
from ..common.hashing import hash_blocks, hash_keys, token_bytes
from ..common.http import MSGPACK, decode_error_body, error_response, msgpack_response, read_msgpack
from ..common.outcomes import PullOutcome, PullServed
from ..common.protocol import PullRequest, PullResult, PullSource, prompt_ids
from ..engine.engine_thread import CommitPulled, ExportCached, Release, Reserve
from ..engine.parallel.group import TPFailure
from ..kvtransfer import PackedSend, ShardSender, TransferError, make_sender, sender_options
from ..kvtransfer.block_store import KVBlockStore
from ..kvtransfer.state import TransferFailure, TransferTable
from .runtime import NodeRuntime
from .sim_link import SimLink

log = logging.getLogger(__name__)
PULL_STEP_SHARE = 0.1  # of a busy holder's mean step: the most one chunk's copy may add to a step
PULL_PROBE_BLOCKS = 16  # a holder's first chunk, before it measured its copy rate
STALL_FAULT = "stall_pull"  # --fault: the holder holds every pull back (tests kill it meanwhile)
# A pull whose holder lands no block for this long fails and the puller computes the prefix: a
# pull is worth less than the prompt's compute, so a stuck or partitioned holder costs at most this
# (a prefill transfer's lease, --transfer-lease, guards a whole prompt's compute and is longer).
PULL_LEASE_S = 5.0


def pull_chunk_blocks(left: int, busy: bool, step_s: float, block_copy_s: float | None) -> int:
    """Blocks of a pull to copy in the next engine pass (module docstring), of ``left`` still
    wanted: a ``busy`` holder (running or queued requests) spends at most PULL_STEP_SHARE of its
    mean step ``step_s`` on the copy, an idle one at most a step; ``block_copy_s``: its measured
    seconds per block copied (None: not measured yet). At least one block, so a pull progresses."""
    if block_copy_s is None or step_s <= 0:
        return min(left, PULL_PROBE_BLOCKS)
    if block_copy_s <= 0:
        return left
    fits = step_s * (PULL_STEP_SHARE if busy else 1.0) / block_copy_s * (1 + 1e-9)  # float rounding
    return left if fits >= left else max(1, int(fits))


class PullHolder:
    """``POST /kv/pull``: send the leading blocks of a prefix this node caches."""

    def __init__(self, config: NodeConfig, rt: NodeRuntime):
        self.config = config
        self.rt = rt
        self.senders: dict[str, ShardSender] = {}  # backend -> sender (one connection pool each)
        sim = config.engine.sim
        self.link = SimLink(sim, config.engine.block_size) if sim is not None and sim.kv_network_bytes_per_s else None
        self.m_served, self.m_blocks = rt.metrics.pulls_served, rt.metrics.pull_blocks_served
        self.stalled = 0  # pulls held back by the stall fault
        # seconds per block of the last chunk copied (written on the engine thread inside the
        # ExportCached that the loop awaits, read by the loop after it); None: none copied yet
        self.block_copy_s: float | None = None

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/kv/pull", self.serve)]

    async def stop(self) -> None:
        for s in self.senders.values():
            await s.sender.close()

    def _sender(self, backend: str) -> ShardSender:
        if backend not in self.senders:
            opts = sender_options(corrupt_every=1 if self.config.fault == "corrupt_block" else 0,
                                  cluster_token=self.config.cluster_token, timeout_s=self.config.transfer_lease_s)
            sender = make_sender(backend, self.rt.layout, opts, device=self.config.engine.device, shard=self.rt.shard)
            self.senders[backend] = ShardSender(sender, KVBlockStore(self.rt.kv_caches, self.rt.layout),
                                                self.rt.shard)
        return self.senders[backend]

    async def serve(self, request: web.Request) -> web.Response:
        try:
            task = await read_msgpack(request, PullRequest)
            prefix = prompt_ids(task.token_ids)
            self._check(task, prefix)
        except InvalidRequest as e:
            return error_response(400, str(e), e.field)
        if self.rt.tp > 1:
            return error_response(409, f"this node has {self.rt.tp} tensor-parallel ranks: pulls from it "
                                  "are not supported")
        if self.config.fault == STALL_FAULT:
            self.stalled += 1
            await asyncio.Event().wait()  # until the test kills this node
        bs = self.config.engine.block_size
        # off the loop: a 100k-token prefix is tens of milliseconds of hashing
        hashes = await asyncio.to_thread(hash_blocks, prefix, bs, hash_keys(self.config.engine.model_id,
                                                                            task.cache_salt))
        sender = self._sender(task.kv_backend)
        n_addrs, want, sent, due = len(task.kv_addrs), len(task.dest_block_ids), 0, 0.0
        engine = self.rt.engine_thread
        export_id = f"pull:{task.transfer_id}"
        try:
            while sent < want:
                stats = engine.stats
                load = stats.load
                most = pull_chunk_blocks(want - sent, load.running + load.waiting > 0,
                                         stats.busy_s / stats.steps if stats.steps else 0.0, self.block_copy_s)
                k, packed = await engine.submit(ExportCached(
                    export_id, prefix, hashes, task.cache_salt, task.skip_blocks + sent, most,
                    lambda ids: self._timed_pack(sender, n_addrs, ids)))
                if k:
                    await sender.send_packed(task.kv_addrs, task.transfer_id, packed,
                                             task.dest_block_ids[sent:sent + k])
                    self.m_blocks.inc(k)
                    if self.link is not None:
                        due = self.link.book(k)
                sent += k
                if k < most:
                    break  # the run of held blocks ends here
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

    def _timed_pack(self, sender: ShardSender, n_addrs: int, ids: list[int]) -> list[PackedSend]:
        """Engine thread: ``sender.pack`` of ``ids``, its seconds per block kept for the next chunk."""
        t0 = time.perf_counter()
        packed = sender.pack(n_addrs, ids)
        self.block_copy_s = (time.perf_counter() - t0) / len(ids)
        return packed

    def state(self) -> dict:
        """Its part of ``/debug/state``."""
        return {"pulls_stalled": self.stalled} if self.config.fault == STALL_FAULT else {}

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


class Puller:
    """Runs pulls into this node's KV blocks. ``table``, ``kv_addrs`` and ``kv_backend``: the
    transfer table its receivers report to, their addresses (one per rank, in rank order) and
    their backend; ``settle``: awaited with a failed pull's transfer id before its blocks are
    reused (a tensor-parallel decode node: every rank stopped landing it)."""

    def __init__(self, config: NodeConfig, rt: NodeRuntime, table: TransferTable,
                 kv_addrs: Callable[[], list[str]], kv_backend: str,
                 settle: Callable[[str], Awaitable[None]] | None = None):
        self.config = config
        self.rt = rt
        self.table = table
        self.kv_addrs = kv_addrs
        self.kv_backend = kv_backend
        self.settle = settle
        self.session: aiohttp.ClientSession | None = None  # set by the owner's start()
        self.m_pulls, self.m_tokens = rt.metrics.pulls, rt.metrics.pull_tokens

    async def pull(self, request_id: str, prompt: Sequence[int], hashes: list[int] | None, salt: str | None,
                   source: PullSource) -> int:
        """Fetch ``source``'s cached prefix of ``prompt`` into this node's prefix cache; the
        prompt tokens now cached here thanks to it (0 when nothing moved: the request then
        computes them). Never raises but ``CancelledError``."""
        bs = self.config.engine.block_size
        blocks = min(source.tokens, len(prompt) - 1) // bs  # one prompt token is always computed
        if blocks <= 0:
            return 0
        prefix = list(prompt[:blocks * bs])
        phashes = hashes[:blocks] if hashes is not None and len(hashes) >= blocks else None
        rid = f"{request_id}:pull"
        engine = self.rt.engine_thread
        try:  # one token more, so that every block of the prefix this node caches counts (and is kept)
            res = await engine.submit(Reserve(rid, list(prompt[:blocks * bs + 1]), phashes, salt))
        except (InvalidRequest, TPFailure) as e:
            log.warning("request %s: no pull (%s)", request_id, e)
            self.m_pulls.labels(PullOutcome.NO_BLOCKS).inc()
            return 0
        if res is None:
            self.m_pulls.labels(PullOutcome.NO_BLOCKS).inc()
            return 0
        skip = res.num_cached_tokens // bs
        dest = res.block_ids[skip:blocks]
        if not dest:  # this node caches it all already
            await asyncio.shield(self._give_back(None, rid))
            return 0
        tid = uuid.uuid4().hex
        transfer = self.table.reserve(tid, rid, dest, min(PULL_LEASE_S, self.config.transfer_lease_s))
        task = PullRequest(request_id=request_id, transfer_id=tid, token_ids=token_bytes(prefix),
                           kv_backend=self.kv_backend, kv_addrs=self.kv_addrs(), skip_blocks=skip,
                           dest_block_ids=dest, cache_salt=salt)
        call = asyncio.create_task(self._ask(source.addr, task))
        committed = False
        t0 = time.monotonic()
        try:
            outcome = await asyncio.shield(transfer.done)
            if isinstance(outcome, TransferFailure):
                self.m_pulls.labels(PullOutcome.FAILED).inc()
                log.warning("request %s: pull of %d blocks from %s failed (%s); computing them", request_id,
                            len(dest), source.node_id, outcome.reason)
                return 0
            self.table.own(tid)
            landed = len(transfer.dest_block_ids)
            if not landed:
                self.m_pulls.labels(PullOutcome.HELD_NONE).inc()
                return 0
            await engine.submit(CommitPulled(rid, prefix, phashes, salt, (skip + landed) * bs))
            committed = True
            self.m_pulls.labels(PullOutcome.PULLED).inc()
            self.m_tokens.inc(landed * bs)
            log.debug("request %s: pulled %d blocks from %s in %.3f s", request_id, landed, source.node_id,
                      time.monotonic() - t0)
            return landed * bs
        except asyncio.CancelledError:
            self.table.abort(tid, "request cancelled")
            self.m_pulls.labels(PullOutcome.ABORTED).inc()
            raise
        except TPFailure:
            self.m_pulls.labels(PullOutcome.FAILED).inc()
            return 0
        finally:
            if not call.done():
                call.cancel()
            if not committed:
                self.table.abort(tid, "not committed")  # a no-op once failed, aborted or owned
                await asyncio.shield(self._give_back(tid, rid))
            self.table.remove(tid)

    async def _give_back(self, tid: str | None, rid: str) -> None:
        """Free a pull's reservation once nothing can land in it any more (``tid``: its
        transfer, None before it had one)."""
        if tid is not None and (grace := backend_spec(self.kv_backend).release_grace_s):
            await asyncio.sleep(grace)  # the sender writes in place: one mid-frame stops first
        if tid is not None and self.settle is not None:
            await self.settle(tid)
        try:
            await self.rt.engine_thread.submit(Release(rid))
        except TPFailure:
            pass  # the engine stopped for good: it holds nothing any more

    async def _ask(self, addr: str, task: PullRequest) -> None:
        """Ask the holder; its answer (or failure) goes to the transfer's table."""
        assert self.session is not None, "Puller.session is set when its node starts"
        try:
            async with self.session.post(f"{addr}/kv/pull", data=msgspec.msgpack.encode(task),
                                         headers={"Content-Type": MSGPACK}) as r:
                body = await r.read()
                if r.status != 200:
                    self.table.fail(task.transfer_id, f"holder answered {r.status}: {decode_error_body(body)}")
                    return
            result = msgspec.msgpack.decode(body, type=PullResult)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self.table.fail(task.transfer_id, f"holder {addr}: {type(e).__name__}: {e}")
            return
        except msgspec.DecodeError as e:
            self.table.fail(task.transfer_id, f"holder {addr} sent a bad answer: {e}")
            return
        self.table.prefilled(task.transfer_id, result)

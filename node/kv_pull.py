"""Prefix pull: a node fetches the KV of a prompt's leading blocks from another node that
caches them (any role, any tier), then computes only the rest.

Every role has both ends. This module owns the puller's: ``Puller`` runs one pull into this
node's blocks (the node about to compute a prompt: a prefill node, or a decode node
prefilling locally). The holder's, ``PullHolder`` serving ``POST /kv/pull``, is
node/pull_holder.py, and the budget it serves every pull from node/pull_budget.py. The
router decides who pulls what from whom (``GenerateRequest.pull``,
router/routing/cache_aware.py); must not decide that here, or touch the engine but through
its commands.

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

The holder copies a pull's blocks out between its steps, in chunks, within one budget for
every pull it serves (node/pull_budget.py): one chunk at a time for the whole node, the pulls
taking turns; while it runs requests, the chunks of all its pulls together take at most
``PULL_STEP_SHARE`` of its step per step (so N pullers of a hot prefix slow its running batch
by that share, not N times it); an idle holder copies up to a step's time per chunk. A chunk
is charged everything it cost the engine thread (the lookup, a lower tier's reads, checks and
loads, the copy; on a GPU the device time of its copies: engine/copy_timer.py), and sized by
that rate, measured on the chunks themselves; the first, before any measurement, is
``PULL_PROBE_BLOCKS``. What the holder holds packed and not yet sent, all pulls together, is
at most ``--kv-pull-memory``; it serves at most ``PULLS_SERVED_MAX`` pulls at once and answers
503 to more (the puller computes the prefix). Each chunk looks its blocks up again by hash and
verifies their tokens, so a block evicted mid-pull ends the run there: the holder sends the
blocks it still had and says how many, and the puller computes the rest. It never sends a
block under another block's hash.

Every failure (the holder unreachable, dead or full, a block failing its checksum, the lease
running out, the request cancelled at any point, its ``Reserve`` included) frees the reserved
blocks and the puller computes the prompt itself: a pull never fails a request.
``splitserve:kv_pulls_total{outcome}`` counts each pull, and ``kv_pull_tokens_total`` the
prompt tokens it saved.

A holder or puller with several tensor-parallel ranks is not supported yet: the holder answers
409 (its worker ranks hold the other heads); the router pulls only from single-rank nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from ..common.config import NodeConfig
from ..common.kv_backends import backend_spec
from ..common.errors import InvalidRequest
from ..common.http import MSGPACK, decode_error_body
from ..common.outcomes import PullOutcome
from ..common.prompt_ref import PromptRef
from ..common.protocol import PullRequest, PullResult, PullSource
from ..engine.engine_thread import CommitPulled, Release, Reserve
from ..engine.parallel.group import TPFailure
from ..kvtransfer.state import TransferFailure, TransferTable
from .runtime import NodeRuntime

log = logging.getLogger(__name__)
# A pull whose holder lands no block for this long fails and the puller computes the prefix: a
# pull is worth less than the prompt's compute, so a stuck or partitioned holder costs at most this
# (a prefill transfer's lease, --transfer-lease, guards a whole prompt's compute and is longer).
PULL_LEASE_S = 5.0


def pull_reservation(request_id: str) -> str:
    """The id a request's pull reserves its blocks under. The request's owner releases it in its
    terminal step too, after the pull ended (it has always released it by then)."""
    return f"{request_id}:pull"


class Puller:
    """Runs pulls into this node's KV blocks (a node's receive side builds it and sets its
    session: node/receive_side.py). ``table``, ``kv_addrs`` and ``kv_backend``: the
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
        self.reserving = 0  # pulls whose Reserve the engine thread has not answered yet

    async def pull(self, request_id: str, prompt: PromptRef, source: PullSource) -> int:
        """Fetch ``source``'s cached prefix of ``prompt`` into this node's prefix cache; the
        prompt tokens now cached here thanks to it (0 when nothing moved: the request then
        computes them). Never raises but ``CancelledError``, and gives back whatever its
        ``Reserve`` took on every path: a failure of any kind costs the pull only, and a pull
        cancelled while its ``Reserve`` waits for the engine thread queues the ``Release``
        behind it (commands run in order), so the blocks it takes are freed when it runs."""
        bs = self.config.engine.block_size
        blocks = min(source.tokens, len(prompt) - 1) // bs  # one prompt token is always computed
        if blocks <= 0:
            return 0
        # one token more, so that every block of the prefix this node caches counts (and is kept)
        reserved = prompt.prefix(blocks * bs + 1)
        rid = pull_reservation(request_id)
        tid: str | None = None  # the pull's transfer, once it has one
        committed = False  # CommitPulled kept the landed blocks and freed the reservation
        self.reserving += 1
        try:
            try:
                res = await self.rt.engine_thread.submit(Reserve(rid, reserved))
            finally:
                self.reserving -= 1
            if res is None:
                self.m_pulls.labels(PullOutcome.NO_BLOCKS).inc()
                return 0
            skip = res.num_cached_tokens // bs
            dest = res.block_ids[skip:blocks]
            if not dest:  # this node caches it all already
                return 0
            prefix = reserved.prefix(blocks * bs)  # its hashes, the Reserve's
            tid = uuid.uuid4().hex
            landed = await self._land(request_id, prefix, source, skip, dest, tid)
            if landed:
                await self.rt.engine_thread.submit(CommitPulled(rid, prefix, num_tokens=(skip + landed) * bs))
                committed = True
                self.m_pulls.labels(PullOutcome.PULLED).inc()
                self.m_tokens.inc(landed * bs)
            return landed * bs
        except asyncio.CancelledError:
            self.m_pulls.labels(PullOutcome.ABORTED).inc()
            raise
        except (InvalidRequest, TPFailure) as e:  # no blocks for it here, or the engine stopped for good
            log.warning("request %s: no pull (%s)", request_id, e)
            self.m_pulls.labels(PullOutcome.NO_BLOCKS if tid is None else PullOutcome.FAILED).inc()
            return 0
        except Exception:  # a bug, or a lower tier failing under the Reserve: the request computes it all
            log.exception("request %s: the pull failed; computing the prompt", request_id)
            self.m_pulls.labels(PullOutcome.FAILED).inc()
            return 0
        finally:
            if tid is not None:
                self.table.abort(tid, "not committed")  # a no-op once failed, aborted or owned
            if not committed:
                await asyncio.shield(self._give_back(tid, rid))
            if tid is not None:
                self.table.remove(tid)

    async def _land(self, request_id: str, prefix: PromptRef, source: PullSource, skip: int,
                    dest: list[int], tid: str) -> int:
        """Have ``source`` send blocks ``skip ..`` of ``prefix`` into ``dest`` as transfer ``tid``;
        how many landed (0: none, or the transfer failed). The caller frees ``dest`` unless it
        commits them."""
        transfer = self.table.reserve(tid, pull_reservation(request_id), dest,
                                      min(PULL_LEASE_S, self.config.transfer_lease_s))
        task = PullRequest(request_id=request_id, transfer_id=tid, prompt=prefix.wire(), kv_backend=self.kv_backend,
                           kv_addrs=self.kv_addrs(), skip_blocks=skip, dest_block_ids=dest)
        call = asyncio.create_task(self._ask(source.addr, task))
        t0 = time.monotonic()
        try:
            outcome = await asyncio.shield(transfer.done)
        except asyncio.CancelledError:
            self.table.abort(tid, "request cancelled")
            raise
        finally:
            if not call.done():
                call.cancel()
        if isinstance(outcome, TransferFailure):
            self.m_pulls.labels(PullOutcome.FAILED).inc()
            log.warning("request %s: pull of %d blocks from %s failed (%s); computing them", request_id,
                        len(dest), source.node_id, outcome.reason)
            return 0
        self.table.own(tid)
        if not transfer.dest_block_ids:
            self.m_pulls.labels(PullOutcome.HELD_NONE).inc()
        log.debug("request %s: pulled %d blocks from %s in %.3f s", request_id, len(transfer.dest_block_ids),
                  source.node_id, time.monotonic() - t0)
        return len(transfer.dest_block_ids)

    def state(self) -> dict:
        """Its part of ``/debug/state``."""
        return {"reserving": self.reserving}

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

"""Block exports: a request's prompt blocks packed for a receiver as the engine completes
them. Each export is one object, the engine thread's, carried there whole by the command
that starts it; the event loop learns how it goes from events alone.

Owns the ``ExportKV`` command (everything an export needs), the ``BlocksReady`` event
(what it hands back), the ``BlockExporter`` (the node's pack, and where the events go) and
``BlockExports`` (the engine thread's exports, one per request). Must not: send anything
(the node does, on its event loop), or be touched off the engine thread::

    event loop                                     engine thread
    submit(ExportKV(req, transfer, addrs,  ---->   BlockExports.start: req -> BlockExport
                    skip, dest ids))               each step (BlockExports.pack): the prompt
                                                   blocks [packed, complete) -> pack(export,
                                                   src ids, dest ids)
    exporter.on_blocks(BlocksReady)        <----   call_soon_threadsafe
                                                   AbortRequest or the request's end: stop

Which prompt blocks a step completes, and where each goes (``bs``: block size, ``n``: prompt
tokens, ``skip``: blocks the receiver holds; ``dest_block_ids[i]`` is prompt block ``skip + i``)::

    prompt blocks  [0 .. skip)  [skip .. packed)  [packed .. upto)   [upto .. ceil(n / bs))
                   not packed   packed already    packed now         not computed yet
    upto = num_computed // bs, or ceil(n / bs) once the whole prompt is computed (the partial
    last block goes too)
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .kv.cache_manager import KVCacheManager
from .scheduler import SchedulerOutput


class ExportKV(NamedTuple):
    """Command: export ``request_id``'s prompt blocks (send it before the AddRequest; it ends
    with the request)."""
    request_id: str
    transfer_id: str  # the receiver's name for this export
    addrs: list[str]  # every receiver (one per decode rank), in rank order
    skip_blocks: int  # prompt blocks the receiver holds: not packed
    dest_block_ids: list[int]  # the receiver's block for each prompt block from ``skip_blocks`` on


class BlocksReady(NamedTuple):
    """Event: prompt blocks [start, end) of ``request_id``, packed (``end`` is the last block,
    partial, once the prompt is computed)."""
    request_id: str
    start: int
    end: int
    packed: Any  # what the exporter's pack returned for those blocks


class BlockExporter(NamedTuple):
    """How exports pack blocks (engine thread) and where their BlocksReady go (event loop).
    ``pack(export, src_ids, dest_ids)``: prompt blocks by engine block id, and the receiver's
    block for each -> a fresh buffer (not a view of the cache), or whatever the node makes of
    them (a tensor-parallel node also tells its workers here)."""
    pack: Callable[[ExportKV, list[int], list[int]], Any]
    on_blocks: Callable[[BlocksReady], None]


@dataclass(slots=True)
class BlockExport:
    """One request's export: what its ExportKV asked, and how far it got."""
    spec: ExportKV
    packed: int  # prompt blocks packed so far (the receiver's own ``skip_blocks`` count as packed)

    def dest_ids(self, start: int, end: int) -> list[int]:
        """The receiver's blocks for prompt blocks [start, end)."""
        skip = self.spec.skip_blocks
        return self.spec.dest_block_ids[start - skip:end - skip]


class BlockExports:
    """The engine thread's exports (one per request), packed as steps complete their blocks."""

    def __init__(self, exporter: BlockExporter, kv: KVCacheManager, block_size: int,
                 aio: asyncio.AbstractEventLoop):
        self._exporter = exporter
        self._kv = kv
        self._block_size = block_size
        self._aio = aio
        self._exports: dict[str, BlockExport] = {}  # req_id -> its export

    def start(self, cmd: ExportKV) -> None:
        self._exports[cmd.request_id] = BlockExport(cmd, cmd.skip_blocks)

    def end(self, request_id: str) -> None:
        """Pack nothing more for ``request_id`` (idempotent)."""
        self._exports.pop(request_id, None)

    def pack(self, sched: SchedulerOutput) -> None:
        """Pack the prompt blocks of exported requests that are complete and not packed yet
        (called by the engine inside step(): before a step's forward, a newly admitted
        request's cached prefix, which then leaves while the step computes; after it, and
        before finished requests free their blocks, what the step completed)."""
        if not self._exports:
            return
        bs = self._block_size
        for req, _ in sched.scheduled:
            export = self._exports.get(req.request_id)
            if export is None:
                continue
            n_prompt = len(req.prompt_token_ids)
            upto = math.ceil(n_prompt / bs) if req.num_computed_tokens >= n_prompt else req.num_computed_tokens // bs
            done = export.packed
            if upto <= done:
                continue
            packed = self._exporter.pack(export.spec, self._kv.block_ids(req.request_id)[done:upto],
                                         export.dest_ids(done, upto))
            export.packed = upto
            self._aio.call_soon_threadsafe(self._exporter.on_blocks, BlocksReady(req.request_id, done, upto, packed))

"""The worker ranks of a tensor-parallel node: processes of its rank 0, and the node's
rank pipe to them.

Owns, on rank 0 (the node process): starting ranks 1..N-1 (multiprocessing spawn, one
process each, in the node's process group), one duplex pipe per worker (the rank pipe:
msgpack ``kvtransfer/rank_report.py`` messages, both ways), watching them (a worker that
exits is the node's death) and stopping them (``RankProcs``). On a worker: its main
(``worker_main``), its event loop thread and its end of the rank pipe (``RankLink``).
Also the node's KV compatibility key (``node_kv_key``), which every rank computes alike.
Must not know the role: the role's ``RankRole`` (prefill_node/ranks.py,
decode_node/ranks.py) runs on each worker, built there by the factory rank 0 hands in.

::

    rank 0 (the node process, node/runtime.py)         worker rank r (spawned, daemonic)
    TPLeader(n, dead=procs.dead)   rendezvous bound
    RankProcs(config, role, rendezvous)  ------------>  worker_main: SIGINT ignored, logs "tp<r>",
                                                          RankLink: event loop thread + pipe end
                                                          role = factory(config, r, link)
    EngineCore(config, tp=leader)  <--- joins ------>   run_worker(config, r, rendezvous, device,
                                                          role.kv_cache_factory(), role.on_runner_built,
                                                          role.controls())  (the steps: main thread)
    attach(loop, on_message, on_exit)   <-- pipe ----   RankReady, RankSent, RankBlocks, ClosedApplied
    send(rank, msg) / broadcast(msg)    --- pipe --->   role.on_message(msg) (its loop)

    a worker exits (its sentinel)  -> on_exit("rank r (pid p) was killed by SIGKILL"): the node fails
    rank 0 gone (the step channel closes, or the pipe reads EOF) -> the worker exits
    close(): after the engine's Stop, each worker gets JOIN_S to exit, then SIGKILL

One thread uses each end of a pipe: rank 0's event loop, a worker's loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import msgspec
import torch

from ..common.config import EngineConfig, NodeConfig
from ..common.kv_compat import KVCompat
from ..engine.models.config import ModelConfig
from ..engine.model_runner import KVCacheFactory, ModelRunner
from ..engine.parallel.group import TPFailure
from ..engine.parallel.launch import exit_words
from ..engine.parallel.worker import ControlHandler, TPRendezvous, run_worker
from ..kvtransfer import rank_report
from ..kvtransfer.rank_report import RankMessage

log = logging.getLogger(__name__)

JOIN_S = 10.0  # close(): how long a worker gets to exit after the engine's Stop before it is killed
EXIT_RANK0_GONE = 4  # a worker's exit status when rank 0 went away without stopping it


def node_kv_key(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype, tp: int) -> KVCompat:
    """The node's KV compatibility key (common/kv_compat.py), the same on every rank: the
    served model id, the KV dtype, the block size, the model's layers, KV heads (all
    ranks') and head dim or MLA's latent width, and the node's TP (never its EP: the KV
    layout is the attention's)."""
    return KVCompat(model=config.model_id, dtype=str(kv_dtype).removeprefix("torch."), block_size=config.block_size,
                    num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, tp=tp,
                    latent_dim=model.mla.latent_dim if model.mla is not None else 0)


class RankRole(Protocol):
    """The role's code on one worker rank, built in the worker process by its factory
    ``(config, rank, link) -> RankRole`` (a module-level class: spawn pickles it by name)."""

    def kv_cache_factory(self) -> KVCacheFactory | None: ...  # where this rank's KV cache lives

    def on_runner_built(self, runner: ModelRunner) -> None: ...  # main thread, once loaded: its KV sender/receiver

    def controls(self) -> Mapping[str, ControlHandler]: ...  # rank 0's Controls, between steps (main thread)

    def on_message(self, msg: RankMessage) -> None: ...  # rank 0's messages, on the link's loop

    async def stop(self) -> None: ...  # on the link's loop: close senders and receivers

    def release(self) -> None: ...  # any thread, last: what outlives the process unless removed (/dev/shm)


RoleFactory = Callable[[NodeConfig, int, "RankLink"], RankRole]


class RankLink:
    """A worker's end of the rank pipe, and the event loop (a daemon thread) its KV
    sender or receiver runs on. ``send`` from that loop only; ``call`` / ``run`` reach it
    from the worker's main thread."""

    def __init__(self, rank: int, conn: Connection):
        self.rank = rank
        self._conn = conn
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"tp{rank}-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Run ``coro`` on the loop (from another thread); its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def send(self, msg: RankMessage) -> None:
        """To rank 0 (on the loop). A gone rank 0 is noticed by the reader, not here."""
        try:
            self._conn.send_bytes(rank_report.encode(msg))
        except OSError:
            pass

    def listen(self, on_message: Callable[[RankMessage], None], on_lost: Callable[[], None]) -> None:
        """Hand rank 0's messages to ``on_message`` on the loop; ``on_lost()`` once the pipe
        closes (rank 0 is gone). Call on the loop."""
        fd = self._conn.fileno()

        def readable() -> None:
            try:
                while self._conn.poll():
                    on_message(rank_report.decode(self._conn.recv_bytes()))
            except (EOFError, OSError):
                self.loop.remove_reader(fd)
                on_lost()

        self.loop.add_reader(fd, readable)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self._conn.close()


def worker_main(factory: RoleFactory, config: NodeConfig, rank: int, rendezvous: TPRendezvous,
                conn: Connection, device: str | None) -> None:
    """A spawned worker rank's main: serve ``run_worker`` with the role's hooks until rank 0
    stops it (exit 0) or breaks (exit 3); exit 4 at once when rank 0 disappears."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle (it drains)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    link = RankLink(rank, conn)
    role = factory(config, rank, link)

    def lost() -> None:  # rank 0 is gone; the step channel tells the main thread too, maybe later
        log.error("tensor-parallel rank %d: rank 0 closed the rank pipe; exiting", rank)
        role.release()
        os._exit(EXIT_RANK0_GONE)

    link.call(link.listen, role.on_message, lost)
    code = 0
    try:
        run_worker(config.engine, rank, rendezvous, device=device, kv_cache_factory=role.kv_cache_factory(),
                   on_runner_built=role.on_runner_built, controls=role.controls())
    except TPFailure as e:  # rank 0 stopped or broke: one line, not a traceback
        log.error("%s", e)
        code = 3
    finally:
        try:
            link.run(role.stop()).result(timeout=10)
        except Exception as e:  # best effort: the process ends either way
            log.warning("tensor-parallel rank %d: stopping its KV transport failed: %r", rank, e)
        role.release()
        link.close()
    if code:
        raise SystemExit(code)


class RankProcs:
    """Rank 0's handle on the worker processes it started (ranks 1 .. size-1)."""

    def __init__(self, config: NodeConfig, factory: RoleFactory, rendezvous: TPRendezvous):
        ctx = mp.get_context("spawn")  # CUDA-safe, inherits no threads
        self.size = rendezvous.size
        self.procs: dict[int, BaseProcess] = {}  # rank -> its process
        self._conns: dict[int, Connection] = {}  # rank -> rank 0's end of its pipe
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        for rank in range(1, self.size):
            mine, theirs = ctx.Pipe(duplex=True)
            device = config.rank_devices[rank] if config.rank_devices else None
            proc = ctx.Process(target=worker_main, args=(factory, config, rank, rendezvous, theirs, device),
                               name=f"splitserve-tp{rank}", daemon=True)
            proc.start()
            theirs.close()  # only the worker holds its end: its exit reads as EOF here
            self.procs[rank], self._conns[rank] = proc, mine

    @property
    def pids(self) -> dict[int, int | None]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def dead(self) -> str | None:
        """What happened to the first worker that exited (for ``TPLeader(dead=...)``), or None."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                return f"rank {rank} (pid {proc.pid}) {exit_words(proc.exitcode)}"
        return None

    def attach(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[int, RankMessage], None],
               on_exit: Callable[[str], None]) -> None:
        """Watch the workers on ``loop``: each message as ``on_message(rank, msg)``, a worker's
        exit (unless ``close`` began) as ``on_exit(words)``."""
        self._loop = loop
        for rank, conn in self._conns.items():
            loop.add_reader(conn.fileno(), self._readable, rank, on_message)
            loop.add_reader(self.procs[rank].sentinel, self._exited, rank, on_exit)

    def _readable(self, rank: int, on_message: Callable[[int, RankMessage], None]) -> None:
        conn = self._conns[rank]
        try:
            while conn.poll():
                data = conn.recv_bytes()
                try:
                    msg = rank_report.decode(data)
                except msgspec.DecodeError as e:  # a bug, not a peer to distrust: say it, go on
                    log.error("tensor-parallel rank %d sent a bad message: %s", rank, e)
                    continue
                on_message(rank, msg)
        except (EOFError, OSError):  # it exited: its sentinel says how
            assert self._loop is not None
            self._loop.remove_reader(conn.fileno())

    def _exited(self, rank: int, on_exit: Callable[[str], None]) -> None:
        proc = self.procs[rank]
        assert self._loop is not None
        self._loop.remove_reader(proc.sentinel)
        proc.join(timeout=1)
        if not self._closing:
            on_exit(f"rank {rank} (pid {proc.pid}) {exit_words(proc.exitcode)}")

    def send(self, rank: int, msg: RankMessage) -> None:
        """To worker ``rank`` (rank 0's event loop). A dead worker is reported by its sentinel."""
        try:
            self._conns[rank].send_bytes(rank_report.encode(msg))
        except OSError:
            pass

    def broadcast(self, msg: RankMessage) -> None:
        data = rank_report.encode(msg)
        for conn in self._conns.values():
            try:
                conn.send_bytes(data)
            except OSError:
                pass

    def close(self, join_s: float = JOIN_S) -> None:
        """After the engine sent Stop (or failed): give the workers ``join_s`` to exit, kill
        the rest, close the pipes. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            for rank, conn in self._conns.items():
                for fd in (conn.fileno(), self.procs[rank].sentinel):
                    try:
                        self._loop.remove_reader(fd)
                    except (OSError, ValueError):
                        pass
        for proc in self.procs.values():
            proc.join(timeout=join_s)
            if proc.exitcode is None:
                log.warning("tensor-parallel worker %s (pid %s) did not stop; killing it", proc.name, proc.pid)
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns.values():
            conn.close()

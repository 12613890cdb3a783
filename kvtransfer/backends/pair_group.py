"""A two-rank torch.distributed process group that carries one connection's payloads.

Owns: ``PairGroup`` (the group, built from a ``TCPStore`` rendezvous under a
per-connection key prefix; gloo for a CPU device, NCCL for a CUDA one), the one
thread that makes every torch.distributed call of that group, and the staging of
host bytes through a CUDA device. Must not: know the protocol (``nccl.py`` frames
it), own the store server (the receiver does), or import the model.

Ranks are fixed: receiver 0, sender 1. The group is built with the
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructors, never
``init_process_group``: that makes one process-wide default group of a fixed world,
while a node holds one pair per peer, peers coming and going. ::

    open(rank, store host:port, prefix)   TCPStore client -> PrefixStore(prefix) -> group
                                          probe: one byte 1 -> 0 (NCCL builds its communicator
                                          in a first send/recv: here, while connecting)
    send(view) / recv(view)               pg.send / pg.recv of one uint8 tensor, then wait(timeout)
    close()                               fails every future the loop awaits, at once

torch.distributed calls block, so they all run on the pair's own daemon thread, in
submission order (payloads leave in the order their frames' headers did); the event
loop only awaits futures, which ``close`` fails at once. The thread creates, uses and
drops the group, and its waits are bounded too: the rendezvous and each op have a
timeout (a gloo timeout also closes the pair), and a gloo group whose peer's sockets
close (process died, or it dropped its group) fails the op in flight at once. gloo's
``abort()`` cannot interrupt a pending op, so after ``close`` the thread may sit in
one until the peer drops its side or the timeout passes; NCCL's ``abort()`` can, and
``close`` calls it. One unbounded wait remains: NCCL's communicator setup inside the
probe has no timeout and abort cannot reach it, so a peer that vanishes between the
store rendezvous and the probe leaves that thread there (holding nothing the loop or
other pairs need). With NCCL a failed op must not end the process:
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2 (abort the communicator only;
torch's own default, 3, tears the process down).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ..connection import ConnectionClosed
from ..errors import TransferError

if TYPE_CHECKING:
    from torch.distributed import Work

TAG = 0  # one stream of payloads per pair: ops match in order
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

Job = tuple[Callable[[], None], asyncio.Future[None]]  # what the thread runs, the future it settles


class _Group(Protocol):
    """What a pair calls on its ``ProcessGroupGloo`` / ``ProcessGroupNCCL``. torch's stubs
    declare ``send`` / ``recv`` on ``ProcessGroup`` only, though every backend binds them."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int, /) -> Work: ...
    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int, /) -> Work: ...
    def abort(self) -> None: ...


def group_kind(device: torch.device) -> str:
    """The process group a device's payloads travel on: ``"nccl"`` for CUDA, else ``"gloo"``."""
    return "nccl" if device.type == "cuda" else "gloo"


def payload_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` (this thread's current device) or ``"cuda:N"`` as a torch device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_available(device: torch.device) -> None:
    """Raise ``TransferError`` naming what this torch lacks to move payloads on ``device``."""
    import torch.distributed as dist

    if device.type not in ("cpu", "cuda"):
        raise TransferError(f"nccl backend: payloads move on cpu (gloo) or cuda (NCCL), not {device}")
    if not dist.is_available():
        raise TransferError("nccl backend unavailable: this torch has no torch.distributed; "
                            "use the tcp backend")
    if group_kind(device) == "gloo" and not dist.is_gloo_available():
        raise TransferError("nccl backend unavailable on cpu: this torch has no gloo; use tcp")
    if group_kind(device) == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise TransferError(f"nccl backend unavailable on {device}: this torch has no NCCL or no "
                            f"CUDA device; run the node on cpu (gloo) or use tcp")


def _host_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view`` (no copy); read-only views are only ever read from."""
    if view.readonly:  # torch warns on read-only buffers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


class PairGroup:
    """One connection's two-rank group and the thread that drives it. Create on the event loop."""

    def __init__(self, device: torch.device, name: str):
        self.device = device
        self.kind = group_kind(device)
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: stop
        self._pending: set[asyncio.Future[None]] = set()  # futures the loop may await
        self._closed = False
        # Touched by the thread only (close() reads _group to abort NCCL):
        self._group: _Group | None = None
        self._rank = -1
        self._staging: torch.Tensor | None = None  # CUDA only: [n] uint8, grows, reused
        threading.Thread(target=self._run, name=f"kv-pair {name}", daemon=True).start()

    # -- the loop side ---------------------------------------------------------------
    def open(self, rank: int, store_host: str, store_port: int, prefix: str, local_host: str,
             timeout_s: float) -> asyncio.Future[None]:
        """Join the pair as ``rank`` through the store at ``store_host:store_port``; the future
        resolves once the probe crossed. ``local_host``: the address this side's gloo
        listens on (the local end of the control connection, which reaches the peer)."""
        return self._submit(lambda: self._open(rank, store_host, store_port, prefix, local_host,
                                               timedelta(seconds=timeout_s)))

    def send(self, view: memoryview, timeout_s: float) -> asyncio.Future[None]:
        """Send ``view``'s bytes to the peer; the future resolves when the buffer is free again."""
        return self._submit(lambda: self._send(view, timedelta(seconds=timeout_s)))

    def recv(self, view: memoryview, timeout_s: float) -> asyncio.Future[None]:
        """Fill ``view`` with the peer's next payload (exactly ``len(view)`` bytes)."""
        return self._submit(lambda: self._recv(view, timedelta(seconds=timeout_s)))

    def close(self) -> None:
        """Fail every awaited future now; the thread ends after its current op (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        for fut in self._pending:
            if not fut.done():
                fut.set_exception(ConnectionClosed(f"pair {self.name} closed"))
        self._pending.clear()
        group = self._group
        if self.kind == "nccl" and group is not None:  # fails a NCCL op in flight
            threading.Thread(target=group.abort, name=f"kv-pair-abort {self.name}", daemon=True).start()

    def _submit(self, fn: Callable[[], None]) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self._closed:
            fut.set_exception(ConnectionClosed(f"pair {self.name} closed"))
            return fut
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self._jobs.put((fn, fut))
        return fut

    def _settle(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        """From the thread: resolve ``fut`` on the loop (unless close() already failed it)."""
        def settle():
            if not fut.done():
                fut.set_result(None) if error is None else fut.set_exception(error)
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody awaits anymore
            pass

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                fn, fut = job
                if self._closed:
                    continue
                try:
                    fn()
                except Exception as e:  # RuntimeError / DistBackendError from torch, TransferError
                    self._settle(fut, ConnectionClosed(f"pair {self.name}: {type(e).__name__}: {e}"))
                else:
                    self._settle(fut, None)
        finally:
            self._group = None  # the group is destroyed on this thread, never on the loop

    def _open(self, rank: int, store_host: str, store_port: int, prefix: str, local_host: str,
              timeout: timedelta) -> None:
        import torch.distributed as dist

        client = dist.TCPStore(store_host, store_port, None, False, timeout)
        store = dist.PrefixStore(prefix, client)
        options: Any  # gloo's _Options or NCCL's Options
        try:
            if self.kind == "gloo":
                # torch's stubs name only the public Options, without a device list or thread count
                options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                options._threads = 1  # its threads only run collectives; we use send/recv
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host,
                                                                        lazy_init=False)]
            else:
                for key, value in NCCL_ENV_DEFAULTS.items():
                    os.environ.setdefault(key, value)
                torch.cuda.set_device(self.device)  # this thread's ops and NCCL's guesses use it
                options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.group_name = prefix  # names the pair in torch's logs
            group_cls = dist.ProcessGroupGloo if self.kind == "gloo" else dist.ProcessGroupNCCL
            group = self._group = cast(_Group, group_cls(store, rank, 2, options))
            self._rank = rank
            probe = torch.ones(1, dtype=torch.uint8, device=self.device)
            op = group.send if rank == 1 else group.recv
            op([probe], 1 - rank, TAG).wait(timeout)
        finally:
            if rank == 0:  # the rendezvous is over (or failed): keep the receiver's store small
                for key in client.list_keys():
                    if key.startswith(prefix + "/"):
                        client.delete_key(key)

    def _send(self, view: memoryview, timeout: timedelta) -> None:
        tensor = _host_tensor(view)
        if self.kind == "nccl":
            tensor = self._device_buffer(len(view)).copy_(tensor)
        self._joined().send([tensor], 1 - self._rank, TAG).wait(timeout)

    def _recv(self, view: memoryview, timeout: timedelta) -> None:
        host = _host_tensor(view)
        if self.kind == "gloo":
            self._joined().recv([host], 1 - self._rank, TAG).wait(timeout)
            return
        staged = self._device_buffer(len(view))
        self._joined().recv([staged], 1 - self._rank, TAG).wait(timeout)  # blocks until it landed
        host.copy_(staged)

    def _joined(self) -> _Group:
        """The group an op runs on; raises (failing that op's future) when ``open`` did not make it."""
        if self._group is None:
            raise TransferError(f"pair {self.name} has no process group (its open failed)")
        return self._group

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a reused CUDA buffer; safe since every op waits before the next."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes]

"""Backend selection: the only place that maps a backend name to its classes.

Owns: ``make_sender`` / ``make_receiver`` for each ``KVBackend`` (common/config.py)
and the resolution of sender options from the environment (fault injection). Must
not: import a backend before it is asked for (ucxx is heavy and optional).

``device`` is the node's compute device. On a GPU the sender hashes blocks with
wsum32_v1 on the device (``checksum.py``); the nccl backend moves payloads on NCCL
(gloo for cpu); tcp and ucx move host bytes (a GPU pack is staged once into pinned
memory); ipc (CUDA only) copies device to device into a same-host receiver's pool.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..common.config import KVBackend
from .base import KVReceiver, KVSender, OnBlock
from .block_store import KVBlockStore, default_checksum_algo
from .layout import KVLayout, KVShard
from .receiver_core import FramedReceiver
from .sender_core import SenderOptions

FAULT_ENV = "SPLITSERVE_FAULT"  # "corrupt_block" (every block) or "corrupt_block:N" (every Nth)


def sender_options(env: Mapping[str, str] = os.environ, **overrides) -> SenderOptions:
    """``SenderOptions`` from ``overrides`` plus ``SPLITSERVE_FAULT`` fault injection."""
    fault = env.get(FAULT_ENV, "")
    if fault and "corrupt_every" not in overrides:
        name, _, every = fault.partition(":")
        if name != "corrupt_block" or (every and not every.isdigit()):
            raise ValueError(f"{FAULT_ENV}: expected 'corrupt_block' or 'corrupt_block:N', got {fault!r}")
        overrides["corrupt_every"] = int(every or 1)
    return SenderOptions(**overrides)


def _check_backend(backend: str) -> None:
    if backend not in tuple(KVBackend):
        raise ValueError(f"backend: must be one of {', '.join(KVBackend)}, got {backend!r}")


def make_sender(backend: str, layout: KVLayout, options: SenderOptions | None = None,
                device: str = "cpu", shard: KVShard | None = None) -> KVSender:
    """A sender speaking ``backend``; ``options`` default to ``sender_options()`` (env-aware).
    ``shard``: the sending rank (its node's compatibility key and rank; default: the one
    rank of a TP=1 node with ``layout`` and no model name). ``"ucx"`` / ``"nccl"`` raise
    ``TransferError`` naming the reason when ucxx / torch.distributed (gloo, or NCCL for a
    cuda ``device``) cannot be used; ``"ipc"`` raises ``TransferError`` without CUDA."""
    _check_backend(backend)
    options = options or sender_options()
    if options.checksum is None:
        algo = default_checksum_algo("cuda" if backend == "ipc" else device)
        options = dataclasses.replace(options, checksum=algo)
    if backend == "ipc":
        from .backends.ipc import IpcSender
        return IpcSender(layout, options, device="cuda" if torch.device(device).type == "cpu" else device,
                         shard=shard)
    if backend == "tcp":
        from .backends.tcp import TcpSender
        return TcpSender(layout, options, shard)
    if backend == "shm":
        from .backends.shm import ShmSender
        return ShmSender(layout, options, shard)
    if backend == "nccl":
        from .backends.nccl import NcclSender
        return NcclSender(layout, options, shard, device=device)
    from .backends.ucx import UcxSender
    return UcxSender(layout, options, shard)


def make_receiver(backend: str, layout: KVLayout, store: KVBlockStore, host: str,
                  on_block: OnBlock, port: int = 0, advertise_host: str | None = None,
                  device: str = "cpu", shard: KVShard | None = None) -> KVReceiver:
    """A receiver for ``backend`` landing blocks in ``store``, bound to ``host:port`` once
    started (ucx's listener and nccl's store bind every interface). ``"shm"`` needs a store
    allocated in /dev/shm, ``"ipc"`` one on a CUDA device. ``shard``: the receiving rank
    (default: the one rank of a TP=1 node with ``layout`` and no model name)."""
    _check_backend(backend)
    if backend == "nccl":
        from .backends.nccl import NcclReceiver
        return NcclReceiver(layout, store, on_block, host=host, port=port,
                            advertise_host=advertise_host, device=device, shard=shard)
    cls: type[FramedReceiver[Any]]
    if backend == "tcp":
        from .backends.tcp import TcpReceiver as cls
    elif backend == "shm":
        from .backends.shm import ShmReceiver as cls
    elif backend == "ipc":
        from .backends.ipc import IpcReceiver as cls
    else:
        from .backends.ucx import UcxReceiver as cls
    return cls(layout, store, on_block, host=host, port=port, advertise_host=advertise_host, shard=shard)

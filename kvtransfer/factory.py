"""Backend construction: a backend's name to its sender or receiver.

Owns: ``make_sender`` / ``make_receiver`` for each backend of common/kv_backends.py (the
backend registry: names, classes, abilities) and the resolution of sender options from the
environment (fault injection). Must not: import a backend before it is asked for (ucxx is
heavy and optional): a spec names its classes, imported here when first built.

``device`` is the node's compute device. On a GPU the sender hashes blocks with
wsum32_v1 on the device (``checksum.py``); the nccl backend moves payloads on NCCL
(gloo for cpu); tcp and ucx move host bytes (a GPU pack is staged once into pinned
memory); a backend that needs CUDA (ipc) copies device to device into a same-host
receiver's pool, and its sender gets a CUDA device even from a CPU caller.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from ..common.config import Fault
from ..common.kv_backends import backend_spec
from ..common.plugins import resolve
from .base import KVReceiver, KVSender, OnBlock
from .block_store import KVBlockStore, default_checksum_algo
from .layout import KVLayout, KVShard
from .sender_core import SenderOptions

FAULT_ENV = "SPLITSERVE_FAULT"  # Fault.CORRUPT_BLOCK (every block) or "corrupt_block:N" (every Nth)


def sender_options(env: Mapping[str, str] = os.environ, **overrides) -> SenderOptions:
    """``SenderOptions`` from ``overrides`` plus ``SPLITSERVE_FAULT`` fault injection."""
    fault = env.get(FAULT_ENV, "")
    if fault and "corrupt_every" not in overrides:
        name, _, every = fault.partition(":")
        if name != Fault.CORRUPT_BLOCK or (every and not every.isdigit()):
            raise ValueError(f"{FAULT_ENV}: expected '{Fault.CORRUPT_BLOCK}' or '{Fault.CORRUPT_BLOCK}:N', "
                             f"got {fault!r}")
        overrides["corrupt_every"] = int(every or 1)
    return SenderOptions(**overrides)


def make_sender(backend: str, layout: KVLayout, options: SenderOptions | None = None,
                device: str = "cpu", shard: KVShard | None = None) -> KVSender:
    """A sender speaking ``backend``; ``options`` default to ``sender_options()`` (env-aware).
    ``shard``: the sending rank (its node's compatibility key and rank; default: the one
    rank of a TP=1 node with ``layout`` and no model name). ``"ucx"`` / ``"nccl"`` raise
    ``TransferError`` naming the reason when ucxx / torch.distributed (gloo, or NCCL for a
    cuda ``device``) cannot be used; ``"ipc"`` raises ``TransferError`` without CUDA."""
    spec = backend_spec(backend, "backend")
    options = options or sender_options()
    if spec.needs_cuda and torch.device(device).type == "cpu":
        device = "cuda"
    if options.checksum is None:
        options = dataclasses.replace(options, checksum=default_checksum_algo(device))
    sender = resolve(spec.sender)(layout, options, shard=shard, device=device)
    if not isinstance(sender, KVSender):
        raise TypeError(f"backend {backend}: its sender {spec.sender} is no KVSender (kvtransfer/base.py)")
    return sender


def make_receiver(backend: str, layout: KVLayout, store: KVBlockStore, host: str,
                  on_block: OnBlock, port: int = 0, advertise_host: str | None = None,
                  device: str = "cpu", shard: KVShard | None = None) -> KVReceiver:
    """A receiver for ``backend`` landing blocks in ``store``, bound to ``host:port`` once
    started (ucx's listener and nccl's store bind every interface). ``"shm"`` needs a store
    allocated in /dev/shm, ``"ipc"`` one on a CUDA device. ``shard``: the receiving rank
    (default: the one rank of a TP=1 node with ``layout`` and no model name)."""
    spec = backend_spec(backend, "backend")
    receiver = resolve(spec.receiver)(layout, store, on_block, host=host, port=port, advertise_host=advertise_host,
                                      shard=shard, device=device)
    if not isinstance(receiver, KVReceiver):
        raise TypeError(f"backend {backend}: its receiver {spec.receiver} is no KVReceiver (kvtransfer/base.py)")
    return receiver

"""A KV connection: the one thing a backend must provide to carry the protocol.

Owns: the ``Connection`` interface, ``ConnectionClosed``, address parsing and the
buffer helper that merges adjacent block views. Must not: know the protocol's
meaning (``sender_core`` / ``receiver_core`` do) or import torch.

A connection carries ``wire`` messages, each optionally followed by a payload:
``send(msg, payload)`` is atomic with respect to other ``send`` calls on the
same connection (frames never interleave inside), ``flush()`` waits until the
payload buffers handed to ``send`` are free again, ``recv()`` returns the next
message, and ``recv_payload(buf)`` fills ``buf`` with the payload that follows
it (the receiver learns its length from the message). Any transport failure,
including the peer closing, raises ``ConnectionClosed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np

from .errors import TransferError
from .wire import CHECKSUM_XXH3, Message

MAX_HEADER_BYTES = 1 << 20  # a frame header lists at most a few thousand block ids


class ConnectionClosed(ConnectionError):
    """The connection is unusable: the peer closed it, the transport failed, or we closed it."""


class Connection(ABC):
    peer: str  # "host:port" of the other end, for messages
    checksum_algo: str = CHECKSUM_XXH3  # the block checksum its Hello named (receiver side)
    sender_heads: tuple[int, int] | None = None  # global KV heads its Hello's shard holds (receiver side)

    @abstractmethod
    async def send(self, msg: Message, payload: Sequence[memoryview] = ()) -> None:
        """Send ``msg`` then the payload buffers' bytes, as one unit. The buffers must stay
        unchanged until ``flush`` returns (a backend may still be reading them)."""

    async def flush(self) -> None:  # noqa: B027 (optional hook; a stream copies out in send)
        """Return once every payload buffer passed to ``send`` so far is free to reuse."""

    @abstractmethod
    async def recv(self) -> Message:
        """The next message (not its payload)."""

    @abstractmethod
    async def recv_payload(self, buf: memoryview) -> None:
        """Fill ``buf`` (exactly ``len(buf)`` bytes) with the payload after the last message."""

    @abstractmethod
    def close(self) -> None:
        """Abort the connection now (idempotent); pending calls raise ``ConnectionClosed``."""


# A backend's connection type (tcp: TcpConnection, ucx: UcxConnection, ...): what its senders'
# peers hold and its receiver serves, with the backend's own attributes.
ConnT = TypeVar("ConnT", bound=Connection)


def parse_address(addr: str, scheme: str) -> tuple[str, int]:
    """``"tcp://host:port"`` -> ``(host, port)``; raises ``TransferError`` on another scheme."""
    parts = urlsplit(addr)
    if parts.scheme != scheme:
        raise TransferError(f"address {addr!r} is not a {scheme}:// address; "
                            f"use the sender of backend {parts.scheme!r} for it")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise TransferError(f"address {addr!r} must look like {scheme}://HOST:PORT")
    return host, port


def format_address(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def coalesce(views: Sequence[memoryview]) -> memoryview | None:
    """One view spanning ``views`` when they are consecutive slices of one buffer, else None.

    ``KVBlockStore.split(pack(...))`` yields such slices, so a frame's blocks usually
    go out as one message without a copy.
    """
    if len(views) == 1:
        return views[0]
    owner = views[0].obj
    if any(v.obj is not owner for v in views):
        return None
    start = _address(views[0])
    pos = start
    for v in views:
        if _address(v) != pos:
            return None
        pos += len(v)
    parent = memoryview(owner).cast("B")
    offset = start - _address(parent)
    return parent[offset:offset + (pos - start)]

"""The transport interface the prefill and decode nodes program against.

Owns: ``KVSender`` / ``KVReceiver`` (abstract), the ``on_block`` callback type,
and the re-export of the errors. Must not: know any backend (``factory.py``
picks one) or import the model.

Contracts every backend honours (``tests/test_kvtransfer_conformance.py`` checks them):

- Each connection starts with a handshake that compares both ends' ``KVShard``: the
  node's compatibility key (model, dtype, block size, layers, KV heads, head dim; TP may
  differ when both TPs split the heads) and the checksum algorithm; a mismatch
  is refused on both sides: the receiver logs it and closes, the sender raises
  ``LayoutMismatch`` (a ``TransferError``) naming each differing field.
- A sender is one rank; ``send_blocks(..., heads)`` sends a slice of its heads (the ones a
  decode rank needs, ``tp_plan.py``), never heads the receiver does not hold (raised
  before a byte moves). The checksum covers exactly the slice the receiver lands.
- One persistent connection per (sender, receiver address), reused by every
  transfer; concurrent ``send_blocks`` calls to one address interleave frame by frame.
- Every block carries its checksum. The receiver calls ``on_block`` exactly once
  per block of a received frame, on its asyncio loop: ``ok=True`` only after the
  bytes are in the destination block and their checksum matched. A rejected
  block (bad checksum, bad id, layout) is reported ``ok=False`` with a reason;
  when the bytes already sat in the block (shm), the decode node frees it anyway.
  Blocks of a frame cut short by a lost connection are reported ``ok=False`` too.
  A block sent in slices (several prefill ranks hold the receiver's heads) is reported
  ``ok=True`` once, when its last slice landed; any bad slice reports it ``ok=False``.
- ``send_blocks`` returns once the receiver acknowledged every frame (so
  ``on_block`` already ran for every block); otherwise it raises ``TransferError``
  (refused, unreachable, connection lost, timed out, or blocks rejected) and
  never hangs past its timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from ..common.kv_heads import HeadRange
from .errors import TransferError
from .layout import KVLayout, LayoutMismatch

__all__ = ["KVReceiver", "KVSender", "LayoutMismatch", "OnBlock", "TransferError"]

# on_block(transfer_id, dest_block_id, ok, reason): reason is None when ok.
OnBlock = Callable[[str, int, bool, "str | None"], None]


class KVSender(ABC):
    """The prefill side: pushes packed blocks to receivers by address."""

    layout: KVLayout

    @abstractmethod
    async def connect(self, addr: str) -> None:
        """Open (or reuse) the connection to ``addr`` and run the handshake.
        Optional: ``send_blocks`` connects on first use. Raises ``TransferError``."""

    @abstractmethod
    async def send_blocks(self, addr: str, transfer_id: str,
                          blocks: Sequence[tuple[int, object]], heads: HeadRange | None = None) -> None:
        """Send ``[(dest_block_id, packed_block), ...]`` for ``transfer_id``: each block
        ``block_nbytes`` bytes in any host buffer, or a ``PackedBlock`` row of a device pack
        (``KVBlockStore.split``); return when all were acknowledged. ``heads``: the global
        KV heads each item holds (``KVBlockStore.pack(..., heads=local)`` of the sender's
        cache; default: all the sender holds).
        Raises ``TransferError`` on any failure; the buffers may be reused after return."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection (idempotent). Pending sends fail with ``TransferError``."""


class KVReceiver(ABC):
    """The decode side: accepts connections and lands blocks into a ``KVBlockStore``.
    Its owner sets, before ``start``: ``accepts`` (transfer_id -> whether its blocks may
    still be written; None: all) and ``cluster_token`` (senders must present it)."""

    layout: KVLayout
    accepts: Callable[[str], bool] | None
    cluster_token: str | None

    @property
    @abstractmethod
    def address(self) -> str:
        """The address senders dial, e.g. ``tcp://10.0.0.5:41000``; valid after ``start``."""

    @abstractmethod
    async def start(self) -> None:
        """Bind and start accepting. ``on_block`` will run on this call's event loop."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop accepting and drop every connection (idempotent). Senders with frames
        in flight get ``TransferError``; blocks of a frame cut short get ``on_block(ok=False)``."""

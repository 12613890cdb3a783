"""The layout of KV cache blocks, and the byte order of one block on the wire.

Owns: ``KVLayout`` (the shape of one rank's cache and of a block of it on the wire),
its size arithmetic, and ``KVShard`` (a rank: its node's ``KVCompat`` key and its rank
number, which the handshake compares). Must not: import torch or touch tensors
(``block_store`` maps a layout onto a cache tensor).

A node's cache is one tensor::

    kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                            ^K=0/V=1

so block ``b`` (``kv_caches[:, :, b]``) is strided: ``num_layers * 2`` runs of
``block_size * num_kv_heads * head_dim`` elements, ``num_blocks`` runs apart.
On the wire (and in ``KVBlockStore.pack``) a block is those runs packed back to
back, C order over ``[num_layers, 2, block_size, num_kv_heads, head_dim]``, each
element in the machine's native byte order (little-endian on every supported
host; the handshake compares layouts, not endianness)::

    one packed block, block_nbytes = num_layers * 2 * run_nbytes
    +-----------+-----------+-----------+-----------+-----+-------------+-------------+
    | L0 K run  | L0 V run  | L1 K run  | L1 V run  | ... | L(n-1) K run| L(n-1) V run|
    +-----------+-----------+-----------+-----------+-----+-------------+-------------+
    one run, run_nbytes = block_size * num_kv_heads * head_dim * itemsize:
    +------------------------------+------------------------------+-----+
    | token 0: head 0 .. heads-1   | token 1: head 0 .. heads-1   | ... |   each head: head_dim elements
    +------------------------------+------------------------------+-----+

A frame of several blocks is those packed blocks back to back, in the order of
the frame's destination block ids. The block checksum (``block_store.checksum``)
is taken over exactly these ``block_nbytes`` bytes.

With tensor parallelism a rank's cache holds only its KV heads (``KVShard``: the node's
``KVCompat`` key and the rank; ``common/kv_heads.py`` says which heads), and a frame may
carry a *slice* of them: heads ``[a, b)`` of each token, packed the same way with
``num_kv_heads = b - a`` (``KVLayout.with_heads``), so a slice is a packed block of a
narrower layout and everything above (checksums, sizes) applies to it unchanged.
"""

from __future__ import annotations

import msgspec

from ..common.kv_compat import KVCompat
from ..common.kv_heads import HeadRange, rank_heads, tp_problem
from .errors import TransferError

# dtype name -> bytes per element; the names are torch's (torch.float32 -> "float32").
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

_FIELDS = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


class LayoutMismatch(TransferError):
    """Two ends of a transfer disagree on the block layout; the message names each differing field."""


class KVLayout(msgspec.Struct, frozen=True, tag="kv_layout", omit_defaults=True):
    """The shape and dtype of one KV block. Sent in every handshake; both ends must be equal."""

    dtype: str  # torch dtype name: float32, float16, bfloat16
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        # Runs on construction and on decode (a violation is a msgspec.ValidationError there).
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype: must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        for name in _FIELDS[1:]:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of_cache(cls, shape: tuple[int, ...], dtype) -> "KVLayout":
        """The layout of a cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` of
        ``dtype`` (a torch dtype or its name)."""
        num_layers, two, _, block_size, heads, head_dim = shape
        assert two == 2, f"kv cache dim 1 must be 2 (K, V), got shape {tuple(shape)}"
        return cls(dtype=str(dtype).removeprefix("torch."), block_size=block_size, num_layers=num_layers,
                   num_kv_heads=heads, head_dim=head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one packed block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def run_nbytes(self) -> int:
        """Bytes of one contiguous (layer, K|V) run of a block inside the cache."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one packed block (see the module diagram)."""
        return self.num_layers * 2 * self.run_nbytes

    def with_heads(self, num_kv_heads: int) -> KVLayout:
        """This layout with ``num_kv_heads`` heads: the layout of a slice of them."""
        return KVLayout(dtype=self.dtype, block_size=self.block_size, num_layers=self.num_layers,
                        num_kv_heads=num_kv_heads, head_dim=self.head_dim)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a whole cache of ``num_blocks`` blocks."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def differences(self, other: KVLayout) -> list[str]:
        """``"field: mine != theirs"`` for each field that differs (empty when equal)."""
        return [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                for name in _FIELDS if getattr(self, name) != getattr(other, name)]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ``LayoutMismatch`` naming every differing field (this side first) unless equal."""
        diffs = self.differences(other)
        if diffs:
            raise LayoutMismatch("KV layout mismatch (this side != peer): " + "; ".join(diffs))


class KVShard(msgspec.Struct, frozen=True, tag="kv_shard", omit_defaults=True):
    """One rank's part of a node's KV cache: the node's compatibility key and the rank.
    Sent in every handshake (both ways); a rank's cache has layout ``layout``."""

    compat: KVCompat
    rank: int = 0

    @classmethod
    def of_layout(cls, layout: KVLayout, model: str = "") -> KVShard:
        """The one rank of a TP=1 node whose cache has ``layout``."""
        return cls(KVCompat(model=model, dtype=layout.dtype, block_size=layout.block_size,
                            num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                            head_dim=layout.head_dim))

    def problem(self) -> str | None:
        """Why this shard is not a rank of a possible node (None: it is)."""
        why = tp_problem(self.compat.tp, self.compat.num_kv_heads)
        if why is None and not 0 <= self.rank < self.compat.tp:
            why = f"rank {self.rank} of a node with tensor_parallel_size {self.compat.tp}"
        return why

    @property
    def heads(self) -> HeadRange:
        """The global KV heads this rank holds."""
        return rank_heads(self.rank, self.compat.tp, self.compat.num_kv_heads)

    @property
    def layout(self) -> KVLayout:
        """The layout of this rank's cache (its heads only)."""
        c = self.compat
        return KVLayout(dtype=c.dtype, block_size=c.block_size, num_layers=c.num_layers,
                        num_kv_heads=self.heads.size, head_dim=c.head_dim)

    def describe(self) -> str:
        h = self.heads
        return f"rank {self.rank}/{self.compat.tp} (KV heads [{h.start}, {h.stop}) of {self.compat.num_kv_heads})"

"""What two nodes must share to exchange KV: the compatibility key.

Owns ``KVCompat``: a node's model, KV dtype, block size and head layout (layers, KV
heads, head dim, or MLA's latent width) and its tensor parallelism, and the one judgement of whether a prefill
node's KV can land in a decode node's cache (``exchange_problem``). A node puts its key
in its node registry record (``common/node_registry.py NodeInfo.kv``) and, with its rank,
in every KV handshake (``kvtransfer/wire.py``); the router pairs only nodes whose keys agree
(``router/routing/kv_pairing.py``), and a receiver refuses a sender whose key does not, before a
byte moves. Must not: import torch or know how a transfer is cut (``kvtransfer/tp_plan.py``).

Every field but ``tp`` must be equal. Different TP degrees are compatible: a transfer
plan exists whenever each node's TP splits the model's KV heads (``common/kv_heads.py``),
which a node checks at start-up, and the plan moves each decode rank exactly its heads.
"""

from __future__ import annotations

import msgspec

from .kv_heads import tp_problem

# The fields that must be equal, in the order a mismatch names them.
EQUAL_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "latent_dim")


class KVCompat(msgspec.Struct, frozen=True, tag="kv_compat", omit_defaults=True, kw_only=True):
    """One node's KV compatibility key (the same on all its ranks)."""

    model: str  # the served model id
    dtype: str  # KV cache dtype, torch's name: float32, float16, bfloat16, float8_e4m3fn
    block_size: int  # tokens per KV block
    num_layers: int
    num_kv_heads: int  # the model's KV heads, all ranks together (not one rank's)
    head_dim: int
    tp: int = 1  # tensor-parallel ranks of the node
    # Multi-head Latent Attention: values of the one latent per token and layer (its halves are the
    # cache's K and V of one head of head_dim = latent_dim / 2); 0: K and V heads
    latent_dim: int = 0

    def differences(self, other: KVCompat) -> list[str]:
        """``"field: mine != theirs"`` for each field that must be equal and is not."""
        return [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                for name in EQUAL_FIELDS if getattr(self, name) != getattr(other, name)]

    def tp_problem(self) -> str | None:
        """Why this node's TP cannot split its KV heads (None: it can)."""
        return tp_problem(self.tp, self.num_kv_heads)

    def exchange_problem(self, other: KVCompat) -> str | None:
        """Why KV cannot move between this node and ``other`` (either direction), naming
        each mismatch with this side first; None when a transfer plan exists."""
        problems = self.differences(other)
        for side, key in (("this side", self), ("peer", other)):
            why = key.tp_problem()
            if why is not None:
                problems.append(f"tp of {side}: {why}")
        return "; ".join(problems) or None


def can_exchange(a: KVCompat | None, b: KVCompat | None) -> bool:
    """Whether KV can move between nodes with keys ``a`` and ``b``. A node that publishes no
    key (an older record, a test double) is not ruled out here (its handshake still checks);
    a node whose own TP cannot split its heads is."""
    if a is None or b is None:
        known = a or b
        return known is None or known.tp_problem() is None
    return a.exchange_problem(b) is None

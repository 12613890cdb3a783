"""A prompt's identity: its token ids, the keys its block hashes are made with, and those
hashes, as one frozen object in a process (``PromptRef``) and one sub-struct on the wire
(``WirePrompt``).

Contract:

- ``PromptKeys`` is the whole hash identity (common/hashing.py: the extra keys of every
  block hash). Its fields map generically, in declaration order and labelled, to the keys
  hashed: ``model`` first, then each other field that is set as (its name, its value), then
  ``extra``'s (label, value) pairs in order. Unsalted: ``(model,)``; salted:
  ``(model, "cache_salt", salt)``: BLOCK_HASH_VERSION 3's values, unchanged. A new key is
  one field here (default None: prompts without it hash as before), or a pair in ``extra``.
- A ``PromptRef`` is built once per request in each role, in one place: the router's
  ``Prompt.ref`` (router/prompt.py, its keys from ``prompt_keys``), a node's
  ``read_prompt`` (node/prompt_hashes.py: ``from_wire`` with the node's own model id as the
  model key), the engine's ``EngineCore.prompt_ref`` (the offline LLM, tests). Everything
  after takes its hashes, keys and salt identity from it: engine commands and methods, the
  engine's ``Request``, the wire.
- Its block hashes are computed or adopted once: given at construction (the router's, or the
  carried ones that checked out, ``adopted``), else on the first ``block_hashes()`` call
  (on a node, the engine thread's), then kept. A ``prefix`` shares what is known.
- Nothing in it is mutated: not ``token_ids`` (the caller's list, not copied) nor the
  read-only hash array.

Must not import torch or anything above common/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np

from .errors import InvalidRequest
from .hashing import BLOCK_HASH_VERSION, hash_blocks, hash_blocks_array, salt_id, token_array, token_bytes

# A request's cache salt: its blocks are hashed with it, so requests with different salts
# share no prefix block. Non-empty; None: unsalted.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1)]
ExtraKey = tuple[str, str | int]  # (label, value)


class PromptKeys(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, kw_only=True):
    """The keys every block hash of a prompt is made with (``hash_keys()``: see the module's
    contract for the mapping). Hashable; built once per request."""
    model: str  # the served model id (a node hashes with its own: node/prompt_hashes.py)
    cache_salt: CacheSalt | None = None  # the effective salt (router/api_keys.py); None: unsalted
    extra: tuple[ExtraKey, ...] = ()  # more labelled keys (an adapter's name, ...), hashed in order

    def __post_init__(self) -> None:
        labels = [label for label, _ in self.extra]
        named = set(self.__struct_fields__)
        if len(set(labels)) != len(labels) or any(not label or label in named for label in labels):
            raise ValueError(f"extra: labels must be non-empty, distinct and none of {sorted(named)}, "
                             f"got {labels}")

    def hash_keys(self) -> tuple[str | int, ...]:
        """The extra keys of every block hash (common/hashing.py ``hash_blocks``)."""
        keys: list[str | int] = [self.model]
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name not in ("model", "extra") and value is not None:
                keys += (name, value)
        for label, value in self.extra:
            keys += (label, value)
        return tuple(keys)


class PromptHashes(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, kw_only=True):
    """A prompt's chained block hashes as the sender computed them, carried router -> decode
    node -> prefill node (and puller -> holder) so that the prompt is hashed once."""
    version: int
    block_size: int
    hashes: bytes  # u64 little-endian, one per full block of the prompt

    @classmethod
    def of(cls, hashes: np.ndarray, block_size: int) -> PromptHashes:
        """From ``hash_blocks_array``'s result (a u64 array)."""
        return cls(version=BLOCK_HASH_VERSION, block_size=block_size,
                   hashes=hashes.astype("<u8", copy=False).tobytes())

    def adopt(self, token_ids: Sequence[int], block_size: int, keys: PromptKeys) -> np.ndarray | None:
        """The hashes (a read-only u64 array) when they are ``token_ids``'s for this node's
        hash version and ``block_size`` under ``keys``: their count fits and the first and last
        blocks re-hash to them (a wrong or shifted token list, or hashes made with another
        model, salt or key, fails that); None when the node must hash the prompt itself.
        Re-hashes two blocks at most."""
        n = len(token_ids) // block_size
        if self.version != BLOCK_HASH_VERSION or self.block_size != block_size or len(self.hashes) != 8 * n:
            return None
        hashes = np.frombuffer(self.hashes, dtype="<u8")
        if n == 0:
            return hashes
        extra = keys.hash_keys()
        if int(hashes[0]) != hash_blocks(token_ids[:block_size], block_size, extra)[0]:
            return None
        if n > 1 and int(hashes[-1]) != hash_blocks(token_ids[(n - 1) * block_size:n * block_size], block_size,
                                                    extra, parent=int(hashes[-2]))[0]:
            return None
        return hashes


class WirePrompt(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, kw_only=True):
    """A prompt on the wire (GenerateRequest, PrefillRequest, PullRequest). Its token ids
    travel as bytes, u32 little-endian (``token_bytes``): a 100k-token prompt is a 400 KB copy
    to encode, not 100k msgpack ints."""
    token_ids: bytes
    keys: PromptKeys | None = None  # the sender's; None: the receiving node's model alone
    hashes: PromptHashes | None = None  # the sender's block hashes, for the receiver to adopt

    @classmethod
    def of(cls, token_ids: Sequence[int], keys: PromptKeys | None = None) -> WirePrompt:
        """``token_ids`` with ``keys`` and no hashes (a client that computes none)."""
        return cls(token_ids=token_bytes(token_ids), keys=keys)


def prompt_ids(token_ids: bytes) -> list[int]:
    """A prompt's ``token_ids`` bytes as ints; InvalidRequest("token_ids") when they are not
    whole u32 values."""
    if len(token_ids) % 4:
        raise InvalidRequest("token_ids", f"{len(token_ids)} bytes is not a whole number of u32 token ids")
    return token_array(token_ids).tolist()


@dataclass(frozen=True, slots=True, eq=False)
class PromptRef:
    """One request's prompt in a process: see the module's contract."""
    token_ids: list[int]  # the caller's list, never mutated
    keys: PromptKeys
    block_size: int
    # [len(token_ids) // block_size] u64, read-only: given, or filled once by block_hashes()
    hashes: np.ndarray | None = None
    adopted: bool = False  # the hashes came with the request and checked out (from_wire)
    hash_keys: tuple[str | int, ...] = field(init=False)  # keys.hash_keys(), once
    salt: bytes = field(init=False)  # their salt identity (common/hashing.py salt_id): cached blocks keep it

    def __post_init__(self) -> None:
        keys = self.keys.hash_keys()
        object.__setattr__(self, "hash_keys", keys)
        object.__setattr__(self, "salt", salt_id(keys))
        if self.hashes is not None:
            assert len(self.hashes) == len(self.token_ids) // self.block_size, (len(self.hashes), len(self))
            self._keep(self.hashes)

    @classmethod
    def hashed(cls, token_ids: list[int], keys: PromptKeys, block_size: int,
               array: np.ndarray | None = None) -> PromptRef:
        """With its hashes computed now, from ``array`` when given (the same ids as a u32
        array: hashed without reading the list)."""
        ref = cls(token_ids, keys, block_size)
        ref._keep(hash_blocks_array(token_ids if array is None else array, block_size, ref.hash_keys))
        return ref

    @classmethod
    def from_wire(cls, wire: WirePrompt, model: str, block_size: int) -> PromptRef:
        """A node's ref of ``wire``: ``model`` (the node's) is its model key; the carried
        hashes are adopted when the sender named that model and they check out
        (``PromptHashes.adopt``). InvalidRequest("token_ids") for bytes that are not u32 ids."""
        ids = prompt_ids(wire.token_ids)
        sent = wire.keys or PromptKeys(model=model)
        keys = sent if sent.model == model else msgspec.structs.replace(sent, model=model)
        hashes = (wire.hashes.adopt(ids, block_size, keys)
                  if wire.hashes is not None and sent.model == model else None)
        return cls(ids, keys, block_size, hashes, adopted=hashes is not None)

    def __len__(self) -> int:
        return len(self.token_ids)

    def _keep(self, hashes: np.ndarray) -> np.ndarray:
        if hashes.flags.writeable:
            hashes.flags.writeable = False
        object.__setattr__(self, "hashes", hashes)
        return hashes

    def block_hashes(self) -> np.ndarray:
        """Its full blocks' chained hashes, [len // block_size] u64 read-only: computed on the
        first call unless known (a node's engine thread makes that call)."""
        return self.hashes if self.hashes is not None else self._keep(
            hash_blocks_array(self.token_ids, self.block_size, self.hash_keys))

    def prefix(self, num_tokens: int) -> PromptRef:
        """Its first ``num_tokens`` tokens, with the same keys and what is known of their hashes."""
        h = self.hashes
        return PromptRef(self.token_ids[:num_tokens], self.keys, self.block_size,
                         None if h is None else h[:num_tokens // self.block_size], self.adopted)

    def wire(self, token_ids: bytes | None = None) -> WirePrompt:
        """On the wire, with its hashes when known. ``token_ids``: its ids' bytes when the
        caller has them (the router's array, a node's request), else encoded here."""
        return WirePrompt(token_ids=token_bytes(self.token_ids) if token_ids is None else token_ids,
                          keys=self.keys,
                          hashes=None if self.hashes is None else PromptHashes.of(self.hashes, self.block_size))

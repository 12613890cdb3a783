"""A validated prompt's token ids, read from the client's list once.

The router reads a prompt's Python list of ids exactly once, when it validates it
(``Prompt.of``: one C pass into a u32 array, then numpy's max against the
vocabulary); every later step of the request reads the array: the block hashes
(computed once per request), the prefix-index lookup and the node request (the
array's bytes are the wire form, `common.protocol.GenerateRequest.token_ids`).
The list stays for what speaks in token ids to Python code: the detokenizer,
echo and prompt logprobs.

    client JSON / tokenizer --list--> Prompt.of --array--> hashes, lookup, wire bytes
                                               \\--ids----> detokenizer, echo, logprobs

A prompt also carries the cache salt its blocks are hashed with (``salted``: the API
key's and the request's, router/api_keys.py), and a migrated continuation (``extended``)
keeps it, so every leg of a generation stays in its tenant's prefix cache. ``ref`` makes
the leg's `common.prompt_ref.PromptRef` (once per leg: its keys from ``prompt_keys``, the
one place the router builds a request's hash keys, and its block hashes from the array),
which the dispatcher looks up and sends.

Must not be mutated: ``ids`` and ``array`` describe the same tokens for the
request's life (``extended`` makes a new one for a migrated continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..common.errors import InvalidRequest
from ..common.hashing import token_array
from ..common.prompt_ref import PromptKeys, PromptRef


def prompt_keys(model_id: str, cache_salt: str | None) -> PromptKeys:
    """The hash keys of a request's prompt for the served ``model_id``: the one place the
    router builds them (every node and engine then hashes with what the request carries)."""
    return PromptKeys(model=model_id, cache_salt=cache_salt)


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]  # the token ids, as the client (or the tokenizer) gave them
    array: np.ndarray  # [len(ids)] uint32, read-only: the same ids
    cache_salt: str | None = None  # the effective salt of its block hashes; None: unsalted

    @classmethod
    def of(cls, ids: list[int], vocab_size: int, param: str = "prompt") -> Prompt:
        """Check every id is in [0, vocab_size) (InvalidRequest naming ``param`` and the
        first bad id otherwise) and read the list into the array. ``ids`` holds ints."""
        try:
            array = token_array(ids)
        except OverflowError:  # negative or >= 2**32: found the slow way (only on bad input)
            array = None
        if array is None or (len(array) and int(array.max()) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise InvalidRequest(param, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        array.flags.writeable = False
        return cls(ids, array)

    def extended(self, more: list[int]) -> Prompt:
        """This prompt followed by ``more`` (ids the nodes produced: in the vocabulary)."""
        array = np.concatenate([self.array, token_array(more)])
        array.flags.writeable = False
        return Prompt(self.ids + more, array, self.cache_salt)

    def salted(self, cache_salt: str | None) -> Prompt:
        """This prompt with its blocks hashed under ``cache_salt`` (no copy of the ids)."""
        return self if cache_salt == self.cache_salt else replace(self, cache_salt=cache_salt)

    def wire(self) -> bytes:
        """The ids as `WirePrompt.token_ids` carries them: u32 little-endian."""
        return self.array.astype("<u4", copy=False).tobytes()

    def ref(self, model_id: str, block_size: int) -> PromptRef:
        """Its identity for ``model_id`` at ``block_size``, hashed now (from the array)."""
        return PromptRef.hashed(self.ids, prompt_keys(model_id, self.cache_salt), block_size, self.array)

    def __len__(self) -> int:
        return len(self.ids)

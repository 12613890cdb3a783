"""Wire messages between the router, decode nodes and prefill nodes (msgspec,
tagged, ``omit_defaults``). Bodies travel as msgpack over HTTP; token streams as
length-prefixed msgpack frames (``encode_frame`` / ``FrameReader``).

Request path (the decode node drives its own prefill, so it alone decides on the
local fallback):

    router --GenerateRequest--> decode node --PrefillRequest--> prefill node
           <--TokenDelta stream--  |  reserves dest blocks      | computes chunks, sends each
                                   |  <===== KV blocks (kvtransfer backend) ====|
                                   |  <--PrefillResult (first token)-------------|

Prefix pull (node/kv_pull.py): the node that will compute a prompt (the prefill node, or the
decode node prefilling locally) first fetches the leading blocks another node holds::

    router --GenerateRequest(pull)--> decode node [--PrefillRequest(pull)--> prefill node]
    computing node --PullRequest--> holder:  reserves dest blocks | packs its cached blocks, sends each
                   <===== KV blocks (kvtransfer backend) =======|
                   <--PullResult (blocks sent)------------------|
    then computes only the rest (the pulled blocks are in its prefix cache)

A prompt's token ids travel as bytes, u32 little-endian (``common.hashing.token_bytes``;
the router sends its validated array's bytes, the decode node forwards them as they
came): a 100k-token prompt is a 400 KB copy to encode, not 100k msgpack ints. A node
reads them with ``prompt_ids``.
"""

import struct
from typing import Annotated, Iterator

import msgspec
import numpy as np

from .errors import InvalidRequest
from .hashing import BLOCK_HASH_VERSION, hash_blocks, hash_keys, token_array
from .sampling_params import PromptLogprob, SamplingParams, TokenLogprobs


class PromptHashes(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, kw_only=True):
    """A prompt's chained block hashes (common/hashing.py) as the router computed them,
    carried router -> decode node -> prefill node so that the prompt is hashed once.
    A node adopts them only for its own hash version, block size and model key, when
    their count fits the prompt and the first and last blocks re-hash to the same
    values under the request's keys (a wrong or shifted token list, or hashes made
    with another cache salt, fails that); otherwise it hashes itself."""
    version: int
    block_size: int
    model: str  # the extra key of every hash (the served model id)
    hashes: bytes  # u64 little-endian, one per full block of the prompt

    @classmethod
    def of(cls, hashes, block_size: int, model: str) -> "PromptHashes":
        """From ``hash_blocks_array``'s result (a u64 array)."""
        return cls(version=BLOCK_HASH_VERSION, block_size=block_size, model=model,
                   hashes=hashes.astype("<u8", copy=False).tobytes())

    def adopt(self, token_ids: list[int], block_size: int, model: str,
              cache_salt: str | None = None) -> list[int] | None:
        """The hashes as ints, when they are ``token_ids``'s for this node's
        ``block_size`` and ``model`` and the request's ``cache_salt``; None when the
        node must hash the prompt itself."""
        n = len(token_ids) // block_size
        if (self.version != BLOCK_HASH_VERSION or self.block_size != block_size or self.model != model
                or len(self.hashes) != 8 * n):
            return None
        hashes = hash_array(self.hashes).tolist()
        if n == 0:
            return hashes
        keys = hash_keys(model, cache_salt)
        if hashes[0] != hash_blocks(token_ids[:block_size], block_size, keys)[0]:
            return None
        if n > 1 and hashes[-1] != hash_blocks(token_ids[(n - 1) * block_size : n * block_size],
                                               block_size, keys, parent=hashes[-2])[0]:
            return None
        return hashes


def prompt_ids(token_ids: bytes) -> list[int]:
    """A request's ``token_ids`` bytes as ints; InvalidRequest("token_ids") when they
    are not whole u32 values."""
    if len(token_ids) % 4:
        raise InvalidRequest("token_ids", f"{len(token_ids)} bytes is not a whole number of "
                             "u32 token ids")
    return token_array(token_ids).tolist()


def hash_array(raw: bytes):
    """``PromptHashes.hashes`` as a u64 numpy array (no copy)."""
    return np.frombuffer(raw, dtype="<u8")


# A request's cache salt: its blocks are hashed with it (common/hashing.py ``hash_keys``), so
# requests with different salts share no prefix block. Non-empty; None: unsalted.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1)]


class PullSource(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, kw_only=True):
    """Where the router predicts a prompt's longest cached prefix is: the node that computes
    the prompt pulls its first ``tokens`` (whole blocks) from ``addr`` before computing."""
    node_id: str
    addr: str  # http://host:port of the holder
    tokens: Annotated[int, msgspec.Meta(ge=1)]


# ErrorBody.type of a node's 409 to a request sent with ``compile_grammar`` false whose
# grammar the node holds neither compiled nor compiling: it compiled nothing for it.
GRAMMAR_NOT_COMPILED = "grammar_not_compiled"


class GenerateRequest(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """router -> decode node. ``prefill_addr`` None: the decode node prefills locally."""
    request_id: str
    token_ids: bytes  # the prompt, u32 little-endian (``prompt_ids`` reads it)
    sampling_params: SamplingParams
    prefill_addr: str | None = None  # http://host:port of the chosen prefill node
    transfer_id: str = ""
    prompt_hashes: PromptHashes | None = None  # the router's, forwarded to the prefill node
    cache_salt: CacheSalt | None = None  # the effective salt (router/api_keys.py), forwarded
    pull: PullSource | None = None  # fetch this prefix first (whoever computes the prompt), forwarded
    # False: the structured output's grammar only if a node holds it compiled (or compiling);
    # else a 409 GRAMMAR_NOT_COMPILED, nothing compiled (the router's compile budget), forwarded
    compile_grammar: bool = True


class PrefillRequest(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """decode node -> prefill node: compute ``token_ids`` and push the KV of blocks
    ``skip_blocks ..`` into ``dest_block_ids`` (one per block, in order) at ``kv_addr``;
    a tensor-parallel decode node names every rank's receiver in ``kv_addrs`` (each decode
    rank gets its KV heads of every block there: kvtransfer/tp_plan.py)."""
    request_id: str
    transfer_id: str
    token_ids: bytes  # the prompt, u32 little-endian: the router's bytes, forwarded
    sampling_params: SamplingParams
    kv_backend: str
    kv_addr: str  # rank 0's receiver (the only one of a TP=1 decode node)
    skip_blocks: int  # leading blocks the decode node already holds (its prefix cache)
    dest_block_ids: list[int]
    prompt_hashes: PromptHashes | None = None  # the router's, when it sent them
    cache_salt: CacheSalt | None = None  # the GenerateRequest's: both nodes hash with it
    # one receiver per decode rank, in rank order (its length is the decode node's TP);
    # empty: [kv_addr], a TP=1 decode node
    kv_addrs: list[str] = []
    pull: PullSource | None = None  # the GenerateRequest's: this node pulls that prefix first
    compile_grammar: bool = True  # the GenerateRequest's: False, a 409 rather than a compile

    def decode_addrs(self) -> list[str]:
        """Every decode rank's receiver, in rank order."""
        return self.kv_addrs or [self.kv_addr]


class PullRequest(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """puller -> holder: push the KV of blocks ``skip_blocks ..`` of the prefix ``token_ids``
    (whole blocks, hashed with ``cache_salt``) that the holder caches, in order, into
    ``dest_block_ids`` at ``kv_addrs`` (one receiver per rank of the puller). The holder sends
    the leading run of those blocks it holds (any tier) and says how many in ``PullResult``."""
    request_id: str  # the request the pull serves (logs)
    transfer_id: str
    token_ids: bytes  # u32 little-endian
    kv_backend: str
    kv_addrs: Annotated[list[str], msgspec.Meta(min_length=1)]
    skip_blocks: Annotated[int, msgspec.Meta(ge=0)]
    dest_block_ids: list[int]
    cache_salt: CacheSalt | None = None


class PullResult(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """holder -> puller, once every block sent was acknowledged: the first ``num_blocks`` of
    ``dest_block_ids`` hold blocks ``skip_blocks ..`` (0: it holds none of them now)."""
    transfer_id: str
    num_blocks: int


class PrefillResult(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """prefill node -> decode node, once every block was handed to the transport."""
    transfer_id: str
    first_token: int
    logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill node served from its prefix cache
    num_blocks_sent: int = 0
    prompt_logprobs: list[PromptLogprob | None] | None = None  # when asked, one per prompt token


class TokenDelta(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """decode node -> router, one frame per step that produced tokens."""
    request_id: str
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0  # prompt tokens not computed for this request (either node's cache)
    error: str | None = None
    # on the first frame when SamplingParams.prompt_logprobs asked: one per prompt token (the first None)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # on the first frame: the prefill node held the grammar neither compiled nor compiling
    # (compile_grammar false), so this node prefilled the request itself
    grammar_missed: bool = False


class Abort(msgspec.Struct, tag=True, omit_defaults=True):
    request_id: str


class ErrorBody(msgspec.Struct, omit_defaults=True):
    """A node's error answer (HTTP 4xx/5xx)."""
    message: str
    param: str | None = None
    type: str = "invalid_request_error"


_LEN = struct.Struct("!I")


def encode_frame(msg: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into length-prefixed msgpack frames of ``type_``."""

    def __init__(self, type_):
        self._decoder = msgspec.msgpack.Decoder(type_)
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator:
        self._buf += data
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < 4 + n:
                break
            frame = bytes(self._buf[4:4 + n])
            del self._buf[:4 + n]
            yield self._decoder.decode(frame)

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

A prompt travels as one ``WirePrompt`` (common/prompt_ref.py: its token ids as u32 bytes, its
hash keys, the sender's block hashes); a node reads it once into a ``PromptRef``
(node/prompt_hashes.py ``read_prompt``).
"""

import struct
from typing import Annotated, Iterator

import msgspec

from .prompt_ref import WirePrompt
from .sampling_params import PromptLogprob, SamplingParams, TokenLogprobs


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
    prompt: WirePrompt  # the router's: ids, keys (the effective salt included) and hashes, forwarded
    sampling_params: SamplingParams
    prefill_addr: str | None = None  # http://host:port of the chosen prefill node
    transfer_id: str = ""
    pull: PullSource | None = None  # fetch this prefix first (whoever computes the prompt), forwarded
    # False: the structured output's grammar only if a node holds it compiled (or compiling);
    # else a 409 GRAMMAR_NOT_COMPILED, nothing compiled (the router's compile budget), forwarded
    compile_grammar: bool = True


class PrefillRequest(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """decode node -> prefill node: compute ``prompt`` and push the KV of blocks
    ``skip_blocks ..`` into ``dest_block_ids`` (one per block, in order) at ``kv_addr``;
    a tensor-parallel decode node names every rank's receiver in ``kv_addrs`` (each decode
    rank gets its KV heads of every block there: kvtransfer/tp_plan.py)."""
    request_id: str
    transfer_id: str
    prompt: WirePrompt  # the GenerateRequest's (its hashes only when the decode node adopted them)
    sampling_params: SamplingParams
    kv_backend: str
    kv_addr: str  # rank 0's receiver (the only one of a TP=1 decode node)
    skip_blocks: int  # leading blocks the decode node already holds (its prefix cache)
    dest_block_ids: list[int]
    # one receiver per decode rank, in rank order (its length is the decode node's TP);
    # empty: [kv_addr], a TP=1 decode node
    kv_addrs: list[str] = []
    pull: PullSource | None = None  # the GenerateRequest's: this node pulls that prefix first
    compile_grammar: bool = True  # the GenerateRequest's: False, a 409 rather than a compile

    def decode_addrs(self) -> list[str]:
        """Every decode rank's receiver, in rank order."""
        return self.kv_addrs or [self.kv_addr]


class PullRequest(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    """puller -> holder: push the KV of blocks ``skip_blocks ..`` of the prefix ``prompt``
    (whole blocks, hashed with its keys) that the holder caches, in order, into
    ``dest_block_ids`` at ``kv_addrs`` (one receiver per rank of the puller). The holder sends
    the leading run of those blocks it holds (any tier) and says how many in ``PullResult``."""
    request_id: str  # the request the pull serves (logs)
    transfer_id: str
    prompt: WirePrompt  # the request's keys; its hashes when the puller knows them
    kv_backend: str
    kv_addrs: Annotated[list[str], msgspec.Meta(min_length=1)]
    skip_blocks: Annotated[int, msgspec.Meta(ge=0)]
    dest_block_ids: list[int]


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

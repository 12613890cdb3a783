"""Request: the engine's state of one generation, owned by the scheduler.

Token bookkeeping (vLLM v1 style): ``all_token_ids`` = prompt + sampled tokens;
``num_computed_tokens`` of them have their KV in the cache. Each step computes
the next ``num_tokens - num_computed_tokens`` tokens (capped by the budget); a
step that reaches the end samples one more token. Prefill, chunked prefill,
decode and recompute after preemption are all this one rule.
"""

import enum
import time
from dataclasses import dataclass, field

import torch

from ..common.hashing import extend_block_hashes
from ..common.sampling_params import SamplingParams, TokenLogprobs
from .structured import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_size: int
    hash_keys: tuple  # extra keys of every block hash (the model id)
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # structured outputs: advanced by every appended token
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.hash_keys)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.logprobs.append(logprobs)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.hash_keys)

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the last appended token, or None to go on."""
        if self.output_token_ids and self.output_token_ids[-1] in self.stop_ids:
            return "stop"
        if self.grammar is not None:
            if self.grammar.rejected is not None:  # never return output that breaks the grammar
                return "error"
            if self.grammar.terminated:
                return "stop"
        if len(self.output_token_ids) >= self.sampling_params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

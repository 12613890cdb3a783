"""Request: the engine's state of one generation, owned by the scheduler.

Token bookkeeping (vLLM v1 style): ``all_token_ids`` = prompt + sampled tokens;
``num_computed_tokens`` of them have their KV in the cache. Each step computes
the next ``num_tokens - num_computed_tokens`` tokens (capped by the budget); a
step that reaches the end samples one more token. Prefill, chunked prefill,
decode and recompute after preemption are all this one rule.

With async scheduling (engine_core.py) a step is scheduled while the previous one
still runs, so a request may have a token sampled on the device but not yet
appended here: ``pending_tokens`` counts those, and ``seq_len`` (= ``num_tokens +
pending_tokens``) is the length the scheduler plans with. The next step's input for
that position is read on the device from the step that sampled it.
"""

import enum
import time
from dataclasses import dataclass, field

import torch

from ..common.hashing import extend_block_hashes
from ..common.prompt_ref import PromptRef
from ..common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from .sampling.structured import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: PromptRef  # its ids, hash keys, block size and block hashes (common/prompt_ref.py)
    sampling_params: SamplingParams
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # structured outputs: advanced by every appended token
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # one per prompt token (the first None) once the prompt is computed, if asked (prompt_logprobs.py)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    # taken from ``prompt`` once:
    prompt_token_ids: list[int] = field(init=False)  # a copy of the prompt's ids
    block_size: int = field(init=False)
    hash_keys: tuple = field(init=False)  # extra keys of every block hash (PromptKeys.hash_keys())
    salt: bytes = field(init=False)  # their salt identity (common.hashing.salt_id): cached blocks carry it
    block_hashes: list[int] = field(init=False)  # chained hashes of full blocks (the prompt's, then more)
    num_computed_tokens: int = 0
    pending_tokens: int = 0  # sampled by a launched step, not yet appended (async scheduling)
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"

    def __post_init__(self):
        p = self.prompt
        self.prompt_token_ids = list(p.token_ids)
        self.all_token_ids = list(p.token_ids)
        self.block_size, self.hash_keys, self.salt = p.block_size, p.hash_keys, p.salt
        self.block_hashes = p.block_hashes().tolist()  # computed here unless known (carried, adopted)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence, counting those still on the device."""
        return len(self.all_token_ids) + self.pending_tokens

    @property
    def samples_from_history(self) -> bool:
        """Whether sampling its next token reads its earlier tokens on the host (a grammar,
        a penalty, min_tokens still counting): its next step waits for its last token."""
        p = self.sampling_params
        return (self.grammar is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or len(self.output_token_ids) < p.min_tokens)

    def ends_by_length(self, max_model_len: int) -> bool:
        """Whether the tokens it has (pending ones too) already make it finish with "length"."""
        return (len(self.output_token_ids) + self.pending_tokens >= self.sampling_params.max_tokens
                or self.seq_len >= max_model_len)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_tokens(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        """Append what a step landed for it, in order: one token per verifying row today (with
        speculative decoding, its accepted drafts and the token sampled after them)."""
        assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
        self.all_token_ids += token_ids
        self.output_token_ids += token_ids
        self.logprobs += logprobs
        if self.grammar is not None:
            for token_id in token_ids:
                self.grammar.accept(token_id)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.hash_keys)

    def record_prompt_logprobs(self, start: int, values: list[PromptLogprob]) -> None:
        """Store a chunk's prompt logprobs, of positions [start, start + len(values)), into
        ``prompt_logprobs`` (entry 0 is None; sampling/prompt_logprobs.py)."""
        lps = self.prompt_logprobs
        del lps[start + 1:]
        if not lps:
            lps.append(None)
        assert len(lps) == start + 1, (len(lps), start)  # chunks of a request run in order
        lps.extend(values)

    def rollback(self, n: int) -> None:
        """Forget the KV of its last ``n`` computed tokens: the drafts a verifying step computed
        and rejected (scheduler.py ``Row``). Their ids were never appended; the next step
        computes over their slots."""
        assert 0 <= n <= self.num_computed_tokens, (n, self.num_computed_tokens, self.request_id)
        self.num_computed_tokens -= n

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
            return "length"  # counts appended tokens only: a pending one is checked when it lands
        return None

"""RequestLimits: what a request must fit to ever run on one engine (its vocabulary,
context length and KV cache), fixed when the engine is built.

A check over frozen numbers, so a node's event loop rejects a request at its HTTP
boundary (a 400 before any stream starts) without touching the engine, which the engine
thread owns. The engine runs the same check on every request it admits. A structured
output's constraint is checked for shape and cost here (`SamplingParams.validate`,
common/grammar_limits.py), never compiled: a node compiles it in a worker
(node/grammar_service.py), the offline `LLM` in engine/sampling/structured.py.
"""

from __future__ import annotations

from typing import NamedTuple

from ..common.errors import InvalidRequest
from ..common.sampling_params import SamplingParams


class RequestLimits(NamedTuple):
    vocab_size: int
    max_model_len: int  # tokens of context: prompt + output
    kv_capacity_tokens: int  # tokens the whole KV cache holds
    structured: bool = False  # structured outputs supported (False: a simulated engine refuses them)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field if this request can never run."""
        params.validate()
        params.check_vocab(self.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt", "must contain at least one token")
        # Callers hand ints (msgspec decodes list[int]; LLM.tokenize checks user lists), so the
        # range is two C-speed passes, not a Python loop over a 100k-token prompt.
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequest("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise InvalidRequest("prompt", f"{n} tokens; this model's context is {self.max_model_len} "
                                 "tokens, and at least one must be left to generate")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                                 f"exceeds the model's context of {self.max_model_len} tokens; "
                                 f"use max_tokens <= {self.max_model_len - n}")
        if n + params.max_tokens > self.kv_capacity_tokens:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens ({n + params.max_tokens} tokens) exceed "
                                 f"the KV cache ({self.kv_capacity_tokens} tokens); lower max_tokens")
        if params.structured_outputs is not None and not self.structured:
            raise InvalidRequest("structured_outputs", "not supported by a simulated node")

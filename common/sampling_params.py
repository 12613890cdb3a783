"""Per-request sampling parameters and per-token logprobs, as wire types.

Owns the `SamplingParams` struct (router -> prefill/decode nodes), its range checks,
and `TokenLogprobs` (nodes -> router). Every user error raises `InvalidRequest`
naming the field and the allowed range, so the router can answer a 400.

Must not import torch: the sampler that consumes these lives in `engine/sampling/sampler.py`.
"""

from __future__ import annotations

import math

import msgspec

from .errors import InvalidRequest
from .structured_outputs import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: [-100, 100]
# OpenAI's range. Above 2 sampling is close to uniform noise; a huge value is a typo.
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 2.0  # as SGLang; 1 disables, typical values are 1.0-1.3
# Upper bound of max_tokens, top_k and token ids: far above any context or vocabulary,
# and within every integer type a node stores them in.
MAX_INT = 2**31 - 1
# Below this a temperature is treated as 0 (greedy): dividing logits by it would
# overflow float32 to inf and turn the softmax into NaN. vLLM uses the same cut-off.
GREEDY_TEMPERATURE_EPS = 1e-5
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick the next tokens of one request, and when to stop.

    Defaults follow the OpenAI API. Construct, then call `validate()` before use:
    msgspec checks the types of decoded messages, but a struct built in Python is
    not checked until `validate()`.
    """

    max_tokens: int = 16  # [1, MAX_INT]
    temperature: float = 1.0  # [0, 2]; 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 disable; else [1, MAX_INT]
    min_p: float = 0.0  # [0, 1], relative to the most likely token's probability
    seed: int | None = None  # None: the node's shared generator
    presence_penalty: float = 0.0  # [-2, 2], OpenAI: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: logit -= frequency * count
    repetition_penalty: float = 1.0  # (0, 2], CTRL/HF, over prompt + output tokens
    stop: list[str] = []  # at most 16 non-empty strings of <= 512 chars; excluded from the output
    stop_token_ids: list[int] = []  # at most 256 token ids that end the request (kept in output)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k in 0..20: sampled token + k alternatives
    # None: none; k in 0..20: each prompt token's logprob and rank + k alternatives (vLLM's
    # prompt_logprobs). The prompt is then computed without the prefix cache (cached blocks
    # have no logits), as vLLM does.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # [0, max_tokens]: EOS and stop_token_ids are masked until this many tokens
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, in [-100, 100]
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits:
        temperature 0 (or below `GREEDY_TEMPERATURE_EPS`) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def validate(self) -> SamplingParams:
        """Check every field's type and range; raise `InvalidRequest(field, msg)` on
        the first bad one. Floats given as ints are converted to float in place.
        Returns self so a caller can write `params = SamplingParams(...).validate()`."""
        if not 1 <= _int(self, "max_tokens") <= MAX_INT:
            raise InvalidRequest(
                "max_tokens", f"must be in [1, {MAX_INT}], got {_show(self.max_tokens)}"
            )
        if not 0.0 <= _float(self, "temperature") <= MAX_TEMPERATURE:
            raise InvalidRequest(
                "temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got "
                f"{self.temperature}"
            )
        if not 0.0 < _float(self, "top_p") <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        top_k = _int(self, "top_k")
        if not -1 <= top_k <= MAX_INT:
            raise InvalidRequest(
                "top_k", f"must be 0 or -1 (disabled) or in [1, {MAX_INT}], got {_show(top_k)}"
            )
        if not 0.0 <= _float(self, "min_p") <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_MIN <= _int(self, "seed") <= SEED_MAX:
            raise InvalidRequest("seed", f"must be in [-2**63, 2**64 - 1], got {_show(self.seed)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < _float(self, "repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                "repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 disables), "
                f"got {self.repetition_penalty}"
            )
        self._validate_stop()
        if not isinstance(self.stop_token_ids, list) or not all(
            type(t) is int and 0 <= t <= MAX_INT for t in self.stop_token_ids
        ):
            raise InvalidRequest(
                "stop_token_ids", f"must be a list of token ids (integers in [0, {MAX_INT}])"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got "
                f"{len(self.stop_token_ids)}"
            )
        if type(self.ignore_eos) is not bool:
            raise InvalidRequest("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= _int(self, name) <= MAX_LOGPROBS:
                raise InvalidRequest(
                    name, f"must be null or an integer in [0, {MAX_LOGPROBS}], got "
                    f"{_show(getattr(self, name))}",
                )
        if not 0 <= _int(self, "min_tokens") <= self.max_tokens:
            raise InvalidRequest(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got "
                f"{_show(self.min_tokens)}"
            )
        self._validate_logit_bias()
        if type(self.include_stop_str_in_output) is not bool:
            raise InvalidRequest("include_stop_str_in_output",
                                 f"must be a boolean, got {self.include_stop_str_in_output!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequest("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        return self

    def _validate_logit_bias(self) -> None:
        """Keys are token ids (the vocabulary bound is the caller's: the router and the
        engine know it); values finite in [-100, 100], converted to float in place."""
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidRequest("logit_bias", "must be an object mapping token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token, value in bias.items():
            if type(token) is not int or not 0 <= token <= MAX_INT:
                raise InvalidRequest("logit_bias", f"keys must be token ids (integers in "
                                     f"[0, {MAX_INT}]), got {token!r}")
            if type(value) is int and abs(value) <= MAX_LOGIT_BIAS_VALUE:
                value = bias[token] = float(value)
            if type(value) is not float or not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
                raise InvalidRequest("logit_bias", f"values must be numbers in [-100, 100], got "
                                     f"{value!r} for token {token}")

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids of logit_bias must be in [0, vocab_size). (A stop token id
        outside the vocabulary is harmless: it is never sampled.)"""
        bad = next((t for t in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest("logit_bias", f"token id {bad} is outside the vocabulary "
                                 f"[0, {vocab_size})")

    def _validate_stop(self) -> None:
        stop = self.stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop", "must be a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}"
            )
        if any(s == "" for s in stop):
            raise InvalidRequest("stop", "stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequest("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters")


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token, from the raw logits (before penalties and
    temperature). `top` holds the requested number of most likely alternatives as
    (token_id, logprob) pairs, best first; it may include the sampled token. A
    logprob may be -inf for a token whose raw logit was -inf."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class PromptLogprob(msgspec.Struct, array_like=True):
    """One prompt token's logprob given the tokens before it (the first prompt token has
    none), from the raw logits, its rank in the vocabulary (1 = most likely), and the
    requested number of most likely alternatives as (token_id, logprob), best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


def _int(params: SamplingParams, name: str) -> int:
    """The integer field `name`; rejects bools and other types."""
    value = getattr(params, name)
    if type(value) is not int:  # bool is a subclass of int: reject it explicitly
        raise InvalidRequest(name, f"must be an integer, got {value!r}")
    return value


def _show(value: int) -> str:
    """An int for an error message: Python refuses to format one of over 4300 digits."""
    if abs(value) < 10**30:
        return str(value)
    return f"{'-' if value < 0 else ''}an integer of about {int(value.bit_length() * 0.30103)} digits"


def _float(params: SamplingParams, name: str) -> float:
    """The float field `name`, converted from int in place; rejects bools, NaN, inf."""
    value = getattr(params, name)
    if type(value) is int:
        value = float(value)
        setattr(params, name, value)
    if type(value) is not float:
        raise InvalidRequest(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequest(name, f"must be a finite number, got {value}")
    return value

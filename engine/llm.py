"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``.

A prompt is text, a list of token ids, or a chat conversation (a list of
``{"role", "content"}`` dicts, rendered with the model's chat template). The
LLM tokenizes, runs the engine to completion and detokenizes, finishing
requests on stop strings.

With ``tensor_parallel_size=N`` the LLM starts N - 1 worker ranks as child processes
(multiprocessing spawn, which re-imports the calling script: keep its top level under
``if __name__ == "__main__":``); ``close()``, or leaving its ``with`` block, stops them.

The tokenizer is loaded on first use: a model folder without one (a bare
``config.json`` with ``load_format="dummy"``) serves token-id prompts, with empty
``text``; text, chat and stop strings then raise InvalidRequest saying so.
"""

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TypeGuard, cast

from transformers import AutoTokenizer

from ..common.chat import CHAT_ROLES
from ..common.config import EngineConfig
from ..common.detokenizer import IncrementalDetokenizer
from ..common.errors import InvalidRequest
from ..common.sampling_params import PromptLogprob, SamplingParams, TokenLogprobs
from .engine_core import EngineCore

Prompt = str | list[int] | list[dict]
# Any of these in a model folder means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs | None] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[PromptLogprob | None] | None = None


def _is_chat(prompt: Prompt) -> TypeGuard[list[dict]]:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the reply."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}]", "must be an object with string 'role' and 'content'")
        if m["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """``engine_args`` are EngineConfig fields (block_size, kv_cache_memory, ...)."""
        self._init(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        self.engine = EngineCore(config)
        self.has_tokenizer = has_tokenizer(self.engine.model_dir)
        self._tokenizer: Any = None  # the folder's transformers tokenizer, loaded on first use
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker ranks (``tensor_parallel_size`` > 1; idempotent). They are
        daemonic children, so they end with this process anyway."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        """The model folder's tokenizer; InvalidRequest when the folder has none."""
        if self._tokenizer is None:
            if not self.has_tokenizer:
                raise InvalidRequest("prompt", f"{self.engine.model_dir} has no tokenizer (none of "
                                     f"{', '.join(TOKENIZER_FILES)}): pass prompts as lists of token ids")
            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.model_dir)
        return self._tokenizer

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        """None for a folder without a tokenizer (outputs carry token ids, no text)."""
        if not self.has_tokenizer:
            if params.stop:
                raise InvalidRequest("stop", f"stop strings need a tokenizer and {self.engine.model_dir} "
                                     "has none; use stop_token_ids")
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                      include_stop=params.include_stop_str_in_output)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            return self.tokenizer(prompt)["input_ids"]
        if _is_chat(prompt):
            return render_chat(self.tokenizer, prompt)
        if _is_token_ids(prompt):
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            return list(prompt)
        raise InvalidRequest("prompt", "must be a string, a list of token ids, or a list of chat messages")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs are in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        not isinstance(prompts[0], (str, list))):
            prompts = [cast(Prompt, prompts)]  # one text, token-id list or conversation
        prompts = cast(Sequence[Prompt], prompts)
        if not prompts:
            raise InvalidRequest("prompt", "no prompts given")
        given = sampling_params or SamplingParams()
        params = [given] * len(prompts) if isinstance(given, SamplingParams) else list(given)
        if len(params) != len(prompts):
            raise InvalidRequest("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        token_lists = [self.tokenize(p) for p in prompts]
        for ids, p in zip(token_lists, params):
            self.engine.limits.check(ids, p)  # reject the whole batch before any request starts
            if p.structured_outputs is not None and self.engine.grammars is not None:
                self.engine.grammars.check(p.structured_outputs)  # compiled (and cached) here
        detok_list = [self._detokenizer(ids, p) for ids, p in zip(token_lists, params)]

        detoks: dict[str, IncrementalDetokenizer | None] = {}
        order = []
        for ids, p, detok in zip(token_lists, params, detok_list):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, self.engine.prompt_ref(ids), p)  # its identity, once
            detoks[rid] = detok
            order.append(rid)

        finished: dict[str, str] = {}  # req_id -> finish reason
        on_stop_string: set[str] = set()
        cached: dict[str, int] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in order}
        logprobs: dict[str, list] = {rid: [] for rid in order}
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished():
            for d in self.engine.step():
                rid = d.request_id
                cached[rid] = d.num_cached_tokens
                tokens[rid].extend(d.new_token_ids)
                logprobs[rid].extend(d.new_logprobs)
                if d.prompt_logprobs is not None:
                    prompt_logprobs[rid] = d.prompt_logprobs
                det = detoks[rid]
                if det is not None and det.add_tokens(d.new_token_ids).stop_string is not None:
                    self.engine.abort(rid, "stop")
                    on_stop_string.add(rid)
                    finished[rid] = "stop"
                elif d.finish_reason is not None:
                    finished[rid] = d.finish_reason

        outputs = []
        for rid, ids, p in zip(order, token_lists, params):
            det, text = detoks[rid], ""
            if det is not None:
                text = det.text if rid in on_stop_string else det.text + det.flush()
            outputs.append(RequestOutput(rid, ids, text, tokens[rid], finished[rid], cached.get(rid, 0),
                                         logprobs[rid] if p.logprobs is not None else None,
                                         prompt_logprobs.get(rid)))
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            return self.generate([messages], sampling_params)
        return self.generate(cast(list[list[dict]], messages), sampling_params)

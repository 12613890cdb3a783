"""The bodies of /v1/completions and /v1/chat/completions answers, whole or as stream
chunks, with usage and logprobs (the Responses API's objects are responses/*.py's;
they are built from these chat bodies).

Echo (completions) puts each choice's prompt text, and with logprobs its prompt tokens'
entries (the first token's logprob null, as OpenAI), before the choice's first piece.
vLLM's ``prompt_logprobs`` go on each completion choice, and at the top of a chat
completion: ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``.
Usage counts each prompt once and every choice's completion tokens (as vLLM with n).

Owns the JSON shapes (``text_completion``, ``chat.completion``,
``chat.completion.chunk``) and the per-choice accumulation of a non-streamed
answer. Must not do I/O or know about nodes: it turns `Piece`s into dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...common.sampling_params import PromptLogprob, TokenLogprobs
from ..streams.generation import Generation, Piece
from .prepare import PreparedRequest
from ..tokenizer import RouterTokenizer
from .tool_calls import ToolCallStream, ToolMode, message_calls, parse

# JSON has no -inf: a token the model ruled out gets this logprob (as vLLM does).
MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class _Choice:
    """One choice of a non-streamed answer, accumulated piece by piece."""

    text: list[str] = field(default_factory=list)
    logprobs: dict | None = None  # completions: dict of lists; chat: {"content": [...]}
    finish_reason: str | None = None
    prompt_logprobs: list | None = None  # vLLM's shape, when asked


class BodyBuilder:
    def __init__(self, prep: PreparedRequest, tok: RouterTokenizer, response_id: str,
                 created: int):
        self.prep = prep
        self._tok = tok
        self.id = response_id
        self.created = created
        self._chat = prep.kind == "chat"
        self._top = prep.params.logprobs or 0  # alternatives per token
        self._offsets = [0] * len(prep.prompts)  # completions: text offset of the next token
        self._choices = [_Choice() for _ in prep.prompts]
        self._started = [False] * len(prep.prompts)  # a piece of this choice went out (echo)
        # chat with tools (tool_choice other than "none"): tool calls are parsed from the text
        self._tools = prep.tools if prep.tools is not None and prep.tools.mode is not ToolMode.NONE else None
        self._tool_streams = [ToolCallStream(self._tools) for _ in prep.prompts] if self._tools else []

    # -- streaming -------------------------------------------------------------

    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        return self._envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])

    def chunk(self, piece: Piece) -> dict:
        text, lp = self._text_and_logprobs(piece)
        if self._tools:  # chat only: echo never applies
            return self._tool_chunk(piece, lp)
        if self._chat:
            delta = {"content": text} if text else {}
            choice = {"index": piece.choice, "delta": delta, "logprobs": lp,
                      "finish_reason": piece.finish_reason}
        else:
            choice = {"index": piece.choice, "text": text, "logprobs": lp,
                      "finish_reason": piece.finish_reason}
        return self._envelope([choice])

    def _tool_chunk(self, piece: Piece, lp: dict | None) -> dict:
        """A chat chunk of a request with tools: its deltas merged into one (content and
        tool_calls may both appear in the last one)."""
        stream = self._tool_streams[piece.choice]
        deltas = stream.feed(piece.text) if piece.text else []
        finish = piece.finish_reason
        if finish is not None:
            last, finish = stream.finish(finish)
            deltas += last
        delta: dict = {}
        for d in deltas:
            for key, value in d.items():
                delta[key] = delta[key] + value if key == "content" and key in delta else value
        return self._envelope([{"index": piece.choice, "delta": delta, "logprobs": lp,
                                "finish_reason": finish}])

    def usage_chunk(self, gens: list[Generation]) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        body = self._envelope([])
        body["usage"] = usage(gens, self.prep.n)
        return body

    # -- whole answer ----------------------------------------------------------

    def add(self, piece: Piece) -> None:
        c = self._choices[piece.choice]
        text, lp = self._text_and_logprobs(piece)
        c.text.append(text)
        if piece.finish_reason is not None:
            c.finish_reason = piece.finish_reason
        if piece.prompt_logprobs is not None and self.prep.prompt_logprobs:
            c.prompt_logprobs = self._prompt_logprobs_body(piece.choice, piece.prompt_logprobs)
        if lp is None:
            return
        if c.logprobs is None:
            c.logprobs = lp
        else:
            for key, values in lp.items():
                c.logprobs[key].extend(values)

    def final(self, gens: list[Generation]) -> dict:
        choices = []
        for i, c in enumerate(self._choices):
            text = "".join(c.text)
            if self._chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if self._tools and finish in ("stop", "length"):
                    content, calls = parse(self._tools, text, finish)
                    if calls:  # cut by max_tokens: the complete calls, finish_reason "length"
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": message_calls(calls)}
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "logprobs": c.logprobs,
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": c.logprobs,
                                "finish_reason": c.finish_reason})
                if self.prep.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = c.prompt_logprobs
        body = self._envelope(choices, chunk=False)
        if self._chat and self.prep.prompt_logprobs:  # vLLM: one list, for the one prompt
            body["prompt_logprobs"] = self._choices[0].prompt_logprobs
        body["usage"] = usage(gens, self.prep.n)
        return body

    # -- parts -----------------------------------------------------------------

    def _envelope(self, choices: list[dict], chunk: bool = True) -> dict:
        if self._chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.prep.model,
                "choices": choices}

    def _text_and_logprobs(self, piece: Piece) -> tuple[str, dict | None]:
        """The piece's text and logprobs, after the echoed prompt on a choice's first piece."""
        first = not self._started[piece.choice]
        self._started[piece.choice] = True
        if self.prep.echo is None or not first:
            return piece.text, self._logprobs(piece)
        prompt_ids = self.prep.prompts[piece.choice].ids
        prompt_lps = piece.prompt_logprobs or [None] * len(prompt_ids)
        lp = None
        if self.prep.logprobs:
            lp = self._completion_logprobs(piece.choice, [
                (t, None if p is None else TokenLogprobs(t, p.logprob, p.top))
                for t, p in zip(prompt_ids, prompt_lps)])
            for key, values in (self._logprobs(piece) or {}).items():
                lp[key].extend(values)
        return self.prep.echo[piece.choice] + piece.text, lp

    def _logprobs(self, piece: Piece) -> dict | None:
        if not self.prep.logprobs or not piece.token_ids:
            return None
        pairs = list(zip(piece.token_ids, piece.logprobs or [None] * len(piece.token_ids)))
        if self._chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in pairs]}
        return self._completion_logprobs(piece.choice, pairs)

    def _completion_logprobs(self, index: int, pairs: list[tuple[int, TokenLogprobs | None]]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token_id, lp in pairs:
            text = self._tok.token_text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp.logprob) if lp else None)
            out["top_logprobs"].append(
                {self._tok.token_text(t): _finite(v) for t, v in lp.top[:self._top]} if lp else None)
            out["text_offset"].append(self._offsets[index])
            self._offsets[index] += len(text)
        return out

    def _prompt_logprobs_body(self, index: int, values: list[PromptLogprob | None]) -> list:
        """vLLM's prompt_logprobs of choice ``index``: per prompt token, null (the first)
        or {token id: {"logprob", "rank", "decoded_token"}} for the token and the top k."""
        out: list[dict | None] = []
        for token_id, lp in zip(self.prep.prompts[index].ids, values):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token_id): self._prompt_entry(token_id, lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), self._prompt_entry(t, v, rank))
            out.append(entry)
        return out

    def _prompt_entry(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _finite(logprob), "rank": rank,
                "decoded_token": self._tok.token_text(token_id)}

    def _chat_entry(self, token_id: int, lp: TokenLogprobs | None) -> dict:
        text = self._tok.token_text(token_id)
        top = [] if lp is None else [
            {"token": (s := self._tok.token_text(t)), "logprob": _finite(v),
             "bytes": list(s.encode())} for t, v in lp.top[:self._top]]
        return {"token": text, "logprob": _finite(lp.logprob) if lp else MIN_LOGPROB,
                "bytes": list(text.encode()), "top_logprobs": top}


def usage(gens: list[Generation], n: int = 1) -> dict:
    """Each prompt counted once (its first choice's), completions of every choice."""
    firsts = [g for g in gens if g.index % n == 0]
    prompt = sum(g.prompt_len for g in firsts)
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.cached_tokens for g in firsts)}}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB

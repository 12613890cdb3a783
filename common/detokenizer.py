"""Incremental detokenization of one request's output, with stop strings.

Owns turning a growing list of generated token ids into text that is safe to stream:
never half a UTF-8 character, never a piece of text that may turn out to be the
start of a stop string, never anything after a matched stop string. Used by the
offline engine and by the router, which holds only the tokenizer.

Must not import torch or transformers: it needs only an object with the Hugging Face
`decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)` method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

# Prompt tokens decoded as left context for the first output token, so that the
# first token's leading space and any byte it shares with the prompt come out as the
# tokenizer decodes them inside the sequence.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode shows for an incomplete char


class TokenDecoder(Protocol):
    """The part of a Hugging Face fast tokenizer that the detokenizer needs."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


class DetokenizerStep(NamedTuple):
    new_text: str  # text safe to emit now (may be "")
    stop_string: str | None  # the stop string that matched at this step, if any


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens.

    Two stages, each keeping only a small window:

    1. Tokens -> text (prefix-offset / read-offset technique). Only the ids from
       `prefix_offset` on are kept, in `_window`:

           all ids:  prompt ... | prefix_offset ...... read_offset ...... end
           _window:             [ already emitted   ][ not yet emitted  ]
                                 0                  _read           len(_window)

       Each step decodes `_window[:_read]` (prefix text) and all of `_window`
       (full text); the new text is the full text past the prefix text. If the full
       text ends in U+FFFD, the last token stops mid-character: emit nothing and wait.
       Otherwise the window slides: the ids just emitted become the next prefix.

    2. Text -> stream (stop strings). `_held` is the longest tail of the decoded text
       that is still a proper prefix of some stop string; every stop string that
       could still match starts inside `_held`, so each step searches only
       `_held + new text`. A match truncates the text right before the stop string
       (the stop string is not emitted, as in OpenAI); after it the detokenizer emits
       nothing more.

    Contract: when no stop string matches, the concatenation of every `new_text`
    plus `flush()` equals `tokenizer.decode(output_ids, skip_special_tokens=...)`
    for byte-level BPE tokenizers that do not clean up spaces (the Llama-3 /
    SmolLM2 family). Text is never re-spaced: `clean_up_tokenization_spaces=False`.
    The first output token is decoded after the prompt's last ids, so a SentencePiece
    (Metaspace) tokenizer keeps its leading space ("Hello" -> " world"), which
    `decode(output_ids)` alone would strip.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        """``include_stop``: a matched stop string is emitted too (vLLM's
        ``include_stop_str_in_output``); the text still ends right after it."""
        assert all(stop), "stop strings must be non-empty (SamplingParams.validate checks)"
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop
        # ids[prefix_offset:]; starts with the last few prompt ids as context
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)  # read_offset - prefix_offset
        self._held = ""  # decoded, not emitted: could still start a stop string
        self._chunks: list[str] = []  # every emitted new_text, in order
        self._text_cache: str | None = ""
        self._stop_string: str | None = None
        self._done = False  # a stop string matched, or flush() was called

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_string

    def add_tokens(self, token_ids: list[int]) -> DetokenizerStep:
        """Append generated token ids; return the text that is safe to emit now and
        the stop string if one matched. After a match, or after `flush()`, further
        calls return `DetokenizerStep("", None)`. Cost: two decodes of the window
        (the ids since the last emitted chunk) plus a scan bounded by the stop
        strings' lengths, independent of the output length so far."""
        if self._done:
            return DetokenizerStep("", None)
        self._window.extend(token_ids)
        return self._release(self._decode_pending(final=False), final=False)

    def flush(self) -> str:
        """End of the request: return everything still held back (a possible stop
        string prefix, bytes of an incomplete character decoded as U+FFFD, exactly
        as `tokenizer.decode` shows them). A stop string completed by those bytes
        still truncates; `stop_string` then says which one matched."""
        if self._done:
            return ""
        step = self._release(self._decode_pending(final=True), final=True)
        self._done = True
        return step.new_text

    # -- stage 1: ids -> text --------------------------------------------------

    def _decode_pending(self, final: bool) -> str:
        """Decode the ids past `_read`; return their text and slide the window, or
        return "" and keep them pending while they end mid-character (unless final)."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if not final and full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        del self._window[: self._read]  # the ids just decoded become the next prefix
        self._read = len(self._window)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    # -- stage 2: text -> stream, with stop strings -----------------------------

    def _release(self, new_text: str, final: bool) -> DetokenizerStep:
        """Search `_held + new_text` for the earliest stop string; emit the text up
        to it, or up to the tail that could still start one (all of it if final)."""
        buf = self._held + new_text
        if not buf:
            return DetokenizerStep("", None)
        match = _earliest_stop(buf, self._stops)
        if match is not None:
            pos, stop = match
            self._held = ""
            self._stop_string = stop
            self._done = True
            end = pos + len(stop) if self._include_stop else pos
            return DetokenizerStep(self._emit(buf[:end]), stop)
        keep = 0 if final else _longest_stop_prefix_suffix(buf, self._stops)
        self._held = buf[len(buf) - keep :]
        return DetokenizerStep(self._emit(buf[: len(buf) - keep]), None)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text_cache = None
        return text


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(position, stop string) of the stop string that starts first in `text`;
    ties go to the one listed first. None if no stop string occurs."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop
    string (0 if none): the part that must be held back."""
    longest = 0
    for stop in stops:
        # candidate starts, left to right: the suffix must be shorter than `stop`
        # and longer than the best so far, so the first hit is the longest
        end = len(text) - longest
        pos = text.find(stop[0], max(len(text) - len(stop) + 1, 0), end)
        while pos != -1:
            if stop.startswith(text[pos:]):
                longest = len(text) - pos
                break
            pos = text.find(stop[0], pos + 1, end)
    return longest

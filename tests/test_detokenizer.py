"""IncrementalDetokenizer on the bundled SmolLM2 tokenizer: exact streaming text,
split multi-byte characters, stop strings across token boundaries, small windows."""

from __future__ import annotations

import random

import pytest

from splitserve.common.detokenizer import (
                                           PROMPT_CONTEXT_TOKENS,
                                           DetokenizerStep,
                                           IncrementalDetokenizer,
                                           _longest_stop_prefix_suffix,
                                           )

TEXTS = [
    "Héllo wörld 😀🎉 日本語のテキスト. Don't stop! Ünïcödé — “quotes” and 👩‍👩‍👧‍👦 family.",
    "Ελληνικά, العربية, 한국어 and flags 🇫🇷🇯🇵.\n\nNew paragraph\twith a tab,  double  spaces "
    "and trailing space ",
    "def f(x):\n    return x ** 2  # naïve ≥ 0 ✓\n",
    "The quick brown fox jumps over the lazy dog.",
]
PROMPT = "<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def _tok(tokenizer):
    return tokenizer


def stream(tok, output_ids, stop=(), chunk_sizes=None, skip_special_tokens=True):
    """Feed `output_ids` in chunks (default: one at a time); return the detokenizer
    and the list of steps."""
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=stop,
                                   skip_special_tokens=skip_special_tokens)
    steps, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(output_ids):
        n = next(sizes, 1)
        steps.append(detok.add_tokens(output_ids[i : i + n]))
        i += n
    return detok, steps


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_one_token_at_a_time(_tok, text):
    ids = _tok.encode(text)
    detok, steps = stream(_tok, ids)
    assert all(isinstance(s, DetokenizerStep) and s.stop_string is None for s in steps)
    assert all("\ufffd" not in s.new_text for s in steps)
    tail = detok.flush()
    assert "".join(s.new_text for s in steps) + tail == _tok.decode(ids, skip_special_tokens=True)
    assert detok.text == text and detok.stop_string is None


def test_the_test_text_really_splits_characters(_tok):
    """Guard: the emoji / CJK text has tokens that decode to half a character."""
    assert any("\ufffd" in _tok.decode([t]) for t in _tok.encode(TEXTS[0]))


def test_text_grows_only_when_a_character_is_complete(_tok):
    ids = _tok.encode(TEXTS[0])
    detok = IncrementalDetokenizer(_tok, [])
    for n in range(1, len(ids) + 1):
        detok.add_tokens(ids[n - 1 : n])
        reference = _tok.decode(ids[:n])
        if "\ufffd" in reference:  # the last token(s) end mid-character: held back
            assert reference.startswith(detok.text) and "\ufffd" not in detok.text
            assert len(detok.text) >= len(_tok.decode(ids[: n - 4]).split("\ufffd")[0])
        else:
            assert detok.text == reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_equals_decode_in_random_chunks(_tok, seed):
    rng = random.Random(seed)
    ids = _tok.encode(" ".join(TEXTS))
    detok, steps = stream(_tok, ids, chunk_sizes=[rng.randint(1, 7) for _ in ids])
    assert "".join(s.new_text for s in steps) + detok.flush() == _tok.decode(ids)


def test_special_tokens_follow_skip_flag(_tok):
    ids = _tok.encode("Sure, here it is.") + [_tok.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        detok, steps = stream(_tok, ids, skip_special_tokens=skip)
        text = "".join(s.new_text for s in steps) + detok.flush()
        assert text == _tok.decode(ids, skip_special_tokens=skip)
        assert text.endswith("<|im_end|>") is not skip


def test_first_token_keeps_its_leading_space(_tok):
    ids = _tok.encode(" leading space")
    detok, steps = stream(_tok, ids)
    assert steps[0].new_text == " leading"


def test_metaspace_tokenizer_keeps_spaces_from_context():
    """A SentencePiece-style decoder strips the first token's leading space; the
    prompt context and the sliding prefix window keep every space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581again": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tok.decode([2]) == "world"  # alone: leading space stripped
    detok = IncrementalDetokenizer(tok, [1])
    steps = [detok.add_tokens([t]).new_text for t in (2, 3, 4)]
    assert steps == [" world", "!", " again"]
    assert tok.decode([1, 2, 3, 4]) == "Hello" + "".join(steps)


def test_stop_string_across_token_boundary_truncates(_tok):
    text = TEXTS[3] + " Then the fox ran."
    ids = _tok.encode(text)
    stop = "fox jum"
    assert not any(stop in _tok.decode([t]) for t in ids)  # spans tokens
    detok, steps = stream(_tok, ids, stop=[stop])
    matched = [i for i, s in enumerate(steps) if s.stop_string is not None]
    assert len(matched) == 1 and steps[matched[0]].stop_string == stop
    assert all(s.new_text == "" for s in steps[matched[0] + 1 :])
    assert "".join(s.new_text for s in steps) == "The quick brown "
    assert detok.text == "The quick brown " and detok.stop_string == stop
    assert detok.add_tokens(_tok.encode(" more")) == DetokenizerStep("", None)
    assert detok.flush() == ""


def test_earliest_stop_string_wins(_tok):
    ids = _tok.encode(TEXTS[3])
    detok, steps = stream(_tok, ids, stop=["lazy", "quick", "brown fox"], chunk_sizes=[len(ids)])
    assert steps == [DetokenizerStep("The ", "quick")]


def test_stop_at_the_very_start(_tok):
    detok, steps = stream(_tok, _tok.encode("Hello there"), stop=["Hello"])
    assert steps[0] == DetokenizerStep("", "Hello")
    assert detok.text == ""


def test_multibyte_stop_string(_tok):
    text = "Smile 😀 then 🎉 party"
    ids = _tok.encode(text)
    detok, steps = stream(_tok, ids, stop=["🎉"])
    assert "".join(s.new_text for s in steps) == "Smile 😀 then "
    assert detok.stop_string == "🎉"


def test_holds_back_possible_stop_prefix_and_releases_it(_tok):
    text = "The lazy dog, the lazy cow, and the lazy ca"
    stops = ("lazy cat", ", and X")
    ids = _tok.encode(text)
    detok = IncrementalDetokenizer(_tok, [], stop=stops)
    for n in range(1, len(ids) + 1):
        step = detok.add_tokens(ids[n - 1 : n])
        assert step.stop_string is None
        so_far = _tok.decode(ids[:n])
        assert so_far.startswith(detok.text)
        held = so_far[len(detok.text) :]
        # exactly the longest tail of the text that could still start a stop string
        longest = max((k for k in range(1, len(so_far) + 1) for s in stops
                       if k < len(s) and s.startswith(so_far[-k:])), default=0)
        assert len(held) == longest
    assert detok.text == "The lazy dog, the lazy cow, and the "
    assert detok.flush() == "lazy ca"
    assert detok.text == text and detok.stop_string is None


def test_incomplete_last_character_is_flushed_as_decode_shows_it(_tok):
    ids = _tok.encode("ok 😀")[:-1]  # drop the emoji's last byte-token
    decoded = _tok.decode(ids)
    assert decoded.endswith("\ufffd")
    detok, steps = stream(_tok, ids)
    assert detok.text == "ok"
    assert "".join(s.new_text for s in steps) + detok.flush() == decoded


class RecordingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decodes_only_a_small_window(_tok):
    ids = _tok.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 400
    spy = RecordingTokenizer(_tok)
    detok = IncrementalDetokenizer(spy, _tok.encode(PROMPT), stop=["never appears"])
    for t in ids:
        detok.add_tokens([t])
    assert detok.text + detok.flush() == _tok.decode(ids)
    assert max(spy.lengths) <= PROMPT_CONTEXT_TOKENS + 8


def test_longest_stop_prefix_suffix_matches_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 3)))
        want = max((k for k in range(1, len(text) + 1) for s in stops
                    if k < len(s) and s.startswith(text[-k:])), default=0)
        assert _longest_stop_prefix_suffix(text, stops) == want, (text, stops)

"""The router's torch-free tokenizer must give the same ids and text as the
transformers tokenizer the engine uses, and importing the router must not pull in
torch or splitserve.engine."""

import subprocess
import sys

import pytest

from splitserve.common.detokenizer import IncrementalDetokenizer
from splitserve.router.tokenizer import RouterTokenizer

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n\nnew lines", "naïve café 日本語 🤖🎨",
         "<|im_start|>user\nspecial tokens inside<|im_end|>", "", "x" * 500]
CHATS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本語で?"}],
]


@pytest.fixture(scope="module")
def router_tok(bundled_dir):
    return RouterTokenizer(bundled_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(router_tok, tokenizer, text):
    assert router_tok.encode(text) == tokenizer(text)["input_ids"]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_engine(router_tok, tokenizer, messages):
    from splitserve.engine.llm import render_chat

    assert router_tok.render_chat(messages) == render_chat(tokenizer, messages)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_and_detokenizer_match_transformers(router_tok, tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    for skip in (True, False):
        assert router_tok.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    prompt = tokenizer("Say:")["input_ids"]
    ours, theirs = IncrementalDetokenizer(router_tok, prompt), IncrementalDetokenizer(tokenizer, prompt)
    for i in range(0, len(ids), 3):  # 3 tokens per step: steps that split characters
        assert ours.add_tokens(ids[i:i + 3]) == theirs.add_tokens(ids[i:i + 3])
    assert ours.flush() == theirs.flush()


def test_context_length_from_config(router_tok, bundled_dir):
    assert router_tok.max_model_len == 8192
    assert RouterTokenizer(bundled_dir, max_model_len=512).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len"):
        RouterTokenizer(bundled_dir, max_model_len=131072)  # beyond the model's context
    # simulated nodes standing for a longer-context model: allowed when asked for
    assert RouterTokenizer(bundled_dir, max_model_len=131072, allow_long=True).max_model_len == 131072


def test_missing_model_dir_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="model_dir"):
        RouterTokenizer(tmp_path)


def test_router_does_not_import_torch():
    code = ("import sys; import splitserve.router.app; "
            "bad = [m for m in sys.modules if m == 'torch' or m == 'splitserve.engine' "
            "or m.startswith('splitserve.engine.') or m == 'transformers']; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr

"""The router's view of the model: tokenizer, chat template and context length,
read from the model folder (tokenizer.json, tokenizer_config.json,
chat_template.jinja, config.json). The context comes from common/hf_config.py, which
the nodes' config adapters read too, so a sliding-window cap is the same here as on the
nodes; the router never reads the engine's config (a family only the nodes know, added
through the engine's family registry, serves here like any other).

Owns text <-> token ids for the whole cluster (nodes speak token ids only).
Must not import torch or transformers (``AutoTokenizer`` pulls torch in): it uses
the `tokenizers` library and renders the chat template with jinja2 the way
transformers' ``apply_chat_template`` does (trim_blocks, lstrip_blocks, sandboxed).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..common.errors import InvalidRequest
from ..common.hf_config import read_config_json, usable_context

log = logging.getLogger(__name__)


class RouterTokenizer:
    """Tokenizes prompts, renders chats, decodes ids. Satisfies the detokenizer's
    `TokenDecoder` protocol (``decode(ids, skip_special_tokens=,
    clean_up_tokenization_spaces=)``)."""

    def __init__(self, model_dir: str | Path, max_model_len: int | None = None,
                 allow_long: bool = False):
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(
                f"model_dir: {model_dir} has no tokenizer.json; pass the model folder with "
                "--model, or convert the bundled model (python -m splitserve.engine.models.convert)")
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        model_cfg = read_config_json(model_dir)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), model_cfg["vocab_size"])
        context = usable_context(model_cfg)  # as the nodes cap it
        if max_model_len is not None and max_model_len > context and allow_long:
            log.warning("router: max_model_len %d is beyond %s's context of %d tokens "
                        "(--allow-long-max-model-len)", max_model_len, model_dir, context)
        elif max_model_len is not None and max_model_len > context:
            raise ValueError(f"max_model_len: {max_model_len} exceeds the model's usable context of "
                             f"{context} tokens ({model_dir}/config.json); pass at most {context}")
        self.max_model_len = context if max_model_len is None else max_model_len
        self._special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token")}
        self._template, self.renders_tools = _load_template(model_dir, tok_cfg)

    # -- text <-> ids ----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a completion prompt (by default with the tokenizer's own special tokens,
        as ``tokenizer(text)`` does). Releases the GIL while it runs (see ``_encode``)."""
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: tokenizers' encode holds the GIL for the whole call
        # (~0.7 s for 100k tokens), so a long prompt tokenized on a worker thread would
        # still stall the event loop; encode_batch releases it (same ids).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ``token_ids``. Spaces are never cleaned up (the byte-level BPE
        models served here do not; the detokenizer passes False)."""
        assert not clean_up_tokenization_spaces, "clean-up of tokenization spaces is not supported"
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (may show U+FFFD for part of a character)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entries of ``token_ids`` (``convert_ids_to_tokens``: byte-level
        BPE shows a leading space as "Ġ")."""
        return [self._tok.id_to_token(i) or "" for i in token_ids]

    # -- chat ------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Ids of a conversation through the chat template, by default ready for the reply.
        ``messages`` are ``{"role", "content"}`` dicts with string content;
        ``add_special_tokens`` adds the tokenizer's own (BOS) on top of the template's;
        ``tools`` (OpenAI tool dicts) are passed to the template (see `renders_tools`);
        ``template_kwargs`` (vLLM's ``chat_template_kwargs``) are more template variables."""
        if self._template is None:
            raise InvalidRequest("messages", "this model has no chat template; "
                                 "use /v1/completions with a prompt")
        variables = {**(template_kwargs or {}), **self._special}
        taken = sorted(set(template_kwargs or ()) & {*self._special, "messages", "tools",
                                                     "add_generation_prompt"})
        if taken:
            raise InvalidRequest(f"chat_template_kwargs.{taken[0]}", "set by the server; leave it out")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **variables)
        except jinja2.TemplateError as e:  # includes raise_exception() from the template
            raise InvalidRequest("messages", f"the chat template rejected the messages: {e}") from e
        return self._encode(text, add_special_tokens)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _load_template(model_dir: Path, tok_cfg: dict) -> tuple[jinja2.Template | None, bool]:
    """The chat template, and whether it renders ``tools`` (it mentions them)."""
    source = None
    if (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text()
    elif isinstance(tok_cfg.get("chat_template"), str):
        source = tok_cfg["chat_template"]
    if source is None:
        return None, False

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value, indent=None):
        return json.dumps(value, indent=indent, ensure_ascii=False)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source), "tools" in source

"""What a benchmark sends: a list of `RequestSpec`, built from a dataset name.

    random           random token ids, lengths uniform around --random-input-len/-output-len
    shared-prefix    --num-tenants tenants; each request is its tenant's fixed
                     --prefix-len tokens + a random suffix of --random-input-len tokens
                     (vLLM's prefix-repetition, under its name too)
    sharegpt:PATH    a ShareGPT-format JSON file: the first human turn is the prompt, the
                     reply's token count the output length
    custom:PATH      a JSONL file, one {"prompt": str} a line (vLLM's custom dataset);
                     --custom-output-len tokens each
    trace:PATH       a routing trace in the replay's format (``common/trace.py``: each hash
                     id expands to the same token block, so ``splitserve bench`` and
                     ``splitserve replay`` send the same prompts), on its own timestamps

Everything is deterministic given the seed. Token-id prompts are sent as token
arrays to /v1/completions. When text is sent instead (``send_text``, or chat), the
ids become text that re-encodes to the requested count (`exact_text`): the decoded
text of random ids does not (about 5% more tokens with the bundled tokenizer: tokens
merge and split differently at their seams).
Must not do I/O other than reading the dataset file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple, Protocol

from splitserve.common.jsonl import read_jsonl
from splitserve.common.trace import load_trace, prompt_tokens

from .config import BenchConfig

DEFAULT_NUM_PROMPTS = 100
LOWEST_TOKEN_ID = 100  # random prompts avoid the special tokens at the start of the vocabulary
# ShareGPT filter (the usual one): drop tiny turns and what a 2048-token context cannot hold
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class RequestSpec(NamedTuple):
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens as built (the endpoint's usage gives what it counted)
    output_len: int  # max_tokens
    tag: str = ""  # a class of requests, summarized apart (e.g. "short", "long")
    timestamp_s: float | None = None  # when to send it, from the start (traces)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of the model folder ``path``; None: the bundled model's."""
    from splitserve.router.tokenizer import RouterTokenizer

    return RouterTokenizer(path or bundled_tokenizer_dir())


def bundled_tokenizer_dir() -> Path:
    """The folder holding the bundled model's tokenizer.json."""
    from splitserve.common.bundled import converted_dir
    path = Path(converted_dir())
    if not (path / "tokenizer.json").is_file():
        from splitserve.engine.models.convert import bundled_model_dir
        path = Path(bundled_model_dir())
    return path


def load_dataset(cfg: BenchConfig, tok: Tokenizer) -> list[RequestSpec]:
    specs = _load(cfg, tok)
    if cfg.send_text or cfg.endpoint_type == "chat":
        rng = random.Random(cfg.seed + 1)  # its own stream: the ids built above stay the same
        specs = [s if isinstance(s.prompt, str) else
                 s._replace(**exact_text(rng, tok, s.prompt)._asdict()) for s in specs]
    return specs


def _load(cfg: BenchConfig, tok: Tokenizer) -> list[RequestSpec]:
    name, _, path = cfg.dataset.partition(":")
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts
    if name == "random":
        return random_specs(rng, tok, n or DEFAULT_NUM_PROMPTS, cfg.random_input_len,
                            cfg.random_output_len, cfg.random_range_ratio)
    if name in ("shared-prefix", "prefix-repetition"):
        return shared_prefix_specs(rng, tok, n or DEFAULT_NUM_PROMPTS, cfg.num_tenants,
                                   cfg.prefix_len, cfg.random_input_len, cfg.random_output_len)
    if name == "sharegpt" and path:
        return sharegpt_specs(rng, tok, Path(path), n or DEFAULT_NUM_PROMPTS, cfg.sharegpt_output_len)
    if name == "custom" and path:
        return custom_specs(Path(path), n, cfg.custom_output_len, tok)
    if name == "trace" and path:
        return trace_specs(Path(path), tok.vocab_size, n, cfg.trace_time_scale)
    raise ValueError(f"--dataset: unknown {cfg.dataset!r}; use random, shared-prefix "
                     "(prefix-repetition), sharegpt:PATH, custom:PATH or trace:PATH")


class TextPrompt(NamedTuple):
    prompt: str
    prompt_len: int  # tokens the text encodes to, as the endpoint counts them


EXACT_TEXT_TRIES = 10  # re-encodings before settling for the closest text


def exact_text(rng: random.Random, tok: Tokenizer, ids: list[int]) -> TextPrompt:
    """Text that encodes to ``len(ids)`` tokens. Decoding ids and encoding the text gives
    other ids (BPE merges across the seams between random tokens), usually a few more;
    so cut the re-encoded ids to the target or pad them with random ids and repeat until
    the count holds (as vLLM's random dataset does)."""
    target = len(ids)
    best: TextPrompt | None = None
    for _ in range(EXACT_TEXT_TRIES):
        text = tok.decode(ids)
        got = tok.encode(text)
        if best is None or abs(len(got) - target) < abs(best.prompt_len - target):
            best = TextPrompt(text, len(got))
        if len(got) == target:
            break
        ids = got[:target] if len(got) > target else got + random_tokens(rng, target - len(got), tok.vocab_size)
    assert best is not None  # EXACT_TEXT_TRIES >= 1
    return best


def custom_specs(path: Path, n: int | None, output_len: int, tok: Tokenizer) -> list[RequestSpec]:
    """One request per line of the JSONL at ``path``: ``{"prompt": str}`` (other keys ignored)."""
    specs = []
    for i, row in read_jsonl(path, dict, f"--dataset custom:{path}"):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"--dataset custom:{path}: line {i} needs a non-empty string \"prompt\"")
        specs.append(RequestSpec(row["prompt"], len(tok.encode(row["prompt"])), output_len))
        if len(specs) == n:
            break
    if not specs:
        raise ValueError(f"--dataset custom:{path}: no prompt in it")
    return specs


def trace_specs(path: Path, vocab_size: int, limit: int | None,
                time_scale: float = 1.0) -> list[RequestSpec]:
    """The first ``limit`` requests (None: all) of the routing trace at ``path`` by
    timestamp, each sent at its timestamp * ``time_scale`` after the first one's."""
    try:
        requests = load_trace(path)[:limit]
    except ValueError as e:
        raise ValueError(f"--dataset trace:{path}: {e}") from None
    t0 = requests[0].timestamp
    return [RequestSpec(prompt_tokens(r, vocab_size), r.input_length, r.output_length,
                        timestamp_s=(r.timestamp - t0) / 1000 * time_scale) for r in requests]


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(LOWEST_TOKEN_ID, vocab_size) for _ in range(n)]


def _around(rng: random.Random, length: int, ratio: float) -> int:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(lo, hi)


def random_specs(rng: random.Random, tok: Tokenizer, n: int, input_len: int, output_len: int,
                 range_ratio: float = 0.0, tag: str = "") -> list[RequestSpec]:
    specs = []
    for _ in range(n):
        ids = random_tokens(rng, _around(rng, input_len, range_ratio), tok.vocab_size)
        specs.append(RequestSpec(ids, len(ids), _around(rng, output_len, range_ratio), tag))
    return specs


def shared_prefix_specs(rng: random.Random, tok: Tokenizer, n: int, num_tenants: int,
                        prefix_len: int, suffix_len: int, output_len: int) -> list[RequestSpec]:
    if num_tenants < 1:
        raise ValueError(f"--num-tenants: must be >= 1, got {num_tenants}")
    prefixes = [random_tokens(rng, prefix_len, tok.vocab_size) for _ in range(num_tenants)]
    specs = []
    for _ in range(n):
        ids = prefixes[rng.randrange(num_tenants)] + random_tokens(rng, suffix_len, tok.vocab_size)
        specs.append(RequestSpec(ids, len(ids), output_len))
    return specs


def sharegpt_specs(rng: random.Random, tok: Tokenizer, path: Path, n: int,
                   output_len: int | None) -> list[RequestSpec]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset sharegpt:{path}: cannot read it as JSON: {e}") from e
    if not isinstance(rows, list):
        raise ValueError(f"--dataset sharegpt:{path}: expected a JSON list of conversations")
    rows = [r for r in rows if isinstance(r, dict) and len(r.get("conversations") or []) >= 2]
    rng.shuffle(rows)
    specs: list[RequestSpec] = []
    for row in rows:
        if len(specs) == n:
            break
        prompt, answer = row["conversations"][0]["value"], row["conversations"][1]["value"]
        p_len = len(tok.encode(prompt))
        o_len = output_len or len(tok.encode(answer))
        if (p_len < SHAREGPT_MIN_LEN or o_len < SHAREGPT_MIN_LEN or p_len > SHAREGPT_MAX_PROMPT
                or p_len + o_len > SHAREGPT_MAX_TOTAL):
            continue
        specs.append(RequestSpec(prompt, p_len, o_len))
    if not specs:
        raise ValueError(f"--dataset sharegpt:{path}: no conversation passed the length filter")
    return specs

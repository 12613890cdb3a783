"""The router's one frozen config, resolved from the command line before the app
starts. Must not be written back to, and must not import torch or node code."""

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from splitserve.common.bundled import BUNDLED_MODEL_ID, converted_dir as bundled_model_dir

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True, slots=True)
class CacheAwareWeights:
    """Weights of the cache_aware policy's cost (router/cache_aware.py has the formula).
    Every term is in token-equivalents: 1.0 is the time a node takes to prefill one
    prompt token, so a predicted cached token is worth at most ``cached_token`` of
    load and a prefix hit never outweighs more than the prompt's length of load."""

    cached_token: float = 1.0  # prefill work a predicted cached token saves (<= 1: no hot spots)
    prefill_request: float = 32.0  # per request prefilling or queued on a prefill node
    decode_request: float = 64.0  # per request running or waiting on a decode node
    kv_usage: float = 1024.0  # a node whose KV pool is full (scaled by the used fraction)
    transfer: float = 0.1  # per prompt token sent to a decode node that does not hold it
    # token-equivalents per (new token x context token) of attention in a prefill: the
    # fit of benchmarks/fit_timing.py here (prefill_attn_s / prefill_token_s, 1.49e-6 / 2.76e-3)
    attention: float = 5.4e-4
    # per token of prompt work recently sent to a prefill node above the mean of the prefill
    # nodes (half-life below): cache affinity accumulates work on the holders of popular
    # prefixes; this caps how far one node's share runs ahead of the others'
    balance: float = 2.0
    balance_half_life_s: float = 300.0  # conversations last minutes

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"score weight {f.name}: must be >= 0, got {getattr(self, f.name)}")
        if self.balance_half_life_s <= 0:
            raise ValueError(f"score weight balance_half_life_s: must be > 0, got {self.balance_half_life_s}")
        if self.cached_token > 1:
            raise ValueError(f"score weight cached_token: must be <= 1 (a cached token cannot save "
                             f"more than computing it), got {self.cached_token}")

    @classmethod
    def parse(cls, text: str) -> "CacheAwareWeights":
        """'prefill_request=16,transfer=0.2' -> weights (the rest default)."""
        names = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(f"score weights: expected name=value with name in "
                                 f"{', '.join(sorted(names))}, got {item!r}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"score weight {name}: not a number: {value!r}") from None
        return cls(**values)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Model folder (tokenizer.json, config.json, chat template), as the nodes' --model.
    # None or BUNDLED_MODEL_ID: the converted bundled model.
    model: str | None = None
    # Names clients may give as "model" (vLLM's --served-model-name). The first is reported
    # in responses and /v1/models, labels the metrics, is the model id nodes register under
    # and an extra key of every block hash. Empty: resolved to (model or BUNDLED_MODEL_ID,).
    served_model_names: tuple[str, ...] = ()
    max_model_len: int | None = None  # None: the model's usable context (ModelConfig)
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413
    policy: str = "cache_aware"
    weights: CacheAwareWeights = field(default_factory=CacheAwareWeights)  # cache_aware only
    # Tokens per KV block; must equal the nodes' --block-size or no prefix hit is ever found.
    block_size: int = 16
    poll_interval_s: float = 0.5  # how often the node list is re-read from Redis
    # A prefix-index lookup slower than this is abandoned (routing falls back to load only),
    # and after a failed one the index is left alone this long, so a Redis outage costs
    # requests at most one timeout per retry period.
    index_timeout_s: float = 0.25
    index_retry_s: float = 1.0
    # Longest silence between two frames of a node's token stream before the
    # request is failed (a hung node must not hang the client forever).
    node_read_timeout_s: float = 300.0
    node_connect_timeout_s: float = 2.0

    def __post_init__(self):
        names = tuple(self.served_model_names) or (self.model or BUNDLED_MODEL_ID,)
        if any(not isinstance(n, str) or not n.strip() for n in names):
            raise ValueError(f"served_model_name: names must be non-empty, got {list(names)}")
        object.__setattr__(self, "served_model_names", names)  # resolved before anyone reads it
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        for name in ("poll_interval_s", "node_read_timeout_s", "node_connect_timeout_s",
                     "index_timeout_s", "index_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")

    @property
    def model_id(self) -> str:
        """The primary served name: what nodes register under and block hashes carry."""
        return self.served_model_names[0]

    @property
    def resolved_model_dir(self) -> Path:
        if self.model is None or self.model == BUNDLED_MODEL_ID:
            return bundled_model_dir()
        return Path(self.model).expanduser()


def add_router_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    g = p.add_argument_group("router")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--redis-url", default=d.redis_url, help="node registry (default %(default)s)")
    add_model_args(g)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, capped at a sliding window)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--policy", choices=POLICIES, default=d.policy)
    g.add_argument("--score-weights", default="",
                   help="cache_aware weights as name=value,... (names: "
                        + ", ".join(f"{f.name} default {getattr(d.weights, f.name)}"
                                    for f in fields(CacheAwareWeights)) + ")")
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV block, as the nodes use (default %(default)s)")
    g.add_argument("--index-timeout", type=float, default=d.index_timeout_s,
                   help="seconds a prefix-index lookup may take before routing by load only")
    g.add_argument("--poll-interval", type=float, default=d.poll_interval_s,
                   help="seconds between reads of the node registry")
    g.add_argument("--node-read-timeout", type=float, default=d.node_read_timeout_s,
                   help="seconds a node's token stream may stay silent before the request fails")


def add_model_args(g) -> None:
    """``--model`` and ``--served-model-name`` as vLLM spells them (``splitserve up`` too)."""
    g.add_argument("--model", "--model-dir", dest="model", default=None,
                   help="model folder with tokenizer.json, config.json and the chat template, as "
                        f"the nodes' --model (default: the bundled {BUNDLED_MODEL_ID})")
    g.add_argument("--served-model-name", "--model-id", dest="served_model_name", nargs="+",
                   default=None, metavar="NAME",
                   help="names clients may request; the first is reported and labels the metrics "
                        "(default: --model as given)")


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                        model=args.model, served_model_names=tuple(args.served_model_name or ()),
                        max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes,
                        policy=args.policy, weights=CacheAwareWeights.parse(args.score_weights),
                        block_size=args.block_size, poll_interval_s=args.poll_interval,
                        node_read_timeout_s=args.node_read_timeout,
                        index_timeout_s=args.index_timeout)

"""The router's one frozen config, resolved from the command line before the app
starts. Must not be written back to, and must not import torch or node code."""

import argparse
import dataclasses
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..common.auth import (REDIS_URL_ENV, RESPONSES_REDIS_URL_ENV, add_cluster_token_args, check_secret,
                           cluster_token_from_args, redis_url_from)
from ..common.bundled import BUNDLED_MODEL_ID, converted_dir as bundled_model_dir
from ..common.config import parse_size
from .api_keys import API_KEY_ENV, ApiKey, api_keys_from_args, resolve_salts, unique_keys
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# --policy: a name of router/routing/policy_registry.py, which sits above this module (the policies
# read CacheAwareWeights) and checks the name when the app is built; a policy of one's own is a
# module named in $SPLITSERVE_ROUTING_POLICIES.
DEFAULT_POLICY = "cache_aware"
POLICIES_ENV = "SPLITSERVE_ROUTING_POLICIES"
MAX_MIGRATION_LIMIT = 16  # a request that kills this many nodes is not worth another one


@dataclass(frozen=True, slots=True)
class CacheAwareWeights:
    """Weights of the cache_aware policy's cost (router/routing/cache_aware.py has the formula).
    Every term is in token-equivalents: 1.0 is the time a node takes to prefill one
    prompt token, so a predicted cached token is worth at most ``cached_token`` of
    load and a prefix hit never outweighs more than the prompt's length of load."""

    cached_token: float = 1.0  # prefill work a predicted cached token saves (<= 1: no hot spots)
    prefill_request: float = 32.0  # per request prefilling or queued on a prefill node
    decode_request: float = 64.0  # per request running or waiting on a decode node
    kv_usage: float = 1024.0  # a node whose KV pool is full (scaled by the used fraction)
    transfer: float = 0.1  # per prompt token sent to a decode node that does not hold it
    # token-equivalents per (new token x context token) of attention in a prefill: the
    # fit of benchmarks/engine/fit_timing.py here (prefill_attn_s / prefill_token_s, 1.49e-6 / 2.76e-3)
    attention: float = 5.4e-4
    # per token of prompt work recently sent to a prefill node above the mean of the prefill
    # nodes (half-life below): cache affinity accumulates work on the holders of popular
    # prefixes; this caps how far one node's share runs ahead of the others'
    balance: float = 2.0
    balance_half_life_s: float = 300.0  # conversations last minutes
    # With router replicas (another router's work heard, router/routing/shared_work.py), recent work
    # counts once this old: every replica has heard it by then (the pub/sub delay is
    # milliseconds), so replicas deciding at the same moment weigh the same work and agree.
    balance_settle_s: float = 0.1
    # Decode-side reuse: a decode node that holds part of the prompt (a conversation's earlier
    # turns, its own answers included) prefills the rest itself, with no remote prefill, when
    # at most this many prompt tokens are not in its cache and that is cheaper than the remote
    # pair plus ``remote_prefill``, the fixed cost of the extra hop (task to the prefill node,
    # KV handshake, last block's transfer). The decode node computes them in chunks of its
    # --local-prefill-budget per step, which bounds the cost to its running batch (TPOT).
    # 0: off. benchmarks/serving/bench_multiturn.py measures it.
    local_prefill_tokens: float = 512.0
    remote_prefill: float = 128.0
    # Prefix pull (node/kv_pull.py): the node that computes a prompt first fetches the longest
    # cached prefix another node holds, paying ``transfer`` per pulled token plus
    # ``pull_request`` (the round trip to the holder and its handshake), when that is cheaper
    # than computing those tokens. 0 (--no-prefix-pull): never.
    prefix_pull: float = 1.0
    pull_request: float = 64.0
    # Seconds per token-equivalent, to report predicted TTFT in seconds in
    # /debug/decisions (0: reported in token-equivalents only). A profile's prefill
    # time per token (sim-nodes --list-profiles) is a fair value.
    token_s: float = 0.0

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
    host: str = "127.0.0.1"  # nothing is open by default; 0.0.0.0 without an API key is warned about
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = field(default=DEFAULT_REDIS_URL, repr=False)  # may hold a password
    # Model folder (tokenizer.json, config.json, chat template), as the nodes' --model.
    # None or BUNDLED_MODEL_ID: the converted bundled model.
    model: str | None = None
    # Names clients may give as "model" (vLLM's --served-model-name). The first is reported
    # in responses and /v1/models, labels the metrics, is the model id nodes register under
    # and an extra key of every block hash. Empty: resolved to (model or BUNDLED_MODEL_ID,).
    served_model_names: tuple[str, ...] = ()
    max_model_len: int | None = None  # None: the model's usable context (common/hf_config.py)
    # Accept a max_model_len beyond the tokenizer model's context (with a warning): the
    # nodes serve another model than the tokenizer's config says (simulated GPU profiles).
    allow_long_max_model_len: bool = False
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413
    # Larger bodies are parsed, validated and tokenized on a worker thread: a long prompt
    # (100k tokens: ~0.5 s to tokenize and render) then never stalls the event loop that
    # streams every other request's tokens. Smaller ones (a few ms at most) stay inline,
    # where a thread hand-off would cost more than the work.
    prepare_thread_bytes: int = 8 << 10
    policy: str = DEFAULT_POLICY  # a name of router/routing/policy_registry.py (checked by build_app)
    weights: CacheAwareWeights = field(default_factory=CacheAwareWeights)  # cache_aware only
    # Tokens per KV block; must equal the nodes' --block-size or no prefix hit is ever found.
    block_size: int = 16
    poll_interval_s: float = 0.5  # how often the node list is re-read from Redis
    # A Redis call on the prefix index (the prefix mirror's follower reads it) slower than
    # this fails: routing falls back to load only, and the follower reconnects after
    # index_retry_s. Lookups themselves never wait on Redis (they read the mirror).
    index_timeout_s: float = 0.25
    index_retry_s: float = 1.0
    # Longest silence between two frames of a node's token stream before the
    # request is failed (a hung node must not hang the client forever).
    node_read_timeout_s: float = 300.0
    node_connect_timeout_s: float = 2.0
    # Clients must send "Authorization: Bearer <one of these>" on /v1/* and /debug/*; a key's
    # cache salt isolates its requests' prefix caches (router/api_keys.py). Plain strings are
    # read as keys without a salt, and resolved to keys with one derived from the key unless
    # shared_prefix_cache. Empty: no authentication (fine on loopback; warned about anywhere else).
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    # Keys without a cache salt share the one unsalted prefix cache (off: each has its own):
    # a request's cached_tokens then tells a key what the others' prompts began with.
    shared_prefix_cache: bool = False
    protect_health: bool = False  # /health also needs an API key (off: probes stay simple)
    protect_metrics: bool = False  # /metrics also needs an API key
    # Sent to the nodes on every internal request; shows request ids on /debug/decisions
    # to callers presenting it. None: no cluster token.
    cluster_token: str | None = field(default=None, repr=False)
    # Generating requests (/v1/completions, /v1/chat/completions) being served at once,
    # body read to last byte streamed; more get a 429 with Retry-After. Each costs the
    # router little (a socket to a node, a detokenizer); the nodes queue what they accept.
    max_inflight: int = 512
    # Open client connections; more are answered 503 and closed at once. Below the
    # process's file limit, leaving room for one connection to a node per stream.
    max_connections: int = 2048
    # A request's headers must be complete within this of their first byte (a new
    # connection's first request: of its opening), and its body within body_timeout_s
    # (408): slow clients (slowloris) cannot hold connections for long.
    header_timeout_s: float = 10.0
    # An idle connection stays open this long between requests: longer than clients' own
    # idle timeouts (aiohttp 15 s, httpx and the openai client 5 s, load balancers 60 s),
    # so the client closes it first and never sends a request into a closing connection.
    keepalive_timeout_s: float = 75.0
    body_timeout_s: float = 30.0
    # SIGTERM: new requests get 503 while in-flight ones finish, for at most this long.
    drain_grace_s: float = 30.0
    retry_after_s: int = 1  # Retry-After of 429 and 503 answers
    # Structured-output compiles on the nodes, per API key (router/http/compile_budget.py): at most
    # this many requests compiling at once (until their first token), and this many a minute; more
    # get 429. A constraint the nodes it goes to hold compiled is free.
    schema_compiles_per_key: int = 1
    schema_compiles_per_key_per_minute: int = 20
    # A generation whose decode node breaks its stream moves to another decode node at most
    # this many times (router/streams/migration.py); 0: the client gets a mid-stream error instead.
    migration_limit: int = 0
    # Stored /v1/responses (router/responses/store.py) live in this Redis; None: redis_url's.
    # A Redis of their own (with maxmemory above responses_max_bytes) keeps them away from
    # the node registry and the prefix index.
    responses_redis_url: str | None = field(default=None, repr=False)
    # Their budgets, in bytes of Redis memory (UTF-8 text plus a per-entry overhead): 1 GiB
    # for all keys together, and per API key 64 MiB and 1,000 responses (an agent's hour of
    # turns, a chat user's day). A key over its quota, or over its fair share of a full
    # store, gets 429; others get 503 while the store is full; nobody's entries are evicted.
    responses_max_bytes: int = 1 << 30
    responses_key_max_bytes: int = 64 << 20
    responses_key_max_entries: int = 1000

    def __post_init__(self):
        names = tuple(self.served_model_names) or (self.model or BUNDLED_MODEL_ID,)
        if any(not isinstance(n, str) or not n.strip() for n in names):
            raise ValueError(f"served_model_name: names must be non-empty, got {list(names)}")
        object.__setattr__(self, "served_model_names", names)  # resolved before anyone reads it
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.prepare_thread_bytes < 0:
            raise ValueError(f"prepare_thread_bytes: must be >= 0, got {self.prepare_thread_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        for name in ("poll_interval_s", "node_read_timeout_s", "node_connect_timeout_s",
                     "index_timeout_s", "index_retry_s", "header_timeout_s", "keepalive_timeout_s",
                     "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        for name in ("max_inflight", "max_connections", "retry_after_s", "responses_max_bytes",
                     "responses_key_max_bytes", "responses_key_max_entries", "schema_compiles_per_key",
                     "schema_compiles_per_key_per_minute"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if type(self.migration_limit) is not int or not 0 <= self.migration_limit <= MAX_MIGRATION_LIMIT:
            raise ValueError(f"migration_limit: must be an integer in [0, {MAX_MIGRATION_LIMIT}] "
                             f"(0: off), got {self.migration_limit!r}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s: must be >= 0, got {self.drain_grace_s}")
        keys = unique_keys([ApiKey(k) if isinstance(k, str) else ApiKey(*k) for k in self.api_keys])
        for k in keys:
            check_secret("api key", k.key)
            if k.cache_salt is not None and (not isinstance(k.cache_salt, str) or not k.cache_salt):
                raise ValueError("api key cache salt: must be a non-empty string")
        if self.cluster_token is not None:
            check_secret("cluster token", self.cluster_token)
        keys = resolve_salts(keys, self.cluster_token, self.shared_prefix_cache)
        object.__setattr__(self, "api_keys", keys)  # resolved before anyone reads it
        if (self.protect_health or self.protect_metrics) and not self.api_keys:
            raise ValueError("protect_health / protect_metrics: need an API key (--api-key)")

    @property
    def responses_store_url(self) -> str:
        """The Redis of stored responses: their own, else the node registry's."""
        return self.responses_redis_url or self.redis_url

    @property
    def exposed_without_key(self) -> bool:
        """Bound beyond loopback with no API key: anyone who reaches it can generate."""
        return not self.api_keys and not _is_loopback(self.host)

    @property
    def model_id(self) -> str:
        """The primary served name: what nodes register under and block hashes carry."""
        return self.served_model_names[0]

    @property
    def resolved_model_dir(self) -> Path:
        if self.model is None or self.model == BUNDLED_MODEL_ID:
            return bundled_model_dir()
        return Path(self.model).expanduser()


def add_router_args(p: argparse.ArgumentParser, policies: Collection[str] | None = None) -> None:
    """The router's flags. ``policies``: --policy's choices (cli.py passes the policy
    registry's, read when the flag is checked); None: any name, refused by build_app."""
    d = RouterConfig()
    g = p.add_argument_group("router")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--redis-url", default=None,
                   help=f"node registry and prefix index (default: ${REDIS_URL_ENV}, else "
                        f"{DEFAULT_REDIS_URL}); a URL with a password belongs in ${REDIS_URL_ENV}: "
                        "flags show in `ps`")
    add_model_args(g)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, capped at a sliding window)")
    g.add_argument("--allow-long-max-model-len", action="store_true",
                   help="accept a --max-model-len beyond the model config's context (simulated "
                        "nodes standing for a longer-context model)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--prepare-thread-bytes", type=int, default=d.prepare_thread_bytes,
                   help="request bodies larger than this are parsed and tokenized on a worker "
                        "thread, so the event loop keeps streaming (0: every body)")
    g.add_argument("--policy", choices=policies, default=d.policy, metavar="NAME",
                   help="the routing policy" + (": %(choices)s" if policies is not None else "")
                        + f" (default %(default)s; one of your own: ${POLICIES_ENV}, see README.md)")
    g.add_argument("--score-weights", default="",
                   help="cache_aware weights as name=value,... (names: "
                        + ", ".join(f"{f.name} default {getattr(d.weights, f.name)}"
                                    for f in fields(CacheAwareWeights)) + ")")
    g.add_argument("--no-prefix-pull", action="store_true",
                   help="never have a node fetch a cached prefix from another node (cache_aware: "
                        "score weight prefix_pull=0)")
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV block, as the nodes use (default %(default)s)")
    g.add_argument("--index-timeout", type=float, default=d.index_timeout_s,
                   help="seconds a Redis call on the prefix index may take before routing by load only")
    g.add_argument("--poll-interval", type=float, default=d.poll_interval_s,
                   help="seconds between reads of the node registry")
    g.add_argument("--node-read-timeout", type=float, default=d.node_read_timeout_s,
                   help="seconds a node's token stream may stay silent before the request fails")
    g.add_argument("--migration-limit", type=int, default=d.migration_limit,
                   help="times a generation may move mid-stream to another decode node when its "
                        "node dies (0: off, the client gets an error event; default %(default)s)")
    s = p.add_argument_group("router security and admission")
    s.add_argument("--api-key", action="append", default=None, metavar="'KEY [cache_salt=SALT]'",
                   help=f"a client key for 'Authorization: Bearer <key>' on /v1/* and /debug/*, "
                        "optionally with the cache salt of its tenant (repeatable; default: "
                        f"${API_KEY_ENV}, one spec per line; none: no authentication); prefer "
                        "--api-key-file or the environment: flags show in `ps`")
    s.add_argument("--api-key-file", default=None,
                   help="file with one 'KEY [cache_salt=SALT]' per line (# comments), readable "
                        "by its owner only")
    s.add_argument("--shared-prefix-cache", action="store_true",
                   help="keys without a cache_salt share one prefix cache, so a request's cached_tokens "
                        "tells what other keys' prompts began with (default: each key its own cache)")
    s.add_argument("--protect-health", action="store_true", help="/health needs an API key too")
    s.add_argument("--protect-metrics", action="store_true", help="/metrics needs an API key too")
    add_cluster_token_args(s)
    s.add_argument("--max-inflight", type=int, default=d.max_inflight,
                   help="generating requests served at once; more get 429 (default %(default)s)")
    s.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open client connections; more get 503 (default %(default)s)")
    s.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds from a request's first byte to its last header byte "
                        "(default %(default)s)")
    s.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout_s,
                   help="seconds an idle client connection stays open between requests "
                        "(default %(default)s)")
    s.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds to receive a request's body; slower gets 408 (default %(default)s)")
    s.add_argument("--drain-grace", type=float, default=d.drain_grace_s,
                   help="on SIGTERM, seconds in-flight requests may take to finish (default "
                        "%(default)s)")
    s.add_argument("--schema-compiles-per-key", type=int, default=d.schema_compiles_per_key,
                   help="requests one API key may have compiling a structured-output constraint on "
                        "the nodes at once (until their first token); more get 429 (default %(default)s)")
    s.add_argument("--schema-compiles-per-key-per-minute", type=int, default=d.schema_compiles_per_key_per_minute,
                   help="structured-output compiles one API key may cause a minute (each on a decode "
                        "node and its prefill node; constraints the nodes hold compiled are free); more "
                        "get 429 (default %(default)s)")
    r = p.add_argument_group("router: stored /v1/responses")
    r.add_argument("--responses-redis-url", default=None,
                   help=f"a Redis of their own (default: ${RESPONSES_REDIS_URL_ENV}, else --redis-url's); "
                        f"a URL with a password belongs in ${RESPONSES_REDIS_URL_ENV}")
    r.add_argument("--responses-max-bytes", default=str(d.responses_max_bytes),
                   help="the Redis memory all stored responses may take, e.g. 1GiB (default: 1GiB)")
    r.add_argument("--responses-key-max-bytes", default=str(d.responses_key_max_bytes),
                   help="per API key: a key over it gets 429 with Retry-After (default: 64MiB)")
    r.add_argument("--responses-key-max-entries", type=int, default=d.responses_key_max_entries,
                   help="per API key: stored responses (default %(default)s)")


def add_model_args(g) -> None:
    """``--model`` and ``--served-model-name`` as vLLM spells them (``splitserve up`` too)."""
    g.add_argument("--model", "--model-dir", dest="model", default=None,
                   help="model folder with tokenizer.json, config.json and the chat template, as "
                        f"the nodes' --model (default: the bundled {BUNDLED_MODEL_ID})")
    g.add_argument("--served-model-name", "--model-id", dest="served_model_name", nargs="+",
                   default=None, metavar="NAME",
                   help="names clients may request; the first is reported and labels the metrics "
                        "(default: --model as given)")


def _weights(args: argparse.Namespace) -> CacheAwareWeights:
    weights = CacheAwareWeights.parse(args.score_weights)
    return dataclasses.replace(weights, prefix_pull=0.0) if args.no_prefix_pull else weights


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, port=args.port,
                        redis_url=redis_url_from(args.redis_url, DEFAULT_REDIS_URL) or DEFAULT_REDIS_URL,
                        model=args.model, served_model_names=tuple(args.served_model_name or ()),
                        max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes,
                        prepare_thread_bytes=args.prepare_thread_bytes,
                        allow_long_max_model_len=args.allow_long_max_model_len,
                        policy=args.policy, weights=_weights(args),
                        block_size=args.block_size, poll_interval_s=args.poll_interval,
                        node_read_timeout_s=args.node_read_timeout,
                        index_timeout_s=args.index_timeout, api_keys=api_keys_from_args(args),
                        shared_prefix_cache=args.shared_prefix_cache,
                        protect_health=args.protect_health, protect_metrics=args.protect_metrics,
                        cluster_token=cluster_token_from_args(args),
                        max_inflight=args.max_inflight, max_connections=args.max_connections,
                        header_timeout_s=args.header_timeout, keepalive_timeout_s=args.keepalive_timeout,
                        body_timeout_s=args.body_timeout,
                        drain_grace_s=args.drain_grace, migration_limit=args.migration_limit,
                        schema_compiles_per_key=args.schema_compiles_per_key,
                        schema_compiles_per_key_per_minute=args.schema_compiles_per_key_per_minute,
                        responses_redis_url=redis_url_from(args.responses_redis_url, None,
                                                           RESPONSES_REDIS_URL_ENV, "--responses-redis-url"),
                        responses_max_bytes=parse_size(args.responses_max_bytes, "--responses-max-bytes"),
                        responses_key_max_bytes=parse_size(args.responses_key_max_bytes,
                                                           "--responses-key-max-bytes"),
                        responses_key_max_entries=args.responses_key_max_entries)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

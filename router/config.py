"""The router's one frozen config, resolved from the command line before the app
starts. Must not be written back to, and must not import torch or node code."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.bundled import BUNDLED_MODEL_ID, converted_dir as bundled_model_dir

POLICIES = ("least_load", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Served model id: clients must name it; only nodes registered with it are used.
    model_id: str = BUNDLED_MODEL_ID
    # Folder with tokenizer.json, config.json and the chat template. None: the bundled model.
    model_dir: str | None = None
    max_model_len: int | None = None  # None: config.json's max_position_embeddings
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413
    policy: str = "least_load"
    poll_interval_s: float = 0.5  # how often the node list is re-read from Redis
    # Longest silence between two frames of a node's token stream before the
    # request is failed (a hung node must not hang the client forever).
    node_read_timeout_s: float = 300.0
    node_connect_timeout_s: float = 2.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        for name in ("poll_interval_s", "node_read_timeout_s", "node_connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")

    @property
    def resolved_model_dir(self) -> Path:
        return Path(self.model_dir) if self.model_dir else bundled_model_dir()


def add_router_args(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    g = p.add_argument_group("router")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--redis-url", default=d.redis_url, help="node registry (default %(default)s)")
    g.add_argument("--model-id", default=d.model_id, help="served model name (default %(default)s)")
    g.add_argument("--model-dir", default=None,
                   help="folder with tokenizer.json, config.json and the chat template "
                        "(default: the converted bundled model)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: config.json's max_position_embeddings)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--policy", choices=POLICIES, default=d.policy)
    g.add_argument("--poll-interval", type=float, default=d.poll_interval_s,
                   help="seconds between reads of the node registry")
    g.add_argument("--node-read-timeout", type=float, default=d.node_read_timeout_s,
                   help="seconds a node's token stream may stay silent before the request fails")


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, port=args.port, redis_url=args.redis_url,
                        model_id=args.model_id, model_dir=args.model_dir,
                        max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes,
                        policy=args.policy, poll_interval_s=args.poll_interval,
                        node_read_timeout_s=args.node_read_timeout)

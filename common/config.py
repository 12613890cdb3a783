"""Frozen process configs. Each process builds one, resolved from its command
line, before it starts, and passes it down; nothing writes back to it."""

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'512MiB', '2GiB', '1.5GB', '1048576' -> bytes (K/M/G/T are binary with or without i)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"kv_cache_memory: cannot parse size {text!r}; use e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs. ``model=None`` means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    # Served model name; also an extra key of every block hash, so two models never share blocks.
    model_id: str = "SmolLM2-135M-Instruct"
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool; the engine reports the tokens it holds
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # token budget per step (decodes + prefill chunks)
    prefill_chunk_size: int = 512  # most prompt tokens one request computes per step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # "auto": float32 on CPU (bf16 is ~6x slower there without AVX-512), bfloat16 on a GPU
    dtype: str = "auto"
    device: str = "cpu"
    # "auto": CUDA kernels, else Triton, else the torch reference (always torch on CPU)
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0  # seeds the shared generator of unseeded sampled requests

    def __post_init__(self):
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        on_cpu = self.device.split(":")[0] == "cpu"
        if self.dtype == "auto":  # resolved here, before anyone reads it
            object.__setattr__(self, "dtype", "float32" if on_cpu else "bfloat16")
        if self.attention_backend not in ("auto", "cuda", "triton", "torch"):
            raise ValueError(f"attention_backend: must be auto, cuda, triton or torch, got {self.attention_backend!r}")
        if on_cpu and self.attention_backend in ("cuda", "triton"):
            raise ValueError(f"attention_backend: {self.attention_backend!r} needs a CUDA device, device is "
                             f"{self.device!r}; use auto or torch, or --device cuda")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A prefill, decode or colocated node process."""

    role: str  # "prefill" | "decode" | "colocated" (a decode node that never asks a prefill node)
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    redis_url: str | None = None  # None: not registered (tests, single-node use)
    node_id: str = ""  # "" : derived from role and port
    kv_backend: str = "tcp"  # "tcp" | "shm" | "ucx": how KV blocks travel to decode nodes
    transfer_lease_s: float = 30.0  # a transfer not complete by then fails and falls back
    fault: str | None = None  # fault injection for tests: "corrupt_block"

    def __post_init__(self):
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role: must be prefill, decode or colocated, got {self.role!r}")
        if self.kv_backend not in ("tcp", "shm", "ucx"):
            raise ValueError(f"kv_backend: must be tcp, shm or ucx, got {self.kv_backend!r}")

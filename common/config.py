"""Frozen process configs. Each process builds one, resolved from its command
line, before it starts, and passes it down; nothing writes back to it."""

import json
import re
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Literal, Protocol
from pathlib import Path

from .bundled import BUNDLED_MODEL_ID
from .kv_backends import DEFAULT_BACKEND, KVBackendSpec, alternatives, backend_spec


NodeRole = Literal["prefill", "decode", "colocated"]


class Fault(StrEnum):
    """A node's injected fault, for tests only (``--fault``, hidden from ``--help``)."""
    CORRUPT_BLOCK = "corrupt_block"  # every KV block it sends fails its checksum (kvtransfer)
    STALL_PULL = "stall_pull"  # every pull it serves is held back (node/pull_holder.py)
    STALL_PULL_MIDWAY = "stall_pull_midway"  # a pull's first chunk is sent, then the rest held back
    STEP_ERROR = "step_error"  # its engine's step raises, twice (engine/step_fault.py)


# How the engine gets its weights (engine.loader): auto and safetensors read the folder's
# checkpoint; dummy draws seeded random weights from its config.json alone (benchmarks).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int, field: str = "kv_cache_memory") -> int:
    """'512MiB', '2GiB', '1.5GB', '1048576' -> bytes (K/M/G/T are binary with or without i);
    ``field`` names the setting in the error."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{field}: cannot parse size {text!r}; use e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


class StepTimeModel(Protocol):
    """A simulated step's time from its shape, in place of the fitted terms (``SimConfig.roofline``:
    a GPU profile's roofline, deploy/planner/roofline.py ``Roofline``)."""

    def step_seconds(self, decode_batch: int, decode_context: int, chunks: list[tuple[int, int]]) -> float: ...


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A simulated forward pass (``EngineConfig.sim``): the engine schedules, caches and
    frees blocks for real and sleeps as long as the real model would take for the step.

    Step time, in seconds (one step = the decode rows D plus the prefill chunks, each
    chunk computing n tokens after ctx tokens already in the cache)::

        t = step_s + prefill_token_s * sum(n) + prefill_attn_s * sum(n * (ctx + n / 2))
              + decode_s(D)     (linear between the measured batch sizes, 0 when D = 0)

    or, with ``roofline`` (a GPU profile, deploy/planner/sim_profiles.py), the roofline's
    step time (deploy/planner/roofline.py), which also sees the decode rows' context.
    ``max_model_len``, ``kv_bytes_per_token`` and ``num_layers`` (0: the model folder's own)
    make a simulated node stand for the profile's model: its context, its KV cache size and
    the layers a lower-tier load overlaps the forward by (engine/sim_runner.py).
    ``kv_network_bytes_per_s`` (0: not modelled) and ``kv_network_latency_s`` are the
    network a simulated prefill node's KV leaves over (``transfer_seconds``; node/sim_link.py
    holds a request's answer until its blocks would have crossed it). ``host_bytes_per_s``
    and ``disk_read_bytes_per_s`` (0: not modelled) price the moves of the prefix cache's
    lower tiers (engine/sim_runner.py adds them to the step that follows them).

    The defaults are the fit of ``benchmarks/engine/fit_timing.py`` to the real engine on the
    development machine (bundled model, fp32, 1 thread); the script writes the same
    fields as JSON for ``load``. ``speedup`` divides every sleep, so a replay can run
    trace time faster than real time.
    """

    step_s: float = 0.079
    prefill_token_s: float = 0.00276
    prefill_attn_s: float = 1.49e-6
    # (decode batch size, seconds added to a step), ascending by batch size
    decode_s: tuple[tuple[int, float], ...] = ((1, 0.010), (4, 0.054), (16, 0.138), (32, 0.294), (64, 0.613))
    speedup: float = 1.0
    roofline: StepTimeModel | None = None
    max_model_len: int = 0  # 0: the model folder's max_position_embeddings
    kv_bytes_per_token: int = 0  # 0: the model folder's own (the KV cache holds as many tokens as it would)
    kv_network_bytes_per_s: float = 0.0  # 0: a transfer takes what this machine's transport takes
    kv_network_latency_s: float = 0.0
    host_bytes_per_s: float = 0.0  # host memory <-> the KV cache, each direction; 0: a move is not priced
    disk_read_bytes_per_s: float = 0.0  # disk -> host memory; 0: a load from disk is not priced
    num_layers: int = 0  # the modelled model's (lower-tier loads overlap a forward layer by layer); 0: the folder's

    def __post_init__(self):
        for name in ("step_s", "prefill_token_s", "prefill_attn_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"sim {name}: must be >= 0, got {getattr(self, name)}")
        if self.speedup <= 0:
            raise ValueError(f"sim speedup: must be > 0, got {self.speedup}")
        if self.max_model_len < 0 or self.kv_bytes_per_token < 0 or self.num_layers < 0:
            raise ValueError("sim max_model_len, kv_bytes_per_token and num_layers: must be >= 0")
        for name in ("kv_network_bytes_per_s", "kv_network_latency_s", "host_bytes_per_s", "disk_read_bytes_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"sim {name}: must be >= 0, got {getattr(self, name)}")
        for name in ("kv_network_bytes_per_s", "host_bytes_per_s", "disk_read_bytes_per_s"):
            if getattr(self, name) and not self.kv_bytes_per_token:
                raise ValueError(f"sim {name}: prices the modelled model's blocks; give kv_bytes_per_token too")
        batches = [b for b, _ in self.decode_s]
        if not batches or batches != sorted(set(batches)) or batches[0] < 1 or any(s < 0 for _, s in self.decode_s):
            raise ValueError("sim decode_s: needs (batch, seconds) pairs, batch >= 1 ascending, seconds >= 0")

    @classmethod
    def load(cls, path: str | Path | None, speedup: float = 1.0) -> "SimConfig":
        """The fitted timing in ``path`` (JSON written by benchmarks/engine/fit_timing.py), or the
        built-in defaults when ``path`` is None."""
        if path is None:
            return cls(speedup=speedup)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"sim timing: cannot read {path}: {e}") from None
        known = {f.name for f in fields(cls)} - {"speedup"}
        values = {k: v for k, v in data.items() if k in known}
        if "decode_s" in values:
            values["decode_s"] = tuple((int(b), float(s)) for b, s in values["decode_s"])
        return cls(**values, speedup=speedup)

    def step_seconds(self, decode_batch: int, chunks: list[tuple[int, int]],
                     decode_context: int = 0) -> float:
        """Simulated seconds of one step (before ``speedup``); ``chunks``: (n, ctx) pairs;
        ``decode_context``: the decode rows' context tokens, summed."""
        if self.roofline is not None:
            return self.roofline.step_seconds(decode_batch, decode_context, chunks)
        t = self.step_s
        for n, ctx in chunks:
            t += self.prefill_token_s * n + self.prefill_attn_s * n * (ctx + n / 2)
        if decode_batch:
            t += self._decode(decode_batch)
        return t

    def transfer_seconds(self, blocks: int, block_size: int) -> float:
        """Simulated seconds (before ``speedup``) to move ``blocks`` KV blocks of the modelled
        model over the KV network, on an idle link, latency excluded; 0.0 when not modelled."""
        if not self.kv_network_bytes_per_s:
            return 0.0
        return blocks * block_size * self.kv_bytes_per_token / self.kv_network_bytes_per_s

    def _decode(self, batch: int) -> float:
        pts = self.decode_s
        if batch <= pts[0][0]:
            return pts[0][1] * batch / pts[0][0]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2] if len(pts) > 1 else (0, 0.0), pts[-1]
        return s1 + (s1 - s0) / (b1 - b0) * (batch - b1)  # beyond the table: the last slope


# A decode node's prompt tokens per step for the prompts it prefills itself, by default.
DEFAULT_LOCAL_PREFILL_BUDGET = 512


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs. ``model=None`` means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    load_format: str = "auto"  # one of LOAD_FORMATS
    # Served model name; also an extra key of every block hash, so two models never share blocks.
    model_id: str = BUNDLED_MODEL_ID
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache; the engine reports the tokens it holds
    # CUDA only: the fraction of the device's total memory this process may use; the KV cache
    # gets what is left of it after the weights and a profiled activation peak (engine/kv/sizing.py).
    # None: the KV cache is kv_cache_memory bytes.
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # token budget per step (decodes + prefill chunks)
    prefill_chunk_size: int = 512  # most prompt tokens one request computes per step
    # Most prompt tokens one step computes over all its prefill rows (prompt chunks, recomputes;
    # engine/scheduler.py), so a running decode batch's step never grows past its decodes plus
    # this; >= 1 and at most max_num_batched_tokens - max_num_seqs (room for every decode beside
    # it), None: max_num_batched_tokens alone. A decode node's --local-prefill-budget (its
    # default: DEFAULT_LOCAL_PREFILL_BUDGET where the step has the room).
    prefill_step_budget: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # "auto": float32 on CPU (bf16 is ~6x slower there without AVX-512), bfloat16 on a GPU
    dtype: str = "auto"
    device: str = "cpu"
    # "auto": CUDA kernels, else Triton, else the torch reference (always torch on CPU)
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0  # seeds the shared generator of unseeded sampled requests
    # Decode-only steps run a padded, fixed-shape forward per batch-size bucket (captured
    # as a CUDA graph on a GPU); True runs every step eagerly at its exact shape.
    enforce_eager: bool = False
    # Decode batch-size buckets; None: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (as vLLM)
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Schedule and launch step N+1 before waiting for step N's tokens (engine_core.py).
    # None: on for a GPU; on the CPU the forward runs on the host, so nothing would overlap.
    async_scheduling: bool | None = None
    # Simulated node: timing model in place of the forward pass (no weights are loaded;
    # the model's config.json still gives vocab, context and the KV block size).
    sim: SimConfig | None = None
    # Ranks (one process and one device each) the model is sharded over, Megatron-style
    # (engine/models/sharding.py); checked against the model's heads and sizes when it is loaded.
    # kv_cache_memory and gpu_memory_utilization are per rank: each rank's KV cache holds
    # its KV heads of every block, so more ranks hold more blocks.
    tensor_parallel_size: int = 1
    # A MoE model's experts split whole over the tensor-parallel ranks (each holds E / N of
    # them; engine/models/moe.py) instead of every expert cut by columns; attention stays
    # tensor-parallel. Refused for a dense model; a no-op at tensor_parallel_size 1. The KV
    # layout is the attention's, so a node's EP never has to match its KV peers'.
    enable_expert_parallel: bool = False
    # Data-parallel attention (engine/ranks/data_parallel.py): this engine is rank
    # data_parallel_rank of data_parallel_size ranks of one MoE node; each rank has its own
    # requests, scheduler and KV pool, and the ranks share the MoE layers (each holds E / N
    # experts). Rank 0 hosts their rendezvous at data_parallel_address (host:port; the ranks
    # share a host). The ranks step in lockstep: no async scheduling, no static decode buckets.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_address: str | None = None
    # Lower tiers of the prefix cache (engine/kv/tier_store.py): bytes of host memory that hold
    # blocks evicted from the KV cache (0: none; pinned on CUDA), and a folder whose files
    # hold blocks evicted from host memory, at most kv_offload_disk_bytes of them (None: no
    # disk tier). A disk tier needs a host tier: blocks pass through it.
    kv_offload_memory: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0

    def __post_init__(self):
        if self.kv_offload_memory < 0 or self.kv_offload_disk_bytes < 0:
            raise ValueError("kv_offload_memory: must be >= 0" if self.kv_offload_memory < 0
                             else "kv_offload_disk_bytes: must be >= 0")
        if self.kv_offload_dir is not None and (not self.kv_offload_memory or not self.kv_offload_disk_bytes):
            raise ValueError("kv_offload_dir: a disk tier needs kv_offload_memory (blocks reach the disk "
                             "through host memory) and kv_offload_disk_bytes (its size)")
        if self.kv_offload_disk_bytes and self.kv_offload_dir is None:
            raise ValueError("kv_offload_disk_bytes: sizes the disk tier; give kv_offload_dir too")
        if self.kv_offload_memory and not self.enable_prefix_caching:
            raise ValueError("kv_offload_memory: the tiers hold prefix-cache blocks; prefix caching is off")
        if self.kv_offload_memory and self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_memory: KV tiers are not built for tensor-parallel nodes yet "
                             "(each rank would offload its own heads); use tensor_parallel_size 1")
        if self.data_parallel_size > 1:
            if self.tensor_parallel_size > 1:
                raise ValueError("data_parallel_size: a data-parallel rank runs tensor_parallel_size 1 "
                                 "(attention data-parallel, experts split over the DP ranks)")
            if not 0 <= self.data_parallel_rank < self.data_parallel_size:
                raise ValueError(f"data_parallel_rank: must be in [0, {self.data_parallel_size}), "
                                 f"got {self.data_parallel_rank}")
            if not self.data_parallel_address or ":" not in self.data_parallel_address:
                raise ValueError("data_parallel_address: give host:port of rank 0's rendezvous")
            if self.sim is not None:
                raise ValueError("data_parallel_size: a simulated node stands for its parallelism in its timing")
            object.__setattr__(self, "async_scheduling", False)  # lockstep: one forward per turn
            object.__setattr__(self, "enforce_eager", True)  # each rank's exact shape; no captured sizes
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_chunk_size", "tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.prefill_step_budget is not None and self.prefill_step_budget < 1:
            raise ValueError(f"prefill_step_budget: must be >= 1 (None: no limit), got {self.prefill_step_budget}")
        if self.prefill_step_budget is not None and \
                self.prefill_step_budget + self.max_num_seqs > self.max_num_batched_tokens:
            # running rows come first: a whole budget's chunk ahead of max_num_seqs decodes
            # would leave some decodes no token of the step (engine/scheduler.py)
            b, s, t = self.prefill_step_budget, self.max_num_seqs, self.max_num_batched_tokens
            raise ValueError(f"prefill_step_budget (--local-prefill-budget) {b} + max_num_seqs (--max-num-seqs) {s} "
                             f"= {b + s} is over max_num_batched_tokens (--max-num-batched-tokens) {t}: a step "
                             f"would have no room for every decode beside a full prefill chunk; lower "
                             f"--local-prefill-budget to {max(t - s, 1)} or less (0: no limit), or raise "
                             f"--max-num-batched-tokens to {b + s} or more")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(sorted(set(self.cuda_graph_sizes)))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"cuda_graph_sizes: must be batch sizes >= 1, got {self.cuda_graph_sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", sizes)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        on_cpu = self.device.split(":")[0] == "cpu"
        if self.dtype == "auto":  # resolved here, before anyone reads it
            object.__setattr__(self, "dtype", "float32" if on_cpu else "bfloat16")
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", not on_cpu)
        if self.attention_backend not in ("auto", "cuda", "triton", "torch"):
            raise ValueError(f"attention_backend: must be auto, cuda, triton or torch, got {self.attention_backend!r}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
            if on_cpu:
                raise ValueError(f"gpu_memory_utilization: sizes a GPU's KV cache, device is {self.device!r}; "
                                 f"on the CPU give --kv-cache-memory instead")
        if on_cpu and self.attention_backend in ("cuda", "triton"):
            raise ValueError(f"attention_backend: {self.attention_backend!r} needs a CUDA device, device is "
                             f"{self.device!r}; use auto or torch, or --device cuda")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A prefill, decode or colocated node process. Only a decode node bounds its engine's
    prompt tokens per step (``engine.prefill_step_budget``, the prompts it prefills beside its
    running batch); a prefill or colocated node's engine runs without that bound."""

    role: NodeRole  # colocated: a decode node that never asks a prefill node
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    redis_url: str | None = field(default=None, repr=False)  # may hold a password; None: not registered
    node_id: str = ""  # "" : derived from role and port
    kv_backend: str = DEFAULT_BACKEND  # a name of common/kv_backends.py: how KV blocks travel to decode nodes
    transfer_lease_s: float = 30.0  # a transfer not complete by then fails and falls back
    fault: Fault | None = None  # injected for tests
    # Bytes this node holds packed for the prefix pulls it serves, all of them together (one fresh
    # buffer per chunk until it is sent; node/pull_budget.py): a 100k-token Llama-3-8B prefix is
    # 12 GiB, so an uncapped holder could pack that once per puller. --kv-pull-memory.
    kv_pull_memory: int = 256 << 20
    # Required on every internal endpoint and KV handshake (common/auth.py); None: open.
    cluster_token: str | None = field(default=None, repr=False)
    drain_grace_s: float = 30.0  # SIGTERM: in-flight work gets this long before the node exits
    # Structured outputs: CPU seconds one grammar compile may take before its worker process is
    # killed (a 400: too complex), and the worker processes (node/grammar_service.py). The
    # limits (common/grammar_limits.py) keep an accepted JSON schema to 2-5 s of a slow core.
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_workers: int = 2  # above the router's default schema_compiles_per_key (1)
    # The device of each rank of a tensor-parallel node, rank 0's first (it is engine.device);
    # empty: engine/ranks/placement.py rank_device's rule (cuda:k -> cuda:k+rank; every rank on the CPU).
    rank_devices: tuple[str, ...] = ()

    def __post_init__(self):
        tp = self.engine.tensor_parallel_size
        if self.rank_devices and (len(self.rank_devices) != tp or self.rank_devices[0] != self.engine.device):
            raise ValueError(f"device: {len(self.rank_devices)} devices ({','.join(self.rank_devices)}) for "
                             f"tensor_parallel_size {tp}; give one device per rank, rank 0's first")
        if len(set(self.rank_devices)) < len(self.rank_devices) and self.engine.device.split(":")[0] == "cuda":
            raise ValueError(f"device: {','.join(self.rank_devices)} names a GPU twice; each rank needs its own")
        if not self.grammar_compile_timeout_s > 0 or self.grammar_compile_workers < 1:
            raise ValueError(f"grammar_compile_timeout_s must be > 0 and grammar_compile_workers >= 1, got "
                             f"{self.grammar_compile_timeout_s} and {self.grammar_compile_workers}")
        if self.kv_pull_memory <= 0:
            raise ValueError(f"--kv-pull-memory: must be > 0 bytes, got {self.kv_pull_memory}")
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role: must be prefill, decode or colocated, got {self.role!r}")
        if self.role != "decode" and self.engine.prefill_step_budget is not None:
            object.__setattr__(self, "engine", replace(self.engine, prefill_step_budget=None))
        spec = self.kv_spec  # raises for an unknown name
        on_cpu = self.engine.device.split(":")[0] == "cpu"
        if spec.shm_cache and not on_cpu and self.role == "decode":
            raise ValueError(f"kv_backend: {spec.name} keeps the KV cache in host memory, device is "
                             f"{self.engine.device!r}; use {alternatives(cuda=True)} on a GPU")
        if spec.needs_cuda and on_cpu and self.role == "decode":
            raise ValueError(f"kv_backend: {spec.name} shares a CUDA KV cache and needs --device cuda; "
                             f"on the CPU use {alternatives(cuda=False)}")

    @property
    def kv_spec(self) -> KVBackendSpec:
        """The spec of ``kv_backend`` (common/kv_backends.py): its abilities."""
        return backend_spec(self.kv_backend)

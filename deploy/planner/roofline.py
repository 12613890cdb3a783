"""The roofline step-time model of a simulated GPU node: one forward pass costs the
larger of its FLOPs over the effective peak and its bytes over the effective
memory bandwidth, plus a fixed per-step overhead.

Owns the formula. Must not import torch or know where its numbers come from
(deploy/planner/sim_profiles.py derives them from a model and a GPU; the profile file
states them and whether they are calibrated).

One step = the decode rows (``decode_batch`` requests whose contexts sum to
``decode_context`` tokens) plus prefill chunks (n new tokens after ctx cached)::

    flops = flops_per_token x (decode_batch + sum n)
          + attn_flops x (decode_context + sum n x (ctx + n / 2))
    bytes = weight_bytes + kv_bytes_per_token x (decode_context + sum (ctx + n))
    t     = max(flops / flops_per_s, bytes / bytes_per_s) + step_overhead_s

``flops_per_token`` = 2 x matmul parameters; ``attn_flops`` = 4 x layers x query
heads x head dim (QK^T and PV, per new token per context token). The weights are
read once per step, whatever the batch: decode is bandwidth-bound, prefill of a
long chunk compute-bound.

A Mixture-of-Experts model (``moe`` set) counts only its active parameters in
``flops_per_token``; ``weight_bytes`` is then its dense part (attention, embeddings,
norms, routers, shared experts), read every step, and a step of T new tokens
(T = decode_batch + sum n) also reads the routed experts its tokens touch, and pays
the expert-parallel all-to-all (``MoeCost``)::

    bytes += MoeCost.expert_bytes x expected_experts(E, k, T)
    t     += MoeCost.all_to_all_seconds(T)      (not overlapped with the forward)

A data-parallel rank (``MoeCost.dp`` = N > 1: one GPU of a node of N ranks, each with its
own requests and KV, each holding E/N experts whole and every dense weight) prices one
rank's step of T new tokens, the other ranks taken as evenly loaded (T tokens each)::

    bytes += MoeCost.expert_bytes x expected_experts(E, k, N x T) / N
             (its share of the experts ALL ranks' tokens touch)
    t     += MoeCost.dp_collective_seconds(T)   (the engine's gather + reduce, below)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of one layer that ``tokens`` tokens touch when each picks
    ``top_k`` of ``experts`` uniformly: E x (1 - (1 - k/E)^T). T = 1 gives k, a large
    T approaches E."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens) if tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class MoeCost:
    """What routed experts add to a step of a node (deploy/planner/sim_profiles.py derives it).

    ``expert_bytes``: one routed expert's weights summed over the MoE layers (an expert
    touched in a layer is read once that step; the node's GPUs share the reads, EP or TP
    alike). ``ep``: expert-parallel ranks; with ep > 1 every MoE layer dispatches each
    token's k activations to the ranks holding its experts and combines them back:
    2 x T x k x hidden x dtype_bytes x (ep - 1) / ep bytes per layer, spread over the
    ep ranks' links (``link_bytes_per_s`` each), plus ``link_latency_s`` per dispatch and
    per combine. Routing is taken as uniform: load imbalance is not modelled. The
    all-to-all is that of a token-sharded (DeepEP-style) dispatch; this engine's EP after
    tensor-parallel attention dispatches locally and combines with the all-reduce a dense
    layer already pays (tp_efficiency), so for it the all-to-all term is an upper bound.

    ``dp`` > 1: the cost is one data-parallel rank's (module docstring) and its collective
    is the one the engine runs (engine/models/moe.py ``_data_parallel_experts``,
    engine/parallel/group.py DataParallel), per MoE layer: an all_gather of every rank's
    tokens padded to the busiest rank's count P, then an all_reduce of the [N x P, hidden]
    partial sums. Ranks evenly loaded (P = T, this rank's tokens), ring algorithms, per rank::

        gather  = (N - 1) x P x hidden x dtype_bytes          (the N x P rows less its own)
        reduce  = 2 x (N - 1) / N x N x P x hidden x dtype_bytes
        seconds = moe_layers x (gather + reduce) / link_bytes_per_s
                  + moe_layers x 3 x ceil(log2 N) x link_latency_s

    (the latency term: tree-like small-message algorithms, log2 N hops for the gather and
    twice that for the reduce). ``link_bytes_per_s`` is one rank's link: NVLink within a
    host, the scale-out network when the node spans hosts (the slowest hop of the ring).
    This is heavier than a true all-to-all (2 x T x k x hidden bytes, DeepEP-style), which
    the engine does not have yet: every rank receives every rank's tokens and sums a
    [N x P, hidden] tensor, so its bytes grow with N. Padding makes these bytes exact for
    the busiest rank whatever the others hold; for a rank below the busiest they are
    under-priced (it pays the busiest rank's P), and idle ranks' empty turns in the
    collective are not modelled."""

    experts: int
    top_k: int
    moe_layers: int
    expert_bytes: float
    ep: int = 1
    hidden: int = 0
    dtype_bytes: int = 2
    link_bytes_per_s: float = 0.0
    link_latency_s: float = 0.0
    dp: int = 1  # data-parallel ranks sharing the experts (> 1: this is one rank's cost)

    def __post_init__(self):
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"moe top_k: must be in [1, experts={self.experts}], got {self.top_k}")
        if self.ep < 1 or self.experts % self.ep:
            raise ValueError(f"moe ep: must be >= 1 and divide experts={self.experts}, got {self.ep}")
        if self.ep > 1 and self.link_bytes_per_s <= 0:
            raise ValueError("moe link_bytes_per_s: ep > 1 needs the interconnect's rate (> 0)")
        if self.moe_layers < 1 or self.expert_bytes < 0:
            raise ValueError("moe moe_layers and expert_bytes: must be >= 1 and >= 0")
        if self.dp < 1 or self.experts % self.dp:
            raise ValueError(f"moe dp: must be >= 1 and divide experts={self.experts}, got {self.dp}")
        if self.dp > 1 and self.link_bytes_per_s <= 0:
            raise ValueError("moe link_bytes_per_s: dp > 1 needs the ranks' link rate (> 0)")

    def expert_read_bytes(self, tokens: int) -> float:
        """Routed-expert bytes a step of ``tokens`` new tokens reads (all layers, the node);
        a data-parallel rank: its 1/dp share of the experts dp x ``tokens`` tokens touch."""
        if self.dp > 1:
            return self.expert_bytes * expected_experts(self.experts, self.top_k, self.dp * tokens) / self.dp
        return self.expert_bytes * expected_experts(self.experts, self.top_k, tokens)

    def dp_collective_bytes(self, tokens: int) -> float:
        """Bytes one data-parallel rank receives in a step of ``tokens`` tokens per rank: the
        all_gather and the all_reduce of every MoE layer (class docstring); 0 without DP."""
        if self.dp == 1 or tokens <= 0:
            return 0.0
        n, row = self.dp, tokens * self.hidden * self.dtype_bytes
        gather = (n - 1) * row
        reduce = 2 * (n - 1) / n * n * row
        return self.moe_layers * (gather + reduce)

    def dp_collective_seconds(self, tokens: int) -> float:
        if self.dp == 1 or tokens <= 0:
            return 0.0
        hops = 3 * math.ceil(math.log2(self.dp))
        return self.dp_collective_bytes(tokens) / self.link_bytes_per_s + self.moe_layers * hops * self.link_latency_s

    def all_to_all_bytes(self, tokens: int) -> float:
        """Dispatch + combine bytes crossing between the ep ranks, all MoE layers (a
        data-parallel rank: its gather + reduce, ``dp_collective_bytes``)."""
        if self.dp > 1:
            return self.dp_collective_bytes(tokens)
        if self.ep == 1 or tokens <= 0:
            return 0.0
        per_layer = 2 * tokens * self.top_k * self.hidden * self.dtype_bytes * (self.ep - 1) / self.ep
        return per_layer * self.moe_layers

    def all_to_all_seconds(self, tokens: int) -> float:
        """The step's expert communication: the all-to-all, or a DP rank's gather + reduce."""
        if self.dp > 1:
            return self.dp_collective_seconds(tokens)
        if self.ep == 1 or tokens <= 0:
            return 0.0
        return (self.all_to_all_bytes(tokens) / (self.ep * self.link_bytes_per_s)
                + 2 * self.moe_layers * self.link_latency_s)


@dataclass(frozen=True, slots=True)
class Roofline:
    flops_per_token: float
    attn_flops: float  # per new token per context token
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # read per context token, written per new token
    flops_per_s: float  # effective: peak x efficiency x GPUs
    bytes_per_s: float  # effective: bandwidth x efficiency x GPUs
    step_overhead_s: float
    moe: MoeCost | None = None  # routed experts (module docstring); None: a dense model

    def __post_init__(self):
        for name in ("flops_per_s", "bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"roofline {name}: must be > 0, got {getattr(self, name)}")
        for name in ("flops_per_token", "attn_flops", "weight_bytes", "kv_bytes_per_token",
                     "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"roofline {name}: must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, decode_batch: int, decode_context: int,
                     chunks: list[tuple[int, int]]) -> float:
        """Seconds of one step; ``chunks``: (n new tokens, ctx cached before them)."""
        new = decode_batch + sum(n for n, _ in chunks)
        attn = decode_context + sum(n * (ctx + n / 2) for n, ctx in chunks)
        touched = decode_context + sum(ctx + n for n, ctx in chunks)
        flops = self.flops_per_token * new + self.attn_flops * attn
        nbytes = self.step_weight_bytes(new) + self.kv_bytes_per_token * touched
        return (max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.all_to_all_seconds(new)
                + self.step_overhead_s)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` new tokens reads: all of a dense model's;
        a MoE model's dense part plus the experts its tokens touch."""
        return self.weight_bytes + (self.moe.expert_read_bytes(tokens) if self.moe else 0.0)

    def all_to_all_seconds(self, tokens: int) -> float:
        """The expert-parallel all-to-all of a step of ``tokens`` new tokens (0: none)."""
        return self.moe.all_to_all_seconds(tokens) if self.moe else 0.0

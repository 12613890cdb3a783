"""The roofline step-time model of a simulated GPU node: one forward pass costs the
larger of its FLOPs over the effective peak and its bytes over the effective
memory bandwidth, plus a fixed per-step overhead.

Owns the formula. Must not import torch or know where its numbers come from
(common/sim_profiles.py derives them from a model and a GPU; the profile file
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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Roofline:
    flops_per_token: float
    attn_flops: float  # per new token per context token
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # read per context token, written per new token
    flops_per_s: float  # effective: peak x efficiency x GPUs
    bytes_per_s: float  # effective: bandwidth x efficiency x GPUs
    step_overhead_s: float

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
        nbytes = self.weight_bytes + self.kv_bytes_per_token * touched
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.step_overhead_s

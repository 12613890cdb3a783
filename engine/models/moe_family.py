"""The Mixture-of-Experts families: Qwen3-MoE, Mixtral and Qwen2-MoE, the dense decoder
(llama.py) with the MoE block (moe.py) as the feed-forward of their sparse layers, and
their registration (``FAMILY``, families.py). Their differences are a table:

    family     | attention                 | experts (width)                           | top-k weights
    -----------+---------------------------+-------------------------------------------+----------------------------
    Qwen3-MoE  | q/k norm, attention_bias  | num_experts (moe_intermediate_size)       | renormalised if norm_topk_prob
    Mixtral    | no biases                 | num_local_experts (intermediate_size)     | always renormalised
    Qwen2-MoE  | qkv_bias                  | num_experts (moe_intermediate_size)       | renormalised if norm_topk_prob

Qwen2-MoE adds a shared expert (shared_expert_intermediate_size); both Qwen families keep
the dense MLP on the layers of ``mlp_only_layers`` and off ``decoder_sparse_step``.

Owns the config adapter (``moe_config``: refuses what is not supported, naming the
field), the weight map (Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2`` onto
``mlp.experts.<e>.gate_proj/up_proj/down_proj``), the sharding plan (per-expert tensors
stacked into ``mlp.w13`` [E, 2 * I, H] and ``mlp.w2`` [E, H, I]; with TP = t every expert
cut like the dense MLP: rows of gate and up, columns of down; with expert parallelism
each rank's E / t experts whole, the others' never read) and the parameter counts
(active: the router, k experts and the shared one). Must not read files.
"""

import dataclasses
import re
from functools import partial
from typing import NamedTuple

import torch

from ...common.hf_config import architecture
from .config import ModelConfig
from .family import ModelFamily, ParamCount
from .llama import CausalLM, dense_parameters
from .moe import moe_feed_forward
from .moe_config import MoEConfig
from .sharding import FUSED, Cut, ShardingPlan, StackSlot, TPShard, cut, hf_cut, shard_full, split_range

class MoEFlags(NamedTuple):
    """What one MoE architecture reads from its config.json."""

    qkv_bias: bool | None  # None: the config's attention_bias (as o_bias)
    o_bias: bool | None
    qk_norm: bool
    experts: tuple[str, ...]  # the expert-count fields, the first one present wins
    width: str  # one expert's width field
    norm_topk_prob: bool | None  # norm_topk_prob's default; None: always renormalised
    qwen: bool  # reads mlp_only_layers, decoder_sparse_step and shared_expert_intermediate_size


MOE_FLAGS = {  # architectures[0] -> its flags
    "Qwen3MoeForCausalLM": MoEFlags(None, None, True, ("num_experts", "num_local_experts"), "moe_intermediate_size",
                                    False, True),
    "MixtralForCausalLM": MoEFlags(False, False, False, ("num_local_experts",), "intermediate_size", None, False),
    "Qwen2MoeForCausalLM": MoEFlags(True, False, False, ("num_experts",), "moe_intermediate_size", False, True),
}


def moe_config(cfg: dict) -> ModelConfig:
    """The config adapter of the MoE families: the dense reading plus ``ModelConfig.moe``."""
    f = MOE_FLAGS[architecture(cfg)]
    experts = next((cfg[k] for k in f.experts if cfg.get(k) is not None), 0)
    if experts < 1:
        raise ValueError(f"model: config.json {f.experts[0]}: {experts} experts; a MoE model needs at least "
                         "one (a dense checkpoint: use its dense architecture)")
    top_k = cfg.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        raise ValueError(f"model: config.json num_experts_per_tok: {top_k} is not between 1 and the "
                         f"{experts} experts")
    step = cfg.get("decoder_sparse_step", 1) if f.qwen else 1
    if step < 1:
        raise ValueError(f"model: config.json decoder_sparse_step: must be >= 1, got {step}")
    only = set(cfg.get("mlp_only_layers") or []) if f.qwen else set()
    norm = True if f.norm_topk_prob is None else bool(cfg.get("norm_topk_prob", f.norm_topk_prob))
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=cfg[f.width], norm_topk_prob=norm,
                    shared_expert_size=cfg.get("shared_expert_intermediate_size", 0) if f.qwen else 0,
                    dense_layers=tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step))
    # a fixed flag yields to a config.json qkv_bias field (Qwen2-MoE has one)
    qkv_bias = None if f.qkv_bias is None else bool(cfg.get("qkv_bias", f.qkv_bias))
    dense = ModelConfig.from_hf(cfg, qkv_bias, f.o_bias, f.qk_norm)
    if dense.mlp_bias:
        raise ValueError("model: config.json mlp_bias: true is not supported by the MoE families")
    return dataclasses.replace(dense, moe=moe)


def moe_parameters(cfg: ModelConfig) -> ParamCount:
    """The dense count with each sparse layer's MLP replaced by its router, experts and
    shared expert; active: the router, k experts and the shared expert per token."""
    assert cfg.moe is not None
    m, h = cfg.moe, cfg.hidden_size
    sparse = sum(m.is_sparse(i) for i in range(cfg.num_layers))
    expert = 3 * h * m.intermediate_size
    shared = 3 * h * m.shared_expert_size + h if m.shared_expert_size else 0  # + its sigmoid gate [1, H]
    fixed = dense_parameters(cfg).total - sparse * 3 * h * cfg.intermediate_size + sparse * (m.num_experts * h + shared)
    return ParamCount(fixed + sparse * m.num_experts * expert, fixed + sparse * m.top_k * expert)


_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


def moe_names(key: str) -> str:
    """Mixtral's names (``block_sparse_moe.gate``, ``block_sparse_moe.experts.<e>.w1/w3/w2``) onto
    the Qwen-MoE ones (``mlp.gate``, ``mlp.experts.<e>.gate_proj/up_proj/down_proj``); those unchanged."""
    key = key.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_MIXTRAL[m.group(2)]}.", key)


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_PIECES = {"gate_proj": ("mlp.w13", 0), "up_proj": ("mlp.w13", 1), "down_proj": ("mlp.w2", 0)}
_SHARED = "mlp.shared_expert."


def moe_stacked(name: str, shard: TPShard) -> StackSlot | None:
    """``mlp.experts.<e>.{gate,up}_proj.weight`` -> expert e's rows of ``mlp.w13``; ``down_proj`` -> of
    ``mlp.w2`` (rows counted from the rank's first expert)."""
    m = _EXPERT.match(name.removesuffix(".weight"))
    if m is None:
        return None
    return StackSlot(_PIECES[m.group(2)][0], int(m.group(1)) - shard.experts.start, _PIECES[m.group(2)][1])


def moe_held(name: str, shard: TPShard) -> bool:
    """False for another rank's expert under expert parallelism: its bytes are never read."""
    m = _EXPERT.match(name.removesuffix(".weight"))
    return m is None or shard.experts.start <= int(m.group(1)) < shard.experts.stop


def moe_cut(part: str, kind: str, shard: TPShard, cfg: ModelConfig) -> Cut | None:
    """As sharding.hf_cut, with each expert (whole under expert parallelism) and the shared
    expert cut like the dense MLP (the router and the shared expert's gate whole)."""
    assert cfg.moe is not None
    m = _EXPERT.match(part)
    if m and shard.expert_parallel:
        return None
    if shard.size == 1 or not (m or part.startswith(_SHARED)):
        return hf_cut(part, kind, shard, cfg)
    r = split_range(cfg.moe.intermediate_size if m else cfg.moe.shared_expert_size, shard)
    return Cut(1, r.start, r.stop) if part.endswith("down_proj") else Cut(0, r.start, r.stop)


def moe_full(name: str, full: torch.Tensor, shard: TPShard, cfg: ModelConfig) -> torch.Tensor:
    """As sharding.shard_full, for the stacked experts [E, ...] and the shared expert too."""
    assert cfg.moe is not None
    part = name.split(".", 2)[2] if name.startswith("layers.") else ""  # layers.<i>.<part>
    if shard.expert_parallel and part in ("mlp.w13", "mlp.w2"):
        return full[shard.experts.start:shard.experts.stop].contiguous()
    if shard.size == 1 or (part not in ("mlp.w13", "mlp.w2") and not part.startswith(_SHARED)):
        return shard_full(name, full, shard, cfg)
    width = cfg.moe.intermediate_size if part in ("mlp.w13", "mlp.w2") else cfg.moe.shared_expert_size
    r = split_range(width, shard)
    dim = full.ndim - 2  # the output rows: dim 1 of a stack, dim 0 of the shared expert
    if part == "mlp.w2" or part.startswith(_SHARED + "down_proj"):
        return cut(full, Cut(dim + 1, r.start, r.stop)).contiguous()
    return torch.cat([cut(p, Cut(dim, r.start, r.stop)) for p in full.split(width, dim=dim)], dim=dim)


MOE_SHARDING = ShardingPlan({**FUSED, "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj",
                                                                          "mlp.shared_expert.up_proj")},
                            moe_cut, moe_full, moe_stacked, moe_held)
FAMILY = ModelFamily(architectures=tuple(MOE_FLAGS), config=moe_config,
                     module=partial(CausalLM, feed_forward=moe_feed_forward),
                     weight_map=moe_names, sharding=MOE_SHARDING, parameters=moe_parameters)

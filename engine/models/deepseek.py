"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2's layout): the
decoder of llama.py with Multi-head Latent Attention (mla.py) in every layer and DeepSeekMoE
(moe.py with the sigmoid router: score bias, expert groups, routed scaling; shared experts
without a gate) as the feed-forward of every layer from ``first_k_dense_replace`` on (the
first ones keep the dense MLP), and its registration (``FAMILY``, families.py).

Owns the config adapter (``deepseek_config``: MLA's and the router's fields, the rotary
tables through transformers' RoPE functions (YaRN as configured), refusals naming the
field), the weight map (``shared_experts`` onto the MoE block's ``shared_expert``; the routed
experts' names are the Qwen-MoE ones, stacked by moe_family's plan) and the parameter
counts. Multi-token-prediction layers past ``num_hidden_layers`` are not served (the loader
skips them). Must not read files.
"""

import dataclasses
from functools import partial

from ...common.hf_config import architecture
from .config import ModelConfig
from .family import ModelFamily, ParamCount
from .llama import CausalLM
from .mla import MLARotary, MLAttention
from .mla_config import MLAConfig
from .moe import moe_feed_forward
from .moe_config import MoEConfig, Scoring
from .moe_family import MOE_SHARDING

ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def _rope(cfg: dict, rope_dim: int, qk_head_dim: int) -> tuple[tuple[float, ...], float, float]:
    """(inverse frequencies [rope / 2], the attention factor on cos and sin, the softmax scale)
    of config.json ``cfg``, by transformers' RoPE functions (default or YaRN)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    conf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})
    params = dict(conf.rope_parameters or {})
    kind = params.get("rope_type", "default")
    if kind == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
        factor = 1.0
    elif kind == "yarn":
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](conf)
    else:
        raise ValueError(f"model: config.json rope_scaling.rope_type: {kind!r} is not supported for "
                         "DeepSeek-V3 (default, yarn)")
    return tuple(float(f) for f in inv), float(factor), float(yarn_apply_mscale(params, qk_head_dim ** -0.5))


def deepseek_config(cfg: dict) -> ModelConfig:
    """The config adapter: ``ModelConfig`` with ``mla`` and ``moe`` (sigmoid router)."""
    assert architecture(cfg) in ARCHITECTURES
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"model: config.json quantization_config: {method!r} checkpoints are not supported "
                         "(DeepSeek-V3's FP8 blocks); serve a bf16 conversion of the weights")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"model: config.json scoring_func / topk_method: {cfg.get('scoring_func')!r} / "
                         f"{cfg.get('topk_method')!r} are DeepSeek-V2's routers; DeepSeek-V3's sigmoid / "
                         "noaux_tc is supported")
    experts, k = cfg.get("n_routed_experts") or 0, cfg.get("num_experts_per_tok", 8)
    groups, topk_groups = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if experts < 1 or not 1 <= k <= experts:
        raise ValueError(f"model: config.json n_routed_experts / num_experts_per_tok: {experts} / {k}; "
                         "need 1 <= num_experts_per_tok <= n_routed_experts")
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups or experts // groups < 2:
        raise ValueError(f"model: config.json n_group / topk_group: {groups} / {topk_groups} for {experts} "
                         "experts; n_group must divide them into groups of >= 2 and topk_group <= n_group")
    if k > topk_groups * (experts // groups):
        raise ValueError(f"model: config.json num_experts_per_tok: {k} is more than the {topk_groups} "
                         f"groups of {experts // groups} experts it may draw from (topk_group)")
    rope_dim, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    if (kv_lora + rope_dim) % 2:
        raise ValueError(f"model: config.json kv_lora_rank + qk_rope_head_dim: {kv_lora} + {rope_dim} is odd; "
                         "the latent cache stores it in two halves")
    inv, factor, scale = _rope(cfg, rope_dim, nope + rope_dim)
    mla = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                    qk_rope_head_dim=rope_dim, v_head_dim=v, rope_interleave=bool(cfg.get("rope_interleave", True)),
                    rope_inv_freq=inv, rope_scaling=factor, softmax_scale=scale)
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    layers = cfg["num_hidden_layers"]
    moe = MoEConfig(num_experts=experts, top_k=k, intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_expert_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                    dense_layers=tuple(i for i in range(layers) if i < first_dense or i % freq),
                    shared_expert_gated=False, scoring=Scoring.SIGMOID, num_groups=groups,
                    topk_groups=topk_groups, routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    # the dense reading without the rotary settings (MLA holds its own) and with the cache's
    # shape: one "KV head" of half a latent (mla_config.py)
    plain = {**cfg, "rope_parameters": {"rope_theta": 10000.0}, "rope_scaling": None,
             "head_dim": (kv_lora + rope_dim) // 2, "num_key_value_heads": 1}
    dense = ModelConfig.from_hf(plain, False, None, False)
    return dataclasses.replace(dense, moe=moe, mla=mla)


def deepseek_names(key: str) -> str:
    """``mlp.shared_experts.*`` onto the MoE block's ``mlp.shared_expert.*``; the rest unchanged."""
    return key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def deepseek_parameters(cfg: ModelConfig) -> ParamCount:
    """Every weight (the routers' score biases too); active: attention, the dense layers' MLP,
    and per sparse layer the router, k routed experts and the shared experts."""
    m, e = cfg.mla, cfg.moe
    assert m is not None and e is not None
    h, H, bias = cfg.hidden_size, cfg.num_heads, cfg.o_bias
    if m.q_lora_rank is None:
        q = h * H * m.qk_head_dim
    else:
        q = h * m.q_lora_rank + bias * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim
    kv = h * m.latent_dim + bias * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    attn = q + kv + H * m.v_head_dim * h + bias * h
    sparse = sum(e.is_sparse(i) for i in range(cfg.num_layers))
    dense = cfg.num_layers - sparse
    expert, shared, router = 3 * h * e.intermediate_size, 3 * h * e.shared_expert_size, e.num_experts * (h + 1)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    fixed = cfg.vocab_size * h + head + h + cfg.num_layers * (attn + 2 * h) + dense * 3 * h * cfg.intermediate_size
    fixed += sparse * (router + shared)
    return ParamCount(fixed + sparse * e.num_experts * expert, fixed + sparse * e.top_k * expert)


# the MoE families' plan without the fused q/k/v (MLA's projections load as they are named)
DEEPSEEK_SHARDING = MOE_SHARDING._replace(fused={name: parts for name, parts in MOE_SHARDING.fused.items()
                                                 if name != "self_attn.qkv_proj"})
FAMILY = ModelFamily(architectures=ARCHITECTURES, config=deepseek_config,
                     module=partial(CausalLM, feed_forward=moe_feed_forward, attention=MLAttention, rope=MLARotary),
                     weight_map=deepseek_names, sharding=DEEPSEEK_SHARDING, parameters=deepseek_parameters)

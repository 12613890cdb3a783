"""ModelConfig: the architecture of a decoder checkpoint (dense, or MoE with ``moe``), read from its Hugging
Face ``config.json`` and frozen, and the reading of the fields every dense family shares
(``ModelConfig.from_hf``). Which family reads which config.json, with which flags, is
the family registry's (families.py; the flags of the built-in families: llama.py).
Owns nothing else (no weights, no torch).

A sliding window smaller than the context caps ``max_position_embeddings`` (the usable
context) at the window, with a log line: common/hf_config.py says why that is exact.
"""

import logging
from dataclasses import dataclass

from ...common.hf_config import architecture, sliding_window, usable_context
from .mla_config import MLAConfig
from .moe_config import MoEConfig

log = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # config.json architectures[0]: the family registry's key of its family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # independent of hidden_size / num_heads in Qwen3
    max_position_embeddings: int  # usable context: the config's, capped at a sliding window
    rms_norm_eps: float
    rope_theta: float
    # None, or the HF rope scaling dict ({"rope_type": "linear"|"llama3", "factor": ...}).
    rope_scaling: tuple[tuple[str, object], ...] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on each q and k head, before RoPE
    sliding_window: int | None  # the checkpoint's window, when some layer uses one
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # a Mixture-of-Experts model's experts (moe_family.py); None: dense
    # Multi-head Latent Attention (deepseek.py): the cache holds one latent per token, as 1 KV head
    # of head_dim = latent_dim / 2 (mla_config.py); None: grouped-query attention
    mla: MLAConfig | None = None

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token takes over all layers, K and V, at ``itemsize`` bytes per value."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf(cls, cfg: dict, qkv_bias: bool | None, o_bias: bool | None, qk_norm: bool) -> "ModelConfig":
        """The config of config.json ``cfg`` (Hugging Face field names) with a family's flags:
        q/k/v and o_proj biases (None: the config's ``attention_bias``), q/k RMSNorm."""
        arch = architecture(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: config.json hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        window, max_pos = sliding_window(cfg), usable_context(cfg)
        declared = cfg.get("max_position_embeddings", 2048)
        if max_pos < declared:
            log.warning("model: %s uses a %d-token sliding window, which splitserve does not implement; "
                     "the usable context is capped at %d tokens (config.json max_position_embeddings: %d)",
                     arch, window, window, declared)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=window,
            eos_token_ids=eos_ids,
        )


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None for the default RoPE)."""
    # transformers >= 5 nests RoPE settings in rope_parameters; older configs
    # keep rope_theta / rope_scaling at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or rope or None
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"model: config.json rope_scaling.rope_type: {kind!r} is not supported "
                         f"({', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    return theta, scaling

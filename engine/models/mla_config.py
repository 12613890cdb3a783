"""MLAConfig: Multi-head Latent Attention's part of a checkpoint's architecture (DeepSeek-V2/V3,
Kimi K2), frozen inside ``ModelConfig.mla``: the low-rank query and KV projections, the
decoupled rotary key, and the rotary tables' inputs resolved once by the family's config
adapter (deepseek.py). Owns nothing else (no torch, no weights).

The KV cache holds one latent vector per token and layer, ``latent_dim = kv_lora_rank +
qk_rope_head_dim`` values (576 for DeepSeek-V3: the normalised compressed KV, then the rotated
rope key), shared by every head. It lives in the paged cache's usual shape with one KV head
of ``latent_dim / 2``: the K half of a block holds the first half of each latent, the V half
the second (``ModelConfig.num_kv_heads`` 1, ``head_dim`` latent_dim / 2), so the block pool,
prefix cache, tiers, checksums and every KV transport move it unchanged.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MLAConfig:
    q_lora_rank: int | None  # None: queries by one full projection (q_proj)
    kv_lora_rank: int  # the compressed KV's width (512 in DeepSeek-V3)
    qk_nope_head_dim: int  # per head: the query/key part without position (128)
    qk_rope_head_dim: int  # the shared rotary key's width, and each query's rotary part (64)
    v_head_dim: int  # per head value width (128)
    rope_interleave: bool  # rotary dimensions in interleaved pairs (x0, x1), (x2, x3), ...
    rope_inv_freq: tuple[float, ...]  # [qk_rope_head_dim / 2] (YaRN already applied)
    rope_scaling: float  # YaRN's attention factor on cos and sin (1.0 without YaRN)
    softmax_scale: float  # (qk_nope + qk_rope)^-0.5, times YaRN's mscale^2 where configured

    @property
    def latent_dim(self) -> int:
        """KV cache values per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

"""A Llama-family decoder in plain torch: RMSNorm, RoPE (default, linear or llama3
scaling), grouped-query attention over the paged KV cache, SwiGLU MLP. One class
serves Llama 2/3/3.1, Qwen2, Qwen3 and Mistral: their differences are flags of
``ModelConfig`` (``qkv_bias``, ``o_bias``, ``mlp_bias``, ``qk_norm``,
``tie_word_embeddings``, ``head_dim``), not subclasses.

The model sees one flat batch of T tokens from many requests (see
``attention/base.py``); it never holds a per-request KV tensor. Weights use
Hugging Face names except that q/k/v and gate/up projections are fused
(``qkv_proj``, ``gate_up_proj``) by the loader, halving the matmul launches.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention.base import AttentionBackend, AttentionMetadata
from .model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # bitwise equal to transformers' LlamaRMSNorm in fp32 (tested)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with the config's scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling_dict
    if scaling is None:
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths scaled by `factor`, short ones kept, smooth band between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in one pass. ``rotate_half(x) * sin`` is computed as
    ``roll(x, hd/2) * sin_signed`` with the first half of ``sin`` negated: the
    same IEEE products as transformers' formula, in fewer ops."""

    cos: torch.Tensor  # [max_pos, hd] (buffers, registered in __init__)
    sin_signed: torch.Tensor  # [max_pos, hd], first half negated

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(cfg)[None, :]  # [max_pos, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, hd]
        sin = emb.sin()
        sin[:, : cfg.head_dim // 2].neg_()
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin_signed", sin, persistent=False)

    def tables(self, positions, dtype: torch.dtype):
        """positions [T] -> (cos, sin_signed), each [T, 1, hd] in the activations' dtype (computed
        in fp32, then cast, as transformers does); gathered once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x, cos, sin_signed):
        """x [T, heads, hd] -> rotated copy."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: one RMSNorm over head_dim shared by all q heads, one by all k heads
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, rope, kv_cache, meta, backend: AttentionBackend):
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*KVH) * hd]: q heads, then k heads, then v heads
        qk = qkv[:, : self.qk_size].view(T, self.num_heads + self.kv_heads, self.head_dim)
        if self.qk_norm:  # [T, H + KVH, hd], normalized per head before RoPE
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = RotaryEmbedding.rotate(qk, *rope)  # q and k rotated together
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.qk_size:].view(T, self.kv_heads, self.head_dim)
        return self.o_proj(backend.forward(q, k, v, kv_cache, meta))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):  # x [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # each [T, intermediate]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, hd];
        logits_indices: [S] rows whose next-token logits are wanted. Returns [S, vocab] float32."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rope.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_caches[i], meta, backend)
        x = self.norm(x[logits_indices])  # RMSNorm is per row: normalizing only the needed rows is exact
        return self.lm_head(x).float()



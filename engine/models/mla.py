"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) over the paged latent KV cache: the
attention block (``MLAttention``, a llama.AttentionBlock) and its rotary tables
(``MLARotary``). Config: mla_config.py; the cache layout (the latent's two halves in a
block's K and V): mla_config.py's docstring. Must not: read weights or configs.

Per token, with H heads (all on this rank: MLA nodes run tensor_parallel_size 1)::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))  [H, nope + rope]   (or q_proj(x))
    c, kr  = kv_a_proj_with_mqa(x)                 [kv_lora], [rope]
    latent = [kv_a_layernorm(c), rotate(kr)]       [kv_lora + rope]    -> the cache, one per token
    k_h    = [W_UK_h c, rotate(kr)],  v_h = W_UV_h c                    (kv_b_proj = [W_UK_h; W_UV_h] per head)

Two ways to attend, equal up to rounding (tests/test_deepseek.py checks it):

- plain (prefill chunks): the context's latents expanded through kv_b_proj into per-head keys
  and values, then causal attention per head: cost ~ context x H x (nope + v) x kv_lora to
  expand, worth it when a chunk has many queries;
- absorbed (decode rows): W_UK folded into the query (q_lat_h = W_UK_h^T q_nope_h), scores
  over the latents directly, ``softmax(q_lat . c + q_rope . kr)``, the weighted latent
  mapped by W_UV afterwards. No per-head keys are built: a decode step reads only the
  latents, one vector per token, the reason MLA's decode reads ~1/H of GQA's KV bytes.
  It is multi-query attention with one "KV head" of width kv_lora + rope whose values are
  the latents themselves (their first kv_lora values are the output). On CUDA the decode
  rows' attention over the latents runs in a Triton kernel that reads them straight from the
  paged cache (``absorbed_paged``, attention/mla_decode_triton.py); on CPU ``absorbed``
  gathers them first (``decode_latents``) and is the kernel's reference.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata, PrefillGroup
from ..parallel.group import TPGroup
from .config import ModelConfig
from .llama import RMSNorm
from .sharding import TPShard

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them at its default eps


class MLARotary(nn.Module):
    """cos and sin of the rotary key's frequencies [max_pos, rope / 2] (YaRN's factor applied),
    for ``rotate``: interleaved pairs (x0, x1), (x2, x3) ... when ``rope_interleave`` (rotated
    into de-interleaved order, as transformers does: q and k alike, so their dot products are
    unchanged), else the first half against the second."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.mla is not None, "MLARotary needs an MLA config"
        inv = torch.tensor(cfg.mla.rope_inv_freq, dtype=torch.float32)
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", freqs.cos() * cfg.mla.rope_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * cfg.mla.rope_scaling, persistent=False)

    def tables(self, positions, dtype: torch.dtype):
        """positions [T] -> (cos, sin), each [T, 1, rope / 2] in the activations' dtype."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)



def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, heads, rope] -> rotated copy (cos, sin: MLARotary.tables)."""
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup):
        super().__init__()
        m = cfg.mla
        assert m is not None and group.size == 1, "MLA runs unsharded (sharding.model_tp_problems refuses TP)"
        self.m, self.num_heads = m, cfg.num_heads
        bias = cfg.o_bias  # config.json attention_bias: q_a, kv_a and o projections
        H, hidden = cfg.num_heads, cfg.hidden_size
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, hidden, bias=bias)

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        m, H, T = self.m, self.num_heads, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, H, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        cos, sin = rope
        q_rope = rotate(q_rope, cos, sin, m.rope_interleave)  # [T, H, rope]
        k_rope = rotate(k_rope.unsqueeze(1), cos, sin, m.rope_interleave).squeeze(1)  # [T, rope]
        latent = torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1)  # [T, latent]
        write_latents(kv_cache, latent, meta.slot_mapping)
        out = x.new_empty(T, H, m.v_head_dim)
        if meta.num_decodes:
            d = meta.num_decodes
            if kv_cache.is_cuda:  # the Triton kernel reads the latents from the paged cache
                out[:d] = self.absorbed_paged(q_nope[:d], q_rope[:d], kv_cache, meta)
            else:
                out[:d] = self.absorbed(q_nope[:d], q_rope[:d], decode_latents(kv_cache, meta), meta.decode_mask)
        for g in meta.prefills:
            rows = slice(g.q_start, g.q_start + g.q_len)
            ctx = latent[rows] if g.key_slots is None else read_latents(kv_cache, g.key_slots)  # [K, latent]
            out[rows] = self.plain(q_nope[rows], q_rope[rows], ctx, g)
        return self.o_proj(out.view(T, H * m.v_head_dim))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's per-head up-projections: W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora] (views)."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """[D, H, v] for decode rows q [D, H, *] over their contexts' latents ctx [D, L, latent]
        (mask: [D, 1, 1, L] additive for padded contexts, or None)."""
        q_abs = self._absorb_query(q_nope, q_rope).unsqueeze(1)  # [D, 1, H, latent]: heads as query rows
        kv = ctx.unsqueeze(1)  # [D, 1, L, latent]: one "KV head", values = the latents
        o = F.scaled_dot_product_attention(q_abs, kv, kv, attn_mask=mask, scale=self.m.softmax_scale)
        o_lat = o[:, 0, :, :self.m.kv_lora_rank]  # [D, H, kv_lora]
        return torch.einsum("dhc,hvc->dhv", o_lat, self._w_uk_uv()[1])  # [D, H, v]

    def absorbed_paged(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """``absorbed`` for the decode rows of ``meta`` with the attention over the latents done
        by the Triton kernel (attention/mla_decode_triton.py) straight from the paged cache
        kv_cache [2, blocks, block_size, 1, latent / 2] through meta's block tables and
        seq_lens (no mask): CUDA tensors, or CPU ones under TRITON_INTERPRET=1 (the tests)."""
        from ..attention.mla_decode_triton import mla_decode  # imports triton, which CPU installs may lack
        o_lat = mla_decode(self._absorb_query(q_nope, q_rope), kv_cache[0], kv_cache[1], meta.decode_block_tables,
                           meta.decode_seq_lens, kv_lora_rank=self.m.kv_lora_rank,
                           scale=self.m.softmax_scale)  # [D, H, kv_lora]
        return torch.einsum("dhc,hvc->dhv", o_lat, self._w_uk_uv()[1])  # [D, H, v]

    def _absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[D, H, latent]: W_UK folded into the query, [W_UK_h^T q_nope_h | q_rope_h] per head."""
        q_lat = torch.einsum("dhn,hnc->dhc", q_nope, self._w_uk_uv()[0])  # [D, H, kv_lora]
        return torch.cat((q_lat, q_rope), dim=-1)

    def plain(self, q_nope: torch.Tensor, q_rope: torch.Tensor, ctx: torch.Tensor, g: PrefillGroup) -> torch.Tensor:
        """[Q, H, v] for a prefill group's rows over its keys' latents ctx [K, latent], the
        group's block-diagonal causal mask (or is_causal for a lone chunk without context)."""
        assert g.mask is not None or g.key_slots is None, "MLA prefill takes masked groups (no varlen)"
        m, H, K = self.m, self.num_heads, ctx.shape[0]
        kv = self.kv_b_proj(ctx[:, :m.kv_lora_rank]).view(K, H, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, ctx[:, None, m.kv_lora_rank:].expand(K, H, m.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=g.mask, is_causal=g.key_slots is None,
                                           scale=m.softmax_scale)  # [H, Q, v]
        return o.transpose(0, 1)


def write_latents(kv_cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_cache [2, blocks, block_size, 1, latent / 2] at ``slots``: K half = latent[:, :half], V half the rest."""
    half = kv_cache.shape[-1]
    kv_cache[0].view(-1, half).index_copy_(0, slots, latent[:, :half])
    kv_cache[1].view(-1, half).index_copy_(0, slots, latent[:, half:])


def read_latents(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[len(slots), latent]: the latents cached at ``slots``."""
    half = kv_cache.shape[-1]
    return torch.cat((kv_cache[0].view(-1, half).index_select(0, slots),
                      kv_cache[1].view(-1, half).index_select(0, slots)), dim=-1)


def decode_latents(kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[D, max_blocks * block_size, latent]: each decode row's blocks, through its block table."""
    flat = meta.decode_block_tables.flatten()
    d = meta.decode_block_tables.shape[0]
    halves = [kv_cache[i].index_select(0, flat).view(d, -1, kv_cache.shape[-1]) for i in (0, 1)]
    return torch.cat(halves, dim=-1)

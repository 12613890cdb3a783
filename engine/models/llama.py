"""The dense family: a Llama-family decoder in plain torch (RMSNorm, RoPE (default, linear
or llama3 scaling), grouped-query attention over the paged KV cache, SwiGLU MLP) and its
registration (``FAMILY``, families.py). One class serves Llama 2/3/3.1, Qwen2, Qwen3 and
Mistral: their differences are flags of ``ModelConfig`` (``qkv_bias``, ``o_bias``,
``mlp_bias``, ``qk_norm``, ``tie_word_embeddings``, ``head_dim``), not subclasses:

    family   | qkv_bias           | o_bias         | qk_norm | tied embeddings | sliding window
    ---------+--------------------+----------------+---------+-----------------+-----------------
    Llama    | attention_bias     | attention_bias | no      | from config     | none
    Qwen2    | always             | never          | no      | from config     | common/hf_config
    Qwen3    | attention_bias     | attention_bias | yes     | from config     | common/hf_config
    Mistral  | never              | never          | no      | from config     | common/hf_config

The model sees one flat batch of T tokens from many requests (see
``attention/base.py``); it never holds a per-request KV tensor. Weights use
Hugging Face names except that q/k/v and gate/up projections are fused
(``qkv_proj``, ``gate_up_proj``) by the loader, halving the matmul launches.

Tensor parallelism (``group.size = t > 1``; what each rank holds: sharding.py): every
rank runs this forward on its shard, in lockstep, with these collectives::

    embed_tokens   vocab-parallel: ids outside the rank's rows look up zeros   all_reduce [T, hidden]
    per layer      qkv_proj, gate_up_proj column-parallel (local heads, local MLP columns)
                   o_proj, down_proj row-parallel: partial sums                 all_reduce [T, hidden] x 2
    lm_head        vocab-parallel: each rank its rows' logits                   all_gather [S, V/t] -> [S, V]

Every rank gets the whole logits (all_gather rather than gather to rank 0): one
collective that NCCL captures in a CUDA graph like the all-reduces, the same shapes on
every rank, and at decode S rows x V floats is small beside the weights a step reads.
Only rank 0 samples from them. With ``t = 1`` the layers are the plain ones.
"""

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ...common.hf_config import architecture
from ..attention.base import AttentionBackend, AttentionMetadata
from .config import ModelConfig
from .family import ModelFamily, ParamCount
from ..parallel.group import TPGroup
from .sharding import DENSE_SHARDING, TPShard, shard_of


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


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each computes its
    partial product, the all-reduce sums them, then the (whole, replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x):  # x [T, in_features / t] -> [T, out_features]
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def row_linear(in_features: int, out_features: int, bias: bool, group: TPGroup) -> nn.Linear:
    """The plain layer at TP=1 (bitwise what it was before TP), else row-parallel."""
    if group.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the (padded) vocabulary; other ids look up zeros and the
    all-reduce fills them from the rank that holds them."""

    def __init__(self, shard: TPShard, hidden: int, group: TPGroup):
        super().__init__(shard.vocab_rows, hidden)
        self.start, self.group = shard.vocab.start, group

    def forward(self, ids):  # ids [T] global token ids -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x)


class ParallelLMHead(nn.Linear):
    """The LM head over this rank's vocabulary rows; the logits of all ranks are gathered,
    padding columns cut off."""

    def __init__(self, shard: TPShard, hidden: int, group: TPGroup):
        super().__init__(hidden, shard.vocab_rows, bias=False)
        self.vocab_size, self.group = shard.vocab_size, group

    def forward(self, x):  # x [S, hidden] -> [S, vocab]
        return self.group.all_gather(F.linear(x, self.weight), dim=-1)[:, : self.vocab_size]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup):
        super().__init__()
        # this rank's query and KV heads (all of them at TP=1)
        self.num_heads, self.kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = row_linear(q_size, cfg.hidden_size, cfg.o_bias, group)
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
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup):
        super().__init__()
        self.inter = shard.intermediate_size  # this rank's columns
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = row_linear(self.inter, cfg.hidden_size, cfg.mlp_bias, group)

    def forward(self, x):  # x [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # each [T, intermediate / t]
        return self.down_proj(F.silu(gate) * up)


# (cfg, shard, group, layer index) -> that layer's feed-forward block, [T, hidden] -> [T, hidden]
# (the whole sum on every rank): a family's choice, the dense MLP by default
FeedForward = Callable[[ModelConfig, TPShard, TPGroup, int], nn.Module]


def dense_mlp(cfg: ModelConfig, shard: TPShard, group: TPGroup, layer: int) -> nn.Module:
    """The dense family's feed-forward block, the same on every layer."""
    return MLP(cfg, shard, group)


class Rotary(Protocol):
    """The rotary tables a model's attention blocks read (``RotaryEmbedding``, mla.MLARotary)."""

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


# (cfg, shard, group) -> a layer's attention block: forward(x [T, hidden], rope tables,
# kv_cache of the layer, AttentionMetadata, AttentionBackend) -> [T, hidden], the whole sum on
# every rank: a family's choice, grouped-query attention (``Attention``) by default
AttentionBlock = Callable[[ModelConfig, TPShard, TPGroup], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup | None = None, feed_forward: FeedForward = dense_mlp,
                 attention: AttentionBlock = Attention, rope: Callable[[ModelConfig], Rotary] = RotaryEmbedding):
        """The whole model, or with a ``group`` of size t > 1 rank ``group.rank``'s shard;
        ``feed_forward`` builds each layer's feed-forward block, ``attention`` its attention
        block, ``rope`` the rotary tables every layer's attention gets (``tables(positions,
        dtype)``)."""
        super().__init__()
        self.cfg = cfg
        group = group if group is not None else TPGroup.single("cpu")
        dp = group.data_parallel
        self.shard = shard_of(cfg, group.rank, group.size, group.expert_parallel,
                              *((dp.rank, dp.size) if dp is not None else (0, 1)))
        self.group = group
        if group.size == 1:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(self.shard, cfg.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attention(cfg, self.shard, group),
                                                 feed_forward(cfg, self.shard, group, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.make_rope = rope  # the loader rebuilds the tables off the meta device
        self.rope = rope(cfg)
        if group.size == 1:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(self.shard, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                logits_indices: torch.Tensor, before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, hd]
        (this rank's KV heads); logits_indices: [S] rows whose next-token logits are wanted.
        ``before_layer(i)``: called before layer i touches ``kv_caches[i]`` (the step's
        lower-tier loads of that layer land there). Returns [S, vocab] float32 (the whole
        vocabulary on every rank)."""
        if self.group.data_parallel is not None:  # the MoE layers gather every rank's tokens
            self.group.data_parallel.begin_forward(input_ids.shape[0])
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rope.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, rope, kv_caches[i], meta, backend)
        if self.group.data_parallel is not None:  # every collective of the forward issued
            self.group.data_parallel.end_forward()
        x = self.norm(x[logits_indices])  # RMSNorm is per row: normalizing only the needed rows is exact
        return self.lm_head(x).float()


# architectures[0] -> (qkv bias, o_proj bias, q/k RMSNorm); None: the config's attention_bias
DENSE_FLAGS: dict[str, tuple[bool | None, bool | None, bool]] = {
    "LlamaForCausalLM": (None, None, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (None, None, True),
    "MistralForCausalLM": (False, False, False),
}


def dense_config(cfg: dict) -> ModelConfig:
    """The config adapter of the dense family: config.json with the architecture's flags."""
    return ModelConfig.from_hf(cfg, *DENSE_FLAGS[architecture(cfg)])


def dense_parameters(cfg: ModelConfig) -> ParamCount:
    """CausalLM's parameters (a tied head counted once), from the config's shapes alone;
    every one is active for every token."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h + cfg.qkv_bias * (q + 2 * kv) + cfg.o_bias * h + cfg.qk_norm * 2 * hd
    mlp = 3 * h * cfg.intermediate_size + cfg.mlp_bias * (2 * cfg.intermediate_size + h)
    layer = attn + mlp + 2 * h  # + input and post-attention norms
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    total = cfg.vocab_size * h + cfg.num_layers * layer + h + head
    return ParamCount(total, total)


def hf_names(key: str) -> str:
    """The dense family's checkpoints use the module's Hugging Face names already."""
    return key


FAMILY = ModelFamily(architectures=tuple(DENSE_FLAGS), config=dense_config, module=CausalLM,
                     weight_map=hf_names, sharding=DENSE_SHARDING, parameters=dense_parameters)

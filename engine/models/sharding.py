"""Which part of the model one tensor-parallel rank holds (Megatron-style), and the one
set of slicing rules every loader applies (safetensors reads only the rank's slices;
dummy weights are drawn whole and sliced, so TP=t equals the TP=1 dummy model).

Owns ``TPShard`` (a rank's query heads, KV heads, MLP columns and vocabulary rows),
``check_model_tp`` (the model-dependent checks of ``tensor_parallel_size``), the
``ShardingPlan`` a model family names (family.py; ``StackSlot``: per-expert tensors stacked
at load) and the dense module's plan (``DENSE_SHARDING``: the slicing of each weight
below). Must not: run collectives (llama.py places them) or read files.

With ``t`` ranks, ``Hq`` query heads, ``H`` KV heads, intermediate size ``I``,
vocabulary ``V`` padded to ``t * ceil(V / t)`` rows, rank ``r`` holds::

    weight (our names)             split on           rank r holds
    embed_tokens, lm_head          vocab rows         [r*Vr, (r+1)*Vr), Vr = ceil(V/t); rows >= V are zero
    self_attn.qkv_proj (q|k|v)     output rows        q: heads [r*Hq/t, (r+1)*Hq/t); k, v: its KV heads
                                                      (common/kv_heads.rank_heads: a slice, or one head
                                                      replicated when H < t); biases alike
    self_attn.o_proj               input columns      its q heads' columns; bias whole, added after the sum
    mlp.gate_up_proj (gate|up)     output rows        [r*I/t, (r+1)*I/t) of each; biases alike
    mlp.down_proj                  input columns      the same columns; bias whole, added after the sum
    norms (q_norm, k_norm too)     -                  replicated (they act per row or per head)

A MoE family's plan (moe_family.py) adds its experts: cut like the dense MLP, or under
expert parallelism (``TPShard.expert_parallel``) rank r holds experts [r*E/t, (r+1)*E/t)
whole and reads no byte of the others (``ShardingPlan.held``).

Query head h uses KV head ``h // (Hq/H)``; a rank's query heads all use KV heads it holds
(in both cases of rank_heads), so grouped-query attention stays local to the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ...common.kv_heads import HeadRange, rank_heads, tp_problem
from .config import ModelConfig


class TPShard(NamedTuple):
    """What rank ``rank`` of ``size`` holds of a model (``size == 1``: all of it)."""

    rank: int
    size: int
    q_heads: HeadRange  # global query heads
    kv_heads: HeadRange  # global KV heads: this rank's KV cache holds exactly these
    inter: HeadRange  # intermediate (MLP) columns [start, stop)
    vocab: HeadRange  # vocabulary rows [start, start + rows); rows at or past vocab_size are padding
    vocab_size: int  # the model's, unpadded
    # a MoE model's experts this rank holds whole [start, stop) under expert parallelism (over the
    # TP ranks, or a data-parallel node's ranks); else every expert (cut by columns at TP > 1)
    experts: HeadRange
    expert_parallel: bool  # the MoE layers are expert-parallel over the TP or DP ranks (a MoE model)

    @property
    def num_heads(self) -> int:
        return self.q_heads.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.size

    @property
    def intermediate_size(self) -> int:
        return self.inter.size

    @property
    def vocab_rows(self) -> int:
        return self.vocab.size

    @property
    def vocab_real_rows(self) -> int:
        """This rank's rows that are real tokens (the rest are padding)."""
        return max(0, min(self.vocab.stop, self.vocab_size) - self.vocab.start)


def model_tp_problems(cfg: ModelConfig, tp: int, expert_parallel: bool = False, dp: int = 1) -> list[str]:
    """Why ``cfg`` cannot be split over ``tp`` ranks (``expert_parallel``: its experts
    split whole over them) or its experts over ``dp`` data-parallel ranks, each naming the
    field and the numbers."""
    if tp < 1:
        return [f"tensor_parallel_size: must be >= 1, got {tp}"]
    problems = []
    if dp > 1 and cfg.moe is None:
        problems.append(f"data_parallel_size: {cfg.architecture} is a dense model: its data-parallel ranks "
                        f"would share nothing; start {dp} nodes instead")
    elif dp > 1 and cfg.moe is not None and cfg.moe.num_experts % dp:
        problems.append(f"data_parallel_size: {dp} ranks do not divide the model's {cfg.moe.num_experts} "
                        "experts; use a divisor of it")
    if cfg.mla is not None and tp > 1:
        return [f"tensor_parallel_size: {tp}: {cfg.architecture}'s latent KV cache has no heads to split over "
                "ranks; serve it on tensor_parallel_size 1 (data-parallel attention is not built yet)"]
    if expert_parallel and cfg.moe is None:
        problems.append(f"enable_expert_parallel: {cfg.architecture} is a dense model (no experts to split); "
                        "drop --enable-expert-parallel")
    if cfg.num_heads % tp:
        problems.append(f"tensor_parallel_size: {tp} does not divide the model's {cfg.num_heads} attention "
                        f"heads (num_attention_heads); use a divisor of {cfg.num_heads}")
    kv = tp_problem(tp, cfg.num_kv_heads)
    if kv is not None:
        problems.append(kv.replace("tensor_parallel_size ", "tensor_parallel_size: ", 1)
                        + " (num_key_value_heads)")
    widths = {"intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:  # the shared expert is cut like the dense MLP; so is each expert without EP
        widths.update(shared_expert_intermediate_size=cfg.moe.shared_expert_size)
        if not expert_parallel:
            widths.update(moe_intermediate_size=cfg.moe.intermediate_size)
        elif cfg.moe.num_experts % tp:
            problems.append(f"tensor_parallel_size: {tp} ranks of expert parallelism do not divide the model's "
                            f"{cfg.moe.num_experts} experts; use a divisor of it")
    for field, width in widths.items():
        if width % tp:
            problems.append(f"tensor_parallel_size: {tp} does not divide the model's {field} "
                            f"{width}; use a divisor of it")
    return problems


def check_model_tp(cfg: ModelConfig, tp: int, expert_parallel: bool = False, dp: int = 1) -> None:
    """Raise ``ValueError`` (every problem, what to change) unless ``cfg`` splits over ``tp`` ranks
    (and its experts over ``dp`` data-parallel ranks)."""
    problems = model_tp_problems(cfg, tp, expert_parallel, dp)
    if problems:
        raise ValueError("; ".join(problems))


def shard_of(cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False, dp_rank: int = 0,
             dp_size: int = 1) -> TPShard:
    """Rank ``rank``'s part of ``cfg`` (checked: raises ``ValueError`` when it does not split);
    a data-parallel rank ``dp_rank`` of ``dp_size`` (TP 1) holds its share of the experts."""
    check_model_tp(cfg, size, expert_parallel, dp_size)
    hq, inter = cfg.num_heads // size, cfg.intermediate_size // size
    rows = -(-cfg.vocab_size // size)  # ceil: the vocabulary is padded to size * rows
    num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
    split, part = (dp_size, dp_rank) if dp_size > 1 else (size, rank)  # the ranks the experts split over
    ep = num_experts > 0 and (dp_size > 1 or (expert_parallel and size > 1))
    per = num_experts // split if ep else num_experts
    experts = HeadRange(part * per, (part + 1) * per) if ep else HeadRange(0, num_experts)
    return TPShard(rank, size, HeadRange(rank * hq, (rank + 1) * hq), rank_heads(rank, size, cfg.num_kv_heads),
                   HeadRange(rank * inter, (rank + 1) * inter), HeadRange(rank * rows, (rank + 1) * rows),
                   cfg.vocab_size, experts, ep)


def split_range(width: int, shard: TPShard) -> HeadRange:
    """Rank ``shard``'s columns [start, stop) of a feed-forward ``width`` split evenly (checked by check_model_tp)."""
    part = width // shard.size
    return HeadRange(shard.rank * part, (shard.rank + 1) * part)


class Cut(NamedTuple):
    """The slice ``[start, stop)`` along ``dim`` of a full tensor that a rank holds;
    ``pad_to`` rows when the slice is padded (the vocabulary)."""

    dim: int
    start: int
    stop: int
    pad_to: int | None = None


def hf_cut(part: str, kind: str, shard: TPShard, cfg: ModelConfig) -> Cut | None:
    """The cut of one checkpoint tensor: ``part`` is its Hugging Face module path inside a
    layer (``self_attn.q_proj``) or ``embed_tokens`` / ``lm_head`` / ``norm``; ``kind``
    ``weight`` or ``bias``. None: the rank holds the whole tensor."""
    if shard.size == 1:
        return None
    hd = cfg.head_dim
    q, kv, inter = shard.q_heads, shard.kv_heads, shard.inter
    if part in ("embed_tokens", "lm_head"):
        return Cut(0, shard.vocab.start, shard.vocab.start + shard.vocab_real_rows, shard.vocab_rows)
    if part == "self_attn.q_proj":
        return Cut(0, q.start * hd, q.stop * hd)
    if part in ("self_attn.k_proj", "self_attn.v_proj"):
        return Cut(0, kv.start * hd, kv.stop * hd)
    if part in ("mlp.gate_proj", "mlp.up_proj"):
        return Cut(0, inter.start, inter.stop)
    if part == "self_attn.o_proj" and kind == "weight":
        return Cut(1, q.start * hd, q.stop * hd)
    if part == "mlp.down_proj" and kind == "weight":
        return Cut(1, inter.start, inter.stop)
    return None  # norms, o_proj and down_proj biases (added once, after the all-reduce)


# our fused name -> its Hugging Face parts, concatenated on the output dim in this order
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def cut(t: torch.Tensor, c: Cut | None) -> torch.Tensor:
    """``t``'s slice under ``c`` (a view unless padded), zero rows appended up to ``pad_to``."""
    if c is None:
        return t
    piece = t.narrow(c.dim, c.start, c.stop - c.start)
    if c.pad_to is None or c.pad_to == piece.shape[c.dim]:
        return piece
    shape = list(piece.shape)
    shape[c.dim] = c.pad_to - shape[c.dim]
    return torch.cat((piece, piece.new_zeros(shape)), dim=c.dim)


def shard_full(name: str, full: torch.Tensor, shard: TPShard, cfg: ModelConfig) -> torch.Tensor:
    """Rank ``shard``'s part of ``full``, the TP=1 model's parameter ``name`` (our names,
    fused q/k/v and gate/up): what the dummy loader draws whole and cuts."""
    if shard.size == 1:
        return full
    kind = name.rsplit(".", 1)[1]
    top = name.split(".", 1)[0]
    if top in ("embed_tokens", "lm_head", "norm"):
        return cut(full, hf_cut(top, kind, shard, cfg)).contiguous()
    part = name.split(".", 2)[2].rsplit(".", 1)[0]  # layers.<i>.<part>.<kind>
    if part in FUSED:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv] if part == "self_attn.qkv_proj" else [cfg.intermediate_size] * 2
        pieces = full.split(sizes, dim=0)
        return torch.cat([cut(p, hf_cut(hf, kind, shard, cfg)) for p, hf in zip(pieces, FUSED[part])])
    return cut(full, hf_cut(part, kind, shard, cfg)).contiguous()


class StackSlot(NamedTuple):
    """Where one checkpoint tensor goes in a stacked parameter (a MoE's experts, [E, ...]):
    each row of the stack is its pieces concatenated on dim 0, in piece order."""

    name: str  # the stacked parameter's name inside a layer (mlp.w13)
    row: int  # its row of the rank's stack (the expert, counted from the rank's first)
    piece: int  # its place among the row's pieces (gate 0, up 1)


def unstacked(name: str, shard: TPShard) -> StackSlot | None:
    """The dense family stacks nothing."""
    return None


def everything(name: str, shard: TPShard) -> bool:
    """The dense family's ranks each hold a part of every tensor."""
    return True


class ShardingPlan(NamedTuple):
    """How a family's module is cut over tensor-parallel ranks (its checkpoint names:
    Hugging Face-style, after the family's weight map)."""

    fused: dict[str, tuple[str, ...]]  # the module's fused name -> its checkpoint parts, in order
    cut: Callable[[str, str, TPShard, ModelConfig], Cut | None]  # (part, kind, shard, cfg): as hf_cut
    full: Callable[[str, torch.Tensor, TPShard, ModelConfig], torch.Tensor]  # as shard_full
    # a checkpoint tensor's name inside a layer (after the weight map: mlp.experts.3.gate_proj.weight)
    # and the rank's shard -> its slot in the rank's stacked parameter, or None; only for held tensors
    stacked: Callable[[str, TPShard], StackSlot | None] = unstacked
    # (name inside a layer, shard) -> whether the rank holds any of it (False: never read)
    held: Callable[[str, TPShard], bool] = everything


DENSE_SHARDING = ShardingPlan(FUSED, hf_cut, shard_full)

"""The Mixture-of-Experts feed-forward block (``MoEBlock``) and the family's choice of it per
layer (``moe_feed_forward``, a llama.FeedForward): a router gate scores the experts, each
token goes to its top k (``route``: softmax, top-k, renormalised when ``norm_topk_prob``, as
the Qwen-MoE families and Mixtral route; or DeepSeek-V3's sigmoid scores with a score bias,
expert groups and a routed scaling: moe_config.Scoring), the experts' SwiGLUs run in one
``fused_moe`` call (fused_moe.py), and a shared expert, if any, adds its SwiGLU of every
token (Qwen2-MoE gates it by ``sigmoid(shared_expert_gate(x))``, DeepSeek-V3 does not).

Experts are stacked: ``w13`` [E, 2 * I, H] (each expert's gate rows, then its up rows) and
``w2`` [E, H, I]; the loader stacks the checkpoint's per-expert tensors into them
(sharding.StackSlot). Over t ranks (moe_family.py's plan) either

    tensor parallel   each rank holds every expert's columns [r*I/t, (r+1)*I/t) and runs
                      every (token, expert) pair on them: partial sums, all-reduced
    expert parallel   rank r holds experts [r*E/t, (r+1)*E/t) whole. Attention is tensor
                      parallel, so every rank has every token's activations after it:
                      dispatch is local (a rank keeps the pairs of its experts, the rest
                      are marked skipped, id E_local, for fused_moe) and the combine is
                      the all-reduce of the ranks' partial sums, one [T, H] collective as
                      in the dense MLP. A rank runs T*k/t pairs on average, not T*k, and
                      reads only its experts' weights.
    data parallel     (ranks/data_parallel.py) rank r of a data-parallel node holds experts
                      [r*E/N, (r+1)*E/N) whole and its own tokens only: each rank's T_r
                      rows, padded to P = max T_r, are all-gathered ([N*P, H]: dispatch), every
                      rank runs its experts' pairs of all of them, and the partial sums are
                      all-reduced; each rank keeps its own rows (combine). Padding rows route
                      nowhere (skipped). A rank with no tokens still joins with P zero rows.

Each forward counts the tokens routed to each expert
(``expert_tokens``); ``expert_load_imbalance`` reads them as max / mean per layer, for the
load-imbalance metric. Must not: read weights or configs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .moe_config import MoEConfig, Scoring
from .fused_moe import fused_moe
from .llama import MLP, dense_mlp
from ..parallel.group import TPGroup
from .sharding import TPShard, split_range


class BiasedGate(nn.Module):
    """The sigmoid router's gate: ``weight`` [E, H] and the score bias ``e_score_correction_bias``
    [E] that only steers the choice of experts (transformers' names)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)


def route(moe: MoEConfig, gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) of the tokens x [T, H] (moe_config.py's table)."""
    if moe.scoring is Scoring.SOFTMAX:
        probs = F.softmax(gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    assert isinstance(gate, BiasedGate), "the sigmoid router's gate"
    scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [T, E]
    choice = scores + gate.e_score_correction_bias.float()
    per_group = moe.num_experts // moe.num_groups
    groups = choice.view(-1, moe.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best = torch.topk(groups, moe.topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
    keep = torch.zeros_like(groups).scatter_(1, best, 1.0).bool()  # [T, G]
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


class MoEBlock(nn.Module):
    expert_tokens: torch.Tensor  # [E] int64: tokens routed to each expert by the last forward

    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup):
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "MoEBlock needs a MoE config"
        E, H = moe.num_experts, cfg.hidden_size
        inter = moe.intermediate_size if shard.expert_parallel else moe.intermediate_size // shard.size
        self.moe, self.group = moe, group
        self.experts = shard.experts  # held: [first, first + local)
        local = shard.experts.size
        self.expert_parallel = shard.expert_parallel
        self.data_parallel = group.data_parallel
        # router: replicated on every rank
        self.gate = nn.Linear(H, E, bias=False) if moe.scoring is Scoring.SOFTMAX else BiasedGate(H, E)
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, H))  # [E_local, 2 * I_rank, H]: gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(local, H, inter))  # [E_local, H, I_rank]
        if moe.shared_expert_size:
            shared = shard._replace(inter=split_range(moe.shared_expert_size, shard))
            self.shared_expert = MLP(cfg, shared, group)
            if moe.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.has_shared = bool(moe.shared_expert_size)
        self.shared_gated = self.has_shared and moe.shared_expert_gated
        # filled in place by every forward, captured CUDA graphs' replays included; on the CPU even
        # when the loader builds the module on "meta" (it moves with the module, like rope's tables)
        self.register_buffer("expert_tokens", torch.zeros(E, dtype=torch.int64, device="cpu"), persistent=False)

    def forward(self, x):  # x [T, H] -> [T, H]
        if self.data_parallel is not None:
            y = self._data_parallel_experts(x)
        else:
            y = self._routed(x, None)  # [T, H]: this rank's partial sums
            if self.group.size > 1:
                y = self.group.all_reduce(y)
        if self.shared_gated:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.has_shared:
            y = y + self.shared_expert(x)
        return y

    def _routed(self, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """[T, H]: x's tokens through this rank's experts (all of them without expert parallelism),
        counted in ``expert_tokens``; ``real`` [T] bool: the rows that are tokens (None: all)."""
        weights, ids = route(self.moe, self.gate, x)  # each [T, k]
        if real is not None:  # padding rows: skipped, and not counted
            ids = ids.masked_fill(~real[:, None], self.moe.num_experts)
        flat = ids.flatten()  # index_add_ rather than bincount: no host sync, so a CUDA graph captures it
        counts = torch.zeros(self.moe.num_experts + 1, dtype=torch.int64, device=flat.device)
        self.expert_tokens.copy_(counts.index_add_(0, flat, torch.ones_like(flat))[:-1])
        if self.expert_parallel:  # dispatch: this rank's experts' pairs; the others' skipped (id E_local)
            local = ids - self.experts.start
            ids = torch.where((local >= 0) & (local < self.experts.size), local, self.experts.size)
        return fused_moe(x, self.w13, self.w2, ids, weights)

    def _data_parallel_experts(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H]: this rank's tokens through every rank's experts (the data-parallel path above)."""
        dp = self.data_parallel
        assert dp is not None and len(dp.counts) == dp.size, "CausalLM.forward calls dp.begin_forward first"
        rows, T = dp.padded, x.shape[0]
        padded = x.new_zeros(rows, x.shape[1])
        padded[:T] = x
        everyone = dp.all_gather(padded)  # [N * P, H]
        real = (torch.arange(rows, device=x.device)[None, :]
                < torch.tensor(dp.counts, device=x.device)[:, None]).flatten()  # [N * P]
        y = dp.all_reduce(self._routed(everyone, real))  # every rank's experts' sums
        return y[dp.rank * rows:dp.rank * rows + T]


def moe_feed_forward(cfg: ModelConfig, shard: TPShard, group: TPGroup, layer: int) -> nn.Module:
    """A MoE family's feed-forward block of ``layer``: the MoE block, or the dense MLP on its dense layers."""
    assert cfg.moe is not None
    return MoEBlock(cfg, shard, group) if cfg.moe.is_sparse(layer) else dense_mlp(cfg, shard, group, layer)


def expert_load_imbalance(model: nn.Module) -> dict[int, float]:
    """layer index -> max / mean of the tokens its experts got in the last forward (1.0: even;
    E: all on one expert), for each MoE layer that routed any token; one copy to the host."""
    blocks = {int(name.split(".")[1]): m for name, m in model.named_modules() if isinstance(m, MoEBlock)}
    if not blocks:
        return {}
    counts = torch.stack([b.expert_tokens for b in blocks.values()]).float()  # [MoE layers, E]
    ratio = (counts.amax(dim=1) / counts.mean(dim=1)).tolist()
    return {layer: r for layer, r in zip(blocks, ratio) if r == r}  # NaN: no token routed

"""MoEConfig: the Mixture-of-Experts part of a checkpoint's architecture (experts, top-k,
how the router scores and picks them, a shared expert, which layers stay dense), frozen
inside ``ModelConfig.moe``. Read by the MoE families' config adapters (moe_family.py,
deepseek.py); owns nothing else (no torch, no weights).

Two routers (``Scoring``), as transformers computes them:

    softmax  (Qwen-MoE, Mixtral)  p = softmax(logits); top-k of p; renormalised if norm_topk_prob
    sigmoid  (DeepSeek-V3)        s = sigmoid(logits); choice = s + score bias; the experts split into
                                  num_groups groups, each scored by its 2 best choices; top-k of
                                  the topk_groups best groups' experts; weights s of those (renormalised
                                  if norm_topk_prob), times routed_scaling
"""

import enum
from dataclasses import dataclass


class Scoring(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"  # with a learned score bias (e_score_correction_bias) and expert groups


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int  # routed experts per token (num_experts_per_tok)
    intermediate_size: int  # one expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the k chosen scores to sum to 1
    shared_expert_size: int  # 0: none; else a dense SwiGLU of this width on every token
    dense_layers: tuple[int, ...]  # layers whose feed-forward is the dense MLP (mlp_only_layers, decoder_sparse_step)
    shared_expert_gated: bool = True  # the shared expert's output scaled by sigmoid(shared_expert_gate(x))
    scoring: Scoring = Scoring.SOFTMAX
    num_groups: int = 1  # sigmoid: expert groups (n_group)
    topk_groups: int = 1  # sigmoid: groups the top-k is drawn from (topk_group)
    routed_scaling: float = 1.0  # sigmoid: the routed experts' weights times this (routed_scaling_factor)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

"""MoEConfig: the Mixture-of-Experts part of a checkpoint's architecture (experts, top-k,
their normalisation, a shared expert, which layers stay dense), frozen inside
``ModelConfig.moe``. Read by the MoE families' config adapter (moe_family.py); owns
nothing else (no torch, no weights).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int  # routed experts per token (num_experts_per_tok)
    intermediate_size: int  # one expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the k softmax probabilities to sum to 1
    shared_expert_size: int  # 0: none; else a dense SwiGLU of this width on every token, gated by sigmoid
    dense_layers: tuple[int, ...]  # layers whose feed-forward is the dense MLP (mlp_only_layers, decoder_sparse_step)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

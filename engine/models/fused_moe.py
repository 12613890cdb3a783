"""The fused MoE layer's expert computation: every token through its top-k experts' SwiGLU
MLPs, weighted by the router's scores and summed. Owns the math only; the router, the
shared expert and any expert-parallel dispatch belong to the MoE block (moe.py).

    x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ x[t],  e = topk_ids[t, j]

A pair whose id is E (one past the last expert) is skipped: it adds nothing to its token's
row. Under expert parallelism the MoE block marks so the pairs of experts another rank holds.

``fused_moe`` runs the Triton grouped GEMM (fused_moe_triton.py) on CUDA tensors and
``fused_moe_torch`` otherwise; the torch path is also the kernel's correctness reference.
"""

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> None:
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, f"x {tuple(x.shape)} w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}"
    num_experts, two_inter, hidden = w13.shape
    assert x.shape[1] == hidden and two_inter % 2 == 0, f"x {tuple(x.shape)} vs w13 {tuple(w13.shape)}"
    assert tuple(w2.shape) == (num_experts, hidden, two_inter // 2), f"w2 {tuple(w2.shape)} vs w13 {tuple(w13.shape)}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0]
    assert topk_ids.dtype == torch.int64 and topk_weights.is_floating_point()
    assert x.dtype == w13.dtype == w2.dtype, f"x {x.dtype} w13 {w13.dtype} w2 {w2.dtype}"


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
    """The reference: (token, slot) pairs sorted by expert, one gate/up and one down matmul
    per expert that has tokens, then the scores-weighted sum back into token rows. Returns
    [T, H] in x's dtype; the combine accumulates in fp32 (fp64 for fp64 inputs)."""
    _check(x, w13, w2, topk_ids, topk_weights)
    num_tokens, k = topk_ids.shape
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1)  # [T*k]: pair p = token p // k, slot p % k
    order = torch.argsort(flat, stable=True)  # [T*k] pairs in expert order
    counts = torch.bincount(flat, minlength=w13.shape[0] + 1).tolist()[:-1]  # expert -> pairs; E: skipped
    tokens = order // k  # [T*k] each sorted pair's token
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.promote_types(x.dtype, torch.float32),
                      device=x.device)  # [T, H]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start:start + n]
        xe = x[tokens[start:start + n]]  # [n, H]
        gu = xe @ w13[expert].t()  # [n, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n, I]
        y = (h @ w2[expert].t()).to(out.dtype)  # [n, H]
        w = topk_weights.reshape(-1)[rows].to(out.dtype)  # [n]
        out.index_add_(0, tokens[start:start + n], y * w[:, None])
        start += n
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token through its top-k experts, weighted by topk_weights, in x's dtype.
    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k] int64 in [0, E] (E: skip the
    pair), topk_weights [T, k]."""
    if x.is_cuda:
        from .fused_moe_triton import fused_moe_triton  # imports triton, which CPU installs may lack
        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights)
    return fused_moe_torch(x, w13, w2, topk_ids, topk_weights)

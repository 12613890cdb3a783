"""The fused MoE layer's Triton path (the contract of ``fused_moe.fused_moe_torch``, which is
its reference): a torch alignment step, two grouped-GEMM launches over all experts, and a
torch sum over each token's k slots. Imports triton: only ``fused_moe.py`` (CUDA tensors)
and the tests import this; it must not route, dispatch across ranks or hold weights.

Alignment (vLLM's moe_align_block_size): the T*k (token, slot) pairs, p = t*k + j, sorted
by expert, each expert's run padded to a multiple of BLOCK_M with the sentinel P = T*k;
every BLOCK_M rows belong to one expert (E: the skipped pairs' run, or a padding block past
the last expert's run; the kernels skip both, and a skipped pair's y row stays zero):

    sorted_ids [P + (E+1)*(BLOCK_M-1)] | e0 e0 e0 P | e2 e2 e2 e2 | e2 P P P | P P P P ... |
    expert_ids [sorted_ids / BLOCK_M] |     0      |      2      |    2     |     E  ...  |

    _gate_up: h[p]   = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)   # h [P, I]
    _down:    y[p]   = topk_weights[p] * (h[p] @ w2[e]^T)                     # y [P, H] fp32
    out[t]           = sum_j y[t*k + j]                                       # [T, H]

One program per (BLOCK_M rows, BLOCK_N columns); the dots accumulate in fp32 ("ieee" for
fp32, bf16 widened to fp32 as the interpreter needs, fp16 native). Runs under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors), set before this module is imported.
"""

from typing import NamedTuple

import torch
import triton  # type: ignore[import-untyped]  # triton ships neither stubs nor py.typed
import triton.language as tl  # type: ignore[import-untyped]  # likewise

BLOCK_M = 16  # tl.dot's smallest tile side: decode batches are small
BLOCK_N = 64
BLOCK_K = 32


class Alignment(NamedTuple):
    sorted_ids: torch.Tensor  # [P + (E+1)*(BLOCK_M-1)] int64 pair ids in expert order, P = padding
    expert_ids: torch.Tensor  # [len(sorted_ids) // BLOCK_M] int64 each block's expert, E = unused block


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs by expert and pad each expert's run to ``block_m`` rows, on the ids'
    device with static sizes and no host read (a CUDA graph can capture it). Pairs of id
    ``num_experts`` (skipped) sort last, into blocks of expert E, which the kernels skip."""
    flat = topk_ids.reshape(-1)  # [P]
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # [P]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E + 1]; not bincount, which reads its max on the host (no CUDA graph)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    run_start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    expert = flat[order]  # [P] each sorted pair's expert
    rank = torch.arange(pairs, device=flat.device) - run_start[expert]  # [P] place in its expert's run
    sorted_ids = torch.full((pairs + (num_experts + 1) * (block_m - 1),), pairs, dtype=torch.int64,
                            device=flat.device)
    sorted_ids[padded_end[expert] - padded[expert] + rank] = order
    block_start = torch.arange(0, sorted_ids.numel(), block_m, device=flat.device)  # [blocks]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts)  # [blocks]
    return Alignment(sorted_ids, expert_ids)


@triton.jit
def _gate_up(h_ptr, x_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, top_k, num_experts, inter, hidden,
             stride_x_t, stride_w_e, stride_w_n, stride_h_p,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + block)
    if expert >= num_experts:
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + m)  # [BM]
    row_ok = pair < num_pairs
    token = pair // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + expert * stride_w_e  # int64 offset: stacked weights pass 2^31 elements
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + kk < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x_t + (k0 + kk)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(w + n[None, :] * stride_w_n + (k0 + kk)[:, None], mask=b_mask, other=0.0)  # [BK, BN]
        u = tl.load(w + (inter + n)[None, :] * stride_w_n + (k0 + kk)[:, None], mask=b_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
    # rounded to h's dtype before silu * up, as the reference's matmul output is
    g_r = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u_r = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = g_r / (1.0 + tl.exp(-g_r)) * u_r
    tl.store(h_ptr + pair[:, None] * stride_h_p + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down(y_ptr, h_ptr, w_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_experts, hidden, inter,
          stride_h_p, stride_w_e, stride_w_n, stride_y_p,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
          DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + block)
    if expert >= num_experts:
        return
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + m)  # [BM]
    row_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + expert * stride_w_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + kk < inter
        a = tl.load(h_ptr + pair[:, None] * stride_h_p + (k0 + kk)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w + n[None, :] * stride_w_n + (k0 + kk)[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    # rounded to h's dtype before the score, as the reference's matmul output is
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(y_ptr + pair[:, None] * stride_y_p + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    """Same contract as ``fused_moe.fused_moe_torch``; x's rows and both weights contiguous."""
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x {x.dtype}: fp32, fp16 or bf16"
    assert x.dtype == w13.dtype == w2.dtype, f"x {x.dtype} w13 {w13.dtype} w2 {w2.dtype}"
    assert x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)} strides {x.stride()}: rows contiguous"
    assert w13.dim() == 3 and w13.is_contiguous() and w2.dim() == 3 and w2.is_contiguous(), "weights contiguous"
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    assert x.shape[1] == hidden and tuple(w2.shape) == (num_experts, hidden, inter) and two_inter == 2 * inter, \
        f"x {tuple(x.shape)} w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}"
    assert topk_ids.dtype == torch.int64 and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0]
    assert topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point()
    assert x.device == w13.device == w2.device == topk_ids.device == topk_weights.device
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    sorted_ids, expert_ids = align_block_size(topk_ids, num_experts, BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    y = torch.zeros((pairs, hidden), dtype=torch.float32, device=x.device)  # [P, H]; a skipped pair's row stays 0
    dot = dict(DOT_FP32=x.dtype != torch.float16, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    blocks = expert_ids.numel()
    _gate_up[(blocks, triton.cdiv(inter, BLOCK_N))](
        h, x, w13, sorted_ids, expert_ids, pairs, top_k, num_experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **dot, num_warps=4)
    _down[(blocks, triton.cdiv(hidden, BLOCK_N))](
        y, h, w2, weights, sorted_ids, expert_ids, pairs, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **dot, num_warps=4)
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)  # [T, H]

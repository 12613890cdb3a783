"""The torch reference attention backend (CPU, and any device as a fallback), split
into cache write, decode and prefill so the kernel backends can replace the first two.

Decode: all decode rows at once. Each request's blocks are gathered through its
block table into ``[D, kv_heads, max_len, head_dim]`` and the query heads that
share a KV head are folded into the query-length axis, so grouped-query
attention never copies K/V per query head:

    q [D, H, hd] -> [D, kv_heads, H/kv_heads, hd]   (head h uses KV head h // group)

Prefill: one call per PrefillGroup (prefill_batch.py). A lone chunk without cached
context attends to its own fresh K/V (is_causal); otherwise the group's keys are read
back from the cache in one gather over ``key_slots`` and go through torch's varlen
flash kernel (CUDA, half precision) or SDPA with the group's block-diagonal causal mask.
"""

from typing import cast

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata, PrefillGroup


def build_decode_mask(seq_lens: torch.Tensor, width: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
    """The additive ``[D, 1, 1, width]`` mask hiding each decode row's positions >= its
    seq_len (``AttentionMetadata.decode_mask``), on ``device``; None when no row is padded.
    Built where ``seq_lens`` lives (the CPU in the engine), then moved."""
    if not len(seq_lens) or int(seq_lens.min()) >= width:
        return None
    keep = torch.arange(width, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [D, width]
    mask = torch.zeros(keep.shape, dtype=dtype, device=seq_lens.device).masked_fill_(~keep, float("-inf"))
    return mask.view(len(seq_lens), 1, 1, width).to(device)


class TorchAttention(AttentionBackend):
    """Also the base of the kernel backends, which override ``write_cache`` and ``decode``
    and keep this class's prefill."""

    name = "torch"
    needs_decode_mask = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        num_tokens, num_heads, head_dim = q.shape
        self.write_cache(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self.decode(q[:meta.num_decodes], kv_cache, meta, out[:meta.num_decodes])
        for group in meta.prefills:
            self.prefill(q, k, v, kv_cache, group, out)
        return out.view(num_tokens, num_heads * head_dim)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        """kv_cache[0|1] at slot_mapping[t] = k[t] | v[t]."""
        kv_heads, head_dim = k.shape[1:]
        kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """out [D, H, hd] = attention of the decode rows q [D, H, hd] over their cached context."""
        nd, num_heads, head_dim = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, hd]
        kv_heads = k_cache.shape[2]
        flat = meta.decode_block_tables.flatten()  # [D * max_blocks]
        max_len = meta.decode_block_tables.shape[1] * k_cache.shape[1]
        # index_select copies whole blocks, about twice as fast as advanced indexing on CPU
        kd = k_cache.index_select(0, flat).view(nd, max_len, kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, flat).view(nd, max_len, kv_heads, head_dim).transpose(1, 2)
        qd = q.view(nd, kv_heads, num_heads // kv_heads, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out.copy_(od.reshape(nd, num_heads, head_dim))

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                g: PrefillGroup, out: torch.Tensor) -> None:
        """out[rows of g] = causal attention of the chunks of g (q, k, v, out: the whole flat batch)."""
        kv_heads, head_dim = kv_cache.shape[-2:]
        rows = slice(g.q_start, g.q_start + g.q_len)
        if g.key_slots is None:  # one chunk, nothing cached before it
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
            vp = v[rows].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            out[rows] = op[0].transpose(0, 1)
            return
        kg = kv_cache[0].view(-1, kv_heads, head_dim).index_select(0, g.key_slots)  # [K, kv_heads, hd]
        vg = kv_cache[1].view(-1, kv_heads, head_dim).index_select(0, g.key_slots)
        if g.mask is None:  # varlen flash: chunk boundaries from cu_q / cu_k, causal aligned bottom-right
            from torch.nn.attention.varlen import varlen_attn

            assert g.cu_q is not None, "a varlen group carries its chunks' offsets (prefill_batch._group)"
            # [Q, H, hd]; a tuple only when return_aux is asked for
            o = cast(torch.Tensor, varlen_attn(q[rows].contiguous(), kg, vg, g.cu_q, g.cu_k, g.max_q, g.max_k,
                                               window_size=(-1, 0), enable_gqa=True))
            out[rows] = o
            return
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, hd]
        op = F.scaled_dot_product_attention(qp, kg.transpose(0, 1).unsqueeze(0), vg.transpose(0, 1).unsqueeze(0),
                                            attn_mask=g.mask, enable_gqa=True)  # [1, H, Q, hd]
        out[rows] = op[0].transpose(0, 1)

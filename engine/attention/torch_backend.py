"""The torch reference attention backend (CPU, and any device as a fallback).

Decode: all decode rows at once. Each request's blocks are gathered through its
block table into ``[D, kv_heads, max_len, head_dim]`` and the query heads that
share a KV head are folded into the query-length axis, so grouped-query
attention never copies K/V per query head:

    q [D, H, hd] -> [D, kv_heads, H/kv_heads, hd]   (head h uses KV head h // group)

Prefill chunks: one SDPA call each; a chunk without cached context attends to its
own fresh K/V with a causal mask, a chunk after a cached prefix reads the whole
context back from the cache with an offset causal mask.
"""

import torch
import torch.nn.functional as F

from splitserve.engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        group = num_heads // kv_heads
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, hd]
        block_size = k_cache.shape[1]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            flat = meta.decode_block_tables.flatten()  # [D * max_blocks]
            max_len = meta.decode_block_tables.shape[1] * block_size
            # index_select copies whole blocks, about twice as fast as advanced indexing on CPU
            kd = k_cache.index_select(0, flat).view(nd, max_len, kv_heads, head_dim).transpose(1, 2)
            vd = v_cache.index_select(0, flat).view(nd, max_len, kv_heads, head_dim).transpose(1, 2)
            qd = q[:nd].view(nd, kv_heads, group, head_dim)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
            out[:nd] = od.reshape(nd, num_heads, head_dim)

        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if p.ctx_len == 0:
                kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
                vp = v[rows].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                total = p.ctx_len + p.q_len
                nb = (total + block_size - 1) // block_size
                table = p.block_table[:nb]
                kp = k_cache.index_select(0, table).view(-1, kv_heads, head_dim)[:total].transpose(0, 1).unsqueeze(0)
                vp = v_cache.index_select(0, table).view(-1, kv_heads, head_dim)[:total].transpose(0, 1).unsqueeze(0)
                # query i (absolute position ctx_len + i) sees keys 0 .. ctx_len + i
                qpos = torch.arange(p.ctx_len, total).unsqueeze(1)
                mask = torch.arange(total).unsqueeze(0) <= qpos  # [n, total] bool
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
            out[rows] = op[0].transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

"""One layer of a host-tier load (engine/kv/tier_streams.py) as one Triton kernel: the blocks in
host slots ``slots[i]`` (pinned memory, which the GPU reads directly over the bus: pinned
pages are mapped into its address space) are copied, layer ``layer`` only, into device
blocks ``blocks[i]`` of the KV cache. Scattered slots into scattered blocks cost one launch
per layer, where copies would cost one per block and layer (neither side is contiguous).

    host  [slots, layers, 2 (K, V), block_size, kv_heads, head_dim]   slot-major, contiguous
    kv    [layers, 2, num_blocks, block_size, kv_heads, head_dim]      the KV cache, contiguous

One program per (hit i, K or V, span of ``SPAN`` elements of the block's half). Runs under
the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) for the CPU tests; imports
triton, so only a CUDA offload and the tests import this.
"""

import torch
import triton  # type: ignore[import-untyped]  # triton ships neither stubs nor py.typed
import triton.language as tl  # type: ignore[import-untyped]  # likewise

SPAN = 1024  # elements one program copies


@triton.jit
def _load_layer(host_ptr, kv_ptr, slots_ptr, blocks_ptr, host_slot_stride, kv_half_stride, half_elems,
                SPAN: tl.constexpr):
    # host_ptr: the layer's first slot (host[0, layer]); kv_ptr: the layer's cache (kv[layer])
    i = tl.program_id(0)
    half = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * SPAN + tl.arange(0, SPAN)
    ok = offs < half_elems
    slot = tl.load(slots_ptr + i).to(tl.int64)
    block = tl.load(blocks_ptr + i).to(tl.int64)
    src = host_ptr + slot * host_slot_stride + half * half_elems + offs
    dst = kv_ptr + half * kv_half_stride + block * half_elems + offs
    tl.store(dst, tl.load(src, mask=ok), mask=ok)


def load_layer(host: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, layer: int) -> None:
    """Copy layer ``layer`` of host slots ``slots`` into KV cache blocks ``blocks`` (int64,
    on the cache's device, one per hit), queued on the current stream."""
    assert host.is_contiguous() and kv.is_contiguous() and host.dtype == kv.dtype
    assert host.shape[1:] == (kv.shape[0], 2, *kv.shape[3:]), f"host slots {tuple(host.shape)} vs cache {tuple(kv.shape)}"
    assert slots.shape == blocks.shape and slots.dtype == blocks.dtype == torch.int64
    assert 0 <= layer < kv.shape[0]
    n = slots.shape[0]
    if n == 0:
        return
    half_elems = kv[0, 0, 0].numel()
    grid = (n, 2, triton.cdiv(half_elems, SPAN))
    # the layer's views as the base pointers: offsets past int32 stay in the pointers
    _load_layer[grid](host[:, layer], kv[layer], slots, blocks, host.stride(0), kv.stride(1), half_elems, SPAN=SPAN)

// KV cache write and block pack/unpack; contracts in kernels.h. Pure copies: elements are
// moved as raw words of their size, so one instantiation serves fp16 and bf16 alike.
#include <cstdint>

#include "kernels.h"

namespace splitserve {
namespace {

constexpr int kThreads = 128;

// One thread block per token; threads stride over its kv_heads * head_dim elements.
template <typename W>
__global__ void __launch_bounds__(kThreads) write_kv_cache(const CacheWriteArgs a) {
  const int t = blockIdx.x;
  const int64_t slot = a.slot_mapping[t];
  if (slot < 0) return;  // a padding token: nothing to store
  const int64_t dst_row = (slot / a.block_size) * a.cache_stride_block + (slot % a.block_size) * a.cache_stride_tok;
  const W* k = static_cast<const W*>(a.k) + t * a.k_stride_tok;
  const W* v = static_cast<const W*>(a.v) + t * a.v_stride_tok;
  W* k_cache = static_cast<W*>(a.k_cache) + dst_row;
  W* v_cache = static_cast<W*>(a.v_cache) + dst_row;
  for (int i = threadIdx.x; i < a.num_kv_heads * a.head_dim; i += kThreads) {
    const int h = i / a.head_dim, d = i % a.head_dim;
    k_cache[h * a.cache_stride_head + d] = k[h * a.k_stride_head + d];
    v_cache[h * a.cache_stride_head + d] = v[h * a.v_stride_head + d];
  }
}

// One thread block per (block id i, plane): copies one run of run_bytes in words W.
template <typename W, bool kPack>
__global__ void __launch_bounds__(kThreads) copy_blocks(const BlockCopyArgs a) {
  const int i = blockIdx.x, plane = blockIdx.y;
  W* cache = reinterpret_cast<W*>(a.cache + plane * a.plane_stride_bytes + a.block_ids[i] * a.run_bytes);
  W* packed = reinterpret_cast<W*>(a.packed + (int64_t(i) * a.num_planes + plane) * a.run_bytes);
  const int64_t words = a.run_bytes / static_cast<int64_t>(sizeof(W));
  for (int64_t w = threadIdx.x; w < words; w += kThreads) {
    if (kPack) {
      packed[w] = cache[w];
    } else {
      cache[w] = packed[w];
    }
  }
}

template <bool kPack>
cudaError_t launch_copy(const BlockCopyArgs& a, cudaStream_t stream) {
  if (a.num_ids == 0) return cudaSuccess;
  const dim3 grid(a.num_ids, a.num_planes);
  // The widest word that every run start is aligned to.
  const uint64_t align = reinterpret_cast<uintptr_t>(a.cache) | reinterpret_cast<uintptr_t>(a.packed) |
                         static_cast<uint64_t>(a.run_bytes) | static_cast<uint64_t>(a.plane_stride_bytes);
  if (align % 16 == 0) {
    copy_blocks<uint4, kPack><<<grid, kThreads, 0, stream>>>(a);
  } else if (align % 4 == 0) {
    copy_blocks<uint32_t, kPack><<<grid, kThreads, 0, stream>>>(a);
  } else if (align % 2 == 0) {
    copy_blocks<uint16_t, kPack><<<grid, kThreads, 0, stream>>>(a);
  } else {
    copy_blocks<uint8_t, kPack><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_write_kv_cache(DType dtype, const CacheWriteArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.block_size < 1) return cudaErrorInvalidValue;
  if (dtype == DType::kFloat32) {
    write_kv_cache<uint32_t><<<a.num_tokens, kThreads, 0, stream>>>(a);
  } else {
    write_kv_cache<uint16_t><<<a.num_tokens, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_pack_blocks(const BlockCopyArgs& a, cudaStream_t stream) { return launch_copy<true>(a, stream); }

cudaError_t launch_unpack_blocks(const BlockCopyArgs& a, cudaStream_t stream) { return launch_copy<false>(a, stream); }

}  // namespace splitserve

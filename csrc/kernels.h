// Launch functions of the splitserve CUDA kernels: plain pointers and strides, no torch.
//
// Only bindings.cpp includes torch; the .cu files include this header and CUDA's own,
// so nvcc can compile them on a machine whose torch has no CUDA (the compile-only test).
// Every stride is in elements of the tensor's dtype unless its name ends in _bytes; the
// last dimension of every tensor is contiguous (the Python wrappers check it).
// Each launch returns cudaSuccess or the error of the launch (cudaErrorInvalidValue for
// a shape the kernels were not built for).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace splitserve {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Paged decode attention, one query token per sequence, grouped-query heads.
// Query head h reads KV head h / (num_heads / num_kv_heads). A sequence's context is
// cut into partitions of partition_size tokens; with num_partitions == 1 the first
// kernel writes `out`, otherwise it writes per-partition results that a second
// kernel merges (split-K, "flash-decoding").
struct PagedDecodeArgs {
  void* out;  // [num_seqs, num_heads, head_dim]
  int64_t out_stride_seq, out_stride_head;
  const void* q;  // [num_seqs, num_heads, head_dim]
  int64_t q_stride_seq, q_stride_head;
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;  // same shape and strides as k_cache
  int64_t cache_stride_block, cache_stride_tok, cache_stride_head;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  int64_t block_tables_stride;
  const int64_t* seq_lens;  // [num_seqs], each >= 1 and <= max_blocks * block_size
  float* part_out;  // [num_seqs, num_heads, num_partitions, head_dim] (unused if 1 partition)
  float* part_max;  // [num_seqs, num_heads, num_partitions]: max scaled score of the partition
  float* part_sum;  // [num_seqs, num_heads, num_partitions]: sum of exp(score - part_max)
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  int partition_size;  // tokens, 1 .. kMaxPartitionSize
  int num_partitions;  // ceil(max_blocks * block_size / partition_size)
  float scale;
};

constexpr int kMaxPartitionSize = 512;

cudaError_t launch_paged_decode(DType dtype, const PagedDecodeArgs& a, cudaStream_t stream);

// KV cache write: token t's K and V rows go to slot slot_mapping[t]
// (block slot / block_size, offset slot % block_size); a slot < 0 is skipped.
struct CacheWriteArgs {
  const void* k;  // [num_tokens, num_kv_heads, head_dim]
  const void* v;
  int64_t k_stride_tok, k_stride_head, v_stride_tok, v_stride_head;
  void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;  // same strides as k_cache
  int64_t cache_stride_block, cache_stride_tok, cache_stride_head;
  const int64_t* slot_mapping;  // [num_tokens]
  int num_tokens, num_kv_heads, head_dim, block_size;
};

cudaError_t launch_write_kv_cache(DType dtype, const CacheWriteArgs& a, cudaStream_t stream);

// Block pack / unpack between the whole cache and a contiguous buffer, dtype-agnostic.
// The cache [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] is num_planes =
// num_layers * 2 planes of num_blocks runs of run_bytes each; packed block i is its
// num_planes runs back to back: packed[i, plane] <-> cache[plane, block_ids[i]].
struct BlockCopyArgs {
  char* cache;
  char* packed;  // [num_ids, num_planes, run_bytes]
  const int64_t* block_ids;  // [num_ids], each in [0, num_blocks)
  int64_t run_bytes;  // block_size * kv_heads * head_dim * itemsize
  int64_t plane_stride_bytes;  // num_blocks * run_bytes
  int num_ids, num_planes;
};

cudaError_t launch_pack_blocks(const BlockCopyArgs& a, cudaStream_t stream);    // cache -> packed
cudaError_t launch_unpack_blocks(const BlockCopyArgs& a, cudaStream_t stream);  // packed -> cache

}  // namespace splitserve

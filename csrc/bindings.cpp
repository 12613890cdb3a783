// torch.ops.splitserve.*: op schemas and their CUDA implementations.
//
// Each implementation checks what memory safety needs (devices, dtypes, ranks, a
// contiguous last dimension, sizes that agree), then fills the plain-pointer
// arguments of kernels.h and launches on the current stream. The Python wrappers
// in ops.py check the same contracts with friendlier messages before calling here.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace splitserve {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "splitserve: unsupported dtype ", t.scalar_type(), "; use float32, float16 or bfloat16");
  }
}

void check_cuda(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "splitserve: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == dim, "splitserve: ", name, " must have ", dim, " dims, got ", t.dim());
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  check_cuda(t, name, 3);
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "splitserve: ", name, " dtype differs");
  TORCH_CHECK(t.stride(2) == 1, "splitserve: ", name, " needs a contiguous last dim");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "splitserve.", op, ": ", cudaGetErrorString(err));
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t partition_size, at::Tensor& part_out, at::Tensor& part_max,
                            at::Tensor& part_sum) {
  check_rows(q, "q", k_cache);
  check_rows(out, "out", k_cache);
  check_cuda(k_cache, "k_cache", 4);
  check_cuda(v_cache, "v_cache", 4);
  check_cuda(block_tables, "block_tables", 2);
  check_cuda(seq_lens, "seq_lens", 1);
  check_cuda(part_out, "part_out", 4);
  check_cuda(part_max, "part_max", 3);
  check_cuda(part_sum, "part_sum", 3);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.stride(3) == 1,
              "splitserve: k_cache and v_cache must match, with a contiguous last dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "splitserve: block_tables and seq_lens must be int64 with contiguous rows");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_partitions = part_max.size(2);
  TORCH_CHECK(out.sizes() == q.sizes() && k_cache.size(3) == head_dim && block_tables.size(0) == num_seqs &&
                  seq_lens.size(0) == num_seqs,
              "splitserve: q, out, caches, block_tables and seq_lens disagree in shape");
  TORCH_CHECK(num_partitions * partition_size >= block_tables.size(1) * k_cache.size(1),
              "splitserve: partitions do not cover max_blocks * block_size tokens");
  if (num_partitions > 1) {
    const std::vector<int64_t> part_shape{num_seqs, num_heads, num_partitions};
    const std::vector<int64_t> out_shape{num_seqs, num_heads, num_partitions, head_dim};
    TORCH_CHECK(part_max.sizes() == part_shape && part_sum.sizes() == part_shape && part_out.sizes() == out_shape &&
                    part_max.is_contiguous() && part_sum.is_contiguous() && part_out.is_contiguous() &&
                    part_out.scalar_type() == at::kFloat &&
                    part_max.scalar_type() == at::kFloat && part_sum.scalar_type() == at::kFloat,
                "splitserve: part_out/part_max/part_sum must be contiguous float32 [D, H, P(, hd)]");
  }
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  PagedDecodeArgs a{};
  a.out = out.data_ptr();
  a.out_stride_seq = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.q = q.data_ptr();
  a.q_stride_seq = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.cache_stride_block = k_cache.stride(0);
  a.cache_stride_tok = k_cache.stride(1);
  a.cache_stride_head = k_cache.stride(2);
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.block_tables_stride = block_tables.stride(0);
  a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.part_out = part_out.data_ptr<float>();
  a.part_max = part_max.data_ptr<float>();
  a.part_sum = part_sum.data_ptr<float>();
  a.num_seqs = static_cast<int>(num_seqs);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(k_cache.size(2));
  a.head_dim = static_cast<int>(head_dim);
  a.block_size = static_cast<int>(k_cache.size(1));
  a.partition_size = static_cast<int>(partition_size);
  a.num_partitions = static_cast<int>(num_partitions);
  a.scale = static_cast<float>(scale);
  check_launch(launch_paged_decode(dtype_of(q), a, stream_of(q)), "paged_decode_attention");
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  check_rows(k, "k", k_cache);
  check_rows(v, "v", k_cache);
  check_cuda(k_cache, "k_cache", 4);
  check_cuda(v_cache, "v_cache", 4);
  check_cuda(slot_mapping, "slot_mapping", 1);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.stride(3) == 1,
              "splitserve: k_cache and v_cache must match, with a contiguous last dim");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == slot_mapping.size(0) && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3),
              "splitserve: k, v, slot_mapping and the caches disagree in shape");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "splitserve: slot_mapping must be contiguous int64");
  const c10::cuda::OptionalCUDAGuard guard(k.device());
  CacheWriteArgs a{};
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.k_stride_tok = k.stride(0);
  a.k_stride_head = k.stride(1);
  a.v_stride_tok = v.stride(0);
  a.v_stride_head = v.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.cache_stride_block = k_cache.stride(0);
  a.cache_stride_tok = k_cache.stride(1);
  a.cache_stride_head = k_cache.stride(2);
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = static_cast<int>(k.size(0));
  a.num_kv_heads = static_cast<int>(k.size(1));
  a.head_dim = static_cast<int>(k.size(2));
  a.block_size = static_cast<int>(k_cache.size(1));
  check_launch(launch_write_kv_cache(dtype_of(k), a, stream_of(k)), "write_kv_cache");
}

// kv_caches [layers, 2, num_blocks, block_size, kv_heads, hd] <-> packed [n, layers, 2, block_size, kv_heads, hd]
BlockCopyArgs block_copy_args(const at::Tensor& kv_caches, const at::Tensor& block_ids, const at::Tensor& packed) {
  check_cuda(kv_caches, "kv_caches", 6);
  check_cuda(packed, "packed", 6);
  check_cuda(block_ids, "block_ids", 1);
  TORCH_CHECK(kv_caches.is_contiguous() && packed.is_contiguous(), "splitserve: kv_caches and packed must be contiguous");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "splitserve: block_ids must be contiguous int64");
  TORCH_CHECK(packed.scalar_type() == kv_caches.scalar_type() && packed.size(0) == block_ids.size(0) &&
                  packed.size(1) == kv_caches.size(0) && packed.size(2) == 2 &&
                  packed.sizes().slice(3) == kv_caches.sizes().slice(3),
              "splitserve: packed must be [len(block_ids), layers, 2, block_size, kv_heads, head_dim] of the cache dtype");
  BlockCopyArgs a{};
  a.cache = static_cast<char*>(kv_caches.data_ptr());
  a.packed = static_cast<char*>(packed.data_ptr());
  a.block_ids = block_ids.data_ptr<int64_t>();
  a.run_bytes = kv_caches.stride(2) * kv_caches.element_size();
  a.plane_stride_bytes = kv_caches.stride(1) * kv_caches.element_size();
  a.num_ids = static_cast<int>(block_ids.size(0));
  a.num_planes = static_cast<int>(kv_caches.size(0) * 2);
  return a;
}

void pack_blocks(const at::Tensor& kv_caches, const at::Tensor& block_ids, at::Tensor& packed) {
  const BlockCopyArgs a = block_copy_args(kv_caches, block_ids, packed);
  const c10::cuda::OptionalCUDAGuard guard(kv_caches.device());
  check_launch(launch_pack_blocks(a, stream_of(kv_caches)), "pack_blocks");
}

void unpack_blocks(const at::Tensor& packed, const at::Tensor& block_ids, at::Tensor& kv_caches) {
  const BlockCopyArgs a = block_copy_args(kv_caches, block_ids, packed);
  const c10::cuda::OptionalCUDAGuard guard(kv_caches.device());
  check_launch(launch_unpack_blocks(a, stream_of(kv_caches)), "unpack_blocks");
}

}  // namespace
}  // namespace splitserve

TORCH_LIBRARY(splitserve, m) {
  m.def("paged_decode_attention(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int partition_size, Tensor! part_out, Tensor! part_max, "
        "Tensor! part_sum) -> ()");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor! k_cache, Tensor! v_cache, Tensor slot_mapping) -> ()");
  m.def("pack_blocks(Tensor kv_caches, Tensor block_ids, Tensor! packed) -> ()");
  m.def("unpack_blocks(Tensor packed, Tensor block_ids, Tensor! kv_caches) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CUDA, m) {
  m.impl("paged_decode_attention", &splitserve::paged_decode_attention);
  m.impl("write_kv_cache", &splitserve::write_kv_cache);
  m.impl("pack_blocks", &splitserve::pack_blocks);
  m.impl("unpack_blocks", &splitserve::unpack_blocks);
}

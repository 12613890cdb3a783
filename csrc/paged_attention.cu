// Paged decode attention, split-K ("flash-decoding"); contract in kernels.h.
//
// Kernel 1: one thread block per (partition p, KV head x head tile, sequence s).
// A head tile is G query heads that share the KV head, so each K/V row is read once
// for all of them. Partition p covers tokens [p*P, min((p+1)*P, seq_len)).
//
//   threads: tid = slot * TPT + lane     TPT = head_dim / kVec threads read one row
//            (16 bytes each); slot = which of the TPI = kThreads / TPT tokens in flight
//
//   1. scores[g][t] = scale * q[g] . k[t]                (partial dots summed by shuffles)
//   2. per head g (one warp each): m = max_t scores[g][t], e = exp(scores - m), l = sum e
//   3. o[g] = sum_t e[g][t] * v[t] / l                  (per-slot sums, merged in shared mem)
//
// One partition: o is the output. Several: o, m, l go to part_out/part_max/part_sum and
// kernel 2, one block per (head, sequence), merges the sequence's partitions:
//
//   M = max_p m_p,   w_p = l_p * exp(m_p - M),   out = sum_p w_p * o_p / sum_p w_p
#include <cmath>

#include "dtypes.cuh"
#include "kernels.h"

namespace splitserve {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int HD, int G>
__global__ void __launch_bounds__(kThreads) paged_decode_partition(const PagedDecodeArgs a) {
  constexpr int V = kVec<T>;
  constexpr int TPT = HD / V;
  static_assert(TPT <= 32 && 32 % TPT == 0, "a row must be read by a power-of-two part of a warp");
  constexpr int TPI = kThreads / TPT;

  const int p = blockIdx.x, s = blockIdx.z;
  const int group = a.num_heads / a.num_kv_heads;
  const int tiles = group / G;
  const int kv_head = blockIdx.y / tiles;
  const int head0 = kv_head * group + (blockIdx.y % tiles) * G;
  const int seq_len = static_cast<int>(a.seq_lens[s]);
  const int start = p * a.partition_size;
  if (start >= seq_len) return;  // past this sequence's end: kernel 2 never reads it
  const int n = min(a.partition_size, seq_len - start);

  extern __shared__ float smem[];
  float* scores = smem;                        // [G, partition_size]
  float* red = scores + G * a.partition_size;  // [TPI, HD]
  __shared__ float head_max[G], head_sum[G];

  const int tid = threadIdx.x, lane = tid % TPT, slot = tid / TPT;
  const int d0 = lane * V;  // this thread's first element of a row

  float qr[G][V];  // this thread's slice of the G query rows, pre-scaled
  const T* q = static_cast<const T*>(a.q) + s * a.q_stride_seq + d0;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < V; ++j) qr[g][j] = to_float(q[(head0 + g) * a.q_stride_head + j]) * a.scale;

  const int64_t* table = a.block_tables + s * a.block_tables_stride;
  const int64_t head_off = kv_head * a.cache_stride_head + d0;
  auto row_offset = [&](int t) {  // element offset of token start + t's row slice
    const int pos = start + t;
    return table[pos / a.block_size] * a.cache_stride_block + (pos % a.block_size) * a.cache_stride_tok + head_off;
  };

  // 1. scores. The trip count is the same for every thread: the shuffles need whole warps.
  const T* k_cache = static_cast<const T*>(a.k_cache);
  for (int t0 = 0; t0 < n; t0 += TPI) {
    const int t = t0 + slot;
    float kf[V];
    if (t < n) {
      load_vec(k_cache + row_offset(t), kf);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) kf[j] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) dot += qr[g][j] * kf[j];
#pragma unroll
      for (int off = TPT / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(kFullMask, dot, off);
      if (t < n && lane == 0) scores[g * a.partition_size + t] = dot;
    }
  }
  __syncthreads();

  // 2. softmax statistics, one warp per head; scores become exp(score - max).
  const int warp = tid / 32, wl = tid % 32;
  for (int g = warp; g < G; g += kWarps) {
    float* sc = scores + g * a.partition_size;
    float m = -INFINITY;
    for (int t = wl; t < n; t += 32) m = fmaxf(m, sc[t]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
    float l = 0.f;
    for (int t = wl; t < n; t += 32) {
      const float e = expf(sc[t] - m);
      sc[t] = e;
      l += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(kFullMask, l, off);
    if (wl == 0) {
      head_max[g] = m;
      head_sum[g] = l;
    }
  }
  __syncthreads();

  // 3. weighted sum of V rows, per slot, then merged across slots head by head.
  float acc[G][V];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[g][j] = 0.f;
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int t = slot; t < n; t += TPI) {
    float vf[V];
    load_vec(v_cache + row_offset(t), vf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float e = scores[g * a.partition_size + t];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[g][j] += e * vf[j];
    }
  }
  const bool split = a.num_partitions > 1;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int j = 0; j < V; ++j) red[slot * HD + d0 + j] = acc[g][j];
    __syncthreads();
    const int h = head0 + g;
    for (int d = tid; d < HD; d += kThreads) {
      float o = 0.f;
#pragma unroll
      for (int i = 0; i < TPI; ++i) o += red[i * HD + d];
      o /= head_sum[g];
      if (split) {
        a.part_out[((int64_t(s) * a.num_heads + h) * a.num_partitions + p) * HD + d] = o;
      } else {
        static_cast<T*>(a.out)[s * a.out_stride_seq + h * a.out_stride_head + d] = from_float<T>(o);
      }
    }
    __syncthreads();
  }
  if (split && tid < G) {
    const int64_t i = (int64_t(s) * a.num_heads + head0 + tid) * a.num_partitions + p;
    a.part_max[i] = head_max[tid];
    a.part_sum[i] = head_sum[tid];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) paged_decode_reduce(const PagedDecodeArgs a) {
  const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int seq_len = static_cast<int>(a.seq_lens[s]);
  const int np = min(a.num_partitions, (seq_len + a.partition_size - 1) / a.partition_size);
  const int64_t base = (int64_t(s) * a.num_heads + h) * a.num_partitions;
  extern __shared__ float weight[];  // [num_partitions]

  float m = -INFINITY;  // every thread scans the few partition maxima itself
  for (int i = 0; i < np; ++i) m = fmaxf(m, a.part_max[base + i]);
  for (int i = tid; i < np; i += kThreads) weight[i] = a.part_sum[base + i] * expf(a.part_max[base + i] - m);
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < np; ++i) total += weight[i];
  for (int d = tid; d < a.head_dim; d += kThreads) {
    float o = 0.f;
    for (int i = 0; i < np; ++i) o += weight[i] * a.part_out[(base + i) * a.head_dim + d];
    static_cast<T*>(a.out)[s * a.out_stride_seq + h * a.out_stride_head + d] = from_float<T>(o / total);
  }
}

template <typename T, int HD, int G>
cudaError_t launch(const PagedDecodeArgs& a, cudaStream_t stream) {
  constexpr int TPI = kThreads / (HD / kVec<T>);
  const int tiles = a.num_heads / a.num_kv_heads / G;
  const dim3 grid(a.num_partitions, a.num_kv_heads * tiles, a.num_seqs);
  const size_t smem = sizeof(float) * (size_t(G) * a.partition_size + TPI * HD);
  paged_decode_partition<T, HD, G><<<grid, kThreads, smem, stream>>>(a);
  if (a.num_partitions > 1) {
    const dim3 grid2(a.num_heads, a.num_seqs);
    paged_decode_reduce<T><<<grid2, kThreads, sizeof(float) * a.num_partitions, stream>>>(a);
  }
  return cudaGetLastError();
}

// Query heads per thread block: the largest of 8, 4, 3, 2, 1 that divides the group.
template <typename T, int HD>
cudaError_t launch_tile(const PagedDecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.num_kv_heads;
  if (group % 8 == 0) return launch<T, HD, 8>(a, stream);
  if (group % 4 == 0) return launch<T, HD, 4>(a, stream);
  if (group % 3 == 0) return launch<T, HD, 3>(a, stream);
  if (group % 2 == 0) return launch<T, HD, 2>(a, stream);
  return launch<T, HD, 1>(a, stream);
}

}  // namespace

cudaError_t launch_paged_decode(DType dtype, const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.partition_size < 1 ||
      a.partition_size > kMaxPartitionSize || a.block_size < 1 || a.num_partitions < 1) {
    return cudaErrorInvalidValue;
  }
  if (a.num_seqs == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto zero) -> cudaError_t {
    using T = decltype(zero);
    if (a.head_dim == 64) return launch_tile<T, 64>(a, stream);
    if (a.head_dim == 128) return launch_tile<T, 128>(a, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace splitserve

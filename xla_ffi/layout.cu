// Dispatch layout and send layout, CUDA handlers: the twins of layout.cc (same arguments,
// attributes and results, bitwise-identical outputs for valid input).
//
// GPU semantics for bad input (docs/contract.md, "Errors"): an expert id outside [-1, E) is treated as an
// unrouted slot (never an out-of-bounds write) and, in the dispatch layout, counted in the
// num_invalid i32[] output. Shape and attribute errors are InvalidArgument, as on CPU.
//
// get_dispatch_layout: one thread per token; expert / rank / invalid counts are integer atomics
//   on a shared-memory histogram per block, flushed to global memory once per block.
// build_send_layout: (1) rows per destination rank (integer atomics, as above); (2) one block
//   per rank: the rank's offset is the sum of the counts of the ranks before it, then a chunked
//   cub::BlockScan over the tokens' membership gives each member token its row (rank-major,
//   token-ascending: deterministic); the same blocks fill the padding rows past num_send.
// No host sync, no scratch memory: both handlers are CUDA-graph (command buffer) compatible.
#include "cuda_common.cuh"
#include "checks.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace jax_ep {
namespace {

namespace cub = ::CUB_WRAPPED_NAMESPACE::cub;

constexpr int kThreads = 256;
constexpr int kScanThreads = 256;
constexpr int kScanItems = 4;
constexpr size_t kMaxSharedHistogramBytes = 32 * 1024;

__device__ __forceinline__ bool ValidExpert(int32_t e, int32_t num_experts) {
  return e >= 0 && e < num_experts;
}

// True when slot k of `row` is the first valid slot of the token owned by rank r (the token
// counts once per owning rank, whichever of its slots comes first).
__device__ __forceinline__ bool FirstSlotOfRank(const int32_t* row, int k, int32_t r,
                                                int32_t num_experts, int32_t L) {
  for (int k2 = 0; k2 < k; ++k2) {
    const int32_t e2 = row[k2];
    if (ValidExpert(e2, num_experts) && e2 / L == r) return false;
  }
  return true;
}

// ----------------------------------------------------------------------------- dispatch layout

// kShared: the per-expert / per-rank / invalid counters live in dynamic shared memory
// (E + P + 1 ints) and are added to the global outputs at the end; otherwise global atomics.
template <bool kShared>
__global__ void __launch_bounds__(kThreads)
    DispatchLayoutKernel(const int32_t* __restrict__ idx, int64_t T, int K, int32_t E,
                         int32_t P, int32_t L, int32_t* __restrict__ per_rank,
                         bool* __restrict__ in_rank, int32_t* __restrict__ per_expert,
                         int32_t* __restrict__ num_invalid) {
  JAX_EP_EXTERN_SHARED(int32_t, smem);
  int32_t* c_expert = per_expert;
  int32_t* c_rank = per_rank;
  int32_t* c_invalid = num_invalid;
  if (kShared) {
    c_expert = smem;
    c_rank = smem + E;
    c_invalid = smem + E + P;
    for (int i = threadIdx.x; i < E + P + 1; i += blockDim.x) smem[i] = 0;
    __syncthreads();
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int invalid = 0;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < T; t += stride) {
    const int32_t* row = idx + t * K;
    bool* flags = in_rank + t * P;
    for (int k = 0; k < K; ++k) {
      const int32_t e = row[k];
      if (e == -1) continue;
      if (!ValidExpert(e, E)) {
        ++invalid;
        continue;
      }
      atomicAdd(&c_expert[e], 1);
      const int32_t r = e / L;
      if (FirstSlotOfRank(row, k, r, E, L)) {
        flags[r] = true;
        atomicAdd(&c_rank[r], 1);
      }
    }
  }
  if (invalid) atomicAdd(c_invalid, invalid);
  if (kShared) {
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x)
      if (smem[i]) atomicAdd(&per_expert[i], smem[i]);
    for (int i = threadIdx.x; i < P; i += blockDim.x)
      if (smem[E + i]) atomicAdd(&per_rank[i], smem[E + i]);
    if (threadIdx.x == 0 && smem[E + P]) atomicAdd(num_invalid, smem[E + P]);
  }
}

ffi::Error DispatchLayoutCuda(cudaStream_t stream, I32 topk_idx, int64_t num_experts,
                              int64_t num_ranks, I32Out tokens_per_rank, PredOut token_in_rank,
                              I32Out tokens_per_expert, I32Out num_invalid) {
  if (auto err = CheckRouting(topk_idx, num_experts, num_ranks); err.failure()) return err;
  const int64_t T = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  const int64_t E = num_experts, P = num_ranks, L = num_experts / num_ranks;
  if (E > INT32_MAX || K > INT32_MAX) {
    return ffi::Error::InvalidArgument("num_experts and top-k must fit in int32");
  }
  if (auto err = CheckDispatchLayoutResults(topk_idx, E, P, tokens_per_rank, token_in_rank,
                                            tokens_per_expert, num_invalid);
      err.failure())
    return err;
  int32_t* per_rank = tokens_per_rank->typed_data();
  bool* in_rank = token_in_rank->typed_data();
  int32_t* per_expert = tokens_per_expert->typed_data();
  int32_t* invalid = num_invalid->typed_data();
  if (auto err = MemsetAsync(per_rank, 0, P * sizeof(int32_t), stream, "memset"); err.failure())
    return err;
  if (auto err = MemsetAsync(in_rank, 0, T * P * sizeof(bool), stream, "memset"); err.failure())
    return err;
  if (auto err = MemsetAsync(per_expert, 0, E * sizeof(int32_t), stream, "memset");
      err.failure())
    return err;
  if (auto err = MemsetAsync(invalid, 0, sizeof(int32_t), stream, "memset"); err.failure())
    return err;
  if (T == 0 || K == 0) return ffi::Error::Success();

  const size_t smem = size_t(E + P + 1) * sizeof(int32_t);
  const unsigned grid = GridFor(T, kThreads, 256);
  if (smem <= kMaxSharedHistogramBytes) {
    JAX_EP_LAUNCH(grid, kThreads, smem, stream, DispatchLayoutKernel<true>)(
        topk_idx.typed_data(), T, int(K), int32_t(E), int32_t(P), int32_t(L), per_rank, in_rank,
        per_expert, invalid);
  } else {
    JAX_EP_LAUNCH(grid, kThreads, 0, stream, DispatchLayoutKernel<false>)(
        topk_idx.typed_data(), T, int(K), int32_t(E), int32_t(P), int32_t(L), per_rank, in_rank,
        per_expert, invalid);
  }
  return CheckLaunch("DispatchLayoutKernel");
}

// ----------------------------------------------------------------------------- send layout

// Rows per destination rank: a token counts once per rank that owns any of its valid slots.
template <bool kShared>
__global__ void __launch_bounds__(kThreads)
    SendCountKernel(const int32_t* __restrict__ idx, int64_t T, int K, int32_t E, int32_t P,
                    int32_t L, int32_t* __restrict__ counts) {
  JAX_EP_EXTERN_SHARED(int32_t, smem);
  int32_t* c = counts;
  if (kShared) {
    c = smem;
    for (int i = threadIdx.x; i < P; i += blockDim.x) smem[i] = 0;
    __syncthreads();
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < T; t += stride) {
    const int32_t* row = idx + t * K;
    for (int k = 0; k < K; ++k) {
      const int32_t e = row[k];
      if (!ValidExpert(e, E)) continue;
      const int32_t r = e / L;
      if (FirstSlotOfRank(row, k, r, E, L)) atomicAdd(&c[r], 1);
    }
  }
  if (kShared) {
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x)
      if (smem[i]) atomicAdd(&counts[i], smem[i]);
  }
}

// One block per destination rank r: writes the rows [offset_r, offset_r + counts[r]) in token
// order, then its share of the padding rows [total, T*P). Block 0 writes num_send.
__global__ void __launch_bounds__(kScanThreads)
    SendPlaceKernel(const int32_t* __restrict__ idx, const float* __restrict__ w, int64_t T,
                    int K, int32_t E, int32_t P, int32_t L, const int32_t* __restrict__ counts,
                    int32_t* __restrict__ out_tok, int32_t* __restrict__ out_rank,
                    int32_t* __restrict__ out_local, float* __restrict__ out_w,
                    int32_t* __restrict__ num_send) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t s_offset, s_total;
  const int32_t r = blockIdx.x;

  // Offset of this rank's block and the total number of rows.
  int64_t before = 0, all = 0;
  for (int32_t i = threadIdx.x; i < P; i += blockDim.x) {
    all += counts[i];
    if (i < r) before += counts[i];
  }
  const int64_t sum_before = Reduce(tmp.reduce).Sum(before);
  __syncthreads();
  const int64_t sum_all = Reduce(tmp.reduce).Sum(all);
  if (threadIdx.x == 0) {
    s_offset = sum_before;
    s_total = sum_all;
  }
  __syncthreads();
  const int64_t offset = s_offset, total = s_total;
  if (r == 0 && threadIdx.x == 0) *num_send = int32_t(total);

  // Member tokens of rank r, token-ascending (a blocked arrangement keeps token order).
  int64_t running = 0;
  for (int64_t base = 0; base < T; base += int64_t(kScanThreads) * kScanItems) {
    int32_t member[kScanItems], pos[kScanItems];
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t t = base + int64_t(threadIdx.x) * kScanItems + j;
      member[j] = 0;
      if (t < T) {
        const int32_t* row = idx + t * K;
        for (int k = 0; k < K; ++k) {
          const int32_t e = row[k];
          if (ValidExpert(e, E) && e / L == r) {
            member[j] = 1;
            break;
          }
        }
      }
    }
    int32_t chunk_total;
    Scan(tmp.scan).ExclusiveSum(member, pos, chunk_total);
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (!member[j]) continue;
      const int64_t t = base + int64_t(threadIdx.x) * kScanItems + j;
      const int64_t row = offset + running + pos[j];
      out_tok[row] = int32_t(t);
      out_rank[row] = r;
      const int32_t* src = idx + t * K;
      const float* src_w = w + t * K;
      int32_t* dst = out_local + row * K;
      float* dst_w = out_w + row * K;
      for (int k = 0; k < K; ++k) {
        const int32_t e = src[k];
        const bool owned = ValidExpert(e, E) && e / L == r;
        dst[k] = owned ? e - r * L : -1;
        dst_w[k] = owned ? src_w[k] : 0.0f;
      }
    }
    running += chunk_total;
    __syncthreads();  // the scan's temp storage is reused by the next chunk
  }

  // Padding rows [total, T*P), shared out among the P blocks.
  const int64_t rows = T * P;
  const int64_t stride = int64_t(P) * blockDim.x;
  for (int64_t row = total + int64_t(r) * blockDim.x + threadIdx.x; row < rows; row += stride) {
    out_tok[row] = -1;
    out_rank[row] = -1;
  }
  for (int64_t i = total * K + int64_t(r) * blockDim.x + threadIdx.x; i < rows * K; i += stride) {
    out_local[i] = -1;
    out_w[i] = 0.0f;
  }
}

ffi::Error SendLayoutCuda(cudaStream_t stream, I32 topk_idx, F32 topk_weights, int64_t num_ranks,
                          int64_t num_local_experts, I32Out token_idx, I32Out rank,
                          I32Out local_idx, F32Out weights, I32Out send_counts,
                          I32Out num_send) {
  const int64_t P = num_ranks, L = num_local_experts;
  int64_t T, K;
  if (auto err = CheckSendLayoutArgs(topk_idx, topk_weights, P, L, &T, &K); err.failure())
    return err;
  if (P * L > INT32_MAX || K > INT32_MAX) {
    return ffi::Error::InvalidArgument("num_experts and top-k must fit in int32");
  }
  if (auto err = CheckSendLayoutResults(topk_idx, P, token_idx, rank, local_idx, weights,
                                        send_counts, num_send);
      err.failure())
    return err;
  const int32_t E = int32_t(P * L);
  int32_t* counts = send_counts->typed_data();
  if (auto err = MemsetAsync(counts, 0, P * sizeof(int32_t), stream, "memset"); err.failure())
    return err;
  if (T > 0 && K > 0) {
    const unsigned grid = GridFor(T, kThreads, 256);
    const size_t smem = size_t(P) * sizeof(int32_t);
    if (smem <= kMaxSharedHistogramBytes) {
      JAX_EP_LAUNCH(grid, kThreads, smem, stream, SendCountKernel<true>)(
          topk_idx.typed_data(), T, int(K), E, int32_t(P), int32_t(L), counts);
    } else {
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, SendCountKernel<false>)(
          topk_idx.typed_data(), T, int(K), E, int32_t(P), int32_t(L), counts);
    }
    if (auto err = CheckLaunch("SendCountKernel"); err.failure()) return err;
  }
  JAX_EP_LAUNCH(unsigned(P), kScanThreads, 0, stream, SendPlaceKernel)(
      topk_idx.typed_data(), topk_weights.typed_data(), T, int(K), E, int32_t(P), int32_t(L),
      counts, token_idx->typed_data(), rank->typed_data(), local_idx->typed_data(),
      weights->typed_data(), num_send->typed_data());
  return CheckLaunch("SendPlaceKernel");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchLayoutCuda, jax_ep::DispatchLayoutCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Ret<jax_ep::I32>()        // num_tokens_per_rank [P]
                                  .Ret<jax_ep::Pred>()       // is_token_in_rank [T, P]
                                  .Ret<jax_ep::I32>()        // num_tokens_per_expert [E]
                                  .Ret<jax_ep::I32>(),       // num_invalid []
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSendLayoutCuda, jax_ep::SendLayoutCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Arg<jax_ep::F32>()        // topk_weights [T, K]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_local_experts")
                                  .Ret<jax_ep::I32>()        // token_idx [T*P]
                                  .Ret<jax_ep::I32>()        // rank [T*P]
                                  .Ret<jax_ep::I32>()        // local_idx [T*P, K]
                                  .Ret<jax_ep::F32>()        // weights [T*P, K]
                                  .Ret<jax_ep::I32>()        // send_counts [P]
                                  .Ret<jax_ep::I32>(),       // num_send []
                              {xla::ffi::Traits::kCmdBufferCompatible});

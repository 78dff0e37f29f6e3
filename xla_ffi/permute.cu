// Multihot routing, expert-major permutation, row gather and the deterministic unpermute
// reduction, CUDA handlers: the twins of permute.cc (same arguments, attributes and results;
// bitwise-identical integer outputs and data movement, fp32-accumulation unpermute).
//
// indices_to_multihot: one thread per (token, expert) element, summing the token's matching slot
//   probs in slot order (as the CPU does); ids outside [0, E) match no expert (unrouted).
// permute: (1) routed tokens per expert (integer atomics) into tokens_per_expert; (2) one block
//   per expert: its block start / capacity from the routed counts, then a chunked cub::BlockScan
//   down its routing_map column gives every kept token its row (expert-major, token-ascending);
//   (3) one block turns the routed counts into the reported block sizes and num_dropped;
//   (4) the row gather below copies the token rows. No scratch, no host sync.
// gather_rows: a group of lanes (a warp for wide rows) per output row, 16-byte loads and stores
//   when the row width and both base addresses allow, narrower units otherwise; rows whose index
//   is outside [0, S) are zero.
// unpermute: the inverse map token -> rows in ascending row order from a stable
//   cub::DeviceRadixSort of (token, row) pairs (row ids are sorted by token; a counting pass and
//   cub::DeviceScan give each token's range), then one warp per output token accumulates its
//   rows in fp32 registers in ascending row order (no atomics on the float sums: bitwise
//   reproducible). sorted_indices outside [-1, T) are ignored. Temporary device memory comes
//   from the FFI scratch allocator, so this one handler is not marked command-buffer compatible.
#include "cuda_common.cuh"
#include "checks.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>

namespace jax_ep {
namespace {

namespace cub = ::CUB_WRAPPED_NAMESPACE::cub;

constexpr int kThreads = 256;
constexpr int kScanThreads = 256;
constexpr int kScanItems = 8;
constexpr int kUnroll = 4;

// ----------------------------------------------------------------------------- multihot

__global__ void __launch_bounds__(kThreads)
    MultihotKernel(const int32_t* __restrict__ idx, const float* __restrict__ p, int64_t T,
                   int K, int64_t E, bool* __restrict__ map, float* __restrict__ dense) {
  const int64_t n = T * E;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / E;
    const int32_t e = int32_t(i - t * E);
    const int32_t* row = idx + t * K;
    const float* prow = p + t * K;
    bool hit = false;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) {
      if (row[k] == e) {
        hit = true;
        acc = __fadd_rn(acc, prow[k]);
      }
    }
    map[i] = hit;
    dense[i] = acc;
  }
}

ffi::Error MultihotCuda(cudaStream_t stream, I32 topk_idx, F32 topk_probs, int64_t num_experts,
                        PredOut routing_map, F32Out probs) {
  int64_t T, K;
  if (auto err = CheckMultihotArgs(topk_idx, topk_probs, num_experts, routing_map, probs, &T, &K);
      err.failure())
    return err;
  const int64_t E = num_experts;
  if (K > INT32_MAX) return ffi::Error::InvalidArgument("topk_idx: top-k must fit in int32");
  if (T * E == 0) return ffi::Error::Success();
  JAX_EP_LAUNCH(GridFor(T * E, kThreads, 1 << 16), kThreads, 0, stream, MultihotKernel)(
      topk_idx.typed_data(), topk_probs.typed_data(), T, int(K), E,
      routing_map->typed_data(), probs->typed_data());
  return CheckLaunch("MultihotKernel");
}

// ----------------------------------------------------------------------------- row gather

// out[r] = x[idx[r]] (rows of nvec units of type V), zero where idx[r] is outside [0, num_src).
// lanes_per_row is a power of two <= 32 dividing the block size, so a row's lanes share a warp.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const V* __restrict__ x, int64_t num_src, int64_t nvec,
                     const int32_t* __restrict__ idx, int64_t num_rows, V* __restrict__ out,
                     int lanes_per_row) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = int(tid & (lanes_per_row - 1));
  const int64_t groups = int64_t(gridDim.x) * blockDim.x / lanes_per_row;
  const int64_t step = int64_t(lanes_per_row) * kUnroll;
  for (int64_t r = tid / lanes_per_row; r < num_rows; r += groups) {
    const int64_t s = idx[r];
    V* dst = out + r * nvec;
    if (s >= 0 && s < num_src) {
      const V* src = x + s * nvec;
      for (int64_t v = lane; v < nvec; v += step) {
        V buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t j = v + int64_t(u) * lanes_per_row;
          if (j < nvec) buf[u] = src[j];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t j = v + int64_t(u) * lanes_per_row;
          if (j < nvec) dst[j] = buf[u];
        }
      }
    } else {
      for (int64_t v = lane; v < nvec; v += lanes_per_row) dst[v] = ZeroUnit<V>();
    }
  }
}

// Byte-level row gather on the stream (the CUDA twin of GatherRowsBytes).
ffi::Error LaunchGatherRows(const void* x, int64_t num_src, int64_t row_bytes,
                            const int32_t* idx, int64_t num_rows, void* out,
                            cudaStream_t stream) {
  if (num_rows == 0 || row_bytes == 0) return ffi::Error::Success();
  const int unit = CopyUnitBytes(row_bytes, x, out);
  return DispatchCopyUnit(unit, [&](auto unit_c) {
    constexpr int kUnit = decltype(unit_c)::value;
    using V = typename CopyUnit<kUnit>::Type;
    const int64_t nvec = row_bytes / kUnit;
    int lanes = 1;
    while (lanes < 32 && lanes < nvec) lanes *= 2;
    const unsigned grid = GridFor(num_rows * lanes, kThreads, int64_t(1) << 20);
    JAX_EP_LAUNCH(grid, kThreads, 0, stream, GatherRowsKernel<V>)(
        static_cast<const V*>(x), num_src, nvec, idx, num_rows, static_cast<V*>(out), lanes);
    return CheckLaunch("GatherRowsKernel");
  });
}

ffi::Error GatherRowsCuda(cudaStream_t stream, Any x, I32 row_idx, AnyOut out) {
  int64_t rows, width;
  RowsAndWidth(x, &rows, &width);
  int64_t row_bytes = 0;
  if (auto err = RowBytes(x.element_type(), width, "x", &row_bytes); err.failure()) return err;
  const int64_t num_rows = row_idx.element_count();
  if (auto err = CheckGatherRowsResult(x, row_bytes, num_rows, out); err.failure()) return err;
  return LaunchGatherRows(x.untyped_data(), rows, row_bytes, row_idx.typed_data(), num_rows,
                          out->untyped_data(), stream);
}

// ----------------------------------------------------------------------------- permute

__device__ __forceinline__ int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// routed[e] += number of tokens routed to e (routed zeroed before). Threads: x over experts,
// y over the block's tokens.
__global__ void CountRoutedKernel(const uint8_t* __restrict__ map, int64_t T, int64_t E,
                                  int64_t tokens_per_block, int32_t* __restrict__ routed) {
  const int64_t t0 = int64_t(blockIdx.x) * tokens_per_block;
  const int64_t t1 = min(T, t0 + tokens_per_block);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t count = 0;
    for (int64_t t = t0 + threadIdx.y; t < t1; t += blockDim.y) count += map[t * E + e] != 0;
    if (count) atomicAdd(&routed[e], count);
  }
}

// Start row and row capacity of expert e's block (PlanPermute in permute.cc): drop_and_pad gives
// every expert c = (N / E) rounded down to a multiple of m rows; otherwise blocks are the routed
// counts rounded up to m, laid end to end, and cut at the N-row end to whole multiples of m
// (BlockCapacity in common.h).
__device__ __forceinline__ int64_t DropCapacity(int64_t N, int64_t E, int64_t m) {
  return (E ? N / E : 0) / m * m;
}

// One block per expert: the rows of its kept tokens, token-ascending.
__global__ void __launch_bounds__(kScanThreads)
    PermutePlaceKernel(const uint8_t* __restrict__ map, const float* __restrict__ probs,
                       int64_t T, int64_t E, int64_t N, int64_t m, bool drop_and_pad,
                       const int32_t* __restrict__ routed, int32_t* __restrict__ sorted_indices,
                       float* __restrict__ permuted_probs) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t s_start;
  const int64_t e = blockIdx.x;
  const int64_t n_e = routed[e];
  int64_t start, capacity;
  if (drop_and_pad) {
    capacity = DropCapacity(N, E, m);
    start = e * capacity;
  } else {
    int64_t part = 0;
    for (int64_t e2 = threadIdx.x; e2 < e; e2 += blockDim.x) part += RoundUp(routed[e2], m);
    const int64_t sum = Reduce(tmp.reduce).Sum(part);
    if (threadIdx.x == 0) s_start = sum;
    __syncthreads();
    start = s_start;
    capacity = BlockCapacity(N, start, RoundUp(n_e, m), m);
  }
  const int64_t keep = min(n_e, capacity);
  if (keep <= 0) return;  // block-uniform
  __syncthreads();        // tmp.reduce is reused as tmp.scan below

  int64_t running = 0;
  for (int64_t base = 0; base < T && running < keep;
       base += int64_t(kScanThreads) * kScanItems) {
    int32_t flag[kScanItems], pos[kScanItems];
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t t = base + int64_t(threadIdx.x) * kScanItems + j;
      flag[j] = (t < T && map[t * E + e] != 0) ? 1 : 0;
    }
    int32_t chunk_total;
    Scan(tmp.scan).ExclusiveSum(flag, pos, chunk_total);
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t jj = running + pos[j];
      if (!flag[j] || jj >= keep) continue;
      const int64_t t = base + int64_t(threadIdx.x) * kScanItems + j;
      const int64_t row = start + jj;
      sorted_indices[row] = int32_t(t);
      if (probs) permuted_probs[row] = probs[t * E + e];
    }
    running += chunk_total;
    __syncthreads();  // the scan's temp storage is reused by the next chunk
  }
}

// One block: routed counts -> reported block sizes (capacities), in place, and num_dropped.
__global__ void __launch_bounds__(kScanThreads)
    PermuteFinalizeKernel(int32_t* __restrict__ tokens_per_expert, int64_t E, int64_t N,
                          int64_t m, bool drop_and_pad, int32_t* __restrict__ num_dropped) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  const int64_t drop_cap = DropCapacity(N, E, m);
  int64_t offset = 0, dropped = 0;
  for (int64_t base = 0; base < E; base += kScanThreads) {
    const int64_t e = base + threadIdx.x;
    const int64_t n_e = e < E ? tokens_per_expert[e] : 0;
    const int64_t block = e < E ? RoundUp(n_e, m) : 0;
    int64_t start, chunk_total;
    Scan(tmp.scan).ExclusiveSum(block, start, chunk_total);
    start += offset;
    if (e < E) {
      const int64_t cap = drop_and_pad ? drop_cap : BlockCapacity(N, start, block, m);
      dropped += n_e - min(n_e, cap);
      tokens_per_expert[e] = int32_t(cap);  // this thread read tokens_per_expert[e] above
    }
    offset += chunk_total;
    __syncthreads();
  }
  const int64_t total = Reduce(tmp.reduce).Sum(dropped);
  if (threadIdx.x == 0) *num_dropped = int32_t(total);
}

ffi::Error PermuteCuda(cudaStream_t stream, Any tokens, Pred routing_map, F32 probs,
                       int64_t pad_multiple, bool drop_and_pad, AnyOut permuted,
                       F32Out permuted_probs, I32Out sorted_indices, I32Out tokens_per_expert,
                       I32Out num_dropped) {
  int64_t T, E, row_bytes;
  bool has_probs;
  if (auto err = CheckPermuteArgs(tokens, routing_map, probs, pad_multiple, &T, &E, &row_bytes,
                                  &has_probs);
      err.failure())
    return err;
  const int64_t N = sorted_indices->element_count();
  if (N > INT32_MAX || T > INT32_MAX || E > INT32_MAX) {  // E: one block per expert below
    return ffi::Error::InvalidArgument("permute: token, row and expert counts must fit in int32, got T = " +
                                       std::to_string(T) + ", N = " + std::to_string(N) +
                                       ", E = " + std::to_string(E));
  }
  if (auto err = CheckPermuteResults(E, row_bytes, permuted, permuted_probs, sorted_indices,
                                     tokens_per_expert, num_dropped);
      err.failure())
    return err;
  const int64_t m = std::max<int64_t>(pad_multiple, 1);
  const uint8_t* map = reinterpret_cast<const uint8_t*>(routing_map.typed_data());
  int32_t* order = sorted_indices->typed_data();
  int32_t* per_expert = tokens_per_expert->typed_data();
  float* out_probs = permuted_probs->typed_data();

  if (auto err = MemsetAsync(per_expert, 0, E * sizeof(int32_t), stream, "memset");
      err.failure())
    return err;
  if (auto err = MemsetAsync(order, 0xff, N * sizeof(int32_t), stream, "memset"); err.failure())
    return err;
  if (auto err = MemsetAsync(out_probs, 0, N * sizeof(float), stream, "memset"); err.failure())
    return err;
  if (E > 0 && T > 0) {
    // (1) routed counts.
    const int bx = int(std::min<int64_t>(kThreads, (E + 31) / 32 * 32));
    const dim3 block(bx, kThreads / bx);
    const int64_t tokens_per_block = 256;
    const unsigned grid = GridFor(T, int(tokens_per_block), INT32_MAX);
    JAX_EP_LAUNCH(grid, block, 0, stream, CountRoutedKernel)(map, T, E, tokens_per_block,
                                                             per_expert);
    if (auto err = CheckLaunch("CountRoutedKernel"); err.failure()) return err;
    // (2) rows of the kept (token, expert) pairs.
    if (N > 0) {
      JAX_EP_LAUNCH(unsigned(E), kScanThreads, 0, stream, PermutePlaceKernel)(
          map, has_probs ? probs.typed_data() : nullptr, T, E, N, m, drop_and_pad, per_expert,
          order, out_probs);
      if (auto err = CheckLaunch("PermutePlaceKernel"); err.failure()) return err;
    }
  }
  // (3) reported block sizes and the drop count (also for T == 0 or N == 0).
  JAX_EP_LAUNCH(1, kScanThreads, 0, stream, PermuteFinalizeKernel)(
      per_expert, E, N, m, drop_and_pad, num_dropped->typed_data());
  if (auto err = CheckLaunch("PermuteFinalizeKernel"); err.failure()) return err;
  // (4) the token rows (padding rows, sorted_indices -1, come out zero).
  return LaunchGatherRows(tokens.untyped_data(), T, row_bytes, order, N, permuted->untyped_data(),
                          stream);
}

// ----------------------------------------------------------------------------- unpermute

// keys[r] = sorted_indices[r] when in [0, T), else T (sorts last, ignored); rows[r] = r;
// count[key] += 1 for the valid keys (count zeroed before).
__global__ void UnpermuteKeysKernel(const int32_t* __restrict__ idx, int64_t N, int32_t T,
                                    int32_t* __restrict__ keys, int32_t* __restrict__ rows,
                                    int32_t* __restrict__ count) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < N; r += stride) {
    const int32_t s = idx[r];
    const bool valid = s >= 0 && s < T;
    keys[r] = valid ? s : T;
    rows[r] = int32_t(r);
    if (valid) atomicAdd(&count[s], 1);
  }
}

// out[t] = sum over token t's rows (ascending row order) of permuted[row] * probs[row], fp32
// accumulation with separate multiply and add, as on CPU. One warp per work item (token t,
// column chunk c): a chunk is 32 * kUnroll vectors of VEC elements, so every lane keeps kUnroll
// vectors in flight and short token lists still give the GPU enough warps.
template <typename Tag, int VEC>
__global__ void __launch_bounds__(kThreads)
    UnpermuteReduceKernel(const typename DeviceFloat<Tag>::Storage* __restrict__ permuted,
                          const int32_t* __restrict__ sorted_rows,
                          const int32_t* __restrict__ begin, const float* __restrict__ probs,
                          int64_t T, int64_t H,
                          typename DeviceFloat<Tag>::Storage* __restrict__ out) {
  using S = typename DeviceFloat<Tag>::Storage;
  using Vec = AlignedVec<S, VEC>;
  constexpr int64_t kChunk = 32 * kUnroll;
  const int lane = threadIdx.x & 31;
  const int64_t nvec = H / VEC;
  const int64_t chunks = (nvec + kChunk - 1) / kChunk;
  const int64_t items = T * chunks;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const Vec* src = reinterpret_cast<const Vec*>(permuted);
  // Warp-uniform loops only: the shuffles below need every lane.
  for (int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; item < items;
       item += warps) {
    const int64_t t = item / chunks;
    const int64_t v0 = (item - t * chunks) * kChunk + lane;
    const int32_t b = begin[t], e = begin[t + 1];
    float acc[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[u][k] = 0.0f;
    for (int32_t i0 = b; i0 < e; i0 += 32) {
      const int n = min(32, e - i0);
      const int32_t my_row = lane < n ? sorted_rows[i0 + lane] : 0;
      const float my_w = (probs != nullptr && lane < n) ? probs[my_row] : 1.0f;
      for (int j = 0; j < n; ++j) {
        const int64_t r = __shfl_sync(0xffffffffu, my_row, j);
        const float w = __shfl_sync(0xffffffffu, my_w, j);
        const Vec* row = src + r * nvec;
        Vec buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + u * 32;
          buf[u] = v < nvec ? row[v] : Vec{};
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (v0 + u * 32 < nvec) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float x = DeviceFloat<Tag>::Load(buf[u].v[k]);
              acc[u][k] = __fadd_rn(acc[u][k], __fmul_rn(x, w));
            }
          }
        }
      }
    }
    Vec* dst = reinterpret_cast<Vec*>(out + t * H);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      if (v < nvec) {
        Vec o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = DeviceFloat<Tag>::Store(acc[u][k]);
        dst[v] = o;
      }
    }
  }
}

inline size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The largest alignment XLA's FFI scratch allocator accepts.
constexpr size_t kFfiScratchAlignment = 16;

ffi::Error UnpermuteCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, Any permuted,
                         I32 sorted_indices, F32 probs, AnyOut out) {
  int64_t N, H;
  RowsAndWidth(permuted, &N, &H);
  int64_t T;
  if (auto err = CheckUnpermuteResult(permuted, H, out, &T); err.failure()) return err;
  bool has_probs;
  if (auto err = CheckUnpermuteArgs(sorted_indices, probs, N, &has_probs); err.failure())
    return err;
  if (N >= INT32_MAX || T >= INT32_MAX) {
    return ffi::Error::InvalidArgument("unpermute: row and token counts must fit in int32");
  }
  return DispatchFloatCuda(permuted.element_type(), "permuted", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using S = typename DeviceFloat<Tag>::Storage;
    if (T == 0 || H == 0) return ffi::Error::Success();
    if (N == 0) {
      return MemsetAsync(out->untyped_data(), 0, T * H * sizeof(S), stream, "memset");
    }
    // Scratch: keys, keys sorted, rows, rows sorted (N each), count and begin (T + 1 each), and
    // the CUB temporary storage shared by the scan and the sort.
    const int num_items = int(N);
    const int end_bit = std::max(1, 32 - __builtin_clz(uint32_t(T)));  // keys lie in [0, T]
    size_t sort_bytes = 0, scan_bytes = 0;
    if (auto err = CheckCuda(cub::DeviceRadixSort::SortPairs(
                                 nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                 static_cast<int32_t*>(nullptr),
                                 static_cast<const int32_t*>(nullptr),
                                 static_cast<int32_t*>(nullptr), num_items, 0, end_bit, stream),
                             "cub::DeviceRadixSort::SortPairs (size query)");
        err.failure())
      return err;
    if (auto err = CheckCuda(cub::DeviceScan::ExclusiveSum(
                                 nullptr, scan_bytes, static_cast<const int32_t*>(nullptr),
                                 static_cast<int32_t*>(nullptr), int(T + 1), stream),
                             "cub::DeviceScan::ExclusiveSum (size query)");
        err.failure())
      return err;
    // Every piece starts on a 256-byte boundary (CUB's own alignment). XLA's scratch allocator
    // refuses alignments above 16 ("Unsupported alignment", xla/ffi/ffi_api.cc), so the block
    // is requested 16-aligned with room (a - 1 bytes, whatever it returns) to align its start
    // by hand.
    const size_t a = 256;
    const size_t n_bytes = AlignUp(size_t(N) * sizeof(int32_t), a);
    const size_t t_bytes = AlignUp(size_t(T + 1) * sizeof(int32_t), a);
    const size_t temp_bytes = AlignUp(std::max<size_t>(std::max(sort_bytes, scan_bytes), 1), a);
    const size_t total = 4 * n_bytes + 2 * t_bytes + temp_bytes + a - 1;
    std::optional<void*> mem = scratch.Allocate(total, kFfiScratchAlignment);
    if (!mem.has_value() || *mem == nullptr) {
      return ffi::Error::Internal("jax_ep CUDA unpermute: could not allocate " +
                                  std::to_string(total) + " bytes of scratch memory");
    }
    char* p = reinterpret_cast<char*>(AlignUp(reinterpret_cast<uintptr_t>(*mem), a));
    int32_t* keys = reinterpret_cast<int32_t*>(p);
    int32_t* keys_sorted = reinterpret_cast<int32_t*>(p + n_bytes);
    int32_t* rows = reinterpret_cast<int32_t*>(p + 2 * n_bytes);
    int32_t* rows_sorted = reinterpret_cast<int32_t*>(p + 3 * n_bytes);
    int32_t* count = reinterpret_cast<int32_t*>(p + 4 * n_bytes);
    int32_t* begin = reinterpret_cast<int32_t*>(p + 4 * n_bytes + t_bytes);
    void* temp = p + 4 * n_bytes + 2 * t_bytes;

    if (auto err = MemsetAsync(count, 0, size_t(T + 1) * sizeof(int32_t), stream, "memset");
        err.failure())
      return err;
    JAX_EP_LAUNCH(GridFor(N, kThreads, 1 << 16), kThreads, 0, stream, UnpermuteKeysKernel)(
        sorted_indices.typed_data(), N, int32_t(T), keys, rows, count);
    if (auto err = CheckLaunch("UnpermuteKeysKernel"); err.failure()) return err;
    size_t bytes = temp_bytes;
    // The same template instances (const inputs) as the size queries above.
    if (auto err = CheckCuda(cub::DeviceScan::ExclusiveSum(temp, bytes,
                                                           static_cast<const int32_t*>(count),
                                                           begin, int(T + 1), stream),
                             "cub::DeviceScan::ExclusiveSum");
        err.failure())
      return err;
    bytes = temp_bytes;
    // LSD radix sort is stable: rows stay ascending inside each token.
    if (auto err = CheckCuda(cub::DeviceRadixSort::SortPairs(temp, bytes,
                                                             static_cast<const int32_t*>(keys),
                                                             keys_sorted,
                                                             static_cast<const int32_t*>(rows),
                                                             rows_sorted, num_items, 0, end_bit,
                                                             stream),
                             "cub::DeviceRadixSort::SortPairs");
        err.failure())
      return err;

    const S* src = static_cast<const S*>(permuted.untyped_data());
    S* dst = static_cast<S*>(out->untyped_data());
    const float* w = has_probs ? probs.typed_data() : nullptr;
    const int unit = CopyUnitBytes(H * int64_t(sizeof(S)), src, dst);
    const int vec = std::max(1, unit / int(sizeof(S)));
    const int64_t chunks = (H / vec + 32 * kUnroll - 1) / (32 * kUnroll);
    const unsigned grid = GridFor(T * chunks * 32, kThreads, int64_t(1) << 20);
    auto launch = [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, UnpermuteReduceKernel<Tag, kVec>)(
          src, rows_sorted, begin, w, T, H, dst);
    };
    switch (vec) {
      case 8:
        if constexpr (sizeof(S) <= 2) launch(std::integral_constant<int, 8>{});
        break;
      case 4:
        launch(std::integral_constant<int, 4>{});
        break;
      case 2:
        launch(std::integral_constant<int, 2>{});
        break;
      default:
        launch(std::integral_constant<int, 1>{});
        break;
    }
    return CheckLaunch("UnpermuteReduceKernel");
  });
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpIndicesToMultihotCuda, jax_ep::MultihotCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Arg<jax_ep::F32>()        // topk_probs [T, K]
                                  .Attr<int64_t>("num_experts")
                                  .Ret<jax_ep::Pred>()       // routing_map [T, E]
                                  .Ret<jax_ep::F32>(),       // probs [T, E]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPermuteCuda, jax_ep::PermuteCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // tokens [T, H]
                                  .Arg<jax_ep::Pred>()       // routing_map [T, E]
                                  .Arg<jax_ep::F32>()        // probs [T, E] or [0]
                                  .Attr<int64_t>("pad_multiple")
                                  .Attr<bool>("drop_and_pad")
                                  .Ret<jax_ep::Any>()        // permuted [N, H]
                                  .Ret<jax_ep::F32>()        // permuted_probs [N]
                                  .Ret<jax_ep::I32>()        // sorted_indices [N]
                                  .Ret<jax_ep::I32>()        // tokens_per_expert [E]
                                  .Ret<jax_ep::I32>(),       // num_dropped []
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGatherRowsCuda, jax_ep::GatherRowsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // x [S, ...]
                                  .Arg<jax_ep::I32>()        // row_idx [N]
                                  .Ret<jax_ep::Any>(),       // out [N, ...]
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Uses the scratch allocator (the token -> rows map and CUB temporary storage), so it is not
// marked command-buffer compatible.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpUnpermuteCuda, jax_ep::UnpermuteCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<jax_ep::Any>()        // permuted [N, H]
                                  .Arg<jax_ep::I32>()        // sorted_indices [N]
                                  .Arg<jax_ep::F32>()        // probs [N] or [0]
                                  .Ret<jax_ep::Any>());      // out [T, H]

// Host stand-ins for the CUB pieces jax_ep's kernels use, with CUB's interfaces and results:
// cub::BlockScan (ExclusiveSum), cub::BlockReduce (Sum), cub::DeviceRadixSort::SortPairs and
// cub::DeviceScan::ExclusiveSum, for the CUDA emulator (cuda_emu/emulator.h).
//
// CUB's usage rules are checked rather than assumed: a block collective runs in a block of
// exactly its BLOCK_DIM threads, its TempStorage may be reused only after a __syncthreads(),
// and BlockReduce's result is defined in thread 0 only (the other threads get a poison value:
// NaN, or 0x5a5a... for integers). The device-wide algorithms keep CUB's two-call protocol: a
// null d_temp_storage asks for temp_storage_bytes, a call with less than that fails with
// cudaErrorInvalidValue, and the temporary storage is really used (a too-small or freed buffer
// is an AddressSanitizer report, not a silent success).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>

#include "cuda_emu/emulator.h"

#define CUB_VERSION 300000  // the CUB 3.x interface (CUDA 13)

#ifdef CUB_WRAPPED_NAMESPACE
namespace CUB_WRAPPED_NAMESPACE {
#endif
namespace cub {

enum BlockScanAlgorithm { BLOCK_SCAN_RAKING, BLOCK_SCAN_RAKING_MEMOIZE, BLOCK_SCAN_WARP_SCANS };
enum BlockReduceAlgorithm {
  BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY,
  BLOCK_REDUCE_RAKING,
  BLOCK_REDUCE_WARP_REDUCTIONS,
};

namespace emu_detail {

inline void CheckBlockShape(int threads, int dim_x, const char* what) {
  if (int(blockDim.x * blockDim.y * blockDim.z) != threads || int(blockDim.x) != dim_x) {
    cuda_emu::KernelError("%s is specialised for %d threads (x = %d) but the block is (%u, %u, "
                          "%u)", what, threads, dim_x, blockDim.x, blockDim.y, blockDim.z);
  }
}

template <typename T>
T Poison() {
  if constexpr (std::is_floating_point_v<T>) {
    return std::numeric_limits<T>::quiet_NaN();
  } else {
    return T(0x5a5a5a5a5a5a5a5aull);
  }
}

// a + b, wrapping for integers (as the device's integer adds do).
template <typename T>
T WrappingAdd(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return T(U(a) + U(b));
  } else {
    return a + b;
  }
}

constexpr size_t kAlign = 256;
inline size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline char* AlignUp(void* p) {
  return reinterpret_cast<char*>(AlignUp(reinterpret_cast<uintptr_t>(p)));
}

}  // namespace emu_detail

template <typename T, int BLOCK_DIM_X, BlockScanAlgorithm ALGORITHM = BLOCK_SCAN_RAKING,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1>
class BlockScan {
  static constexpr int kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

 public:
  struct TempStorage {
    T slot[kThreads + 1];  // per-thread partials, scanned in place; the total last
  };

  explicit BlockScan(TempStorage& storage) : storage_(storage) {
    emu_detail::CheckBlockShape(kThreads, BLOCK_DIM_X, "cub::BlockScan");
  }

  // Exclusive prefix sum over the block of a blocked arrangement (thread i holds items
  // [i * ITEMS, (i + 1) * ITEMS)); input and output may be the same array.
  template <int ITEMS>
  void ExclusiveSum(T (&input)[ITEMS], T (&output)[ITEMS], T& block_aggregate) {
    T items[ITEMS];
    T partial = T();
    for (int i = 0; i < ITEMS; ++i) {
      items[i] = input[i];
      partial = emu_detail::WrappingAdd(partial, items[i]);
    }
    T running = ScanPartials(partial, block_aggregate);
    for (int i = 0; i < ITEMS; ++i) {
      output[i] = running;
      running = emu_detail::WrappingAdd(running, items[i]);
    }
  }

  void ExclusiveSum(T input, T& output, T& block_aggregate) {
    output = ScanPartials(input, block_aggregate);
  }

  void ExclusiveSum(T input, T& output) {
    T block_aggregate;
    output = ScanPartials(input, block_aggregate);
  }

 private:
  T ScanPartials(T partial, T& block_aggregate) {
    cuda_emu::CheckTempStorageReuse(&storage_, "cub::BlockScan");
    const int tid = cuda_emu::LinearThreadId();
    storage_.slot[tid] = partial;
    __syncthreads();
    if (tid == 0) {
      T running = T();
      for (int i = 0; i < kThreads; ++i) {
        const T v = storage_.slot[i];
        storage_.slot[i] = running;
        running = emu_detail::WrappingAdd(running, v);
      }
      storage_.slot[kThreads] = running;
    }
    __syncthreads();
    block_aggregate = storage_.slot[kThreads];
    const T prefix = storage_.slot[tid];
    cuda_emu::RecordTempStorageUse(&storage_);
    return prefix;
  }

  TempStorage& storage_;
};

template <typename T, int BLOCK_DIM_X,
          BlockReduceAlgorithm ALGORITHM = BLOCK_REDUCE_WARP_REDUCTIONS, int BLOCK_DIM_Y = 1,
          int BLOCK_DIM_Z = 1>
class BlockReduce {
  static constexpr int kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;

 public:
  struct TempStorage {
    T slot[kThreads];
  };

  explicit BlockReduce(TempStorage& storage) : storage_(storage) {
    emu_detail::CheckBlockShape(kThreads, BLOCK_DIM_X, "cub::BlockReduce");
  }

  // The block-wide sum, in thread 0 only (CUB leaves the other threads' results undefined).
  T Sum(T input) {
    cuda_emu::CheckTempStorageReuse(&storage_, "cub::BlockReduce");
    const int tid = cuda_emu::LinearThreadId();
    storage_.slot[tid] = input;
    __syncthreads();
    T result = emu_detail::Poison<T>();
    if (tid == 0) {
      result = T();
      for (int i = 0; i < kThreads; ++i) result = emu_detail::WrappingAdd(result, storage_.slot[i]);
    }
    cuda_emu::RecordTempStorageUse(&storage_);
    return result;
  }

 private:
  TempStorage& storage_;
};

struct DeviceRadixSort {
  // Stable LSD radix sort of (key, value) pairs on key bits [begin_bit, end_bit), keys ordered
  // as CUB orders them (signed integers with negative keys first). Inputs are not modified.
  template <typename KeyT, typename ValueT, typename NumItemsT>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes,
                               const KeyT* d_keys_in, KeyT* d_keys_out,
                               const ValueT* d_values_in, ValueT* d_values_out,
                               NumItemsT num_items, int begin_bit = 0,
                               int end_bit = int(sizeof(KeyT) * 8), cudaStream_t stream = nullptr) {
    static_assert(std::is_integral_v<KeyT>, "the emulator's SortPairs sorts integer keys");
    using U = std::make_unsigned_t<KeyT>;
    constexpr int kKeyBits = int(sizeof(KeyT) * 8);
    constexpr int kDigitBits = 8, kBins = 1 << kDigitBits;
    const size_t n = num_items > 0 ? size_t(num_items) : 0;
    const size_t key_bytes = emu_detail::AlignUp(n * sizeof(KeyT));
    const size_t value_bytes = emu_detail::AlignUp(n * sizeof(ValueT));
    const size_t count_bytes = emu_detail::AlignUp(kBins * sizeof(size_t));
    const size_t needed = key_bytes + value_bytes + count_bytes + emu_detail::kAlign - 1;
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = needed;
      return cudaSuccess;
    }
    if (temp_storage_bytes < needed || num_items < 0 || begin_bit < 0 || begin_bit > end_bit ||
        end_bit > kKeyBits || !cuda_emu::IsValidStream(stream)) {
      return cudaErrorInvalidValue;
    }
    if (n && (!d_keys_in || !d_keys_out || !d_values_in || !d_values_out)) {
      return cudaErrorInvalidValue;
    }
    char* base = emu_detail::AlignUp(d_temp_storage);
    KeyT* keys_tmp = reinterpret_cast<KeyT*>(base);
    ValueT* values_tmp = reinterpret_cast<ValueT*>(base + key_bytes);
    size_t* count = reinterpret_cast<size_t*>(base + key_bytes + value_bytes);
    const U flip = std::is_signed_v<KeyT> ? U(U(1) << (kKeyBits - 1)) : U(0);
    const int passes = (end_bit - begin_bit + kDigitBits - 1) / kDigitBits;
    if (passes == 0) {
      if (n) {
        std::memcpy(d_keys_out, d_keys_in, n * sizeof(KeyT));
        std::memcpy(d_values_out, d_values_in, n * sizeof(ValueT));
      }
      return cudaSuccess;
    }
    const KeyT* keys_src = d_keys_in;
    const ValueT* values_src = d_values_in;
    for (int pass = 0; pass < passes; ++pass) {
      // The last pass lands in the outputs.
      const bool to_out = (passes - 1 - pass) % 2 == 0;
      KeyT* keys_dst = to_out ? d_keys_out : keys_tmp;
      ValueT* values_dst = to_out ? d_values_out : values_tmp;
      const int shift = begin_bit + pass * kDigitBits;
      const int bits = end_bit - shift < kDigitBits ? end_bit - shift : kDigitBits;
      const U digit_mask = U((1u << bits) - 1u);
      auto digit = [&](KeyT k) { return size_t((U(U(k) ^ flip) >> shift) & digit_mask); };
      for (int b = 0; b < kBins; ++b) count[b] = 0;
      for (size_t i = 0; i < n; ++i) ++count[digit(keys_src[i])];
      size_t offset = 0;
      for (int b = 0; b < kBins; ++b) {
        const size_t c = count[b];
        count[b] = offset;
        offset += c;
      }
      for (size_t i = 0; i < n; ++i) {
        const size_t at = count[digit(keys_src[i])]++;
        keys_dst[at] = keys_src[i];
        values_dst[at] = values_src[i];
      }
      keys_src = keys_dst;
      values_src = values_dst;
    }
    return cudaSuccess;
  }
};

struct DeviceScan {
  // out[i] = in[0] + ... + in[i - 1] (out[0] = 0), in the input's value type; in-place allowed.
  template <typename InputIt, typename OutputIt, typename NumItemsT>
  static cudaError_t ExclusiveSum(void* d_temp_storage, size_t& temp_storage_bytes, InputIt d_in,
                                  OutputIt d_out, NumItemsT num_items,
                                  cudaStream_t stream = nullptr) {
    using T = typename std::iterator_traits<InputIt>::value_type;
    constexpr size_t kNeeded = 16;  // the running total lives in the temporary storage
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = kNeeded;
      return cudaSuccess;
    }
    if (temp_storage_bytes < kNeeded || num_items < 0 || !cuda_emu::IsValidStream(stream)) {
      return cudaErrorInvalidValue;
    }
    T* running = static_cast<T*>(d_temp_storage);
    *running = T();
    for (NumItemsT i = 0; i < num_items; ++i) {
      const T v = d_in[i];
      d_out[i] = *running;
      *running = emu_detail::WrappingAdd(*running, v);
    }
    return cudaSuccess;
  }
};

}  // namespace cub
#ifdef CUB_WRAPPED_NAMESPACE
}  // namespace CUB_WRAPPED_NAMESPACE
#endif

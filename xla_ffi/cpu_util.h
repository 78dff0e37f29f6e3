// CPU helpers: dtype dispatch (float32, bfloat16 as raw bits, float16 as _Float16, with fp32
// load/store, so each arithmetic handler is written once over a template type) and a
// parallel-for over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "common.h"

namespace jax_ep {

// Smallest amount of memory traffic worth handing to another thread.
constexpr int64_t kParallelGrainBytes = 64 << 10;

// ParallelFor's grain for items (rows) of `item_bytes` each: enough items for
// kParallelGrainBytes, at least one (item_bytes = 0, e.g. H = 0, is legal).
inline int64_t GrainItems(int64_t item_bytes) {
  return std::max<int64_t>(1, kParallelGrainBytes / std::max<int64_t>(item_bytes, 1));
}

// The transparent huge page size; outputs of two pages or more get the hint below.
constexpr int64_t kHugePageBytes = 2 << 20;

// Asks the kernel to back the whole 2 MiB pages inside a freshly allocated output buffer with
// transparent huge pages before the handler first writes it. XLA:CPU hands out large outputs
// as new anonymous mappings, so a write-heavy handler otherwise spends most of its time in
// one page fault per 4 KiB (measured: 94 ms of a 128 MiB row gather, 13 ms of which is the
// copy itself). Only a hint: pages outside the buffer are never touched, failures are
// ignored, and without Linux (or with THP set to "never") it does nothing.
inline void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 2 * kHugePageBytes) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePageBytes - 1) &
                          ~uintptr_t(kHugePageBytes - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + uintptr_t(bytes)) &
                        ~uintptr_t(kHugePageBytes - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// Outputs of at least this many bytes are written with streaming (non-temporal) stores: a
// normal store first reads its destination line into the cache (read for ownership), so a
// row gather into a buffer larger than the cache moves its output bytes three times; a
// streaming store writes them once. Smaller outputs are likely read again while cached.
constexpr int64_t kStreamingStoreBytes = 8 << 20;

// dst[0, bytes) = src[0, bytes), or zeros when src is null.
inline void CopyOrZeroRow(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  if (src) {
    std::memcpy(dst, src, bytes);
  } else {
    std::memset(dst, 0, bytes);
  }
}

// CopyOrZeroRow with streaming stores for the 16-byte-aligned middle on x86-64 (plain
// CopyOrZeroRow elsewhere). Call StreamingFence() before the written bytes are handed to
// another thread.
inline void StreamRow(uint8_t* dst, const uint8_t* src, int64_t bytes) {
#if defined(__x86_64__)
  const int64_t head = std::min<int64_t>(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  const int64_t body = (bytes - head) / 16 * 16;
  if (src) {
    std::memcpy(dst, src, head);
    for (int64_t i = head; i < head + body; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    std::memcpy(dst + head + body, src + head + body, bytes - head - body);
  } else {
    std::memset(dst, 0, head);
    for (int64_t i = head; i < head + body; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_setzero_si128());
    std::memset(dst + head + body, 0, bytes - head - body);
  }
#else
  CopyOrZeroRow(dst, src, bytes);
#endif
}

// Orders this thread's streaming stores before its later stores (ParallelFor's completion
// count), so whoever sees the work done sees the bytes.
inline void StreamingFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

template <typename T>
struct Fp32Io;
template <>
struct Fp32Io<float> {
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
template <>
struct Fp32Io<uint16_t> {  // bfloat16 bits
  static float Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBf16(v); }
};
template <>
struct Fp32Io<_Float16> {
  static float Load(_Float16 v) { return float(v); }
  static _Float16 Store(float v) { return _Float16(v); }
};

// 16 fp32 lanes as a GCC/Clang vector: compiled to whatever SIMD the target has (one zmm
// register with AVX-512), with the same per-lane arithmetic as scalar code.
typedef float F32x16 __attribute__((vector_size(64)));

// acc += 16 values widened to fp32 (as Fp32Io<T>::Load) times w, each product rounded
// before the add; and 16 fp32 values stored as Fp32Io<T>::Store. Vectors go by reference
// (no vector-ABI dependence); the fixed-length loops vectorise.
template <typename T>
inline void MulAddF32x16(const T* __restrict in, float w, F32x16& acc) {
  F32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = Fp32Io<T>::Load(in[i]);
  acc += v * w;
}
template <typename T>
inline void StoreF32x16(const F32x16& v, T* __restrict out) {
  for (int i = 0; i < 16; ++i) out[i] = Fp32Io<T>::Store(v[i]);
}

// Calls fn(T{}) with the storage type of a float32 / bfloat16 / float16 buffer.
template <typename Fn>
inline ffi::Error DispatchFloat(ffi::DataType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::BF16:
      return fn(uint16_t{});
    case ffi::DataType::F16:
      return fn(_Float16{});
    default:
      return UnsupportedDtype(name, dtype);
  }
}

// Whether ParallelFor shares its chunks with XLA's intra-op pool. XLA:CPU runs the programs of
// every device of the process on the cores that pool's threads share (the pool a handler gets
// reports max(cores, devices) threads: jax 0.10 and 0.11, measured): where the process has at
// least as many devices as the pool has threads
// (--xla_force_host_platform_device_count at or past the cores), the devices' own programs
// keep every core busy and a shared chunk only queues behind them and spins (measured: the
// E = 8 layer step of 8 devices on 2 cores 3-10% faster with every chunk on its caller;
// benchmarks/RESULTS.md, session 32). kAuto shares while the handlers have run for fewer
// distinct devices than the pool has threads.
enum class PoolHelperMode : int { kAuto = 0, kAlways = 1, kNever = 2 };

// Device ordinals below this are told apart (ordinals are the devices' ids, which in a
// multi-process run need not start at 0); a call for a larger one counts no new device.
constexpr int32_t kTrackedDevices = 4096;

struct PoolHelperState {
  std::atomic<int> mode{int(PoolHelperMode::kAuto)};
  std::atomic<uint64_t> seen[kTrackedDevices / 64] = {};  // bit d: a handler ran for device d
  std::atomic<int32_t> devices_seen{0};                  // the bits set
  std::atomic<int64_t> pool_threads{0};                  // the pool's at the last ParallelFor
  std::atomic<int64_t> shared_calls{0};  // ParallelFor calls of several chunks: shared
  std::atomic<int64_t> inline_calls{0};  // ... and run on the caller alone
};

inline PoolHelperState& PoolHelpers() {
  static PoolHelperState state;
  return state;
}

// XLA's intra-op pool as a CPU handler gets it, with the device ordinal of the call
// (.Ctx<ThreadPool>().Ctx<DeviceOrdinal>()).
struct CpuWorkers {
  ffi::ThreadPool pool;
  int32_t device;
};

// Counts `device` among the devices seen; returns how many have been.
inline int32_t NoteDevice(int32_t device) {
  PoolHelperState& state = PoolHelpers();
  if (device >= 0 && device < kTrackedDevices) {
    std::atomic<uint64_t>& word = state.seen[device / 64];
    const uint64_t bit = uint64_t(1) << (device % 64);
    if (!(word.load(std::memory_order_relaxed) & bit) && !(word.fetch_or(bit) & bit)) {
      return state.devices_seen.fetch_add(1) + 1;
    }
  }
  return state.devices_seen.load(std::memory_order_relaxed);
}

// Records the call's device and says whether ParallelFor may hand chunks to a pool of
// `threads` threads.
inline bool SharesWithPool(int32_t device, int64_t threads) {
  PoolHelperState& state = PoolHelpers();
  const int32_t seen = NoteDevice(device);
  if (state.pool_threads.load(std::memory_order_relaxed) != threads) {
    state.pool_threads.store(threads, std::memory_order_relaxed);
  }
  switch (PoolHelperMode(state.mode.load(std::memory_order_relaxed))) {
    case PoolHelperMode::kAlways:
      return true;
    case PoolHelperMode::kNever:
      return false;
    default:
      return seen < threads;
  }
}

// Runs fn(begin, end) over [0, n) in chunks of at least `grain` items, on the calling thread
// and, where SharesWithPool, on XLA's intra-op pool. The caller claims chunks too and only
// waits for chunks already running, so a busy or missing pool can never deadlock it; tasks
// that start after the work is done find nothing to claim and never touch fn.
template <typename Fn>
void ParallelFor(const CpuWorkers& workers, int64_t n, int64_t grain, const Fn& fn) {
  ffi::ThreadPool pool = workers.pool;
  const int64_t threads = pool.num_threads();
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>((n + grain - 1) / grain, 4 * threads));
  int64_t helpers = std::min<int64_t>(threads, chunks - 1);
  if (n <= 0) return;
  if (helpers > 0 && !SharesWithPool(workers.device, threads)) {
    PoolHelpers().inline_calls.fetch_add(1, std::memory_order_relaxed);
    helpers = 0;
  }
  if (helpers <= 0) {
    fn(int64_t(0), n);
    return;
  }
  PoolHelpers().shared_calls.fetch_add(1, std::memory_order_relaxed);
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  const Fn* body = &fn;
  auto drain = [progress, body, n, chunks]() {
    for (int64_t c; (c = progress->next.fetch_add(1)) < chunks;) {
      (*body)(c * n / chunks, (c + 1) * n / chunks);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain] { drain(); });
  drain();
  while (progress->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace jax_ep

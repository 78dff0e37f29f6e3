// Self-test of the CUDA emulator (xla_ffi/emu) and its CUB stand-ins, built and run by
// tests/test_cuda_emu.py with AddressSanitizer and UndefinedBehaviorSanitizer.
//
//   cuda_emu_selftest            every check below; prints "checks N failed M", exits 1 on any
//   cuda_emu_selftest oob        a toy kernel writes one element past its buffer (ASan must stop it)
//   cuda_emu_selftest misaligned a 16-byte vector load from an address 4 bytes off (UBSan must)
//   cuda_emu_selftest smem_oob   a write one past the launch's dynamic shared memory (ASan must)
//
// Toy kernels use the same launch macro as jax_ep's .cu files and check the execution model
// (barriers with exited threads, warp collectives, shared memory, atomics, launch limits, the
// errors the emulator reports, a missing barrier showing in the results), the CUB stand-ins
// against plain C++ references, and the runtime's devices, events and peer access (a read of
// another device's memory refused until the reader enables peer access).
#include <cuda_runtime.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#define LAUNCH CUDA_EMU_LAUNCH

namespace {

int g_checks = 0, g_failed = 0;

void Check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failed;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

// The launch error (cleared) and its message.
std::string LastError() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : cudaGetErrorString(e);
}

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// ----------------------------------------------------------------------------- toy kernels

// Block sum in shared memory by halving, with the upper half of the threads exiting early
// (Volta semantics: exited threads drop out of later barriers).
__global__ void TreeSumKernel(const int* in, int* out) {
  __shared__ int partial[256];
  const int t = threadIdx.x;
  partial[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (t >= half) return;
    partial[t] += partial[t + half];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

// Every warp collective: out[8 * i + k] for thread i.
__global__ void WarpKernel(int* out) {
  const int t = threadIdx.x, lane = t % 32;
  int* o = out + 8 * t;
  o[0] = __shfl_sync(0xffffffffu, t * 10, 3);                 // lane 3's value
  o[1] = __shfl_xor_sync(0xffffffffu, t, 1);                  // the pair partner
  o[2] = __shfl_up_sync(0xffffffffu, t, 2);                   // lane - 2, own below 2
  o[3] = __shfl_down_sync(0xffffffffu, t, 5, 16);             // within 16-lane segments
  o[4] = int(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = __all_sync(0xffffffffu, t >= 0) + 2 * __any_sync(0xffffffffu, lane == 7);
  o[6] = __syncthreads_count(t % 4 == 0);
  int v = lane;  // a butterfly sum: every lane gets 0 + ... + 31
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncwarp();
  o[7] = v;
}

__global__ void AtomicKernel(int* counter, unsigned* maximum, float* sum) {
  atomicAdd(counter, 1);
  atomicMax(maximum, threadIdx.x + blockIdx.x * blockDim.x);
  atomicAdd(sum, 0.5f);
}

__global__ void DynamicSharedKernel(int* out, int n) {
  CUDA_EMU_EXTERN_SHARED(int, buf);
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = i * i;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int i = 0; i < n; ++i) s += buf[i];
    out[blockIdx.x] = s;
  }
}

__global__ void CoordinatesKernel(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  out[block * blockDim.x * blockDim.y * blockDim.z + thread] = block * 1000 + thread;
}

__global__ void DenormalKernel(const float* in, float* out) { out[0] = __fmul_rn(in[0], in[1]); }

// The last thread publishes a value in shared memory that every thread reads: with the barrier
// omitted, the alternating resume orders make some block read it before it is written.
__global__ void BroadcastKernel(int* out, bool barrier) {
  __shared__ int value;
  if (threadIdx.x == blockDim.x - 1) value = int(blockIdx.x) + 100;
  if (barrier) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// Errors the emulator must report.
__global__ void DeadlockKernel() {
  if (threadIdx.x == 0) {
    __syncwarp(0x3u);  // lane 1 never comes: it waits at the block barrier
  } else {
    __syncthreads();
  }
}

__global__ void ShuffleExitedLaneKernel(int* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, int(threadIdx.x), 0);
}

__global__ void ShuffleFromInactiveLaneKernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, int(threadIdx.x), 20) +
                     __shfl_sync(0xffff0000u, int(threadIdx.x), 0);
}

template <int kThreads>
__global__ void ScanReuseKernel(int* out, bool barrier_between) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int a, b, total;
  Scan(tmp).ExclusiveSum(1, a, total);
  if (barrier_between) __syncthreads();
  Scan(tmp).ExclusiveSum(2, b, total);
  out[threadIdx.x] = a + b;
}

__global__ void ScanWrongBlockKernel() {
  using Scan = cub::BlockScan<int, 128>;
  __shared__ typename Scan::TempStorage tmp;
  int a, total;
  Scan(tmp).ExclusiveSum(1, a, total);
}

// *out = the sum of from[0 .. n), read as a peer's memory (jax_ep's FromPeer).
__global__ void PeerSumKernel(const int* from, int n, int* out) {
  if (threadIdx.x != 0) return;
  cuda_emu::CheckPeerRead(from, size_t(n) * sizeof(int));
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += from[i];
  *out = sum;
}

// The deliberate bugs of the sanitizer modes.
__global__ void OutOfBoundsKernel(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = i;  // one past the end
}

struct alignas(16) Vec4 {
  float v[4];
};

__global__ void MisalignedKernel(const float* base, float* out) {
  const Vec4 x = *reinterpret_cast<const Vec4*>(base + 1);  // 4 bytes past a 16-byte boundary
  out[threadIdx.x] = x.v[0];
}

__global__ void SharedOutOfBoundsKernel(int n) {
  CUDA_EMU_EXTERN_SHARED(int, buf);
  if (threadIdx.x == 0) buf[n] = 1;  // the launch asked for n ints
}

// CUB block collectives under test.
template <int kThreads, int kItems>
__global__ void BlockScanKernel(const int* in, int* out, int* aggregate) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int items[kItems];
  for (int j = 0; j < kItems; ++j) items[j] = in[threadIdx.x * kItems + j];
  int total;
  Scan(tmp).ExclusiveSum(items, items, total);  // in place, as CUB allows
  for (int j = 0; j < kItems; ++j) out[threadIdx.x * kItems + j] = items[j];
  if (threadIdx.x == 0) *aggregate = total;
}

template <int kThreads>
__global__ void BlockReduceKernel(const long long* in, long long* out) {
  using Reduce = cub::BlockReduce<long long, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  out[threadIdx.x] = Reduce(tmp).Sum(in[threadIdx.x]);  // valid in thread 0 only
}

// ----------------------------------------------------------------------------- checks

void CheckExecutionModel() {
  {  // tree sum with early exits, 3 blocks
    std::vector<int> in(3 * 256), out(3, -1);
    std::iota(in.begin(), in.end(), 1);
    LAUNCH(3, 256, 0, nullptr, TreeSumKernel)(in.data(), out.data());
    Check(LastError().empty(), "tree sum launch");
    for (int b = 0; b < 3; ++b) {
      const int want = std::accumulate(in.begin() + 256 * b, in.begin() + 256 * (b + 1), 0);
      Check(out[b] == want, "tree sum block " + std::to_string(b));
    }
  }
  {  // warp collectives over a 64-thread block
    std::vector<int> out(64 * 8, -1);
    LAUNCH(1, 64, 0, nullptr, WarpKernel)(out.data());
    Check(LastError().empty(), "warp kernel launch");
    bool ok = true;
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, warp_base = t - lane, seg = lane & ~15;
      const int* o = &out[8 * t];
      unsigned ballot = 0;
      for (int l = 0; l < 32; ++l) ballot |= unsigned(l % 3 == 0) << l;
      const int down = lane + 5 < seg + 16 ? t + 5 : t;
      ok &= o[0] == (warp_base + 3) * 10 && o[1] == (t ^ 1) && o[2] == (lane >= 2 ? t - 2 : t) &&
            o[3] == down && unsigned(o[4]) == ballot && o[5] == 3 && o[6] == 16 && o[7] == 496;
    }
    Check(ok, "warp collectives (shfl idx/xor/up/down with width, ballot, all/any, count)");
  }
  {  // atomics over 4 x 128 threads
    int counter = 0;
    unsigned maximum = 0;
    float sum = 0;
    LAUNCH(4, 128, 0, nullptr, AtomicKernel)(&counter, &maximum, &sum);
    Check(counter == 512 && maximum == 511 && sum == 256.0f, "atomics");
  }
  {  // dynamic shared memory, per launch
    std::vector<int> out(2, 0);
    LAUNCH(2, 32, 100 * sizeof(int), nullptr, DynamicSharedKernel)(out.data(), 100);
    Check(LastError().empty() && out[0] == 328350 && out[1] == 328350, "dynamic shared memory");
  }
  {  // 3-D grids and blocks
    const dim3 grid(2, 3, 2), block(4, 2, 3);
    std::vector<int> out(12 * 24, -1);
    LAUNCH(grid, block, 0, nullptr, CoordinatesKernel)(out.data());
    bool ok = LastError().empty();
    for (int b = 0; b < 12; ++b)
      for (int t = 0; t < 24; ++t) ok &= out[b * 24 + t] == b * 1000 + t;
    Check(ok, "3-D grid and block coordinates");
  }
  {  // denormals are kept while a kernel runs, whatever the host thread's MXCSR
    const float in[2] = {1e-20f, 1e-20f};
    float out = -1;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ + DAZ, as XLA:CPU's threads run
    LAUNCH(1, 1, 0, nullptr, DenormalKernel)(in, &out);
    const unsigned after = _mm_getcsr();
    _mm_setcsr(csr);
    Check(out == 1e-20f * 1e-20f && out != 0.0f && after == (csr | 0x8040),
          "denormal product kept, host MXCSR restored");
  }
}

void CheckMissingBarrierShows() {
  for (bool barrier : {true, false}) {
    std::vector<int> out(4 * 64, -1);
    LAUNCH(4, 64, 0, nullptr, BroadcastKernel)(out.data(), barrier);
    int wrong = 0;
    for (int i = 0; i < 4 * 64; ++i) wrong += out[size_t(i)] != i / 64 + 100;
    Check(barrier ? wrong == 0 : wrong > 0,
          std::string("shared-memory broadcast ") + (barrier ? "with" : "without") +
              " its barrier: " + std::to_string(wrong) + " wrong reads");
  }
}

void CheckLaunchErrors() {
  std::vector<int> out(2048);
  LAUNCH(1, 1025, 0, nullptr, CoordinatesKernel)(out.data());
  Check(Contains(LastError(), "invalid configuration"), "1025 threads per block refused");
  LAUNCH(0, 32, 0, nullptr, CoordinatesKernel)(out.data());
  Check(Contains(LastError(), "invalid configuration"), "an empty grid refused");
  LAUNCH(dim3(1, 65536), 32, 0, nullptr, CoordinatesKernel)(out.data());
  Check(Contains(LastError(), "invalid configuration"), "grid.y above 65535 refused");
  LAUNCH(1, dim3(1, 1, 65), 0, nullptr, CoordinatesKernel)(out.data());
  Check(Contains(LastError(), "invalid configuration"), "block.z above 64 refused");
  LAUNCH(1, 32, 49 * 1024, nullptr, DynamicSharedKernel)(out.data(), 1);
  Check(Contains(LastError(), "dynamic shared memory"), "49 KiB of dynamic shared memory refused");
  LAUNCH(1, 32, 0, reinterpret_cast<cudaStream_t>(&out), CoordinatesKernel)(out.data());
  Check(Contains(LastError(), "invalid resource handle"), "an unknown stream refused");
  Check(LastError().empty(), "cudaGetLastError clears the error");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream) == cudaSuccess, "stream created");
  LAUNCH(1, 32, 0, stream, CoordinatesKernel)(out.data());
  Check(LastError().empty() && cudaStreamSynchronize(stream) == cudaSuccess &&
            cudaStreamDestroy(stream) == cudaSuccess,
        "launch on a created stream");
}

void CheckReportedErrors() {
  std::vector<int> out(256);
  LAUNCH(1, 32, 0, nullptr, DeadlockKernel)();
  std::string e = LastError();
  Check(Contains(e, "unspecified launch failure") && Contains(e, "deadlock"),
        "deadlock reported: " + e);
  LAUNCH(1, 32, 0, nullptr, ShuffleExitedLaneKernel)(out.data());
  e = LastError();
  Check(Contains(e, "exited"), "shuffle naming an exited lane reported: " + e);
  LAUNCH(1, 32, 0, nullptr, ShuffleFromInactiveLaneKernel)(out.data());
  e = LastError();
  Check(Contains(e, "not in the mask") || Contains(e, "divergent"),
        "shuffle from a lane outside the mask reported: " + e);
  LAUNCH(1, 64, 0, nullptr, ScanReuseKernel<64>)(out.data(), false);
  e = LastError();
  Check(Contains(e, "no __syncthreads()"), "BlockScan storage reused without a barrier: " + e);
  LAUNCH(1, 64, 0, nullptr, ScanReuseKernel<64>)(out.data(), true);
  bool ok = LastError().empty();
  for (int t = 0; t < 64; ++t) ok &= out[t] == 3 * t;
  Check(ok, "BlockScan storage reused after a barrier");
  LAUNCH(1, 64, 0, nullptr, ScanWrongBlockKernel)();
  e = LastError();
  Check(Contains(e, "specialised for 128 threads"), "BlockScan in a block of the wrong size: " + e);
  // After errors the emulator still runs kernels correctly.
  std::vector<int> in(256, 1), sum(1);
  LAUNCH(1, 256, 0, nullptr, TreeSumKernel)(in.data(), sum.data());
  Check(LastError().empty() && sum[0] == 256, "a kernel runs correctly after reported errors");
}

template <int kThreads, int kItems>
void CheckBlockScan(std::mt19937& rng) {
  std::vector<int> in(kThreads * kItems), out(in.size()), want(in.size());
  for (int& v : in) v = int(rng() % 7);
  int aggregate = -1;
  LAUNCH(1, kThreads, 0, nullptr, BlockScanKernel<kThreads, kItems>)(in.data(), out.data(),
                                                                    &aggregate);
  std::exclusive_scan(in.begin(), in.end(), want.begin(), 0);
  Check(LastError().empty() && out == want &&
            aggregate == std::accumulate(in.begin(), in.end(), 0),
        "BlockScan<" + std::to_string(kThreads) + "> x " + std::to_string(kItems) + " items");
}

void CheckCub() {
  std::mt19937 rng(7);
  CheckBlockScan<256, 8>(rng);
  CheckBlockScan<256, 4>(rng);
  CheckBlockScan<32, 1>(rng);
  {
    std::vector<long long> in(256), out(256);
    for (auto& v : in) v = (long long)(rng() % 1000) - 400;
    LAUNCH(1, 256, 0, nullptr, BlockReduceKernel<256>)(in.data(), out.data());
    bool poisoned = true;
    for (int t = 1; t < 256; ++t) poisoned &= out[t] == 0x5a5a5a5a5a5a5a5all;
    Check(LastError().empty() && out[0] == std::accumulate(in.begin(), in.end(), 0ll) && poisoned,
          "BlockReduce::Sum in thread 0, poison elsewhere");
  }
  for (int n : {0, 1, 5, 1000, 4099}) {
    for (auto [begin, end] : {std::pair{0, 32}, std::pair{0, 13}, std::pair{3, 11}}) {
      const size_t count = static_cast<size_t>(n);
      std::vector<int> keys(count), values(count), keys_out(count), values_out(count);
      for (int i = 0; i < n; ++i) {
        keys[size_t(i)] = int(rng() % 5000) - (end == 32 ? 2500 : 0);  // negatives: full range
        values[size_t(i)] = i;
      }
      size_t bytes = 0;
      Check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys.data(), keys_out.data(),
                                            values.data(), values_out.data(), n, begin, end) ==
                    cudaSuccess && bytes > 0,
            "SortPairs size query");
      std::vector<char> temp(bytes);
      size_t small = bytes - 1;
      Check(cub::DeviceRadixSort::SortPairs(temp.data(), small, keys.data(), keys_out.data(),
                                            values.data(), values_out.data(), n, begin,
                                            end) == cudaErrorInvalidValue,
            "SortPairs refuses too little temporary storage");
      const auto keys_in = keys;
      Check(cub::DeviceRadixSort::SortPairs(temp.data(), bytes, keys.data(), keys_out.data(),
                                            values.data(), values_out.data(), n, begin,
                                            end) == cudaSuccess,
            "SortPairs");
      // Reference: stable sort by the key's bits [begin, end) of its order-preserving form.
      const unsigned mask = end - begin == 32 ? ~0u : ((1u << (end - begin)) - 1u) << begin;
      auto digit = [&](int k) { return (unsigned(k) ^ 0x80000000u) & mask; };
      std::vector<int> order(count);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return digit(keys[size_t(a)]) < digit(keys[size_t(b)]); });
      bool ok = keys == keys_in;
      for (int i = 0; i < n; ++i) {
        ok &= values_out[size_t(i)] == order[size_t(i)] &&
              keys_out[size_t(i)] == keys[size_t(order[size_t(i)])];
      }
      Check(ok, "SortPairs n=" + std::to_string(n) + " bits [" + std::to_string(begin) + ", " +
                    std::to_string(end) + ") stable, inputs unchanged");
    }
  }
  for (int n : {0, 1, 77, 3000}) {
    const size_t count = static_cast<size_t>(n);
    std::vector<int> in(count), want(count);
    for (int& v : in) v = int(rng() % 9);
    std::exclusive_scan(in.begin(), in.end(), want.begin(), 0);
    size_t bytes = 0;
    cub::DeviceScan::ExclusiveSum(nullptr, bytes, in.data(), in.data(), n);
    std::vector<char> temp(bytes);
    size_t small = bytes - 1;
    Check(cub::DeviceScan::ExclusiveSum(temp.data(), small, in.data(), in.data(), n) ==
              cudaErrorInvalidValue,
          "DeviceScan refuses too little temporary storage");
    Check(cub::DeviceScan::ExclusiveSum(temp.data(), bytes, in.data(), in.data(), n) ==
                  cudaSuccess && in == want,
          "DeviceScan::ExclusiveSum in place, n=" + std::to_string(n));
  }
}

void CheckRuntime() {
  void* p = nullptr;
  Check(cudaMalloc(&p, 1000) == cudaSuccess && reinterpret_cast<uintptr_t>(p) % 256 == 0,
        "cudaMalloc 256-byte aligned");
  Check(cudaMemset(p, 7, 1000) == cudaSuccess && static_cast<unsigned char*>(p)[999] == 7,
        "cudaMemset");
  std::vector<char> host(1000);
  Check(cudaMemcpy(host.data(), p, 1000, cudaMemcpyDeviceToHost) == cudaSuccess && host[0] == 7,
        "cudaMemcpy");
  Check(cudaFree(p) == cudaSuccess, "cudaFree");
  Check(cudaFree(host.data()) == cudaErrorInvalidValue, "cudaFree of a foreign pointer refused");
  (void)cudaGetLastError();
  Check(cudaMemsetAsync(nullptr, 0, 4, nullptr) == cudaErrorInvalidValue,
        "cudaMemsetAsync(nullptr) refused");
  (void)cudaGetLastError();
}

// Devices: the count, the current device per host thread, peer access and who may read what.
void CheckDevicesAndPeerAccess() {
  int count = 0, device = -1, other = -1, can = -1;
  Check(cudaGetDeviceCount(&count) == cudaSuccess && count == 8, "8 devices by default");
  Check(cudaGetDevice(&device) == cudaSuccess && device == 0, "device 0 current at first");
  Check(cudaSetDevice(count) == cudaErrorInvalidDevice && Contains(LastError(), "invalid device"),
        "cudaSetDevice past the last device refused");
  std::thread([&] {
    cudaSetDevice(3);
    cudaGetDevice(&other);
  }).join();
  cudaGetDevice(&device);
  Check(other == 3 && device == 0, "the current device is per host thread");
  Check(cudaDeviceCanAccessPeer(&can, 0, 1) == cudaSuccess && can == 1, "0 can access 1");
  Check(cudaDeviceCanAccessPeer(&can, 1, 1) == cudaSuccess && can == 0, "not its own peer");
  Check(cudaDeviceCanAccessPeer(&can, 0, count) == cudaErrorInvalidDevice, "no such peer");
  (void)cudaGetLastError();

  int* on0 = nullptr;  // device 0's memory
  cudaMalloc(&on0, 4 * sizeof(int));
  for (int i = 0; i < 4; ++i) on0[i] = i + 1;
  cudaSetDevice(1);
  int* on1 = nullptr;
  cudaMalloc(&on1, sizeof(int));
  LAUNCH(1, 32, 0, nullptr, PeerSumKernel)(on1, 1, on1);
  Check(LastError().empty(), "a kernel reads its own device's memory");
  LAUNCH(1, 32, 0, nullptr, PeerSumKernel)(on0, 4, on1);
  const std::string refused = LastError();
  Check(Contains(refused, "unspecified launch failure") &&
            Contains(refused, "on device 1 reads 16 bytes") &&
            Contains(refused, "never called cudaDeviceEnablePeerAccess(0)"),
        "device 1 reading device 0's memory without peer access refused: " + refused);
  Check(cudaDeviceEnablePeerAccess(0, 0) == cudaSuccess, "peer access 1 -> 0 enabled");
  *on1 = 0;
  LAUNCH(1, 32, 0, nullptr, PeerSumKernel)(on0, 4, on1);
  Check(LastError().empty() && *on1 == 10, "device 1 reads device 0's memory once enabled");
  Check(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorPeerAccessAlreadyEnabled &&
            Contains(LastError(), "already enabled"),
        "enabling twice: cudaErrorPeerAccessAlreadyEnabled, also the last error");
  Check(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorInvalidDevice, "a device is not its peer");
  Check(cudaDeviceEnablePeerAccess(count, 0) == cudaErrorInvalidDevice, "no such peer to enable");
  (void)cudaGetLastError();

  std::vector<int> host(4, 5);  // host memory claimed by device 2 (as bindings_emu.cc does)
  const uint64_t claim = cuda_emu::ClaimMemory(2, host.data(), host.size() * sizeof(int));
  LAUNCH(1, 32, 0, nullptr, PeerSumKernel)(host.data(), 4, on1);
  Check(Contains(LastError(), "memory of device 2"), "claimed host memory is device 2's");
  cuda_emu::ReleaseMemory(claim);
  LAUNCH(1, 32, 0, nullptr, PeerSumKernel)(host.data(), 4, on1);
  Check(LastError().empty() && *on1 == 20, "memory nobody claims is readable from every device");

  cudaSetDevice(0);
  cudaStream_t stream0 = nullptr;
  cudaStreamCreate(&stream0);
  cudaSetDevice(1);
  LAUNCH(1, 32, 0, stream0, PeerSumKernel)(on1, 1, on1);
  Check(Contains(LastError(), "stream of device 0 while device 1 is current"),
        "a launch on another device's stream refused");
  cudaStreamDestroy(stream0);
  cudaFree(on1);
  cudaSetDevice(0);
  cudaFree(on0);
}

// Events: made on the current device, recorded on its streams only, waited on from any device;
// unknown or destroyed handles refused everywhere.
void CheckEvents() {
  cudaStream_t stream0 = nullptr, stream1 = nullptr;
  cudaStreamCreate(&stream0);
  cudaSetDevice(1);
  cudaStreamCreate(&stream1);
  cudaEvent_t event = nullptr;
  Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess, "event made");
  Check(cudaEventRecord(event, stream1) == cudaSuccess && cudaEventQuery(event) == cudaSuccess &&
            cudaEventSynchronize(event) == cudaSuccess,
        "recorded on a stream of its device, complete at once");
  Check(cudaEventRecord(event, stream0) == cudaErrorInvalidResourceHandle &&
            Contains(LastError(), "device 1's, the stream device 0's"),
        "recording on another device's stream refused");
  Check(cudaStreamWaitEvent(stream0, event, 0) == cudaSuccess, "a stream waits on another "
                                                              "device's event");
  Check(cudaStreamWaitEvent(stream0, event, 1) == cudaErrorInvalidValue, "unknown wait flags");
  cudaEvent_t bad = nullptr;
  Check(cudaEventCreateWithFlags(&bad, 0x100) == cudaErrorInvalidValue &&
            cudaEventCreateWithFlags(&bad, cudaEventInterprocess) == cudaErrorInvalidValue,
        "unknown flags, and interprocess without cudaEventDisableTiming, refused");
  int never_made = 0;
  Check(cudaStreamWaitEvent(stream0, reinterpret_cast<cudaEvent_t>(&never_made), 0) ==
            cudaErrorInvalidResourceHandle,
        "waiting on an event never made refused");
  Check(cudaEventDestroy(event) == cudaSuccess, "event destroyed");
  Check(cudaEventRecord(event, stream1) == cudaErrorInvalidResourceHandle &&
            cudaStreamWaitEvent(stream1, event, 0) == cudaErrorInvalidResourceHandle &&
            cudaEventQuery(event) == cudaErrorInvalidResourceHandle &&
            cudaEventDestroy(event) == cudaErrorInvalidResourceHandle,
        "a destroyed event refused everywhere");
  (void)cudaGetLastError();
  cudaStreamDestroy(stream1);
  cudaSetDevice(0);
  cudaStreamDestroy(stream0);
}

// The launch counts name each template instance; a refused launch is not counted.
void CheckLaunchCounts() {
  cuda_emu::LaunchCounts(/*reset=*/true);
  std::vector<int> out(128);
  LAUNCH(1, 128, 0, nullptr, ScanReuseKernel<128>)(out.data(), true);
  LAUNCH(1, 128, 0, nullptr, ScanReuseKernel<128>)(out.data(), true);
  LAUNCH(1, 2048, 0, nullptr, ScanReuseKernel<128>)(out.data(), true);  // too many threads
  (void)cudaGetLastError();
  const auto counts = cuda_emu::LaunchCounts(/*reset=*/true);
  Check(counts.size() == 1 && counts[0].first == "ScanReuseKernel<128>" && counts[0].second == 2,
        "launch counts by kernel instance: " +
            (counts.empty() ? std::string("none") : counts[0].first));
  Check(cuda_emu::LaunchCounts().empty(), "launch counts reset");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "oob") {
    std::vector<int> out(100);
    LAUNCH(1, 128, 0, nullptr, OutOfBoundsKernel)(out.data(), 100);
    std::printf("oob: no report (%s)\n", LastError().c_str());
    return 0;
  }
  if (mode == "misaligned") {
    alignas(16) float in[8] = {};
    float out[4];
    LAUNCH(1, 4, 0, nullptr, MisalignedKernel)(in, out);
    std::printf("misaligned: no report\n");
    return 0;
  }
  if (mode == "smem_oob") {
    LAUNCH(1, 32, 16 * sizeof(int), nullptr, SharedOutOfBoundsKernel)(16);
    std::printf("smem_oob: no report\n");
    return 0;
  }
  CheckExecutionModel();
  CheckMissingBarrierShows();
  CheckLaunchErrors();
  CheckReportedErrors();
  CheckCub();
  CheckRuntime();
  CheckDevicesAndPeerAccess();
  CheckEvents();
  CheckLaunchCounts();
  std::printf("checks %d failed %d\n", g_checks, g_failed);
  return g_failed ? 1 : 0;
}

// An emulator of the CUDA execution model on the host, so that jax_ep's .cu kernels run
// unchanged (compiled as C++) in CI, where there is no GPU.
//
// Model: a launch runs its grid one block at a time (process-wide: launches are serialised);
// a block's threads are fibers (user-level threads with their own stacks) on the calling host
// thread, switched only where CUDA threads synchronise: __syncthreads*, __syncwarp and the warp
// collectives (__shfl*_sync, __ballot_sync, __all_sync, __any_sync). Warps are 32 lanes of
// consecutive linear thread ids. A thread that returns drops out of later block barriers (as on
// Volta and later); a warp collective whose mask names an exited lane, a lane outside the block
// or lanes that arrived with different masks or operations is reported, and so is a deadlock
// (threads waiting at barriers nobody else can reach). The block's threads run in alternating
// orders (each pass of the scheduler, i.e. after each barrier, and each block the other way
// round from the one before; JAX_EP_CUDA_EMU_SCHEDULE=forward or reverse fixes one), so a
// missing barrier between a shared-memory write and another thread's read shows up in the
// results; the CUB stand-ins also report temporary storage reused without a barrier.
//
// `__shared__` variables are function statics (one per kernel, shared by the block running it);
// dynamic shared memory (CUDA_EMU_EXTERN_SHARED) is a fresh allocation of exactly the launch's
// size per launch, filled with 0xcd garbage before each block, so AddressSanitizer sees an
// access past it. Launches check CUDA's limits (1024 threads per block, block and grid extents,
// 48 KiB of dynamic shared memory) and fail as the device would: the kernel does not run and
// cudaGetLastError reports the error. Errors found while a kernel runs abandon the launch and
// surface as cudaErrorLaunchFailure with the emulator's message in cudaGetErrorString.
// Streams are in-order queues that run each operation when it is issued. Float intrinsics are
// plain IEEE operations (the build uses -ffp-contract=off, so nothing fuses), with the host's
// flush-to-zero / denormals-are-zero modes off while a kernel runs (CUDA keeps denormals unless
// built with -ftz=true). Each launch is counted by kernel template instance (LaunchCounts): the
// coverage measure of CI's emulated stage.
//
// Devices: cudaGetDeviceCount reports JAX_EP_CUDA_EMU_DEVICES devices (default 8, at most
// 64); cudaSetDevice / cudaGetDevice keep a current device per host thread (0 until set).
// Streams and events belong to the device current when they were made, and the runtime's
// rules between devices hold: a kernel launched on a stream of another device than the current
// one fails (cudaErrorInvalidResourceHandle), so does cudaEventRecord of an event and a stream
// of different devices; cudaStreamWaitEvent on an event of another device is legal. An event
// handle that was never made or was destroyed is cudaErrorInvalidResourceHandle everywhere.
// Every operation has run when it is issued, so events order nothing here: recording and
// waiting check their handles, cudaEventQuery / cudaEventSynchronize report completion.
//
// Peer access: every pair of distinct devices can access each other (cudaDeviceCanAccessPeer), once
// the reading device enabled it (cudaDeviceEnablePeerAccess from that device; enabling twice is
// cudaErrorPeerAccessAlreadyEnabled, the device itself or one that does not exist is
// cudaErrorInvalidDevice), except the pairs JAX_EP_CUDA_EMU_NO_PEER_ACCESS names ("a:b,c:d", read
// at every call): those cannot (enabling is cudaErrorPeerAccessUnsupported). Which memory is whose:
// cudaMalloc'd memory belongs to the device current at the call, and ClaimMemory declares a range
// as a device's (bindings_emu.cc claims each FFI call's operands and results for its device for the
// length of the call: XLA:CPU's buffers are host memory of no device). A kernel's reads of another
// device's memory go through CheckPeerRead (jax_ep's `FromPeer` in cuda_common.cuh; a plain pointer
// on the GPU): a read of memory claimed only by devices the kernel's device has not enabled access
// to fails the launch (cudaErrorLaunchFailure with the emulator's message). Plain loads and stores
// are not checked; memory nobody claimed is readable from every device.
//
// Not modelled: concurrency between blocks or streams, the memory model (no reordering, no
// caches), timing, warp-synchronous code without __syncwarp (lanes do not run in lockstep),
// __launch_bounds__ (accepted, not checked beyond the 1024-thread limit), and any ordering by
// events (operations run when issued, so a missing cudaStreamWaitEvent goes unseen).
#pragma once

#if defined(__CUDACC__)
#error "cuda_emu/emulator.h is the host emulator; nvcc builds use the real CUDA runtime"
#endif
#if !defined(__x86_64__)
#error "the CUDA emulator switches x86-64 register contexts; build JAX_EP_CUDA_EMU on x86-64"
#endif

#include <vector_types.h>  // dim3, uint3, uint2, uint4: the toolkit's host definitions

// The toolkit's host_defines.h (included once, by vector_types.h or cuda_fp16.h) defines
// __shared__ as nothing for host compilers.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define CUDA_EMU 1

// ----------------------------------------------------------------------------- runtime API
// The toolkit's declarations (types, error codes, signatures); the emulator defines the entry
// points jax_ep uses: cudaGetLastError, cudaPeekAtLastError, cudaGetErrorString, cudaMalloc,
// cudaFree, cudaMemcpy(Async), cudaMemset(Async), cudaStreamCreate / Destroy / Synchronize,
// cudaDeviceSynchronize, cudaGetDeviceCount, cudaSetDevice, cudaGetDevice,
// cudaDeviceCanAccessPeer, cudaDeviceEnablePeerAccess, cudaEventCreate(WithFlags),
// cudaEventRecord, cudaStreamWaitEvent, cudaEventQuery, cudaEventSynchronize and
// cudaEventDestroy. Any other entry point is an undefined symbol at import.
#include <cuda_runtime_api.h>

template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}

// ----------------------------------------------------------------------------- launches

// The running thread's coordinates, set by the scheduler before it switches to a thread.
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

namespace cuda_emu {

struct LaunchConfig {
  const char* kernel_name;
  const char* instance;  // the kernel's template instance, as the compiler names it
  dim3 grid;
  dim3 block;
  size_t dynamic_shared_bytes;
  cudaStream_t stream;
};

// Runs `thread_main(context)` as every thread of the grid (see the header comment); on a bad
// configuration or an error while running, the sticky launch error is set instead.
void Launch(const LaunchConfig& config, void (*thread_main)(void*), void* context);

// How many launches of each kernel instance ran (a refused configuration does not count) since
// the process started or the last reset, sorted by instance name; `reset` zeroes the counts
// in the same step.
std::vector<std::pair<std::string, uint64_t>> LaunchCounts(bool reset = false);

// The kernel named in a __PRETTY_FUNCTION__ of KernelInstanceName, without anonymous
// namespaces: "... [with auto Kernel = (& {anonymous}::K<int, 4>)]" -> "K<int, 4>".
std::string KernelFromPrettyFunction(const char* pretty_function);

// The instance name of `Kernel` (e.g. "jax_ep::GatherRowsKernel<uint4>"): the compiler's
// own spelling of the template arguments.
template <auto Kernel>
const char* KernelInstanceName() {
  static const std::string name = KernelFromPrettyFunction(__PRETTY_FUNCTION__);
  return name.c_str();
}

// The launch's dynamic shared memory (extern __shared__).
void* DynamicSharedMemory();

// A CUDA stream handle is valid: the default stream (null) or one this runtime made.
bool IsValidStream(cudaStream_t stream);

// ----------------------------------------------------------------------------- device memory

// Declares [data, data + bytes) as device `device`'s memory until ReleaseMemory(the returned
// id). Claims may overlap (a range several devices claim is each of theirs).
uint64_t ClaimMemory(int device, const void* data, size_t bytes);
void ReleaseMemory(uint64_t claim);

// In a kernel: the running kernel reads [data, data + bytes). Fails the launch when that
// memory is claimed, none of its claims is the kernel's device's, and the kernel's device has
// not enabled peer access to any of the devices that claim it.
void CheckPeerRead(const void* data, size_t bytes);

// Reports an error of the running kernel (abandons the launch; does not return).
[[noreturn]] void KernelError(const char* format, ...) __attribute__((format(printf, 1, 2)));

template <typename... Params>
class KernelLaunch {
 public:
  KernelLaunch(void (*kernel)(Params...), LaunchConfig config)
      : kernel_(kernel), config_(config) {}

  // Each thread gets its own copy of the arguments, converted to the kernel's parameter types
  // once, as the device reads them from the launch's parameter buffer.
  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params),
                  "kernel launched with the wrong number of arguments");
    struct Context {
      void (*kernel)(Params...);
      std::tuple<std::decay_t<Params>...> params;
    } context{kernel_, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    Launch(config_,
           [](void* p) {
             const Context& c = *static_cast<const Context*>(p);
             std::tuple<std::decay_t<Params>...> own = c.params;
             std::apply(c.kernel, own);
           },
           &context);
  }

 private:
  void (*kernel_)(Params...);
  LaunchConfig config_;
};

template <typename... Params>
KernelLaunch<Params...> MakeLaunch(void (*kernel)(Params...), const char* name,
                                   const char* instance, dim3 grid, dim3 block,
                                   size_t dynamic_shared_bytes, cudaStream_t stream) {
  return KernelLaunch<Params...>(
      kernel, LaunchConfig{name, instance, grid, block, dynamic_shared_bytes, stream});
}

// ----------------------------------------------------------------------------- synchronisation

enum class WarpOp { kSync, kBallot, kAll, kAny, kShfl, kShflUp, kShflDown, kShflXor };

// One warp collective of the running lane: waits for every lane of `mask`, then returns this
// lane's result (shuffles: the source lane's `value`; votes: the vote).
uint64_t WarpCollective(WarpOp op, unsigned mask, uint64_t value, int arg, int width);

// A block barrier; returns the number of threads that passed a non-zero `predicate`.
int BlockBarrier(int predicate);

// Linear id of the running thread in its block, and the block's thread count.
int LinearThreadId();
int BlockThreads();

// Raises an error when the block's temporary storage at `storage` is used again by the same
// collective family without a __syncthreads() since its previous use completed; `what` names
// the collective. RecordTempStorageUse marks the end of a use.
void CheckTempStorageReuse(const void* storage, const char* what);
void RecordTempStorageUse(const void* storage);

template <typename T>
uint64_t ToBits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                "warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T FromBits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace cuda_emu

// The source form of a launch `kernel<<<grid, block, shared_bytes, stream>>>(args...)`.
#define CUDA_EMU_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::cuda_emu::MakeLaunch(&__VA_ARGS__, #__VA_ARGS__,                           \
                         ::cuda_emu::KernelInstanceName<&__VA_ARGS__>(), grid, block, \
                         shared_bytes, stream)

// `extern __shared__ T name[]`: the launch's dynamic shared memory as an array of T.
#define CUDA_EMU_EXTERN_SHARED(T, name) \
  T* const name = static_cast<T*>(::cuda_emu::DynamicSharedMemory())

inline void __syncthreads() { cuda_emu::BlockBarrier(0); }
inline int __syncthreads_count(int predicate) { return cuda_emu::BlockBarrier(predicate != 0); }
inline int __syncthreads_and(int predicate) {
  return cuda_emu::BlockBarrier(predicate != 0) == cuda_emu::BlockThreads();
}
inline int __syncthreads_or(int predicate) { return cuda_emu::BlockBarrier(predicate != 0) > 0; }

unsigned __activemask();

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emu::WarpCollective(cuda_emu::WarpOp::kSync, mask, 0, 0, 32);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return unsigned(cuda_emu::WarpCollective(cuda_emu::WarpOp::kBallot, mask, predicate != 0, 0,
                                           32));
}
inline int __all_sync(unsigned mask, int predicate) {
  return int(cuda_emu::WarpCollective(cuda_emu::WarpOp::kAll, mask, predicate != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  return int(cuda_emu::WarpCollective(cuda_emu::WarpOp::kAny, mask, predicate != 0, 0, 32));
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return cuda_emu::FromBits<T>(cuda_emu::WarpCollective(
      cuda_emu::WarpOp::kShfl, mask, cuda_emu::ToBits(var), src_lane, width));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return cuda_emu::FromBits<T>(cuda_emu::WarpCollective(
      cuda_emu::WarpOp::kShflUp, mask, cuda_emu::ToBits(var), int(delta), width));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return cuda_emu::FromBits<T>(cuda_emu::WarpCollective(
      cuda_emu::WarpOp::kShflDown, mask, cuda_emu::ToBits(var), int(delta), width));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return cuda_emu::FromBits<T>(cuda_emu::WarpCollective(
      cuda_emu::WarpOp::kShflXor, mask, cuda_emu::ToBits(var), lane_mask, width));
}

// ----------------------------------------------------------------------------- atomics
// Threads are cooperative fibers and one launch runs at a time, so no other emulated thread
// can run between the read and the write: a plain read-modify-write is atomic here.

template <typename T>
T cuda_emu_atomic_update(T* address, T value, T (*update)(T, T)) {
  const T old = *address;
  *address = update(old, value);
  return old;
}

#define CUDA_EMU_ATOMIC(name, type, expr)                                                   \
  inline type name(type* address, type value) {                                              \
    return cuda_emu_atomic_update<type>(address, value, [](type a, type b) -> type { return expr; }); \
  }
CUDA_EMU_ATOMIC(atomicAdd, int, a + b)
CUDA_EMU_ATOMIC(atomicAdd, unsigned, a + b)
CUDA_EMU_ATOMIC(atomicAdd, unsigned long long, a + b)
CUDA_EMU_ATOMIC(atomicAdd, float, a + b)
CUDA_EMU_ATOMIC(atomicMax, int, a > b ? a : b)
CUDA_EMU_ATOMIC(atomicMax, unsigned, a > b ? a : b)
CUDA_EMU_ATOMIC(atomicMin, int, a < b ? a : b)
CUDA_EMU_ATOMIC(atomicMin, unsigned, a < b ? a : b)
CUDA_EMU_ATOMIC(atomicExch, int, b)
CUDA_EMU_ATOMIC(atomicExch, unsigned, b)
#undef CUDA_EMU_ATOMIC

inline int atomicCAS(int* address, int compare, int value) {
  const int old = *address;
  if (old == compare) *address = value;
  return old;
}

// ----------------------------------------------------------------------------- arithmetic
// Correctly rounded single-precision operations (round to nearest even): IEEE host arithmetic.

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

// CUDA's integer and float min / max overloads.
#define CUDA_EMU_MINMAX(type)                                       \
  inline type min(type a, type b) { return b < a ? b : a; }         \
  inline type max(type a, type b) { return a < b ? b : a; }
CUDA_EMU_MINMAX(int)
CUDA_EMU_MINMAX(unsigned)
CUDA_EMU_MINMAX(long)
CUDA_EMU_MINMAX(unsigned long)
CUDA_EMU_MINMAX(long long)
CUDA_EMU_MINMAX(unsigned long long)
#undef CUDA_EMU_MINMAX
// fminf / fmaxf: a NaN operand yields the other operand.
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }

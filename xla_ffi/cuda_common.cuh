// Shared by the CUDA (.cu) handlers: device-side float I/O for float32 / bfloat16 / float16
// storage (bit-exact with the CPU handlers' Fp32Io), the dtype dispatch that picks it, 16-byte
// vector helpers for row movement, the launch / CUDA-call error checks, and the source forms
// that differ between nvcc and the CUDA emulator (xla_ffi/emu, the JAX_EP_CUDA_EMU build, which
// compiles these files as host C++): kernel launches, dynamic shared memory and the check of a
// read of a peer GPU's memory (FromPeer).
//
// Include this header before any CUB header: it wraps CUB in a private namespace so that the
// extension's CUB instantiations never collide with another library's (jaxlib's) in the process.
#pragma once

#if defined(CUB_VERSION)
#error "include cuda_common.cuh before any CUB header"
#endif
#ifndef CUB_WRAPPED_NAMESPACE
#define CUB_WRAPPED_NAMESPACE jax_ep_cub
#endif

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common.h"

// JAX_EP_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...) is
// kernel<<<grid, block, shared_bytes, stream>>>(args...); JAX_EP_EXTERN_SHARED(T, name) is
// `extern __shared__ T name[]`. Nothing else in a .cu file differs between the two builds.
#if defined(CUDA_EMU)
#define JAX_EP_LAUNCH CUDA_EMU_LAUNCH
#define JAX_EP_EXTERN_SHARED CUDA_EMU_EXTERN_SHARED
#else
#define JAX_EP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#define JAX_EP_EXTERN_SHARED(T, name) extern __shared__ T name[]
#endif

namespace jax_ep {

// ----------------------------------------------------------------------------- errors

// The error of the last kernel launch (cudaGetLastError also clears it), as an FFI error naming
// the kernel; Success when the launch went through.
inline ffi::Error CheckLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ep CUDA: launching ") + what + " failed: " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// The result of a CUDA runtime / CUB call, as an FFI error naming the call.
inline ffi::Error CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave it for the next launch check to report
    return ffi::Error::Internal(std::string("jax_ep CUDA: ") + what + " failed: " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// cudaMemsetAsync that tolerates empty (possibly null) buffers.
inline ffi::Error MemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream,
                              const char* what) {
  if (bytes == 0) return ffi::Error::Success();
  return CheckCuda(cudaMemsetAsync(ptr, value, bytes, stream), what);
}

// Blocks of `threads` threads covering n items, at most max_blocks (kernels grid-stride).
inline unsigned GridFor(int64_t n, int threads, int64_t max_blocks = 65535) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

// ----------------------------------------------------------------------------- peer reads

// A kernel's read of `count` elements at p that may be another GPU's memory (peer access over
// NVLink / PCIe): p itself. Under the emulator the read is checked first: a kernel whose device
// never enabled peer access to the device that owns the memory fails its launch
// (cuda_emu::CheckPeerRead). Every read of a peer's memory goes through it.
template <typename T>
__device__ __forceinline__ const T* FromPeer(const T* p, int64_t count) {
#if defined(CUDA_EMU)
  cuda_emu::CheckPeerRead(p, size_t(count) * sizeof(T));
#endif
  return p;
}

// ----------------------------------------------------------------------------- float I/O

// Storage tags: each names how a dtype is stored and converts to / from fp32 exactly as the CPU
// handlers do (bf16 and f16 stores round to nearest even; NaNs stay quiet NaNs with the sign and
// top payload bits, like the CPU conversions).
struct Bf16Tag {};
struct Fp16Tag {};

template <typename Tag>
struct DeviceFloat;

template <>
struct DeviceFloat<float> {
  using Storage = float;
  static __device__ __forceinline__ float Load(float v) { return v; }
  static __device__ __forceinline__ float Store(float v) { return v; }
};

template <>
struct DeviceFloat<Bf16Tag> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float Load(uint16_t v) { return Bf16ToFloat(v); }
  static __device__ __forceinline__ uint16_t Store(float v) { return FloatToBf16(v); }
};

template <>
struct DeviceFloat<Fp16Tag> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float Load(uint16_t v) {
    if ((v & 0x7c00u) == 0x7c00u && (v & 0x3ffu)) {  // NaN: quieted, sign and payload kept
      return BitsFloat((uint32_t(v & 0x8000u) << 16) | 0x7fc00000u | (uint32_t(v & 0x3ffu) << 13));
    }
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ uint16_t Store(float v) {
    const uint32_t b = FloatBits(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet, sign and top payload bits kept
      return uint16_t(((b >> 16) & 0x8000u) | 0x7e00u | ((b >> 13) & 0x3ffu));
    }
    return __half_as_ushort(__float2half_rn(v));
  }
};

// Calls fn(Tag{}) with the storage tag (float, Bf16Tag or Fp16Tag) of a float32 / bfloat16 /
// float16 buffer; any other dtype is an InvalidArgument error naming the argument.
template <typename Fn>
inline ffi::Error DispatchFloatCuda(ffi::DataType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::BF16:
      return fn(Bf16Tag{});
    case ffi::DataType::F16:
      return fn(Fp16Tag{});
    default:
      return UnsupportedDtype(name, dtype);
  }
}

// ----------------------------------------------------------------------------- vectors

// Widest copy unit (16, 8, 4, 2 or 1 bytes) that divides the row width and both base addresses.
inline int CopyUnitBytes(int64_t row_bytes, const void* a, const void* b) {
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  for (int unit = 16; unit > 1; unit /= 2) {
    if (row_bytes % unit == 0 && pa % unit == 0 && pb % unit == 0) return unit;
  }
  return 1;
}

// An unsigned type of exactly N bytes (N = 1, 2, 4, 8 or 16) for vectorised row movement.
template <int N>
struct CopyUnit;
template <>
struct CopyUnit<1> {
  using Type = uint8_t;
};
template <>
struct CopyUnit<2> {
  using Type = uint16_t;
};
template <>
struct CopyUnit<4> {
  using Type = uint32_t;
};
template <>
struct CopyUnit<8> {
  using Type = uint2;
};
template <>
struct CopyUnit<16> {
  using Type = uint4;
};

template <typename V>
__device__ __forceinline__ V ZeroUnit() {
  return V{};
}

// `n` values of storage type S loaded or stored as one aligned vector (n * sizeof(S) bytes,
// 16 at most): the caller guarantees the alignment.
template <typename S, int N>
struct alignas(sizeof(S) * N) AlignedVec {
  S v[N];
};

// Calls fn(std::integral_constant<int, unit>{}) for a copy unit chosen at run time.
template <typename Fn>
inline ffi::Error DispatchCopyUnit(int unit, Fn&& fn) {
  switch (unit) {
    case 16:
      return fn(std::integral_constant<int, 16>{});
    case 8:
      return fn(std::integral_constant<int, 8>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    default:
      return fn(std::integral_constant<int, 1>{});
  }
}

}  // namespace jax_ep

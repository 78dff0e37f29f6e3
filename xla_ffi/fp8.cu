// Per-token FP8 cast (DeepEP's per_token_cast_to_fp8) and its inverse, CUDA handlers: the twins
// of fp8.cc, bit-exact (same FP8 codes, same scales; the conversions are common.h's).
//
// One warp per (token, 128-channel group): each lane holds 4 consecutive channels, the group's
// amax is a warp max-reduction over the bit patterns of |x| (as on the CPU: integer order is
// float order for non-negative floats, and a NaN propagates as in the reference), and each lane
// writes its 4 FP8 codes as one 32-bit store. scale_inv = amax * fl(1/448) (see fp8.cc); the
// products and the multiplier's division (common.h) are the correctly rounded __fmul_rn / __fdiv_rn,
// matching the CPU's plain float arithmetic. Vector loads and stores are
// used when the base addresses allow (every row offset is a multiple of 128 elements), scalar
// accesses otherwise. No scratch, no host sync: both handlers are command-buffer compatible.
#include "cuda_common.cuh"
#include "checks.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Four consecutive values of storage S at p (p + 4 aligned to 4 * sizeof(S) when kAligned).
template <typename S, bool kAligned>
__device__ __forceinline__ void Load4(const S* p, S (&v)[4]) {
  if (kAligned) {
    const AlignedVec<S, 4> a = *reinterpret_cast<const AlignedVec<S, 4>*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = a.v[i];
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = p[i];
  }
}

template <typename S, bool kAligned>
__device__ __forceinline__ void Store4(S* p, const S (&v)[4]) {
  if (kAligned) {
    AlignedVec<S, 4> a;
#pragma unroll
    for (int i = 0; i < 4; ++i) a.v[i] = v[i];
    *reinterpret_cast<AlignedVec<S, 4>*>(p) = a;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = v[i];
  }
}

template <typename Tag, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    CastToFp8Kernel(const typename DeviceFloat<Tag>::Storage* __restrict__ x, int64_t T,
                    int64_t H, bool round_scale, bool use_ue8m0, uint8_t* __restrict__ q,
                    float* __restrict__ f32_scales, uint8_t* __restrict__ ue8m0) {
  using S = typename DeviceFloat<Tag>::Storage;
  const int lane = threadIdx.x & 31;
  const int64_t G = H / kFp8Block;
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  const int64_t items = T * G;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; item < items;
       item += warps) {
    const int64_t t = item / G, g = item - t * G;
    const int64_t base = t * H + g * kFp8Block + lane * 4;
    S raw[4];
    Load4<S, kAligned>(x + base, raw);
    float v[4];
    uint32_t amax_bits = FloatBits(kFp8MinAmax);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = DeviceFloat<Tag>::Load(raw[i]);
      amax_bits = max(amax_bits, FloatBits(v[i]) & 0x7fffffffu);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, offset));
    const float amax = BitsFloat(amax_bits);
    // amax * fl(1/448), as the CPU handler (and XLA's rewrite of the reference's amax / 448).
    float scale_inv = __fmul_rn(amax, 1.0f / kFp8Max);
    uint32_t codes = 0;
    if (!IsFiniteAmax(amax)) {  // warp-uniform: an inf or NaN poisons the block (common.h)
      scale_inv = BitsFloat(kCanonicalNanBits);
      codes = 0x01010101u * kE4m3NanCode;
    } else {
      if (round_scale) scale_inv = CeilPow2(scale_inv);
      const float inv = Fp8Multiplier(amax, scale_inv, round_scale);
#pragma unroll
      for (int i = 0; i < 4; ++i) codes |= uint32_t(FloatToE4m3(__fmul_rn(v[i], inv))) << (8 * i);
    }
    if (kAligned) {
      *reinterpret_cast<uint32_t*>(q + base) = codes;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) q[base + i] = uint8_t(codes >> (8 * i));
    }
    if (lane == 0) {
      if (use_ue8m0) {
        uint8_t* row = ue8m0 + t * ue8m0_row_bytes;
        row[g] = Ue8m0Byte(scale_inv);
        if (g == G - 1) {  // the unused bytes of the row's last word are zero
          for (int64_t i = G; i < ue8m0_row_bytes; ++i) row[i] = 0;
        }
      } else {
        f32_scales[t * G + g] = scale_inv;
      }
    }
  }
}

template <typename Tag, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    CastBackKernel(const uint8_t* __restrict__ q, const float* __restrict__ f32_scales,
                   const uint8_t* __restrict__ ue8m0, bool use_ue8m0, int64_t T, int64_t H,
                   typename DeviceFloat<Tag>::Storage* __restrict__ out) {
  using S = typename DeviceFloat<Tag>::Storage;
  const int lane = threadIdx.x & 31;
  const int64_t G = H / kFp8Block;
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  const int64_t items = T * G;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; item < items;
       item += warps) {
    const int64_t t = item / G, g = item - t * G;
    const float s = use_ue8m0 ? Ue8m0Scale(ue8m0[t * ue8m0_row_bytes + g]) : f32_scales[t * G + g];
    const int64_t base = t * H + g * kFp8Block + lane * 4;
    uint32_t codes;
    if (kAligned) {
      codes = *reinterpret_cast<const uint32_t*>(q + base);
    } else {
      codes = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) codes |= uint32_t(q[base + i]) << (8 * i);
    }
    S o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      o[i] = DeviceFloat<Tag>::Store(
          CanonicalNan(__fmul_rn(E4m3ToFloat(uint8_t(codes >> (8 * i))), s)));
    Store4<S, kAligned>(out + base, o);
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

ffi::Error CastToFp8Cuda(cudaStream_t stream, Any x, bool round_scale, bool use_ue8m0,
                         AnyOut x_fp8, AnyOut scales) {
  int64_t T, H;
  RowsAndWidth(x, &T, &H);
  if (auto err = CheckFp8Shapes(H, use_ue8m0, round_scale); err.failure()) return err;
  const int64_t G = H / kFp8Block;
  if (auto err = CheckCastToFp8Results(x, T, H, use_ue8m0, x_fp8, scales); err.failure())
    return err;
  uint8_t* q = static_cast<uint8_t*>(x_fp8->untyped_data());
  float* f32_scales = static_cast<float*>(scales->untyped_data());
  uint8_t* ue8m0 = static_cast<uint8_t*>(scales->untyped_data());
  return DispatchFloatCuda(x.element_type(), "x", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using S = typename DeviceFloat<Tag>::Storage;
    if (T * G == 0) return ffi::Error::Success();
    const S* src = static_cast<const S*>(x.untyped_data());
    const unsigned grid = GridFor(T * G, kWarpsPerBlock, int64_t(1) << 20);
    if (Aligned(src, 4 * sizeof(S)) && Aligned(q, 4)) {
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, CastToFp8Kernel<Tag, true>)(
          src, T, H, round_scale, use_ue8m0, q, f32_scales, ue8m0);
    } else {
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, CastToFp8Kernel<Tag, false>)(
          src, T, H, round_scale, use_ue8m0, q, f32_scales, ue8m0);
    }
    return CheckLaunch("CastToFp8Kernel");
  });
}

ffi::Error CastBackCuda(cudaStream_t stream, Any x_fp8, Any scales, bool use_ue8m0,
                        AnyOut out) {
  int64_t T, H;
  if (auto err = CheckCastBackArgs(x_fp8, scales, use_ue8m0, &T, &H); err.failure()) return err;
  const int64_t G = H / kFp8Block;
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  if (auto err = CheckCastBackResult(x_fp8, out); err.failure()) return err;
  const uint8_t* q = static_cast<const uint8_t*>(x_fp8.untyped_data());
  const float* f32_scales = static_cast<const float*>(scales.untyped_data());
  const uint8_t* ue8m0 = static_cast<const uint8_t*>(scales.untyped_data());
  return DispatchFloatCuda(out->element_type(), "out", [&](auto tag) -> ffi::Error {
    using Tag = decltype(tag);
    using S = typename DeviceFloat<Tag>::Storage;
    if (T * G == 0) return ffi::Error::Success();
    S* dst = static_cast<S*>(out->untyped_data());
    const unsigned grid = GridFor(T * G, kWarpsPerBlock, int64_t(1) << 20);
    if (Aligned(dst, 4 * sizeof(S)) && Aligned(q, 4)) {
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, CastBackKernel<Tag, true>)(
          q, f32_scales, ue8m0, use_ue8m0, T, H, dst);
    } else {
      JAX_EP_LAUNCH(grid, kThreads, 0, stream, CastBackKernel<Tag, false>)(
          q, f32_scales, ue8m0, use_ue8m0, T, H, dst);
    }
    return CheckLaunch("CastBackKernel");
  });
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastToFp8Cuda, jax_ep::CastToFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // x [T, H]
                                  .Attr<bool>("round_scale")
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>()        // x_fp8 [T, H] float8_e4m3fn
                                  .Ret<jax_ep::Any>(),       // scales f32[T, H/128] | i32[T, H/512]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastBackCuda, jax_ep::CastBackCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // x_fp8 [T, H]
                                  .Arg<jax_ep::Any>()        // scales
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>(),       // out [T, H]
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Per-token FP8 cast (DeepEP's per_token_cast_to_fp8) and its inverse, CPU handlers.
//
// per_token_cast_to_fp8: x [T,H] f32/bf16/f16 -> x_fp8 float8_e4m3fn [T,H] and scales: for each
//   token and each 128 channels, amax = max(1e-4, max|x|), scale_inv = amax / 448 (rounded up
//   to a power of two with round_scale), x_fp8 = x * (1 / scale_inv). scales are f32[T,H/128],
//   or with use_ue8m0 the exponent bytes of scale_inv packed four per int32 little-endian,
//   i32[T, ceil(H/512)] (unused bytes zero). A block holding an inf or NaN gets a NaN scale and
//   NaN codes (common.h).
// per_token_cast_back: x_fp8 [T,H], scales -> out [T,H] = x_fp8 * scale_inv in the out dtype
//   (NaN products stored as one canonical NaN).
#include <algorithm>
#include <cmath>

#include "checks.h"
#include "cpu_util.h"

namespace jax_ep {
namespace {

// Per-128-channel row kernels with restrict pointers, so the compiler vectorises them.
// LoadBlock widens one block to fp32 and returns max(1e-4, max|x|). The max runs on the bit
// patterns of |x|: for non-negative floats integer order is float order, so the reduction
// vectorises (a float max does not without -ffast-math) and a NaN, the largest pattern,
// propagates as it does through the reference's jnp.max.
template <typename T>
float LoadBlock(const T* __restrict in, float* __restrict out) {
  uint32_t amax_bits = FloatBits(kFp8MinAmax);
  for (int64_t i = 0; i < kFp8Block; ++i) {
    out[i] = Fp32Io<T>::Load(in[i]);
    amax_bits = std::max(amax_bits, FloatBits(out[i]) & 0x7fffffffu);
  }
  return BitsFloat(amax_bits);
}

inline void QuantizeBlock(const float* __restrict in, float inv, uint8_t* __restrict out) {
  for (int64_t i = 0; i < kFp8Block; ++i) out[i] = FloatToE4m3(in[i] * inv);
}

template <typename T>
void DequantizeBlock(const uint8_t* __restrict in, float scale, T* __restrict out) {
  for (int64_t i = 0; i < kFp8Block; ++i)
    out[i] = Fp32Io<T>::Store(CanonicalNan(E4m3ToFloat(in[i]) * scale));
}

ffi::Error CastToFp8Cpu(ffi::ThreadPool pool, Any x, bool round_scale, bool use_ue8m0,
                        AnyOut x_fp8, AnyOut scales) {
  int64_t T, H;
  RowsAndWidth(x, &T, &H);
  if (auto err = CheckFp8Shapes(H, use_ue8m0, round_scale); err.failure()) return err;
  const int64_t G = H / kFp8Block;
  uint8_t* q = static_cast<uint8_t*>(x_fp8->untyped_data());
  float* f32_scales = static_cast<float*>(scales->untyped_data());
  uint8_t* ue8m0 = static_cast<uint8_t*>(scales->untyped_data());
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  if (use_ue8m0) std::memset(ue8m0, 0, T * ue8m0_row_bytes);
  AdviseHugePages(q, T * H);
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* src = static_cast<const T_*>(x.untyped_data());
    const int64_t row_bytes = std::max<int64_t>(1, H * sizeof(T_));  // H = 0 is legal
    const int64_t grain = std::max<int64_t>(1, kParallelGrainBytes / row_bytes);
    ParallelFor(pool, T, grain, [&](int64_t begin, int64_t end) {
      float block[kFp8Block];
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          const float amax = LoadBlock(src + t * H + g * kFp8Block, block);
          uint8_t* codes = q + t * H + g * kFp8Block;
          // amax * fl(1/448), not amax / 448: the reference's `amax / 448.0` is rewritten by
          // XLA into this product (as PyTorch does for DeepEP's `x_amax / 448.0`); true
          // division differs by one ulp for about half of all amax values.
          float scale_inv = amax * (1.0f / kFp8Max);
          if (!IsFiniteAmax(amax)) {  // an inf or NaN poisons the block (common.h)
            scale_inv = BitsFloat(kCanonicalNanBits);
            std::memset(codes, kE4m3NanCode, kFp8Block);
          } else {
            if (round_scale) scale_inv = CeilPow2(scale_inv);
            QuantizeBlock(block, 1.0f / scale_inv, codes);
          }
          if (use_ue8m0) {
            ue8m0[t * ue8m0_row_bytes + g] = Ue8m0Byte(scale_inv);
          } else {
            f32_scales[t * G + g] = scale_inv;
          }
        }
      }
    });
    return ffi::Error::Success();
  });
}

ffi::Error CastBackCpu(ffi::ThreadPool pool, Any x_fp8, Any scales, bool use_ue8m0,
                       AnyOut out) {
  int64_t T, H;
  if (auto err = CheckCastBackArgs(x_fp8, scales, use_ue8m0, &T, &H); err.failure()) return err;
  const int64_t G = H / kFp8Block;
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  const uint8_t* q = static_cast<const uint8_t*>(x_fp8.untyped_data());
  const float* f32_scales = static_cast<const float*>(scales.untyped_data());
  const uint8_t* ue8m0 = static_cast<const uint8_t*>(scales.untyped_data());
  return DispatchFloat(out->element_type(), "out", [&](auto tag) {
    using T_ = decltype(tag);
    T_* dst = static_cast<T_*>(out->untyped_data());
    AdviseHugePages(dst, T * H * int64_t(sizeof(T_)));
    const int64_t row_bytes = std::max<int64_t>(1, H * sizeof(T_));  // H = 0 is legal
    const int64_t grain = std::max<int64_t>(1, kParallelGrainBytes / row_bytes);
    ParallelFor(pool, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          const float s = use_ue8m0 ? Ue8m0Scale(ue8m0[t * ue8m0_row_bytes + g])
                                    : f32_scales[t * G + g];
          const int64_t base = t * H + g * kFp8Block;
          DequantizeBlock(q + base, s, dst + base);
        }
      }
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastToFp8Cpu, jax_ep::CastToFp8Cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<jax_ep::Any>()        // x [T, H]
                                  .Attr<bool>("round_scale")
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>()        // x_fp8 [T, H] float8_e4m3fn
                                  .Ret<jax_ep::Any>());      // scales f32[T, H/128] | i32[T, H/512]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastBackCpu, jax_ep::CastBackCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<jax_ep::Any>()        // x_fp8 [T, H]
                                  .Arg<jax_ep::Any>()        // scales
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>());      // out [T, H]

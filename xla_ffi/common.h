// Shared by every jax_ep FFI handler, CPU (.cc) and CUDA (.cu) alike: buffer aliases, the
// bit-exact number formats (bf16, float8_e4m3fn, UE8M0) and the checks every handler makes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define JAX_EP_HD __host__ __device__ __forceinline__
#else
// Forced inline: the CPU row loops only vectorise when the conversions are inlined into them.
#define JAX_EP_HD inline __attribute__((always_inline))
#endif

namespace jax_ep {

namespace ffi = xla::ffi;

using I32 = ffi::Buffer<ffi::S32>;
using F32 = ffi::Buffer<ffi::F32>;
using Pred = ffi::Buffer<ffi::PRED>;
using I32Out = ffi::ResultBuffer<ffi::S32>;
using F32Out = ffi::ResultBuffer<ffi::F32>;
using PredOut = ffi::ResultBuffer<ffi::PRED>;
using Any = ffi::AnyBuffer;
using AnyOut = ffi::Result<ffi::AnyBuffer>;

// FP8 per-token cast: one scale per kFp8Block channels, max finite e4m3fn value.
constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8MinAmax = 1e-4f;

JAX_EP_HD uint32_t FloatBits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof(b));
  return b;
}

JAX_EP_HD float BitsFloat(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof(f));
  return f;
}

JAX_EP_HD float Bf16ToFloat(uint16_t v) { return BitsFloat(uint32_t(v) << 16); }

// Round to nearest even, NaN kept quiet: the same result as XLA's f32 -> bf16 convert.
// Branch-free (both candidates, then a select) so loops over it vectorise.
JAX_EP_HD uint16_t FloatToBf16(float f) {
  const uint32_t b = FloatBits(f);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x40u;
  return uint16_t((b & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// float8_e4m3fn (bias 7, no infinities, 0x7f/0xff are NaN, max 448), round to nearest even;
// magnitudes that round past 448 become NaN, as XLA's non-saturating convert does.
// Branch-free (every candidate computed, then integer selects) so loops over it vectorise.
JAX_EP_HD uint8_t FloatToE4m3(float f) {
  const uint32_t b = FloatBits(f);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t mag = b & 0x7fffffffu;
  // Below 2^-6 the grid is m * 2^-9, m in [0, 8] (8 is the smallest normal): adding 2^23
  // rounds |f| * 2^9 (exact) to an integer, to nearest even.
  const uint32_t subnormal = FloatBits(BitsFloat(mag) * 512.0f + 8388608.0f) - 0x4b000000u;
  // Normal: round the mantissa to 3 bits (nearest even); (exp + 7) << 3 | mantissa.
  const uint32_t rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
  const uint32_t normal = (rounded >> 20) - (120u << 3);
  const uint32_t is_sub = 0u - uint32_t(mag < 0x3c800000u);
  const uint32_t is_nan = 0u - (uint32_t(mag > 0x7f800000u) | (~is_sub & uint32_t(normal > 0x7eu)));
  const uint32_t code = (subnormal & is_sub) | (normal & ~is_sub);
  return uint8_t(sign | (code & ~is_nan) | (0x7fu & is_nan));
}

JAX_EP_HD float E4m3ToFloat(uint8_t v) {
  const uint32_t sign = uint32_t(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 7u;
  const uint32_t normal = sign | ((exp + 120u) << 23) | (man << 20);
  const uint32_t subnormal = FloatBits(float(int32_t(man)) * 0.001953125f) | sign;  // man*2^-9
  const uint32_t is_sub = 0u - uint32_t(exp == 0);
  const uint32_t is_nan = 0u - uint32_t((v & 0x7fu) == 0x7fu);
  const uint32_t bits = (normal & ~is_sub) | (subnormal & is_sub);
  return BitsFloat((bits & ~is_nan) | ((sign | 0x7fc00000u) & is_nan));
}

// Non-finite values, made identical on every platform (hardware NaN results are not: x86
// passes an operand's NaN through, 0 * inf gives the negative default NaN, CUDA always returns
// 0x7fffffff). An FP8 block whose amax is inf or NaN is poisoned: NaN scale (UE8M0 byte 0xff),
// every code NaN; a cast back that yields NaN stores this NaN.
constexpr uint32_t kCanonicalNanBits = 0x7fc00000u;
constexpr uint8_t kE4m3NanCode = 0x7f;

JAX_EP_HD bool IsFiniteAmax(float amax) { return FloatBits(amax) < 0x7f800000u; }  // amax >= 0

JAX_EP_HD float CanonicalNan(float v) {  // branch-free, so the CPU loops stay vectorised
  const uint32_t b = FloatBits(v);
  return BitsFloat((b & 0x7fffffffu) > 0x7f800000u ? kCanonicalNanBits : b);
}

// The smallest power of two >= v (v > 0, finite): DeepEP's ceil_to_ue8m0, computed on bits.
JAX_EP_HD float CeilPow2(float v) {
  uint32_t b = FloatBits(v);
  if (b & 0x007fffffu) b = (b & 0x7f800000u) + 0x00800000u;
  return BitsFloat(b & 0x7f800000u);
}

// The factor a block's channels are multiplied by before the e4m3 rounding: what PyTorch makes
// of DeepEP's reference `x * (448.0 / x_amax)` on every device (a scalar divided by a tensor is
// `x_amax.reciprocal() * 448`), i.e. 448 * fl(1 / amax); with round_scale the reciprocal of the
// power-of-two scale_inv (exact). Not 1 / scale_inv (scale_inv = amax * fl(1/448) is rounded
// already) nor 448 / amax (DeepEP's CUDA kernels): on bfloat16 inputs either moves about one
// code in a thousand by one step against the PyTorch reference.
//
// Past 2^126, fl(1 / amax) is an fp32 subnormal, which XLA:CPU's threads (and the CUDA emulator
// on them) flush to zero, zeroing every code of the block. There the reciprocal is rounded to
// the subnormal grid in integers instead (Fp8MultiplierPastFlush), the same bits as on a GPU.
JAX_EP_HD float Fp8MultiplierPastFlush(float amax) {
  // amax = m * 2^(e - 150) with e in {253, 254}, so 1 / amax = n * 2^-149 where n is
  // 2^(299 - e) / m rounded to nearest even (n <= 2^23: exact in fp32).
  const uint32_t bits = FloatBits(amax);
  const uint64_t m = (bits & 0x7fffffu) | 0x800000u;
  const uint64_t numerator = uint64_t(1) << (299 - int(bits >> 23));
  const uint64_t rem = numerator % m;
  uint64_t n = numerator / m;
  if (2 * rem > m || (2 * rem == m && (n & 1u))) ++n;
  // 448 * n * 2^-149 = fl(7 * n) * 2^-143, the power of two applied to the exponent bits
  // (the result is at least 2^-120: normal).
  return BitsFloat(FloatBits(float(7 * n)) - (143u << 23));
}

JAX_EP_HD float Fp8Multiplier(float amax, float scale_inv, bool round_scale) {
  if (!round_scale && amax > 0x1p126f) return Fp8MultiplierPastFlush(amax);
#if defined(__CUDA_ARCH__)
  return round_scale ? __fdiv_rn(1.0f, scale_inv) : __fmul_rn(kFp8Max, __fdiv_rn(1.0f, amax));
#else
  return round_scale ? 1.0f / scale_inv : kFp8Max * (1.0f / amax);
#endif
}

// UE8M0 byte of a power-of-two scale: its biased fp32 exponent.
JAX_EP_HD uint8_t Ue8m0Byte(float scale) { return uint8_t((FloatBits(scale) >> 23) & 0xffu); }
JAX_EP_HD float Ue8m0Scale(uint8_t byte) { return BitsFloat(uint32_t(byte) << 23); }

// Rows an expert block starting at `start` keeps in an N-row buffer: its padded size `block`,
// cut at the buffer's end to a whole multiple of m so every kept block stays m-aligned.
JAX_EP_HD int64_t BlockCapacity(int64_t N, int64_t start, int64_t block, int64_t m) {
  const int64_t room = N > start ? (N - start) / m * m : 0;
  return room < block ? room : block;
}

// Dimensions of a buffer as a string, for error messages: "[4096, 8]".
template <typename Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// Checks that a buffer has `rank` dimensions; names the argument and the shape it got.
template <typename Buf>
ffi::Error CheckRank(const Buf& buf, size_t rank, const char* name) {
  auto dims = buf.dimensions();
  if (dims.size() != rank) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected rank " +
                                       std::to_string(rank) + ", got shape " +
                                       ShapeString(dims));
  }
  return ffi::Error::Success();
}

// Rows and row width (product of trailing dims) of a [rows, ...] buffer.
template <typename Buf>
void RowsAndWidth(const Buf& buf, int64_t* rows, int64_t* width) {
  auto dims = buf.dimensions();
  *rows = dims.size() ? dims[0] : 1;
  *width = 1;
  for (size_t i = 1; i < dims.size(); ++i) *width *= dims[i];
}

// The sub-byte element types: XLA packs them several to a byte, and ffi::ByteWidth counts
// each element as a whole byte, so a row of them would be read and written at twice its size
// or more. The row movers refuse them.
inline bool IsSubByte(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return true;
    default:
      return false;
  }
}

inline std::string SubByteError(const char* name) {
  return std::string(name) + ": sub-byte element types (packed several to a byte) are not "
                             "moved; cast to an 8-bit type first";
}

// Bytes of one row of `width` elements of `type` into *row_bytes, or an error naming `name`
// for a sub-byte type.
inline ffi::Error RowBytes(ffi::DataType type, int64_t width, const char* name,
                           int64_t* row_bytes) {
  if (IsSubByte(type)) return ffi::Error::InvalidArgument(SubByteError(name));
  *row_bytes = width * int64_t(ffi::ByteWidth(type));
  return ffi::Error::Success();
}

// pad_multiple of the permute plans: at most INT32_MAX, so the int64 block arithmetic (a
// count rounded up to a multiple of it) cannot overflow.
inline ffi::Error CheckPadMultiple(int64_t pad_multiple) {
  if (pad_multiple > INT32_MAX)
    return ffi::Error::InvalidArgument("pad_multiple: expected at most " +
                                       std::to_string(INT32_MAX) + ", got " +
                                       std::to_string(pad_multiple));
  return ffi::Error::Success();
}

inline bool IsFloatType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline ffi::Error UnsupportedDtype(const char* name, ffi::DataType t) {
  return ffi::Error::InvalidArgument(std::string(name) +
                                     ": expected float32, bfloat16 or float16, got dtype code " +
                                     std::to_string(static_cast<int>(t)));
}

// Exclusive prefix sums of counts[0..n) into offsets[0..n], offsets[n] = total.
inline void ExclusiveScan(const int32_t* counts, int64_t n, int64_t* offsets) {
  offsets[0] = 0;
  for (int64_t i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + counts[i];
}

// CPU only: expert ids must lie in [-1, num_experts); GPU handlers count them as unrouted.
// A branch-free scan first (it vectorises: -1 + 1 = 0 and every id outside [-1, E) maps above
// E as unsigned); the search for the first bad id runs only when there is one.
inline ffi::Error CheckExpertIds(const int32_t* idx, int64_t n, int64_t num_experts, const char* name) {
  uint32_t any_bad = 0;
  // Ids are int32, so E >= 2^31 admits every id >= -1 (-2 and below still map above 2^31).
  const int64_t bound = num_experts < (int64_t(1) << 31) ? num_experts : int64_t(1) << 31;
  const uint32_t limit = uint32_t(bound);
  for (int64_t i = 0; i < n; ++i) any_bad |= uint32_t(uint32_t(idx[i]) + 1u > limit);
  if (!any_bad) return ffi::Error::Success();
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < -1 || idx[i] >= num_experts) {
      // jax_ep narrows a wider dtype's out-of-range id to -2 (as_int32_ids): say so.
      const char* narrowed = idx[i] == -2 ? " (-2 also stands for an id of an int64 / uint32 / "
                                            "uint64 array outside that range)" : "";
      return ffi::Error::InvalidArgument(std::string(name) + ": expert id " +
                                         std::to_string(idx[i]) + " at flat position " +
                                         std::to_string(i) + " is outside [-1, " +
                                         std::to_string(num_experts) + ")" + narrowed);
    }
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckRouting(const I32& topk_idx, int64_t num_experts, int64_t num_ranks) {
  if (auto err = CheckRank(topk_idx, 2, "topk_idx"); err.failure()) return err;
  if (num_ranks <= 0 || num_experts <= 0 || num_experts % num_ranks != 0) {
    return ffi::Error::InvalidArgument("num_experts (" + std::to_string(num_experts) +
                                       ") must be a positive multiple of num_ranks (" +
                                       std::to_string(num_ranks) + ")");
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep

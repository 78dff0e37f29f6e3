// Per-token FP8 cast (DeepEP's per_token_cast_to_fp8) and its inverse, CPU handlers.
//
// per_token_cast_to_fp8: x [T,H] f32/bf16/f16 -> x_fp8 float8_e4m3fn [T,H] and scales: for each
//   token and each 128 channels, amax = max(1e-4, max|x|), scale_inv = amax / 448 (rounded up
//   to a power of two with round_scale), x_fp8 = x * (448 * (1 / amax)) (x / scale_inv with
//   round_scale; common.h's Fp8Multiplier). scales are f32[T,H/128],
//   or with use_ue8m0 the exponent bytes of scale_inv packed four per int32 little-endian,
//   i32[T, ceil(H/512)] (unused bytes zero). A block holding an inf or NaN gets a NaN scale and
//   NaN codes (common.h).
// per_token_cast_back: x_fp8 [T,H], scales -> out [T,H] = x_fp8 * scale_inv in the out dtype
//   (NaN products stored as one canonical NaN).
#include <algorithm>
#include <cstdlib>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define JAX_EP_HAS_AVX512_PATH 1
#endif

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

// The scale of a block from its amax: amax * fl(1/448), not amax / 448 (the reference's
// `amax / 448.0` is rewritten by XLA into this product, as PyTorch does for DeepEP's
// `x_amax / 448.0`; true division differs by one ulp for about half of all amax values),
// rounded up to a power of two with round_scale. An inf or NaN amax poisons the block
// (common.h): the canonical NaN scale, and every code NaN.
inline float BlockScaleOrPoison(float amax, bool round_scale, uint8_t* codes) {
  if (!IsFiniteAmax(amax)) {
    std::memset(codes, kE4m3NanCode, kFp8Block);
    return BitsFloat(kCanonicalNanBits);
  }
  const float scale_inv = amax * (1.0f / kFp8Max);
  return round_scale ? CeilPow2(scale_inv) : scale_inv;
}

// One block of 128 channels: codes, and the scale returned.
template <typename T>
float CastBlock(const T* in, bool round_scale, uint8_t* codes) {
  float block[kFp8Block];
  const float amax = LoadBlock(in, block);
  const float scale_inv = BlockScaleOrPoison(amax, round_scale, codes);
  if (IsFiniteAmax(amax)) QuantizeBlock(block, Fp8Multiplier(amax, scale_inv, round_scale), codes);
  return scale_inv;
}

// A row of G blocks: codes [G * 128] and scale_inv [G].
template <typename T>
void CastRow(const T* in, int64_t G, bool round_scale, uint8_t* codes, float* scale_inv) {
  for (int64_t g = 0; g < G; ++g)
    scale_inv[g] = CastBlock(in + g * kFp8Block, round_scale, codes + g * kFp8Block);
}

template <typename T>
void DequantizeBlock(const uint8_t* __restrict in, float scale, T* __restrict out) {
  for (int64_t i = 0; i < kFp8Block; ++i)
    out[i] = Fp32Io<T>::Store(CanonicalNan(E4m3ToFloat(in[i]) * scale));
}

#if JAX_EP_HAS_AVX512_PATH
// AVX-512 versions of CastRow and DequantizeBlock, picked at run time on CPUs that have
// AVX-512F, BW and VL. Both give the same bits as the portable loops above under every
// MXCSR setting (flush-to-zero, denormals-are-zero, rounding mode; XLA:CPU runs handlers
// with FTZ and DAZ on and rounding to nearest). They only spend fewer instructions:
// the compiler's vectorisation of the portable conversions is port-5 bound on permutes.
#define JAX_EP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define JAX_EP_AVX512_INLINE JAX_EP_AVX512 inline __attribute__((always_inline))

// round(|y| * 2^9) on 16 fp32 lanes through 2^23's ulp: the e4m3 codes of the subnormal grid
// (|y| < 2^-6), in the current rounding mode like the portable FloatToE4m3.
JAX_EP_AVX512_INLINE __m512i SubnormalGridCodes(__m512i y) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(y, _mm512_set1_epi32(0x7fffffff)));
  const __m512 on_grid = _mm512_add_ps(_mm512_mul_ps(magnitude, _mm512_set1_ps(512.0f)),
                                       _mm512_set1_ps(8388608.0f));
  return _mm512_sub_epi32(_mm512_castps_si512(on_grid), _mm512_set1_epi32(0x4b000000));
}

// FloatToE4m3 on 16 lanes. The one NaN test `code > 0x7e` covers the portable version's two:
// subnormal-grid codes are at most 8, and an inf or NaN input gives a normal code above 0x7e.
JAX_EP_AVX512_INLINE __m128i FloatToE4m3x16(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __m512i subnormal = SubnormalGridCodes(bits);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7ffff)), odd);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x3c800000));
  __m512i code = _mm512_mask_mov_epi32(normal, is_sub, subnormal);
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(code, _mm512_set1_epi32(0x7e)),
                               _mm512_set1_epi32(kE4m3NanCode));
  // code | ((bits >> 24) & 0x80): ternary-logic table 0xf8 is A | (B & C).
  code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xf8);
  return _mm512_cvtepi32_epi8(code);
}

// 16 channels widened to fp32, as Fp32Io<T>::Load (float and float16 input; bfloat16 input
// has its own loop below).
JAX_EP_AVX512_INLINE __m512 Load16(const float* in) { return _mm512_loadu_ps(in); }
JAX_EP_AVX512_INLINE __m512 Load16(const _Float16* in) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
}

// max(1e-4, amax) from the bit pattern of amax, the floor taken by a vector instruction: a
// scalar max against the constant lets GCC fold 1e-4 * (1/448) at compile time, in
// round-to-nearest whatever the MXCSR rounding mode.
JAX_EP_AVX512_INLINE float FlooredAmax(uint32_t magnitude_bits) {
  const __m128i floored = _mm_max_epu32(_mm_cvtsi32_si128(int32_t(magnitude_bits)),
                                        _mm_set1_epi32(int32_t(FloatBits(kFp8MinAmax))));
  return BitsFloat(uint32_t(_mm_cvtsi128_si32(floored)));
}

// The largest of 32 unsigned 16-bit lanes. phminposuw finds the smallest of eight; the
// largest is the smallest of the complements, complemented.
JAX_EP_AVX512_INLINE uint32_t MaxEpu16(__m512i v) {
  const __m256i m256 = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  const __m128i m128 = _mm_max_epu16(_mm256_castsi256_si128(m256), _mm256_extracti128_si256(m256, 1));
  const __m128i smallest = _mm_minpos_epu16(_mm_xor_si128(m128, _mm_set1_epi16(-1)));
  return ~uint32_t(_mm_cvtsi128_si32(smallest)) & 0xffffu;
}

// max(1e-4, max|x|) of one block, as LoadBlock computes it: on the bit patterns of |x| (for
// non-negative floats integer order is float order; a NaN, the largest pattern, wins).
// float16 and bfloat16 take the max on their 16-bit patterns and widen the winner, exactly.
JAX_EP_AVX512_INLINE float BlockAmaxAvx512(const float* in) {
  __m512i amax_bits = _mm512_setzero_si512();
  for (int v = 0; v < kFp8Block / 16; ++v)
    amax_bits = _mm512_max_epu32(amax_bits, _mm512_and_si512(_mm512_loadu_si512(in + 16 * v),
                                                              _mm512_set1_epi32(0x7fffffff)));
  return FlooredAmax(_mm512_reduce_max_epu32(amax_bits));
}
JAX_EP_AVX512_INLINE __m512i Max16BitMagnitudes(const void* in) {
  const __m512i* vectors = static_cast<const __m512i*>(in);
  __m512i amax16 = _mm512_setzero_si512();
  for (int v = 0; v < kFp8Block / 32; ++v)
    amax16 = _mm512_max_epu16(amax16, _mm512_and_si512(_mm512_loadu_si512(vectors + v),
                                                       _mm512_set1_epi16(0x7fff)));
  return amax16;
}
JAX_EP_AVX512_INLINE float BlockAmaxAvx512(const uint16_t* in) {  // bfloat16 bits
  return FlooredAmax(MaxEpu16(Max16BitMagnitudes(in)) << 16);
}
JAX_EP_AVX512_INLINE float BlockAmaxAvx512(const _Float16* in) {
  const __m256i widest = _mm256_set1_epi16(int16_t(MaxEpu16(Max16BitMagnitudes(in))));
  return FlooredAmax(FloatBits(_mm512_cvtss_f32(_mm512_cvtph_ps(widest))));
}

// The codes of one block that is not poisoned, given its multiplier (float and float16).
template <typename T>
JAX_EP_AVX512_INLINE void QuantizeBlockAvx512(const T* in, __m512 multiplier, uint8_t* codes) {
  for (int v = 0; v < kFp8Block / 16; ++v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * v),
                     FloatToE4m3x16(_mm512_mul_ps(Load16(in + 16 * v), multiplier)));
  }
}

// FloatToE4m3(x * inv) for 32 bfloat16 channels of a block that is not poisoned, as 16-bit
// codes. A bf16 pair (x0, x1) in one dword widens to two floats with one shift (x0) and one
// mask (x1), so each product y is formed exactly as in the other loops. y is then rounded to
// odd at bf16 precision: its upper 16 bits, with the last of them set when any lower bit is.
// That keeps every round-to-nearest-even decision at 5 or fewer fraction bits (a tie stays a
// tie, anything off it stays off it), so the e4m3 rounding, done on 16-bit lanes, 32
// channels per instruction, gives the same codes. The subnormal grid (|y| < 2^-6, rare but
// for zeros) is taken from y itself with SubnormalGridCodes, as in FloatToE4m3x16, so the
// codes match under every MXCSR rounding mode too. No NaN select: |x| <= amax makes |y| at most
// 448 * (1 + 2^-21), whose nearest e4m3 value is 448 (0x7e).
JAX_EP_AVX512_INLINE __m512i Bf16PairsToE4m3x32(__m512i x, __m512 inv) {
  const __m512i y0 = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), inv));
  const __m512i y1 = _mm512_castps_si512(
      _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xffff0000u)))), inv));
  // (y0 >> 16) | (y1 & 0xffff0000): ternary-logic table 0xf8 is A | (B & C).
  __m512i r = _mm512_ternarylogic_epi32(_mm512_srli_epi32(y0, 16), y1,
                                        _mm512_set1_epi32(int32_t(0xffff0000u)), 0xf8);
  const __m512i low_half = _mm512_set1_epi32(0xffff);
  r = _mm512_mask_or_epi32(r, _mm512_test_epi32_mask(y0, low_half), r, _mm512_set1_epi32(1));
  r = _mm512_mask_or_epi32(r, _mm512_test_epi32_mask(y1, low_half), r, _mm512_set1_epi32(0x10000));
  // FloatToE4m3 on the 16-bit patterns: 7 fraction bits, rounded at bit 4.
  const __m512i mag = _mm512_and_si512(r, _mm512_set1_epi16(0x7fff));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(mag, 4), _mm512_set1_epi16(1));
  const __m512i rounded = _mm512_add_epi16(_mm512_add_epi16(mag, _mm512_set1_epi16(7)), odd);
  __m512i code = _mm512_sub_epi16(_mm512_srli_epi16(rounded, 4), _mm512_set1_epi16(120 << 3));
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(0x3c80));  // |y| < 2^-6
  if (is_sub) {  // zeros get code 0; other subnormal-grid lanes (rare) round(|y| * 2^9) from y
    code = _mm512_mask_mov_epi16(code, is_sub, _mm512_setzero_si512());
    const __mmask32 tiny = is_sub & _mm512_test_epi16_mask(mag, mag);
    if (tiny) {
      // (grid(y0) & 0xffff) | (grid(y1) << 16): the two halves back in channel order (0xec).
      const __m512i sub_codes = _mm512_ternarylogic_epi32(
          SubnormalGridCodes(y0), _mm512_slli_epi32(SubnormalGridCodes(y1), 16),
          _mm512_set1_epi32(0xffff), 0xec);
      code = _mm512_mask_mov_epi16(code, tiny, sub_codes);
    }
  }
  // code | ((r >> 8) & 0x80)
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(r, 8), _mm512_set1_epi16(0x80), 0xf8);
}

// QuantizeBlockAvx512 for bfloat16 input, 32 channels per register.
JAX_EP_AVX512_INLINE void QuantizeBlockAvx512(const uint16_t* in, __m512 multiplier, uint8_t* codes) {
  for (int v = 0; v < kFp8Block / 32; ++v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * v),
                        _mm512_cvtepi16_epi8(Bf16PairsToE4m3x32(_mm512_loadu_si512(in + 32 * v), multiplier)));
  }
}

// How far ahead of the block being reduced CastRowAvx512 asks for input lines (bytes). With
// the hardware prefetchers alone the loop waited on memory: one core, bf16, T = 4096, it ran
// 10-30% slower from memory without (C++ microbenchmark; 1-32 KiB ahead measured alike).
constexpr uintptr_t kCastPrefetchBytes = 4096;

// A row of G blocks (all G blocks' codes and scales, as CastRow). Two passes over up to
// kBlocksPerPass blocks: every block's amax, scale and multiplier first, then their codes
// (re-read from L1), so the latency of one block's reduction and division is not on the path
// to its codes. Single-threaded, T = 4096, H = 2048 and 7168, that ran 15-30% faster than one
// pass per block for all three input types, in cache and from memory.
template <typename T>
JAX_EP_AVX512 void CastRowAvx512(const T* in, int64_t G, bool round_scale, uint8_t* codes,
                                 float* scale_inv) {
  constexpr int64_t kBlocksPerPass = 16;
  float multiplier[kBlocksPerPass];
  bool finite[kBlocksPerPass];
  for (int64_t g0 = 0; g0 < G; g0 += kBlocksPerPass) {
    const int64_t n = std::min(kBlocksPerPass, G - g0);
    for (int64_t i = 0; i < n; ++i) {
      const T* block = in + (g0 + i) * kFp8Block;
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(block) + kCastPrefetchBytes;
      for (uintptr_t line = 0; line < sizeof(T) * kFp8Block; line += 64)  // never faults
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      const float amax = BlockAmaxAvx512(block);
      scale_inv[g0 + i] = BlockScaleOrPoison(amax, round_scale, codes + (g0 + i) * kFp8Block);
      finite[i] = IsFiniteAmax(amax);
      multiplier[i] = finite[i] ? Fp8Multiplier(amax, scale_inv[g0 + i], round_scale) : 0.0f;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (finite[i]) {
        QuantizeBlockAvx512(in + (g0 + i) * kFp8Block, _mm512_set1_ps(multiplier[i]),
                            codes + (g0 + i) * kFp8Block);
      }
    }
  }
}

// 32 fp32 lanes (lo = the first 16) to the output type: float as is, float16 by the hardware
// convert in the current rounding mode (as _Float16(v)), bfloat16 by FloatToBf16's integer
// rounding, then one permute picks the 32 upper halves. Lanes are finite, inf or the
// canonical NaN, which every rounding here keeps.
JAX_EP_AVX512_INLINE void Store32(__m512 lo, __m512 hi, float* out) {
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
}
JAX_EP_AVX512_INLINE void Store32(__m512 lo, __m512 hi, _Float16* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(lo, _MM_FROUND_CUR_DIRECTION));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtps_ph(hi, _MM_FROUND_CUR_DIRECTION));
}
JAX_EP_AVX512_INLINE __m512i RoundToBf16Bits(__m512 v) {  // bf16 bits in the upper halves
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
}
JAX_EP_AVX512_INLINE void Store32(__m512 lo, __m512 hi, uint16_t* out) {
  const __m512i upper_halves = _mm512_set_epi16(
      63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(RoundToBf16Bits(lo), upper_halves,
                                                     RoundToBf16Bits(hi)));
}

// Whether scale * 2^8 is exact and normal (or zero) under every MXCSR setting: a normal
// scale with an exponent field up to 0xf6, or +-0. Other scales (subnormal ones, which FTZ
// and DAZ treat differently in one product and in two; huge and non-finite ones) take the
// portable loop.
inline bool ScaleTimes256IsExact(float scale) {
  const uint32_t bits = FloatBits(scale);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  return (exponent >= 1 && exponent <= 0xf6) || (bits & 0x7fffffffu) == 0;
}

// DequantizeBlock for a scale that passes ScaleTimes256IsExact. Each code goes through
// float16: sign to bit 15, the seven magnitude bits to bits 7..13 is the code's value / 2^8
// exactly (subnormal codes land on float16 subnormals, which the hardware widening never
// flushes), NaN codes become the float16 NaN that widens to the canonical NaN. Then one
// product with the exact scale * 2^8, which rounds the same real number as the portable
// E4m3ToFloat(code) * scale. A finite factor keeps the canonical NaN and makes no new one.
template <typename T>
JAX_EP_AVX512 void DequantizeBlockAvx512(const uint8_t* in, float scale_x256, T* out) {
  const __m512 s = _mm512_set1_ps(scale_x256);
  for (int64_t i = 0; i < kFp8Block; i += 32) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    __m512i half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7),
                                    _mm512_set1_epi16(int16_t(0xbf80)));
    const __mmask32 is_nan = _mm256_cmpeq_epi8_mask(
        _mm256_and_si256(codes, _mm256_set1_epi8(0x7f)), _mm256_set1_epi8(0x7f));
    half = _mm512_mask_mov_epi16(half, is_nan, _mm512_set1_epi16(0x7e00));
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
    const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    Store32(_mm512_mul_ps(lo, s), _mm512_mul_ps(hi, s), out + i);
  }
}

// The AVX-512 path runs when the CPU has it, unless JAX_EP_CPU_SIMD=0 (read once per
// process; the tests use it to run the portable path on the same machine).
bool UseAvx512() {
  static const bool use = [] {
    const char* env = std::getenv("JAX_EP_CPU_SIMD");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && !(env && std::string(env) == "0");
  }();
  return use;
}
#else
bool UseAvx512() { return false; }
bool ScaleTimes256IsExact(float) { return false; }
template <typename T>
void CastRowAvx512(const T*, int64_t, bool, uint8_t*, float*) {}
template <typename T>
void DequantizeBlockAvx512(const uint8_t*, float, T*) {}
#endif

ffi::Error CastToFp8Cpu(ffi::ThreadPool pool, int32_t device, Any x, bool round_scale,
                        bool use_ue8m0, AnyOut x_fp8, AnyOut scales) {
  int64_t T, H;
  RowsAndWidth(x, &T, &H);
  if (auto err = CheckFp8Shapes(H, use_ue8m0, round_scale); err.failure()) return err;
  if (auto err = CheckCastToFp8Results(x, T, H, use_ue8m0, x_fp8, scales); err.failure())
    return err;
  const int64_t G = H / kFp8Block;
  uint8_t* q = static_cast<uint8_t*>(x_fp8->untyped_data());
  float* f32_scales = static_cast<float*>(scales->untyped_data());
  uint8_t* ue8m0 = static_cast<uint8_t*>(scales->untyped_data());
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  if (use_ue8m0) std::memset(ue8m0, 0, T * ue8m0_row_bytes);
  AdviseHugePages(q, T * H);
  const bool avx512 = UseAvx512();
  return DispatchFloat(x.element_type(), "x", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* src = static_cast<const T_*>(x.untyped_data());
    const int64_t grain = GrainItems(H * int64_t(sizeof(T_)));
    ParallelFor({pool, device}, T, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row_scales(use_ue8m0 ? G : 0);  // UE8M0: scale_inv before packing
      for (int64_t t = begin; t < end; ++t) {
        float* scale_inv = use_ue8m0 ? row_scales.data() : f32_scales + t * G;
        if (avx512) {
          CastRowAvx512(src + t * H, G, round_scale, q + t * H, scale_inv);
        } else {
          CastRow(src + t * H, G, round_scale, q + t * H, scale_inv);
        }
        for (int64_t g = 0; g < G && use_ue8m0; ++g)
          ue8m0[t * ue8m0_row_bytes + g] = Ue8m0Byte(scale_inv[g]);
      }
    });
    return ffi::Error::Success();
  });
}

ffi::Error CastBackCpu(ffi::ThreadPool pool, int32_t device, Any x_fp8, Any scales,
                       bool use_ue8m0, AnyOut out) {
  int64_t T, H;
  if (auto err = CheckCastBackArgs(x_fp8, scales, use_ue8m0, &T, &H); err.failure()) return err;
  if (auto err = CheckCastBackResult(x_fp8, out); err.failure()) return err;
  const int64_t G = H / kFp8Block;
  const int64_t ue8m0_row_bytes = Ue8m0RowBytes(G);
  const uint8_t* q = static_cast<const uint8_t*>(x_fp8.untyped_data());
  const float* f32_scales = static_cast<const float*>(scales.untyped_data());
  const uint8_t* ue8m0 = static_cast<const uint8_t*>(scales.untyped_data());
  const bool avx512 = UseAvx512();
  return DispatchFloat(out->element_type(), "out", [&](auto tag) {
    using T_ = decltype(tag);
    T_* dst = static_cast<T_*>(out->untyped_data());
    AdviseHugePages(dst, T * H * int64_t(sizeof(T_)));
    const int64_t grain = GrainItems(H * int64_t(sizeof(T_)));
    ParallelFor({pool, device}, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t g = 0; g < G; ++g) {
          const float s = use_ue8m0 ? Ue8m0Scale(ue8m0[t * ue8m0_row_bytes + g])
                                    : f32_scales[t * G + g];
          const int64_t base = t * H + g * kFp8Block;
          if (avx512 && ScaleTimes256IsExact(s)) {
            DequantizeBlockAvx512(q + base, s * 256.0f, dst + base);
          } else {
            DequantizeBlock(q + base, s, dst + base);
          }
        }
      }
    });
    return ffi::Error::Success();
  });
}

}  // namespace

const char* CpuFp8Loops() { return UseAvx512() ? "avx512" : "portable"; }

}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastToFp8Cpu, jax_ep::CastToFp8Cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // x [T, H]
                                  .Attr<bool>("round_scale")
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>()        // x_fp8 [T, H] float8_e4m3fn
                                  .Ret<jax_ep::Any>());      // scales f32[T, H/128] | i32[T, H/512]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCastBackCpu, jax_ep::CastBackCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // x_fp8 [T, H]
                                  .Arg<jax_ep::Any>()        // scales
                                  .Attr<bool>("use_ue8m0")
                                  .Ret<jax_ep::Any>());      // out [T, H]

// The AVX-512 FP8 loops of xla_ffi/fp8.cc against its portable loops, block by block and
// row by row (rows longer than one pass of CastRowAvx512), under every MXCSR setting (4 rounding modes x FTZ x DAZ): same scales, same codes, same
// cast-back bits. Built and run by tests/test_fp8.py with the handlers' own compile flags.
// Prints "blocks N mismatches M" and exits 1 on any mismatch.
#include "fp8.cc"

#include <cstdio>
#include <random>
#include <type_traits>

#include <xmmintrin.h>

namespace {

using jax_ep::FloatBits;

uint64_t g_blocks = 0, g_mismatches = 0;

template <typename T>
void RandomBlock(std::mt19937_64& rng, T* out);

// A row of `blocks` blocks (at most kMaxRowBlocks) cast both ways.
constexpr int64_t kMaxRowBlocks = 40;

template <typename T>
void CheckCast(const T* in, bool round_scale, unsigned csr, int64_t blocks = 1) {
  uint8_t want[kMaxRowBlocks * jax_ep::kFp8Block], got[kMaxRowBlocks * jax_ep::kFp8Block];
  float want_scales[kMaxRowBlocks], got_scales[kMaxRowBlocks];
  jax_ep::CastRow(in, blocks, round_scale, want, want_scales);
  jax_ep::CastRowAvx512(in, blocks, round_scale, got, got_scales);
  g_blocks += blocks;
  for (int64_t g = 0; g < blocks; ++g) {
    const size_t at = g * jax_ep::kFp8Block;
    if (FloatBits(want_scales[g]) != FloatBits(got_scales[g]) ||
        std::memcmp(want + at, got + at, jax_ep::kFp8Block)) {
      if (g_mismatches++ < 5)
        std::printf("cast to, %zu-byte input, mxcsr %04x, round_scale %d, block %lld of %lld: "
                    "scale %08x vs %08x\n", sizeof(T), csr, round_scale, (long long)g,
                    (long long)blocks, FloatBits(want_scales[g]), FloatBits(got_scales[g]));
    }
  }
}

// Rows of 1 to kMaxRowBlocks random blocks: every split of a row into CastRowAvx512's passes.
template <typename T>
void CheckRandomRow(std::mt19937_64& rng, unsigned csr) {
  T row[kMaxRowBlocks * jax_ep::kFp8Block];
  const int64_t blocks = 1 + int64_t(rng() % kMaxRowBlocks);
  for (int64_t g = 0; g < blocks; ++g) RandomBlock(rng, row + g * jax_ep::kFp8Block);
  CheckCast(row, rng() % 2, csr, blocks);
}

template <typename T>
void CheckCastBack(const uint8_t* codes, float scale, unsigned csr) {
  if (!jax_ep::ScaleTimes256IsExact(scale)) return;  // the handler keeps the portable loop
#if !defined(__F16C__)
  // Without F16C the portable loop converts to float16 in software (libgcc), which ignores
  // DAZ: with DAZ on and FTZ off, a subnormal fp32 product rounds to a float16 subnormal in
  // a directed rounding mode where the hardware convert sees a zero. XLA sets both or none.
  if (std::is_same<T, _Float16>::value && (csr & 0x8040u) == 0x40u) return;
#endif
  T want[jax_ep::kFp8Block], got[jax_ep::kFp8Block];
  jax_ep::DequantizeBlock(codes, scale, want);
  jax_ep::DequantizeBlockAvx512(codes, scale * 256.0f, got);
  ++g_blocks;
  if (std::memcmp(want, got, sizeof(want)) && g_mismatches++ < 5)
    std::printf("cast back, %zu-byte output, mxcsr %04x, scale %08x\n", sizeof(T), csr,
                FloatBits(scale));
}

// A block of 128 values of one input type from 32-bit patterns: magnitudes spread over a few
// binades around a random one, some zeros and, now and then, an inf or NaN (a poisoned block).
template <typename T>
void RandomBlock(std::mt19937_64& rng, T* out);
template <>
void RandomBlock(std::mt19937_64& rng, float* out) {
  const int top = int(rng() % 254) + 1;
  for (int i = 0; i < jax_ep::kFp8Block; ++i) {
    const int e = std::max(0, top - int(rng() % 30));
    const uint32_t bits = uint32_t(rng() & 0x80000000u) | uint32_t(e) << 23 | uint32_t(rng() & 0x7fffff);
    out[i] = rng() % 40 == 0 ? 0.0f : jax_ep::BitsFloat(bits);
  }
  if (rng() % 100 == 0) out[rng() % jax_ep::kFp8Block] = jax_ep::BitsFloat(0x7f800000u | uint32_t(rng() % 2));
}
template <>
void RandomBlock(std::mt19937_64& rng, uint16_t* out) {  // bfloat16 bits
  const int top = int(rng() % 254) + 1;
  for (int i = 0; i < jax_ep::kFp8Block; ++i) {
    const int e = std::max(0, top - int(rng() % 30));
    out[i] = rng() % 40 == 0 ? 0 : uint16_t((rng() & 0x8000) | e << 7 | (rng() & 0x7f));
  }
  if (rng() % 100 == 0) out[rng() % jax_ep::kFp8Block] = uint16_t(0x7f80 | (rng() % 2));
}
template <>
void RandomBlock(std::mt19937_64& rng, _Float16* out) {
  const int top = int(rng() % 30) + 1;
  for (int i = 0; i < jax_ep::kFp8Block; ++i) {
    const int e = std::max(0, top - int(rng() % 12));
    const uint16_t bits = uint16_t((rng() & 0x8000) | e << 10 | (rng() & 0x3ff));
    std::memcpy(&out[i], &bits, 2);
    if (rng() % 40 == 0) out[i] = 0;
  }
}

// Every bf16 value up to a block amax A, 127 at a time next to +-A: all products of one scale.
void EveryBf16UpTo(std::mt19937_64& rng, uint16_t amax, unsigned csr) {
  for (int round_scale = 0; round_scale < 2; ++round_scale) {
    uint16_t block[jax_ep::kFp8Block];
    int n = 0;
    for (uint32_t x = 0; x <= 0xffff; ++x) {
      if ((x & 0x7fff) > amax) continue;
      block[n++] = uint16_t(x);
      if (n == jax_ep::kFp8Block - 1 || x == 0xffff) {
        while (n < jax_ep::kFp8Block - 1) block[n++] = 0;
        block[n] = uint16_t(amax | (rng() & 0x8000));
        std::swap(block[n], block[rng() % jax_ep::kFp8Block]);
        CheckCast(block, round_scale, csr);
        n = 0;
      }
    }
  }
}

}  // namespace

int main() {
  if (!jax_ep::UseAvx512()) {
    std::printf("no AVX-512 loops on this CPU\n");
    return 0;
  }
  std::mt19937_64 rng(2026);
  const unsigned base = _mm_getcsr() & ~0xe040u;
  for (unsigned flush : {0u, 0x8000u, 0x40u, 0x8040u}) {           // FTZ, DAZ
    for (unsigned rounding : {0u, 0x2000u, 0x4000u, 0x6000u}) {    // RN, RD, RU, RZ
      const unsigned csr = base | flush | rounding;
      _mm_setcsr(csr);
      for (uint16_t amax : {0x0000, 0x0001, 0x0080, 0x38d1, 0x38d2, 0x3c80, 0x3f80, 0x43e0,
                            0x7f00, 0x7f7f})
        EveryBf16UpTo(rng, amax, csr);
      for (int i = 0; i < 4; ++i) EveryBf16UpTo(rng, uint16_t(rng() % 0x7f80), csr);
      for (int i = 0; i < 20000; ++i) {
        float f[jax_ep::kFp8Block];
        uint16_t b[jax_ep::kFp8Block];
        _Float16 h[jax_ep::kFp8Block];
        RandomBlock(rng, f);
        RandomBlock(rng, b);
        RandomBlock(rng, h);
        CheckCast(f, i & 1, csr);
        CheckCast(b, i & 1, csr);
        CheckCast(h, i & 1, csr);
        if (i % 100 == 0) {
          CheckRandomRow<float>(rng, csr);
          CheckRandomRow<uint16_t>(rng, csr);
          CheckRandomRow<_Float16>(rng, csr);
        }
        uint8_t codes[jax_ep::kFp8Block];
        for (auto& c : codes) c = uint8_t(rng());
        const float scale = i % 7 == 0 ? jax_ep::BitsFloat(uint32_t(rng())) :
                            std::ldexp(1.0f + float(rng() % 1024) / 1024.0f, int(rng() % 80) - 40);
        CheckCastBack<float>(codes, scale, csr);
        CheckCastBack<uint16_t>(codes, scale, csr);
        CheckCastBack<_Float16>(codes, scale, csr);
      }
      _mm_setcsr(base);
    }
  }
  std::printf("blocks %llu mismatches %llu\n", (unsigned long long)g_blocks,
              (unsigned long long)g_mismatches);
  return g_mismatches ? 1 : 0;
}

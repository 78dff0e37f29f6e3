// DeepEP's LogFMT-10 combine format (legacy/internode_ll.cu: logfmt_encode,
// logfmt_check_amaxmin, decode_and_accumulate), shared by the CPU (logfmt.cc) and CUDA
// (logfmt.cu) handlers so that both compute the same bits.
//
// A bf16 row of H channels (H % 512 == 0) becomes a slot of LogfmtSlotBytes(H) = 2H + 4H/128
// bytes, DeepEP's slot layout:
//   meta: per 128-channel division g, the bf16 pair (amax, amin) of |x| (4 bytes, amax first);
//   payload: the chunks of LogfmtChunk(H) channels (1024 when H % 1024 == 0, else 512) in
//     order, each either LogFMT-packed (10 bits per value) or raw bf16, without gaps;
//   the bytes after the payload are zero.
// A chunk is packed when every division in it has amax < 1 and amin < amax. Packed, every 16
// consecutive values take 5 little-endian uint32 words: 9-bit magnitude codes c_j at bits
// 9j .. 9j+8 of the 160-bit stream, the 16 sign bits at bits 144 .. 159.
// Per division: la = log2(amax), lb = max(log2(amin), la - 32) (la - 32 when amin = 0),
// step = (la - lb) / 510, r = 2 - log2((1 + 2^step) / 2) / step; code(|x|) =
// floor(max(log2|x| / step + r - lb / step, 0)) (code 0 for |x| = 0), decoded
// 2^((code - 1) step + lb) (0 for code 0) with the sign bit applied.
//
// Differences from DeepEP, on purpose: the arithmetic is float64 with the math library's log2
// and exp2 (DeepEP: float32 with PTX lg2.approx / ex2.approx), so a code can differ from a
// DeepEP GPU's where log2 lands within float32 rounding of a code boundary; amax and amin are
// taken on the bit patterns of |x|, where a NaN is the largest value, so a chunk holding a NaN
// or an inf is sent as bf16 and arrives unchanged (DeepEP's __hmax2 ignores NaNs and its
// encoder turns a NaN into code 0, i.e. a zero).
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace jax_ep {

constexpr int64_t kLogfmtDivision = 128;   // channels per (amax, amin) pair
constexpr int64_t kLogfmtGroup = 16;       // values per 5 packed words
constexpr int64_t kLogfmtGroupWords = 5;
constexpr int64_t kLogfmtHiddenMultiple = 512;
constexpr double kLogfmtMinClip = 32.0;    // lb >= la - 32
constexpr double kLogfmtSteps = 510.0;     // 2^9 - 2: codes 1 .. 511 span [lb, la]
constexpr uint32_t kBf16One = 0x3f80u;

JAX_EP_HD int64_t LogfmtChunk(int64_t H) { return H % 1024 == 0 ? 1024 : 512; }
JAX_EP_HD int64_t LogfmtDivisions(int64_t H) { return H / kLogfmtDivision; }
JAX_EP_HD int64_t LogfmtSlotBytes(int64_t H) { return 2 * H + 4 * LogfmtDivisions(H); }
// Bytes of one chunk of C channels on the wire: packed (10 bits a value) or raw bf16.
JAX_EP_HD int64_t LogfmtChunkBytes(int64_t C, bool packed) { return packed ? C * 10 / 8 : C * 2; }

// Correctly rounded float64 products and sums on both sides: nvcc would fuse a * b + c.
JAX_EP_HD double DMul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
JAX_EP_HD double DAdd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// A bf16 magnitude (15-bit pattern) as an exact double.
JAX_EP_HD double Bf16Magnitude(uint32_t bits) { return double(Bf16ToFloat(uint16_t(bits))); }

// Whether a division with these |x| bit patterns may be packed (amax < 1, amin < amax; a NaN
// or an inf amax fails the first test).
JAX_EP_HD bool LogfmtDivisionCasts(uint32_t amax_bits, uint32_t amin_bits) {
  return amax_bits < kBf16One && amin_bits < amax_bits;
}

// The log-domain parameters of one packed division.
struct LogfmtScale {
  double lb;     // log2 of the value of code 1
  double step;   // log2 distance between consecutive codes
  double inv;    // 1 / step
  double fused;  // r - lb / step: code = floor(log2|x| * inv + fused)
};

JAX_EP_HD LogfmtScale MakeLogfmtScale(uint32_t amax_bits, uint32_t amin_bits) {
  const double la = log2(Bf16Magnitude(amax_bits));
  const double clip = DAdd(la, -kLogfmtMinClip);
  const double lb = amin_bits == 0 ? clip : fmax(log2(Bf16Magnitude(amin_bits)), clip);
  LogfmtScale s;
  s.lb = lb;
  s.step = DAdd(la, -lb) / kLogfmtSteps;
  s.inv = 1.0 / s.step;
  const double r = DAdd(2.0, -DMul(log2(DMul(DAdd(1.0, exp2(s.step)), 0.5)), s.inv));
  s.fused = DAdd(r, -DMul(lb, s.inv));
  return s;
}

// The 9-bit code of a nonzero magnitude from its log2 (0 .. 511 for |x| <= amax).
JAX_EP_HD uint32_t LogfmtCodeOfLog2(double log2_magnitude, const LogfmtScale& s) {
  const double t = DAdd(DMul(log2_magnitude, s.inv), s.fused);
  return t > 0.0 ? uint32_t(floor(t)) : 0u;
}

// The 9-bit code of a bf16 magnitude pattern.
JAX_EP_HD uint32_t LogfmtCode(uint32_t magnitude_bits, const LogfmtScale& s) {
  return magnitude_bits == 0 ? 0u : LogfmtCodeOfLog2(log2(Bf16Magnitude(magnitude_bits)), s);
}

// The magnitude a code stands for (code 0: zero).
JAX_EP_HD double LogfmtValue(uint32_t code, const LogfmtScale& s) {
  return code == 0 ? 0.0 : exp2(DAdd(DMul(double(code - 1), s.step), s.lb));
}

// 16 codes and their signs (bit j: value j) -> 5 words.
JAX_EP_HD void PackLogfmtGroup(const uint32_t (&c)[16], uint32_t signs, uint32_t* w) {
  w[0] = c[0] | (c[1] << 9) | (c[2] << 18) | (c[3] << 27);
  w[1] = (c[3] >> 5) | (c[4] << 4) | (c[5] << 13) | (c[6] << 22) | (c[7] << 31);
  w[2] = (c[7] >> 1) | (c[8] << 8) | (c[9] << 17) | (c[10] << 26);
  w[3] = (c[10] >> 6) | (c[11] << 3) | (c[12] << 12) | (c[13] << 21) | (c[14] << 30);
  w[4] = (c[14] >> 2) | (c[15] << 7) | (signs << 16);
}

// Code j (0 .. 15) of 5 packed words.
JAX_EP_HD uint32_t LogfmtGroupCode(const uint32_t* w, int j) {
  const int bit = 9 * j, word = bit / 32, shift = bit % 32;
  uint64_t pair = w[word];
  if (word + 1 < kLogfmtGroupWords) pair |= uint64_t(w[word + 1]) << 32;
  return uint32_t(pair >> shift) & 0x1ffu;
}

// Whether chunk k of a row is packed, from the row's meta words (amax | amin << 16, one per
// division).
JAX_EP_HD bool LogfmtChunkPacked(const uint32_t* meta, int64_t H, int64_t k) {
  const int64_t per_chunk = LogfmtChunk(H) / kLogfmtDivision;
  bool packed = true;
  for (int64_t g = k * per_chunk; g < (k + 1) * per_chunk; ++g)
    packed = packed && LogfmtDivisionCasts(meta[g] & 0xffffu, meta[g] >> 16);
  return packed;
}

// The byte offset inside the slot of each chunk k of a row (offsets[k], H / LogfmtChunk(H) + 1
// entries; the last is where the zero tail starts).
JAX_EP_HD void LogfmtChunkOffsets(const uint32_t* meta, int64_t H, int64_t* offsets) {
  const int64_t C = LogfmtChunk(H);
  offsets[0] = 4 * LogfmtDivisions(H);
  for (int64_t k = 0; k < H / C; ++k)
    offsets[k + 1] = offsets[k] + LogfmtChunkBytes(C, LogfmtChunkPacked(meta, H, k));
}

}  // namespace jax_ep

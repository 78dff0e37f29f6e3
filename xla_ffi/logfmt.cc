// DeepEP's LogFMT-10 combine format (logfmt.h), CPU handlers.
//
// logfmt_encode: x bf16 [N,H] (H % 512 == 0) -> wire u8[N, 2H + H/32], one slot per row as
//   DeepEP's combine sends it (meta, then each 512/1024-channel chunk packed or raw bf16, zero
//   tail).
// logfmt_decode: wire u8[N, 2H + H/32] -> out [N,H] f32 (the decoded values rounded once from
//   float64) or bf16 (that f32 value rounded to bf16).
// Both run with flush-to-zero and denormals-are-zero off (XLA:CPU turns them on in its
// threads): bf16 subnormals are real magnitudes, and the CUDA twin keeps denormals.
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "checks.h"
#include "cpu_util.h"
#include "logfmt.h"

namespace jax_ep {
namespace {

// IEEE denormal handling for the scope (x86-64 MXCSR FTZ and DAZ cleared, restored after).
class IeeeDenormals {
 public:
#if defined(__x86_64__)
  IeeeDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }
  ~IeeeDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// log2 of every bf16 magnitude pattern below 1.0 (all a packed division holds), from the same
// log2 call LogfmtCode makes, built once: the codes are the same, a table read cheaper.
const double* Log2BelowOne() {
  static const std::vector<double> table = [] {
    IeeeDenormals ieee;
    std::vector<double> t(kBf16One, 0.0);
    for (uint32_t m = 1; m < kBf16One; ++m) t[m] = log2(Bf16Magnitude(m));
    return t;
  }();
  return table.data();
}

// Meta word of each division: max and min of the 15-bit magnitude patterns (amax | amin << 16).
void EncodeMeta(const uint16_t* x, int64_t H, uint32_t* meta) {
  for (int64_t g = 0; g < LogfmtDivisions(H); ++g) {
    uint32_t amax = 0, amin = 0x7fffu;
    for (int64_t i = g * kLogfmtDivision; i < (g + 1) * kLogfmtDivision; ++i) {
      const uint32_t m = x[i] & 0x7fffu;
      amax = std::max(amax, m);
      amin = std::min(amin, m);
    }
    meta[g] = amax | (amin << 16);
  }
}

// One division's 128 values packed: 8 groups of 5 words.
void PackDivision(const uint16_t* x, uint32_t meta, uint32_t* out) {
  const LogfmtScale s = MakeLogfmtScale(meta & 0xffffu, meta >> 16);
  const double* log2_of = Log2BelowOne();
  for (int64_t q = 0; q < kLogfmtDivision / kLogfmtGroup; ++q) {
    uint32_t codes[16], signs = 0;
    for (int j = 0; j < 16; ++j) {
      const uint16_t v = x[q * kLogfmtGroup + j];
      const uint32_t m = v & 0x7fffu;  // < amax < 1.0 in a packed division
      codes[j] = m == 0 ? 0u : LogfmtCodeOfLog2(log2_of[m], s);
      signs |= uint32_t(v >> 15) << j;
    }
    PackLogfmtGroup(codes, signs, out + q * kLogfmtGroupWords);
  }
}

void EncodeRow(const uint16_t* x, int64_t H, uint8_t* slot) {
  std::vector<uint32_t> meta(LogfmtDivisions(H));
  std::vector<int64_t> offsets(H / LogfmtChunk(H) + 1);
  EncodeMeta(x, H, meta.data());
  std::memcpy(slot, meta.data(), meta.size() * 4);
  LogfmtChunkOffsets(meta.data(), H, offsets.data());
  const int64_t C = LogfmtChunk(H), per_chunk = C / kLogfmtDivision;
  const int64_t division_words = kLogfmtDivision / kLogfmtGroup * kLogfmtGroupWords;
  for (int64_t k = 0; k < H / C; ++k) {
    uint8_t* dst = slot + offsets[k];
    if (!LogfmtChunkPacked(meta.data(), H, k)) {
      std::memcpy(dst, x + k * C, C * 2);
      continue;
    }
    for (int64_t d = 0; d < per_chunk; ++d) {
      uint32_t words[kLogfmtDivision / kLogfmtGroup * kLogfmtGroupWords];
      PackDivision(x + k * C + d * kLogfmtDivision, meta[k * per_chunk + d], words);
      std::memcpy(dst + d * division_words * 4, words, sizeof(words));
    }
  }
  std::memset(slot + offsets.back(), 0, LogfmtSlotBytes(H) - offsets.back());
}

template <typename T>
T StoreDecoded(float v);
template <>
float StoreDecoded<float>(float v) { return v; }
template <>
uint16_t StoreDecoded<uint16_t>(float v) { return FloatToBf16(v); }

// One packed division (8 groups of 5 words) -> 128 values.
template <typename T>
void UnpackDivision(const uint32_t* words, uint32_t meta, T* out) {
  const LogfmtScale s = MakeLogfmtScale(meta & 0xffffu, meta >> 16);
  for (int64_t q = 0; q < kLogfmtDivision / kLogfmtGroup; ++q) {
    const uint32_t* w = words + q * kLogfmtGroupWords;
    for (int j = 0; j < 16; ++j) {
      const float v = float(LogfmtValue(LogfmtGroupCode(w, j), s));
      out[q * kLogfmtGroup + j] = StoreDecoded<T>((w[4] >> (16 + j)) & 1u ? -v : v);
    }
  }
}

template <typename T>
void DecodeRow(const uint8_t* slot, int64_t H, T* out) {
  std::vector<uint32_t> meta(LogfmtDivisions(H));
  std::vector<int64_t> offsets(H / LogfmtChunk(H) + 1);
  std::memcpy(meta.data(), slot, meta.size() * 4);
  LogfmtChunkOffsets(meta.data(), H, offsets.data());
  const int64_t C = LogfmtChunk(H), per_chunk = C / kLogfmtDivision;
  const int64_t division_words = kLogfmtDivision / kLogfmtGroup * kLogfmtGroupWords;
  for (int64_t k = 0; k < H / C; ++k) {
    const uint8_t* src = slot + offsets[k];
    if (!LogfmtChunkPacked(meta.data(), H, k)) {
      for (int64_t i = 0; i < C; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[k * C + i] = StoreDecoded<T>(Bf16ToFloat(b));
      }
      continue;
    }
    for (int64_t d = 0; d < per_chunk; ++d) {
      uint32_t words[kLogfmtDivision / kLogfmtGroup * kLogfmtGroupWords];
      std::memcpy(words, src + d * division_words * 4, sizeof(words));
      UnpackDivision(words, meta[k * per_chunk + d], out + k * C + d * kLogfmtDivision);
    }
  }
}

ffi::Error LogfmtEncodeCpu(ffi::ThreadPool pool, int32_t device, Any x, AnyOut wire) {
  int64_t N, H;
  if (auto err = CheckLogfmtEncode(x, wire, &N, &H); err.failure()) return err;
  const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data());
  uint8_t* dst = static_cast<uint8_t*>(wire->untyped_data());
  const int64_t S = LogfmtSlotBytes(H);
  ParallelFor({pool, device}, N, GrainItems(S), [&](int64_t begin, int64_t end) {
    IeeeDenormals ieee;
    for (int64_t t = begin; t < end; ++t) EncodeRow(src + t * H, H, dst + t * S);
  });
  return ffi::Error::Success();
}

ffi::Error LogfmtDecodeCpu(ffi::ThreadPool pool, int32_t device, Any wire, AnyOut out) {
  int64_t N, H;
  if (auto err = CheckLogfmtDecode(wire, out, &N, &H); err.failure()) return err;
  const uint8_t* src = static_cast<const uint8_t*>(wire.untyped_data());
  const int64_t S = LogfmtSlotBytes(H);
  auto run = [&](auto* dst) {
    ParallelFor({pool, device}, N, GrainItems(S), [&](int64_t begin, int64_t end) {
      IeeeDenormals ieee;
      for (int64_t t = begin; t < end; ++t) DecodeRow(src + t * S, H, dst + t * H);
    });
  };
  if (out->element_type() == ffi::DataType::F32) {
    run(static_cast<float*>(out->untyped_data()));
  } else {
    run(static_cast<uint16_t*>(out->untyped_data()));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLogfmtEncodeCpu, jax_ep::LogfmtEncodeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // x bf16 [N, H]
                                  .Ret<jax_ep::Any>());      // wire u8[N, 2H + H/32]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLogfmtDecodeCpu, jax_ep::LogfmtDecodeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // wire u8[N, 2H + H/32]
                                  .Ret<jax_ep::Any>());      // out [N, H] f32 | bf16

// DeepEP's LogFMT-10 combine format (logfmt.h), CUDA handlers: the twins of logfmt.cc, the same
// bits (the per-value arithmetic is logfmt.h's, float64 with correctly rounded products and
// sums; log2 / exp2 are CUDA's, within an ulp of the host library's, so on a real GPU a code
// can differ where log2 lands on a code boundary to an ulp of float64).
//
// One block per row (grid-stride over rows). Its threads first reduce one 128-channel division
// each to the meta word (amax | amin << 16); thread 0 derives the chunk offsets; then every
// thread packs (or copies) 16-value groups into the slot, and the tail is zeroed. The decoder
// reads the meta, derives the same offsets and unpacks the groups. No scratch, no host sync:
// both handlers are command-buffer compatible.
#include "cuda_common.cuh"
#include "checks.h"
#include "logfmt.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 128;

// Shared memory of one row: its meta words and chunk offsets.
size_t RowSharedBytes(int64_t H) {
  return sizeof(int64_t) * (H / LogfmtChunk(H) + 1) + sizeof(uint32_t) * LogfmtDivisions(H);
}

// The group q's chunk, and whether that chunk is packed (its length on the wire says so).
__device__ __forceinline__ bool GroupPacked(const int64_t* offsets, int64_t C, int64_t q) {
  const int64_t k = q * kLogfmtGroup / C;
  return offsets[k + 1] - offsets[k] == LogfmtChunkBytes(C, true);
}

// Byte offset in the slot of group q (16 values), packed or raw.
__device__ __forceinline__ int64_t GroupOffset(const int64_t* offsets, int64_t C, int64_t q,
                                               bool packed) {
  const int64_t k = q * kLogfmtGroup / C, i = q * kLogfmtGroup - k * C;
  return offsets[k] + (packed ? i / kLogfmtGroup * kLogfmtGroupWords * 4 : i * 2);
}

__global__ void __launch_bounds__(kThreads)
    LogfmtEncodeKernel(const uint16_t* __restrict__ x, int64_t N, int64_t H,
                       uint8_t* __restrict__ wire) {
  JAX_EP_EXTERN_SHARED(int64_t, smem);
  const int64_t C = LogfmtChunk(H), G = LogfmtDivisions(H), S = LogfmtSlotBytes(H);
  int64_t* offsets = smem;
  uint32_t* meta = reinterpret_cast<uint32_t*>(smem + H / C + 1);
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const uint16_t* xr = x + row * H;
    uint32_t* slot = reinterpret_cast<uint32_t*>(wire + row * S);
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
      uint32_t amax = 0, amin = 0x7fffu;
      for (int64_t i = g * kLogfmtDivision; i < (g + 1) * kLogfmtDivision; ++i) {
        const uint32_t m = xr[i] & 0x7fffu;
        amax = max(amax, m);
        amin = min(amin, m);
      }
      meta[g] = amax | (amin << 16);
      slot[g] = meta[g];
    }
    __syncthreads();
    if (threadIdx.x == 0) LogfmtChunkOffsets(meta, H, offsets);
    __syncthreads();
    for (int64_t q = threadIdx.x; q < H / kLogfmtGroup; q += blockDim.x) {
      const bool packed = GroupPacked(offsets, C, q);
      uint32_t* dst = slot + GroupOffset(offsets, C, q, packed) / 4;
      const uint16_t* v = xr + q * kLogfmtGroup;
      if (!packed) {
        for (int j = 0; j < 8; ++j) dst[j] = uint32_t(v[2 * j]) | (uint32_t(v[2 * j + 1]) << 16);
        continue;
      }
      const uint32_t m = meta[q * kLogfmtGroup / kLogfmtDivision];
      const LogfmtScale s = MakeLogfmtScale(m & 0xffffu, m >> 16);
      uint32_t codes[16], signs = 0;
      for (int j = 0; j < 16; ++j) {
        codes[j] = LogfmtCode(v[j] & 0x7fffu, s);
        signs |= uint32_t(v[j] >> 15) << j;
      }
      PackLogfmtGroup(codes, signs, dst);
    }
    for (int64_t w = offsets[H / C] / 4 + threadIdx.x; w < S / 4; w += blockDim.x) slot[w] = 0;
    __syncthreads();  // the next row reuses meta and offsets
  }
}

template <typename T>
__device__ __forceinline__ T StoreDecoded(float v);
template <>
__device__ __forceinline__ float StoreDecoded<float>(float v) { return v; }
template <>
__device__ __forceinline__ uint16_t StoreDecoded<uint16_t>(float v) { return FloatToBf16(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    LogfmtDecodeKernel(const uint8_t* __restrict__ wire, int64_t N, int64_t H,
                       T* __restrict__ out) {
  JAX_EP_EXTERN_SHARED(int64_t, smem);
  const int64_t C = LogfmtChunk(H), G = LogfmtDivisions(H), S = LogfmtSlotBytes(H);
  int64_t* offsets = smem;
  uint32_t* meta = reinterpret_cast<uint32_t*>(smem + H / C + 1);
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const uint32_t* slot = reinterpret_cast<const uint32_t*>(wire + row * S);
    T* o = out + row * H;
    for (int64_t g = threadIdx.x; g < G; g += blockDim.x) meta[g] = slot[g];
    __syncthreads();
    if (threadIdx.x == 0) LogfmtChunkOffsets(meta, H, offsets);
    __syncthreads();
    for (int64_t q = threadIdx.x; q < H / kLogfmtGroup; q += blockDim.x) {
      const bool packed = GroupPacked(offsets, C, q);
      const uint32_t* src = slot + GroupOffset(offsets, C, q, packed) / 4;
      T* dst = o + q * kLogfmtGroup;
      if (!packed) {
        for (int j = 0; j < 8; ++j) {
          dst[2 * j] = StoreDecoded<T>(Bf16ToFloat(uint16_t(src[j] & 0xffffu)));
          dst[2 * j + 1] = StoreDecoded<T>(Bf16ToFloat(uint16_t(src[j] >> 16)));
        }
        continue;
      }
      const uint32_t m = meta[q * kLogfmtGroup / kLogfmtDivision];
      const LogfmtScale s = MakeLogfmtScale(m & 0xffffu, m >> 16);
      uint32_t w[kLogfmtGroupWords];
      for (int i = 0; i < kLogfmtGroupWords; ++i) w[i] = src[i];
      for (int j = 0; j < 16; ++j) {
        const float v = float(LogfmtValue(LogfmtGroupCode(w, j), s));
        dst[j] = StoreDecoded<T>((w[4] >> (16 + j)) & 1u ? -v : v);
      }
    }
    __syncthreads();  // the next row reuses meta and offsets
  }
}

ffi::Error LogfmtEncodeCuda(cudaStream_t stream, Any x, AnyOut wire) {
  int64_t N, H;
  if (auto err = CheckLogfmtEncode(x, wire, &N, &H); err.failure()) return err;
  if (N == 0) return ffi::Error::Success();
  JAX_EP_LAUNCH(GridFor(N, 1), kThreads, RowSharedBytes(H), stream, LogfmtEncodeKernel)(
      static_cast<const uint16_t*>(x.untyped_data()), N, H,
      static_cast<uint8_t*>(wire->untyped_data()));
  return CheckLaunch("LogfmtEncodeKernel");
}

ffi::Error LogfmtDecodeCuda(cudaStream_t stream, Any wire, AnyOut out) {
  int64_t N, H;
  if (auto err = CheckLogfmtDecode(wire, out, &N, &H); err.failure()) return err;
  if (N == 0) return ffi::Error::Success();
  const uint8_t* src = static_cast<const uint8_t*>(wire.untyped_data());
  const unsigned grid = GridFor(N, 1);
  if (out->element_type() == ffi::DataType::F32) {
    JAX_EP_LAUNCH(grid, kThreads, RowSharedBytes(H), stream, LogfmtDecodeKernel<float>)(
        src, N, H, static_cast<float*>(out->untyped_data()));
  } else {
    JAX_EP_LAUNCH(grid, kThreads, RowSharedBytes(H), stream, LogfmtDecodeKernel<uint16_t>)(
        src, N, H, static_cast<uint16_t*>(out->untyped_data()));
  }
  return CheckLaunch("LogfmtDecodeKernel");
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLogfmtEncodeCuda, jax_ep::LogfmtEncodeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // x bf16 [N, H]
                                  .Ret<jax_ep::Any>(),       // wire u8[N, 2H + H/32]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLogfmtDecodeCuda, jax_ep::LogfmtDecodeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_ep::Any>()        // wire u8[N, 2H + H/32]
                                  .Ret<jax_ep::Any>(),       // out [N, H] f32 | bf16
                              {xla::ffi::Traits::kCmdBufferCompatible});

// Multihot routing, expert-major permutation, row gather and the deterministic unpermute
// reduction, CPU handlers.
//
// indices_to_multihot: topk_idx i32[T,K], topk_probs f32[T,K] -> routing_map bool[T,E],
//   probs f32[T,E] (a repeated expert id in one row adds its probs).
// permute: tokens [T,H], routing_map bool[T,E], probs f32[T,E] or f32[0] -> permuted [N,H],
//   permuted_probs f32[N], sorted_indices i32[N], tokens_per_expert i32[E], num_dropped i32[].
//   Expert-major, token-ascending; blocks padded to pad_multiple; drop_and_pad gives every
//   expert exactly N // E rows. Rows that fit nowhere are dropped (counted), padding rows are
//   zero / -1 / 0.
// gather_rows: x [S,H], row_idx i32[N] -> out [N,H], out[r] = x[row_idx[r]], zero when the
//   index is outside [0, S). Used for send packing and every "replay a layout" step.
// unpermute: permuted [N,H], sorted_indices i32[N], probs f32[N] or f32[0] -> out [T,H],
//   out[t] = sum over rows r with sorted_indices[r] == t, ascending r, of permuted[r]*probs[r]
//   in fp32. A counting pass builds the inverse map token -> rows, so every output row is
//   reduced in a fixed order (bitwise reproducible, no scatter-add).
#include <algorithm>
#include <vector>

#include "common.h"
#include "checks.h"
#include "cpu_util.h"
#include "permute.h"

namespace jax_ep {

void PlanPermute(const bool* routing_map, const float* probs, int64_t T, int64_t E, int64_t N,
                 int64_t pad_multiple, bool drop_and_pad, int32_t* sorted_indices,
                 float* permuted_probs, int32_t* tokens_per_expert, int32_t* num_dropped) {
  std::vector<int64_t> routed(E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) routed[e] += routing_map[t * E + e];

  // Block start and row capacity of each expert.
  std::vector<int64_t> start(E), capacity(E);
  const int64_t m = std::max<int64_t>(pad_multiple, 1);
  if (drop_and_pad) {
    const int64_t c = (E ? N / E : 0) / m * m;
    for (int64_t e = 0; e < E; ++e) {
      start[e] = e * c;
      capacity[e] = c;
    }
  } else {
    int64_t offset = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t block = (routed[e] + m - 1) / m * m;
      start[e] = offset;
      capacity[e] = BlockCapacity(N, offset, block, m);
      offset += block;
    }
  }
  std::fill(sorted_indices, sorted_indices + N, -1);
  std::fill(permuted_probs, permuted_probs + N, 0.0f);
  int64_t kept = 0, total = 0;
  std::vector<int64_t> cursor(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      if (!routing_map[t * E + e]) continue;
      ++total;
      const int64_t j = cursor[e]++;
      if (j >= capacity[e]) continue;
      const int64_t row = start[e] + j;
      sorted_indices[row] = int32_t(t);
      if (probs) permuted_probs[row] = probs[t * E + e];
      ++kept;
    }
  }
  for (int64_t e = 0; e < E; ++e) tokens_per_expert[e] = int32_t(capacity[e]);
  *num_dropped = int32_t(total - kept);
}

// acc[h] += row[h] * w over h < n (restrict pointers: vectorised).
template <typename T>
void AccumulateRow(const T* __restrict row, float w, int64_t n, float* __restrict acc) {
  for (int64_t h = 0; h < n; ++h) acc[h] += Fp32Io<T>::Load(row[h]) * w;
}

// One output row of unpermute: out[h] = sum over i < count, ascending, of
// src[row_of[i] * H + h] * w_i in fp32 (each product rounded, then added; w_i =
// probs[row_of[i]], 1 without probs). 64 channels at a time, the token's rows read side by
// side so their loads overlap, the sums held in four vector registers.
template <typename T>
void ReduceRow(const T* src, int64_t H, const int64_t* row_of, int64_t count,
               const float* probs, T* out) {
  constexpr int64_t kChunk = 64, kLanes = 16;
  int64_t h0 = 0;
  for (; h0 + kChunk <= H; h0 += kChunk) {
    F32x16 acc[kChunk / kLanes] = {};
    for (int64_t i = 0; i < count; ++i) {
      const T* row = src + row_of[i] * H + h0;
      const float w = probs ? probs[row_of[i]] : 1.0f;
      for (int64_t v = 0; v < kChunk / kLanes; ++v) MulAddF32x16(row + v * kLanes, w, acc[v]);
    }
    for (int64_t v = 0; v < kChunk / kLanes; ++v) StoreF32x16(acc[v], out + h0 + v * kLanes);
  }
  if (h0 == H) return;
  float tail[kChunk] = {};
  for (int64_t i = 0; i < count; ++i)
    AccumulateRow(src + row_of[i] * H + h0, probs ? probs[row_of[i]] : 1.0f, H - h0, tail);
  for (int64_t h = h0; h < H; ++h) out[h] = Fp32Io<T>::Store(tail[h - h0]);
}

void GatherRowsBytes(const CpuWorkers& workers, const uint8_t* x, int64_t num_src,
                     int64_t row_bytes, const int32_t* idx, int64_t num_rows, uint8_t* out) {
  AdviseHugePages(out, num_rows * row_bytes);
  const bool streaming = num_rows * row_bytes >= kStreamingStoreBytes;
  ParallelFor(workers, num_rows, GrainItems(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = idx[r];
      const uint8_t* src = s >= 0 && s < num_src ? x + s * row_bytes : nullptr;
      uint8_t* dst = out + r * row_bytes;
      if (streaming) {
        StreamRow(dst, src, row_bytes);
      } else {
        CopyOrZeroRow(dst, src, row_bytes);
      }
    }
    if (streaming) StreamingFence();
  });
}

namespace {

ffi::Error MultihotCpu(ffi::ThreadPool pool, int32_t device, I32 topk_idx, F32 topk_probs,
                       int64_t num_experts, PredOut routing_map, F32Out probs) {
  int64_t T, K;
  if (auto err = CheckMultihotArgs(topk_idx, topk_probs, num_experts, routing_map, probs, &T, &K);
      err.failure())
    return err;
  const int64_t E = num_experts;
  const int32_t* idx = topk_idx.typed_data();
  if (auto err = CheckExpertIds(idx, T * K, E, "topk_idx"); err.failure()) return err;
  const float* p = topk_probs.typed_data();
  bool* map = routing_map->typed_data();
  float* dense = probs->typed_data();
  const int64_t row_bytes = E * int64_t(sizeof(bool) + sizeof(float));
  ParallelFor({pool, device}, T, GrainItems(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {  // clear a row, then scatter its slots while cached
      std::fill(map + t * E, map + (t + 1) * E, false);
      std::fill(dense + t * E, dense + (t + 1) * E, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[t * K + k];
        if (e < 0) continue;
        map[t * E + e] = true;
        dense[t * E + e] += p[t * K + k];
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error PermuteCpu(ffi::ThreadPool pool, int32_t device, Any tokens, Pred routing_map,
                      F32 probs, int64_t pad_multiple, bool drop_and_pad, AnyOut permuted,
                      F32Out permuted_probs, I32Out sorted_indices, I32Out tokens_per_expert,
                      I32Out num_dropped) {
  int64_t T, E, row_bytes;
  bool has_probs;
  if (auto err = CheckPermuteArgs(tokens, routing_map, probs, pad_multiple, &T, &E, &row_bytes,
                                  &has_probs);
      err.failure())
    return err;
  const int64_t N = sorted_indices->element_count();
  if (auto err = CheckPermuteResults(E, row_bytes, permuted, permuted_probs, sorted_indices,
                                     tokens_per_expert, num_dropped);
      err.failure())
    return err;
  int32_t* order = sorted_indices->typed_data();
  PlanPermute(routing_map.typed_data(), has_probs ? probs.typed_data() : nullptr, T, E, N,
              pad_multiple, drop_and_pad, order, permuted_probs->typed_data(),
              tokens_per_expert->typed_data(), num_dropped->typed_data());
  GatherRowsBytes({pool, device}, static_cast<const uint8_t*>(tokens.untyped_data()), T,
                  row_bytes, order, N, static_cast<uint8_t*>(permuted->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error GatherRowsCpu(ffi::ThreadPool pool, int32_t device, Any x, I32 row_idx, AnyOut out) {
  int64_t rows, width;
  RowsAndWidth(x, &rows, &width);
  int64_t row_bytes = 0;
  if (auto err = RowBytes(x.element_type(), width, "x", &row_bytes); err.failure()) return err;
  const int64_t num_rows = row_idx.element_count();
  if (auto err = CheckGatherRowsResult(x, row_bytes, num_rows, out); err.failure()) return err;
  GatherRowsBytes({pool, device}, static_cast<const uint8_t*>(x.untyped_data()), rows,
                  row_bytes, row_idx.typed_data(), num_rows,
                  static_cast<uint8_t*>(out->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error UnpermuteCpu(ffi::ThreadPool pool, int32_t device, Any permuted, I32 sorted_indices,
                        F32 probs, AnyOut out) {
  int64_t N, H;
  RowsAndWidth(permuted, &N, &H);
  int64_t T;
  if (auto err = CheckUnpermuteResult(permuted, H, out, &T); err.failure()) return err;
  bool has_probs;
  if (auto err = CheckUnpermuteArgs(sorted_indices, probs, N, &has_probs); err.failure())
    return err;
  const int32_t* idx = sorted_indices.typed_data();
  for (int64_t r = 0; r < N; ++r) {
    if (idx[r] < -1 || idx[r] >= T) {
      return ffi::Error::InvalidArgument("sorted_indices: entry " + std::to_string(idx[r]) +
                                         " at row " + std::to_string(r) + " is outside [-1, " +
                                         std::to_string(T) + ")");
    }
  }
  // Inverse map token -> rows, rows ascending inside each token (a stable counting sort).
  std::vector<int32_t> count(T, 0);
  for (int64_t r = 0; r < N; ++r)
    if (idx[r] >= 0) ++count[idx[r]];
  std::vector<int64_t> offset(T + 1);
  ExclusiveScan(count.data(), T, offset.data());
  std::vector<int64_t> rows_of_token(offset[T]);
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t r = 0; r < N; ++r)
    if (idx[r] >= 0) rows_of_token[fill[idx[r]]++] = r;

  const float* p = has_probs ? probs.typed_data() : nullptr;
  return DispatchFloat(permuted.element_type(), "permuted", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* src = static_cast<const T_*>(permuted.untyped_data());
    T_* dst = static_cast<T_*>(out->untyped_data());
    AdviseHugePages(dst, T * H * int64_t(sizeof(T_)));
    const int64_t row_bytes = H * int64_t(sizeof(T_));
    const bool streaming = T * row_bytes >= kStreamingStoreBytes;
    ParallelFor({pool, device}, T, GrainItems(row_bytes), [&](int64_t begin, int64_t end) {
      std::vector<T_> staged(streaming ? H : 0);  // the output row before its streaming store
      for (int64_t t = begin; t < end; ++t) {
        const int64_t* row_of = rows_of_token.data() + offset[t];
        const int64_t count = offset[t + 1] - offset[t];
        if (streaming) {
          ReduceRow(src, H, row_of, count, p, staged.data());
          StreamRow(reinterpret_cast<uint8_t*>(dst + t * H),
                    reinterpret_cast<const uint8_t*>(staged.data()), row_bytes);
        } else {
          ReduceRow(src, H, row_of, count, p, dst + t * H);
        }
      }
      if (streaming) StreamingFence();
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpIndicesToMultihotCpu, jax_ep::MultihotCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Arg<jax_ep::F32>()        // topk_probs [T, K]
                                  .Attr<int64_t>("num_experts")
                                  .Ret<jax_ep::Pred>()       // routing_map [T, E]
                                  .Ret<jax_ep::F32>());      // probs [T, E]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPermuteCpu, jax_ep::PermuteCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // tokens [T, H]
                                  .Arg<jax_ep::Pred>()       // routing_map [T, E]
                                  .Arg<jax_ep::F32>()        // probs [T, E] or [0]
                                  .Attr<int64_t>("pad_multiple")
                                  .Attr<bool>("drop_and_pad")
                                  .Ret<jax_ep::Any>()        // permuted [N, H]
                                  .Ret<jax_ep::F32>()        // permuted_probs [N]
                                  .Ret<jax_ep::I32>()        // sorted_indices [N]
                                  .Ret<jax_ep::I32>()        // tokens_per_expert [E]
                                  .Ret<jax_ep::I32>());      // num_dropped []

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGatherRowsCpu, jax_ep::GatherRowsCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // x [S, ...]
                                  .Arg<jax_ep::I32>()        // row_idx [N]
                                  .Ret<jax_ep::Any>());      // out [N, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpUnpermuteCpu, jax_ep::UnpermuteCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // permuted [N, H]
                                  .Arg<jax_ep::I32>()        // sorted_indices [N]
                                  .Arg<jax_ep::F32>()        // probs [N] or [0]
                                  .Ret<jax_ep::Any>());      // out [T, H]

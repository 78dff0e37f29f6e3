// Host-side argument checks shared by each CPU handler and its CUDA twin, so both reject the
// same inputs with the same message (the argument's name and the shape it got).
#pragma once

#include "common.h"

namespace jax_ep {

// Bytes of one token's packed UE8M0 scales: G exponent bytes rounded up to whole int32 words.
JAX_EP_HD int64_t Ue8m0RowBytes(int64_t groups) { return 4 * ((groups + 3) / 4); }

inline ffi::Error CheckFp8Shapes(int64_t H, bool use_ue8m0, bool round_scale) {
  if (H % kFp8Block != 0) {
    return ffi::Error::InvalidArgument("x: hidden size " + std::to_string(H) +
                                       " must be a multiple of 128 for the FP8 cast");
  }
  if (use_ue8m0 && !round_scale) {
    return ffi::Error::InvalidArgument("use_ue8m0 requires round_scale");
  }
  return ffi::Error::Success();
}

// x_fp8 [T,H] float8_e4m3fn and its scales (f32[T,H/128] or packed UE8M0); sets T and H.
inline ffi::Error CheckCastBackArgs(const Any& x_fp8, const Any& scales, bool use_ue8m0,
                                    int64_t* T, int64_t* H) {
  RowsAndWidth(x_fp8, T, H);
  if (x_fp8.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("x_fp8: expected float8_e4m3fn");
  }
  if (auto err = CheckFp8Shapes(*H, false, false); err.failure()) return err;
  const int64_t G = *H / kFp8Block;
  const size_t want = use_ue8m0 ? *T * Ue8m0RowBytes(G) : *T * G * 4;
  if (scales.size_bytes() != want) {
    return ffi::Error::InvalidArgument("scales: got shape " + ShapeString(scales.dimensions()) +
                                       ", which does not match x_fp8 " +
                                       ShapeString(x_fp8.dimensions()));
  }
  return ffi::Error::Success();
}

// topk_idx [T,K] over P*L experts and topk_weights [T,K]; sets T and K.
inline ffi::Error CheckSendLayoutArgs(const I32& topk_idx, const F32& topk_weights, int64_t P,
                                      int64_t L, int64_t* T, int64_t* K) {
  if (L <= 0) return ffi::Error::InvalidArgument("num_local_experts must be positive");
  if (auto err = CheckRouting(topk_idx, P * L, P); err.failure()) return err;
  *T = topk_idx.dimensions()[0];
  *K = topk_idx.dimensions()[1];
  if (topk_weights.element_count() != size_t(*T * *K)) {
    return ffi::Error::InvalidArgument("topk_weights: expected shape [" + std::to_string(*T) +
                                       ", " + std::to_string(*K) + "], got " +
                                       ShapeString(topk_weights.dimensions()));
  }
  return ffi::Error::Success();
}

// tokens [T,...], routing_map bool[T,E], probs f32[T,E] or f32[0]; sets T, E, the row width
// (elements) and whether probs were given.
inline ffi::Error CheckPermuteArgs(const Any& tokens, const Pred& routing_map, const F32& probs,
                                   int64_t* T, int64_t* E, int64_t* width, bool* has_probs) {
  if (auto err = CheckRank(routing_map, 2, "routing_map"); err.failure()) return err;
  *T = routing_map.dimensions()[0];
  *E = routing_map.dimensions()[1];
  int64_t rows;
  RowsAndWidth(tokens, &rows, width);
  if (rows != *T) {
    return ffi::Error::InvalidArgument("tokens: expected " + std::to_string(*T) +
                                       " rows to match routing_map, got shape " +
                                       ShapeString(tokens.dimensions()));
  }
  *has_probs = probs.element_count() != 0;
  if (*has_probs && probs.element_count() != size_t(*T * *E)) {
    return ffi::Error::InvalidArgument("probs: expected shape of routing_map, got " +
                                       ShapeString(probs.dimensions()));
  }
  return ffi::Error::Success();
}

// sorted_indices i32[N] (one per permuted row) and probs f32[N] or f32[0].
inline ffi::Error CheckUnpermuteArgs(const I32& sorted_indices, const F32& probs, int64_t N,
                                     bool* has_probs) {
  if (int64_t(sorted_indices.element_count()) != N) {
    return ffi::Error::InvalidArgument("sorted_indices: expected " + std::to_string(N) +
                                       " entries (rows of permuted), got shape " +
                                       ShapeString(sorted_indices.dimensions()));
  }
  *has_probs = probs.element_count() != 0;
  if (*has_probs && int64_t(probs.element_count()) != N) {
    return ffi::Error::InvalidArgument("probs: expected [" + std::to_string(N) + "], got " +
                                       ShapeString(probs.dimensions()));
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep

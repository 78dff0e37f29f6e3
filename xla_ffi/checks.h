// Host-side argument checks shared by each CPU handler and its CUDA twin, so both reject the
// same inputs with the same message (the argument's name and the shape it got).
#pragma once

#include <initializer_list>
#include <utility>

#include "common.h"
#include "logfmt.h"

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

// tokens [T,...] (whole bytes per element), routing_map bool[T,E], probs f32[T,E] or f32[0],
// pad_multiple at most INT32_MAX; sets T, E, a token row's bytes and whether probs were given.
inline ffi::Error CheckPermuteArgs(const Any& tokens, const Pred& routing_map, const F32& probs,
                                   int64_t pad_multiple, int64_t* T, int64_t* E,
                                   int64_t* row_bytes, bool* has_probs) {
  if (auto err = CheckRank(routing_map, 2, "routing_map"); err.failure()) return err;
  *T = routing_map.dimensions()[0];
  *E = routing_map.dimensions()[1];
  int64_t rows, width;
  RowsAndWidth(tokens, &rows, &width);
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
  if (auto err = RowBytes(tokens.element_type(), width, "tokens", row_bytes); err.failure())
    return err;
  return CheckPadMultiple(pad_multiple);
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

// ----------------------------------------------------------------------------- results
// A target's result shapes come from its caller (jax.ffi.ffi_call takes them as given), so
// every handler checks them against its operands before it writes anything: a mismatched
// call is an InvalidArgument error naming the shapes, never an out-of-bounds write.
// (Results are taken by non-const reference: ffi::Result's operator-> is not const.)

// Whether each result holds its expected number of elements ({got, want} pairs).
inline bool CountsMatch(std::initializer_list<std::pair<size_t, int64_t>> got_want) {
  for (const auto& [got, want] : got_want)
    if (want < 0 || got != size_t(want)) return false;
  return true;
}

// topk_idx [T,K] and topk_probs [T,K] -> routing_map bool[T,E], probs f32[T,E]; sets T, K.
inline ffi::Error CheckMultihotArgs(const I32& topk_idx, const F32& topk_probs,
                                    int64_t num_experts, PredOut& routing_map,
                                    F32Out& probs, int64_t* T, int64_t* K) {
  if (auto err = CheckRank(topk_idx, 2, "topk_idx"); err.failure()) return err;
  *T = topk_idx.dimensions()[0];
  *K = topk_idx.dimensions()[1];
  if (num_experts < 0 || num_experts > INT32_MAX) {
    return ffi::Error::InvalidArgument("num_experts must be in [0, 2^31), got " +
                                       std::to_string(num_experts));
  }
  if (topk_probs.element_count() != size_t(*T * *K)) {
    return ffi::Error::InvalidArgument("topk_probs: expected shape [" + std::to_string(*T) + ", " +
                                       std::to_string(*K) + "], got " +
                                       ShapeString(topk_probs.dimensions()));
  }
  const int64_t cells = *T * num_experts;
  if (!CountsMatch({{routing_map->element_count(), cells}, {probs->element_count(), cells}})) {
    return ffi::Error::InvalidArgument("indices_to_multihot: results must be [T, E] = [" +
                                       std::to_string(*T) + ", " + std::to_string(num_experts) +
                                       "], got " + ShapeString(routing_map->dimensions()) +
                                       " and " + ShapeString(probs->dimensions()));
  }
  return ffi::Error::Success();
}

// num_tokens_per_rank [P], is_token_in_rank [T,P], num_tokens_per_expert [E], num_invalid [].
inline ffi::Error CheckDispatchLayoutResults(const I32& topk_idx, int64_t E, int64_t P,
                                             I32Out& per_rank, PredOut& in_rank,
                                             I32Out& per_expert, I32Out& invalid) {
  const int64_t T = topk_idx.dimensions()[0];
  if (!CountsMatch({{per_rank->element_count(), P},
                    {in_rank->element_count(), T * P},
                    {per_expert->element_count(), E},
                    {invalid->element_count(), 1}})) {
    return ffi::Error::InvalidArgument(
        "dispatch layout: result shapes do not match [P], [T, P], [E], [] for topk_idx " +
        ShapeString(topk_idx.dimensions()) + " with P = " + std::to_string(P) +
        ", E = " + std::to_string(E));
  }
  return ffi::Error::Success();
}

// token_idx [T*P], rank [T*P], local_idx [T*P,K], weights [T*P,K], send_counts [P], num_send [].
inline ffi::Error CheckSendLayoutResults(const I32& topk_idx, int64_t P, I32Out& token_idx,
                                         I32Out& rank, I32Out& local_idx,
                                         F32Out& weights, I32Out& send_counts,
                                         I32Out& num_send) {
  const int64_t T = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  const int64_t rows = T * P;
  if (!CountsMatch({{token_idx->element_count(), rows},
                    {rank->element_count(), rows},
                    {local_idx->element_count(), rows * K},
                    {weights->element_count(), rows * K},
                    {send_counts->element_count(), P},
                    {num_send->element_count(), 1}})) {
    return ffi::Error::InvalidArgument(
        "send layout: result shapes do not match [T*P], [T*P], [T*P, K], [T*P, K], [P], [] for "
        "topk_idx " + ShapeString(topk_idx.dimensions()) + " with P = " + std::to_string(P));
  }
  return ffi::Error::Success();
}

// permuted [N, row], permuted_probs [N], sorted_indices [N], tokens_per_expert [E],
// num_dropped []; N is taken from sorted_indices.
inline ffi::Error CheckPermuteResults(int64_t E, int64_t row_bytes, AnyOut& permuted,
                                      F32Out& permuted_probs, I32Out& sorted_indices,
                                      I32Out& tokens_per_expert, I32Out& num_dropped) {
  const int64_t N = sorted_indices->element_count();
  if (!CountsMatch({{permuted->size_bytes(), N * row_bytes},
                    {permuted_probs->element_count(), N},
                    {tokens_per_expert->element_count(), E},
                    {num_dropped->element_count(), 1}})) {
    return ffi::Error::InvalidArgument("permute: result shapes do not match [N, H], [N], [N], [" +
                                       std::to_string(E) + "], [] with N = " + std::to_string(N) +
                                       ", got permuted " + ShapeString(permuted->dimensions()));
  }
  return ffi::Error::Success();
}

// out [num_rows, row] of x's rows, num_rows = row_idx's length.
inline ffi::Error CheckGatherRowsResult(const Any& x, int64_t row_bytes, int64_t num_rows,
                                        AnyOut& out) {
  if (!CountsMatch({{out->size_bytes(), num_rows * row_bytes}})) {
    return ffi::Error::InvalidArgument("gather_rows: out must hold " + std::to_string(num_rows) +
                                       " rows of x " + ShapeString(x.dimensions()) + ", got " +
                                       ShapeString(out->dimensions()));
  }
  return ffi::Error::Success();
}

// out [T, H] with permuted's row width H and dtype; sets T (the caller's num_tokens).
inline ffi::Error CheckUnpermuteResult(const Any& permuted, int64_t H, AnyOut& out,
                                       int64_t* T) {
  int64_t out_width;
  RowsAndWidth(*out, T, &out_width);
  if (out_width != H || out->element_type() != permuted.element_type()) {
    return ffi::Error::InvalidArgument("unpermute: out " + ShapeString(out->dimensions()) +
                                       " must have the row width and dtype of permuted " +
                                       ShapeString(permuted.dimensions()));
  }
  return ffi::Error::Success();
}

// x_fp8 float8_e4m3fn [T,H] and scales f32[T,H/128] or packed UE8M0 (whole int32 words per token).
inline ffi::Error CheckCastToFp8Results(const Any& x, int64_t T, int64_t H, bool use_ue8m0,
                                        AnyOut& x_fp8, AnyOut& scales) {
  const int64_t G = H / kFp8Block;
  const int64_t want_scales = use_ue8m0 ? T * Ue8m0RowBytes(G) : T * G * 4;
  if (x_fp8->element_type() != ffi::DataType::F8E4M3FN ||
      !CountsMatch({{x_fp8->size_bytes(), T * H}, {scales->size_bytes(), want_scales}})) {
    return ffi::Error::InvalidArgument(
        "per_token_cast_to_fp8: results must be float8_e4m3fn " + ShapeString(x.dimensions()) +
        " and scales of " + std::to_string(want_scales) + " bytes, got " +
        ShapeString(x_fp8->dimensions()) + " and " + ShapeString(scales->dimensions()));
  }
  return ffi::Error::Success();
}

// out [T, H], the shape of x_fp8 (its dtype is checked by the float dispatch).
inline ffi::Error CheckCastBackResult(const Any& x_fp8, AnyOut& out) {
  if (out->element_count() != x_fp8.element_count()) {
    return ffi::Error::InvalidArgument("per_token_cast_back: out must have the shape of x_fp8 " +
                                       ShapeString(x_fp8.dimensions()) + ", got " +
                                       ShapeString(out->dimensions()));
  }
  return ffi::Error::Success();
}

// LogFMT: x [N,H] bf16 (H % 512 == 0) and the wire u8[N, LogfmtSlotBytes(H)]; sets N and H.
inline ffi::Error CheckLogfmtEncode(const Any& x, AnyOut& wire, int64_t* N, int64_t* H) {
  RowsAndWidth(x, N, H);
  if (x.element_type() != ffi::DataType::BF16 || x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("x: expected bfloat16 [N, H], got shape " +
                                       ShapeString(x.dimensions()));
  }
  if (*H % kLogfmtHiddenMultiple != 0 || *H == 0) {
    return ffi::Error::InvalidArgument("x: hidden size " + std::to_string(*H) +
                                       " must be a positive multiple of 512 for LogFMT");
  }
  if (wire->element_type() != ffi::DataType::U8 ||
      wire->size_bytes() != size_t(*N * LogfmtSlotBytes(*H))) {
    return ffi::Error::InvalidArgument("wire: expected uint8 [N, 2H + H/32]");
  }
  return ffi::Error::Success();
}

// The wire u8[N, S] (S = 2H + H/32, H % 512 == 0) and out [N,H] f32 | bf16; sets N and H.
inline ffi::Error CheckLogfmtDecode(const Any& wire, AnyOut& out, int64_t* N, int64_t* H) {
  int64_t S;
  RowsAndWidth(wire, N, &S);
  *H = S * 32 / 65;
  if (wire.element_type() != ffi::DataType::U8 || wire.dimensions().size() != 2 ||
      *H % kLogfmtHiddenMultiple != 0 || *H == 0 || LogfmtSlotBytes(*H) != S) {
    return ffi::Error::InvalidArgument("wire: expected uint8 [N, 2H + H/32] with H % 512 == 0, "
                                       "got shape " + ShapeString(wire.dimensions()));
  }
  const ffi::DataType t = out->element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16) ||
      out->element_count() != size_t(*N * *H)) {
    return ffi::Error::InvalidArgument("out: expected float32 or bfloat16 [N, H]");
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep

// Dispatch layout and send layout, CPU handlers. Counting passes only (no sort): O(T*K + T*P).
//
// get_dispatch_layout: topk_idx i32[T,K] -> num_tokens_per_rank i32[P], is_token_in_rank
//   bool[T,P], num_tokens_per_expert i32[E], num_invalid i32[] (always 0 on CPU: an expert id
//   outside [-1, E) is an InvalidArgument error here).
// build_send_layout: one row per (token, owning rank), rank-major then token-ascending,
//   worst case T*P rows; padding rows hold -1 indices and 0 weights.
#include <algorithm>
#include <vector>

#include "checks.h"

namespace jax_ep {

namespace {

// Calls fn(t, k, owning rank r, first) for every routed slot, tokens ascending; `first` is
// true for the first slot of token t owned by rank r (one send row per (token, rank)).
template <typename Fn>
void ForEachRoutedSlot(const int32_t* idx, int64_t T, int64_t K, int64_t L, int64_t P, Fn&& fn) {
  std::vector<int64_t> last_token(P, -1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      if (e < 0) continue;
      const int64_t r = e / L;
      fn(t, k, r, last_token[r] != t);
      last_token[r] = t;
    }
  }
}

ffi::Error DispatchLayoutCpu(I32 topk_idx, int64_t num_experts, int64_t num_ranks,
                             I32Out tokens_per_rank, PredOut token_in_rank,
                             I32Out tokens_per_expert, I32Out num_invalid) {
  if (auto err = CheckRouting(topk_idx, num_experts, num_ranks); err.failure()) return err;
  const int64_t T = topk_idx.dimensions()[0], K = topk_idx.dimensions()[1];
  const int64_t L = num_experts / num_ranks;
  if (auto err = CheckDispatchLayoutResults(topk_idx, num_experts, num_ranks, tokens_per_rank,
                                            token_in_rank, tokens_per_expert, num_invalid);
      err.failure())
    return err;
  const int32_t* idx = topk_idx.typed_data();
  if (auto err = CheckExpertIds(idx, T * K, num_experts, "topk_idx"); err.failure()) return err;

  int32_t* per_rank = tokens_per_rank->typed_data();
  int32_t* per_expert = tokens_per_expert->typed_data();
  bool* in_rank = token_in_rank->typed_data();
  std::fill(per_rank, per_rank + num_ranks, 0);
  std::fill(per_expert, per_expert + num_experts, 0);
  std::fill(in_rank, in_rank + T * num_ranks, false);
  ForEachRoutedSlot(idx, T, K, L, num_ranks, [&](int64_t t, int64_t k, int64_t r, bool first) {
    ++per_expert[idx[t * K + k]];
    if (first) {
      in_rank[t * num_ranks + r] = true;
      ++per_rank[r];
    }
  });
  *num_invalid->typed_data() = 0;
  return ffi::Error::Success();
}

ffi::Error SendLayoutCpu(I32 topk_idx, F32 topk_weights, int64_t num_ranks,
                         int64_t num_local_experts, I32Out token_idx, I32Out rank,
                         I32Out local_idx, F32Out weights, I32Out send_counts,
                         I32Out num_send) {
  const int64_t P = num_ranks, L = num_local_experts;
  int64_t T, K;
  if (auto err = CheckSendLayoutArgs(topk_idx, topk_weights, P, L, &T, &K); err.failure())
    return err;
  if (auto err = CheckSendLayoutResults(topk_idx, P, token_idx, rank, local_idx, weights,
                                        send_counts, num_send);
      err.failure())
    return err;
  const int32_t* idx = topk_idx.typed_data();
  const float* w = topk_weights.typed_data();
  if (auto err = CheckExpertIds(idx, T * K, P * L, "topk_idx"); err.failure()) return err;

  // Pass 1: rows per destination rank (a token counts once per owning rank).
  int32_t* counts = send_counts->typed_data();
  std::fill(counts, counts + P, 0);
  ForEachRoutedSlot(idx, T, K, L, P, [&](int64_t, int64_t, int64_t r, bool first) {
    counts[r] += first;
  });
  std::vector<int64_t> cursor(P + 1);
  ExclusiveScan(counts, P, cursor.data());
  const int64_t total = cursor[P];

  // Pass 2: tokens ascending, so each rank's block fills in token order.
  int32_t* out_tok = token_idx->typed_data();
  int32_t* out_rank = rank->typed_data();
  int32_t* out_local = local_idx->typed_data();
  float* out_w = weights->typed_data();
  std::fill(out_tok, out_tok + T * P, -1);
  std::fill(out_rank, out_rank + T * P, -1);
  std::fill(out_local, out_local + T * P * K, -1);
  std::fill(out_w, out_w + T * P * K, 0.0f);
  std::vector<int64_t> row_of_rank(P);
  ForEachRoutedSlot(idx, T, K, L, P, [&](int64_t t, int64_t k, int64_t r, bool first) {
    if (first) {
      row_of_rank[r] = cursor[r]++;
      out_tok[row_of_rank[r]] = int32_t(t);
      out_rank[row_of_rank[r]] = int32_t(r);
    }
    const int64_t row = row_of_rank[r];
    out_local[row * K + k] = int32_t(idx[t * K + k] - r * L);
    out_w[row * K + k] = w[t * K + k];
  });
  *num_send->typed_data() = int32_t(total);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchLayoutCpu, jax_ep::DispatchLayoutCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Ret<jax_ep::I32>()        // num_tokens_per_rank [P]
                                  .Ret<jax_ep::Pred>()       // is_token_in_rank [T, P]
                                  .Ret<jax_ep::I32>()        // num_tokens_per_expert [E]
                                  .Ret<jax_ep::I32>());      // num_invalid []

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSendLayoutCpu, jax_ep::SendLayoutCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<jax_ep::I32>()        // topk_idx [T, K]
                                  .Arg<jax_ep::F32>()        // topk_weights [T, K]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_local_experts")
                                  .Ret<jax_ep::I32>()        // token_idx [T*P]
                                  .Ret<jax_ep::I32>()        // rank [T*P]
                                  .Ret<jax_ep::I32>()        // local_idx [T*P, K]
                                  .Ret<jax_ep::F32>()        // weights [T*P, K]
                                  .Ret<jax_ep::I32>()        // send_counts [P]
                                  .Ret<jax_ep::I32>());      // num_send []

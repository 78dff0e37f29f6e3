// CPU building blocks shared by the permutation, HybridEP and low-latency handlers.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// Expert-major, token-ascending row plan of a [T, E] routing map into N rows (see permute.cc):
// fills sorted_indices[N] (-1 on padding), permuted_probs[N] (probs[T*E] of each kept pair, 0
// on padding or when probs is null), tokens_per_expert[E] and num_dropped[1].
void PlanPermute(const bool* routing_map, const float* probs, int64_t T, int64_t E, int64_t N,
                 int64_t pad_multiple, bool drop_and_pad, int32_t* sorted_indices,
                 float* permuted_probs, int32_t* tokens_per_expert, int32_t* num_dropped);

// out[r] = x[idx[r]] for idx[r] in [0, num_src), else a zero row; rows are row_bytes wide.
// Rows are copied in parallel on `pool`.
void GatherRowsBytes(xla::ffi::ThreadPool& pool, const uint8_t* x, int64_t num_src,
                     int64_t row_bytes, const int32_t* idx, int64_t num_rows, uint8_t* out);

}  // namespace jax_ep

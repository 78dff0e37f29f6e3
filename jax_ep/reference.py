"""Pure-JAX reference of every layer-1 op: the test oracle and the `impl="xla"` path.

Same signatures and results as `jax_ep.ops` (which checks arguments before calling here), written
as the clearest jax.numpy formulation rather than the fastest. Notation: T tokens, H hidden,
K top-k, E experts, P ranks, L = E / P local experts, N permuted rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep._index import group_bounds

__all__ = [
    "SendLayout",
    "build_send_layout",
    "compute_send_counts",
    "gather_rows",
    "get_dispatch_layout",
    "indices_to_multihot",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "permute",
    "unpermute",
]

FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4


class SendLayout(NamedTuple):
    """One row per (token, owning rank), rank-major then token-ascending; T*P rows in all.

    token_idx i32[T*P] (-1 on padding), rank i32[T*P] (-1 on padding), local_idx i32[T*P,K]
    (the slot's local expert id where that rank owns it, else -1), weights f32[T*P,K] (0 where
    local_idx is -1), send_counts i32[P], num_send i32[].
    """

    token_idx: jax.Array
    rank: jax.Array
    local_idx: jax.Array
    weights: jax.Array
    send_counts: jax.Array
    num_send: jax.Array


def _owner_rank(topk_idx, num_local_experts):
    """[T,K] owning rank of each slot, -1 where unrouted."""
    return jnp.where(topk_idx >= 0, topk_idx // num_local_experts, -1)


def get_dispatch_layout(topk_idx, *, num_experts, num_ranks):
    """topk_idx i32[T,K] -> (num_tokens_per_rank i32[P], is_token_in_rank bool[T,P],
    num_tokens_per_expert i32[E]); a token counts once per rank owning any of its experts."""
    owner = _owner_rank(topk_idx, num_experts // num_ranks)
    is_token_in_rank = (owner[:, :, None] == jnp.arange(num_ranks)).any(axis=1)
    slot_expert = topk_idx[:, :, None] == jnp.arange(num_experts)
    num_tokens_per_expert = slot_expert.sum(axis=(0, 1), dtype=jnp.int32)
    num_tokens_per_rank = is_token_in_rank.sum(axis=0, dtype=jnp.int32)
    return num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert


def slot_ranks(topk_idx, num_ranks, num_local_experts):
    """topk_idx [T,K] -> i32[T,K] owning rank of each slot, -1 where unrouted (ids >= E, which
    only the GPU kernels accept, count as unrouted)."""
    valid = topk_idx < num_ranks * num_local_experts
    return jnp.where(valid, _owner_rank(topk_idx, num_local_experts), -1).astype(jnp.int32)


def compute_send_counts(topk_idx, num_ranks, num_local_experts):
    """topk_idx i32[T,K] -> (dest i32[T,K] owning rank of each slot, -1 where unrouted,
    is_in_rank bool[T,P], send_counts i32[P] tokens sent to each rank, once per token)."""
    dest = slot_ranks(topk_idx, num_ranks, num_local_experts)
    is_in_rank = (dest[:, :, None] == jnp.arange(num_ranks)).any(axis=1)
    return dest, is_in_rank, is_in_rank.sum(axis=0, dtype=jnp.int32)


def build_send_layout(topk_idx, topk_weights, *, num_ranks, num_local_experts):
    """topk_idx i32[T,K], topk_weights f32[T,K] -> SendLayout (see its docstring)."""
    num_tokens, top_k = topk_idx.shape
    P, L = num_ranks, num_local_experts
    owner = _owner_rank(topk_idx, L)
    is_in_rank = (owner[:, :, None] == jnp.arange(P)).any(axis=1)  # [T,P]
    # Rank-major, token-ascending order = row-major order of the [P,T] membership matrix.
    member = is_in_rank.T.reshape(-1)
    dest = jnp.where(member, jnp.cumsum(member) - 1, num_tokens * P)
    ranks = jnp.arange(P)[:, None, None]
    owned = owner[None] == ranks  # [P,T,K]
    local_all = jnp.where(owned, topk_idx[None] - ranks * L, -1).reshape(P * num_tokens, top_k)
    weight_all = jnp.where(owned, topk_weights[None], 0.0).reshape(P * num_tokens, top_k)
    rows = num_tokens * P

    def scatter(fill, values, shape):
        return jnp.full(shape, fill, values.dtype).at[dest].set(values, mode="drop")

    token_idx = scatter(-1, jnp.tile(jnp.arange(num_tokens, dtype=jnp.int32), P), (rows,))
    rank = scatter(-1, jnp.repeat(jnp.arange(P, dtype=jnp.int32), num_tokens), (rows,))
    local_idx = scatter(-1, local_all.astype(jnp.int32), (rows, top_k))
    weights = scatter(0.0, weight_all.astype(jnp.float32), (rows, top_k))
    send_counts = is_in_rank.sum(axis=0, dtype=jnp.int32)
    return SendLayout(token_idx, rank, local_idx, weights, send_counts, send_counts.sum())


def indices_to_multihot(topk_idx, topk_probs, *, num_experts):
    """topk_idx i32[T,K], topk_probs f32[T,K] -> (routing_map bool[T,E], probs f32[T,E]).
    Unrouted (-1) slots are skipped; a repeated id in one row adds its probs."""
    num_tokens = topk_idx.shape[0]
    rows = jnp.arange(num_tokens)[:, None]
    cols = jnp.where(topk_idx >= 0, topk_idx, num_experts)
    shape = (num_tokens, num_experts)
    routing_map = jnp.zeros(shape, bool).at[rows, cols].set(True, mode="drop")
    probs = jnp.zeros(shape, jnp.float32).at[rows, cols].add(topk_probs, mode="drop")
    return routing_map, probs


def permute_plan(routing_map, *, num_out_tokens, pad_multiple=None, drop_and_pad=False):
    """The row of every (token, expert) pair: (row i32[T,E] (num_out_tokens where unrouted or
    dropped), tokens_per_expert i32[E], num_dropped i32[])."""
    num_experts = routing_map.shape[1]
    n, m = num_out_tokens, pad_multiple or 1
    routed = routing_map.sum(axis=0, dtype=jnp.int32)
    if drop_and_pad:
        cap_each = (n // num_experts) // m * m
        capacity = jnp.full((num_experts,), cap_each, jnp.int32)
        start = jnp.arange(num_experts, dtype=jnp.int32) * cap_each
    else:
        # blocks rounded up to m rows; a block that would pass the n rows counts as n (it
        # keeps at most the rows left either way), so neither the rounding nor the running
        # sum overflows int32 for any m (the handler's int64 arithmetic, to the same result)
        quotient = routed // m + (routed % m != 0).astype(jnp.int32)
        block = jnp.where(quotient > n // m, n, quotient * m)
        start, _ = group_bounds(block, n)
        # A block cut by the buffer end keeps a whole multiple of m rows.
        capacity = jnp.clip((n - start) // m * m, 0, block).astype(jnp.int32)
    pos_in_expert = jnp.cumsum(routing_map, axis=0, dtype=jnp.int32) - 1
    keep = routing_map & (pos_in_expert < capacity[None, :])
    row = jnp.where(keep, start[None, :] + pos_in_expert, n)
    num_dropped = routed.sum(dtype=jnp.int32) - keep.sum(dtype=jnp.int32)
    return row, capacity, num_dropped


def permute(tokens, routing_map, probs=None, *, num_out_tokens, pad_multiple=None,
            drop_and_pad=False):
    """tokens [T,H] -> (permuted [N,H], permuted_probs f32[N] | None, sorted_indices i32[N],
    tokens_per_expert i32[E]); expert-major, token-ascending, see docs/contract.md "permute"."""
    num_tokens, num_experts = routing_map.shape
    n = num_out_tokens
    row, tokens_per_expert, _ = permute_plan(
        routing_map, num_out_tokens=n, pad_multiple=pad_multiple, drop_and_pad=drop_and_pad)
    token_of_pair = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], row.shape)
    sorted_indices = jnp.full((n,), -1, jnp.int32).at[row].set(token_of_pair, mode="drop")
    # Gathered in fp32 (exact) so that the gradient, a scatter-add of the row cotangents onto
    # their tokens, accumulates in fp32 as the FFI backward (an unpermute) does.
    permuted = gather_rows(tokens.astype(jnp.float32), sorted_indices).astype(tokens.dtype)
    permuted_probs = None
    if probs is not None and n == 0:  # JAX cannot differentiate a scatter into nothing
        permuted_probs = jnp.zeros((0,), jnp.float32)
    elif probs is not None:
        permuted_probs = jnp.zeros((n,), jnp.float32).at[row].set(probs, mode="drop")
    return permuted, permuted_probs, sorted_indices, tokens_per_expert


def gather_rows(x, row_idx):
    """x [S,...], row_idx i32[N] -> [N,...]: x[row_idx[r]], zero rows where out of [0, S)."""
    if x.shape[0] == 0:  # every index is out of range (and jnp.take rejects an empty axis)
        return jnp.zeros(row_idx.shape + x.shape[1:], x.dtype)
    valid = (row_idx >= 0) & (row_idx < x.shape[0])
    rows = jnp.take(x, jnp.clip(row_idx, 0, x.shape[0] - 1), axis=0)
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, rows, jnp.zeros((), x.dtype))


def unpermute(permuted, sorted_indices, *, num_tokens, probs=None):
    """permuted [N,H], sorted_indices i32[N] -> [num_tokens,H]: per token, the fp32 sum of its
    rows (times probs), cast back to permuted.dtype; -1 rows are ignored."""
    if num_tokens == 0:  # JAX cannot differentiate a scatter into nothing
        return jnp.zeros((0,) + permuted.shape[1:], permuted.dtype)
    values = permuted.astype(jnp.float32)
    if probs is not None:
        values = values * probs.astype(jnp.float32)[:, None]
    seg = jnp.where(sorted_indices >= 0, sorted_indices, num_tokens)
    out = jnp.zeros((num_tokens,) + permuted.shape[1:], jnp.float32)
    return out.at[seg].add(values, mode="drop").astype(permuted.dtype)


def _ceil_pow2(v):
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    exp = bits & 0x7F800000
    exp = jnp.where(bits & 0x007FFFFF, exp + 0x00800000, exp)
    return jax.lax.bitcast_convert_type(exp.astype(jnp.uint32), jnp.float32)


def _fp8_multiplier_past_flush(amax):
    """f32 amax > 2^126 -> 448 * fl(1 / amax), bitwise, where fl(1 / amax) is an fp32 subnormal
    that XLA:CPU flushes to zero: the reciprocal n * 2^-149 rounded to nearest even in integers
    (common.h's Fp8MultiplierPastFlush). Meaningless elsewhere (callers select it away)."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    m = ((bits & 0x7FFFFF) | 0x800000).astype(jnp.int32)  # amax = m * 2^(e - 150), e in 253, 254
    numerator = jnp.where(bits >> 23 == 253, jnp.float32(2.0**46), jnp.float32(2.0**45))
    n = jnp.floor(numerator / m.astype(jnp.float32)).astype(jnp.int32)  # the quotient, +-1
    # numerator - n * m: the numerator is 0 modulo 2^32 and the remainder below 2^25 in size,
    # so int32's wrapping product gives it exactly.
    rem = -(n * m)
    n, rem = jnp.where(rem < 0, n - 1, n), jnp.where(rem < 0, rem + m, rem)
    n, rem = jnp.where(rem >= m, n + 1, n), jnp.where(rem >= m, rem - m, rem)
    n = n + ((2 * rem > m) | ((2 * rem == m) & (n % 2 == 1))).astype(jnp.int32)
    # 448 * n * 2^-149 = fl(7 * n) * 2^-143, the power of two subtracted from the exponent bits.
    seven_n = jax.lax.bitcast_convert_type((7 * n).astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type(seven_n - jnp.uint32(143 << 23), jnp.float32)


def _pack_ue8m0(scale_inv):
    """f32[T,G] powers of two -> i32[T,ceil(G/4)], exponent bytes little-endian."""
    num_tokens, groups = scale_inv.shape
    exps = (jax.lax.bitcast_convert_type(scale_inv, jnp.uint32) >> 23) & 0xFF
    exps = jnp.pad(exps, ((0, 0), (0, -groups % 4))).reshape(num_tokens, -(-groups // 4), 4)
    words = (exps << (8 * jnp.arange(4, dtype=jnp.uint32))).sum(axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _unpack_ue8m0(words, groups):
    """i32[T,W] -> f32[T,groups] scales 2^(byte - 127)."""
    bits = jax.lax.bitcast_convert_type(words, jnp.uint32)[..., None]
    exps = (bits >> (8 * jnp.arange(4, dtype=jnp.uint32))) & 0xFF
    exps = exps.reshape(words.shape[0], 4 * words.shape[1])[:, :groups]
    return jax.lax.bitcast_convert_type(exps << 23, jnp.float32)


def fp8_scale_width(hidden, use_ue8m0):
    """Scales per token of a [T, hidden] FP8 cast: G = ceil(hidden / 128) f32 scales, or with
    use_ue8m0 ceil(G / 4) int32 words of packed exponent bytes."""
    groups = -(-hidden // FP8_BLOCK)
    return -(-groups // 4) if use_ue8m0 else groups


def pad_to_fp8_blocks(x):
    """x [T,H] -> [T, 128*ceil(H/128)]: zero channels appended up to whole 128-channel blocks,
    as DeepEP's per_token_cast_to_fp8 / per_token_cast_back pad (x itself when none are)."""
    extra = -x.shape[1] % FP8_BLOCK
    return jnp.pad(x, ((0, 0), (0, extra))) if extra else x


def per_token_cast_to_fp8(x, *, round_scale=False, use_ue8m0=False):
    """x [T,H] -> (x_fp8 float8_e4m3fn[T,H], scales f32[T,G] | i32[T,ceil(G/4)] with use_ue8m0),
    G = ceil(H/128): x is zero-padded to whole 128-channel blocks (a zero never raises an
    amax) and the codes are sliced back to H, as in DeepEP's tests/utils.py.
    Per token and 128 channels: scale_inv = max(1e-4, amax) / 448 (next power of two with
    round_scale), x_fp8 = x * (448 * (1 / amax)), which is what PyTorch computes for DeepEP's
    reference `x * (448.0 / x_amax)` (x * (1 / scale_inv) with round_scale, exact for a power
    of two). Past amax = 2^126, 1 / amax is an fp32 subnormal, rounded to the subnormal grid in
    integers so XLA:CPU's flush to zero cannot zero the block. A block holding an inf or NaN is
    poisoned: NaN scale_inv (UE8M0 byte 0xff) and NaN codes."""
    num_tokens, hidden = x.shape
    padded = pad_to_fp8_blocks(x)
    groups = padded.shape[1] // FP8_BLOCK
    blocks = padded.astype(jnp.float32).reshape(num_tokens, groups, FP8_BLOCK)
    amax = jnp.maximum(jnp.abs(blocks).max(axis=-1), FP8_MIN_AMAX)
    # amax * fl32(1/448): what XLA makes of `amax / 448` and what PyTorch's CUDA division by
    # a scalar computes for DeepEP's `x_amax / 448.0`; written out so no rewrite is relied on.
    scale_inv = amax * jnp.float32(1.0 / FP8_MAX)
    if round_scale:
        scale_inv = _ceil_pow2(scale_inv)
    finite = jnp.isfinite(amax)
    scale_inv = jnp.where(finite, scale_inv, jnp.nan)
    if round_scale:
        multiplier = 1.0 / scale_inv
    else:
        multiplier = jnp.where(amax > 2.0**126, _fp8_multiplier_past_flush(amax),
                               jnp.float32(FP8_MAX) * (1.0 / amax))
    x_fp8 = jnp.where(finite[..., None], blocks * multiplier[..., None],
                      jnp.nan).astype(jnp.float8_e4m3fn)
    scales = _pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv
    return x_fp8.reshape(num_tokens, groups * FP8_BLOCK)[:, :hidden], scales


def fp8_block_scales(scales, num_tokens, hidden, *, use_ue8m0=False):
    """The scales of an FP8 cast of [num_tokens, hidden] (per_token_cast_to_fp8's, in any shape
    holding their elements in row-major order) -> scale_inv f32[T, G], one per token and
    128-channel block, G = ceil(hidden/128). int32 scales are packed UE8M0 even without
    use_ue8m0; a poisoned block's UE8M0 byte 0xff reads as inf (its float32 scale is NaN)."""
    use_ue8m0 = use_ue8m0 or jnp.dtype(scales.dtype) == jnp.dtype(jnp.int32)
    rows = scales.reshape(num_tokens, fp8_scale_width(hidden, use_ue8m0))
    groups = fp8_scale_width(hidden, False)
    return _unpack_ue8m0(rows, groups) if use_ue8m0 else rows.astype(jnp.float32)


def per_token_cast_back(x_fp8, scales, *, use_ue8m0=False, dtype=jnp.bfloat16):
    """Inverse of per_token_cast_to_fp8: x_fp8 [T,H], scales -> [T,H] of `dtype`.
    scales may have any shape holding the T*W scales in row-major order (DeepEP's utils view
    them as [T, -1]); int32 scales are packed UE8M0 even without use_ue8m0, as DeepEP's
    per_token_cast_back reads them. H need not be a multiple of 128 (padded, then sliced)."""
    num_tokens, hidden = x_fp8.shape
    scale_inv = fp8_block_scales(scales, num_tokens, hidden, use_ue8m0=use_ue8m0)
    groups = scale_inv.shape[1]
    blocks = pad_to_fp8_blocks(x_fp8).astype(jnp.float32).reshape(num_tokens, groups, FP8_BLOCK)
    out = blocks * scale_inv[..., None]
    out = jnp.where(jnp.isnan(out), jnp.float32(jnp.nan), out)  # one NaN, as the handlers store
    return out.reshape(num_tokens, groups * FP8_BLOCK)[:, :hidden].astype(dtype)

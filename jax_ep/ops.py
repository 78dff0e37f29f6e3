"""Layer 1: local dispatch ops (no communication) as XLA FFI custom calls.

Every op takes `impl="ffi"` (default: the CPU/CUDA handler) or `impl="xla"` (the pure-JAX
reference in `jax_ep.reference`); both give the same results, bitwise for integer outputs and
data movement. The LogFMT cast (logfmt_encode / logfmt_decode) is the exception: FFI only (its
float64 log2 / exp2 have no bitwise pure-XLA twin; tests/logfmt_model.py is its numpy model).
Arguments are checked at trace time and errors name the argument and the shape they got.
permute, unpermute, gather_rows, indices_to_multihot and grouped_matmul are differentiable
(`custom_vjp`: permute's backward is an unpermute and vice versa, gather_rows' an unpermute;
each backward is built from differentiable ops, so gradients of gradients work too; for
grouped_matmul with impl="ffi"). Notation: T tokens, H hidden, K top-k, E experts, P ranks,
L = E / P, N permuted rows.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _ffi, reference
from jax_ep._checks import (
    MAX_INT32,
    as_dtype,
    as_int32_ids,
    check_experts,
    check_flag,
    check_float,
    check_positive,
    check_rank,
    check_routing,
    check_rows,
    check_shape,
    check_weights,
    check_whole_bytes,
)
from jax_ep._index import group_bounds, search
from jax_ep.reference import SendLayout

__all__ = [
    "SendLayout",
    "block_ladder",
    "block_matmul",
    "build_send_layout",
    "check_grouped_operands",
    "compute_send_counts",
    "from_group_blocks",
    "gather_rows",
    "get_dispatch_layout",
    "group_block_choice",
    "group_rows",
    "grouped_matmul",
    "grouped_matmul_impl",
    "grouped_operands",
    "grouped_tile_rows",
    "indices_to_multihot",
    "logfmt_decode",
    "logfmt_encode",
    "logfmt_slot_bytes",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "permute",
    "switch_block_sizes",
    "tiled_grouped_matmul_grads",
    "to_group_blocks",
    "unpermute",
]

_IMPLS = ("ffi", "xla")


def _unit_weights(n):
    """f32[n] of ones: the weights of an unweighted unpermute (x * 1.0 is exact). FFI calls
    never get zero-sized operands: XLA:CPU (jax 0.11) crashes compiling them in shard_map."""
    return jnp.ones((n,), jnp.float32)


def _check_impl(impl: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _typed_like_ffi(outputs, *inputs):
    """The reference's outputs (a pytree) typed as the FFI call on `inputs` types its results:
    varying over every manual mesh axis an input varies over, inside shard_map. jax.numpy
    drops that type where it short-circuits (a scatter of zero updates returns its fresh
    zeros), and a custom_vjp backward then fails its type check."""
    inputs = [a for a in inputs if a is not None]
    return jax.tree.map(lambda out: _ffi.vary_like(out, *inputs), outputs)


# ----------------------------------------------------------------------------- layouts


def get_dispatch_layout(topk_idx, *, num_experts, num_ranks, impl="ffi"):
    """topk_idx [T,K] int (-1 = unrouted) -> (num_tokens_per_rank i32[P], is_token_in_rank
    bool[T,P], num_tokens_per_expert i32[E]). A token counts once per rank owning any of its
    experts; ranks own contiguous blocks of L = E / P experts. The CPU kernel raises on an id
    outside [-1, E) (the reference and the GPU kernel count it nowhere): inside shard_map, a
    raise on one rank leaves the others waiting in their next collective, so a layout meant
    for a dispatch comes from `jax_ep.Buffer.get_dispatch_layout` (which routes such ids
    nowhere, as the dispatch does) or from ids already checked."""
    _check_impl(impl)
    check_experts(num_experts, num_ranks)
    topk_idx, _ = check_routing(topk_idx, None, num_experts)
    if impl == "xla" or topk_idx.size == 0:
        return _typed_like_ffi(reference.get_dispatch_layout(
            topk_idx, num_experts=num_experts, num_ranks=num_ranks), topk_idx)
    per_rank, in_rank, per_expert, _ = _dispatch_layout_ffi(topk_idx, num_experts, num_ranks)
    return per_rank, in_rank, per_expert


def _dispatch_layout_ffi(topk_idx, num_experts, num_ranks):
    """FFI layout plus its i32[] count of expert ids outside [-1, E) (GPU; CPU raises)."""
    num_tokens = topk_idx.shape[0]
    results = (_sds((num_ranks,), jnp.int32), _sds((num_tokens, num_ranks), jnp.bool_),
               _sds((num_experts,), jnp.int32), _sds((), jnp.int32))
    return _ffi.call("jax_ep_dispatch_layout", results, topk_idx,
                     num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))


def compute_send_counts(topk_idx, num_ranks, num_local_experts, *, impl="ffi"):
    """topk_idx [T,K] int (global ids, -1 = unrouted) -> (dest i32[T,K], is_in_rank bool[T,P],
    send_counts i32[P]): the owning rank of each slot (-1 where unrouted), whether each token
    goes to each rank, and how many tokens each rank gets (a token once per rank). The counts
    come from the dispatch-layout kernel."""
    _check_impl(impl)
    check_positive(num_ranks, "num_ranks")
    check_positive(num_local_experts, "num_local_experts")
    num_experts = num_ranks * num_local_experts
    topk_idx, _ = check_routing(topk_idx, None, num_experts)
    if impl == "xla" or topk_idx.size == 0:
        return _typed_like_ffi(
            reference.compute_send_counts(topk_idx, num_ranks, num_local_experts), topk_idx)
    send_counts, is_in_rank, _, _ = _dispatch_layout_ffi(topk_idx, num_experts, num_ranks)
    return reference.slot_ranks(topk_idx, num_ranks, num_local_experts), is_in_rank, send_counts


def build_send_layout(topk_idx, topk_weights, *, num_ranks, num_local_experts, impl="ffi"):
    """topk_idx [T,K] (global ids), topk_weights [T,K] -> SendLayout with T*P rows: one per
    (token, owning rank), rank-major then token-ascending, padding rows -1 / 0."""
    return _send_layout(topk_idx, topk_weights, num_ranks, num_local_experts, impl,
                        any_top_k=False)


def build_forward_layout(recv_idx, recv_weights, *, num_ranks, num_local_experts, impl="ffi"):
    """build_send_layout of received rows, whose K slots hold ids of the P*L experts of this
    group or -1 (e.g. a two-hop forwarder's node-local ids: K may exceed P*L there)."""
    return _send_layout(recv_idx, recv_weights, num_ranks, num_local_experts, impl,
                        any_top_k=True)


def _send_layout(topk_idx, topk_weights, num_ranks, num_local_experts, impl, *, any_top_k):
    _check_impl(impl)
    check_positive(num_ranks, "num_ranks")
    check_positive(num_local_experts, "num_local_experts")
    num_experts = num_ranks * num_local_experts
    check_experts(num_experts, num_ranks)
    topk_idx, topk_weights = check_routing(topk_idx, topk_weights, num_experts,
                                           any_top_k=any_top_k, weights_required=True)
    if impl == "xla" or topk_idx.size == 0:
        return _typed_like_ffi(reference.build_send_layout(
            topk_idx, topk_weights, num_ranks=num_ranks, num_local_experts=num_local_experts),
            topk_idx, topk_weights)
    num_tokens, top_k = topk_idx.shape
    rows = num_tokens * num_ranks
    results = (_sds((rows,), jnp.int32), _sds((rows,), jnp.int32),
               _sds((rows, top_k), jnp.int32), _sds((rows, top_k), jnp.float32),
               _sds((num_ranks,), jnp.int32), _sds((), jnp.int32))
    out = _ffi.call("jax_ep_send_layout", results, topk_idx, topk_weights,
                    num_ranks=np.int64(num_ranks),
                    num_local_experts=np.int64(num_local_experts))
    return SendLayout(*out)


# ----------------------------------------------------------------------------- multihot


def indices_to_multihot(topk_idx, topk_probs, *, num_experts, impl="ffi"):
    """topk_idx [T,K], topk_probs [T,K] -> (routing_map bool[T,E], probs f32[T,E]).
    -1 slots are masked out; K may exceed E (NeMo's _indices_to_multihot of received rows:
    K slots, L local experts), and repeated ids sum their probs. The gradient to topk_probs
    is the dense gradient gathered at the indices (0 on -1 slots)."""
    _check_impl(impl)
    check_positive(num_experts, "num_experts")
    topk_idx, topk_probs = check_routing(topk_idx, topk_probs, num_experts, any_top_k=True,
                                         weights_name="topk_probs", weights_required=True)
    if impl == "xla" or topk_idx.size == 0:
        return _typed_like_ffi(reference.indices_to_multihot(
            topk_idx, topk_probs, num_experts=num_experts), topk_idx, topk_probs)
    return _multihot(*_ffi.vary_together(topk_idx, topk_probs), num_experts)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _multihot(topk_idx, topk_probs, num_experts):
    num_tokens = topk_idx.shape[0]
    results = (_sds((num_tokens, num_experts), jnp.bool_),
               _sds((num_tokens, num_experts), jnp.float32))
    return tuple(_ffi.call("jax_ep_indices_to_multihot", results, topk_idx, topk_probs,
                           num_experts=np.int64(num_experts)))


def _multihot_fwd(topk_idx, topk_probs, num_experts):
    return _multihot(topk_idx, topk_probs, num_experts), topk_idx


def _multihot_bwd(num_experts, topk_idx, cotangents):
    _, d_probs = cotangents
    picked = jnp.take_along_axis(d_probs, jnp.clip(topk_idx, 0, num_experts - 1), axis=1)
    return None, jnp.where(topk_idx >= 0, picked, 0.0)


_multihot.defvjp(_multihot_fwd, _multihot_bwd)


# ----------------------------------------------------------------------------- row movement


def gather_rows(x, row_idx, *, impl="ffi"):
    """x [S,...], row_idx i32[N] -> [N,...] with out[r] = x[row_idx[r]] and zero rows where
    row_idx is outside [0, S). The send-packing kernel. Differentiable in a float32 / bfloat16
    / float16 x (its VJP sums the cotangent rows back into x's rows: an unpermute, whose own
    VJP is this gather, so gradients of gradients work too)."""
    _check_impl(impl)
    check_rank(row_idx, 1, "row_idx")
    check_rows(x, "x")
    x = jnp.asarray(x)  # a numpy array in JAX's dtype (float64 -> float32 without x64)
    check_whole_bytes(x, "x")
    row_idx = as_int32_ids(row_idx, x.shape[0], "row_idx")
    if impl == "xla":
        return _typed_like_ffi(reference.gather_rows(x, row_idx), x, row_idx)
    return _gather_rows_ffi(x, row_idx)


def _gather_rows_ffi(x, row_idx):
    if x.size == 0 or row_idx.size == 0:
        return _ffi.vary_like(jnp.zeros(row_idx.shape + x.shape[1:], x.dtype), x, row_idx)
    if x.dtype in _DIFFERENTIABLE_ROWS:
        # Inside shard_map x is typed as varying like row_idx first (a table replicated over
        # axes the ids vary over gets its cotangent summed over them by that cast's VJP).
        x, row_idx = _ffi.vary_together(x, row_idx)
        return _gathered_rows(x, row_idx, x.shape[0])
    return _gather_rows_call(x, row_idx)


# Row dtypes whose gather has a VJP (the unpermute kernel's dtypes); others (FP8 codes, int
# scales) are moved, not differentiated.
_DIFFERENTIABLE_ROWS = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


def _gather_rows_call(x, row_idx):
    return _ffi.call("jax_ep_gather_rows", _sds(row_idx.shape + x.shape[1:], x.dtype), x,
                     row_idx)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gathered_rows(x, row_idx, num_src):
    del num_src  # x.shape[0], static for the backward
    return _gather_rows_call(x, row_idx)


def _gathered_rows_fwd(x, row_idx, num_src):
    return _gathered_rows(x, row_idx, num_src), row_idx


def _gathered_rows_bwd(num_src, row_idx, d_out):
    """Each cotangent row summed into the x row it was read from (rows read from outside x
    add nothing): unpermute with unit weights over the flattened rows."""
    ids = jnp.where((row_idx >= 0) & (row_idx < num_src), row_idx, -1)
    rows = d_out.reshape(d_out.shape[0], -1)
    d_x = _unpermute_unweighted(rows, ids, num_src)
    return d_x.reshape((num_src,) + d_out.shape[1:]), None


_gathered_rows.defvjp(_gathered_rows_fwd, _gathered_rows_bwd)


def permute(tokens, routing_map, probs=None, *, num_out_tokens, pad_multiple=None,
            drop_and_pad=False, impl="ffi", return_num_dropped=False):
    """Expert-major permutation of tokens [T,H] by routing_map bool[T,E].

    Returns (permuted [N,H], permuted_probs f32[N] | None, sorted_indices i32[N],
    tokens_per_expert i32[E]) with N = num_out_tokens, token-ascending inside each expert.
    pad_multiple=m pads every expert block with zero rows to a multiple of m (tokens_per_expert
    reports padded sizes). drop_and_pad gives every expert exactly c = N // E rows (rounded
    down to a multiple of m) holding its first c tokens. Rows past the last block are padding
    (zero, sorted_indices -1, prob 0). Tokens that fit nowhere are dropped (the later experts'
    last tokens first; a block cut by the end of the buffer keeps a whole multiple of m rows)
    and the count of dropped (token, expert) pairs is appended to the result with
    return_num_dropped=True.
    """
    _check_impl(impl)
    check_rank(tokens, 2, "tokens")
    check_float(tokens, "tokens")
    check_rank(routing_map, 2, "routing_map")
    if routing_map.dtype != jnp.bool_:
        raise ValueError(f"routing_map: expected bool, got {routing_map.dtype}")
    if routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing_map: expected {tokens.shape[0]} rows to match tokens "
                         f"{tokens.shape}, got shape {routing_map.shape}")
    drop_and_pad = check_flag(drop_and_pad, "drop_and_pad")
    return_num_dropped = check_flag(return_num_dropped, "return_num_dropped")
    if drop_and_pad and routing_map.shape[1] == 0:
        raise ValueError("routing_map: drop_and_pad needs at least one expert (capacity "
                         f"num_out_tokens // E), got shape {routing_map.shape}")
    if probs is not None:
        probs = check_weights(probs, routing_map.shape, "probs")
    num_out_tokens = check_positive(num_out_tokens, "num_out_tokens", allow_zero=True,
                                    upper=MAX_INT32)
    pad = 0 if pad_multiple is None else check_positive(pad_multiple, "pad_multiple",
                                                        upper=MAX_INT32)
    if impl == "xla" or tokens.size == 0 or routing_map.size == 0 or num_out_tokens == 0:
        out = reference.permute(tokens, routing_map, probs, num_out_tokens=num_out_tokens,
                                pad_multiple=pad_multiple, drop_and_pad=drop_and_pad)
        if return_num_dropped:
            _, _, dropped = reference.permute_plan(
                routing_map, num_out_tokens=num_out_tokens, pad_multiple=pad_multiple,
                drop_and_pad=drop_and_pad)
            out = out + (dropped,)
        return _typed_like_ffi(out, tokens, routing_map, probs)
    has_probs = probs is not None
    # one type for the operands inside shard_map: the custom_vjp's cotangents take it, and a
    # replicated operand gets its cotangent summed over the axes by the cast's transpose
    tokens, routing_map, probs = _ffi.vary_together(
        tokens, routing_map, probs if has_probs else jnp.zeros(routing_map.shape, jnp.float32))
    permuted, permuted_probs, sorted_indices, tokens_per_expert, dropped = _permute(
        tokens, routing_map, probs, num_out_tokens, pad, bool(drop_and_pad), has_probs)
    out = (permuted, permuted_probs if has_probs else None, sorted_indices, tokens_per_expert)
    return out + (dropped,) if return_num_dropped else out


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _permute(tokens, routing_map, probs, num_out_tokens, pad_multiple, drop_and_pad, has_probs):
    num_experts = routing_map.shape[1]
    n = num_out_tokens
    results = (_sds((n,) + tokens.shape[1:], tokens.dtype), _sds((n,), jnp.float32),
               _sds((n,), jnp.int32), _sds((num_experts,), jnp.int32), _sds((), jnp.int32))
    del has_probs  # zero probs stand in for none; the caller drops permuted_probs
    return tuple(_ffi.call("jax_ep_permute", results, tokens, routing_map, probs,
                           pad_multiple=np.int64(pad_multiple), drop_and_pad=drop_and_pad))


def _permute_fwd(tokens, routing_map, probs, num_out_tokens, pad_multiple, drop_and_pad,
                 has_probs):
    out = _permute(tokens, routing_map, probs, num_out_tokens, pad_multiple, drop_and_pad,
                   has_probs)
    _, _, sorted_indices, tokens_per_expert, _ = out
    return out, (sorted_indices, tokens_per_expert, routing_map)


def _permute_bwd(num_out_tokens, pad_multiple, drop_and_pad, has_probs, residuals, cotangents):
    sorted_indices, tokens_per_expert, routing_map = residuals
    d_permuted, d_permuted_probs = cotangents[0], cotangents[1]
    num_tokens = routing_map.shape[0]
    d_tokens = _unpermute_unweighted(d_permuted, sorted_indices, num_tokens)
    if not has_probs:
        return d_tokens, None, _ffi.vary_like(jnp.zeros(routing_map.shape, jnp.float32),
                                              routing_map)
    # Row r of the permuted buffer belongs to the expert whose block contains it.
    row_expert = search(jnp.cumsum(tokens_per_expert), jnp.arange(num_out_tokens))
    token = jnp.where(sorted_indices >= 0, sorted_indices, num_tokens)
    d_probs = jnp.zeros(routing_map.shape, jnp.float32)
    return d_tokens, None, d_probs.at[token, row_expert].add(d_permuted_probs, mode="drop")


_permute.defvjp(_permute_fwd, _permute_bwd)


def unpermute(permuted, sorted_indices, *, num_tokens, probs=None, impl="ffi"):
    """permuted [N,H], sorted_indices i32[N] -> [num_tokens,H]: out[t] = sum over rows r with
    sorted_indices[r] == t of permuted[r] * probs[r], fp32 accumulation in ascending row order,
    cast back to permuted.dtype; -1 rows are ignored. Differentiable in permuted and probs."""
    _check_impl(impl)
    check_rank(permuted, 2, "permuted")
    check_float(permuted, "permuted")
    check_shape(sorted_indices, (permuted.shape[0],), "sorted_indices")
    num_tokens = check_positive(num_tokens, "num_tokens", allow_zero=True, upper=MAX_INT32)
    sorted_indices = as_int32_ids(sorted_indices, num_tokens, "sorted_indices")
    if probs is not None:
        probs = check_weights(probs, (permuted.shape[0],), "probs")
    if impl == "xla":
        return _typed_like_ffi(reference.unpermute(
            permuted, sorted_indices, num_tokens=num_tokens, probs=probs),
            permuted, sorted_indices, probs)
    if probs is None:
        return _unpermute_unweighted(*_ffi.vary_together(permuted, sorted_indices), num_tokens)
    return _unpermute_weighted(*_ffi.vary_together(permuted, sorted_indices, probs), num_tokens)


def _unpermute_ffi(permuted, sorted_indices, probs, num_tokens):
    if num_tokens == 0 or permuted.size == 0:
        return _ffi.vary_like(jnp.zeros((num_tokens,) + permuted.shape[1:], permuted.dtype),
                              permuted, sorted_indices, probs)
    results = _sds((num_tokens,) + permuted.shape[1:], permuted.dtype)
    return _ffi.call("jax_ep_unpermute", results, permuted, sorted_indices, probs)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _unpermute_unweighted(permuted, sorted_indices, num_tokens):
    return _unpermute_ffi(permuted, sorted_indices, _unit_weights(permuted.shape[0]), num_tokens)


def _unpermute_unweighted_fwd(permuted, sorted_indices, num_tokens):
    out = _unpermute_unweighted(permuted, sorted_indices, num_tokens)
    return out, sorted_indices


def _unpermute_unweighted_bwd(num_tokens, sorted_indices, d_out):
    return _gather_rows_ffi(d_out, sorted_indices), None


_unpermute_unweighted.defvjp(_unpermute_unweighted_fwd, _unpermute_unweighted_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unpermute_weighted(permuted, sorted_indices, probs, num_tokens):
    return _unpermute_ffi(permuted, sorted_indices, probs, num_tokens)


def _unpermute_weighted_fwd(permuted, sorted_indices, probs, num_tokens):
    out = _unpermute_weighted(permuted, sorted_indices, probs, num_tokens)
    return out, (permuted, sorted_indices, probs)


def _unpermute_weighted_bwd(num_tokens, residuals, d_out):
    permuted, sorted_indices, probs = residuals
    d_rows = _gather_rows_ffi(d_out, sorted_indices).astype(jnp.float32)
    d_permuted = (d_rows * probs[:, None]).astype(permuted.dtype)
    d_probs = (d_rows * permuted.astype(jnp.float32)).sum(axis=-1)
    return d_permuted, None, d_probs


_unpermute_weighted.defvjp(_unpermute_weighted_fwd, _unpermute_weighted_bwd)


# ----------------------------------------------------------------------------- FP8


def per_token_cast_to_fp8(x, *, round_scale=False, use_ue8m0=False, impl="ffi"):
    """x [T,H] f32/bf16/f16 -> (x_fp8 float8_e4m3fn[T,H], scales): per token and 128 channels,
    scale_inv = max(1e-4, amax) / 448 (next power of two with round_scale); scales f32[T,G],
    G = ceil(H/128), or with use_ue8m0 (requires round_scale) exponent bytes packed
    i32[T,ceil(G/4)] (i32[T,H/512] when H % 512 == 0). Any H: x is zero-padded to whole
    128-channel blocks, cast, and the codes sliced back to H, as in DeepEP's tests/utils.py.
    Differentiable straight through, in both modes and on both impls: the rounding counts as
    exact and the scales as constants, so the tangent (and cotangent) of x_fp8 is that of x
    divided by each channel's scale, in float8_e4m3fn (NaN in a block holding an inf or NaN),
    and the scales get none. A cast and per_token_cast_back then give d x = e4m3(g * scale) /
    scale: g up to that rounding (`dispatch(use_fp8=True, fp8_output="cast_back")` passes its
    cotangent through exactly)."""
    _check_impl(impl)
    check_rank(x, 2, "x")
    check_float(x, "x")
    round_scale = check_flag(round_scale, "round_scale")
    use_ue8m0 = check_flag(use_ue8m0, "use_ue8m0")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0: requires round_scale=True (UE8M0 scales are powers of two)")
    return _cast_to_fp8(x, round_scale, use_ue8m0, impl)


@partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _cast_to_fp8(x, round_scale, use_ue8m0, impl):
    if impl == "xla":
        return _typed_like_ffi(reference.per_token_cast_to_fp8(
            x, round_scale=round_scale, use_ue8m0=use_ue8m0), x)
    num_tokens, hidden = x.shape
    width = reference.fp8_scale_width(hidden, use_ue8m0)
    scales = _sds((num_tokens, width), jnp.int32 if use_ue8m0 else jnp.float32)
    if x.size == 0:
        return _typed_like_ffi((jnp.zeros(x.shape, jnp.float8_e4m3fn),
                                jnp.zeros(scales.shape, scales.dtype)), x)
    padded = reference.pad_to_fp8_blocks(x)
    results = (_sds(padded.shape, jnp.float8_e4m3fn), scales)
    codes, scales = _ffi.call("jax_ep_cast_to_fp8", results, padded, round_scale=bool(round_scale),
                              use_ue8m0=bool(use_ue8m0))
    return codes[:, :hidden], scales


@_cast_to_fp8.defjvp
def _cast_to_fp8_jvp(round_scale, use_ue8m0, impl, primals, tangents):
    (x,), (t,) = primals, tangents
    codes, scales = _cast_to_fp8(x, round_scale, use_ue8m0, impl)
    num_tokens, hidden = codes.shape
    block_scale = reference.fp8_block_scales(scales, num_tokens, hidden, use_ue8m0=use_ue8m0)
    block_scale = jnp.where(jnp.isinf(block_scale), jnp.nan, block_scale)  # poisoned: NaN
    scale = jnp.repeat(block_scale, reference.FP8_BLOCK, axis=1)[:, :hidden]  # per channel
    d_codes = (t.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
    d_scales = (np.zeros(scales.shape, jax.dtypes.float0) if use_ue8m0
                else jnp.zeros(scales.shape, scales.dtype))
    return (codes, scales), (d_codes, d_scales)


def _fp8_scale_rows(scales, num_tokens, hidden, use_ue8m0):
    """The scales of a cast back of x_fp8 [T, hidden], in any shape holding their T*W elements
    (DeepEP's utils view them as [T, -1]) -> (scales [T,W], whether they are packed UE8M0).
    int32 scales are packed UE8M0 even without use_ue8m0 (DeepEP's per_token_cast_back reads
    them so): W = ceil(G/4), G = ceil(hidden/128); float scales become f32 [T,G]."""
    if not hasattr(scales, "dtype"):
        raise ValueError(f"scales: expected an array, got {type(scales).__name__}")
    is_int32 = jnp.dtype(scales.dtype) == jnp.dtype(jnp.int32)
    packed = bool(use_ue8m0) or is_int32
    if packed and not is_int32:
        raise ValueError(f"scales: use_ue8m0=True expects packed UE8M0 int32 scales, got "
                         f"{scales.dtype}")
    if not packed and not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"scales: expected float scales or packed UE8M0 int32 scales, got "
                         f"{scales.dtype}")
    width = reference.fp8_scale_width(hidden, packed)
    if jnp.size(scales) != num_tokens * width:
        kind = "packed UE8M0 int32" if packed else "float"
        raise ValueError(f"scales: expected {num_tokens * width} {kind} scales ([{num_tokens}, "
                         f"{width}] for x_fp8 of shape ({num_tokens}, {hidden})), got shape "
                         f"{tuple(jnp.shape(scales))}")
    rows = jnp.reshape(scales, (num_tokens, width))
    return (rows if packed else rows.astype(jnp.float32)), packed


def per_token_cast_back(x_fp8, scales, *, use_ue8m0=False, dtype=jnp.bfloat16, impl="ffi"):
    """Inverse of per_token_cast_to_fp8: x_fp8 float8_e4m3fn[T,H] (any H), scales -> [T,H]
    `dtype`. scales: f32 [T,G] or packed UE8M0 i32 [T,ceil(G/4)], G = ceil(H/128), in any shape
    with that many elements; int32 scales are UE8M0 even with use_ue8m0=False (DeepEP's rule).
    Differentiable (both impls): d x_fp8 = g * scale (in float8_e4m3fn), d scales = the sum of
    g * x_fp8 over each 128-channel group (f32); integer UE8M0 scales get no cotangent."""
    _check_impl(impl)
    check_rank(x_fp8, 2, "x_fp8")
    use_ue8m0 = check_flag(use_ue8m0, "use_ue8m0")
    if x_fp8.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"x_fp8: expected float8_e4m3fn, got {x_fp8.dtype}")
    num_tokens, hidden = x_fp8.shape
    scales, use_ue8m0 = _fp8_scale_rows(scales, num_tokens, hidden, use_ue8m0)
    if as_dtype(dtype, "dtype") not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                        jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    if impl == "xla":
        return _typed_like_ffi(reference.per_token_cast_back(
            x_fp8, scales, use_ue8m0=use_ue8m0, dtype=dtype), x_fp8, scales)
    if x_fp8.size == 0:
        return _ffi.vary_like(jnp.zeros(x_fp8.shape, dtype), x_fp8, scales)
    x_fp8, scales = _ffi.vary_together(reference.pad_to_fp8_blocks(x_fp8), scales)
    out = _cast_back(x_fp8, scales, use_ue8m0, jnp.dtype(dtype))
    return out[:, :hidden]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cast_back(x_fp8, scales, use_ue8m0, dtype):
    return _ffi.call("jax_ep_cast_back", _sds(x_fp8.shape, dtype), x_fp8, scales,
                     use_ue8m0=use_ue8m0)


def _cast_back_fwd(x_fp8, scales, use_ue8m0, dtype):
    return _cast_back(x_fp8, scales, use_ue8m0, dtype), (x_fp8, scales)


def _cast_back_bwd(use_ue8m0, dtype, saved, g):
    # The cast back is x_fp8 * scale per 128 channels: the reference's VJP is exact (the
    # cotangent of x_fp8 is rounded to float8_e4m3fn, its dtype; UE8M0 scales are integers
    # and get none).
    _, vjp = jax.vjp(partial(reference.per_token_cast_back, use_ue8m0=use_ue8m0, dtype=dtype),
                     *saved)
    return vjp(g)


_cast_back.defvjp(_cast_back_fwd, _cast_back_bwd)


# ----------------------------------------------------------------------------- LogFMT

LOGFMT_HIDDEN_MULTIPLE = 512  # DeepEP's combine: hidden % (32 lanes * 2 unrolls * 8) == 0


def logfmt_slot_bytes(hidden):
    """Bytes of one LogFMT slot of a row of `hidden` channels: 2H + 4 * H/128 (DeepEP's
    combine slot: the bf16 row plus one (amax, amin) bf16 pair per 128 channels)."""
    return 2 * hidden + 4 * (hidden // 128)


def _check_logfmt_hidden(hidden, name):
    if hidden <= 0 or hidden % LOGFMT_HIDDEN_MULTIPLE:
        raise ValueError(f"{name}: hidden size {hidden} must be a positive multiple of "
                         f"{LOGFMT_HIDDEN_MULTIPLE} for LogFMT (DeepEP's combine requires it)")


def logfmt_encode(x):
    """DeepEP's LogFMT-10 combine encoding (xla_ffi/logfmt.h has the format), FFI only.

    x: bf16 [N, H], H % 512 == 0 -> wire uint8 [N, 2H + H/32], one slot per row as DeepEP's
    combine sends it: an (amax, amin) bf16 pair of |x| per 128 channels, then each chunk of
    1024 channels (512 when H % 1024 != 0) either packed, 10 bits a value (9-bit log code +
    sign; when every 128 channels of the chunk have amax < 1 and amin < amax), or raw bf16,
    then zeros. Chunks holding a NaN or an inf go raw. Not differentiable (integer output).
    """
    check_rank(x, 2, "x")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bfloat16 for LogFMT, got {x.dtype}")
    num_rows, hidden = x.shape
    _check_logfmt_hidden(hidden, "x")
    out = _sds((num_rows, logfmt_slot_bytes(hidden)), jnp.uint8)
    if num_rows == 0:
        return _ffi.vary_like(jnp.zeros(out.shape, out.dtype), x)
    return _ffi.call("jax_ep_logfmt_encode", out, x)


def _logfmt_hidden(slot_bytes):
    """H of a LogFMT slot of `slot_bytes` bytes (inverse of logfmt_slot_bytes), or None."""
    hidden = slot_bytes * 32 // 65
    return hidden if hidden > 0 and logfmt_slot_bytes(hidden) == slot_bytes else None


def logfmt_decode(wire, *, dtype=jnp.float32):
    """Inverse of logfmt_encode, FFI only: wire uint8 [N, 2H + H/32] -> [N, H] `dtype`
    (float32: each packed value 2^((code-1)*step + lb) rounded once from float64, raw chunks
    exact; bfloat16: that float32 rounded to bf16). Not differentiable."""
    check_rank(wire, 2, "wire")
    if wire.dtype != jnp.uint8:
        raise ValueError(f"wire: expected uint8, got {wire.dtype}")
    hidden = _logfmt_hidden(wire.shape[1])
    if hidden is None or hidden % LOGFMT_HIDDEN_MULTIPLE:
        raise ValueError(f"wire: got shape {wire.shape}; its rows must be 2H + H/32 bytes "
                         f"with H a positive multiple of {LOGFMT_HIDDEN_MULTIPLE}")
    if as_dtype(dtype, "dtype") not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype: expected float32 or bfloat16, got {dtype}")
    out = _sds((wire.shape[0], hidden), dtype)
    if wire.shape[0] == 0:
        return _ffi.vary_like(jnp.zeros(out.shape, out.dtype), wire)
    return _ffi.call("jax_ep_logfmt_decode", out, wire)


# ----------------------------------------------------------------------------- grouped GEMM

GROUPED_MATMUL_IMPLS = ("auto", "ffi", "tiled", "blocks", "ragged_dot")
# Rows per tile of the tiled grouped GEMM, measured on XLA:CPU (bench_moe --tile-rows, the
# layer's experts on 8 emulated devices, H = F = 256, 32-128 routed rows per expert): 64 was
# the fastest or within 4% of it; 32 lost up to 40%, 128 up to 33%. Smaller tiles waste
# fewer rows where a tile straddles a group boundary, larger ones pay the loop's
# per-iteration cost less often.
GROUPED_MATMUL_TILE_ROWS = 64


def grouped_tile_rows(tile_rows):
    """The tiled grouped GEMM's rows per tile: tile_rows checked positive, or
    GROUPED_MATMUL_TILE_ROWS when it is None."""
    return GROUPED_MATMUL_TILE_ROWS if tile_rows is None else check_positive(
        tile_rows, "tile_rows", upper=MAX_INT32)


# XLA:GPU has no grouped kernel for ragged_dot: its RaggedDotRewriter
# (xla/hlo/transforms/expanders/ragged_dot_rewriter.cc) turns each call into a dense dot over
# the operand broadcast to every group and masked, G times the multiply-adds and an [N, G, K]
# temporary (jax's own lowering on XLA:CPU does the same). On the H200 that cost less than the
# tiled loop at 8 groups (8192 rows, H 2048, F 1408: 74 TFLOP/s of routed work against 20)
# and twice as much at 32 (32768 rows, H 7168, F 2048: 23.5 against 47); at 256 groups the
# layer's step asked for 64 GiB. "auto" takes it on GPUs for at most this many groups, while
# the broadcast operand stays within the byte bound below, and "tiled" otherwise.
GPU_RAGGED_DOT_MAX_GROUPS = 8
GPU_RAGGED_DOT_MAX_BYTES = 2 << 30


def grouped_matmul_impl(impl, dtype=None, *, num_rows=None, w_shape=None):
    """impl checked against GROUPED_MATMUL_IMPLS, "auto" resolved for the platform of the
    enclosing mesh (else the default backend): on CPU "ffi" (the CPU handler), "tiled" for a
    float64 `dtype` (the operands' promoted dtype; the handler computes in float32); on TPU
    "ragged_dot"; on GPUs "ragged_dot" where XLA's dense expansion of it is cheap (w_shape
    [G, K, F] with G <= GPU_RAGGED_DOT_MAX_GROUPS and num_rows * G * max(K, F) elements of
    `dtype` within GPU_RAGGED_DOT_MAX_BYTES), else "tiled" (also where num_rows or w_shape is
    not given). "ffi" on another platform or for float64 is refused: the handler is CPU
    only."""
    if impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"impl: expected one of {GROUPED_MATMUL_IMPLS}, got {impl!r}")
    platform = _ffi.trace_platform()
    if impl == "ffi" and platform != "cpu":
        raise ValueError(f"impl: 'ffi' is the grouped GEMM's CPU handler, this program runs on "
                         f"{platform}: use 'tiled', 'blocks' or 'ragged_dot' (or 'auto')")
    wide = dtype is not None and jnp.dtype(dtype).itemsize > 4
    if impl == "ffi" and wide:
        raise ValueError(f"impl: 'ffi' computes in float32, the operands are {jnp.dtype(dtype)}"
                         f": use 'tiled' (or 'auto')")
    if impl != "auto":
        return impl
    if platform == "cpu":
        return "tiled" if wide else "ffi"
    if platform == "tpu" or _dense_ragged_dot_is_cheap(dtype, num_rows, w_shape):
        return "ragged_dot"
    return "tiled"


def _dense_ragged_dot_is_cheap(dtype, num_rows, w_shape):
    """Whether XLA:GPU's dense expansion of ragged_dot over rows [num_rows, K] and w [G,K,F]
    stays within GPU_RAGGED_DOT_MAX_GROUPS groups and GPU_RAGGED_DOT_MAX_BYTES of broadcast
    operand (the widest of its forward and backward products)."""
    if num_rows is None or w_shape is None or len(w_shape) != 3:
        return False
    groups, depth, width = w_shape
    itemsize = jnp.dtype(jnp.float32 if dtype is None else dtype).itemsize
    expanded = num_rows * groups * max(depth, width) * itemsize
    return groups <= GPU_RAGGED_DOT_MAX_GROUPS and expanded <= GPU_RAGGED_DOT_MAX_BYTES


def check_grouped_operands(x, w, group_sizes, w_name="w", x_name="x",
                           sizes_name="group_sizes"):
    """grouped_matmul's operand checks: x float [N,H], w float [G,H,F], group_sizes integer
    [G]; a ValueError naming the argument (the caller's names for them) otherwise."""
    check_rank(x, 2, x_name)
    check_float(x, x_name)
    check_rank(w, 3, w_name)
    check_float(w, w_name)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{w_name}: expected [G, H={x.shape[1]}, F] to match {x_name} "
                         f"{x.shape}, got shape {w.shape}")
    check_shape(group_sizes, (w.shape[0],), sizes_name)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{sizes_name}: expected an integer dtype, got {group_sizes.dtype}")


def grouped_operands(arrays, group_sizes):
    """(*arrays, group_sizes) ready for the grouped GEMMs: the float arrays cast to their
    promoted dtype, group_sizes to int32, and all typed as varying over the union of their
    mesh axes inside shard_map (weights replicated over a data axis the tokens vary over: AD
    then sums the weights' gradients over that axis, as it does for ragged_dot)."""
    dtype = jnp.result_type(*arrays)
    return _ffi.vary_together(*(a.astype(dtype) for a in arrays),
                              int32_group_sizes(group_sizes, arrays[0].shape[0]))


def align_up(counts, alignment, name="expert_alignment"):
    """i32 counts rounded up to multiples of `alignment` (an int in [1, 2^31 - 1], else
    ValueError naming `name`), with no int32 overflow: a count whose multiple would pass
    2^31 - 1 gets the largest multiple that fits."""
    align = check_positive(alignment, name, upper=MAX_INT32)
    quotient = counts // align + (counts % align != 0).astype(counts.dtype)
    most = MAX_INT32 // align
    return jnp.where(quotient > most, most, quotient) * align


def int32_group_sizes(group_sizes, num_rows):
    """Integer group sizes as int32, each clipped to [0, num_rows] first, so a size of a wider
    or unsigned dtype (3e9 as uint32, 2^32 + 1 as int64) cannot wrap: the sum is then cut at
    num_rows as for any other sizes."""
    if jnp.iinfo(group_sizes.dtype).max > jnp.iinfo(jnp.int32).max:
        group_sizes = jnp.clip(group_sizes, 0, num_rows)
    return group_sizes.astype(jnp.int32)


def block_matmul(spec, a, w):
    """jnp.einsum(spec, a, w) accumulated in float32, returned in a's dtype: the batched GEMM
    over [G, C, ...] group blocks."""
    return jnp.einsum(spec, a, w, preferred_element_type=jnp.float32).astype(a.dtype)


def grouped_matmul(x, w, group_sizes, *, impl="auto", tile_rows=None):
    """Grouped GEMM with the semantics of `jax.lax.ragged_dot`: x [N,H] rows in consecutive
    groups of group_sizes i32[G] rows, w [G,H,F] (float32, bfloat16 or float16; float64 is
    refused, as the products accumulate in float32) -> [N,F] in the promoted dtype of x and w
    (fp32 accumulation; every impl, ragged_dot included, computes in that dtype; "ffi" in
    float32),
    out[r] = x[r] @ w[g] for the rows r of group g; rows past sum(group_sizes) are zero (a sum
    above N is cut at N; negative sizes count as 0). Differentiable in x and w.

    impl="tiled": x is cut into tiles of `tile_rows` rows (default GROUPED_MATMUL_TILE_ROWS)
    and a while loop visits only the (tile, group) pairs that hold rows of the group, at most
    ceil(N / tile_rows) + G - 1 of them, so the work is about (sum(group_sizes) + G * tile_rows)
    * H * F multiply-adds, not G * N * H * F as XLA:CPU's lowering of ragged_dot (a dense
    matmul over every group). Its backward runs the same loop: dx = grouped_matmul(dy, w^T),
    dw[g] = x_g^T dy_g.
    impl="blocks": every group is gathered into a block of C rows (zero rows past the group),
    C the smallest size of a static ladder (8 * 2^(j/2) rounded up to 8, up to ceil(N/G))
    that holds the largest group, and the [G, C, H] blocks go through one batched GEMM; a
    `lax.switch` over the ladder picks C at run time (on each device, no collective), and a
    largest group above ceil(N/G) takes the tiled loop, as do blocks holding more than
    BLOCKS_MAX_WORK times the grouped rows plus BLOCK_MIN_ROWS per group (a lopsided step).
    No row is dropped; the work is G * C * H * F multiply-adds at the batched GEMM's rate, with
    no loop step per tile. Its backward picks the same C: dx from dy's blocks times w^T, dw[g]
    from x's and dy's blocks.
    impl="ffi": the CPU handler (xla_ffi/grouped_gemm.cc): each group's exact rows times its
    matrix in register tiles, float32 inside (other dtypes cast in and out), on XLA's intra-op
    pool; its backward is two more handler calls, dx = dy times each w^T and
    dw[g] = x_g^T dy_g. CPU only.
    impl="ragged_dot": jax.lax.ragged_dot (on GPUs XLA expands it to a dense dot over every
    group: G times the work). impl="auto": see grouped_matmul_impl ("ffi" on CPU, "ragged_dot"
    on TPU, and on GPUs "ragged_dot" for at most GPU_RAGGED_DOT_MAX_GROUPS groups, "tiled"
    beyond).
    Works under jit, vmap and inside shard_map (under vmap the switch runs every branch).
    """
    check_grouped_operands(x, w, group_sizes)
    impl = grouped_matmul_impl(impl, jnp.result_type(x, w), num_rows=x.shape[0],
                               w_shape=w.shape)
    tile = grouped_tile_rows(tile_rows)
    if impl == "ragged_dot":
        dtype = jnp.result_type(x, w)
        # the sizes cut first: ragged_dot's own int32 running sum wraps past 2^31
        starts, ends = group_bounds(group_sizes, x.shape[0])
        return jax.lax.ragged_dot(x.astype(dtype), w.astype(dtype), ends - starts)
    x, w, group_sizes = grouped_operands((x, w), group_sizes)
    if x.size == 0 or w.size == 0:
        return _ffi.vary_like(jnp.zeros((x.shape[0], w.shape[2]), x.dtype), x, w, group_sizes)
    if impl == "ffi":
        return _ffi_gmm(x, w, group_sizes)
    if impl == "blocks":
        return _blocks_gmm(x, w, group_sizes, block_ladder(x.shape[0], w.shape[0]), tile)
    return _tiled_gmm(x, w, group_sizes, tile)


def _ffi_product(x, w, group_sizes, transpose_w=False):
    """The CPU handler's grouped GEMM: x [N,K] rows by group times w [G,K,F] (transpose_w: w
    [G,F,K], each group's transpose) -> [N,F] in x's dtype; float32 inside."""
    width = w.shape[1] if transpose_w else w.shape[2]
    out = _ffi.call("jax_ep_grouped_gemm",
                    jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32),
                    x.astype(jnp.float32), w.astype(jnp.float32), group_sizes,
                    transpose_rhs=transpose_w, cuda_twin=False)
    return out.astype(x.dtype)


def _ffi_weight_grad(x, dy, group_sizes):
    """dw f32[G,K,F]: dw[g] = x_g^T dy_g over the rows of group g of x [N,K] and dy [N,F], by
    the CPU handler."""
    shape = (group_sizes.shape[0], x.shape[1], dy.shape[1])
    return _ffi.call("jax_ep_grouped_gemm_dw", jax.ShapeDtypeStruct(shape, jnp.float32),
                     x.astype(jnp.float32), dy.astype(jnp.float32), group_sizes,
                     cuda_twin=False)


# The handler's three products, each the others' VJP (so gradients of gradients work): per
# group g, _ffi_gmm: x @ w[g]; _ffi_gmm_t: y @ w[g]^T; _ffi_gmm_dw: x_g^T @ y_g (float32).
# Each forward rule is the product itself (differentiable again) saving its operands.
def _saving_operands(product):
    return lambda *operands: (product(*operands), operands)


@jax.custom_vjp
def _ffi_gmm(x, w, group_sizes):
    return _ffi_product(x, w, group_sizes)


def _ffi_gmm_bwd(residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    return (_ffi_gmm_t(dy, w, group_sizes),
            _ffi_gmm_dw(x, dy, group_sizes).astype(w.dtype), None)


_ffi_gmm.defvjp(_saving_operands(_ffi_gmm), _ffi_gmm_bwd)


@jax.custom_vjp
def _ffi_gmm_t(y, w, group_sizes):
    return _ffi_product(y, w, group_sizes, transpose_w=True)


def _ffi_gmm_t_bwd(residuals, d_out):
    y, w, group_sizes = residuals
    d_out = d_out.astype(y.dtype)
    return (_ffi_gmm(d_out, w, group_sizes),
            _ffi_gmm_dw(d_out, y, group_sizes).astype(w.dtype), None)


_ffi_gmm_t.defvjp(_saving_operands(_ffi_gmm_t), _ffi_gmm_t_bwd)


@jax.custom_vjp
def _ffi_gmm_dw(x, y, group_sizes):
    return _ffi_weight_grad(x, y, group_sizes)


def _ffi_gmm_dw_bwd(residuals, d_w):
    x, y, group_sizes = residuals
    return (_ffi_gmm_t(y, d_w, group_sizes).astype(x.dtype),
            _ffi_gmm(x, d_w, group_sizes).astype(y.dtype), None)


_ffi_gmm_dw.defvjp(_saving_operands(_ffi_gmm_dw), _ffi_gmm_dw_bwd)


def _tile_visits(group_sizes, num_rows, tile):
    """The (tile, group) pairs that hold rows: (group i32[V], tile i32[V], num_visits i32[],
    starts i32[G], ends i32[G]) with V = ceil(num_rows / tile) + G - 1 static slots, the
    first num_visits used, group-major and tile-ascending."""
    num_groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    tiles = jnp.where(ends > starts, (ends + tile - 1) // tile - starts // tile, 0)
    visit_end = jnp.cumsum(tiles)
    num_slots = -(-num_rows // tile) + num_groups - 1
    v = jnp.arange(num_slots, dtype=jnp.int32)
    group = jnp.minimum(search(visit_end, v), num_groups - 1)
    tile_of = starts[group] // tile + v - (visit_end[group] - tiles[group])
    return group, tile_of, visit_end[-1], starts, ends


def _padded_rows(a, rows):
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def _gmm_loop(x, w, group_sizes, visits, tile, transpose_w):
    """out [N, F] (w [G,H,F]) or [N, H] (transpose_w: w^T per group) of the visited tiles
    (`visits`: _tile_visits of group_sizes), rows outside every group zero; fp32 accumulation,
    cast to x's dtype."""
    num_rows = x.shape[0]
    group, tile_of, num_visits, starts, ends = visits
    padded = -(-num_rows // tile) * tile
    xp = _padded_rows(x, padded)
    contract = ((1,), (1,)) if transpose_w else ((1,), (0,))
    width = w.shape[1] if transpose_w else w.shape[2]
    local_rows = jnp.arange(tile, dtype=jnp.int32)

    def body(i, out):
        g, r0 = group[i], tile_of[i] * tile
        xt = jax.lax.dynamic_slice_in_dim(xp, r0, tile)
        wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)
        yt = jax.lax.dot_general(xt, wg, (contract, ((), ())),
                                 preferred_element_type=jnp.float32)
        rows = r0 + local_rows
        inside = ((rows >= starts[g]) & (rows < ends[g]))[:, None]
        kept = jax.lax.dynamic_slice_in_dim(out, r0, tile)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(inside, yt.astype(out.dtype), kept), r0, 0)

    out = _ffi.vary_like(jnp.zeros((padded, width), x.dtype), x, w, group_sizes)
    out = jax.lax.fori_loop(0, num_visits, body, out)
    return out[:num_rows]


def _gmm_dw(x, dy, group_sizes, visits, num_groups, tile):
    """dw [G,H,F] f32: dw[g] = x_g^T dy_g over the visited tiles (0 for empty groups)."""
    num_rows = x.shape[0]
    group, tile_of, num_visits, starts, ends = visits
    padded = -(-num_rows // tile) * tile
    xp, dyp = _padded_rows(x, padded), _padded_rows(dy, padded)
    local_rows = jnp.arange(tile, dtype=jnp.int32)

    def body(i, dw):
        g, r0 = group[i], tile_of[i] * tile
        rows = r0 + local_rows
        inside = ((rows >= starts[g]) & (rows < ends[g]))[:, None]
        xt = jnp.where(inside, jax.lax.dynamic_slice_in_dim(xp, r0, tile), 0)
        dyt = jax.lax.dynamic_slice_in_dim(dyp, r0, tile)
        part = jax.lax.dot_general(xt, dyt, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        acc = jax.lax.dynamic_index_in_dim(dw, g, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(dw, acc + part[None], g, 0)

    dw = jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32)
    dw = _ffi.vary_like(dw, x, dy, group_sizes)
    return jax.lax.fori_loop(0, num_visits, body, dw)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x, w, group_sizes, tile):
    visits = _tile_visits(group_sizes, x.shape[0], tile)
    return _gmm_loop(x, w, group_sizes, visits, tile, transpose_w=False)


def _tiled_gmm_fwd(x, w, group_sizes, tile):
    return _tiled_gmm(x, w, group_sizes, tile), (x, w, group_sizes)


def _tiled_gmm_bwd(tile, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    visits = _tile_visits(group_sizes, x.shape[0], tile)
    dx = _gmm_loop(dy, w, group_sizes, visits, tile, transpose_w=True)
    dw = _gmm_dw(x, dy, group_sizes, visits, w.shape[0], tile).astype(w.dtype)
    return dx, dw, None


_tiled_gmm.defvjp(_tiled_gmm_fwd, _tiled_gmm_bwd)


def tiled_grouped_matmul_grads(x, w, group_sizes, dy, tile_rows=None):
    """The backward of grouped_matmul(x, w, group_sizes, impl="tiled") for the cotangent
    dy [N,F], without rerunning its forward: (dx [N,H] in x's dtype, dw [G,H,F] in w's), by
    the tiled loop. x, w and group_sizes as grouped_operands returns them (one float dtype,
    int32 sizes)."""
    tile = grouped_tile_rows(tile_rows)
    return _tiled_gmm_bwd(tile, (x, w, group_sizes), dy)[:2]


def block_ladder(num_rows, num_groups):
    """The block sizes C impl="blocks" chooses from: 8 * 2^(j/2) rounded up to a multiple of
    8, for j = 0, 1, ..., until ceil(num_rows / num_groups) (the last size): G blocks of the
    last size hold num_rows rows. The block chosen for a largest group of n rows holds
    C <= sqrt(2) * n + 8 rows (the rounding to 8 adds up to 7, the first size is 8), unless
    the step falls back to the tiled loop."""
    cap = max(-(-num_rows // num_groups), 1)
    sizes, j = [], 0
    while not sizes or sizes[-1] < cap:
        sizes.append(min(-(-math.ceil(8 * 2 ** (j / 2)) // 8) * 8, cap))
        j += 1
    return tuple(sorted(set(sizes)))


def to_group_blocks(x, starts, ends, capacity):
    """x [N,H] in consecutive groups [starts, ends) -> [G, C, H] blocks (C = capacity >= every
    group's size), block g = group g's rows, then zero rows."""
    offsets = jnp.arange(capacity, dtype=jnp.int32)
    rows = starts[:, None] + offsets[None, :]
    rows = jnp.where(rows < ends[:, None], rows, x.shape[0])  # past the end: filled with 0
    return jnp.take(x, rows.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(
        starts.shape[0], capacity, x.shape[1])


def from_group_blocks(blocks, starts, ends, num_rows):
    """to_group_blocks' inverse: blocks [G, C, F] -> [num_rows, F], rows outside every group 0."""
    num_groups, capacity, width = blocks.shape
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.minimum(search(ends, rows), num_groups - 1)
    src = jnp.where(rows < ends[-1], group * capacity + rows - starts[group],
                    num_groups * capacity)
    return jnp.take(blocks.reshape(-1, width), src, axis=0, mode="fill", fill_value=0)


def group_rows(values, group_sizes, num_rows):
    """Per-group values [G, F] -> [num_rows, F] for rows in consecutive groups of group_sizes
    i32[G] (cut at num_rows; negative sizes count as 0): each row of group g gets values[g],
    rows past the groups zeros (a grouped GEMM's per-group bias). Differentiable in values:
    the gradient of values[g] is the sum of its rows'."""
    _, ends = group_bounds(group_sizes, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.where(rows < ends[-1], search(ends, rows), values.shape[0])
    return jnp.take(values, group, axis=0, mode="fill", fill_value=0)


# impl="blocks" takes the tiled loop where its G blocks would hold more than this many times
# the grouped rows (plus BLOCK_MIN_ROWS per group): its work stays proportional to the rows.
BLOCKS_MAX_WORK = 3
BLOCK_MIN_ROWS = 8


def group_block_choice(group_sizes, num_rows, ladder):
    """impl="blocks"' lax.switch branch for group_sizes i32[G] over num_rows rows: the first
    ladder size C holding the largest group, or len(ladder) (the tiled loop) when none does or
    when G * C > BLOCKS_MAX_WORK * (rows in groups) + BLOCK_MIN_ROWS * G. Returns
    (index i32[], starts i32[G], ends i32[G])."""
    starts, ends = group_bounds(group_sizes, num_rows)
    sizes = jnp.asarray(ladder, jnp.int32)
    index = search(sizes, jnp.max(ends - starts), side="left")
    num_groups = group_sizes.shape[0]
    bound = BLOCKS_MAX_WORK * ends[-1] + BLOCK_MIN_ROWS * num_groups
    too_much = num_groups * sizes[jnp.minimum(index, len(ladder) - 1)] > bound
    return jnp.where(too_much, len(ladder), index), starts, ends


def switch_block_sizes(group_sizes, num_rows, ladder, blocks, fallback, *operands):
    """impl="blocks"' run-time choice, for grouped GEMMs over num_rows rows in consecutive
    groups of group_sizes i32[G]: blocks(C, starts, ends)(*operands) for the ladder size C
    that group_block_choice picks (starts, ends i32[G]: the groups' row bounds), or
    fallback(*operands) where it picks the tiled loop. One lax.switch branch per ladder size
    plus the fallback; every branch returns the same shapes and dtypes."""
    index, starts, ends = group_block_choice(group_sizes, num_rows, ladder)
    branches = [blocks(capacity, starts, ends) for capacity in ladder] + [fallback]
    return jax.lax.switch(index, branches, *operands)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocks_gmm(x, w, group_sizes, ladder, tile):
    def blocks(capacity, starts, ends):
        def product(x, w):
            y = block_matmul("gch,ghf->gcf", to_group_blocks(x, starts, ends, capacity), w)
            return from_group_blocks(y, starts, ends, x.shape[0])
        return product

    def tiled(x, w):
        return _tiled_gmm(x, w, group_sizes, tile)

    return switch_block_sizes(group_sizes, x.shape[0], ladder, blocks, tiled, x, w)


def _blocks_gmm_fwd(x, w, group_sizes, ladder, tile):
    return _blocks_gmm(x, w, group_sizes, ladder, tile), (x, w, group_sizes)


def _blocks_gmm_bwd(ladder, tile, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)

    def blocks(capacity, starts, ends):
        def grads(x, dy, w):
            xb, dyb = (to_group_blocks(a, starts, ends, capacity) for a in (x, dy))
            dxb = block_matmul("gcf,ghf->gch", dyb, w)
            dw = jnp.einsum("gch,gcf->ghf", xb, dyb, preferred_element_type=jnp.float32)
            return from_group_blocks(dxb, starts, ends, x.shape[0]), dw.astype(w.dtype)
        return grads

    def tiled(x, dy, w):
        return tiled_grouped_matmul_grads(x, w, group_sizes, dy, tile)

    dx, dw = switch_block_sizes(group_sizes, x.shape[0], ladder, blocks, tiled, x, dy, w)
    return dx, dw, None


_blocks_gmm.defvjp(_blocks_gmm_fwd, _blocks_gmm_bwd)

"""DeepEP normal-mode dispatch/combine over an expert mesh axis (backends "deepep", "alltoall",
"uccl_ep"), inside `jax.shard_map`.

Each token is sent once to every rank owning at least one of its experts. On the receiving
rank, rows are grouped by source rank ascending, source token ascending inside; recv_topk_idx
holds local expert ids (-1 for slots owned elsewhere, weight 0 there); R = num_worst_tokens
rows, the tail is padding (zero rows, -1 ids, 0 weights); rows past a per-destination
`capacity` or past R are dropped by their senders and counted. combine sums every returned copy of
a token (unweighted, fp32 accumulation). "deepep" (and its alias "uccl_ep") run the FFI
kernels for the send layout, row packing and the combine reduction; "alltoall" gives the same
results from XLA ops only. Gradients: dispatch's backward is a combine of the cotangents,
combine's backward is a dispatch replaying the forward handle.

Over a (node_axis, local_axis) pair the same calls run DeepEP's internode two hops (hop 1 over
the node axis, hop 2 over the local axis) with the flat result; the handle is then an
InternodeHandle. The plans and row paths, one hop or two, are `jax_ep.internode`'s (shared
with the hybridep mode).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from jax_ep import _ffi, internode, ops, transport as tp
from jax_ep._checks import (
    as_dtype,
    check_flag,
    check_float,
    check_fp8_dispatch,
    check_positive,
    check_rank,
    check_real,
    check_row_parts,
    check_routing,
    check_shape,
    check_weights,
    check_whole_bytes,
    unroute_invalid_experts,
)
from jax_ep.internode import DispatchHandle, InternodeHandle
from jax_ep.transport import BACKENDS, check_backend

__all__ = [
    "BACKENDS",
    "DROP_POLICIES",
    "DispatchHandle",
    "InternodeHandle",
    "capacity_from_factor",
    "chunk_bounds",
    "combine",
    "combine_with_bias",
    "dispatch",
    "dispatch_chunked_forward",
    "drop_to_expert_capacity",
    "expert_capacity",
    "top_per_expert",
]

DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens, top_k, num_experts, capacity_factor):
    """Megatron's get_capacity(T*K, E, factor): tokens each expert keeps from one rank's T
    tokens, ceil(T*K/E * factor)."""
    check_real(capacity_factor, "capacity_factor", positive=True)
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def capacity_from_factor(num_tokens, top_k, num_ranks, capacity_factor, num_experts=None):
    """Per-destination row bound once every expert keeps at most c = expert_capacity(...)
    tokens: a rank's L experts take at most L*c distinct tokens (and never more than T), so
    this bound drops nothing after drop_to_expert_capacity. num_experts defaults to P (L=1)."""
    if capacity_factor is None:
        return num_tokens
    num_experts = num_ranks if num_experts is None else num_experts
    c = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    return max(1, min(num_tokens, c * (num_experts // num_ranks)))


def top_per_expert(score, capacity):
    """score [T,E] -> bool[T,E]: each expert's (column's) `capacity` highest-scoring tokens,
    equal scores to the lower token index (Megatron's capacity mask; capacity <= T)."""
    _, top = jax.lax.top_k(score.T, capacity)  # [E,c]
    return jnp.zeros(score.T.shape, bool).at[jnp.arange(score.shape[1])[:, None], top].set(
        True).T


def drop_to_expert_capacity(routing_map, probs, *, capacity, drop_policy="probs"):
    """Megatron's router token drop on one rank's tokens: each expert keeps at most `capacity`
    of the tokens routed to it - those with the highest probs ("probs", Megatron's default;
    equal probs keep the lower token index) or its first ones in token order ("position").

    routing_map bool[T,E], probs f32[T,E] -> (routing_map, probs with the dropped (token,
    expert) pairs cleared, num_dropped i32[]).
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")
    capacity = check_positive(capacity, "capacity", allow_zero=True)
    num_tokens = routing_map.shape[0]
    if capacity >= num_tokens:
        return routing_map, probs, jnp.zeros((), jnp.int32)
    if drop_policy == "position":
        keep = routing_map & (jnp.cumsum(routing_map, axis=0, dtype=jnp.int32) <= capacity)
    else:
        keep = routing_map & top_per_expert(jnp.where(routing_map, probs, -jnp.inf), capacity)
    num_dropped = routing_map.sum(dtype=jnp.int32) - keep.sum(dtype=jnp.int32)
    return keep, jnp.where(keep, probs, 0.0).astype(probs.dtype), num_dropped


HANDLES = (DispatchHandle, InternodeHandle)


def _reduce_back_fp32(y, handle):
    """internode.reduce_back with the two-hop partial sums crossing the node axis in fp32."""
    return internode.reduce_back(y.astype(jnp.float32), handle).astype(y.dtype)


_combine_rows = tp.with_transpose(internode.reduce_back, internode.send_tokens, tp.COMBINE_NAME)
_combine_rows_fp32 = tp.with_transpose(_reduce_back_fp32, internode.send_tokens,
                                       tp.COMBINE_NAME)
_sent_rows = tp.with_transpose(internode.send_tokens, internode.reduce_back, tp.DISPATCH_NAME)
_sent_rows_fp8 = tp.with_fp8_wire(internode.send_tokens, internode.reduce_back)


@jax.custom_vjp
def _biased_rows(y, bias, handle):
    """internode.reduce_back(y, handle, bias) -> [T,...] in y.dtype: linear in y and in
    bias f32[T,...] (y and bias vary over the same mesh axes)."""
    return internode.reduce_back(y, handle, bias)


_biased_rows.defvjp(
    lambda y, bias, handle: (_biased_rows(y, bias, handle), handle),
    lambda handle, d_out: (_sent_rows(d_out, handle), d_out.astype(jnp.float32), None))


def _rows_summed_to(y, handle, dtype):
    """internode.reduce_back(y, handle, dtype=dtype): the fp32 sums cast to dtype once; the
    cotangent goes back in y's dtype."""
    return tp.with_transpose(partial(internode.reduce_back, dtype=dtype),
                             lambda d_out, h: internode.send_tokens(d_out.astype(y.dtype), h),
                             tp.COMBINE_NAME)(y, handle)


def _dispatch_weights(topk_weights, handle):
    """topk_weights [T,K] to their owning ranks; the weights of slots owned elsewhere read 0
    (so their cotangents are dropped before the reduce-back)."""
    recv_w = _sent_rows(topk_weights, handle)
    return jnp.where(handle.recv_topk_idx >= 0, recv_w, 0.0)


def _dispatch_rows(x, topk_weights, handle):
    """x [T,H] and topk_weights [T,K] to their owning ranks (see _dispatch_weights)."""
    return _sent_rows(x, handle), _dispatch_weights(topk_weights, handle)


def dispatch(x, topk_idx=None, topk_weights=None, *, num_experts=None, axis_name,
             backend="deepep", num_worst_tokens=None, expert_alignment=1, transport="auto",
             capacity=None, handle=None, layout=None, use_fp8=False, fp8_output="pair",
             round_scale=False, use_ue8m0=False, hierarchical=None,
             num_worst_rdma_tokens=None):
    """Send each token once to every rank owning one of its experts (DeepEP normal mode).

    Call inside `jax.shard_map` over `axis_name` (P ranks; P = 1 runs no collective).
      x: [T,H] f32/bf16/f16, this rank's tokens; or, as DeepEP's FP8 dispatch takes it, a
        tuple of row arrays (x_fp8 float8_e4m3fn[T,H], scales f32[T,H/128]) that travel
        through one layout; recv_x is then the tuple of their received [R,...] arrays. The
        rows are moved as they are, so any dtype of whole bytes dispatches (FP8 parts,
        integer scales; int4 / uint4 / float4 are a ValueError); combine takes f32/bf16/f16
        rows.
      topk_idx: [T,K] int32/int64 global expert ids, -1 = unrouted.
      topk_weights: [T,K] float routing weights (None: ones; then no weights are sent and
        recv_topk_weights is 1 on every owned slot, 0 elsewhere).
      num_experts: E, a multiple of P; rank r owns experts [r*L, (r+1)*L).
      num_worst_tokens: R, rows of the receive buffers (default P*C: no drop). A smaller R
        bounds them: each rank fills its R rows with its sources' blocks in rank order, and
        the rows that do not fit are dropped by their senders (highest token indices of each
        block first) and counted in handle.num_dropped.
      expert_alignment: num_recv_tokens_per_expert is rounded up to a multiple of it.
      transport: "auto", "all_to_all", "ragged" or "peer" (see jax_ep.transport).
      capacity: C, rows sent per destination (default T: no drop; a larger C is cut to T).
        Blocks beyond it drop their highest token indices; the count is handle.num_dropped.
      handle: a previous dispatch's handle to replay its layout (cached dispatch: topk_idx
        is then ignored, the routing is the cached one; topk_weights, if given, travel with
        the rows as without a handle).
      layout: a `get_dispatch_layout` result (num_tokens_per_rank i32[P], is_token_in_rank
        bool[T,P], num_tokens_per_expert i32[E]) for the same topk_idx (DeepEP's
        precomputed layout), checked for shapes and dtypes; the exchange takes its counts
        from topk_idx's own send layout, so a layout whose values disagree with topk_idx
        cannot misplace, pad or drop rows.
      use_fp8: cast x [T,H] f32/bf16/f16 (H % 128 == 0) to FP8 per token and 128 channels
        before the wire (ops.per_token_cast_to_fp8 with round_scale / use_ue8m0; use_ue8m0
        requires round_scale); the codes and scales travel through one layout, as the tuple
        x above does. recv_x is then, by fp8_output:
          "pair": DeepEP's FP8 pair (x_fp8 float8_e4m3fn[R,H], scales f32[R,H/128], or
            i32[R,H/512] with use_ue8m0); forward-only: differentiating it raises.
          "cast_back": the received rows cast back to x.dtype [R,H] on arrival.
        Gradients (cast_back) flow to x and topk_weights; the cotangents move back in
        x.dtype through the backward of the dispatch without FP8, the cast being the
        identity (straight-through): the gradient equals that of the non-FP8 dispatch of the
        FP8 round trip of x.
      hierarchical, num_worst_rdma_tokens: the internode mode. axis_name may be a pair
        (node_axis, local_axis) of N x G ranks (global rank n*G + g); hierarchical=None runs
        DeepEP's two hops when N > 1 and G > 1 (hop 1 once per (token, destination node)
        over the node axis to the rank with this local index, hop 2 once per (token, owning
        rank) over the local axis), False the flat exchange over the pair. The result is the
        flat one. num_worst_rdma_tokens R1 (default N*T: no drop) bounds each forwarder's
        hop-1 rows, filled source node by source node, the rows that do not fit dropped by
        their senders (highest token indices first) and counted. transport may be a
        (node hop, local hop) pair. The handle is then an InternodeHandle
        (num_tokens_per_rdma_rank i32[N], num_rdma_recv_tokens i32[]). With
        backend="uccl_ep" the handle reads as UCCL-EP's handle tuple (its tuple_layout).
    Returns (recv_x [R,H], recv_topk_idx i32[R,K], recv_topk_weights f32[R,K], handle).
    """
    impl = check_backend(backend)
    use_fp8 = check_flag(use_fp8, "use_fp8")
    if use_fp8:
        check_fp8_dispatch(x, fp8_output, round_scale, use_ue8m0)
    if isinstance(x, (tuple, list)):
        return _dispatch_row_tuple(tuple(x), topk_idx, topk_weights, num_experts=num_experts,
                                   axis_name=axis_name, backend=backend,
                                   num_worst_tokens=num_worst_tokens,
                                   expert_alignment=expert_alignment, transport=transport,
                                   capacity=capacity, handle=handle, layout=layout,
                                   hierarchical=hierarchical,
                                   num_worst_rdma_tokens=num_worst_rdma_tokens)
    check_rank(x, 2, "x")
    check_whole_bytes(x, "x")
    if handle is None:
        if topk_idx is None or num_experts is None:
            raise ValueError("dispatch: topk_idx and num_experts are required without a handle")
        if jnp.ndim(topk_idx) >= 1 and jnp.shape(topk_idx)[0] != x.shape[0]:
            raise ValueError(f"topk_idx: expected {x.shape[0]} rows to match x {x.shape}, got "
                             f"shape {jnp.shape(topk_idx)}")  # before the weights' check
        topk_idx, topk_weights = check_routing(topk_idx, topk_weights, num_experts)
        axes = internode.two_hop_axes(axis_name, hierarchical)
        transports = internode.resolve_transports(transport, axes is not None, impl)
        if num_worst_rdma_tokens is not None and axes is None:
            raise ValueError(f"num_worst_rdma_tokens: bounds the node hop of a two-hop "
                             f"dispatch; axis_name {axis_name!r} (hierarchical="
                             f"{hierarchical}) runs a flat exchange")
        if layout is not None:
            _, num_ranks = tp.axis_rank_and_size(axis_name)
            _check_layout(layout, x.shape[0], num_ranks, num_experts)
        sizes = dict(capacity=capacity, num_worst_tokens=num_worst_tokens,
                     expert_alignment=expert_alignment)
        if axes is not None:
            handle = internode.two_hop_plan(topk_idx, num_experts, axes, transports=transports,
                                            impl=impl, **sizes,
                                            num_worst_rdma_tokens=num_worst_rdma_tokens)
        else:
            handle = internode.routing_plan(topk_idx, num_experts, axis_name,
                                            transport=transports, impl=impl, **sizes)
        if backend == "uccl_ep":  # reads as UCCL-EP's handle tuple
            handle = dataclasses.replace(handle, tuple_layout="uccl_ep")
    elif not isinstance(handle, HANDLES):
        raise ValueError(f"handle: expected the DispatchHandle of a dispatch, got "
                         f"{type(handle).__name__}")
    else:
        if x.shape[0] != handle.num_tokens:
            raise ValueError(f"x: expected {handle.num_tokens} rows to match the handle, got "
                             f"shape {x.shape}")
        topk_weights = check_weights(topk_weights,
                                     (handle.num_tokens, handle.recv_topk_idx.shape[1]))
    if use_fp8:
        recv_x = _sent_rows_fp8(x, handle, bool(round_scale), bool(use_ue8m0),
                                fp8_output == "cast_back")
    else:
        recv_x = _sent_rows(x, handle)
    if topk_weights is None:
        # Weights of ones arrive as ones on every owned slot: nothing to send.
        recv_w = jnp.where(handle.recv_topk_idx >= 0, 1.0, 0.0).astype(jnp.float32)
    else:
        recv_w = _dispatch_weights(topk_weights, handle)
    return recv_x, handle.recv_topk_idx, recv_w, handle


def _dispatch_row_tuple(parts, topk_idx, topk_weights, *, axis_name, backend, handle,
                        **routing):
    """dispatch of a tuple of [T,...] row arrays: the first routes (or replays `handle`), the
    others replay its handle, so row r of every received array is the same source row."""
    parts = check_row_parts(parts, "x")
    first, recv_idx, recv_w, handle = dispatch(parts[0], topk_idx, topk_weights,
                                               axis_name=axis_name, backend=backend,
                                               handle=handle, **routing)
    rest = tuple(_sent_rows(part, handle) for part in parts[1:])
    return (first,) + rest, recv_idx, recv_w, handle


def _check_layout(layout, num_tokens, num_ranks, num_experts):
    """Validates a get_dispatch_layout triple's shapes and dtypes."""
    if not isinstance(layout, (tuple, list)) or len(layout) != 3:
        raise ValueError("layout: expected the (num_tokens_per_rank, is_token_in_rank, "
                         "num_tokens_per_expert) triple of get_dispatch_layout")
    per_rank, in_rank, per_expert = layout
    parts = ((per_rank, (num_ranks,), "num_tokens_per_rank", jnp.integer, "i32"),
             (in_rank, (num_tokens, num_ranks), "is_token_in_rank", jnp.bool_, "bool"),
             (per_expert, (num_experts,), "num_tokens_per_expert", jnp.integer, "i32"))
    for part, shape, name, kind, expected in parts:
        check_shape(part, shape, f"layout.{name}")
        if not jnp.issubdtype(jnp.result_type(part), kind):
            raise ValueError(f"layout.{name}: expected get_dispatch_layout's {expected} "
                             f"array, got {jnp.result_type(part)}")


def combine(y, handle, dtype=None, *, topk_weights=None, combine_dtype=None):
    """Sum every returned copy of a token: y [R,H] -> (combined [T,H], combined_weights).

    Unweighted (experts apply gate weights themselves), fp32 accumulation, cast to y.dtype
    or to `dtype` (the all_to_all module's argument: e.g. float32 returns the fp32 sums of
    bf16 rows unrounded; the rows still cross the wire in y.dtype); unrouted tokens combine
    to 0. topk_weights [R,K] (optional) are summed back the same way into combined_weights
    f32[T,K], else None. Two-hop handle: each forwarder sums the copies of a (token, node)
    in fp32, the partial sums cross the node axis in y.dtype (DeepEP's bytes; one extra
    rounding for bf16) or in fp32 with combine_dtype=jnp.float32, and the source sums them
    in fp32. A flat handle sums once at the source, combine_dtype changes nothing there.
    """
    combine_dtype = None if combine_dtype is None else as_dtype(combine_dtype, "combine_dtype")
    dtype = None if dtype is None else as_dtype(dtype, "dtype")
    if combine_dtype is not None and jnp.dtype(combine_dtype) not in (
            jnp.dtype(jnp.float32), jnp.dtype(y.dtype)):
        raise ValueError(f"combine_dtype: expected None, float32 or y's dtype {y.dtype}, got "
                         f"{combine_dtype}")
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype: expected None or a float dtype, got {dtype}")
    check_combine_rows(y, handle, "y")
    wide = combine_dtype is not None and jnp.dtype(combine_dtype) != jnp.dtype(y.dtype)
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(y.dtype):
        combined = _rows_summed_to(y.astype(jnp.float32) if wide else y, handle,
                                   jnp.dtype(dtype))
    else:
        combined = (_combine_rows_fp32 if wide else _combine_rows)(y, handle)
    return combined, _combined_weights(topk_weights, handle)


def combine_with_bias(y, handle, bias, *, topk_weights=None, name="y"):
    """combine with DeepEP's `bias`: y [R,H] -> (combined [T,H] in y.dtype, combined_weights
    f32[T,K] or None). bias: one [T,H] array or a pair of them (any float dtype); each
    token's fp32 sum starts at their fp32 sum, adds the token's copies in source-rank order
    and is cast to y.dtype once, as DeepEP's combine kernels do (two hops: the bias joins the
    source's final sum). Differentiable in y and the biases. name: y's argument name in
    errors (Buffer.combine calls it "x")."""
    check_combine_rows(y, handle, name)
    biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if not 1 <= len(biases) <= 2:
        raise ValueError(f"bias: expected one [T,H] array or a pair, got {len(biases)} arrays")
    shape = (handle.num_tokens,) + y.shape[1:]
    total = None
    for i, b in enumerate(biases):
        check_shape(b, shape, "bias" if len(biases) == 1 else f"bias[{i}]")
        check_float(b, "bias" if len(biases) == 1 else f"bias[{i}]")
        b = jnp.asarray(b).astype(jnp.float32)
        total = b if total is None else total + b
    y, total = _ffi.vary_together(*(tp.vary_with_handle(a, handle) for a in (y, total)))
    summed = tp.named(_biased_rows(y, total, handle), tp.COMBINE_NAME)
    return summed, _combined_weights(topk_weights, handle)


def _combined_weights(topk_weights, handle):
    """topk_weights [R,K] summed back to their tokens in fp32 (None stays None)."""
    if topk_weights is None:
        return None
    return _combine_rows(check_weights(topk_weights, handle.recv_topk_idx.shape), handle)


def check_combine_rows(y, handle, name):
    """ValueError naming `name` (the caller's argument: "y" here, "x" in Buffer.combine) unless
    y is float [handle.num_recv, H] and handle a DispatchHandle. Integer rows dispatch fine
    but cannot be combined (the sum accumulates in fp32 and is cast back)."""
    if not isinstance(handle, HANDLES):
        raise ValueError(f"handle: expected the DispatchHandle of a dispatch, got {type(handle)}")
    check_rank(y, 2, name)
    check_float(y, name)
    if y.shape[0] != handle.num_recv:
        raise ValueError(f"{name}: expected {handle.num_recv} rows (the dispatch's receive "
                         f"buffer), got shape {y.shape}")


def chunk_bounds(num_tokens, chunks):
    """`chunks` contiguous [start, end) token ranges; each holds num_tokens // chunks tokens
    and the last also takes the remainder, so some are empty when num_tokens < chunks."""
    check_positive(chunks, "chunks")
    step = num_tokens // chunks
    bounds = [(i * step, (i + 1) * step) for i in range(chunks - 1)]
    return bounds + [((chunks - 1) * step, num_tokens)]


def dispatch_chunked_forward(x, topk_idx, topk_weights, local_kernel, *, num_local_experts,
                             axis_name, chunks, backend="alltoall", transport="auto"):
    """dispatch -> local_kernel -> combine over `chunks` token ranges; equals the unchunked
    result. local_kernel(recv_x [R,H], recv_topk_idx [R,K], recv_topk_weights [R,K]) -> float
    [R,H'] (H' = H, or any width: the result is then [T,H'], as combine gives).

    One count exchange serves every chunk; every rank issues every chunk's collectives in the
    same order, so XLA can overlap chunk i+1's dispatch with chunk i's expert compute. T is
    static and the same on every rank, so a chunk that is empty here (T < chunks) is empty on
    every rank: it sends and receives nothing, and it issues no collective (its output is
    zero rows; jax 0.11's Shardy pass crashed compiling the gradient of an empty chunk's
    FFI dispatch). With one rank there is nothing to overlap: `chunks` is ignored and the
    tokens go through one dispatch -> local_kernel -> combine, bitwise the unchunked path.
    """
    _, num_ranks = tp.axis_rank_and_size(axis_name)
    num_experts = num_local_experts * num_ranks
    impl = check_backend(backend)
    chunks = check_positive(chunks, "chunks")  # checked at P = 1 too, where it is unused
    check_rank(x, 2, "x")
    check_float(x, "x")
    topk_idx, topk_weights = check_routing(topk_idx, topk_weights, num_experts)
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx: expected {x.shape[0]} rows to match x {x.shape}, got "
                         f"shape {topk_idx.shape}")
    topk_idx, _ = unroute_invalid_experts(topk_idx, num_experts)
    if topk_weights is None:
        topk_weights = jnp.ones(topk_idx.shape, jnp.float32)
    bounds = chunk_bounds(x.shape[0], chunks if num_ranks > 1 else 1)
    counts = jnp.stack([
        ops.get_dispatch_layout(topk_idx[s:e], num_experts=num_experts, num_ranks=num_ranks,
                                impl=impl)[0] for s, e in bounds])
    transport = tp.resolve_transport(transport, tp.xla_only(impl))
    count_matrix = tp.exchange_counts(counts, axis_name, transport)  # [P_src, chunks, P_dst]
    outputs = {}
    for i, (s, e) in enumerate(bounds):
        if s == e:
            continue
        handle = internode.routing_plan(topk_idx[s:e], num_experts, axis_name,
                                        transport=transport, impl=impl,
                                        count_matrix=count_matrix[:, i])
        recv_x, recv_w = _dispatch_rows(x[s:e], topk_weights[s:e], handle)
        y = local_kernel(recv_x, handle.recv_topk_idx, recv_w)
        check_combine_rows(y, handle, "local_kernel's result")
        outputs[i] = _combine_rows(y, handle)
    # empty chunks: zero rows of the kernel's result width and dtype; where none ran (T = 0),
    # the shape the kernel gives zero received rows (traced only)
    like = next(iter(outputs.values())) if outputs else jax.eval_shape(
        local_kernel, jax.ShapeDtypeStruct((0,) + x.shape[1:], x.dtype),
        jax.ShapeDtypeStruct((0,) + topk_idx.shape[1:], jnp.int32),
        jax.ShapeDtypeStruct((0,) + topk_weights.shape[1:], topk_weights.dtype))
    empty = _ffi.vary_like(jnp.zeros((0,) + like.shape[1:], like.dtype), x)
    return jnp.concatenate([outputs.get(i, empty) for i in range(len(bounds))], axis=0)

"""HybridEP mode: dispatch fused with the expert permutation, inside `jax.shard_map`.

hybridep_dispatch sends each token once per owning rank (the DeepEP routing plan of
`jax_ep.internode`: one hop, or over a (node, local) pair two) together with its routing
metadata - the dense [T,E] map and probs sliced to the destination's experts, or with compact
routing the top-k ids and probs (only the indices cross the wire, the receiver rebuilds the
map). On the receiving rank the permutation plan is computed from the metadata alone and the
data rows are gathered straight from the receive buffer into expert-major order: grouped by
local expert, rows inside a block ordered by (source rank, source token), blocks padded with
zero rows to pad_multiple. Rows that do not fit in num_permuted_tokens are dropped (later
experts' last rows first) and counted in the handle. hybridep_combine is the mirror: an
unweighted fp32 sum written straight into the return buffer, then back to the source tokens.
The rows and the probs are two linear maps, each with its transpose as its gradient; with
use_fp8 the rows cross the wire as FP8 (transport.with_fp8_wire), the probs in fp32.

Token counts are equalised across ranks to a multiple of 4 (HybridEP's alignment): padding
rows carry no routing and prob 0 and are sliced off after combine.
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import partial

import jax
import jax.numpy as jnp

from jax_ep import _ffi, internode, ops, reference, transport as tp
from jax_ep._checks import (
    MAX_INT32,
    check_experts,
    check_float,
    check_flag,
    check_float_weights,
    check_fp8_dispatch,
    check_positive,
    check_rank,
    check_row_parts,
    check_routing,
    check_shape,
    check_whole_bytes,
)
from jax_ep._index import search

__all__ = [
    "COMBINE_CHUNK",
    "TOKEN_ALIGNMENT",
    "HybridEPHandle",
    "equalized_num_tokens",
    "hybridep_combine",
    "hybridep_dispatch",
    "required_capacity",
]

TOKEN_ALIGNMENT = 4
COMBINE_CHUNK = 64
MIN_CAPACITY = 512


def required_capacity(num_tokens: int, chunk: int | None = None) -> int:
    """HybridEP's token-capacity rule: ceil(max(n, 512) / chunk) * chunk; chunk None: the
    environment's NUM_OF_TOKENS_PER_CHUNK_COMBINE_API (HybridEP's combine chunk), else 64."""
    name = "chunk"
    if chunk is None:
        name = "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API"
        text = os.environ.get(name, str(COMBINE_CHUNK))
        chunk = int(text) if text.strip().isdigit() else text
    check_positive(chunk, name)
    check_positive(num_tokens, "num_tokens", allow_zero=True)
    return -(-max(int(num_tokens), MIN_CAPACITY) // chunk) * chunk


def equalized_num_tokens(num_tokens: int, group_max: int | None = None) -> int:
    """Token count every rank of the group uses: the group maximum rounded up to a multiple
    of 4. Inside shard_map every rank has the same static T, so group_max defaults to it."""
    most = max(int(num_tokens), int(group_max if group_max is not None else num_tokens))
    return -(-most // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT


@partial(jax.tree_util.register_dataclass,
         data_fields=["routing", "recv_map", "sorted_rows", "row_expert", "tokens_per_expert",
                      "num_dropped"],
         meta_fields=["num_tokens", "compact"])
@dataclasses.dataclass(frozen=True)
class HybridEPHandle:
    """State of a HybridEP dispatch, a pytree of arrays plus static fields.

    routing: the internode.DispatchHandle of the (token, rank) rows (tokens equalised), or
      over a (node, local) pair with two hops its internode.InternodeHandle.
    recv_map bool[R,L]: which local experts each received row selected.
    sorted_rows i32[N]: received row of each permuted row (-1 on padding).
    row_expert i32[N]: local expert of each permuted row (L past the last block).
    tokens_per_expert i32[L]: block sizes (padded to pad_multiple, clamped to N).
    num_dropped i32[]: (token, rank) rows past num_worst_tokens R (routing.num_dropped) or
      past a dense map's first top_k owning ranks, plus the (row, local expert) pairs that
      did not fit in N.
    num_tokens: T before equalisation; compact: compact routing was used.
    """

    routing: internode.DispatchHandle | internode.InternodeHandle
    recv_map: jax.Array
    sorted_rows: jax.Array
    row_expert: jax.Array
    tokens_per_expert: jax.Array
    num_dropped: jax.Array
    num_tokens: int
    compact: bool

    @property
    def num_invalid(self):
        """i32[]: expert ids outside [-1, E) seen, routed nowhere (as DispatchHandle's)."""
        return self.routing.num_invalid

    @property
    def impl(self):
        """The kernels ("ffi" / "xla") of the dispatch's backend (transport.with_fp8_wire
        casts with them)."""
        return self.routing.impl


def _padded_tokens(num_tokens):
    """The rows a rank's tokens are padded to: equalized_num_tokens(T), at least one aligned
    group even at T = 0 (every buffer then has rows; JAX cannot gather from an empty one)."""
    return max(equalized_num_tokens(num_tokens), TOKEN_ALIGNMENT)


def _pad_rows(a, rows, fill):
    return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)


def _dense_layout_idx(routing_map, num_ranks):
    """[T,P] one expert id per owning rank (the first it selects there, -1 if none): all the
    send layout needs from a dense map."""
    num_tokens, num_experts = routing_map.shape
    local = routing_map.reshape(num_tokens, num_ranks, num_experts // num_ranks)
    first = jnp.argmax(local, axis=-1) + jnp.arange(num_ranks) * (num_experts // num_ranks)
    return jnp.where(local.any(axis=-1), first, -1).astype(jnp.int32)


def _first_owning_ranks(layout_idx, top_k):
    """[T,P] one expert id per owning rank (-1 if none) -> ([T,k] the ids of each token's first
    k = min(top_k, P) owning ranks in rank order, -1 past them; i32[] the owning ranks past
    them, whose rows are not sent). The send layout is rank-major then token-ascending, so
    its rows do not depend on the column order, only on which (token, rank) pairs remain."""
    num_ranks = layout_idx.shape[1]
    if top_k >= num_ranks:
        return layout_idx, jnp.zeros((), jnp.int32)
    owned = layout_idx >= 0
    earlier_first = jnp.where(owned, num_ranks - jnp.arange(num_ranks, dtype=jnp.int32), 0)
    keys, cols = jax.lax.top_k(earlier_first, top_k)
    kept = jnp.where(keys > 0, jnp.take_along_axis(layout_idx, cols, axis=1), -1)
    cut = jnp.maximum(owned.sum(axis=1, dtype=jnp.int32) - top_k, 0).sum(dtype=jnp.int32)
    return kept, cut


def _two_hop(h):
    """The dispatch runs DeepEP's two hops over a (node, local) pair (internode.InternodeHandle):
    rows then move through internode's row paths and are permuted after arrival."""
    return isinstance(h.routing, internode.InternodeHandle)


def _own_columns(rows, num_local, axis_name):
    """[R, P*L] -> [R, L], the columns of this rank's experts."""
    rank, _ = tp.axis_rank_and_size(axis_name)
    return jax.lax.dynamic_slice_in_dim(rows, rank * num_local, num_local, axis=1)


def _send_permuted(x, h):
    """x [T,...] rows -> [N,...] permuted rows, gathered straight from the receive buffer."""
    r = h.routing
    if _two_hop(h):
        return ops.gather_rows(internode.send_tokens(x, r), h.sorted_rows, impl=r.impl)
    return tp.receive_rows(x, r.send_token_idx, r.plan, h.sorted_rows, num_recv=r.num_recv,
                           capacity=r.capacity, axis_name=r.axis_name, transport=r.transport,
                           impl=r.impl)


def _return_unpermuted(y, h):
    """y [N,...] permuted rows -> [T,...]: summed per received row straight into the return
    buffer, sent back, summed per source token (fp32)."""
    r = h.routing
    flat = y.reshape(y.shape[0], math.prod(y.shape[1:]))
    if _two_hop(h):
        packed = ops.unpermute(flat, h.sorted_rows, num_tokens=r.num_recv, impl=r.impl)
        return internode.reduce_back(packed, r).reshape((r.num_tokens,) + y.shape[1:])
    ret_slot = tp.return_slots(r.plan, num_recv=r.num_recv, capacity=r.capacity,
                               axis_name=r.axis_name, transport=r.transport)
    target = jnp.where(h.sorted_rows >= 0, jnp.take(ret_slot, jnp.clip(h.sorted_rows, 0)), -1)
    num_ranks = r.plan.send_counts.shape[0]
    size = tp.return_buffer_size(r.num_recv, r.capacity, num_ranks, r.transport)
    packed = ops.unpermute(flat, target, num_tokens=size, impl=r.impl)
    rows, owner, _ = tp.return_rows(packed, r.send_token_idx, r.plan,
                                    num_send=r.send_token_idx.shape[0], capacity=r.capacity,
                                    axis_name=r.axis_name, transport=r.transport, impl=r.impl,
                                    prepacked=True)
    out = ops.unpermute(rows, owner, num_tokens=r.num_tokens, impl=r.impl)
    return out.reshape((r.num_tokens,) + y.shape[1:])


def _recv_probs(probs, h):
    """Routing probs -> f32[R,L] on the receiving rank (dense [T,E] or compact [T,K])."""
    r = h.routing
    num_local = h.recv_map.shape[1]
    if h.compact:
        recv_w = internode.send_tokens(probs, r)
        return reference.indices_to_multihot(r.recv_topk_idx, recv_w, num_experts=num_local)[1]
    if _two_hop(h):
        return _own_columns(internode.send_tokens(probs, r), num_local, r.axis_name)
    kwargs = dict(num_recv=r.num_recv, capacity=r.capacity, axis_name=r.axis_name,
                  transport=r.transport, impl=r.impl)
    num_ranks = r.plan.send_counts.shape[0]
    by_rank = probs.reshape(probs.shape[0] * num_ranks, num_local)
    return tp.send_rows(by_rank, _by_rank_rows(r), r.plan, **kwargs)


def _by_rank_rows(r):
    """i32[S] (S = T*min(max(K,1),P) compact send rows): each one's row of a [T*P, ...] table
    holding each token's columns for each destination rank (token * P + rank; -1 on
    padding)."""
    num_ranks = r.plan.send_counts.shape[0]
    ranks = tp.send_row_ranks(r.plan, r.send_token_idx.shape[0])
    return jnp.where(r.send_token_idx >= 0, r.send_token_idx * num_ranks + ranks, -1)


def _permute_probs(probs, h):
    """Routing probs f32[T',E] (dense) or f32[T',K] (compact) -> f32[N]: the prob of each
    permuted row's (token, local expert) pair, 0 on padding rows."""
    recv_probs = _recv_probs(probs, h)
    permuted_probs = recv_probs.at[h.sorted_rows, h.row_expert].get(mode="fill", fill_value=0.0)
    return jnp.where(h.sorted_rows >= 0, permuted_probs, 0.0)


def _unpermute_probs(d_permuted_probs, h):
    """The transpose of _permute_probs: f32[N] -> f32[T',E] or f32[T',K], each permuted row's
    value back on its source token's (expert) column, summed in fp32."""
    r = h.routing
    num_recv, num_local = h.recv_map.shape
    rows = jnp.where(h.sorted_rows >= 0, h.sorted_rows, num_recv)
    d_recv = jnp.zeros((num_recv, num_local), jnp.float32).at[rows, h.row_expert].add(
        d_permuted_probs, mode="drop")
    if h.compact:
        ids = r.recv_topk_idx
        picked = jnp.take_along_axis(d_recv, jnp.clip(ids, 0, num_local - 1), axis=1)
        return internode.reduce_back(jnp.where(ids >= 0, picked, 0.0), r)
    if _two_hop(h):  # each rank's columns of the [T,E] probs come back from their owner
        rank, num_ranks = tp.axis_rank_and_size(r.axis_name)
        d_full = jnp.zeros((num_recv, num_ranks * num_local), jnp.float32)
        d_full = jax.lax.dynamic_update_slice_in_dim(d_full, d_recv, rank * num_local, axis=1)
        return internode.reduce_back(d_full, r)
    back, owner, src_rank = tp.return_rows(d_recv, r.send_token_idx, r.plan,
                                           num_send=r.send_token_idx.shape[0],
                                           capacity=r.capacity, axis_name=r.axis_name,
                                           transport=r.transport, impl="xla")
    num_ranks = r.plan.send_counts.shape[0]
    owner = jnp.where(owner >= 0, owner, r.num_tokens)
    d_probs = jnp.zeros((r.num_tokens, num_ranks, num_local), jnp.float32).at[
        owner, src_rank].add(back, mode="drop")
    return d_probs.reshape(r.num_tokens, num_ranks * num_local)


_dispatch_rows = tp.with_transpose(_send_permuted, _return_unpermuted, tp.DISPATCH_NAME)
_dispatch_rows_fp8 = tp.with_fp8_wire(_send_permuted, _return_unpermuted)
_dispatch_probs = tp.with_transpose(_permute_probs, _unpermute_probs, tp.DISPATCH_NAME)
_combine_rows = tp.with_transpose(_return_unpermuted, _send_permuted, tp.COMBINE_NAME)


def hybridep_dispatch(x, *, routing_map=None, topk_idx=None, probs=None, num_experts, axis_name,
                      num_permuted_tokens=None, pad_multiple=None, transport="auto",
                      backend="deepep", use_fp8=False, fp8_output="pair", round_scale=False,
                      use_ue8m0=False, hierarchical=None, num_worst_tokens=None, top_k=None):
    """Dispatch fused with the expert permutation (HybridEP). Call inside jax.shard_map.

      x: [T,H] tokens of this rank.
      routing_map: bool[T,E] with probs f32[T,E] (dense routing), or
      topk_idx: [T,K] global ids (-1 unrouted) with probs f32[T,K] (compact routing).
      probs may be None, as HybridEP's: nothing but the rows is exchanged and permuted_probs
        is None.
      num_permuted_tokens: N, rows of the permuted output on this rank. None (default): the
        no-drop worst case, every received row's local slots plus the block padding,
        N = P*T' * S + L*(m - 1) (m = pad_multiple, 1 without padding) with T' =
        max(equalized_num_tokens(T), 4) the padded token count and S = min(K, L) with compact
        routing, min(top_k, L) with a dense map and top_k, else L (a dense map may route a
        token to every expert). HybridEP sizes N from a host-synced count, or in its
        CPU-free non-blocking mode pre-allocates T*P*min(L, K), the compact bound here;
        static shapes always take the bound. A smaller N drops rows (counted in the handle).
      pad_multiple: pad every local expert block to a multiple of it (None or 0: no padding,
        as HybridEP's 0).
      num_worst_tokens: R, rows this rank receives before the permutation (as jax_ep.dispatch's
        num_worst_tokens): None (default) P*T', the worst case (every rank's every token);
        a smaller R drops the rows past it (the last source ranks' last tokens), counted in
        the handle. It bounds the combine's return buffer [R, H] (the peer transport writes
        the dispatch straight into the N permuted rows).
      top_k: dense routing only (None with topk_idx, whose width is K): the most experts a
        token selects in routing_map, e.g. the router's top-k. None (default): P, a dense map
        may route a token to every rank. A token then sends rows to at most min(top_k, P)
        ranks, so the send layout, and the [rows, H] buffer the combine's rows come back in,
        hold T'*min(top_k, P) rows instead of T'*P (the peer and ragged transports; the
        padded all_to_all's [P, T', H] buffers are the same either way). A token owning more
        ranks keeps its first min(top_k, P) in rank order; the rest are dropped and counted
        in the handle.
      backend: "deepep" runs the FFI kernels, "alltoall" the XLA reference ops.
      axis_name: the expert axis, or a (node_axis, local_axis) pair of N x G ranks: the rows
        then move by DeepEP's two hops (jax_ep.dispatch's internode mode; `transport` may be
        a (node hop, local hop) pair) and are permuted on arrival; the result equals the flat
        exchange's.
      hierarchical: as jax_ep.dispatch's. None: two hops whenever axis_name is a pair with
        N > 1 and G > 1; False: the flat exchange over the pair; True: two hops, also on a
        degenerate pair (with one axis a ValueError naming hierarchical).
      use_fp8 / round_scale / use_ue8m0 / fp8_output: as jax_ep.dispatch's - x (f32/bf16/f16,
        H % 128 == 0) crosses the wire as FP8 codes plus per-128-channel scales; permuted_x
        is then the pair (float8_e4m3fn[N,H], scales f32[N,H/128] or i32[N,H/512]) or, with
        fp8_output="cast_back", [N,H] in x.dtype, differentiable (straight-through: the
        gradient of the dispatch without FP8 of x's FP8 round trip, moved back in x.dtype).
      x may also be a tuple of row arrays, e.g. an FP8 pair cast beforehand (x_fp8
        float8_e4m3fn[T,H], scales f32[T,H/128]: HybridEP's hidden with its scaling_factor):
        the first routes, every array travels through the same layout, and permuted_x is the
        tuple of their permuted [N,...] arrays (not with use_fp8).
    Returns (permuted_x [N,H], permuted_probs f32[N] (None without probs),
    tokens_per_expert i32[L], handle).
    """
    use_fp8 = check_flag(use_fp8, "use_fp8")
    if isinstance(x, (tuple, list)):
        parts = check_row_parts(x, "x")
        if use_fp8:
            raise ValueError("use_fp8: x is a tuple of row arrays (already cast, e.g. an FP8 "
                             "pair); pass use_fp8=False")
        first, permuted_probs, tokens_per_expert, h = hybridep_dispatch(
            parts[0], routing_map=routing_map, topk_idx=topk_idx, probs=probs,
            num_experts=num_experts, axis_name=axis_name,
            num_permuted_tokens=num_permuted_tokens, pad_multiple=pad_multiple,
            transport=transport, backend=backend, hierarchical=hierarchical,
            num_worst_tokens=num_worst_tokens, top_k=top_k)
        padded = _padded_tokens(parts[0].shape[0])
        rest = tuple(_dispatch_rows(_pad_rows(part, padded, 0), h) for part in parts[1:])
        return (first,) + rest, permuted_probs, tokens_per_expert, h
    if use_fp8:
        check_fp8_dispatch(x, fp8_output, round_scale, use_ue8m0)
    if (routing_map is None) == (topk_idx is None):
        raise ValueError("routing_map / topk_idx: pass exactly one of them (dense or compact "
                         "routing)")
    check_rank(x, 2, "x")
    check_whole_bytes(x, "x")
    if probs is not None:
        check_float_weights(probs, "probs")
    _, num_ranks = tp.axis_rank_and_size(axis_name)
    num_local = check_experts(num_experts, num_ranks)
    if num_permuted_tokens is not None:
        num_permuted_tokens = check_positive(num_permuted_tokens, "num_permuted_tokens",
                                             allow_zero=True, upper=MAX_INT32)
    if pad_multiple is not None:  # 0 is no padding, as HybridEP's
        pad_multiple = check_positive(pad_multiple, "pad_multiple", allow_zero=True,
                                      upper=MAX_INT32) or None
    impl = tp.check_backend(backend)
    axes = internode.two_hop_axes(axis_name, hierarchical)
    transports = internode.resolve_transports(transport, axes is not None, impl)
    num_tokens = x.shape[0]
    padded = _padded_tokens(num_tokens)
    compact = topk_idx is not None
    if compact:
        topk_idx, _ = check_routing(topk_idx, None, num_experts)
        check_shape(topk_idx, (num_tokens, topk_idx.shape[1]), "topk_idx")
    else:
        check_shape(routing_map, (num_tokens, num_experts), "routing_map")
        if routing_map.dtype != jnp.bool_:
            raise ValueError(f"routing_map: expected bool, got {routing_map.dtype}")
    if top_k is not None:
        if compact:
            raise ValueError("top_k: bounds a dense routing_map; compact routing's K is "
                             "topk_idx's width (pass top_k=None)")
        top_k = check_positive(top_k, "top_k")
    if probs is not None:
        check_shape(probs, (topk_idx if compact else routing_map).shape, "probs")
    if num_tokens == 0:
        # No token anywhere (T is static and shared): the rows below are built without
        # reading the empty inputs, which XLA's Shardy pass cannot compile when two or more
        # zero-sized shard_map inputs feed a non-empty result. They vary over the expert axis
        # where the inputs do, as the collectives below would make them, so that at P = 1
        # the results still vary as the inputs do. Not over other axes (data): with jax 0.11
        # that cast crashes Shardy when it compiles the VJP on a (data, expert) mesh.
        def fresh(like, value):
            axes = frozenset({axis_name}) & _ffi.varying_axes(like)
            return _ffi.make_varying(jnp.full(like.shape, value, like.dtype), axes)
        x = fresh(x, 0)
        probs = None if probs is None else fresh(probs, 0)
        if compact:
            topk_idx = fresh(topk_idx, -1)
        else:
            routing_map = fresh(routing_map, False)
    num_cut = jnp.zeros((), jnp.int32)
    if compact:
        layout_idx = _pad_rows(topk_idx, padded, -1)
    else:
        routing_map = _pad_rows(routing_map.astype(bool), padded, False)
        layout_idx = _dense_layout_idx(routing_map, num_ranks)
        if top_k is not None:
            layout_idx, num_cut = _first_owning_ranks(layout_idx, top_k)
    x = _pad_rows(x, padded, 0)
    if probs is not None:
        probs = _pad_rows(probs.astype(jnp.float32), padded, 0.0)
    if axes is not None:  # DeepEP's two hops over a (node, local) pair
        routing = internode.two_hop_plan(layout_idx, num_experts, axes, transports=transports,
                                         impl=impl, num_worst_tokens=num_worst_tokens)
    else:
        routing = internode.routing_plan(layout_idx, num_experts, axis_name,
                                         transport=transports, impl=impl,
                                         num_worst_tokens=num_worst_tokens)
    if compact:
        recv_map, _ = reference.indices_to_multihot(
            routing.recv_topk_idx, jnp.zeros(routing.recv_topk_idx.shape, jnp.float32),
            num_experts=num_local)
    elif axes is not None:
        recv_map = _own_columns(internode.send_tokens(routing_map.astype(jnp.int8), routing),
                                num_local, axis_name).astype(bool)
    else:
        kwargs = dict(num_recv=routing.num_recv, capacity=routing.capacity,
                      axis_name=axis_name, transport=routing.transport, impl=impl)
        by_rank = routing_map.reshape(padded * num_ranks, num_local).astype(jnp.int8)
        recv_map = tp.send_rows(by_rank, _by_rank_rows(routing), routing.plan,
                                **kwargs).astype(bool)
    if num_permuted_tokens is None:
        slots = min(topk_idx.shape[1] if compact else (top_k or num_local), num_local)
        pad = check_positive(pad_multiple, "pad_multiple") if pad_multiple is not None else 1
        num_permuted_tokens = routing.num_recv * slots + num_local * (pad - 1)
    # The plan alone: one-column dummy rows (the data rows are gathered below, fused).
    plan = ops.permute(jnp.zeros((routing.num_recv, 1), jnp.float32), recv_map,
                       num_out_tokens=num_permuted_tokens, pad_multiple=pad_multiple,
                       impl=impl, return_num_dropped=True)
    _, _, sorted_rows, tokens_per_expert, num_dropped = plan
    row_expert = search(jnp.cumsum(tokens_per_expert), jnp.arange(num_permuted_tokens))
    h = HybridEPHandle(routing=routing, recv_map=recv_map, sorted_rows=sorted_rows,
                       row_expert=row_expert,
                       tokens_per_expert=tokens_per_expert,
                       num_dropped=num_dropped + routing.num_dropped + num_cut,
                       num_tokens=num_tokens,
                       compact=compact)
    # first: the programs' collective order
    permuted_probs = None if probs is None else _dispatch_probs(probs, h)
    if use_fp8:
        permuted_x = _dispatch_rows_fp8(x, h, bool(round_scale), bool(use_ue8m0),
                                        fp8_output == "cast_back")
    else:
        permuted_x = _dispatch_rows(x, h)
    return permuted_x, permuted_probs, tokens_per_expert, h


def hybridep_combine(y, handle):
    """y [N,H] expert outputs in the dispatch's permuted order -> [T,H], the unweighted fp32
    sum of every row back onto its source token (padding rows contribute nothing)."""
    if not isinstance(handle, HybridEPHandle):
        raise ValueError(f"handle: expected a HybridEPHandle, got {type(handle)}")
    check_rank(y, 2, "y")
    check_shape(y, (handle.sorted_rows.shape[0], y.shape[1]), "y")
    check_float(y, "y")
    return _combine_rows(y, handle)[:handle.num_tokens]

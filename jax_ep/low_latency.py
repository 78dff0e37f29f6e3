"""DeepEP low-latency mode: one copy per (token, expert) slot into fixed-size expert buffers,
inside `jax.shard_map`.

low_latency_dispatch packs every routed slot into one block of C rows per destination rank
(that rank's experts ascending, source token ascending inside, used rows first; C =
min(L*Tmax, T*min(K, L)) is the most slots a rank can send another, Tmax =
num_max_dispatch_tokens_per_rank >= T), exchanges the blocks (whole with all_to_all, only the
used rows with ragged_all_to_all), and scatters what arrives into recv_x [L, P*Tmax, H]: for
each local expert, the rows of source rank 0, then rank 1, ... (source token ascending inside),
recv_count[l] valid rows first - the layout a masked grouped GEMM consumes. With use_fp8 the
FFI cast runs before the wire (half the bytes) and the per-128-channel scales travel with their
rows. low_latency_combine returns every row to its source and reduces Σ_k w_k · y_{idx_k}(t)
in fp32; with use_logfmt the rows travel in DeepEP's LogFMT-10 encoding (ops.logfmt_encode),
decoded on arrival.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _ffi, ops, reference, transport as tp
from jax_ep._checks import (
    MAX_INT32,
    check_experts,
    check_flag,
    check_float,
    check_fp8_dispatch,
    check_positive,
    check_rank,
    check_routing,
    check_shape,
    check_whole_bytes,
    unroute_invalid_experts,
)
from jax_ep._index import segment_of

__all__ = ["LowLatencyHandle", "low_latency_combine", "low_latency_dispatch"]


@partial(jax.tree_util.register_dataclass,
         data_fields=["src_info", "layout_range", "recv_slot", "return_slot", "send_token",
                      "send_expert", "send_sizes", "recv_sizes", "num_invalid",
                      "cumulative_local_expert_recv_stats"],
         meta_fields=["num_tokens", "num_max_dispatch_tokens_per_rank", "num_experts",
                      "axis_name", "impl", "capacity", "transport", "hidden"])
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """src_info i32[L,P*Tmax]: source token index (on its source rank) of each row, -1 pad.
    layout_range i32[L,P,2]: (begin row, count) of each source rank's block per local expert.
    The wire is P blocks of C = capacity rows, one per rank, each holding that rank's slots
    (local expert ascending, token ascending inside) first:
    send_token i32[P*C]: source token of each sent wire row (-1: empty).
    send_expert i32[P*C]: global expert of each sent wire row (-1: empty).
    send_sizes / recv_sizes i32[P]: used rows of each block sent to / received from a rank.
    recv_slot i32[L*P*Tmax]: received wire row of each output row (-1: padding).
    return_slot i32[P*C]: output row returned through each received wire row (-1: none).
    num_invalid i32[]: this rank's expert ids outside [-1, E), routed nowhere.
    capacity: C = min(L*Tmax, T*min(K, L)) (at least 1), the most slots a rank can send
      another; transport: "all_to_all" (whole blocks), "ragged" or "peer" (the used rows
      only; peer also reads the slots where they are and writes the per-expert layout).
    hidden: H of the dispatched rows (jax_ep.Buffer sizes its combine buffer from it).
    cumulative_local_expert_recv_stats i32[L] | None: set by jax_ep.Buffer.low_latency_dispatch
      (the stats it was given plus this dispatch's recv_count).
    handle[i] and tuple unpacking read it as DeepEP's 5-tuple handle (see __getitem__)."""

    src_info: jax.Array
    layout_range: jax.Array
    recv_slot: jax.Array
    return_slot: jax.Array
    send_token: jax.Array
    send_expert: jax.Array
    send_sizes: jax.Array
    recv_sizes: jax.Array
    num_invalid: jax.Array
    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    axis_name: str
    impl: str
    capacity: int = 1
    transport: str = "all_to_all"
    hidden: int | None = None
    cumulative_local_expert_recv_stats: jax.Array | None = None

    def __len__(self) -> int:
        """5: the handle also reads as DeepEP's tuple (see __getitem__)."""
        return len(_DEEPEP_HANDLE)

    def __getitem__(self, index):
        """DeepEP's 5-tuple handle (src_info, layout_range, num_max_dispatch_tokens_per_rank,
        hidden, num_experts), by int index or slice (tuple unpacking works too): src_info
        i32[L,P*Tmax]; layout_range in DeepEP's layout, int64 [L,P] = begin << 32 | count:
        a jax array under jax_enable_x64; without it a numpy int64 array where the handle's
        arrays are concrete (a handle returned from jit, read on the host), and a ValueError
        inside a traced function (use handle.layout_range there, i32[L,P,2])."""
        positions = range(len(self))[index]
        if isinstance(positions, range):
            return tuple(self._deepep_item(i) for i in positions)
        return self._deepep_item(positions)

    def __iter__(self):
        return (self._deepep_item(i) for i in range(len(self)))

    def _deepep_item(self, position):
        name = _DEEPEP_HANDLE[position]
        if name != "layout_range":
            return getattr(self, name)
        if jax.config.jax_enable_x64:
            pairs = self.layout_range.astype(jnp.int64)
        else:  # on the host, numpy holds the int64
            try:
                pairs = np.asarray(self.layout_range).astype(np.int64)
            except jax.errors.TracerArrayConversionError:
                raise ValueError("handle[1]: DeepEP's packed layout_range (int64 begin << 32 "
                                 "| count) needs jax_enable_x64 inside a traced function; "
                                 "enable it (jax.config.update('jax_enable_x64', True)), read "
                                 "handle[1] outside, or use handle.layout_range, i32[L,P,2] "
                                 "of (begin, count)") from None
        return (pairs[..., 0] << 32) | pairs[..., 1]


# The fields DeepEP's low-latency handle tuple holds, in its order.
_DEEPEP_HANDLE = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                  "num_experts")


def _exchange(src, row_map, h, name, forward=True, recv_rows=None):
    """src[row_map] as [P*C, ...] wire blocks to every peer (forward: the dispatch direction;
    else the return), the received blocks or their rows recv_rows; on the peer transport both
    gathers are the copy itself (transport.exchange_blocks)."""
    sizes = (h.send_sizes, h.recv_sizes) if forward else (h.recv_sizes, h.send_sizes)
    return tp.exchange_blocks(src, *sizes, capacity=h.capacity, axis_name=h.axis_name,
                              transport=h.transport, name=name, row_map=row_map,
                              recv_rows=recv_rows, impl=h.impl)


def _send(rows, h):
    """rows [T,...] -> [L, P*Tmax, ...]: one copy per slot, compacted per local expert."""
    out = _exchange(rows, h.send_token, h, tp.DISPATCH_NAME, recv_rows=h.recv_slot)
    return out.reshape(h.src_info.shape + rows.shape[1:])  # explicit: H may be 0


def _return(y, h):
    """y [L, P*Tmax, ...] -> [P*C, ...] back in this rank's wire rows."""
    flat = y.reshape((y.shape[0] * y.shape[1],) + y.shape[2:])
    return _exchange(flat, h.return_slot, h, tp.COMBINE_NAME, forward=False)


def _sum_back(y, h):
    """y [L, P*Tmax, ...] -> [T, ...]: every slot's row returned and summed per source token."""
    return ops.unpermute(_return(y, h), h.send_token, num_tokens=h.num_tokens, impl=h.impl)


_ll_rows = tp.with_transpose(_send, _sum_back, tp.DISPATCH_NAME)
_ll_rows_fp8 = tp.with_fp8_wire(_send, _sum_back)


def _return_logfmt(y, h):
    """y bf16 [L, P*Tmax, H] -> f32 [P*C, H]: the rows of the return wire gathered first (so
    only they are encoded, not the padding of y), LogFMT-encoded (ops.logfmt_encode), moved
    back as u32 words of their slots (2H + H/32 bytes instead of 2H; empty wire rows are zero
    rows, whose slots decode to zeros), decoded on arrival."""
    rows = ops.gather_rows(y.reshape(-1, y.shape[-1]), h.return_slot, impl=h.impl)
    wire = ops.logfmt_encode(rows)
    words = jax.lax.bitcast_convert_type(wire.reshape(wire.shape[0], -1, 4), jnp.uint32)
    back = _exchange(words, None, h, tp.COMBINE_NAME, forward=False)
    return ops.logfmt_decode(jax.lax.bitcast_convert_type(back, jnp.uint8).reshape(
        back.shape[0], -1))


def _return_transpose(d_back, h):
    """The return's transpose: cotangents of the return wire's rows [P*C, ...] -> [L, P*Tmax,
    ...], moved in the dispatch direction into the slots they came from."""
    d_y = _exchange(d_back, None, h, tp.DISPATCH_NAME, recv_rows=h.recv_slot)
    return d_y.reshape(h.src_info.shape + d_back.shape[1:])


_returned = tp.with_transpose(_return, _return_transpose, tp.COMBINE_NAME)


@jax.custom_vjp
def _returned_logfmt(y, h):
    return _return_logfmt(y, h)


# Straight-through: the LogFMT cast counts as the identity, so the rows' cotangents (f32, as
# the decoded rows) go back as the bf16 return's would.
_returned_logfmt.defvjp(
    lambda y, h: (_returned_logfmt(y, h), h),
    lambda h, d_back: (_returned.adjoint(d_back.astype(jnp.bfloat16), h), None))


def _ll_combine_rows(y, slot_weights, h, use_logfmt):
    """y [L, P*Tmax, H] -> [T, H] in y.dtype: every slot's row returned (LogFMT-encoded on
    the wire with use_logfmt) and summed per source token with its weight slot_weights f32[P*C]
    (ops.unpermute). Differentiable in y and slot_weights, to any order: each piece's VJP is
    another piece (the return's is the dispatch-direction exchange, unpermute's a gather)."""
    if use_logfmt:
        back = tp.named(_returned_logfmt(tp.vary_with_handle(y, h), h), tp.COMBINE_NAME)
    else:
        back = _returned(y, h)
    out = ops.unpermute(back, h.send_token, num_tokens=h.num_tokens, probs=slot_weights,
                        impl=h.impl)
    return out.astype(y.dtype)


def _block_rows(counts, capacity):
    """counts i32[B, L] (rows per expert of each block) -> (expert, j) i32[B, capacity] of
    every row of the blocks (expert-major, row j of that expert), expert -1 past the used."""
    begin = tp.exclusive_cumsum(counts, axis=1)
    c = jnp.arange(capacity, dtype=jnp.int32)
    expert = jax.vmap(lambda b: segment_of(b, c))(begin)
    j = c[None, :] - jnp.take_along_axis(begin, expert, axis=1)
    used = c[None, :] < counts.sum(axis=1, keepdims=True)
    return jnp.where(used, expert, -1), j


def _plan(topk_idx, num_experts, tmax, axis_name, transport, impl):
    topk_idx, num_invalid = unroute_invalid_experts(topk_idx, num_experts)  # no rank raises alone
    _, num_ranks = tp.axis_rank_and_size(axis_name)
    num_local = check_experts(num_experts, num_ranks)
    num_tokens, top_k = topk_idx.shape
    # A rank sends another at most min(K, L) slots per token (distinct experts), T <= Tmax.
    capacity = max(1, min(num_local * tmax, num_tokens * min(top_k, num_local)))
    routing_map, _ = ops.indices_to_multihot(topk_idx, jnp.zeros(topk_idx.shape, jnp.float32),
                                             num_experts=num_experts, impl=impl)
    _, _, slot_token, _ = ops.permute(jnp.zeros((num_tokens, 1), jnp.float32), routing_map,
                                      num_out_tokens=num_experts * tmax, drop_and_pad=True,
                                      impl=impl)
    send_counts = routing_map.sum(axis=0, dtype=jnp.int32).reshape(num_ranks, num_local)
    # Wire row (p, c) <- expert-major slot (p, l, j): block p packs its used slots first.
    local, j = _block_rows(send_counts, capacity)
    dest = jnp.arange(num_ranks, dtype=jnp.int32)[:, None]
    send_expert = jnp.where(local >= 0, dest * num_local + local, -1).reshape(-1)
    slot = jnp.where(send_expert >= 0, send_expert * tmax + j.reshape(-1), -1)
    send_token = jnp.where(slot >= 0, jnp.take(slot_token, jnp.clip(slot, 0)), -1)
    counts = tp.exchange_rows(send_counts, axis_name, transport, tp.COUNTS_NAME)  # [P_src, L]
    send_sizes, recv_sizes = send_counts.sum(axis=1), counts.sum(axis=1)
    # the receivers' src_info: dispatch traffic, named so (a remat policy saving "ep_dispatch"
    # keeps the whole dispatch)
    src_token = tp.exchange_blocks(send_token, send_sizes, recv_sizes, capacity=capacity,
                                   axis_name=axis_name, transport=transport,
                                   name=tp.DISPATCH_NAME)
    recv_counts = counts.T  # [L, P_src]
    begin = tp.exclusive_cumsum(recv_counts, axis=1)
    # Output row (l, i) <- row (begin of expert l in source p's block) + j of wire block p.
    i = jnp.arange(num_ranks * tmax, dtype=jnp.int32)
    p = jax.vmap(lambda b: segment_of(b, i))(begin)
    j = i[None, :] - jnp.take_along_axis(begin, p, axis=1)
    valid = j < jnp.take_along_axis(recv_counts, p, axis=1)
    in_block = tp.exclusive_cumsum(counts, axis=1).T  # [L, P_src]
    slot = jnp.where(valid, p * capacity + jnp.take_along_axis(in_block, p, axis=1) + j, -1)
    recv_slot = slot.reshape(-1).astype(jnp.int32)
    total = num_ranks * capacity
    return_slot = jnp.full((total,), -1, jnp.int32).at[
        jnp.where(recv_slot >= 0, recv_slot, total)].set(
        jnp.arange(recv_slot.shape[0], dtype=jnp.int32), mode="drop")
    src_info = jnp.where(valid, src_token[jnp.clip(slot, 0)], -1)
    layout_range = jnp.stack([begin, recv_counts], axis=-1).astype(jnp.int32)
    return LowLatencyHandle(src_info=src_info, layout_range=layout_range, recv_slot=recv_slot,
                            return_slot=return_slot, send_token=send_token.astype(jnp.int32),
                            send_expert=send_expert.astype(jnp.int32),
                            send_sizes=send_sizes, recv_sizes=recv_sizes,
                            num_invalid=num_invalid, num_tokens=num_tokens,
                            num_max_dispatch_tokens_per_rank=tmax, num_experts=num_experts,
                            axis_name=axis_name, impl=impl, capacity=capacity,
                            transport=transport)


def low_latency_dispatch(x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts,
                         axis_name, use_fp8=False, round_scale=False, use_ue8m0=False,
                         backend="deepep", fp8_output="pair", transport="auto"):
    """DeepEP low-latency dispatch. Call inside jax.shard_map over `axis_name`.

      x: [T,H] with T <= Tmax = num_max_dispatch_tokens_per_rank (same on every rank).
      topk_idx: [T,K] global expert ids, -1 = unrouted (distinct ids per token).
      use_fp8 / round_scale / use_ue8m0: cast x (f32/bf16/f16, H % 128 == 0) to
        float8_e4m3fn before the wire, with per-128-channel scales (see
        jax_ep.ops.per_token_cast_to_fp8; use_ue8m0 requires round_scale).
      fp8_output (with use_fp8): "pair" (DeepEP's result, below) or "cast_back" (rows cast
        back to x.dtype on arrival, recv_x [L, P*Tmax, H] in x.dtype).
      transport: "all_to_all" sends every rank a fixed block of C = min(L*Tmax,
        T*min(K, L)) rows (the most slots a rank can send another); "ragged" only the used
        rows of those blocks; "auto" picks as jax_ep.transport does. Same results.
    Returns (recv_x, recv_count i32[L], handle): recv_x [L, P*Tmax, H] in x.dtype, or with
    use_fp8 and fp8_output="pair" (x_fp8 [L, P*Tmax, H] float8_e4m3fn, scales
    [L, P*Tmax, H/128] f32 or [L, P*Tmax, H/512] i32 with use_ue8m0). Row i < recv_count[l]
    of expert l is valid. Gradients flow to x in x.dtype (backward = the combine-shaped
    reduction, no FP8 in it); with use_fp8 and "cast_back" the cast counts as the identity
    (the gradient of the non-FP8 dispatch of x's FP8 round trip); the FP8 pair is
    forward-only and differentiating it raises.
    """
    use_fp8 = check_flag(use_fp8, "use_fp8")
    if use_fp8:
        check_fp8_dispatch(x, fp8_output, round_scale, use_ue8m0)
    check_rank(x, 2, "x")
    check_whole_bytes(x, "x")
    tmax = check_positive(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank",
                          upper=MAX_INT32)
    if x.shape[0] > tmax:
        raise ValueError(f"x: {x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank "
                         f"({tmax}); got shape {x.shape}")
    topk_idx, _ = check_routing(topk_idx, None, num_experts)
    check_shape(topk_idx, (x.shape[0], topk_idx.shape[1]), "topk_idx")
    impl = tp.check_backend(backend)
    h = dataclasses.replace(_plan(topk_idx, num_experts, tmax, axis_name,
                                  tp.resolve_transport(transport, tp.xla_only(impl)), impl),
                                hidden=x.shape[1])
    recv_count = h.layout_range[..., 1].sum(axis=1, dtype=jnp.int32)  # i32 under x64 too
    if not use_fp8:
        return _ll_rows(x, h), recv_count, h
    return (_ll_rows_fp8(x, h, bool(round_scale), bool(use_ue8m0), fp8_output == "cast_back"),
            recv_count, h)


def check_combine_rows(y, handle, name):
    """ValueError naming `name` (the caller's argument: "y" here, "x" in
    Buffer.low_latency_combine) unless y is float [L, P*Tmax, H] for the LowLatencyHandle."""
    if not isinstance(handle, LowLatencyHandle):
        raise ValueError(f"handle: expected a LowLatencyHandle, got {type(handle)}")
    check_rank(y, 3, name)
    check_shape(y, handle.src_info.shape + (y.shape[-1],), name)
    check_float(y, name)


def check_logfmt_rows(y, name):
    """ValueError naming `name` unless y can travel LogFMT-encoded: bf16, H % 512 == 0."""
    if y.dtype != jnp.bfloat16:
        raise ValueError(f"{name}: use_logfmt needs bfloat16 rows (DeepEP's combine), got "
                         f"{y.dtype}")
    if y.shape[-1] % ops.LOGFMT_HIDDEN_MULTIPLE:
        raise ValueError(f"{name}: use_logfmt needs a hidden size that is a multiple of "
                         f"{ops.LOGFMT_HIDDEN_MULTIPLE}, got shape {y.shape}")


def low_latency_combine(y, topk_idx, topk_weights, handle, use_logfmt=False):
    """y [L, P*Tmax, H] expert outputs -> [T,H] = Σ_k topk_weights[t,k] · y_{topk_idx[t,k]}(t),
    fp32 accumulation, cast to y.dtype. topk_idx/topk_weights are the dispatch's [T,K].

    use_logfmt (y bf16, H % 512 == 0): each row travels in DeepEP's LogFMT-10 encoding
    (ops.logfmt_encode: per 128 channels an (amax, amin) bf16 pair, then per 1024-channel
    chunk (512 if H % 1024 != 0) 10-bit log codes when the chunk's values are below 1 and not
    constant, else raw bf16; a slot of 2H + H/32 bytes), decoded to f32 on arrival
    (ops.logfmt_decode) and summed as above. Gradients are straight-through: the cast counts as
    the identity (d y is the non-LogFMT combine's, moved in y.dtype), topk_weights see the
    decoded rows."""
    check_combine_rows(y, handle, "y")
    use_logfmt = check_flag(use_logfmt, "use_logfmt")
    if use_logfmt:
        check_logfmt_rows(y, "y")
    topk_idx, topk_weights = check_routing(topk_idx, topk_weights, handle.num_experts,
                                           weights_required=True)
    check_shape(topk_idx, (handle.num_tokens, topk_idx.shape[1]), "topk_idx")
    _, dense_w = reference.indices_to_multihot(topk_idx, topk_weights,
                                               num_experts=handle.num_experts)
    # One zero row past the last token: with T = 0 the gather still has a row to read (JAX
    # cannot gather from an empty array).
    dense_w = jnp.pad(dense_w, ((0, 1), (0, 0)))
    slot_weights = dense_w.at[handle.send_token, handle.send_expert].get(mode="fill",
                                                                         fill_value=0.0)
    # Typed like y: with T = 0 nothing above varies over the expert axis, but y's cotangent does.
    slot_weights = _ffi.vary_like(jnp.where(handle.send_token >= 0, slot_weights, 0.0), y)
    return _ll_combine_rows(y, slot_weights, handle, use_logfmt)

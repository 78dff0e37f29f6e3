"""NeMo's MoE utilities (`nemo_automodel.components.moe.megatron.moe_utils`, itself a copy of
Megatron-Core's `moe_utils` and `fused_bias_swiglu` / `fused_bias_geglu`) over jax_ep, with
their names, arguments and results, so that expert code written against them ports by its
import line:

- `permute` / `unpermute`: the expert-major permutation of the dispatchers, on jax_ep's
  permute and unpermute kernels;
- `sort_chunks_by_idxs`: Megatron's reordering of row chunks (the all-to-all dispatcher's
  (rank, expert) -> (expert, rank) step);
- the grouped experts' gated activations: SwiGLU, GEGLU (tanh GELU) and Quick-GEGLU
  (gpt-oss), their token-weighted forms, their `*_back` gradients and the
  `weighted_bias_*_impl` entry points (with `fp8_input_store`: the input kept for the
  backward pass in float8_e4m3fn);
- the router helpers of `jax_ep.flax.router` and `MoEAuxLossAutoScaler`, which live in the
  same module in Megatron.

Static shapes: every result that PyTorch sizes by the data is a fixed-size buffer here (see
`permute`). `fused=` is accepted everywhere and changes nothing: jax_ep's permute and
unpermute are fused kernels either way.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, ops
from jax_ep._index import search, segment_of
from jax_ep.flax.activations import (QUICK_GELU_ALPHA, clamp_glu_halves, geglu, quick_geglu,
                                     quick_gelu, swiglu)
from jax_ep.flax.moe import MoEAuxLossAutoScaler
from jax_ep.flax.router import (
    apply_biased_logits,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    get_updated_expert_bias,
    group_limited_topk,
    pad_routing_map,
    qb_dual_update,
    router_gating_linear,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from jax_ep.transport import exclusive_cumsum

__all__ = [
    "MoEAuxLossAutoScaler", "apply_biased_logits", "apply_random_logits",
    "apply_router_token_dropping",
    "compute_routing_scores_for_aux_loss", "geglu", "geglu_back", "get_capacity",
    "get_tokens_per_expert_and_token_count", "get_updated_expert_bias", "group_limited_topk",
    "pad_routing_map", "permute", "qb_dual_update",
    "quick_geglu", "quick_geglu_back", "quick_gelu", "router_gating_linear", "sinkhorn",
    "sort_chunks_by_idxs", "swiglu", "swiglu_back", "switch_load_balancing_loss_func",
    "topk_routing_with_score_function", "unpermute", "weighted_bias_geglu_impl",
    "weighted_bias_quick_geglu", "weighted_bias_quick_geglu_back",
    "weighted_bias_quick_geglu_impl", "weighted_bias_swiglu_impl", "weighted_geglu",
    "weighted_geglu_back", "weighted_quick_geglu", "weighted_quick_geglu_back",
    "weighted_swiglu", "weighted_swiglu_back", "z_loss_func",
]

# --- permutation -----------------------------------------------------------------------------

def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
            drop_and_pad=False):
    """tokens [T,H], routing_map [T,E] (bool, or integer with nonzero = routed), probs [T,E]
    or None -> (permuted_input [N,H], permuted_probs [N] in probs' dtype or None,
    sorted_indices i32[N]): each expert's tokens in token order, experts in order, as
    NeMo's and Megatron's permute.

    N = num_out_tokens (static), default T*E: PyTorch sizes the result by the routed count,
    which is not static here, so pass T*K as Megatron's dispatchers do. Rows past the routed
    ones are padding: zero, probs 0, sorted_indices -1 (`unpermute` skips them; Megatron's
    argsort path fills them with unrouted tokens instead). Routed (token, expert) pairs past
    N are dropped, the last experts' last tokens first.

    drop_and_pad (with num_out_tokens; without it the flag is ignored, as in PyTorch): every
    expert gets exactly capacity = N // E rows holding its first tokens. Megatron expects the
    router to have marked exactly `capacity` tokens per expert; where it marked fewer, the
    rest of the block is padding here (PyTorch repeats unrouted tokens there). The result
    then has E * capacity rows, as PyTorch's."""
    del fused
    drop_and_pad = _checks.check_flag(drop_and_pad, "drop_and_pad")
    routing_map = _checks.check_map(routing_map)
    num_tokens, num_experts = routing_map.shape
    if num_out_tokens is not None:
        _checks.check_positive(num_out_tokens, "num_out_tokens", allow_zero=True)
    if num_out_tokens is None:
        num_out_tokens, drop_and_pad = num_tokens * num_experts, False
    elif drop_and_pad:  # PyTorch's result: E blocks of capacity rows
        if num_experts == 0:
            raise ValueError("routing_map: drop_and_pad needs at least one expert column, got "
                             f"shape {routing_map.shape}")
        num_out_tokens = num_out_tokens // num_experts * num_experts
    permuted, permuted_probs, sorted_indices, _ = ops.permute(
        tokens, routing_map, probs, num_out_tokens=num_out_tokens,
        drop_and_pad=drop_and_pad)
    if probs is not None:
        permuted_probs = permuted_probs.astype(probs.dtype)
    return permuted, permuted_probs, sorted_indices


def _row_experts(routing_map, num_rows, drop_and_pad):
    """i32[num_rows]: the expert whose block holds each row of permute's layout."""
    num_experts = routing_map.shape[1]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    if drop_and_pad:
        return jnp.minimum(rows // max(num_rows // num_experts, 1), num_experts - 1)
    ends = jnp.cumsum(routing_map.sum(axis=0, dtype=jnp.int32))
    return jnp.minimum(search(ends, rows), num_experts - 1)


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None,
              fused=False, drop_and_pad=False):
    """permute's inverse: permuted_tokens [N,H], sorted_indices i32[N] (-1 rows skipped) ->
    [T,H] = restore_shape, each token the sum of its rows, weighted by probs [T,E] at the
    row's expert when probs is given (which needs routing_map [T,E] to place the rows, as in
    PyTorch). Sums in float32, cast back to permuted_tokens' dtype. Differentiable in
    permuted_tokens and probs."""
    del fused
    drop_and_pad = _checks.check_flag(drop_and_pad, "drop_and_pad")
    if (not isinstance(restore_shape, (tuple, list)) or len(restore_shape) != 2
            or not all(_checks.is_int(d, 0) for d in restore_shape)):
        raise ValueError(f"restore_shape: expected (num_tokens, hidden) ints >= 0, got "
                         f"{restore_shape}")
    num_tokens, hidden = (int(d) for d in restore_shape)
    _checks.check_rank(permuted_tokens, 2, "permuted_tokens")
    _checks.check_float(permuted_tokens, "permuted_tokens")
    _checks.check_rank(sorted_indices, 1, "sorted_indices")
    if permuted_tokens.shape[1] != hidden:
        raise ValueError(f"restore_shape: expected hidden {permuted_tokens.shape[1]} "
                         f"(permuted_tokens' width), got {restore_shape}")
    weights = None
    if probs is not None:
        if routing_map is None:
            raise ValueError("routing_map: expected the [num_tokens, num_experts] map with "
                             "probs (it places each row's prob), got None")
        routing_map = _checks.check_map(routing_map)
        _checks.check_shape(probs, routing_map.shape, "probs")
        _checks.check_shape(routing_map, (num_tokens, routing_map.shape[1]), "routing_map")
        expert = _row_experts(routing_map, sorted_indices.shape[0], drop_and_pad)
        routed = sorted_indices >= 0
        weights = (jnp.zeros(sorted_indices.shape, probs.dtype) if num_tokens == 0 else
                   jnp.where(routed, probs[jnp.where(routed, sorted_indices, 0), expert], 0))
    return ops.unpermute(permuted_tokens, sorted_indices, num_tokens=num_tokens, probs=weights)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """Megatron's sort_chunks_by_idxs: input [N,...] read as consecutive chunks of
    split_sizes i32[C] rows -> (the chunks in the order sorted_idxs i32[C] (a permutation of
    range(C)), probs [N] reordered alike or None). Rows past sum(split_sizes) come out zero
    (PyTorch requires the sizes to cover the input exactly). Differentiable in input and
    probs."""
    del fused
    _checks.check_rows(input, "input")
    _checks.check_array(input, "input")
    split_sizes, sorted_idxs = (v if hasattr(v, "dtype") else np.asarray(v)
                                for v in (split_sizes, sorted_idxs))  # lists, as PyTorch's
    for values, name in ((split_sizes, "split_sizes"), (sorted_idxs, "sorted_idxs")):
        if not jnp.issubdtype(values.dtype, jnp.integer):
            raise ValueError(f"{name}: expected integers, got {values.dtype}")
    _check_chunk_values(split_sizes, sorted_idxs, input.shape[0])
    split_sizes = jnp.asarray(split_sizes, jnp.int32)
    sorted_idxs = jnp.asarray(sorted_idxs, jnp.int32)
    _checks.check_rank(split_sizes, 1, "split_sizes")
    _checks.check_shape(sorted_idxs, split_sizes.shape, "sorted_idxs")
    num_rows = input.shape[0]
    out_sizes = split_sizes[sorted_idxs]
    out_starts = exclusive_cumsum(out_sizes)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    chunk = segment_of(out_starts, rows)
    src = exclusive_cumsum(split_sizes)[sorted_idxs[chunk]] + rows - out_starts[chunk]
    src = jnp.where(rows < out_sizes.sum(), src, num_rows)  # past the chunks: zero rows
    sorted_probs = None
    if probs is not None:
        _checks.check_shape(probs, (num_rows,), "probs")
        sorted_probs = ops.gather_rows(probs, src)
    return ops.gather_rows(input, src), sorted_probs


def _check_chunk_values(split_sizes, sorted_idxs, num_rows):
    """Each where it is concrete (a traced one is not read: no host sync): ValueError naming
    split_sizes unless every size is >= 0 and they sum to at most num_rows (the input's rows:
    chunks past them would be cut), and sorted_idxs unless it is a permutation of range(C)."""
    sizes, idxs = (_concrete(v) for v in (split_sizes, sorted_idxs))
    if sizes is not None and (sizes < 0).any():
        raise ValueError(f"split_sizes: expected row counts >= 0, got {sizes.tolist()}")
    if sizes is not None and sizes.sum() > num_rows:
        raise ValueError(f"split_sizes: the chunks sum to {int(sizes.sum())} rows, more than "
                         f"input's {num_rows}")
    if idxs is not None and sorted(idxs.ravel().tolist()) != list(range(idxs.size)):
        raise ValueError(f"sorted_idxs: expected a permutation of range({idxs.size}), got "
                         f"{idxs.tolist()}")


def _concrete(values):
    """values as a numpy array, or None where they are traced."""
    try:
        return np.asarray(values)
    except jax.errors.TracerArrayConversionError:
        return None


def get_tokens_per_expert_and_token_count(routing_map, reduce_group, topk=None,
                                          with_padding_mask=False):
    """Megatron's counts for the load-balancing losses: routing_map [T,E] (bool or integer)
    -> (global_tokens_per_expert i32[E]: the map's column sums, summed over the mesh axis
    name(s) reduce_group inside shard_map (None: this device's own), local_num_tokens,
    total_num_tokens). With with_padding_mask the token counts are the routed slots / topk
    (padding tokens routed nowhere do not count; float32), else T and T times the devices of
    reduce_group (ints)."""
    routing_map = _checks.check_map(routing_map)
    with_padding_mask = _checks.check_flag(with_padding_mask, "with_padding_mask")
    reduce_group = _checks.check_axis_names(reduce_group, "reduce_group")
    local = routing_map.astype(jnp.int32).sum(axis=0)
    tokens_per_expert = local if reduce_group is None else jax.lax.psum(local, reduce_group)
    if with_padding_mask:
        topk = _checks.check_positive(topk, "topk")
        return (tokens_per_expert, local.sum().astype(jnp.float32) / topk,
                tokens_per_expert.sum().astype(jnp.float32) / topk)
    num_tokens = routing_map.shape[0]
    group = 1 if reduce_group is None else jax.lax.axis_size(reduce_group)
    return tokens_per_expert, num_tokens, num_tokens * group


# --- the experts' gated activations ----------------------------------------------------------

_NOT_GIVEN = object()


def _check_glu(y, name="y", *, weights=_NOT_GIVEN, g=_NOT_GIVEN, bias=_NOT_GIVEN):
    """ValueError naming the argument unless y is a float [..., 2F] array ([gate | up]: an even
    last axis), weights a float [..., 1] (one per row of y), the cotangent g [..., F] and bias
    broadcastable to y (each where passed; None is no array)."""
    _checks.check_float_weights(y, name)
    if jnp.ndim(y) < 1 or y.shape[-1] % 2:
        raise ValueError(f"{name}: expected [..., 2F] ([gate | up]: an even last axis), got "
                         f"shape {tuple(jnp.shape(y))}")
    if weights is not _NOT_GIVEN:
        _checks.check_shape(weights, y.shape[:-1] + (1,), "weights")
        _checks.check_float_weights(weights, "weights")
    if g is not _NOT_GIVEN:
        _checks.check_shape(g, y.shape[:-1] + (y.shape[-1] // 2,), "g")
        _checks.check_float_weights(g, "g")
    if bias is not _NOT_GIVEN:
        _checks.check_float_weights(bias, "bias")
        try:
            broadcast = jnp.broadcast_shapes(bias.shape, y.shape) == y.shape
        except ValueError:
            broadcast = False
        if not broadcast:
            raise ValueError(f"bias: expected a shape that broadcasts to {name}'s "
                             f"{tuple(y.shape)}, got {tuple(bias.shape)}")


def _offset(linear_offset):
    return _checks.check_real(linear_offset, "linear_offset")


def _back(activation, g, y):
    """The gradient of activation at y for the output cotangent g, in their promoted dtype
    (PyTorch's formulas compute in it)."""
    dtype = jnp.result_type(g, y)
    return jax.vjp(activation, y.astype(dtype))[1](g.astype(dtype))[0]


def _weighted(activation, y, weights):
    return (activation(y) * weights).astype(y.dtype)


def _weighted_back(activation, g, y, weights):
    """(d input in y's dtype, d weights [..., 1] in weights' dtype) of _weighted."""
    input_grad = _back(activation, g * weights, y)
    weights_grad = jnp.sum(activation(y) * g.astype(weights.dtype), axis=-1, keepdims=True)
    return input_grad.astype(y.dtype), weights_grad.astype(weights.dtype)


def swiglu_back(g, y):
    """swiglu's input gradient: g [..., F], y [..., 2F] -> [..., 2F]."""
    _check_glu(y, g=g)
    return _back(swiglu, g, y)


def geglu_back(g, y):
    """geglu's input gradient: g [..., F], y [..., 2F] -> [..., 2F]."""
    _check_glu(y, g=g)
    return _back(geglu, g, y)


def quick_geglu_back(g, y, linear_offset: float = 0.0):
    """quick_geglu's input gradient: g [..., F], y [..., 2F] -> [..., 2F]."""
    _check_glu(y, g=g)
    return _back(partial(quick_geglu, linear_offset=_offset(linear_offset)), g, y)


def weighted_swiglu(y, weights):
    """swiglu(y) * weights (weights [..., 1], one per token), in y's dtype."""
    _check_glu(y, weights=weights)
    return _weighted(swiglu, y, weights)


def weighted_geglu(y, weights):
    """geglu(y) * weights, in y's dtype."""
    _check_glu(y, weights=weights)
    return _weighted(geglu, y, weights)


def weighted_quick_geglu(y, weights, linear_offset: float = 0.0):
    """quick_geglu(y, linear_offset) * weights, in y's dtype."""
    _check_glu(y, weights=weights)
    return _weighted(partial(quick_geglu, linear_offset=_offset(linear_offset)), y, weights)


def weighted_bias_quick_geglu(y, bias, weights, linear_offset: float = 0.0):
    """quick_geglu(y + bias, linear_offset) * weights, in y's dtype."""
    _check_glu(y, weights=weights, bias=bias)
    return weighted_quick_geglu(y + bias, weights, linear_offset).astype(y.dtype)


def weighted_swiglu_back(g, y, weights):
    """(d y, d weights) of weighted_swiglu for the cotangent g."""
    _check_glu(y, weights=weights, g=g)
    return _weighted_back(swiglu, g, y, weights)


def weighted_geglu_back(g, y, weights):
    """(d y, d weights) of weighted_geglu for the cotangent g."""
    _check_glu(y, weights=weights, g=g)
    return _weighted_back(geglu, g, y, weights)


def weighted_quick_geglu_back(g, y, weights, linear_offset: float = 0.0):
    """(d y, d weights) of weighted_quick_geglu for the cotangent g."""
    _check_glu(y, weights=weights, g=g)
    return _weighted_back(partial(quick_geglu, linear_offset=_offset(linear_offset)), g, y,
                          weights)


def weighted_bias_quick_geglu_back(g, y, bias, weights, linear_offset: float = 0.0):
    """(d y, d bias, d weights) of weighted_bias_quick_geglu; d bias is d y at y's shape, as
    PyTorch returns it (its autograd sums it to the bias' shape)."""
    _check_glu(y, weights=weights, g=g, bias=bias)
    input_grad, weights_grad = weighted_quick_geglu_back(g, y + bias, weights, linear_offset)
    return input_grad.astype(y.dtype), input_grad.astype(y.dtype), weights_grad


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stored_weighted(activation, fp8_input_store, x, weights):
    return _weighted(activation, x, weights)


def _stored_weighted_fwd(activation, fp8_input_store, x, weights):
    kept = x.astype(jnp.float8_e4m3fn) if fp8_input_store else x
    return _weighted(activation, x, weights), (kept, weights)


def _stored_weighted_bwd(activation, fp8_input_store, residuals, g):
    kept, weights = residuals
    return _weighted_back(activation, g, kept.astype(g.dtype), weights)


_stored_weighted.defvjp(_stored_weighted_fwd, _stored_weighted_bwd)


def _weighted_impl(activation, input, weights, fp8_input_store):
    """PyTorch's weighted_bias_*_impl: input [T, 2F] or [S, B, 2F], weights [S*B, 1] ->
    [T, F] or [S, B, F]; with fp8_input_store the backward pass reads the input rounded to
    float8_e4m3fn (kept in that dtype between the passes; with a bias, input + bias)."""
    _check_impl_input(input, weights)
    shape = input.shape
    rows = input.reshape(-1, shape[-1])
    out = _stored_weighted(activation, _checks.check_flag(fp8_input_store, "fp8_input_store"),
                           rows, weights)
    return out.reshape(shape[0], shape[1], -1) if len(shape) > 2 else out


def _check_impl_input(input, weights):
    """PyTorch's assertion (input of rank 2 or 3), then _check_glu on its rows."""
    _checks.check_array(input, "input")
    if jnp.ndim(input) not in (2, 3):
        raise ValueError(f"input: expected rank 2 or 3, got shape {tuple(jnp.shape(input))}")
    rows = input.reshape(-1, input.shape[-1])
    _check_glu(rows, "input", weights=weights)


def weighted_bias_swiglu_impl(input, weights, fp8_input_store=False):
    """Token-weighted SwiGLU of the grouped experts (see _weighted_impl)."""
    return _weighted_impl(swiglu, input, weights, fp8_input_store)


def weighted_bias_geglu_impl(input, weights, fp8_input_store=False):
    """Token-weighted GEGLU of the grouped experts (see _weighted_impl)."""
    return _weighted_impl(geglu, input, weights, fp8_input_store)


def weighted_bias_quick_geglu_impl(input, bias, weights, fp8_input_store=False,
                                   linear_offset=0.0, clamp_value=None,
                                   alpha=QUICK_GELU_ALPHA):
    """Token-weighted Quick-GEGLU of gpt-oss's experts: input [T, 2F] or [S, B, 2F], bias
    broadcastable to it or None, weights [rows, 1]. With clamp_value c, the gate half is
    clamped to at most c and the linear half to [-c, c] first. alpha: NeMo accepts it and
    uses 1.702 whatever it is; anything else is refused here rather than silently differ."""
    if not (_checks.is_real(alpha) and float(alpha) == QUICK_GELU_ALPHA):
        raise ValueError(f"alpha: expected {QUICK_GELU_ALPHA} (NeMo's Quick-GELU constant; it "
                         f"ignores other values), got {alpha!r}")
    _check_impl_input(input, weights)
    if bias is not None:
        _check_glu(input, "input", bias=bias)
    clamp_value = _checks.check_real(clamp_value, "clamp_value", positive=True, allow_none=True)
    linear_offset = _offset(linear_offset)
    dtype = input.dtype
    if clamp_value is not None:
        input = jnp.concatenate(clamp_glu_halves(*jnp.split(input, 2, axis=-1), clamp_value),
                                axis=-1)
    if bias is not None:  # in the promoted dtype, as PyTorch; the result in the input's
        input = input + bias
    activation = partial(quick_geglu, linear_offset=linear_offset)
    return _weighted_impl(activation, input, weights, fp8_input_store).astype(dtype)

"""jax_ep.flax.moe_utils against numpy ports of NeMo's moe_utils (float64 where it computes):
permute / unpermute (masked-select and argsort paths), sort_chunks_by_idxs, and the gated
activations with their closed-form gradients."""

from __future__ import annotations

from math import erf

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _helpers import random_routing_map
from jax_ep.flax import moe_utils as mu


# --- numpy ports of NeMo's functions (the torch code, op for op) ------------------------------

def np_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    num_tokens, num_experts = routing_map.shape
    if drop_and_pad and num_out_tokens is not None:
        capacity = num_out_tokens // num_experts
        by_expert = routing_map.astype(np.int8).T
        order = np.argsort(-by_expert, axis=-1, kind="stable")[:, :capacity]
        sorted_indices = order.reshape(-1)
        permuted_probs = None
        if probs is not None:
            flat = (np.arange(num_experts)[:, None] * num_tokens + order).reshape(-1)
            permuted_probs = probs.T.reshape(-1)[flat]
    else:
        by_expert = routing_map.astype(bool).T
        sorted_indices = np.broadcast_to(np.arange(num_tokens), by_expert.shape)[by_expert]
        permuted_probs = None if probs is None else probs.T[by_expert]
    return tokens[sorted_indices], permuted_probs, sorted_indices


def np_unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
                 drop_and_pad=False):
    permuted = permuted.astype(np.float64)
    if probs is not None:
        if drop_and_pad:
            num_experts = routing_map.shape[1]
            capacity = sorted_indices.shape[0] // num_experts
            flat = (np.arange(num_experts)[:, None] * probs.shape[0]
                    + sorted_indices.reshape(num_experts, capacity)).reshape(-1)
            row_probs = probs.T.reshape(-1)[flat]
        else:
            row_probs = probs.T[routing_map.astype(bool).T]
        permuted = permuted * row_probs[:, None]
    out = np.zeros(restore_shape)
    np.add.at(out, sorted_indices, permuted)
    return out


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_swiglu_back(g, y):
    y1, y2 = np.split(y, 2, -1)
    s = np_sigmoid(y1)
    return np.concatenate([g * s * (1 + y1 * (1 - s)) * y2, g * np_silu(y1)], -1)


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def np_geglu_back(g, y):
    y1, y2 = np.split(y, 2, -1)
    t = np.tanh(0.7978845608028654 * (y1 + 0.044715 * y1 ** 3))
    d = 0.5 * (1 + t) + 0.5 * y1 * (1 - t ** 2) * 0.7978845608028654 * (
        1 + 3 * 0.044715 * y1 ** 2)
    return np.concatenate([g * d * y2, g * np_gelu_tanh(y1)], -1)


def np_quick_geglu(y, offset=0.0):
    y1, y2 = np.split(y, 2, -1)
    return y1 * np_sigmoid(1.702 * y1) * (y2 + offset)


def np_quick_geglu_back(g, y, offset=0.0):
    y1, y2 = np.split(y, 2, -1)
    s = np_sigmoid(1.702 * y1)
    return np.concatenate([g * s * (1 + 1.702 * y1 * (1 - s)) * (y2 + offset), g * y1 * s], -1)


def np_swiglu(y):
    y1, y2 = np.split(y, 2, -1)
    return np_silu(y1) * y2


def np_geglu(y):
    y1, y2 = np.split(y, 2, -1)
    return np_gelu_tanh(y1) * y2


def _f64(x):
    return np.asarray(x, np.float64)


# --- permute / unpermute ----------------------------------------------------------------------

@given(st.integers(0, 10**6), st.integers(1, 24), st.integers(1, 6), st.booleans())
def test_permute_matches_the_masked_select_path(seed, num_tokens, num_experts, int_map):
    rng = np.random.default_rng(seed)
    routing_map = random_routing_map(rng, num_tokens, num_experts, density=0.4)
    tokens = rng.standard_normal((num_tokens, 8)).astype(np.float32)
    probs = (rng.random((num_tokens, num_experts)) * routing_map).astype(np.float32)
    want_x, want_p, want_idx = np_permute(tokens, routing_map, probs)
    n = len(want_idx)
    spare = 3  # a buffer past the routed rows: padding
    given_map = routing_map.astype(np.int32) if int_map else routing_map
    x, p, idx = mu.permute(jnp.asarray(tokens), jnp.asarray(given_map), jnp.asarray(probs),
                           num_out_tokens=n + spare)
    np.testing.assert_array_equal(np.asarray(idx[:n]), want_idx)
    np.testing.assert_array_equal(np.asarray(idx[n:]), -1)
    np.testing.assert_array_equal(np.asarray(x[:n]), want_x)
    np.testing.assert_array_equal(np.asarray(x[n:]), 0)
    np.testing.assert_array_equal(np.asarray(p[:n]), want_p)
    np.testing.assert_array_equal(np.asarray(p[n:]), 0)


def test_permute_defaults_to_the_no_drop_buffer_and_keeps_probs_dtype():
    routing_map = np.array([[1, 0, 1], [0, 1, 1]], bool)
    tokens = np.arange(8, dtype=np.float32).reshape(2, 4)
    probs = jnp.asarray([[0.5, 0, 0.5], [0, 0.25, 0.75]], jnp.bfloat16)
    x, p, idx = mu.permute(jnp.asarray(tokens), jnp.asarray(routing_map), probs)
    assert x.shape == (6, 4) and p.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(idx), [0, 1, 0, 1, -1, -1])
    np.testing.assert_array_equal(np.asarray(p, np.float32), [0.5, 0.25, 0.5, 0.75, 0, 0])
    # drop_and_pad without num_out_tokens takes the no-drop path, as in PyTorch
    _, _, idx2 = mu.permute(jnp.asarray(tokens), jnp.asarray(routing_map), drop_and_pad=True)
    np.testing.assert_array_equal(np.asarray(idx2), np.asarray(idx))
    x3, p3, idx3 = mu.permute(jnp.asarray(tokens), jnp.asarray(routing_map), fused=True)
    assert p3 is None
    np.testing.assert_array_equal(np.asarray(x3), np.asarray(x))


def test_permute_drop_and_pad_matches_the_argsort_path():
    rng = np.random.default_rng(3)
    num_tokens, num_experts, capacity = 12, 4, 3
    # the router's capacity map: exactly `capacity` tokens per expert
    routing_map = np.zeros((num_tokens, num_experts), bool)
    for e in range(num_experts):
        routing_map[rng.choice(num_tokens, capacity, replace=False), e] = True
    tokens = rng.standard_normal((num_tokens, 8)).astype(np.float32)
    probs = (rng.random((num_tokens, num_experts)) * routing_map).astype(np.float32)
    n = num_experts * capacity
    want = np_permute(tokens, routing_map, probs, num_out_tokens=n, drop_and_pad=True)
    got = mu.permute(jnp.asarray(tokens), jnp.asarray(routing_map), jnp.asarray(probs),
                     num_out_tokens=n, drop_and_pad=True)
    for g, w in zip(got, (want[0], want[1], want[2])):
        np.testing.assert_array_equal(np.asarray(g), w)
    y = mu.unpermute(got[0], got[2], (num_tokens, 8), probs=jnp.asarray(probs),
                     routing_map=jnp.asarray(routing_map), drop_and_pad=True)
    np.testing.assert_allclose(np.asarray(y), np_unpermute(
        want[0], want[2], (num_tokens, 8), probs, routing_map, drop_and_pad=True),
        rtol=1e-6, atol=1e-6)


def test_permute_drop_and_pad_pads_a_short_column_and_drops_a_long_one():
    routing_map = np.array([[1, 1], [1, 0], [1, 0], [0, 0]], bool)  # expert 0: 3, expert 1: 1
    tokens = np.arange(1, 5, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)
    x, _, idx = mu.permute(jnp.asarray(tokens), jnp.asarray(routing_map), num_out_tokens=4,
                           drop_and_pad=True)
    np.testing.assert_array_equal(np.asarray(idx), [0, 1, 0, -1])  # capacity 2
    np.testing.assert_array_equal(np.asarray(x[:, 0]), [1, 2, 1, 0])


@given(st.integers(0, 10**6), st.integers(1, 20), st.integers(1, 5),
       st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_unpermute_matches_the_scatter_add_path(seed, num_tokens, num_experts, dtype):
    rng = np.random.default_rng(seed)
    routing_map = random_routing_map(rng, num_tokens, num_experts, density=0.5)
    tokens = rng.standard_normal((num_tokens, 8)).astype(np.float32)
    probs = (rng.random((num_tokens, num_experts)) * routing_map).astype(np.float32)
    x, _, idx = mu.permute(jnp.asarray(tokens, dtype), jnp.asarray(routing_map),
                           num_out_tokens=num_tokens * num_experts)
    n = int(routing_map.sum())
    y = mu.unpermute(x, idx, (num_tokens, 8), probs=jnp.asarray(probs),
                     routing_map=jnp.asarray(routing_map))
    assert y.dtype == dtype
    want = np_unpermute(np.asarray(x[:n], np.float32), np.asarray(idx[:n]), (num_tokens, 8),
                        probs, routing_map)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol)
    unweighted = mu.unpermute(x, idx, (num_tokens, 8))
    np.testing.assert_allclose(np.asarray(unweighted, np.float32), np_unpermute(
        np.asarray(x[:n], np.float32), np.asarray(idx[:n]), (num_tokens, 8)),
        rtol=tol, atol=tol)


def test_permute_unpermute_gradients_match_the_dense_layer():
    rng = np.random.default_rng(7)
    num_tokens, num_experts, hidden = 10, 4, 8
    routing_map = jnp.asarray(random_routing_map(rng, num_tokens, num_experts, density=0.5))
    tokens = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
    probs = jnp.asarray(rng.random((num_tokens, num_experts)), jnp.float32) * routing_map
    scale = jnp.arange(1, num_experts + 1, dtype=jnp.float32)  # expert e multiplies by e+1
    target = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)

    def routed(x, p):
        rows, _, idx = mu.permute(x, routing_map, num_out_tokens=num_tokens * num_experts)
        expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(routing_map.sum(0)),
                                              jnp.arange(rows.shape[0]), side="right"),
                             num_experts - 1)
        y = jnp.tanh(rows * scale[expert][:, None])
        out = mu.unpermute(y, idx, x.shape, probs=p, routing_map=routing_map)
        return jnp.sum((out - target) ** 2)

    def dense(x, p):
        every = jnp.tanh(x[:, None, :] * scale[None, :, None])  # [T,E,H]
        out = jnp.einsum("teh,te->th", every, p * routing_map)
        return jnp.sum((out - target) ** 2)

    got = jax.grad(routed, argnums=(0, 1))(tokens, probs)
    want = jax.grad(dense, argnums=(0, 1))(tokens, probs)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1] * routing_map),
                               np.asarray(want[1] * routing_map), rtol=1e-5, atol=1e-5)


def test_unpermute_refusals():
    x = jnp.zeros((4, 8))
    idx = jnp.asarray([0, 1, -1, -1])
    with pytest.raises(ValueError, match="routing_map"):
        mu.unpermute(x, idx, (2, 8), probs=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="restore_shape"):
        mu.unpermute(x, idx, (2, 4))
    with pytest.raises(ValueError, match="restore_shape"):
        mu.unpermute(x, idx, (2, 8, 1))
    with pytest.raises(ValueError, match="probs"):
        mu.unpermute(x, idx, (2, 8), probs=jnp.ones((2, 2)),
                     routing_map=jnp.ones((2, 3), bool))


# --- sort_chunks_by_idxs ----------------------------------------------------------------------

@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(0, 3))
def test_sort_chunks_by_idxs_matches_split_and_cat(seed, num_chunks, spare):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, num_chunks)
    order = rng.permutation(num_chunks)
    rows = int(sizes.sum()) + spare
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    probs = rng.random(rows).astype(np.float32)
    pieces = np.split(x[:sizes.sum()], np.cumsum(sizes)[:-1])
    prob_pieces = np.split(probs[:sizes.sum()], np.cumsum(sizes)[:-1])
    want = np.concatenate([pieces[i] for i in order] + [np.zeros((spare, 4), np.float32)])
    want_p = np.concatenate([prob_pieces[i] for i in order] + [np.zeros(spare, np.float32)])
    got, got_p = mu.sort_chunks_by_idxs(jnp.asarray(x), jnp.asarray(sizes), jnp.asarray(order),
                                        probs=jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got_p), want_p)
    assert mu.sort_chunks_by_idxs(jnp.asarray(x), sizes.tolist(), order.tolist())[1] is None


def test_sort_chunks_by_idxs_gradient_is_the_inverse_reordering():
    x = jnp.arange(12, dtype=jnp.float32).reshape(6, 2)
    sizes, order = jnp.asarray([2, 1, 3]), jnp.asarray([2, 0, 1])
    weights = jnp.arange(1, 13, dtype=jnp.float32).reshape(6, 2)
    grad = jax.grad(lambda v: jnp.sum(mu.sort_chunks_by_idxs(v, sizes, order)[0] * weights))(x)
    # output rows: chunk 2 (input rows 3,4,5), chunk 0 (rows 0,1), chunk 1 (row 2)
    want = np.asarray(weights)[[3, 4, 5, 0, 1, 2]]
    np.testing.assert_array_equal(np.asarray(grad), want)


# --- activations --------------------------------------------------------------------------------

ACTIVATIONS = [
    ("swiglu", mu.swiglu, np_swiglu, mu.swiglu_back, np_swiglu_back),
    ("geglu", mu.geglu, np_geglu, mu.geglu_back, np_geglu_back),
    ("quick_geglu", mu.quick_geglu, np_quick_geglu, mu.quick_geglu_back, np_quick_geglu_back),
]


@pytest.mark.parametrize("name,act,np_act,back,np_back", ACTIVATIONS, ids=[a[0] for a in
                                                                           ACTIVATIONS])
def test_activation_and_its_back_match_the_closed_forms(name, act, np_act, back, np_back):
    rng = np.random.default_rng(11)
    y = rng.standard_normal((6, 16)).astype(np.float32) * 2
    g = rng.standard_normal((6, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(act(jnp.asarray(y))), np_act(_f64(y)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(g), jnp.asarray(y))),
                               np_back(_f64(g), _f64(y)), rtol=1e-5, atol=1e-5)


def test_quick_geglu_linear_offset_and_quick_gelu():
    rng = np.random.default_rng(12)
    y = rng.standard_normal((3, 8)).astype(np.float32)
    g = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(mu.quick_geglu(jnp.asarray(y), 1.0)),
                               np_quick_geglu(_f64(y), 1.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mu.quick_geglu_back(jnp.asarray(g), jnp.asarray(y),
                                                              1.0)),
                               np_quick_geglu_back(_f64(g), _f64(y), 1.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mu.quick_gelu(jnp.asarray(y), 1.0)),
                               _f64(y) * np_sigmoid(_f64(y)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,act,np_act,back,np_back", ACTIVATIONS, ids=[a[0] for a in
                                                                           ACTIVATIONS])
def test_weighted_back_matches_the_formulas_in_their_dtypes(name, act, np_act, back, np_back):
    rng = np.random.default_rng(13)
    y = jnp.asarray(rng.standard_normal((5, 16)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((5, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.random((5, 1)), jnp.float32)
    weighted = getattr(mu, f"weighted_{name}")
    weighted_back = getattr(mu, f"weighted_{name}_back")
    out = weighted(y, w)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np_act(_f64(y)) * _f64(w),
                               rtol=2e-2, atol=2e-2)
    d_y, d_w = weighted_back(g, y, w)
    assert d_y.dtype == jnp.bfloat16 and d_w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(d_y, np.float32),
                               np_back(_f64(g) * _f64(w), _f64(y)), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(d_w), np.sum(np_act(_f64(y)) * _f64(g), -1,
                                                       keepdims=True), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl,name", [(mu.weighted_bias_swiglu_impl, "swiglu"),
                                       (mu.weighted_bias_geglu_impl, "geglu")])
def test_weighted_impl_forward_gradient_and_shapes(impl, name):
    rng = np.random.default_rng(14)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    w = jnp.asarray(rng.random((6, 1)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    out, vjp = jax.vjp(lambda a, b: impl(a, b), x, w)
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(getattr(mu, f"weighted_{name}")(x, w)))
    d_x, d_w = vjp(g)
    want_x, want_w = getattr(mu, f"weighted_{name}_back")(g, x, w)
    np.testing.assert_allclose(np.asarray(d_x), np.asarray(want_x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(want_w), rtol=1e-6, atol=1e-6)
    three = impl(x.reshape(2, 3, 16), w)
    assert three.shape == (2, 3, 8)
    np.testing.assert_array_equal(np.asarray(three.reshape(6, 8)), np.asarray(out))


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_fp8_input_store_reads_the_fp8_input_in_the_backward(name):
    rng = np.random.default_rng(15)
    x = jnp.asarray(rng.standard_normal((8, 32)) * 3, jnp.float32)
    w = jnp.asarray(rng.random((8, 1)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    impl = getattr(mu, f"weighted_bias_{name}_impl")
    back = getattr(mu, f"weighted_{name}_back")
    out, vjp = jax.vjp(lambda a, b: impl(a, b, fp8_input_store=True), x, w)
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(getattr(mu, f"weighted_{name}")(x, w)))
    rounded = jnp.asarray(np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    want_x, want_w = back(g, rounded, w)
    d_x, d_w = vjp(g)
    np.testing.assert_allclose(np.asarray(d_x), np.asarray(want_x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(want_w), rtol=1e-6, atol=1e-6)
    exact_x, _ = back(g, x, w)
    assert not np.allclose(np.asarray(d_x), np.asarray(exact_x), rtol=1e-3, atol=1e-3)


def test_weighted_bias_quick_geglu_impl_clamp_bias_and_gradients():
    rng = np.random.default_rng(16)
    x = jnp.asarray(rng.standard_normal((2, 3, 16)) * 4, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(16), jnp.float32)
    w = jnp.asarray(rng.random((6, 1)), jnp.float32)
    clamp = 2.0

    def impl(a, b, c):
        return mu.weighted_bias_quick_geglu_impl(a, b, c, linear_offset=1.0, clamp_value=clamp)

    out = impl(x, bias, w)
    rows = np.asarray(x, np.float64).reshape(6, 16)
    gate, linear = np.split(rows, 2, -1)
    clamped = np.concatenate([np.minimum(gate, clamp), np.clip(linear, -clamp, clamp)], -1)
    want = np_quick_geglu(clamped + _f64(bias), 1.0) * _f64(w)
    assert out.shape == (2, 3, 8)
    np.testing.assert_allclose(np.asarray(out).reshape(6, 8), want, rtol=1e-5, atol=1e-5)
    g = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    _, vjp = jax.vjp(impl, x, bias, w)
    d_x, d_bias, d_w = vjp(g)
    d_in, d_b, want_w = mu.weighted_bias_quick_geglu_back(
        g.reshape(6, 8), jnp.asarray(clamped, jnp.float32), bias, w, 1.0)
    inside = np.concatenate([gate <= clamp, np.abs(linear) <= clamp], -1)  # torch.clamp's
    np.testing.assert_allclose(np.asarray(d_x).reshape(6, 16), np.asarray(d_in) * inside,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_bias), np.asarray(d_b).sum(0), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(want_w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="alpha"):
        mu.weighted_bias_quick_geglu_impl(x, None, w, alpha=1.0)
    with pytest.raises(ValueError, match="input"):
        mu.weighted_bias_quick_geglu_impl(x.reshape(-1), None, w)


def test_module_carries_megatrons_router_helpers():
    from jax_ep.flax import router
    for name in ("pad_routing_map", "sinkhorn", "topk_routing_with_score_function",
                 "z_loss_func", "get_capacity", "switch_load_balancing_loss_func"):
        assert getattr(mu, name) is getattr(router, name)
    assert mu.MoEAuxLossAutoScaler.apply is not None


def np_act(func):
    """Megatron's activation_func `func` in numpy (float64)."""
    return {"silu": np_silu, "gelu": np.vectorize(lambda v: 0.5 * v * (1 + erf(v / 2 ** 0.5))),
            "gelu_tanh": np_gelu_tanh, "quick_gelu": lambda v: v * np_sigmoid(1.702 * v),
            "relu": lambda v: np.maximum(v, 0.0),
            "squared_relu": lambda v: np.maximum(v, 0.0) ** 2}[func]


def np_gated(y, func, offset=0.0, clamp=None):
    gate, up = np.split(_f64(y), 2, -1)
    if clamp is not None:
        gate, up = np.minimum(gate, clamp), np.clip(up, -clamp, clamp)
    return np_act(func)(gate) * (up + offset)


@pytest.mark.parametrize("func", ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu",
                                  "squared_relu"])
@pytest.mark.parametrize("offset,clamp", [(0.0, None), (1.0, 7.0), (-0.5, 0.5)])
def test_gated_activation_matches_the_formulas(func, offset, clamp):
    from jax_ep.flax.activations import GatedActivation
    y = np.random.default_rng(17).standard_normal((4, 12)).astype(np.float32) * 3
    act = GatedActivation(func, offset, clamp)
    np.testing.assert_allclose(np.asarray(act(jnp.asarray(y))), np_gated(y, func, offset, clamp),
                               rtol=1e-5, atol=1e-5)
    assert hash(act) == hash(GatedActivation(func, offset, clamp))


@pytest.mark.parametrize("func", ["silu", "gelu", "gelu_tanh", "quick_gelu", "relu",
                                  "squared_relu"])
def test_non_gated_activation_is_the_function_alone(func):
    """gated_linear_unit=False (Megatron's MLP experts): act(fc1) over all F columns; the GLU
    offset and clamp are unused, as in Megatron."""
    from jax_ep.flax.activations import GatedActivation
    y = np.random.default_rng(19).standard_normal((4, 6)).astype(np.float32) * 3
    want = np_act(func)(_f64(y))
    for offset, clamp in [(0.0, None), (1.0, 0.5)]:
        act = GatedActivation(func, offset, clamp, gated_linear_unit=False)
        np.testing.assert_allclose(np.asarray(act(jnp.asarray(y))), want, rtol=1e-5, atol=1e-5)
        assert act.fc1_columns(6) == 6
    assert GatedActivation(func).fc1_columns(6) == 12


def test_moe_config_reads_megatrons_activation_fields():
    from jax_ep.flax import MoEConfig
    from jax_ep.flax.activations import GatedActivation
    cfg = MoEConfig(num_moe_experts=8, activation_func="quick_gelu", glu_linear_offset=1.0,
                    activation_func_clamp_value=7.0)
    assert cfg.gated_activation() == GatedActivation("quick_gelu", 1.0, 7.0)
    assert MoEConfig(num_moe_experts=8, activation_func=jax.nn.silu).activation_func == "silu"
    assert MoEConfig.from_dict(dict(num_moe_experts=8, activation_func="gelu_tanh")
                               ).gated_activation() == GatedActivation("gelu_tanh")
    assert MoEConfig(num_moe_experts=8, gated_linear_unit=False, activation_func=jax.nn.relu
                     ).gated_activation() == GatedActivation("relu", gated_linear_unit=False)
    # no activation_func: SwiGLU gated, Megatron's default F.gelu not gated (from_dict too)
    assert MoEConfig(num_moe_experts=8).activation_func == "silu"
    assert MoEConfig(num_moe_experts=8, gated_linear_unit=False).activation_func == "gelu"
    assert MoEConfig.from_dict(dict(num_moe_experts=8, gated_linear_unit=False)
                               ).gated_activation() == GatedActivation("gelu",
                                                                       gated_linear_unit=False)
    for field, value in [("gated_linear_unit", 1), ("activation_func", "tanh"),
                         ("glu_linear_offset", float("nan")),
                         ("activation_func_clamp_value", 0.0)]:
        with pytest.raises(ValueError, match=f"MoEConfig.{field}"):
            MoEConfig(num_moe_experts=8, **{field: value})
    # Megatron: a clamped SwiGLU takes no linear offset (other clamped GLUs may: gpt-oss's)
    with pytest.raises(ValueError, match="^MoEConfig.glu_linear_offset: expected 0 when "
                                         "activation_func_clamp_value is set for SwiGLU"):
        MoEConfig(num_moe_experts=8, glu_linear_offset=0.5, activation_func_clamp_value=0.3)
    MoEConfig(num_moe_experts=8, glu_linear_offset=0.5)
    MoEConfig(num_moe_experts=8, activation_func_clamp_value=0.3)
    MoEConfig(num_moe_experts=8, gated_linear_unit=False, activation_func="silu",
              glu_linear_offset=0.5, activation_func_clamp_value=0.3)


def test_get_tokens_per_expert_and_token_count_over_a_mesh_axis():
    from jax.sharding import PartitionSpec as P
    rng = np.random.default_rng(18)
    maps = random_routing_map(rng, 4 * 6, 5, density=0.4).reshape(4, 6, 5)
    maps[:, 5] = False  # each device's last token is padding, routed nowhere
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4])

    def counts(m, with_padding_mask):
        out = mu.get_tokens_per_expert_and_token_count(m[0], "ep", topk=2,
                                                       with_padding_mask=with_padding_mask)
        return tuple(jnp.asarray(v)[None] for v in out)

    for with_mask in (False, True):
        tpe, local, total = map(np.asarray, jax.jit(jax.shard_map(
            lambda m: counts(m, with_mask), mesh=mesh, in_specs=P("ep"),
            out_specs=(P("ep"), P("ep"), P("ep"))))(
                jax.device_put(maps, jax.sharding.NamedSharding(mesh, P("ep")))))
        want_tpe = maps.sum(axis=(0, 1))
        for d in range(4):
            np.testing.assert_array_equal(np.asarray(tpe[d]), want_tpe)
            if with_mask:
                assert float(local[d]) == maps[d].sum() / 2
                assert float(total[d]) == maps.sum() / 2
            else:
                assert (int(local[d]), int(total[d])) == (6, 24)
    tpe, local, total = mu.get_tokens_per_expert_and_token_count(jnp.asarray(maps[0]), None)
    np.testing.assert_array_equal(np.asarray(tpe), maps[0].sum(0))
    assert (local, total) == (6, 6)
    with pytest.raises(ValueError, match="topk"):
        mu.get_tokens_per_expert_and_token_count(jnp.asarray(maps[0]), None,
                                                 with_padding_mask=True)


def test_clamp_has_torch_clamps_gradient_at_the_bounds():
    from jax_ep.flax.activations import GatedActivation
    act = GatedActivation("silu", 0.0, 2.0)
    gate_up = jnp.asarray([[2.0, 3.0, -2.0, 2.0, 3.0, -2.0]])  # gate [2, 3, -2], up [2, 3, -2]
    grad = np.asarray(jax.grad(lambda v: jnp.sum(act(v)))(gate_up))[0]
    gate, up = np.array([2.0, 3.0, -2.0]), np.array([2.0, 3.0, -2.0])
    clamped_gate, clamped_up = np.minimum(gate, 2.0), np.clip(up, -2.0, 2.0)
    s = np_sigmoid(clamped_gate)
    d_gate = s * (1 + clamped_gate * (1 - s)) * clamped_up * np.array([1.0, 0.0, 1.0])
    d_up = np_silu(clamped_gate) * np.array([1.0, 0.0, 1.0])  # at +-c: 1 (torch.clamp)
    np.testing.assert_allclose(grad, np.concatenate([d_gate, d_up]), rtol=1e-6, atol=1e-7)


def test_activation_func_reads_torch_functions_and_refuses_jax_gelu():
    from jax_ep.flax import MoEConfig

    def gelu(v):  # what torch.nn.functional.gelu looks like to the config
        return v
    gelu.__module__ = "torch.nn.functional"
    assert MoEConfig(num_moe_experts=8, activation_func=gelu).activation_func == "gelu"

    def squared_relu(v):  # Megatron's megatron.core.activations.squared_relu
        return v
    squared_relu.__module__ = "megatron.core.activations"
    assert MoEConfig(num_moe_experts=8, gated_linear_unit=False,
                     activation_func=squared_relu).activation_func == "squared_relu"
    with pytest.raises(ValueError, match="MoEConfig.activation_func"):
        MoEConfig(num_moe_experts=8, activation_func=jax.nn.gelu)  # tanh by default


def test_unpermute_of_no_tokens_and_drop_and_pad_rows():
    x, p, idx = mu.permute(jnp.zeros((0, 4)), jnp.zeros((0, 2), bool), jnp.zeros((0, 2)),
                           num_out_tokens=4)
    assert x.shape == (4, 4) and not np.asarray(idx + 1).any()
    y = mu.unpermute(x, idx, (0, 4), probs=jnp.zeros((0, 2)), routing_map=jnp.zeros((0, 2),
                                                                                      bool))
    assert y.shape == (0, 4)
    routing_map = jnp.asarray([[1, 0, 1], [0, 1, 1]], bool)
    x, _, idx = mu.permute(jnp.ones((2, 4)), routing_map, num_out_tokens=8, drop_and_pad=True)
    assert x.shape == (6, 4)  # 3 experts x capacity 8 // 3 = 2, as PyTorch's E * capacity
    np.testing.assert_array_equal(np.asarray(idx), [0, -1, 1, -1, 0, 1])


def test_bias_is_added_in_the_promoted_dtype():
    rng = np.random.default_rng(19)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(8) * 1e-3, jnp.float32)
    w = jnp.ones((4, 1), jnp.float32)
    out = mu.weighted_bias_quick_geglu_impl(x, bias, w)
    assert out.dtype == jnp.bfloat16
    want = np_quick_geglu(_f64(x) + _f64(bias))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=8e-3, atol=1e-6)

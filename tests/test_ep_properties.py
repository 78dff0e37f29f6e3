"""Hypothesis properties of the layer-2 modes (normal, HybridEP, low-latency) over ranks,
shapes and routings (T = 0, empty ranks, K > L, unrouted tokens, capacity and receive-budget
drops), against numpy oracles built from an all-gather of every rank's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from ep_utils import AXIS, deepep_layout, dense_routing, ep_mesh, hybridep_oracle, run_ep
from hypothesis import given
from hypothesis import strategies as st

import jax_ep
from jax_ep import deepep, hybridep
from jax_ep.flax import MoEFlexTokenDispatcher

H = 4


@st.composite
def ep_routings(draw):
    """(num_ranks, T, K, E, x [P*T,H], topk_idx [P*T,K] distinct ids or -1, weights)."""
    num_ranks = draw(st.sampled_from([1, 2, 4]))
    num_local = draw(st.integers(1, 3))
    num_experts = num_ranks * num_local
    top_k = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 5))
    unrouted = draw(st.sampled_from([0.0, 0.3, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    rows = num_ranks * num_tokens
    idx = np.argsort(rng.random((rows, num_experts)), axis=1)[:, :top_k]
    if rows and draw(st.booleans()):  # rank 0's experts get nothing
        idx = np.where(idx < num_local, -1, idx)
    idx = np.where(rng.random(idx.shape) < unrouted, -1, idx).astype(np.int32)
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    x = rng.standard_normal((rows, H)).astype(np.float32)
    return num_ranks, num_tokens, top_k, num_experts, x, idx, w


def _deepep_oracle(x, idx, w, num_ranks, num_experts, capacity, num_recv):
    """Per destination the rows kept (each source block cut to `capacity` rows, then the
    source-major list cut to num_recv rows), and per source rank the rows it dropped."""
    want = deepep_layout(x, idx, w, num_ranks, num_experts)
    dropped = np.zeros(num_ranks, np.int64)
    for d in want:
        kept, per_source = [], np.zeros(num_ranks, np.int64)
        for j, (p, _) in enumerate(d["src"]):
            if per_source[p] < capacity and len(kept) < num_recv:
                kept.append(j)
                per_source[p] += 1
            else:
                dropped[p] += 1
        for key in ("x", "idx", "w"):
            d[key] = d[key][kept]
        d["src"] = [d["src"][j] for j in kept]
    return want, dropped


@given(ep_routings(), st.sampled_from(["deepep", "alltoall"]), st.data())
def test_dispatch_and_combine_match_the_oracle(routing, backend, data):
    num_ranks, T, K, E, x, idx, w = routing
    capacity = data.draw(st.sampled_from([None, 1, 2]), label="capacity")
    cap = T if capacity is None else min(capacity, T)  # no more rows than tokens
    num_worst = data.draw(st.sampled_from([None, max(1, num_ranks * cap - 1)]),
                          label="num_worst_tokens")
    R = num_ranks * cap if num_worst is None else num_worst

    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend, capacity=capacity,
                                        num_worst_tokens=num_worst)
        out, _ = jax_ep.combine(rx, h)
        return rx, ri, rw, h.num_recv_tokens[None], h.num_dropped[None], out

    rx, ri, rw, n, dropped, out = map(np.asarray,
                                      run_ep(body, ep_mesh(num_ranks), x, idx, w))
    want, want_dropped = _deepep_oracle(x, idx, w, num_ranks, E, cap, R)
    copies = np.zeros(num_ranks * T)
    for d in range(num_ranks):
        rows, m = slice(d * R, (d + 1) * R), len(want[d]["src"])
        assert n[d] == m
        np.testing.assert_array_equal(rx[rows][:m], want[d]["x"])
        np.testing.assert_array_equal(ri[rows][:m], want[d]["idx"])
        np.testing.assert_array_equal(rw[rows][:m], want[d]["w"])
        assert not rx[rows][m:].any() and (ri[rows][m:] == -1).all() and not rw[rows][m:].any()
        for p, t in want[d]["src"]:
            copies[p * T + t] += 1
    np.testing.assert_array_equal(dropped, want_dropped)
    # identity experts: every kept copy comes back once
    np.testing.assert_allclose(out, x * copies[:, None], rtol=1e-6)


@given(ep_routings(), st.booleans(), st.data())
def test_hybridep_matches_the_oracle(routing, compact, data):
    num_ranks, T, K, E, x, idx, w = routing
    N = data.draw(st.integers(0, num_ranks * T * min(K, E // num_ranks) + 4), label="N")
    pad = data.draw(st.sampled_from([None, 2, 3]), label="pad_multiple")
    backend = data.draw(st.sampled_from(["deepep", "alltoall"]), label="backend")
    rm, pr = dense_routing(idx, w, E)

    def body(x, a, b):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)
        px, pp, tpe, h = hybridep.hybridep_dispatch(
            x, probs=b, num_experts=E, axis_name=AXIS, num_permuted_tokens=N,
            pad_multiple=pad, backend=backend, **kw)
        return px, pp, tpe, h.num_dropped[None]

    args = (x, idx, w) if compact else (x, rm, pr)
    px, pp, tpe, dropped = map(np.asarray, run_ep(body, ep_mesh(num_ranks), *args))
    L = E // num_ranks
    for d, (wx, wp, wt, wd) in enumerate(hybridep_oracle(x, rm, pr, num_ranks, N, pad)):
        np.testing.assert_array_equal(px[d * N:(d + 1) * N], wx)
        np.testing.assert_array_equal(pp[d * N:(d + 1) * N], wp)
        np.testing.assert_array_equal(tpe[d * L:(d + 1) * L], wt)
        assert dropped[d] == wd


@given(ep_routings(), st.integers(0, 2))
def test_low_latency_matches_the_oracle(routing, spare_slots):
    num_ranks, T, K, E, x, idx, w = routing
    tmax = max(T, 1) + spare_slots  # num_max_dispatch_tokens_per_rank
    L = E // num_ranks

    def body(x, i, w):
        recv, count, h = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
        return recv, count, h.src_info, jax_ep.low_latency_combine(recv, i, w, h)

    recv, count, src_info, out = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    slots = num_ranks * tmax
    recv = recv.reshape(num_ranks, L, slots, H)
    count, src_info = count.reshape(num_ranks, L), src_info.reshape(num_ranks, L, slots)
    for d in range(num_ranks):
        for l in range(L):
            # one slot per (token, expert) pair: source rank ascending, token ascending inside
            selecting = [g for g in range(num_ranks * T) if d * L + l in idx[g]]
            n = len(selecting)
            assert count[d, l] == n
            np.testing.assert_array_equal(recv[d, l, :n], x[selecting])
            np.testing.assert_array_equal(src_info[d, l, :n], [g % T for g in selecting])
            assert (src_info[d, l, n:] == -1).all() and not recv[d, l, n:].any()
    # identity experts: the weighted sum of a token's copies
    want = x * np.where(idx >= 0, w, 0.0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def _linear_experts(x, num_experts, seed):
    """(scale f32[E,H]: expert e maps a row to row * scale[e], cot: a cotangent like x)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((num_experts, H)).astype(np.float32),
            rng.standard_normal(x.shape).astype(np.float32))


def _dense_loss(x, idx, w, scale, cot):
    """Single-device reference: sum(cot * sum_k w[t,k] x[t] scale[idx[t,k]])."""
    picked = jnp.where((idx >= 0)[..., None], scale[jnp.clip(idx, 0)], 0.0)
    return ((w[..., None] * x[:, None, :] * picked).sum(axis=1) * cot).sum()


# d/d(x, w) of the reference, one compiled program per shape (eagerly, every op of the grad
# would compile on its own)
_dense_grads = jax.jit(jax.grad(_dense_loss, argnums=(0, 2)))


@given(ep_routings(), st.sampled_from(["deepep", "alltoall"]))
def test_dispatch_combine_gradients_match_the_dense_reference(routing, backend):
    num_ranks, T, K, E, x, idx, w = routing
    L = E // num_ranks
    scale, cot = _linear_experts(x, E, seed=T * 31 + E)

    def ep_loss(x, w, idx, scale, cot):
        rank = jax.lax.axis_index(AXIS)
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend)
        local = jax.lax.dynamic_slice_in_dim(scale, rank * L, L)
        y = (rw[:, :, None] * rx[:, None, :] * local[jnp.clip(ri, 0)]).sum(axis=1)
        out, _ = jax_ep.combine(y, h)
        return jax.lax.psum((out * cot).sum(), AXIS)

    def body(x, w, idx, cot, scale):
        return jax.grad(ep_loss, argnums=(0, 1))(x, w, idx, scale, cot)

    d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, w, idx, cot, replicated=(scale,))
    want_x, want_w = _dense_grads(x, idx, w, scale, cot)
    np.testing.assert_allclose(d_x, want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_w, want_w, rtol=1e-5, atol=1e-5)


@given(ep_routings(), st.booleans(), st.sampled_from([None, 2, 3]))
def test_hybridep_gradients_match_the_dense_reference(routing, compact, pad):
    num_ranks, T, K, E, x, idx, w = routing
    L = E // num_ranks
    m = pad or 1
    N = L * -(-num_ranks * T // m) * m  # room for every (token, local expert) pair: no drop
    scale, cot = _linear_experts(x, E, seed=T * 37 + E)
    rm, pr = dense_routing(idx, w, E)

    def ep_loss(x, probs, routing, scale, cot):
        kw = dict(topk_idx=routing) if compact else dict(routing_map=routing)
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, probs=probs, num_experts=E,
                                                    axis_name=AXIS, num_permuted_tokens=N,
                                                    pad_multiple=pad, **kw)
        expert = jnp.searchsorted(jnp.cumsum(tpe), jnp.arange(N), side="right")
        local = jax.lax.dynamic_slice_in_dim(scale, jax.lax.axis_index(AXIS) * L, L)
        y = px * pp[:, None] * local[jnp.clip(expert, 0, L - 1)]
        out = hybridep.hybridep_combine(y, h)
        return jax.lax.psum((out * cot).sum(), AXIS)

    def body(x, probs, routing, cot, scale):
        return jax.grad(ep_loss, argnums=(0, 1))(x, probs, routing, scale, cot)

    args = (x, w, idx) if compact else (x, pr, rm)
    d_x, d_p = run_ep(body, ep_mesh(num_ranks), *args, cot, replicated=(scale,))
    want_x, want_w = _dense_grads(x, idx, w, scale, cot)
    np.testing.assert_allclose(d_x, want_x, rtol=1e-5, atol=1e-5)
    if compact:
        np.testing.assert_allclose(d_p, want_w, rtol=1e-5, atol=1e-5)
    else:  # d probs[t, e]: x[t] . (scale[e] * cot[t]) wherever e is routed, 0 elsewhere
        want_p = np.einsum("th,eh->te", x * cot, scale) * rm
        np.testing.assert_allclose(d_p, want_p, rtol=1e-5, atol=1e-5)


@given(ep_routings(), st.sampled_from(["deepep", "alltoall", "hybridep", "uccl_ep"]),
       st.booleans())
def test_flax_dispatcher_round_trip(routing, backend, fusion):
    # token_permutation2 -> gate-weighted identity experts -> token_unpermutation gives
    # x * (sum of the token's routed probs), and its gradient is that sum times the cotangent.
    num_ranks, T, K, E, x, idx, w = routing
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_flex_dispatcher_backend=backend,
                                       moe_permute_fusion=fusion, expert_axis_name=AXIS)
    L = E // num_ranks
    dispatcher = MoEFlexTokenDispatcher(L, range(L), cfg)
    cot = np.random.default_rng(T + E).standard_normal(x.shape).astype(np.float32)

    def round_trip(x, w, idx):
        tokens, _, probs, state = dispatcher.token_permutation2(x, x.shape[0], w, idx)
        return dispatcher.token_unpermutation(tokens * probs[:, None].astype(tokens.dtype),
                                              state)

    def body(x, w, idx, cot):
        out, pull = jax.vjp(lambda x: round_trip(x, w, idx), x)
        return out, pull(cot)[0]

    out, d_x = run_ep(body, ep_mesh(num_ranks), x, w, idx, cot)
    routed = np.where(idx >= 0, w, 0.0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out, x * routed, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_x, cot * routed, rtol=1e-5, atol=1e-6)


@given(ep_routings(), st.integers(1, 4), st.sampled_from(["deepep", "alltoall"]))
def test_chunked_forward_matches_the_dense_reference(routing, chunks, backend):
    # dispatch_chunked_forward with linear experts: values and gradients of the dense model
    # for any number of chunks (empty chunks and T = 0 included).
    num_ranks, T, K, E, x, idx, w = routing
    L = E // num_ranks
    scale, cot = _linear_experts(x, E, seed=T * 41 + E + chunks)

    def ep_loss(x, w, idx, scale, cot):
        local = jax.lax.dynamic_slice_in_dim(scale, jax.lax.axis_index(AXIS) * L, L)

        def kernel(rx, ri, rw):
            return (rw[:, :, None] * rx[:, None, :] * local[jnp.clip(ri, 0)]).sum(axis=1)
        out = deepep.dispatch_chunked_forward(x, idx, w, kernel, num_local_experts=L,
                                              axis_name=AXIS, chunks=chunks, backend=backend)
        return jax.lax.psum((out * cot).sum(), AXIS), out

    def body(x, w, idx, cot, scale):
        (_, out), grads = jax.value_and_grad(ep_loss, argnums=(0, 1), has_aux=True)(
            x, w, idx, scale, cot)
        return out, *grads

    out, d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, w, idx, cot, replicated=(scale,))
    picked = np.where((idx >= 0)[..., None], scale[np.clip(idx, 0, None)], 0.0)
    np.testing.assert_allclose(out, (w[..., None] * x[:, None, :] * picked).sum(axis=1),
                               rtol=1e-5, atol=1e-5)
    want_x, want_w = _dense_grads(x, idx, w, scale, cot)
    np.testing.assert_allclose(d_x, want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_w, want_w, rtol=1e-5, atol=1e-5)

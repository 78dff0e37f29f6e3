"""DeepEP normal-mode dispatch/combine ("deepep", "alltoall", "uccl_ep") on emulated CPU ranks."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import (
    AXIS,
    dense_moe,
    deepep_layout,
    ep_mesh,
    local_experts,
    owner_count,
    random_routing,
    run_ep,
    shard,
)
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import deepep, ops

BACKENDS = ("deepep", "alltoall")


def _dispatch_outputs(mesh, x, idx, w, num_experts, backend, **kwargs):
    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=num_experts, axis_name=AXIS,
                                        backend=backend, **kwargs)
        return (rx, ri, rw, h.num_recv_tokens[None], h.num_recv_tokens_per_expert,
                h.num_dropped[None])
    return [np.asarray(a) for a in run_ep(body, mesh, x, idx, w)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_layout_matches_deepep_contract(num_ranks, backend):
    rng = np.random.default_rng(num_ranks)
    T, H, K, E = 5, 16, 3, 2 * 8
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rx, ri, rw, n, per_expert, dropped = _dispatch_outputs(ep_mesh(num_ranks), x, idx, w, E,
                                                           backend)
    R = num_ranks * T
    want = deepep_layout(x, idx, w, num_ranks, E)
    L = E // num_ranks
    for d in range(num_ranks):
        rows = slice(d * R, (d + 1) * R)
        m = len(want[d]["src"])
        assert n[d] == m
        np.testing.assert_array_equal(rx[rows][:m], want[d]["x"])
        np.testing.assert_array_equal(ri[rows][:m], want[d]["idx"])
        np.testing.assert_array_equal(rw[rows][:m], want[d]["w"])
        # padding rows: zero data, -1 ids, 0 weights
        assert not rx[rows][m:].any() and (ri[rows][m:] == -1).all() and not rw[rows][m:].any()
        counts = np.bincount(want[d]["idx"][want[d]["idx"] >= 0], minlength=L)
        np.testing.assert_array_equal(per_expert[d * L:(d + 1) * L], counts)
    assert not dropped.any()


def test_rows_encode_their_source_rank():
    num_ranks, T, H, K, E = 4, 6, 8, 4, 16
    rng = np.random.default_rng(1)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    x = np.repeat(np.arange(num_ranks, dtype=np.float32), T)[:, None] * np.ones((1, H), np.float32)
    rx, _, _, n, _, _ = _dispatch_outputs(ep_mesh(num_ranks), x, idx, w, E, "deepep")
    want = deepep_layout(x, idx, w, num_ranks, E)
    R = num_ranks * T
    for d in range(num_ranks):
        src_rank = np.array([p for p, _ in want[d]["src"]], np.float32)
        np.testing.assert_array_equal(rx[d * R:d * R + n[d], 0], src_rank)
        assert (np.diff(src_rank) >= 0).all()  # grouped by source rank ascending


@pytest.mark.parametrize("backend", BACKENDS + ("uccl_ep",))
def test_combine_of_dispatch_scales_by_owning_ranks(backend):
    num_ranks, T, H, K, E = 8, 7, 16, 4, 32
    rng = np.random.default_rng(2)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.3)
    idx[3] = -1  # an unrouted token combines to zero

    def body(x, idx, w):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend=backend)
        return jax_ep.combine(rx, h, topk_weights=rw)

    y, cw = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    np.testing.assert_allclose(y, x * owner_count(idx, E // num_ranks)[:, None], rtol=1e-6)
    assert not y[3].any()
    np.testing.assert_array_equal(cw, np.where(idx >= 0, w, 0.0))


def test_combine_dtype_sums_in_fp32_and_casts_once():
    # the all_to_all module's combine(local_out, handle, dtype=None), dtype positional: bf16
    # rows, dtype=float32 gives the fp32 sums unrounded (x * owners exactly); the default
    # returns them rounded to bf16, which differs where the owners are 3, 5, 6 or 7
    num_ranks, T, H, K, E = 8, 6, 16, 6, 32
    rng = np.random.default_rng(12)
    x = np.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, _ = random_routing(rng, num_ranks * T, K, E, unrouted=0.1)
    cot = rng.standard_normal(x.shape).astype(np.float32)

    def body(x, idx, cot):
        rx, _, _, h = jax_ep.dispatch(x, idx, num_experts=E, axis_name=AXIS)
        wide, narrow = jax_ep.combine(rx, h, jnp.float32)[0], jax_ep.combine(rx, h)[0]

        def loss(dtype):
            return lambda y: jnp.sum(jax_ep.combine(y, h, dtype)[0].astype(jnp.float32) * cot)
        return wide, narrow, jax.grad(loss(jnp.float32))(rx), jax.grad(loss(None))(rx)

    wide, narrow, d_wide, d_narrow = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx,
                                                             cot))
    owners = owner_count(idx, E // num_ranks)[:, None]
    assert wide.dtype == np.float32 and narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(wide, x.astype(np.float32) * owners)
    np.testing.assert_array_equal(narrow, np.asarray(wide, jnp.bfloat16))
    assert (narrow.astype(np.float32) != wide).any()
    np.testing.assert_array_equal(d_wide, d_narrow)  # the cotangent goes back in bf16
    # no tokens: the dtype and bias paths give empty sums
    def empty(x, idx):
        rx, _, _, h = jax_ep.dispatch(x, idx, num_experts=E, axis_name=AXIS)
        return (jax_ep.combine(rx, h, jnp.float32)[0],
                deepep.combine_with_bias(rx, h, jnp.ones((0, H), jnp.float32))[0])
    wide0, biased0 = run_ep(empty, ep_mesh(2), x[:0], idx[:0])
    assert wide0.shape == biased0.shape == (0, H) and wide0.dtype == jnp.float32
    with pytest.raises(ValueError, match="dtype: expected None or a float dtype"):
        run_ep(lambda x, idx: jax_ep.combine(*jax_ep.dispatch(x, idx, num_experts=E,
                                                              axis_name=AXIS)[::3],
                                             jnp.int32)[0], ep_mesh(2), x[:2 * T], idx[:2 * T])


def _moe_case(name, rng, num_ranks, T, K, E):
    idx, w = random_routing(rng, num_ranks * T, K, E)
    L = E // num_ranks
    if name == "empty_rank":  # nothing is routed to the last rank
        idx = np.where(idx // L == num_ranks - 1, -1, idx)
    elif name == "all_unrouted":
        idx = np.full_like(idx, -1)
    elif name == "hot_expert":
        idx[:, 0] = 3
        idx[:, 1:] = -1
    return idx.astype(np.int32), w


def _ep_moe(mesh, E, backend, **kwargs):
    def body(x, idx, w, w_in, w_out):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend, **kwargs)
        out, _ = jax_ep.combine(local_experts(rx, ri, rw, w_in, w_out), h)
        return out
    return jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 5, out_specs=P(AXIS))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,num_ranks,K", [
    ("random", 4, 3), ("random", 8, 2), ("random", 1, 2), ("empty_rank", 4, 2),
    ("all_unrouted", 4, 2), ("k_gt_l", 8, 5), ("hot_expert", 4, 2)])
def test_moe_forward_and_grad_match_dense(case, num_ranks, K, backend):
    T, H, F, E = 6, 8, 16, 16
    rng = np.random.default_rng(zlib.crc32(case.encode()))  # the same data every run
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = _moe_case(case, rng, num_ranks, T, K, E)
    w_in = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mesh = ep_mesh(num_ranks)
    moe = _ep_moe(mesh, E, backend)

    def ep_loss(x, w, w_in, w_out, idx):
        return jnp.sum(moe(x, idx, w, w_in, w_out) * cot)

    def dense_loss(x, w, w_in, w_out, idx):
        return jnp.sum(dense_moe(x, idx, w, w_in, w_out) * cot)

    args = shard(mesh, x, w, w_in, w_out, idx)
    out = jax.jit(moe)(args[0], args[4], args[1], args[2], args[3])
    np.testing.assert_allclose(out, dense_moe(x, idx, w, w_in, w_out), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(ep_loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(x, w, w_in, w_out, idx)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_overflow_drops_highest_tokens_and_counts(backend):
    num_ranks, T, H, K, E = 4, 8, 8, 1, 4
    idx = np.zeros((num_ranks * T, K), np.int32)  # every token to expert 0 (rank 0)
    idx[1::2] = 2  # odd tokens to rank 2
    x = np.arange(num_ranks * T, dtype=np.float32)[:, None].repeat(H, 1)
    w = np.ones(idx.shape, np.float32)
    cap = 3
    rx, ri, _, n, per_expert, dropped = _dispatch_outputs(ep_mesh(num_ranks), x, idx, w, E,
                                                          backend, capacity=cap)
    R = num_ranks * cap
    assert rx.shape[0] == num_ranks * R
    # each source sends 4 tokens to rank 0 and 4 to rank 2; only the first 3 survive
    np.testing.assert_array_equal(n, [4 * cap, 0, 4 * cap, 0])
    np.testing.assert_array_equal(dropped, [2, 2, 2, 2])
    for p in range(num_ranks):
        np.testing.assert_array_equal(rx[p * cap:(p + 1) * cap, 0], p * T + np.array([0, 2, 4]))
        dest2 = 2 * R + p * cap
        np.testing.assert_array_equal(rx[dest2:dest2 + cap, 0], p * T + np.array([1, 3, 5]))
    np.testing.assert_array_equal(per_expert, [12, 0, 12, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_num_worst_tokens_fills_by_source_rank_and_counts_drops(backend):
    # Every token goes to rank 0 (expert 0). R = 10 receive rows: all 8 rows of source 0, the
    # first 2 of source 1, none of sources 2 and 3; the senders count what they dropped.
    num_ranks, T, H, K, E, R = 4, 8, 4, 1, 4, 10
    idx = np.zeros((num_ranks * T, K), np.int32)
    x = np.arange(num_ranks * T, dtype=np.float32)[:, None].repeat(H, 1) + 1
    w = np.full(idx.shape, 0.5, np.float32)
    mesh = ep_mesh(num_ranks)
    rx, ri, rw, n, per_expert, dropped = _dispatch_outputs(mesh, x, idx, w, E, backend,
                                                           num_worst_tokens=R)
    assert rx.shape == (num_ranks * R, H)
    np.testing.assert_array_equal(n, [R, 0, 0, 0])
    np.testing.assert_array_equal(dropped, [0, 6, 8, 8])
    np.testing.assert_array_equal(rx[:R, 0], np.r_[np.arange(T), T, T + 1] + 1)
    np.testing.assert_array_equal(ri[:R, 0], 0)
    np.testing.assert_array_equal(rw[:R, 0], 0.5)
    assert not rx[R:].any() and (ri[R:] == -1).all() and not rw[R:].any()
    np.testing.assert_array_equal(per_expert, [R, 0, 0, 0])

    # Combine returns the kept copies; the dropped tokens come back as zero rows.
    def round_trip(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                      backend=backend, num_worst_tokens=R)
        return jax_ep.combine(rx, h)[0]
    kept = np.zeros(num_ranks * T, bool)
    kept[:T + 2] = True
    np.testing.assert_array_equal(np.asarray(run_ep(round_trip, mesh, x, idx, w)),
                                  np.where(kept[:, None], x, 0))


def test_num_worst_tokens_and_expert_alignment():
    num_ranks, T, H, K, E = 2, 4, 8, 2, 4
    rng = np.random.default_rng(5)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    rx, ri, rw, n, per_expert, _ = _dispatch_outputs(ep_mesh(num_ranks), x, idx, w, E, "deepep",
                                                     num_worst_tokens=11, expert_alignment=4)
    assert rx.shape == (num_ranks * 11, H)
    raw = np.concatenate([np.bincount(ri[d * 11:(d + 1) * 11][ri[d * 11:(d + 1) * 11] >= 0],
                                      minlength=2) for d in range(num_ranks)])
    np.testing.assert_array_equal(per_expert, -(-raw // 4) * 4)
    # an alignment near 2^31: the counts round up to it without wrapping int32 (got [2, 2] or
    # -2^31 + 1 before)
    *_, per_expert, _ = _dispatch_outputs(ep_mesh(num_ranks), x, idx, w, E, "deepep",
                                          expert_alignment=2**31 - 1)
    np.testing.assert_array_equal(per_expert, np.where(raw > 0, 2**31 - 1, 0))


def test_align_up_hand_checked():
    align_up = jax_ep.ops.align_up
    counts = jnp.array([0, 1, 4, 5, 7, -5, 2**31 - 1], jnp.int32)
    np.testing.assert_array_equal(align_up(counts, 4), [0, 4, 4, 8, 8, -4, 2**31 - 4])
    np.testing.assert_array_equal(align_up(counts, 1), counts)
    # past 2^31 - 1 the largest multiple that fits
    np.testing.assert_array_equal(align_up(counts, 2**31 - 1),
                                  [0, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 0, 2**31 - 1])
    np.testing.assert_array_equal(align_up(jnp.array([2**30 + 1, 2**30], jnp.int32), 2**30),
                                  [2**30, 2**30])
    for bad in (0, -4, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="^expert_alignment: expected an int"):
            align_up(counts, bad)


def test_precomputed_layout_gives_the_same_dispatch():
    num_ranks, T, H, K, E = 4, 5, 8, 3, 16
    rng = np.random.default_rng(12)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)

    def body(x, idx, w):
        layout = jax_ep.ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks)
        a = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout=layout)
        b = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        return a[0], b[0], a[1], b[1]

    a, b, ai, bi = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ai, bi)
    with pytest.raises(ValueError, match="layout.is_token_in_rank"):
        run_ep(lambda x, i, w: jax_ep.dispatch(
            x, i, w, num_experts=E, axis_name=AXIS,
            layout=(jnp.zeros(num_ranks, jnp.int32), jnp.zeros((T, 2), bool),
                    jnp.zeros(E, jnp.int32)))[0], ep_mesh(num_ranks), x, idx, w)


def test_cached_dispatch_replays_the_handle():
    num_ranks, T, H, K, E = 4, 5, 8, 2, 8
    rng = np.random.default_rng(6)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    x2 = rng.standard_normal(x.shape).astype(np.float32)

    def body(x, x2, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        rx2, ri2, rw2, _ = jax_ep.dispatch(x2, axis_name=AXIS, handle=h)
        fresh, ri3, _, _ = jax_ep.dispatch(x2, idx, w, num_experts=E, axis_name=AXIS)
        # without weights: what sending explicit ones would deliver (none are sent)
        ones_sent = jax_ep.dispatch(x2, idx, jnp.ones_like(w), num_experts=E,
                                    axis_name=AXIS)[2]
        return rx2, fresh, ri2, ri3, rw2, ones_sent

    rx2, fresh, ri2, ri3, rw2, ones_sent = map(
        np.asarray, run_ep(body, ep_mesh(num_ranks), x, x2, idx, w))
    np.testing.assert_array_equal(rx2, fresh)
    np.testing.assert_array_equal(ri2, ri3)
    np.testing.assert_array_equal(rw2, ones_sent)
    np.testing.assert_array_equal(rw2, np.where(ri2 >= 0, 1.0, 0.0))


@pytest.mark.parametrize("chunks,T", [(2, 7), (3, 7), (3, 2), (2, 1)])
def test_chunked_forward_equals_unchunked(chunks, T):
    num_ranks, H, F, K, E = 4, 8, 8, 2, 8
    rng = np.random.default_rng(chunks * 10 + T)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32) / 3
    w_out = rng.standard_normal((E, F, H)).astype(np.float32) / 3

    def body(x, idx, w, w_in, w_out):
        kernel = lambda rx, ri, rw: local_experts(rx, ri, rw, w_in, w_out)  # noqa: E731
        return deepep.dispatch_chunked_forward(x, idx, w, kernel, num_local_experts=E // num_ranks,
                                               axis_name=AXIS, chunks=chunks)

    mesh = ep_mesh(num_ranks)
    got = np.asarray(run_ep(body, mesh, x, idx, w, w_in, w_out))
    whole = np.asarray(jax.jit(_ep_moe(mesh, E, "alltoall"))(*shard(mesh, x, idx, w, w_in, w_out)))
    np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, dense_moe(x, idx, w, w_in, w_out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_forward_on_one_rank_is_the_unchunked_path(backend):
    """P = 1 (axolotl's single-rank path): chunks are ignored, bitwise equal to unchunked
    dispatch -> kernel -> combine, whose kernel sees all T rows at once."""
    T, H, F, K, E = 13, 8, 16, 2, 8
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx, w = random_routing(rng, T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32) / 3
    w_out = rng.standard_normal((E, F, H)).astype(np.float32) / 3
    seen = []

    def kernel(rx, ri, rw):
        seen.append(rx.shape[0])
        return local_experts(rx, ri, rw, w_in, w_out)

    def chunked(x, idx, w):
        return deepep.dispatch_chunked_forward(x, idx, w, kernel, num_local_experts=E,
                                               axis_name=AXIS, chunks=3, backend=backend)

    def whole(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend)
        return jax_ep.combine(kernel(rx, ri, rw), h)[0]

    mesh = ep_mesh(1)
    got = np.asarray(run_ep(chunked, mesh, x, idx, w))
    assert len(seen) == 1
    np.testing.assert_array_equal(got, np.asarray(run_ep(whole, mesh, x, idx, w)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunks,T", [(2, 1), (3, 2)])  # leading chunks empty on every rank
def test_chunked_forward_gradients_with_empty_chunks(backend, chunks, T):
    num_ranks, H, F, K, E = 4, 8, 8, 2, 8
    rng = np.random.default_rng(chunks * 10 + T + 1)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32) / 3
    w_out = rng.standard_normal((E, F, H)).astype(np.float32) / 3
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mesh = ep_mesh(num_ranks)

    def body(x, w, w_in, w_out, idx):
        kernel = lambda rx, ri, rw: local_experts(rx, ri, rw, w_in, w_out)  # noqa: E731
        return deepep.dispatch_chunked_forward(x, idx, w, kernel, num_local_experts=E // num_ranks,
                                               axis_name=AXIS, chunks=chunks, backend=backend)

    moe = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 5, out_specs=P(AXIS))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(moe(*a) * cot), argnums=(0, 1, 2, 3)))(
        *shard(mesh, x, w, w_in, w_out, idx))
    want = jax.grad(lambda x, w, w_in, w_out: jnp.sum(dense_moe(x, idx, w, w_in, w_out) * cot),
                    argnums=(0, 1, 2, 3))(x, w, w_in, w_out)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS + ("uccl_ep",))
def test_zero_tokens_dispatch_combine_and_gradients(backend):
    num_ranks, H, K, E = 4, 8, 2, 8
    x = np.zeros((0, H), np.float32)
    idx = np.zeros((0, K), np.int32)
    w = np.zeros((0, K), np.float32)

    def body(x, idx, w):
        def loss(x, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           backend=backend)
            out, _ = jax_ep.combine(rx * 2, h)
            return out.sum() + rw.sum(), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return out, *grads  # zero-sized results only (see test_hybridep's T = 0 test)

    out, d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    assert out.shape == (0, H) and d_x.shape == (0, H) and d_w.shape == (0, K)


@pytest.mark.parametrize("num_ranks,transport", [(1, "auto"), (4, "all_to_all"), (4, "peer")])
def test_top_k_zero_routes_nothing_on_every_transport(num_ranks, transport):
    # K = 0: no token is sent anywhere; the combine and both gradients are zero. (The send maps
    # stop at T*min(K, P) rows; at K = 0 they keep T rows of padding, which the padded
    # transport's gathers need.)
    T, H, E = 4, 8, 8
    x = np.arange(num_ranks * T * H, dtype=np.float32).reshape(num_ranks * T, H)
    idx = np.zeros((num_ranks * T, 0), np.int32)
    w = np.zeros((num_ranks * T, 0), np.float32)

    def body(x, idx, w):
        def loss(x, w):
            rx, ridx, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                              transport=transport)
            out, _ = jax_ep.combine(rx * 2 + 1, h)
            return jnp.sum(out ** 2) + rw.sum(), (out, h.num_recv_tokens.reshape(1))
        (_, (out, received)), grads = jax.value_and_grad(loss, argnums=(0, 1),
                                                         has_aux=True)(x, w)
        return out, received, *grads

    out, received, d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    np.testing.assert_array_equal(out, np.zeros((num_ranks * T, H), np.float32))
    np.testing.assert_array_equal(received, np.zeros(num_ranks, np.int32))
    np.testing.assert_array_equal(d_x, np.zeros_like(x))
    assert d_w.shape == (num_ranks * T, 0)


@pytest.mark.parametrize("backend", BACKENDS + ("uccl_ep",))
def test_fp8_tuple_dispatch_as_deepep(backend):
    # DeepEP's test_intranode dispatches x as (x_fp8, scales): both arrive on the same rows,
    # equal to dispatching each alone, and cast back to the bf16 dispatch's rows.
    num_ranks, T, H, K, E = 4, 5, 256, 3, 16
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)

    def body(x, idx, w):
        q, s = ops.per_token_cast_to_fp8(x)
        (rq, rs), ri, rw, h = jax_ep.dispatch((q, s), idx, w, num_experts=E, axis_name=AXIS,
                                              backend=backend)
        alone_q, ri2, rw2, _ = jax_ep.dispatch(q, idx, w, num_experts=E, axis_name=AXIS,
                                               backend=backend)
        alone_s = jax_ep.dispatch(s, axis_name=AXIS, backend=backend, handle=h)[0]
        rx = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend=backend)[0]
        back = ops.per_token_cast_back(rq, rs, dtype=jnp.float32)
        return (jax.lax.bitcast_convert_type(rq, jnp.uint8), rs,
                jax.lax.bitcast_convert_type(alone_q, jnp.uint8), alone_s, ri, ri2, rw, rw2,
                back, rx.astype(jnp.float32))

    out = [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, idx, w)]
    rq, rs, alone_q, alone_s, ri, ri2, rw, rw2, back, rx = out
    np.testing.assert_array_equal(rq, alone_q)
    np.testing.assert_array_equal(rs, alone_s)
    np.testing.assert_array_equal(ri, ri2)
    np.testing.assert_array_equal(rw, rw2)
    # e4m3 rounds to half an ulp: at most 16 (the top binade, 256..448) times the scale
    scale = np.repeat(rs, 128, axis=1)
    assert np.all(np.abs(back - rx) <= scale * 16 + 1e-12)
    assert np.abs(back).sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tuple_dispatch_gradients_match_separate_dispatches(backend):
    # Every part of a tuple is linear in its rows: its cotangent returns by the combine path.
    num_ranks, T, H, K, E = 4, 6, 8, 2, 8
    rng = np.random.default_rng(12)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    extra = rng.standard_normal((num_ranks * T, 3)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    pull_x = rng.standard_normal((num_ranks * T * num_ranks, H)).astype(np.float32)
    pull_e = rng.standard_normal((num_ranks * T * num_ranks, 3)).astype(np.float32)

    def body(x, extra, idx, w, pull_x, pull_e):
        def together(x, extra, w):
            (rx, re), _, rw, _ = jax_ep.dispatch((x, extra), idx, w, num_experts=E,
                                                 axis_name=AXIS, backend=backend)
            return (rx * pull_x).sum() + (re * pull_e).sum() + (rw ** 2).sum()

        def apart(x, extra, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           backend=backend)
            re = jax_ep.dispatch(extra, axis_name=AXIS, backend=backend, handle=h)[0]
            return (rx * pull_x).sum() + (re * pull_e).sum() + (rw ** 2).sum()
        return (*jax.grad(together, argnums=(0, 1, 2))(x, extra, w),
                *jax.grad(apart, argnums=(0, 1, 2))(x, extra, w))

    got = run_ep(body, ep_mesh(num_ranks), x, extra, idx, w, pull_x, pull_e)
    for g, want in zip(got[:3], got[3:]):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got[1])).sum() > 0


def test_tuple_dispatch_rejects_mismatched_rows():
    x = jnp.zeros((4, 128), jnp.float32)
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        jax_ep.dispatch((x, x[:3]), idx, num_experts=4, axis_name=AXIS)
    with pytest.raises(ValueError, match="tuple"):
        jax_ep.dispatch((), idx, num_experts=4, axis_name=AXIS)


def test_chunk_bounds():
    assert jax_ep.chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert jax_ep.chunk_bounds(2, 3) == [(0, 0), (0, 0), (0, 2)]
    assert jax_ep.chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="chunks"):
        jax_ep.chunk_bounds(4, 0)


def test_deepep_and_alltoall_bitwise_equal_bf16():
    num_ranks, T, H, K, E = 8, 9, 32, 4, 64
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    mesh = ep_mesh(num_ranks)

    def body(backend):
        def f(x, idx, w):
            rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                            backend=backend)
            return rx, ri, rw, jax_ep.combine(rx * 2, h)[0]
        return f

    a = run_ep(body("deepep"), mesh, x, idx, w)
    b = run_ep(body("alltoall"), mesh, x, idx, w)
    for u, v in zip(a, b):  # the combine too: both sum a token's copies in fp32, in order
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_checkpoint_policy_by_collective_name_keeps_gradients():
    num_ranks, T, H, F, K, E = 4, 5, 8, 8, 2, 8
    rng = np.random.default_rng(8)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32) / 3
    w_out = rng.standard_normal((E, F, H)).astype(np.float32) / 3
    mesh = ep_mesh(num_ranks)
    moe = _ep_moe(mesh, E, "deepep")
    policy = jax.checkpoint_policies.save_only_these_names("ep_dispatch", "ep_counts")
    remat_moe = jax.checkpoint(moe, policy=policy)
    args = shard(mesh, x, idx, w, w_in, w_out)
    loss = lambda f: lambda x, w, w_in, w_out, idx: jnp.sum(f(x, idx, w, w_in, w_out) ** 2)  # noqa
    plain = jax.jit(jax.grad(loss(moe), argnums=(0, 1, 2)))(args[0], args[2], args[3], args[4],
                                                            args[1])
    remat = jax.jit(jax.grad(loss(remat_moe), argnums=(0, 1, 2)))(args[0], args[2], args[3],
                                                                  args[4], args[1])
    for a, b in zip(plain, remat):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_jitted_train_step_has_no_host_transfers():
    num_ranks, T, H, F, K, E = 4, 5, 8, 8, 2, 8
    rng = np.random.default_rng(9)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32)
    w_out = rng.standard_normal((E, F, H)).astype(np.float32)
    mesh = ep_mesh(num_ranks)
    moe = _ep_moe(mesh, E, "deepep")

    def step(w_in, w_out, x, idx, w):
        grads = jax.grad(lambda a, b: jnp.sum(moe(x, idx, w, a, b) ** 2), argnums=(0, 1))(
            w_in, w_out)
        return w_in - 0.1 * grads[0], w_out - 0.1 * grads[1]

    args = shard(mesh, w_in, w_out, x, idx, w)
    hlo = jax.jit(step).lower(*args).compile().as_text()
    for marker in ("outfeed", "infeed", "host_callback", "python_cpu_callback", "send-done",
                   "recv-done", "CustomCallPythonCallback"):
        assert marker not in hlo, marker
    assert "jax_ep_send_layout" in hlo and "jax_ep_unpermute" in hlo


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=6), "divisible"),
    (dict(num_experts=8, num_worst_tokens=0), "num_worst_tokens"),
    (dict(num_experts=8, backend="nccl"), "backend"),
    (dict(num_experts=8, transport="nvshmem"), "transport"),
    (dict(num_experts=8, axis_name="experts"), "axis_name"),
    (dict(num_experts=8, capacity=0), "capacity"),
    (dict(num_experts=8, expert_alignment=0), "expert_alignment"),
])
def test_bad_inputs_raise_at_trace_time(kwargs, match):
    mesh = ep_mesh(4)
    x = np.zeros((16, 8), np.float32)
    idx = np.zeros((16, 2), np.int32)
    w = np.ones((16, 2), np.float32)
    kwargs = dict(axis_name=AXIS) | kwargs
    with pytest.raises(ValueError, match=match):
        run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, **kwargs)[0], mesh, x, idx, w)


@pytest.mark.parametrize("kernel,match", [
    (lambda rx, ri, rw: rx.astype(jnp.int32), "local_kernel's result: expected float"),
    (lambda rx, ri, rw: rx[:-1], "local_kernel's result: expected"),
])
def test_chunked_forward_names_a_bad_kernel_result(kernel, match):
    mesh = ep_mesh(2)
    rng = np.random.default_rng(12)
    idx, w = random_routing(rng, 8, 2, 4)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=match):
        run_ep(lambda x, i, w: deepep.dispatch_chunked_forward(
            x, i, w, kernel, num_local_experts=2, axis_name=AXIS, chunks=2), mesh, x, idx, w)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_chunked_forward_checks_chunks_on_any_mesh(num_ranks):
    # at P = 1 `chunks` is unused, and still checked: a call must not start failing once the
    # expert axis is scaled out
    rng = np.random.default_rng(13)
    idx, w = random_routing(rng, 8, 2, 4)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    for chunks, match in ((0, "^chunks: expected an int > 0, got 0"),
                          (2.0, "^chunks: expected an int, got 2.0")):
        with pytest.raises(ValueError, match=match):
            run_ep(lambda x, i, w: deepep.dispatch_chunked_forward(
                x, i, w, lambda rx, ri, rw: rx, num_local_experts=4 // num_ranks,
                axis_name=AXIS, chunks=chunks), ep_mesh(num_ranks), x, idx, w)


@pytest.mark.parametrize("chunks, T", [(2, 4), (8, 4), (2, 0)])
def test_chunked_forward_takes_the_kernels_width(chunks, T):
    # A kernel changing the row width (H -> 2H) gives [T, 2H], as combine does, with empty
    # chunks (T = 4 per rank < 8 chunks) as well: their zero rows take the kernel's width;
    # with T = 0 no chunk runs and the width is the kernel's on zero rows.
    mesh = ep_mesh(2)
    rng = np.random.default_rng(14)
    idx, w = random_routing(rng, max(2 * T, 1), 2, 4)
    idx, w = idx[:2 * T], w[:2 * T]
    x = rng.standard_normal((2 * T, 8)).astype(np.float32)

    def kernel(rx, ri, rw):
        return jnp.concatenate([rx, 2 * rx], axis=1) * rw.sum(axis=1, keepdims=True)

    def chunked(x, i, w):
        return deepep.dispatch_chunked_forward(x, i, w, kernel, num_local_experts=2,
                                               axis_name=AXIS, chunks=chunks)

    def plain(x, i, w):
        rx, ri, rw, handle = jax_ep.dispatch(x, i, w, num_experts=4, axis_name=AXIS)
        return jax_ep.combine(kernel(rx, ri, rw), handle)[0]
    got, want = (np.asarray(run_ep(f, mesh, x, idx, w)) for f in (chunked, plain))
    assert got.shape == want.shape == (2 * T, 16)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_integer_rows_dispatch_as_data_and_combines_name_y():
    """Dispatch moves rows of any dtype (DeepEP's FP8 pair travels as x_fp8 and its scales),
    so integer rows arrive exactly; combining them is an error naming y (not a layer-1
    argument name), in every mode. hybridep's probs must be float."""
    mesh = ep_mesh(2)
    rng = np.random.default_rng(11)
    idx, w = random_routing(rng, 8, 2, 4)
    x = rng.integers(-1000, 1000, (8, 8)).astype(np.int32)

    def body(x, i, w):
        ri, _, _, _ = jax_ep.dispatch(x, i, num_experts=4, axis_name=AXIS)
        rf, _, _, _ = jax_ep.dispatch(x.astype(jnp.float32), i, num_experts=4, axis_name=AXIS)
        return ri, rf
    got_int, got_float = run_ep(body, mesh, x, idx, w)
    assert got_int.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_int), np.asarray(got_float).astype(np.int32))

    def combines(x, i, w):
        xf = x.astype(jnp.float32)
        rx, _, _, h = jax_ep.dispatch(xf, i, w, num_experts=4, axis_name=AXIS)
        _, _, lh = jax_ep.low_latency_dispatch(xf, i, num_max_dispatch_tokens_per_rank=4,
                                               num_experts=4, axis_name=AXIS)
        px, _, _, hh = jax_ep.hybridep_dispatch(xf, topk_idx=i, probs=w, num_experts=4,
                                                axis_name=AXIS, num_permuted_tokens=8)
        return (lambda: jax_ep.combine(rx.astype(jnp.int32), h)[0],
                lambda: jax_ep.low_latency_combine(
                    jnp.zeros(lh.src_info.shape + (8,), jnp.int32), i, w, lh),
                lambda: jax_ep.hybridep_combine(px.astype(jnp.int32), hh))

    for which in range(3):
        with pytest.raises(ValueError, match=r"y: expected float32, bfloat16 or float16, got"):
            run_ep(lambda x, i, w: combines(x, i, w)[which](), mesh, x, idx, w)
    with pytest.raises(ValueError, match=r"probs: expected a float array, got int32"):
        run_ep(lambda x, i: jax_ep.hybridep_dispatch(
            x.astype(jnp.float32), topk_idx=i, probs=i, num_experts=4, axis_name=AXIS,
            num_permuted_tokens=8)[0], mesh, x, idx)


def test_mismatched_shapes_raise():
    mesh = ep_mesh(2)
    x = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="topk_idx"):
        run_ep(lambda x, i: jax_ep.dispatch(x, i, num_experts=4, axis_name=AXIS)[0], mesh, x,
               np.zeros((6, 2), np.int32))
    with pytest.raises(ValueError, match="topk_weights"):
        run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=4, axis_name=AXIS)[0], mesh,
               x, np.zeros((8, 2), np.int32), np.zeros((8, 3), np.float32))

    def bad_combine(x, i):
        rx, _, _, h = jax_ep.dispatch(x, i, num_experts=4, axis_name=AXIS)
        return jax_ep.combine(rx[:-1], h)[0]
    with pytest.raises(ValueError, match="y: expected"):
        run_ep(bad_combine, mesh, x, np.zeros((8, 2), np.int32))

    def source_weights_to_combine(x, i, w):  # combine's weights are per received row [R,K]
        rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=4, axis_name=AXIS)
        return jax_ep.combine(rx, h, topk_weights=w)[1]
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        run_ep(source_weights_to_combine, mesh, x, np.zeros((8, 2), np.int32),
               np.ones((8, 2), np.float32))

    def other_mode_handle(x, i):
        _, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=4,
                                              num_experts=4, axis_name=AXIS)
        return jax_ep.dispatch(x, axis_name=AXIS, handle=h)[0]
    with pytest.raises(ValueError, match="handle: expected the DispatchHandle"):
        run_ep(other_mode_handle, mesh, x, np.zeros((8, 2), np.int32))

    with pytest.raises(ValueError, match=r"x: expected a rank-2 array, got tuple"):
        run_ep(lambda x, i: jax_ep.low_latency_dispatch(
            (x, x), i, num_max_dispatch_tokens_per_rank=4, num_experts=4, axis_name=AXIS)[0],
            mesh, x, np.zeros((8, 2), np.int32))


@pytest.mark.parametrize("backend", BACKENDS + ("uccl_ep",))
@pytest.mark.parametrize("bad", [99, -5])
def test_invalid_expert_id_on_one_rank_is_unrouted_and_counted(backend, bad):
    # A CPU layer-1 kernel raises on such an id; inside dispatch that error would hit one rank
    # only and leave the others waiting in the count exchange. The modes route it nowhere.
    num_ranks, T, H, K, E = 4, 6, 8, 2, 8
    rng = np.random.default_rng(9)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    bad_idx = idx.copy()
    bad_idx[2, 0] = bad  # rank 0 only
    clean_idx = idx.copy()
    clean_idx[2, 0] = -1

    def body(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, backend=backend)
        return rx, ri, rw, h.num_invalid[None], jax_ep.combine(rx, h)[0]

    mesh = ep_mesh(num_ranks)
    got = [np.asarray(a) for a in run_ep(body, mesh, x, bad_idx, w)]
    want = [np.asarray(a) for a in run_ep(body, mesh, x, clean_idx, w)]
    np.testing.assert_array_equal(got[3], [1, 0, 0, 0])
    np.testing.assert_array_equal(want[3], [0, 0, 0, 0])
    for g, c in zip(got[:3] + got[4:], want[:3] + want[4:]):
        np.testing.assert_array_equal(g, c)

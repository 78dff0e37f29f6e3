"""DeepEP low-latency mode (one copy per (token, expert) slot, optional FP8) on CPU ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import AXIS, ep_mesh, random_routing, run_ep, shard
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ops


def calc_diff(x, y):
    """DeepEP's similarity metric: 1 - 2<x,y> / (|x|^2 + |y|^2), in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    denom = (x * x + y * y).sum()
    return 1 - 2 * (x * y).sum() / denom


def _dispatch(num_ranks, x, idx, w, tmax, E, **kw):
    def body(x, i, w):
        recv, count, h = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS, **kw)
        if kw.get("use_fp8"):
            q, s = recv
            H = q.shape[-1]
            deq = ops.per_token_cast_back(q.reshape(-1, H), s.reshape(q.shape[0] * q.shape[1], -1),
                                          use_ue8m0=kw.get("use_ue8m0", False),
                                          dtype=x.dtype).reshape(q.shape)
        else:
            deq = recv
        out = jax_ep.low_latency_combine(deq, i, w, h)
        return deq, count, h.src_info, h.layout_range, out
    return [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, idx, w)]


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_layout_counts_and_source_decoding(num_ranks):
    T, tmax, K, E, H = 5, 8, 3, 16, 128
    rng = np.random.default_rng(num_ranks)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    # rows encode (source rank, token index)
    src_rank = np.repeat(np.arange(num_ranks), T)
    tok = np.tile(np.arange(T), num_ranks)
    x = np.zeros((num_ranks * T, H), np.float32)
    x[:, 0], x[:, 1] = src_rank, tok
    recv, count, src_info, layout_range, _ = _dispatch(num_ranks, x, idx, w, tmax, E)
    L = E // num_ranks
    recv = recv.reshape(num_ranks, L, num_ranks * tmax, H)
    count = count.reshape(num_ranks, L)
    src_info = src_info.reshape(num_ranks, L, num_ranks * tmax)
    layout_range = layout_range.reshape(num_ranks, L, num_ranks, 2)
    for d in range(num_ranks):
        for l in range(L):
            e = d * L + l
            selecting = [(g // T, g % T) for g in range(num_ranks * T) if e in idx[g]]
            assert count[d, l] == len(selecting) == layout_range[d, l, :, 1].sum()
            n = count[d, l]
            got = [(int(a), int(b)) for a, b in recv[d, l, :n, :2]]
            assert got == selecting  # source rank ascending, token ascending inside
            np.testing.assert_array_equal(src_info[d, l, :n], [t for _, t in selecting])
            assert (src_info[d, l, n:] == -1).all() and not recv[d, l, n:].any()
            begins = np.cumsum(layout_range[d, l, :, 1]) - layout_range[d, l, :, 1]
            np.testing.assert_array_equal(layout_range[d, l, :, 0], begins)


def test_worst_case_block_is_full():
    # Every token of every rank picks experts 0..K-1 (all on rank 0, K = L, T = Tmax): each
    # rank's block to rank 0 holds exactly T*min(K, L) slots, the wire's block size.
    num_ranks, T, K, E, H = 4, 4, 2, 8, 128
    idx = np.tile(np.arange(K, dtype=np.int32), (num_ranks * T, 1))
    w = np.full(idx.shape, 0.5, np.float32)
    x = np.random.default_rng(7).standard_normal((num_ranks * T, H)).astype(np.float32)
    recv, count, src_info, _, out = _dispatch(num_ranks, x, idx, w, T, E)
    np.testing.assert_array_equal(count, [num_ranks * T] * K + [0] * (E - K))
    recv = recv.reshape(num_ranks, K, num_ranks * T, H)
    for l in range(K):  # expert l of rank 0: every token of every rank, in rank order
        np.testing.assert_array_equal(recv[0, l], x)
    np.testing.assert_array_equal(src_info.reshape(E, -1)[:K], np.tile(np.arange(T), (K, 4)))
    np.testing.assert_allclose(out, x, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_combine_is_weighted_sum(dtype):
    num_ranks, T, tmax, K, E, H = 4, 6, 6, 4, 16, 256
    rng = np.random.default_rng(2)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), dtype)
    *_, out = _dispatch(num_ranks, x, idx, w, tmax, E)
    want = np.asarray(x, np.float32) * np.where(idx >= 0, w, 0.0).sum(1)[:, None]
    assert not np.isnan(out.astype(np.float32)).any()
    assert calc_diff(out.astype(np.float32), want) < 1e-5


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_dispatch(round_scale, use_ue8m0):
    num_ranks, T, tmax, K, E, H = 4, 6, 8, 4, 16, 512
    rng = np.random.default_rng(3)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    *_, out = _dispatch(num_ranks, x, idx, w, tmax, E, use_fp8=True, round_scale=round_scale,
                        use_ue8m0=use_ue8m0)
    want = np.asarray(x, np.float32) * np.where(idx >= 0, w, 0.0).sum(1)[:, None]
    assert not np.isnan(out.astype(np.float32)).any()
    assert calc_diff(out.astype(np.float32), want) < 9e-4


def test_fp8_halves_the_wire_bytes(padded_auto):
    num_ranks, T, tmax, K, E, H = 2, 4, 4, 2, 4, 256
    mesh = ep_mesh(num_ranks)
    rng = np.random.default_rng(4)
    idx, _ = random_routing(rng, num_ranks * T, K, E)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)

    def wire(use_fp8):
        f = jax.shard_map(lambda x, i: jax.tree.leaves(jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS,
            use_fp8=use_fp8)[0]), mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
        # The program as jax_ep emits it (XLA:CPU later widens sub-32-bit collectives).
        text = jax.jit(f).lower(*shard(mesh, x, idx)).as_text()
        return " ".join(line for line in text.splitlines() if "all_to_all" in line)

    rows = f"tensor<{num_ranks}x{E // num_ranks * tmax}x{H}x"
    assert rows + "ui8>" in wire(True) and rows + "ui16>" not in wire(True)
    assert rows + "ui16>" in wire(False)  # bf16 rows travel as their bits


def test_gradients_match_dense_reference():
    num_ranks, T, tmax, K, E, H = 4, 5, 6, 3, 8, 16
    rng = np.random.default_rng(5)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    scale = rng.standard_normal((E, H)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mesh = ep_mesh(num_ranks)
    L = E // num_ranks

    def body(x, i, w, scale):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                 num_experts=E, axis_name=AXIS)
        return jax_ep.low_latency_combine(recv * scale[:L, None, :], i, w, h)

    moe = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=P(AXIS))

    def ep_loss(x, w, scale, i):
        return jnp.sum(moe(x, i, w, scale) * cot)

    def dense_loss(x, w, scale):
        valid = idx >= 0
        s = scale[np.where(valid, idx, 0)]  # [T,K,H]
        y = jnp.sum(jnp.where(valid[..., None], w[..., None] * s * x[:, None, :], 0.0), axis=1)
        return jnp.sum(y * cot)

    got = jax.jit(jax.grad(ep_loss, argnums=(0, 1, 2)))(*shard(mesh, x, w, scale, idx))
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, scale)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    mesh = ep_mesh(2)
    x = np.zeros((8, 100), np.float32)
    idx = np.zeros((8, 2), np.int32)

    def call(**kw):
        args = dict(num_max_dispatch_tokens_per_rank=4, num_experts=4, axis_name=AXIS) | kw
        return run_ep(lambda x, i: jax_ep.low_latency_dispatch(x, i, **args)[1], mesh, x, idx)

    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        call(num_max_dispatch_tokens_per_rank=3)
    with pytest.raises(ValueError, match="multiple of 128"):
        call(use_fp8=True)
    with pytest.raises(ValueError, match="use_ue8m0"):
        run_ep(lambda x, i: jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=4, num_experts=4, axis_name=AXIS,
            use_fp8=True, use_ue8m0=True)[1], mesh, np.zeros((8, 128), np.float32), idx)


def test_fp8_pair_refuses_to_be_differentiated():
    # The pair is forward-only; fp8_output="cast_back" is the differentiable FP8 dispatch
    # (tests/test_fp8_dispatch.py).
    num_ranks, T, tmax, K, E, H = 2, 4, 4, 2, 4, 128
    rng = np.random.default_rng(9)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    mesh = ep_mesh(num_ranks)

    def f(x, i, w):
        (q, _), _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                   num_experts=E, axis_name=AXIS, use_fp8=True)
        return jax_ep.low_latency_combine(q.astype(jnp.float32), i, w, h)

    g = jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
    with pytest.raises(ValueError, match="fp8_output.*cast_back"):
        jax.jit(jax.grad(lambda x, i, w: jnp.sum(g(x, i, w))))(*shard(mesh, x, idx, w))


def test_invalid_expert_id_on_one_rank_is_unrouted():
    # Routed nowhere (as on GPU) rather than an error on one rank mid-exchange.
    num_ranks, T, H, K, E, tmax = 4, 5, 128, 2, 8, 6
    rng = np.random.default_rng(4)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    bad_idx, clean_idx = idx.copy(), idx.copy()
    bad_idx[1, 1], clean_idx[1, 1] = E + 3, -1
    got = _dispatch(num_ranks, x, bad_idx, w, tmax, E)
    want = _dispatch(num_ranks, x, clean_idx, w, tmax, E)
    for g, c in zip(got, want):
        np.testing.assert_array_equal(g, c)

    def invalid(x, i):
        return jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                           num_experts=E, axis_name=AXIS)[2].num_invalid[None]
    np.testing.assert_array_equal(run_ep(invalid, ep_mesh(num_ranks), x, bad_idx), [1, 0, 0, 0])


def test_zero_tokens_dispatch_combine_and_gradients():
    # DeepEP allows T <= Tmax, T = 0 included.
    num_ranks, H, K, E, tmax = 4, 128, 2, 8, 3
    x = np.zeros((0, H), np.float32)
    idx = np.zeros((0, K), np.int32)
    w = np.zeros((0, K), np.float32)

    def body(x, i, w):
        def loss(x, w):
            recv, _, h = jax_ep.low_latency_dispatch(
                x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
            return jax_ep.low_latency_combine(recv * 2.0, i, w, h).sum(), recv
        (_, recv), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return recv.reshape(-1, H), *grads

    recv, d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    assert recv.shape == (num_ranks * (E // num_ranks) * num_ranks * tmax, H)
    assert not np.asarray(recv).any()
    assert d_x.shape == (0, H) and d_w.shape == (0, K)


def test_recv_count_is_int32_under_x64():
    """recv_count is documented i32[L]: a sum of i32 counts, which x64 would widen (issue 22)."""
    num_ranks, T, tmax, K, E = 2, 3, 4, 2, 4
    rng = np.random.default_rng(11)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, 8)).astype(np.float32)
    with jax.enable_x64(True):
        _, count, _, layout_range, _ = _dispatch(num_ranks, x, idx, w, tmax, E)
    assert count.dtype == np.int32 and layout_range.dtype == np.int32
    # Per rank the counts are the slots of its experts: every routed slot once over the ranks.
    assert count.sum() == (idx >= 0).sum()
    np.testing.assert_array_equal(count, layout_range[..., 1].reshape(-1, num_ranks).sum(-1))

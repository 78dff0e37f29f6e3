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
    assert calc_diff(out.astype(np.float32), want) < 1e-5  # DeepEP's check
    # the fp32 sum of the weighted copies, cast once to x's dtype
    rtol = 1e-6 if dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=rtol, atol=1e-6)


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


def _expert_scaling_losses(seed, transport="auto", activation=lambda v: v):
    """(loss of the low-latency round trip dispatch -> activation(rows * scale[expert]) ->
    combine, the dense model's loss, their sharded and plain arguments): 4 ranks, T = 5,
    Tmax = 6, K = 3, E = 8, H = 16, a fixed random cotangent."""
    num_ranks, T, tmax, K, E, H = 4, 5, 6, 3, 8, 16
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    scale = rng.standard_normal((E, H)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mesh = ep_mesh(num_ranks)
    L = E // num_ranks

    def body(x, i, w, scale):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                 num_experts=E, axis_name=AXIS,
                                                 transport=transport)
        return jax_ep.low_latency_combine(activation(recv * scale[:L, None, :]), i, w, h)

    moe = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=P(AXIS))

    def ep_loss(x, w, scale, i):
        return jnp.sum(moe(x, i, w, scale) * cot)

    def dense_loss(x, w, scale):
        valid = idx >= 0
        s = scale[np.where(valid, idx, 0)]  # [T,K,H]
        y = jnp.sum(jnp.where(valid[..., None], w[..., None] * activation(s * x[:, None, :]),
                              0.0), axis=1)
        return jnp.sum(y * cot)

    return ep_loss, dense_loss, shard(mesh, x, w, scale, idx), (x, w, scale)


def test_gradients_match_dense_reference():
    ep_loss, dense_loss, sharded, plain = _expert_scaling_losses(5)
    got = jax.jit(jax.grad(ep_loss, argnums=(0, 1, 2)))(*sharded)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(*plain)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["all_to_all", "peer"])  # ragged: GPU only
def test_gradients_of_gradients_match_dense_reference(transport):
    """Second order (the gradient of a gradient penalty) through dispatch -> tanh experts ->
    combine: every VJP of the round trip is itself differentiable (the return's VJP is the
    dispatch-direction exchange, unpermute's a gather, and back), equal to the dense model's."""
    ep_loss, dense_loss, sharded, plain = _expert_scaling_losses(15, transport, jnp.tanh)

    def penalty(loss):
        return lambda *a: sum(jnp.sum(g ** 2) for g in jax.grad(loss, argnums=(0, 1, 2))(*a))

    got = jax.jit(jax.grad(penalty(ep_loss), argnums=(0, 1, 2)))(*sharded)
    want = jax.grad(penalty(dense_loss), argnums=(0, 1, 2))(*plain)
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


def test_zero_hidden_size_dispatch_combine_and_gradients():
    """H = 0 (as the normal mode takes it): empty rows move, the counts and the layout are those
    of any H, and the gradients are empty. A reshape inferring -1 from zero-size rows failed
    with ZeroDivisionError before."""
    num_ranks, T, K, E, tmax = 4, 3, 2, 8, 3
    rng = np.random.default_rng(5)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = np.zeros((num_ranks * T, 0), np.float32)

    def body(x, i, w):
        def loss(x, w):
            recv, count, h = jax_ep.low_latency_dispatch(
                x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
            out = jax_ep.low_latency_combine(recv * 2.0, i, w, h)
            return out.sum(), (recv, count, out)
        (_, (recv, count, out)), grads = jax.value_and_grad(loss, argnums=(0, 1),
                                                            has_aux=True)(x, w)
        return recv.reshape(recv.shape[0] * recv.shape[1], 0), count, out, *grads

    recv, count, out, d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    L = E // num_ranks
    assert recv.shape == (num_ranks * L * num_ranks * tmax, 0) and out.shape == (num_ranks * T, 0)
    assert d_x.shape == (num_ranks * T, 0) and not np.asarray(d_w).any()
    want = [sum(e in row for row in idx) for e in range(E)]
    np.testing.assert_array_equal(np.asarray(count), want)


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


def _handle_as_deepep_tuple(num_ranks, x, idx, tmax, E, seen):
    """Dispatches and reads the handle as DeepEP's test does (handle[0], handle[1], unpacking);
    records the static items and the pytree view in `seen`."""
    def body(x, i):
        _, count, h = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
        src_info, layout_range, t, hidden, e = h
        seen["static"] = (len(h), t, hidden, e, h[2], h[3], h[4], h[-1], h[2:])
        seen["same"] = (h[0] is h.src_info, src_info is h.src_info, h[-5] is h.src_info)
        leaves, tree = jax.tree.flatten(h)
        seen["pytree"] = (len(leaves), type(jax.tree.unflatten(tree, leaves)))
        with pytest.raises(IndexError):
            h[5]
        return count, src_info, layout_range, h[1], h.layout_range
    return [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, idx)]


def test_handle_reads_as_deepeps_tuple():
    """DeepEP's handle is (src_info, layout_range, Tmax, hidden, num_experts) with
    layout_range int64 [L,P] = begin << 32 | count; its test reads handle[0][i] and
    handle[1][i]. LowLatencyHandle gives those (index 1 under x64), its fields and pytree
    unchanged."""
    num_ranks, T, tmax, K, E, H = 4, 5, 6, 3, 16, 128
    L = E // num_ranks
    rng = np.random.default_rng(13)
    idx, _ = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    seen = {}
    with jax.enable_x64(True):
        count, src_info, packed, h1, pairs = _handle_as_deepep_tuple(num_ranks, x, idx, tmax,
                                                                     E, seen)
    assert seen["static"] == (5, tmax, H, E, tmax, H, E, E, (tmax, H, E))
    assert seen["same"] == (True, True, True)
    assert seen["pytree"] == (9, jax_ep.LowLatencyHandle)  # the array fields, stats None
    assert packed.dtype == h1.dtype == np.int64 and packed.shape == (num_ranks * L, num_ranks)
    assert pairs.dtype == np.int32 and pairs.shape == (num_ranks * L, num_ranks, 2)
    np.testing.assert_array_equal(packed, h1)
    np.testing.assert_array_equal(packed, (pairs[..., 0].astype(np.int64) << 32) | pairs[..., 1])
    # DeepEP's checks, as its test_low_latency.py writes them.
    int_mask = (1 << 32) - 1
    np.testing.assert_array_equal((packed & int_mask).sum(-1), count)
    np.testing.assert_array_equal(packed >> 32, np.cumsum(pairs[..., 1], -1) - pairs[..., 1])
    for e in range(E):
        assert count[e] == (idx == e).sum()
        for j in range(num_ranks):
            begin, n = packed[e, j] >> 32, packed[e, j] & int_mask
            assert n == (idx[j * T:(j + 1) * T] == e).sum()
            rows = src_info[e, begin:begin + n]  # [P*L, P*Tmax] over the ranks
            np.testing.assert_array_equal(rows, np.nonzero((idx[j * T:(j + 1) * T] == e)
                                                           .any(-1))[0])


def test_handle_packed_layout_needs_x64():
    num_ranks, T, tmax, K, E = 2, 3, 4, 2, 4
    rng = np.random.default_rng(14)
    idx, _ = random_routing(rng, num_ranks * T, K, E)
    x = rng.standard_normal((num_ranks * T, 128)).astype(np.float32)
    msg = (r"^handle\[1\]: DeepEP's packed layout_range \(int64 begin << 32 \| count\) needs "
           r"jax_enable_x64 inside a traced function; enable it .* read handle\[1\] outside, "
           r"or use handle.layout_range, i32\[L,P,2\]")
    with pytest.raises(ValueError, match=msg):
        _handle_as_deepep_tuple(num_ranks, x, idx, tmax, E, {})
    # a handle returned from the program and read on the host: numpy's int64, no x64 needed
    with jax.enable_x64(True):
        packed = _handle_as_deepep_tuple(num_ranks, x, idx, tmax, E, {})[2]
    trees = {}

    def whole_handle(x, i):
        _, _, h = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
        leaves, trees["handle"] = jax.tree.flatten(h)
        return [jnp.asarray(a)[None] for a in leaves]  # a rank axis on every leaf

    leaves = run_ep(whole_handle, ep_mesh(num_ranks), x, idx)
    L = E // num_ranks
    for rank in range(num_ranks):
        h = jax.tree.unflatten(trees["handle"], [np.asarray(a)[rank] for a in leaves])
        host = h[1]
        assert isinstance(host, np.ndarray) and host.dtype == np.int64
        np.testing.assert_array_equal(host, packed[rank * L:(rank + 1) * L])

    seen = {}

    def other_items(x, i):  # need no x64
        _, _, h = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
        seen["static"] = h[2:]
        return h[0]

    src_info = run_ep(other_items, ep_mesh(num_ranks), x, idx)
    assert seen["static"] == (tmax, 128, E)
    assert src_info.dtype == jnp.int32 and src_info.shape == (E, num_ranks * tmax)  # [P*L, .]


# ----------------------------------------------------------------------------- LogFMT combine


def _round_trip(y):
    """y bf16 [..., H] -> its LogFMT round trip, f32 (what arrives on the wire)."""
    flat = y.reshape(-1, y.shape[-1])
    return ops.logfmt_decode(ops.logfmt_encode(flat)).reshape(y.shape)


def _straight_through(y):
    """y's f32 value, round-tripped in the forward pass and the identity in the backward."""
    y32 = y.astype(jnp.float32)
    return y32 + (_round_trip(jax.lax.stop_gradient(y)) - jax.lax.stop_gradient(y32))


def _deepep_logfmt_rows(rng, n, h):
    """DeepEP's test rows for use_logfmt: randn * 0.5 * U(0,1) per row (most), randn * 0.1,
    and one kind of large constants (rank - 128, the last 128 channels the token id)."""
    kind = np.arange(n) % 6
    x = rng.standard_normal((n, h)) * 0.5 * rng.uniform(0, 1, (n, 1))
    x = np.where(kind[:, None] == 4, rng.standard_normal((n, h)) * 0.1, x)
    const = np.full((n, h), -125.0)
    const[:, -128:] = np.arange(n)[:, None] % 64
    return np.where(kind[:, None] == 5, const, x)


@pytest.mark.parametrize("transport", ["all_to_all", "peer"])  # ragged: GPU only
def test_logfmt_combine_values_and_gradients(transport):
    # Values: the non-LogFMT combine applied to the round trip of the rows, exactly. Gradients:
    # jax.vjp of that reference with the cast as the identity (straight-through), exactly.
    num_ranks, T, tmax, K, E, H = 8, 6, 8, 3, 16, 1536  # 512-channel chunks
    rng = np.random.default_rng(21)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = jnp.asarray(_deepep_logfmt_rows(rng, num_ranks * T, H), jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)

    def body(x, i, w, cot):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                 num_experts=E, axis_name=AXIS,
                                                 transport=transport)
        got, got_vjp = jax.vjp(
            lambda y, w: jax_ep.low_latency_combine(y, i, w, h, use_logfmt=True), recv, w)
        want, want_vjp = jax.vjp(lambda y, w: jax_ep.low_latency_combine(
            _straight_through(y), i, w, h).astype(jnp.bfloat16), recv, w)
        plain = jax_ep.low_latency_combine(recv, i, w, h)
        return got, want, plain, *got_vjp(cot), *want_vjp(cot)

    outs = [np.asarray(a).astype(np.float32)
            for a in run_ep(body, ep_mesh(num_ranks), x, idx, w, cot)]
    got, want, plain, d_y, d_w, want_d_y, want_d_w = outs
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(d_y, want_d_y)
    np.testing.assert_array_equal(d_w, want_d_w)
    assert (got != plain).any() and np.abs(d_y).max() > 0 and np.abs(d_w).max() > 0
    # DeepEP's acceptance: calc_diff against x * Σ w below 1e-5, as without LogFMT.
    ref = np.asarray(x, np.float32) * np.where(idx >= 0, w, 0.0).sum(1)[:, None]
    assert not np.isnan(got).any()
    assert calc_diff(got + 1, ref + 1) < 1e-5
    assert calc_diff(got, ref) > calc_diff(plain, ref)  # lossier than the bf16 combine


def test_logfmt_combine_end_to_end_gradients_match_dense_reference():
    # dispatch -> combine(use_logfmt) of x is rt(x) * Σ_k w_k; straight-through, its gradient
    # is the dense bf16 one: d x = cot * Σ_k w_k, d w_k = <cot, rt(x)>.
    num_ranks, T, tmax, K, E, H = 8, 4, 4, 2, 8, 1024
    rng = np.random.default_rng(22)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)) * 0.2, jnp.bfloat16)
    # bf16 values: the combine's output is bf16, so its cotangent is rounded to bf16.
    cot = np.asarray(jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16),
                     np.float32)
    mesh = ep_mesh(num_ranks)

    def body(x, i, w):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                 num_experts=E, axis_name=AXIS)
        return jax_ep.low_latency_combine(recv, i, w, h, use_logfmt=True)

    moe = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))

    def loss(x, w, i):
        return jnp.sum(moe(x, i, w).astype(jnp.float32) * cot)

    def dense_loss(x, w):
        mask = jnp.asarray(idx >= 0)
        y = _straight_through(x) * jnp.where(mask, w, 0.0).sum(1)[:, None]
        return jnp.sum(y * cot)

    d_x, d_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(*shard(mesh, x, w, idx))
    want_x, want_w = jax.grad(dense_loss, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(d_x, np.float32), np.asarray(want_x, np.float32),
                               rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(want_w), rtol=1e-4, atol=1e-3)
    # Second order, straight-through again (a gradient penalty's gradient).
    def penalty(f):
        return lambda x, w, *rest: sum(jnp.sum(g.astype(jnp.float32) ** 2)
                                       for g in jax.grad(f, argnums=(0, 1))(x, w, *rest))

    got = jax.jit(jax.grad(penalty(loss), argnums=(0, 1)))(*shard(mesh, x, w, idx))
    want = jax.grad(penalty(dense_loss), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(r).max() > 0 and np.linalg.norm(g - r) <= 1e-2 * np.linalg.norm(r)


def test_logfmt_combine_with_zero_tokens_and_an_empty_rank():
    num_ranks, H, K, E, tmax = 4, 512, 2, 8, 3
    x = np.zeros((0, H), jnp.bfloat16)
    idx = np.zeros((0, K), np.int32)
    w = np.zeros((0, K), np.float32)

    def body(x, i, w):
        def loss(x, w):
            recv, _, h = jax_ep.low_latency_dispatch(
                x, i, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS)
            return jax_ep.low_latency_combine(recv, i, w, h, use_logfmt=True).sum()
        return jax.grad(loss, argnums=(0, 1))(x, w)

    d_x, d_w = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    assert d_x.shape == (0, H) and d_w.shape == (0, K)
    # One rank routes nothing anywhere and no token picks rank 3's experts.
    T = 3
    rng = np.random.default_rng(23)
    idx, w = random_routing(rng, num_ranks * T, K, 6, unrouted=0.0)
    idx[:T] = -1
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)) * 0.1, jnp.bfloat16)
    *_, out = _dispatch(num_ranks, x, idx, w, T, E)

    def logfmt(x, i, w):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=T,
                                                 num_experts=E, axis_name=AXIS)
        return jax_ep.low_latency_combine(recv, i, w, h, use_logfmt=True)

    got = np.asarray(run_ep(logfmt, ep_mesh(num_ranks), x, idx, w)).astype(np.float32)
    assert not got[:T].any()
    want = np.asarray(x, np.float32) * np.where(idx >= 0, w, 0.0).sum(1)[:, None]
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=1e-3)
    assert (got != out.astype(np.float32)).any()

"""Layer 1: get_dispatch_layout, build_send_layout and indices_to_multihot (CPU).

FFI (impl="ffi") against the pure-JAX reference (impl="xla"), bitwise; hand-computed cases
from docs/contract.md; edge cases; gradients; jit / vmap / shard_map; argument errors.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _helpers import cuda_contract, jit_op, ref
from jax_ep import ops

# (T, K, E, P): K > L in several rows (L = E / P), P = 1, P = E, T = 1.
LAYOUT_CASES = [
    (1, 1, 1, 1),
    (1, 2, 8, 2),
    (7, 2, 4, 4),
    (16, 4, 8, 4),   # K=4 > L=2
    (33, 3, 6, 3),
    (64, 8, 64, 8),
    (50, 6, 8, 8),   # L=1
    (40, 8, 8, 2),   # K == E
]


def _assert_layout_equal(a, b):
    for name, x, y in zip(("num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert"),
                          a, b):
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def _assert_send_equal(a: ops.SendLayout, b: ops.SendLayout):
    for name in ops.SendLayout._fields:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def _numpy_dispatch_layout(idx, num_experts, num_ranks):
    """Loop version of contract layer 1 item 1, independent of jax_ep."""
    num_local = num_experts // num_ranks
    per_rank = np.zeros(num_ranks, np.int32)
    in_rank = np.zeros((idx.shape[0], num_ranks), bool)
    per_expert = np.zeros(num_experts, np.int32)
    for t, row in enumerate(idx):
        for e in row:
            if e < 0:
                continue
            per_expert[e] += 1
            in_rank[t, e // num_local] = True
    per_rank[:] = in_rank.sum(axis=0)
    return per_rank, in_rank, per_expert


def _numpy_send_layout(idx, weights, num_ranks, num_local):
    """Loop version of contract layer 1 item 2, independent of jax_ep."""
    T, K = idx.shape
    rows = T * num_ranks
    tok = np.full(rows, -1, np.int32)
    rank = np.full(rows, -1, np.int32)
    local = np.full((rows, K), -1, np.int32)
    w = np.zeros((rows, K), np.float32)
    counts = np.zeros(num_ranks, np.int32)
    row = 0
    for r in range(num_ranks):
        for t in range(T):
            owned = [(k, e) for k, e in enumerate(idx[t]) if e >= 0 and e // num_local == r]
            if not owned:
                continue
            tok[row], rank[row] = t, r
            for k, e in owned:
                local[row, k] = e - r * num_local
                w[row, k] = weights[t, k]
            counts[r] += 1
            row += 1
    return tok, rank, local, w, counts, np.int32(row)


# ----------------------------------------------------------------------------- dispatch layout


@pytest.mark.parametrize("T,K,E,num_ranks", LAYOUT_CASES)
def test_dispatch_layout_ffi_matches_reference(rng, make_routing, T, K, E, num_ranks):
    idx = jnp.asarray(make_routing(rng, T, K, E))
    ffi = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks)
    want = ref(ops.get_dispatch_layout, idx, num_experts=E, num_ranks=num_ranks)
    _assert_layout_equal(ffi, want)
    _assert_layout_equal(ffi, _numpy_dispatch_layout(np.asarray(idx), E, num_ranks))
    assert ffi[0].dtype == jnp.int32 and ffi[1].dtype == jnp.bool_ and ffi[2].dtype == jnp.int32
    assert ffi[0].shape == (num_ranks,) and ffi[1].shape == (T, num_ranks)
    assert ffi[2].shape == (E,)


def test_dispatch_layout_spec_example():
    idx = jnp.array([[0, 1], [2, 5]], jnp.int32)
    for impl in ("ffi", "xla"):
        per_rank, in_rank, per_expert = jit_op(ops.get_dispatch_layout, idx, num_experts=8,
                                               num_ranks=2, impl=impl)
        np.testing.assert_array_equal(per_rank, [2, 1])
        np.testing.assert_array_equal(in_rank, [[True, False], [True, True]])
        np.testing.assert_array_equal(per_expert, [1, 1, 1, 0, 0, 1, 0, 0])


@pytest.mark.parametrize("dtype,bad", [(np.int64, 2**32 + 3), (np.int64, -(2**32) + 3),
                                       (np.uint32, 2**32 - 1), (np.uint64, 2**33)])
def test_wide_expert_ids_outside_range_are_not_wrapped_into_range(dtype, bad):
    # 2^32 + 3 cast to int32 would be expert 3; it must stay an error (CPU) / unrouted (ref).
    with jax.enable_x64(True):
        idx = jnp.asarray(np.array([[1, 0], [2, bad]], dtype))
        w = jnp.ones((2, 2), jnp.float32)
        impls = ["xla"]
        if cuda_contract():  # the CUDA handlers count the id as unrouted, as the reference does
            impls.append("ffi")
        else:
            # the position names the user's id; the message says what -2 stands for
            with pytest.raises(Exception, match=r"flat position 3 .* uint64 array outside"):
                jax.block_until_ready(ops.get_dispatch_layout(idx, num_experts=8, num_ranks=2))
            with pytest.raises(Exception, match="outside"):
                jax.block_until_ready(ops.indices_to_multihot(idx, w, num_experts=8))
        for impl in impls:
            _, _, per_expert = ops.get_dispatch_layout(idx, num_experts=8, num_ranks=2, impl=impl)
            np.testing.assert_array_equal(per_expert, [1, 1, 1, 0, 0, 0, 0, 0])
            routing_map, _ = ops.indices_to_multihot(idx, w, num_experts=8, impl=impl)
            assert int(routing_map.sum()) == 3


def test_dispatch_layout_int64_topk_idx_accepted():
    idx = np.array([[3, -1], [0, 7]], np.int64)
    for impl in ("ffi", "xla"):
        per_rank, in_rank, per_expert = ops.get_dispatch_layout(idx, num_experts=8, num_ranks=4,
                                                                impl=impl)
        np.testing.assert_array_equal(per_rank, [1, 1, 0, 1])
        np.testing.assert_array_equal(in_rank, [[False, True, False, False],
                                                [True, False, False, True]])
        np.testing.assert_array_equal(per_expert, [1, 0, 0, 1, 0, 0, 0, 1])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_dispatch_layout_all_unrouted(impl):
    idx = jnp.full((5, 3), -1, jnp.int32)
    per_rank, in_rank, per_expert = jit_op(ops.get_dispatch_layout, idx, num_experts=8,
                                           num_ranks=4, impl=impl)
    np.testing.assert_array_equal(per_rank, np.zeros(4))
    np.testing.assert_array_equal(in_rank, np.zeros((5, 4), bool))
    np.testing.assert_array_equal(per_expert, np.zeros(8))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_dispatch_layout_one_expert_gets_everything(impl):
    idx = jnp.array([[5, -1, -1]] * 9, jnp.int32)
    per_rank, in_rank, per_expert = jit_op(ops.get_dispatch_layout, idx, num_experts=8,
                                           num_ranks=4, impl=impl)
    np.testing.assert_array_equal(per_rank, [0, 0, 9, 0])
    assert np.asarray(in_rank)[:, 2].all() and not np.asarray(in_rank)[:, [0, 1, 3]].any()
    np.testing.assert_array_equal(per_expert, [0, 0, 0, 0, 0, 9, 0, 0])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_dispatch_layout_token_counts_once_per_rank(impl):
    # K=4 > L=2: all four experts of token 0 live on two ranks.
    idx = jnp.array([[0, 1, 2, 3], [0, -1, 7, -1]], jnp.int32)
    per_rank, in_rank, per_expert = jit_op(ops.get_dispatch_layout, idx, num_experts=8,
                                           num_ranks=4, impl=impl)
    np.testing.assert_array_equal(per_rank, [2, 1, 0, 1])
    np.testing.assert_array_equal(in_rank, [[1, 1, 0, 0], [1, 0, 0, 1]])
    np.testing.assert_array_equal(per_expert, [2, 1, 1, 1, 0, 0, 0, 1])


# ----------------------------------------------------------------------------- send layout


def test_send_layout_spec_example():
    idx = jnp.array([[0, 1], [2, 5]], jnp.int32)
    w = jnp.array([[0.5, 0.25], [0.125, 2.0]], jnp.float32)
    for impl in ("ffi", "xla"):
        lay = jit_op(ops.build_send_layout, idx, w, num_ranks=2, num_local_experts=4,
                     impl=impl)
        np.testing.assert_array_equal(lay.send_counts, [2, 1])
        assert int(lay.num_send) == 3
        np.testing.assert_array_equal(lay.token_idx, [0, 1, 1, -1])
        np.testing.assert_array_equal(lay.rank, [0, 0, 1, -1])
        np.testing.assert_array_equal(lay.local_idx, [[0, 1], [2, -1], [-1, 1], [-1, -1]])
        np.testing.assert_array_equal(lay.weights,
                                      [[0.5, 0.25], [0.125, 0.0], [0.0, 2.0], [0.0, 0.0]])
        assert lay.local_idx.dtype == jnp.int32 and lay.weights.dtype == jnp.float32
        assert lay.num_send.shape == ()


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_compute_send_counts_hand_example(impl):
    # The spec's send-layout routing plus an unrouted slot: P=2, L=4.
    idx = np.array([[0, 1], [2, 5], [-1, 7]], np.int64)
    dest, in_rank, counts = jit_op(ops.compute_send_counts, idx, num_ranks=2,
                                   num_local_experts=4, impl=impl)
    np.testing.assert_array_equal(dest, [[0, 0], [0, 1], [-1, 1]])
    np.testing.assert_array_equal(in_rank, [[True, False], [True, True], [False, True]])
    np.testing.assert_array_equal(counts, [2, 2])
    assert dest.dtype == jnp.int32 and in_rank.dtype == jnp.bool_ and counts.dtype == jnp.int32


@pytest.mark.parametrize("T,K,E,num_ranks", LAYOUT_CASES)
def test_compute_send_counts_ffi_matches_reference_and_layouts(rng, make_routing, T, K, E,
                                                              num_ranks):
    idx = jnp.asarray(make_routing(rng, T, K, E))
    L = E // num_ranks
    got = ops.compute_send_counts(idx, num_ranks, L)
    want = ref(ops.compute_send_counts, idx, num_ranks=num_ranks, num_local_experts=L)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    per_rank, in_rank, _ = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks)
    np.testing.assert_array_equal(got[1], in_rank)
    np.testing.assert_array_equal(got[2], per_rank)
    lay = ops.build_send_layout(idx, jnp.ones(idx.shape, jnp.float32), num_ranks=num_ranks,
                                num_local_experts=L)
    np.testing.assert_array_equal(got[2], lay.send_counts)


def test_compute_send_counts_out_of_range_ids_are_unrouted_in_the_reference():
    # The GPU kernels and the reference count ids >= E as unrouted (the CPU kernels raise):
    # dest stays a valid rank or -1.
    idx = jnp.array([[8, 1], [-1, 5]], jnp.int32)
    dest, in_rank, counts = ops.compute_send_counts(idx, 2, 4, impl="xla")
    np.testing.assert_array_equal(dest, [[-1, 0], [-1, 1]])
    np.testing.assert_array_equal(in_rank, [[True, False], [False, True]])
    np.testing.assert_array_equal(counts, [1, 1])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_compute_send_counts_bad_arguments(impl):
    idx = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="num_ranks"):
        ops.compute_send_counts(idx, 0, 4, impl=impl)
    with pytest.raises(ValueError, match="num_local_experts"):
        ops.compute_send_counts(idx, 2, -1, impl=impl)
    with pytest.raises(ValueError, match="topk_idx"):
        ops.compute_send_counts(jnp.zeros((2,), jnp.int32), 2, 4, impl=impl)


@pytest.mark.parametrize("T,K,E,num_ranks", LAYOUT_CASES)
def test_send_layout_ffi_matches_reference(rng, make_routing, T, K, E, num_ranks):
    idx = make_routing(rng, T, K, E)
    w = rng.random((T, K)).astype(np.float32)
    L = E // num_ranks
    ffi = ops.build_send_layout(jnp.asarray(idx), jnp.asarray(w), num_ranks=num_ranks,
                                num_local_experts=L)
    want = ref(ops.build_send_layout, jnp.asarray(idx), jnp.asarray(w), num_ranks=num_ranks,
               num_local_experts=L)
    _assert_send_equal(ffi, want)
    for name, got, want in zip(ops.SendLayout._fields, ffi,
                               _numpy_send_layout(idx, w, num_ranks, L)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_send_layout_all_unrouted(impl):
    idx = jnp.full((3, 2), -1, jnp.int32)
    w = jnp.ones((3, 2), jnp.float32)
    lay = jit_op(ops.build_send_layout, idx, w, num_ranks=2, num_local_experts=2, impl=impl)
    np.testing.assert_array_equal(lay.send_counts, [0, 0])
    assert int(lay.num_send) == 0
    np.testing.assert_array_equal(lay.token_idx, np.full(6, -1))
    np.testing.assert_array_equal(lay.rank, np.full(6, -1))
    np.testing.assert_array_equal(lay.local_idx, np.full((6, 2), -1))
    np.testing.assert_array_equal(lay.weights, np.zeros((6, 2)))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_send_layout_one_rank_gets_everything_k_bigger_than_l(impl):
    # P=4, L=1 (K=3 > L): every token goes to rank 3 only (expert 3) or nowhere.
    idx = jnp.array([[3, -1, -1], [-1, 3, -1], [-1, -1, -1], [-1, -1, 3]], jnp.int32)
    w = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], jnp.float32)
    lay = jit_op(ops.build_send_layout, idx, w, num_ranks=4, num_local_experts=1,
                 impl=impl)
    np.testing.assert_array_equal(lay.send_counts, [0, 0, 0, 3])
    assert int(lay.num_send) == 3
    np.testing.assert_array_equal(lay.token_idx[:4], [0, 1, 3, -1])
    np.testing.assert_array_equal(lay.rank[:4], [3, 3, 3, -1])
    np.testing.assert_array_equal(lay.local_idx[:3], [[0, -1, -1], [-1, 0, -1], [-1, -1, 0]])
    np.testing.assert_array_equal(lay.weights[:3], [[1, 0, 0], [0, 5, 0], [0, 0, 12]])
    np.testing.assert_array_equal(lay.token_idx[3:], np.full(13, -1))


@given(T=st.integers(1, 24), K=st.integers(1, 4), P_L=st.sampled_from(
    [(1, 1), (1, 4), (2, 1), (2, 3), (4, 2), (8, 1)]), unrouted=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16))
def test_send_layout_properties(make_routing, T, K, P_L, unrouted, seed):
    num_ranks, L = P_L
    E = num_ranks * L
    K = min(K, E)
    rng = np.random.default_rng(seed)
    idx = make_routing(rng, T, K, E, unrouted=unrouted)
    w = rng.random((T, K)).astype(np.float32)
    lay = ops.build_send_layout(jnp.asarray(idx), jnp.asarray(w), num_ranks=num_ranks,
                                num_local_experts=L)
    per_rank, in_rank, _ = ops.get_dispatch_layout(jnp.asarray(idx), num_experts=E,
                                                   num_ranks=num_ranks)
    tok, rank, local = np.asarray(lay.token_idx), np.asarray(lay.rank), np.asarray(lay.local_idx)
    weights, n = np.asarray(lay.weights), int(lay.num_send)
    in_rank = np.asarray(in_rank)
    assert n == in_rank.sum()
    np.testing.assert_array_equal(lay.send_counts, per_rank)
    np.testing.assert_array_equal(lay.send_counts, in_rank.sum(axis=0))
    # Rank-major, token-ascending: (rank, token) strictly increasing over the used rows.
    keys = rank[:n].astype(np.int64) * (T + 1) + tok[:n]
    assert np.all(np.diff(keys) > 0)
    # One row per (token, owning rank), nothing else.
    assert set(zip(tok[:n], rank[:n])) == set(zip(*np.nonzero(in_rank)))
    # Padding rows.
    assert np.all(tok[n:] == -1) and np.all(rank[n:] == -1)
    assert np.all(local[n:] == -1) and np.all(weights[n:] == 0)
    # Slots: local id where the row's rank owns it, else -1 with weight 0.
    for row in range(n):
        t, r = tok[row], rank[row]
        owned = (idx[t] >= 0) & (idx[t] // L == r)
        np.testing.assert_array_equal(local[row], np.where(owned, idx[t] - r * L, -1))
        np.testing.assert_array_equal(weights[row], np.where(owned, w[t], 0.0))


# ----------------------------------------------------------------------------- multihot


def test_multihot_hand_example():
    idx = jnp.array([[0, 3], [1, 5]], jnp.int32)
    probs = jnp.array([[0.75, 0.25], [0.5, 0.125]], jnp.float32)
    want_map = np.zeros((2, 8), bool)
    want_map[0, [0, 3]] = True
    want_map[1, [1, 5]] = True
    want_probs = np.zeros((2, 8), np.float32)
    want_probs[0, 0], want_probs[0, 3], want_probs[1, 1], want_probs[1, 5] = 0.75, 0.25, 0.5, 0.125
    for impl in ("ffi", "xla"):
        routing_map, dense = jit_op(ops.indices_to_multihot, idx, probs, num_experts=8,
                                    impl=impl)
        assert routing_map.dtype == jnp.bool_ and dense.dtype == jnp.float32
        np.testing.assert_array_equal(routing_map, want_map)
        np.testing.assert_array_equal(dense, want_probs)


def test_multihot_takes_more_slots_than_experts():
    # received rows: K = 4 slots of local ids over L = 2 experts, -1 where another rank owns
    # the slot (NeMo's _indices_to_multihot); a repeated id sums its probs
    idx = jnp.array([[-1, 1, -1, 0], [-1, -1, -1, -1], [1, -1, 1, -1]], jnp.int32)
    probs = jnp.array([[9.0, 0.25, 9.0, 0.5], [1.0, 2.0, 3.0, 4.0], [0.125, 7.0, 0.5, 7.0]],
                      jnp.float32)
    want_map = np.array([[True, True], [False, False], [False, True]])
    want_probs = np.array([[0.5, 0.25], [0.0, 0.0], [0.0, 0.625]], np.float32)
    cot = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], jnp.float32)
    for impl in ("ffi", "xla"):
        routing_map, dense = jit_op(ops.indices_to_multihot, idx, probs, num_experts=2,
                                    impl=impl)
        np.testing.assert_array_equal(routing_map, want_map)
        np.testing.assert_array_equal(dense, want_probs)
        grad = jax.grad(lambda p: jnp.sum(ops.indices_to_multihot(
            idx, p, num_experts=2, impl=impl)[1] * cot))(probs)
        np.testing.assert_array_equal(grad, [[0, 2, 0, 1], [0, 0, 0, 0], [6, 0, 6, 0]])
    with pytest.raises(ValueError, match="topk_idx: top-k 4 exceeds num_experts 2"):
        ops.get_dispatch_layout(idx, num_experts=2, num_ranks=1)  # routing keeps K <= E


# The last two cases: a benchmark-sized batch, and a token count and expert count that are
# multiples of nothing in particular.
@pytest.mark.parametrize("T,K,E", [(1, 1, 1), (1, 4, 8), (9, 2, 4), (32, 8, 64), (17, 6, 6),
                                   (4096, 8, 64), (1001, 5, 20)])
@pytest.mark.parametrize("unrouted", [0.0, 0.3, 1.0])
def test_multihot_ffi_matches_reference(rng, make_routing, T, K, E, unrouted):
    idx = jnp.asarray(make_routing(rng, T, K, E, unrouted=unrouted))
    probs = jnp.asarray(rng.random((T, K)).astype(np.float32))
    ffi = ops.indices_to_multihot(idx, probs, num_experts=E)
    want = ref(ops.indices_to_multihot, idx, probs, num_experts=E)
    for x, y in zip(ffi, want):
        assert x.dtype == y.dtype and x.shape == y.shape == (T, E)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Unrouted slots leave nothing behind.
    assert int(np.asarray(ffi[0]).sum()) == int((np.asarray(idx) >= 0).sum())


@pytest.mark.parametrize("unrouted", [0.0, 0.4])
def test_multihot_grad_ffi_matches_autodiff(rng, make_routing, unrouted):
    T, K, E = 12, 3, 8
    idx = jnp.asarray(make_routing(rng, T, K, E, unrouted=unrouted))
    probs = jnp.asarray(rng.random((T, K)).astype(np.float32))
    cot = jnp.asarray(rng.standard_normal((T, E)).astype(np.float32))

    def loss(p, impl):
        _, dense = ops.indices_to_multihot(idx, p, num_experts=E, impl=impl)
        return (dense * cot).sum()

    g_ffi = jax.grad(loss)(probs, "ffi")
    g_ref = jax.grad(loss)(probs, "xla")
    np.testing.assert_array_equal(g_ffi, g_ref)
    # Dense gradient gathered at the indices, 0 on -1 slots (contract item 3).
    i = np.asarray(idx)
    want = np.where(i >= 0, np.take_along_axis(np.asarray(cot), np.maximum(i, 0), axis=1), 0)
    np.testing.assert_array_equal(g_ffi, want)
    g_jit = jax.jit(jax.grad(loss), static_argnums=1)(probs, "ffi")
    np.testing.assert_array_equal(g_jit, want)


# ------------------------------------------------------------------------ jit / vmap / shard_map


def test_layout_ops_under_jit(rng, make_routing):
    T, K, E, num_ranks = 20, 4, 16, 4
    idx = jnp.asarray(make_routing(rng, T, K, E))
    w = jnp.asarray(rng.random((T, K)).astype(np.float32))

    @partial(jax.jit, static_argnames="impl")
    def f(idx, w, impl):
        return (ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks, impl=impl),
                ops.build_send_layout(idx, w, num_ranks=num_ranks,
                                      num_local_experts=E // num_ranks, impl=impl),
                ops.indices_to_multihot(idx, w, num_experts=E, impl=impl))

    got, want = f(idx, w, "ffi"), f(idx, w, "xla")
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layout_ops_under_vmap(rng, make_routing):
    B, T, K, E, num_ranks = 3, 10, 3, 8, 2
    idx = jnp.asarray(np.stack([make_routing(rng, T, K, E) for _ in range(B)]))
    w = jnp.asarray(rng.random((B, T, K)).astype(np.float32))

    def f(idx, w, impl):
        return (ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks, impl=impl),
                ops.build_send_layout(idx, w, num_ranks=num_ranks,
                                      num_local_experts=E // num_ranks, impl=impl),
                ops.indices_to_multihot(idx, w, num_experts=E, impl=impl))

    got = jax.vmap(partial(f, impl="ffi"))(idx, w)
    for b in range(B):
        want = jax.jit(f, static_argnums=2)(idx[b], w[b], "xla")
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x)[b], np.asarray(y))
    got_jit = jax.jit(jax.vmap(partial(f, impl="ffi")))(idx, w)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(got_jit)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layout_ops_inside_shard_map(ep_mesh, rng, make_routing):
    D = ep_mesh.shape["ep"]
    T, K, E, num_ranks = 6, 4, 16, 8  # per-shard T; the layout's P is independent of the mesh
    idx = make_routing(rng, D * T, K, E)
    w = rng.random((D * T, K)).astype(np.float32)
    sharding = NamedSharding(ep_mesh, P("ep"))
    idx_s, w_s = jax.device_put(idx, sharding), jax.device_put(w, sharding)

    def local(idx, w):
        per_rank, in_rank, per_expert = ops.get_dispatch_layout(idx, num_experts=E,
                                                                num_ranks=num_ranks)
        lay = ops.build_send_layout(idx, w, num_ranks=num_ranks,
                                    num_local_experts=E // num_ranks)
        routing_map, dense = ops.indices_to_multihot(idx, w, num_experts=E)
        return (per_rank, in_rank, per_expert, lay.token_idx, lay.rank, lay.local_idx,
                lay.weights, lay.send_counts, lay.num_send[None], routing_map, dense)

    f = jax.jit(jax.shard_map(local, mesh=ep_mesh, in_specs=(P("ep"), P("ep")),
                              out_specs=P("ep")))
    got = [np.asarray(x) for x in f(idx_s, w_s)]
    for d in range(D):
        sl = slice(d * T, (d + 1) * T)
        idx_d, w_d = jnp.asarray(idx[sl]), jnp.asarray(w[sl])
        per_rank, in_rank, per_expert = ref(ops.get_dispatch_layout, idx_d, num_experts=E,
                                            num_ranks=num_ranks)
        lay = ref(ops.build_send_layout, idx_d, w_d, num_ranks=num_ranks,
                  num_local_experts=E // num_ranks)
        routing_map, dense = ref(ops.indices_to_multihot, idx_d, w_d, num_experts=E)
        want = (per_rank, in_rank, per_expert, lay.token_idx, lay.rank, lay.local_idx,
                lay.weights, lay.send_counts, lay.num_send[None], routing_map, dense)
        for x, y in zip(got, want):
            n = y.shape[0]
            np.testing.assert_array_equal(x[d * n:(d + 1) * n], np.asarray(y))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_layout_bad_arguments(impl):
    idx = jnp.zeros((4, 2), jnp.int32)
    w = jnp.ones((4, 2), jnp.float32)
    layout = partial(ops.get_dispatch_layout, impl=impl)
    send = partial(ops.build_send_layout, impl=impl)
    multihot = partial(ops.indices_to_multihot, impl=impl)
    with pytest.raises(ValueError, match="topk_idx"):
        layout(jnp.zeros((4,), jnp.int32), num_experts=8, num_ranks=2)
    with pytest.raises(ValueError, match="topk_idx"):
        layout(jnp.zeros((4, 2), jnp.float32), num_experts=8, num_ranks=2)
    with pytest.raises(ValueError, match="num_experts"):
        layout(idx, num_experts=6, num_ranks=4)
    with pytest.raises(ValueError, match="num_experts"):
        layout(idx, num_experts=0, num_ranks=1)
    with pytest.raises(ValueError, match="num_ranks"):
        layout(idx, num_experts=8, num_ranks=0)
    with pytest.raises(ValueError, match="topk_idx"):   # K=3 > E=2
        layout(jnp.zeros((4, 3), jnp.int32), num_experts=2, num_ranks=1)
    with pytest.raises(ValueError, match="topk_weights"):
        send(idx, jnp.ones((4, 3), jnp.float32), num_ranks=2, num_local_experts=4)
    with pytest.raises(ValueError, match="topk_weights"):
        send(idx, jnp.ones((4, 2), jnp.int32), num_ranks=2, num_local_experts=4)
    with pytest.raises(ValueError, match="num_local_experts"):
        send(idx, w, num_ranks=2, num_local_experts=0)
    with pytest.raises(ValueError, match="topk_idx"):   # K=3 > E=2
        send(jnp.zeros((4, 3), jnp.int32), jnp.ones((4, 3)), num_ranks=2, num_local_experts=1)
    with pytest.raises(ValueError, match="topk_idx"):
        send(jnp.zeros((2, 4, 2), jnp.int32), w, num_ranks=2, num_local_experts=4)
    with pytest.raises(ValueError, match="num_experts"):
        multihot(idx, w, num_experts=0)
    # K=2 > E=1 is allowed here (-1-masked received ids; the routing ops above refuse it)
    assert multihot(idx, w, num_experts=1)[0].shape == (4, 1)
    with pytest.raises(ValueError, match="topk_probs|topk_weights"):
        multihot(idx, jnp.ones((4, 1)), num_experts=8)
    with pytest.raises(ValueError, match="topk_idx"):
        multihot(jnp.zeros((4, 2), jnp.float32), w, num_experts=8)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("num_ranks", [0, -1])
def test_send_layout_bad_num_ranks_is_named(impl, num_ranks):
    # The caller passed num_ranks; the error must name num_ranks (not the derived num_experts).
    with pytest.raises(ValueError, match="num_ranks"):
        ops.build_send_layout(jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2), jnp.float32),
                              num_ranks=num_ranks, num_local_experts=2, impl=impl)


def test_layout_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        ops.get_dispatch_layout(jnp.zeros((2, 1), jnp.int32), num_experts=2, num_ranks=1,
                                impl="cuda")


@pytest.mark.parametrize("bad", [99, 8, -2])
def test_expert_id_out_of_range_raises_at_run_time(bad):
    idx = jnp.array([[0, 1], [2, bad]], jnp.int32)
    w = jnp.ones((2, 2), jnp.float32)
    if cuda_contract():  # unrouted on the CUDA handlers: the reference's results, bitwise
        for op, kw in [(ops.get_dispatch_layout, dict(num_experts=8, num_ranks=2)),
                       (ops.build_send_layout, dict(num_ranks=2, num_local_experts=4)),
                       (ops.indices_to_multihot, dict(num_experts=8))]:
            args = (idx,) if op is ops.get_dispatch_layout else (idx, w)
            for got, want in zip(jax.tree.leaves(op(*args, **kw)),
                                 jax.tree.leaves(op(*args, impl="xla", **kw))):
                np.testing.assert_array_equal(got, want)
        return
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(ops.get_dispatch_layout(idx, num_experts=8, num_ranks=2))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(ops.build_send_layout(idx, w, num_ranks=2, num_local_experts=4))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(ops.indices_to_multihot(idx, w, num_experts=8))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(jax.jit(partial(ops.get_dispatch_layout, num_experts=8,
                                              num_ranks=2))(idx))

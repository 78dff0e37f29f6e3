"""Layer 1: permute, unpermute and gather_rows (CPU).

FFI (impl="ffi") against the pure-JAX reference (impl="xla") and a loop oracle written from
docs/contract.md; hand-computed layouts (pad_multiple, drop_and_pad, overflow); gradients;
hypothesis properties; jit / vmap / shard_map; argument and run-time errors; determinism.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _helpers import cuda_contract, jit_op, random_routing_map, ref
from jax_ep import ops
from jax_ep._ffi import varying_axes

F32, BF16, F16 = np.float32, ml_dtypes.bfloat16, np.float16
DTYPES = [F32, BF16, F16]
# fp32 accumulation, one rounding to the output dtype: summation order may move the result by
# about one output ulp.
TOL = {F32: dict(rtol=1e-6, atol=1e-6), BF16: dict(rtol=2**-7, atol=2**-7),
       F16: dict(rtol=2**-10, atol=2**-10)}


def _np(x):
    return None if x is None else np.asarray(x)


def _f32(x):
    return np.asarray(x).astype(np.float32)


def plan_oracle(routing_map, num_out, pad_multiple=None, drop_and_pad=False):
    """Loop version of contract item 4: (sorted_indices, tokens_per_expert, num_dropped, row[T,E]).

    Blocks are expert-major and token-ascending. Without drop_and_pad, block e has
    ceil(n_e/m)*m rows and blocks are laid end to end; rows at or past num_out do not exist, so
    their tokens are dropped. The contract: "every expert block is padded with zero rows to a
    multiple of m and tokens_per_expert reports the padded sizes", so a block cut by num_out keeps
    whole multiples of m only: capacity min(ceil(n_e/m)*m, (num_out - start) // m * m).
    With drop_and_pad every block has c = num_out // E rows (rounded down to a multiple of m,
    as ops.permute documents) and keeps its first c tokens.
    """
    T, E = routing_map.shape
    m = pad_multiple or 1
    sorted_indices = np.full(num_out, -1, np.int32)
    tokens_per_expert = np.zeros(E, np.int32)
    row_of = np.full((T, E), -1, np.int64)
    dropped = 0
    start = 0
    for e in range(E):
        toks = np.nonzero(routing_map[:, e])[0]
        if drop_and_pad:
            block = (num_out // E) // m * m
            start = e * block
        else:
            block = -(-len(toks) // m) * m
        cap = block if drop_and_pad else max(0, min(block, (num_out - start) // m * m))
        tokens_per_expert[e] = cap
        for j, t in enumerate(toks):
            if j < cap:
                sorted_indices[start + j] = t
                row_of[t, e] = start + j
            else:
                dropped += 1
        if not drop_and_pad:
            start += block
    return sorted_indices, tokens_per_expert, dropped, row_of


def _routing_and_probs(rng, T, E, density=0.4):
    routing_map = random_routing_map(rng, T, E, density)
    probs = np.where(routing_map, rng.random((T, E)), 0.0).astype(np.float32)
    return routing_map, probs


def _num_out(routing_map, pad_multiple, mode):
    """num_out_tokens for a case: "fit" (no-drop worst case), "small" (about half), "big"."""
    m = pad_multiple or 1
    fit = int(sum(-(-int(n) // m) * m for n in routing_map.sum(axis=0)))
    return {"fit": fit, "small": fit // 2, "big": fit + 5}[mode]


def _assert_permute_equal(got, want):
    names = ("permuted", "permuted_probs", "sorted_indices", "tokens_per_expert", "num_dropped")
    assert len(got) == len(want)
    for name, x, y in zip(names, got, want):
        if y is None:
            assert x is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, (
            name, x.dtype, y.dtype, x.shape, y.shape)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


# ------------------------------------------------------------------------ permute vs reference

PERMUTE_CASES = [
    # T, H, E, pad_multiple, drop_and_pad, num_out mode, dtype, with probs
    (1, 8, 1, None, False, "fit", F32, True),
    (13, 16, 4, None, False, "fit", BF16, True),
    (13, 16, 4, None, False, "small", F16, True),
    (13, 16, 4, None, False, "big", F32, False),
    (20, 8, 8, 4, False, "fit", F16, True),
    (20, 8, 8, 3, False, "small", BF16, False),
    (20, 8, 8, None, True, "small", F32, True),
    (20, 8, 8, None, True, "big", BF16, True),
    (17, 4, 6, 2, True, "fit", F16, False),
    (32, 24, 16, 8, False, "big", F32, True),
]


def _case_id(case):
    T, H, E, pad, drop, mode, dtype, with_probs = case
    return (f"T{T}-H{H}-E{E}-pad{pad}-{'drop' if drop else 'nodrop'}-{mode}-"
            f"{np.dtype(dtype).name}-{'probs' if with_probs else 'noprobs'}")


@pytest.mark.parametrize("T,H,E,pad,drop,mode,dtype,with_probs", PERMUTE_CASES,
                         ids=[_case_id(c) for c in PERMUTE_CASES])
def test_permute_ffi_matches_reference(rng, T, H, E, pad, drop, mode, dtype, with_probs):
    routing_map, probs = _routing_and_probs(rng, T, E)
    tokens = rng.standard_normal((T, H)).astype(dtype)
    n = _num_out(routing_map, pad, mode)
    p = jnp.asarray(probs) if with_probs else None
    kw = dict(num_out_tokens=n, pad_multiple=pad, drop_and_pad=drop, return_num_dropped=True)
    got = ops.permute(jnp.asarray(tokens), jnp.asarray(routing_map), p, **kw)
    want = ref(ops.permute, jnp.asarray(tokens), jnp.asarray(routing_map), p, **kw)
    _assert_permute_equal(got, want)
    assert got[0].dtype == tokens.dtype and got[0].shape == (n, H)
    # Against the loop oracle written from the contract.
    sorted_indices, tpe, dropped, _ = plan_oracle(routing_map, n, pad, drop)
    np.testing.assert_array_equal(got[2], sorted_indices)
    np.testing.assert_array_equal(got[3], tpe)
    assert int(got[4]) == dropped
    rows = np.where(sorted_indices[:, None] >= 0, tokens[np.maximum(sorted_indices, 0)], 0)
    np.testing.assert_array_equal(_f32(got[0]), rows.astype(np.float32))


# ----------------------------------------------------------------------------- hand-computed

HAND_TOKENS = np.array([[1, 10], [2, 20], [3, 30]], np.float32)
HAND_MAP = np.array([[1, 0, 1], [1, 0, 0], [0, 1, 1]], bool)
HAND_PROBS = np.array([[0.5, 0, 0.25], [0.75, 0, 0], [0, 0.125, 1.0]], np.float32)

# (num_out, pad_multiple, drop_and_pad) -> (sorted_indices, tokens_per_expert, num_dropped)
HAND_CASES = {
    "plain": ((5, None, False), ([0, 1, 2, 0, 2], [2, 1, 2], 0)),
    "tail_padding": ((7, None, False), ([0, 1, 2, 0, 2, -1, -1], [2, 1, 2], 0)),
    "pad2": ((6, 2, False), ([0, 1, 2, -1, 0, 2], [2, 2, 2], 0)),
    "pad4": ((12, 4, False), ([0, 1, -1, -1, 2, -1, -1, -1, 0, 2, -1, -1], [4, 4, 4], 0)),
    "pad2_tail": ((8, 2, False), ([0, 1, 2, -1, 0, 2, -1, -1], [2, 2, 2], 0)),
    # N=5 leaves one row for expert 2's 2-row block: a block must be whole multiples of m,
    # so expert 2 keeps nothing and both of its tokens are dropped.
    "pad2_cut": ((5, 2, False), ([0, 1, 2, -1, -1], [2, 2, 0], 2)),
    "drop_c1": ((3, None, True), ([0, 2, 0], [1, 1, 1], 2)),
    "drop_c1_tail": ((5, None, True), ([0, 2, 0, -1, -1], [1, 1, 1], 2)),
    "drop_c2": ((8, None, True), ([0, 1, 2, -1, 0, 2, -1, -1], [2, 2, 2], 0)),
    "too_small_3": ((3, None, False), ([0, 1, 2], [2, 1, 0], 2)),
    "too_small_4": ((4, None, False), ([0, 1, 2, 0], [2, 1, 1], 1)),
    "zero_rows": ((0, None, False), ([], [0, 0, 0], 5)),
    "zero_rows_drop": ((0, None, True), ([], [0, 0, 0], 5)),
}


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_permute_hand_cases(impl, case):
    (n, pad, drop), (sorted_want, tpe_want, dropped_want) = HAND_CASES[case]
    out = jit_op(ops.permute, jnp.asarray(HAND_TOKENS), jnp.asarray(HAND_MAP),
                 jnp.asarray(HAND_PROBS), num_out_tokens=n, pad_multiple=pad, drop_and_pad=drop,
                 return_num_dropped=True, impl=impl)
    permuted, permuted_probs, sorted_indices, tpe, dropped = map(np.asarray, out)
    sorted_want = np.array(sorted_want, np.int32)
    np.testing.assert_array_equal(sorted_indices, sorted_want)
    np.testing.assert_array_equal(tpe, tpe_want)
    assert int(dropped) == dropped_want
    assert permuted.shape == (n, 2) and permuted_probs.shape == (n,)
    # Data rows: the token where sorted_indices >= 0, zero on padding rows.
    want_rows = np.zeros((n, 2), np.float32)
    want_probs = np.zeros(n, np.float32)
    block_expert = np.repeat(np.arange(3), tpe_want)  # expert of every row inside a block
    for r, t in enumerate(sorted_want):
        if t >= 0:
            want_rows[r] = HAND_TOKENS[t]
            want_probs[r] = HAND_PROBS[t, block_expert[r]]
    np.testing.assert_array_equal(permuted, want_rows)
    np.testing.assert_array_equal(permuted_probs, want_probs)


def test_permute_hand_plain_written_out():
    # Experts 0: tokens 0,1; expert 1: token 2; expert 2: tokens 0,2.
    for impl in ("ffi", "xla"):
        permuted, permuted_probs, sorted_indices, tpe = jit_op(
            ops.permute, jnp.asarray(HAND_TOKENS), jnp.asarray(HAND_MAP),
            jnp.asarray(HAND_PROBS), num_out_tokens=5, impl=impl)
        np.testing.assert_array_equal(permuted, [[1, 10], [2, 20], [3, 30], [1, 10], [3, 30]])
        np.testing.assert_array_equal(permuted_probs, [0.5, 0.75, 0.125, 0.25, 1.0])
        np.testing.assert_array_equal(sorted_indices, [0, 1, 2, 0, 2])
        np.testing.assert_array_equal(tpe, [2, 1, 2])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_unpermute_hand(impl):
    permuted = jnp.asarray([[1, 10], [2, 20], [3, 30], [1, 10], [3, 30]], jnp.float32)
    sorted_indices = jnp.asarray([0, 1, 2, 0, 2], jnp.int32)
    probs = jnp.asarray([0.5, 0.75, 0.125, 0.25, 1.0], jnp.float32)
    out = jit_op(ops.unpermute, permuted, sorted_indices, num_tokens=3, impl=impl)
    np.testing.assert_array_equal(out, [[2, 20], [2, 20], [6, 60]])
    out = ops.unpermute(permuted, sorted_indices, num_tokens=3, probs=probs, impl=impl)
    np.testing.assert_array_equal(out, [[0.75, 7.5], [1.5, 15], [3.375, 33.75]])
    # drop_and_pad c=1 layout with padding rows (-1 ignored) and an extra token with no rows.
    permuted = jnp.asarray([[1, 10], [3, 30], [1, 10], [7, 7], [9, 9]], jnp.float32)
    sorted_indices = jnp.asarray([0, 2, 0, -1, -1], jnp.int32)
    out = ops.unpermute(permuted, sorted_indices, num_tokens=4, impl=impl)
    np.testing.assert_array_equal(out, [[2, 20], [0, 0], [3, 30], [0, 0]])


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_nothing_routed(impl):
    tokens = jnp.ones((4, 8), jnp.bfloat16)
    routing_map = jnp.zeros((4, 3), bool)
    for pad, drop, n in [(None, False, 5), (2, False, 0), (None, True, 6)]:
        permuted, pp, si, tpe, dropped = jit_op(
            ops.permute, tokens, routing_map, jnp.ones((4, 3)), num_out_tokens=n,
            pad_multiple=pad, drop_and_pad=drop, return_num_dropped=True, impl=impl)
        np.testing.assert_array_equal(_f32(permuted), np.zeros((n, 8)))
        np.testing.assert_array_equal(pp, np.zeros(n))
        np.testing.assert_array_equal(si, np.full(n, -1))
        np.testing.assert_array_equal(tpe, [2, 2, 2] if drop else [0, 0, 0])
        assert int(dropped) == 0


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_one_expert_gets_everything(impl):
    T, H, E = 9, 4, 4
    tokens = jnp.arange(T * H, dtype=jnp.float32).reshape(T, H)
    routing_map = jnp.zeros((T, E), bool).at[:, 2].set(True)
    permuted, _, si, tpe, dropped = jit_op(ops.permute, tokens, routing_map, None,
                                           num_out_tokens=T, return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, np.arange(T))
    np.testing.assert_array_equal(tpe, [0, 0, T, 0])
    np.testing.assert_array_equal(permuted, tokens)
    assert int(dropped) == 0
    # drop_and_pad with N = 2E: capacity 2, expert 2 keeps tokens 0 and 1, the rest is padding.
    permuted, _, si, tpe, dropped = jit_op(ops.permute, tokens, routing_map, None,
                                           num_out_tokens=2 * E, drop_and_pad=True,
                                           return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [-1, -1, -1, -1, 0, 1, -1, -1])
    np.testing.assert_array_equal(tpe, [2, 2, 2, 2])
    assert int(dropped) == T - 2
    np.testing.assert_array_equal(permuted[4:6], tokens[:2])
    np.testing.assert_array_equal(permuted[:4], np.zeros((4, H)))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_pad_multiple_tiny_experts(impl):
    # One token per expert, m = 4: every block is 1 token + 3 zero rows.
    tokens = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    routing_map = jnp.asarray([[1, 0, 1, 0], [0, 1, 0, 1]], bool)
    permuted, _, si, tpe, dropped = jit_op(ops.permute, tokens, routing_map, None,
                                           num_out_tokens=16, pad_multiple=4,
                                           return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [0, -1, -1, -1, 1, -1, -1, -1,
                                       0, -1, -1, -1, 1, -1, -1, -1])
    np.testing.assert_array_equal(tpe, [4, 4, 4, 4])
    assert int(dropped) == 0
    want = np.zeros((16, 2), np.float32)
    want[[0, 8]] = [1, 2]
    want[[4, 12]] = [3, 4]
    np.testing.assert_array_equal(permuted, want)
    # N = 10 leaves two rows for the third block: less than one multiple of 4, so experts 2
    # and 3 get no block and their tokens are dropped; rows 8, 9 are tail padding.
    _, _, si, tpe, dropped = jit_op(ops.permute, tokens, routing_map, None, num_out_tokens=10,
                                    pad_multiple=4, return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [0, -1, -1, -1, 1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(tpe, [4, 4, 0, 0])
    assert int(dropped) == 2


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_drop_and_pad_overflow_and_empty(impl):
    # Expert 0 gets all 6 tokens (overflows c=2), expert 1 none, expert 2 two, expert 3 one.
    T, E = 6, 4
    routing_map = np.zeros((T, E), bool)
    routing_map[:, 0] = True
    routing_map[[1, 3], 2] = True
    routing_map[5, 3] = True
    tokens = jnp.asarray(np.arange(T, dtype=np.float32)[:, None] + 1)
    probs = jnp.asarray(np.where(routing_map, 0.5, 0.0).astype(np.float32))
    permuted, pp, si, tpe, dropped = jit_op(
        ops.permute, tokens, jnp.asarray(routing_map), probs, num_out_tokens=8,
        drop_and_pad=True, return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [0, 1, -1, -1, 1, 3, 5, -1])
    np.testing.assert_array_equal(tpe, [2, 2, 2, 2])
    assert int(dropped) == 4  # tokens 2, 3, 4, 5 of expert 0
    np.testing.assert_array_equal(permuted[:, 0], [1, 2, 0, 0, 2, 4, 6, 0])
    np.testing.assert_array_equal(pp, [0.5, 0.5, 0, 0, 0.5, 0.5, 0.5, 0])
    # N = 9 is not a multiple of E: c = 2 still, row 8 is tail padding.
    _, _, si, tpe, dropped = jit_op(ops.permute, tokens, jnp.asarray(routing_map), None,
                                    num_out_tokens=9, drop_and_pad=True,
                                    return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [0, 1, -1, -1, 1, 3, 5, -1, -1])
    assert int(dropped) == 4
    # N < E: capacity 0, everything dropped.
    _, _, si, tpe, dropped = jit_op(ops.permute, tokens, jnp.asarray(routing_map), None,
                                    num_out_tokens=3, drop_and_pad=True,
                                    return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(si, [-1, -1, -1])
    np.testing.assert_array_equal(tpe, [0, 0, 0, 0])
    assert int(dropped) == int(routing_map.sum())


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_num_out_too_small_counts_drops(impl, rng):
    T, E = 16, 4
    routing_map, probs = _routing_and_probs(rng, T, E, density=0.6)
    routed = routing_map.sum(axis=0)
    n = int(routed[0] + routed[1] + 1)  # experts 0, 1 fit, expert 2 keeps one token
    out = jit_op(ops.permute, jnp.ones((T, 8)), jnp.asarray(routing_map), jnp.asarray(probs),
                 num_out_tokens=n, return_num_dropped=True, impl=impl)
    hand_count = int(routed[2] - 1 + routed[3])
    assert int(out[4]) == hand_count
    np.testing.assert_array_equal(out[3], [routed[0], routed[1], 1, 0])
    assert (np.asarray(out[2]) >= 0).all()


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("E, pad, n, kept", [(1, 2**31 - 1, 3, [0]), (4, 2**30, 3, [0] * 4),
                                             (4, 2, 9, [4, 4, 0, 0])])
def test_permute_pad_multiple_near_int32_max(impl, E, pad, n, kept):
    """Padded blocks past int32 keep the rows left (none, but for a small pad): the
    reference's rounding and running sum wrapped before (tokens_per_expert [-2^31 + 1], and
    9 drops instead of 12 at E = 4), disagreeing with the handler."""
    T = 3
    out = ops.permute(jnp.ones((T, 4)), jnp.ones((T, E), bool), num_out_tokens=n,
                      pad_multiple=pad, return_num_dropped=True, impl=impl)
    np.testing.assert_array_equal(np.asarray(out[3]), kept)
    assert int(out[4]) == T * E - sum(min(k, T) for k in kept)
    # the kept rows hold their tokens at the head of each block
    rows = np.asarray(out[2])[:8]
    assert (rows[:min(kept[0], T)] == np.arange(min(kept[0], T))).all()


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_no_tokens(impl):
    permuted, pp, si, tpe, dropped = ops.permute(
        jnp.ones((0, 4), jnp.bfloat16), jnp.zeros((0, 3), bool), jnp.zeros((0, 3)),
        num_out_tokens=2, impl=impl, return_num_dropped=True)
    assert permuted.shape == (2, 4) and permuted.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_f32(permuted), np.zeros((2, 4)))
    np.testing.assert_array_equal(si, [-1, -1])
    np.testing.assert_array_equal(pp, [0, 0])
    np.testing.assert_array_equal(tpe, [0, 0, 0])
    assert int(dropped) == 0


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_single_token(impl):
    tokens = jnp.asarray([[1.5, -2.0, 3.0]], jnp.float16)
    routing_map = jnp.asarray([[0, 1, 1, 0, 1]], bool)
    probs = jnp.asarray([[0, 0.2, 0.3, 0, 0.5]], jnp.float32)
    permuted, pp, si, tpe = jit_op(ops.permute, tokens, routing_map, probs, num_out_tokens=3,
                                   impl=impl)
    np.testing.assert_array_equal(si, [0, 0, 0])
    np.testing.assert_array_equal(tpe, [0, 1, 1, 0, 1])
    np.testing.assert_array_equal(_f32(permuted), np.repeat(_f32(tokens), 3, axis=0))
    np.testing.assert_array_equal(pp, np.float32([0.2, 0.3, 0.5]))
    out = jit_op(ops.unpermute, permuted, si, num_tokens=1, impl=impl)
    np.testing.assert_array_equal(_f32(out), 3 * _f32(tokens))


# ---------------------------------------------------------------------- unpermute / gather_rows


@pytest.mark.parametrize("N,H,T,dtype,with_probs", [
    (1, 1, 1, F32, True), (40, 16, 12, F32, False), (40, 16, 12, BF16, True),
    (64, 40, 5, BF16, False), (64, 40, 5, F16, True), (7, 8, 20, F16, False),
    (7, 8, 20, F32, True)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_unpermute_ffi_matches_reference(rng, N, H, T, dtype, with_probs):
    permuted = rng.standard_normal((N, H)).astype(dtype)
    # Arbitrary map with repeats, -1 rows and tokens that receive nothing.
    sorted_indices = rng.integers(-1, T, N).astype(np.int32)
    probs = jnp.asarray(rng.random(N).astype(np.float32)) if with_probs else None
    got = ops.unpermute(jnp.asarray(permuted), jnp.asarray(sorted_indices), num_tokens=T,
                        probs=probs)
    want = ref(ops.unpermute, jnp.asarray(permuted), jnp.asarray(sorted_indices), num_tokens=T,
               probs=probs)
    assert got.dtype == want.dtype == permuted.dtype and got.shape == want.shape == (T, H)
    np.testing.assert_allclose(_f32(got), _f32(want), **TOL[dtype])
    # Float64 loop oracle.
    w = np.ones(N) if probs is None else np.asarray(probs, np.float64)
    oracle = np.zeros((T, H))
    for r, t in enumerate(sorted_indices):
        if t >= 0:
            oracle[t] += permuted[r].astype(np.float64) * w[r]
    np.testing.assert_allclose(_f32(got), oracle, rtol=TOL[dtype]["rtol"],
                               atol=TOL[dtype]["atol"] * 4)


def _unpermute_in_handler_order(permuted, sorted_indices, probs, num_tokens):
    """The CPU handler's arithmetic written out in numpy: for each token, its rows in
    ascending order, acc = fl32(acc + fl32(row * w)), then one rounding to the data dtype."""
    x = np.asarray(permuted).astype(np.float32)
    w = np.ones(len(x), np.float32) if probs is None else np.asarray(probs, np.float32)
    acc = np.zeros((num_tokens, x.shape[1]), np.float32)
    for r, t in enumerate(np.asarray(sorted_indices)):
        if t >= 0:
            acc[t] = acc[t] + x[r] * w[r]
    return acc.astype(permuted.dtype)


# H >= 64 takes the 64-channel register loop (plus a scalar tail when H % 64 != 0); outputs
# of 8 MiB or more are written with streaming stores.
@pytest.mark.parametrize("N,H,T,dtype,with_probs", [
    (300, 64, 40, F32, True), (300, 130, 40, BF16, True), (300, 200, 40, F16, False),
    (300, 1000, 9, BF16, False), (4096, 2048, 1024, F32, True),
    (4096, 2048, 2048, BF16, True), (4096, 2112, 2048, F16, True)],
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_unpermute_wide_rows_bitwise_in_handler_order(rng, N, H, T, dtype, with_probs):
    permuted = rng.standard_normal((N, H)).astype(dtype)
    sorted_indices = rng.integers(-1, T, N).astype(np.int32)
    sorted_indices[: N // 8] = 3  # one token with many rows
    probs = rng.random(N).astype(np.float32) if with_probs else None
    got = ops.unpermute(jnp.asarray(permuted), jnp.asarray(sorted_indices), num_tokens=T,
                        probs=None if probs is None else jnp.asarray(probs))
    want = _unpermute_in_handler_order(permuted, sorted_indices, probs, T)
    assert got.dtype == permuted.dtype and got.shape == (T, H)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


# Outputs of 8 MiB or more take the streaming-store copy; rows of 21 and 2002 bytes start at
# every alignment, so its unaligned head and tail are exercised, and some rows are zero fill.
@pytest.mark.parametrize("shape,num_rows,dtype", [((300, 1001), 4500, BF16),
                                                  ((50, 3, 7), 400_000, np.uint8)],
                         ids=["bf16-2002B", "u8-21B"])
def test_gather_rows_large_output(rng, shape, num_rows, dtype):
    x = (rng.standard_normal(shape) * 50).astype(dtype)
    row_idx = rng.integers(-5, shape[0] + 5, num_rows).astype(np.int32)
    got = np.asarray(ops.gather_rows(jnp.asarray(x), jnp.asarray(row_idx)))
    assert got.nbytes >= 8 << 20
    valid = (row_idx >= 0) & (row_idx < shape[0])
    want = np.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)),
                    x[np.clip(row_idx, 0, shape[0] - 1)], np.zeros_like(x[:1]))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,dtype", [
    ((6, 5), F32), ((6, 5), BF16), ((6, 5), F16), ((6,), np.int32), ((6, 2, 3), np.uint8),
    ((6, 2, 3), BF16)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_gather_rows_ffi_matches_reference(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 50).astype(dtype)
    row_idx = np.array([0, 5, -1, 3, 6, 99, -7, 3, 2, 2], np.int32)  # out of range -> zeros
    got = ops.gather_rows(jnp.asarray(x), jnp.asarray(row_idx))
    want = ref(ops.gather_rows, jnp.asarray(x), jnp.asarray(row_idx))
    assert got.dtype == want.dtype and got.shape == want.shape == (10,) + shape[1:]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    valid = (row_idx >= 0) & (row_idx < shape[0])
    for r, i in enumerate(row_idx):
        want = x[i] if valid[r] else np.zeros_like(x[0])
        np.testing.assert_array_equal(np.asarray(got)[r], want)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_gather_rows_empty(impl):
    x = jnp.ones((0, 3))
    out = ops.gather_rows(x, jnp.asarray([0, -1], jnp.int32), impl=impl)
    np.testing.assert_array_equal(out, np.zeros((2, 3)))
    out = ops.gather_rows(jnp.ones((4, 3)), jnp.zeros((0,), jnp.int32), impl=impl)
    assert out.shape == (0, 3)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_unpermute_empty(impl):
    out = ops.unpermute(jnp.ones((0, 4)), jnp.zeros((0,), jnp.int32), num_tokens=3, impl=impl)
    np.testing.assert_array_equal(out, np.zeros((3, 4)))
    out = ops.unpermute(jnp.ones((2, 4)), jnp.full((2,), -1, jnp.int32), num_tokens=0, impl=impl)
    assert out.shape == (0, 4)
    out = ops.unpermute(jnp.ones((2, 4)), jnp.full((2,), -1, jnp.int32), num_tokens=2, impl=impl)
    np.testing.assert_array_equal(out, np.zeros((2, 4)))


# ----------------------------------------------------------------------------- gradients

GRAD_CASES = [
    # T, E, num_out, pad_multiple, drop_and_pad
    (10, 4, None, None, False),
    (10, 4, "small", None, False),
    (10, 4, None, 4, False),
    (10, 4, 12, None, True),
    (10, 4, 12, 2, True),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T,E,n,pad,drop", GRAD_CASES)
def test_permute_grad_ffi_matches_autodiff(rng, dtype, T, E, n, pad, drop):
    H = 8
    routing_map, probs = _routing_and_probs(rng, T, E, density=0.5)
    if n is None:
        n = _num_out(routing_map, pad, "fit")
    elif n == "small":
        n = _num_out(routing_map, pad, "small")
    tokens = jnp.asarray(rng.standard_normal((T, H)).astype(dtype))
    w_rows = jnp.asarray(rng.standard_normal((n, H)).astype(np.float32))
    w_probs = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    rmap, p = jnp.asarray(routing_map), jnp.asarray(probs)

    def loss(tokens, p, impl):
        permuted, pp, _, _ = ops.permute(tokens, rmap, p, num_out_tokens=n, pad_multiple=pad,
                                         drop_and_pad=drop, impl=impl)
        return (permuted.astype(jnp.float32) * w_rows).sum() + (pp * w_probs).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    (gt_ffi, gp_ffi), (gt_ref, gp_ref) = grad(tokens, p, "ffi"), grad(tokens, p, "xla")
    assert gt_ffi.dtype == gt_ref.dtype == tokens.dtype
    np.testing.assert_allclose(_f32(gt_ffi), _f32(gt_ref), **TOL[dtype])
    np.testing.assert_array_equal(gp_ffi, gp_ref)  # data movement only
    # Unrouted (token, expert) pairs get no gradient.
    assert not np.asarray(gp_ffi)[~routing_map].any()
    # Without probs: gradient w.r.t. tokens only.
    g_noprobs = jax.grad(lambda x: (ops.permute(x, rmap, num_out_tokens=n, pad_multiple=pad,
                                                drop_and_pad=drop)[0].astype(jnp.float32)
                                    * w_rows).sum())(tokens)
    np.testing.assert_allclose(_f32(g_noprobs), _f32(gt_ref), **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_unpermute_grad_ffi_matches_autodiff(rng, dtype, with_probs):
    N, H, T = 30, 8, 9
    permuted = jnp.asarray(rng.standard_normal((N, H)).astype(dtype))
    sorted_indices = jnp.asarray(rng.integers(-1, T, N).astype(np.int32))
    probs = jnp.asarray(rng.random(N).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))

    def loss(permuted, probs, impl):
        out = ops.unpermute(permuted, sorted_indices, num_tokens=T,
                            probs=probs if with_probs else None, impl=impl)
        return (out.astype(jnp.float32) * w).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    (gx_ffi, gp_ffi), (gx_ref, gp_ref) = grad(permuted, probs, "ffi"), grad(permuted, probs, "xla")
    assert gx_ffi.dtype == gx_ref.dtype == permuted.dtype
    np.testing.assert_allclose(_f32(gx_ffi), _f32(gx_ref), **TOL[dtype])
    np.testing.assert_allclose(gp_ffi, gp_ref, rtol=1e-5, atol=1e-5)
    # -1 rows get zero gradient.
    pad_rows = np.asarray(sorted_indices) < 0
    assert not _f32(gx_ffi)[pad_rows].any() and not np.asarray(gp_ffi)[pad_rows].any()


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_grad_accumulates_bf16_rows_in_fp32(impl):
    """A token sent to three experts gets the sum of its three row cotangents, added in fp32
    and rounded once: 1 + 2^-8 + 2^-8 = 1.0078125 (bf16 steps would round each 1 + 2^-8 back
    to 1, as autodiff of a bf16 gather did for impl="xla")."""
    tokens = jnp.ones((1, 1), BF16)
    routing_map = jnp.ones((1, 3), bool)
    d_rows = jnp.asarray([[1.0], [2.0 ** -8], [2.0 ** -8]], BF16)
    _, vjp = jax.vjp(lambda x: ops.permute(x, routing_map, num_out_tokens=3, impl=impl)[0],
                     tokens)
    (d_tokens,) = vjp(d_rows)
    assert d_tokens.dtype == BF16 and float(d_tokens[0, 0]) == 1.0078125


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_grads_through_empty_buffers_are_zero(impl):
    """num_out_tokens=0 with tokens, and unpermute to num_tokens=0 with rows: the outputs are
    empty, so every gradient is zero (autodiff of a scatter into an empty array used to fail
    for impl="xla")."""
    tokens, probs = jnp.ones((2, 8)), jnp.full((2, 3), 0.5)
    routing_map = jnp.ones((2, 3), bool)

    def permute_loss(x, p):
        permuted, pp, _, _ = ops.permute(x, routing_map, p, num_out_tokens=0, impl=impl)
        return permuted.sum() + pp.sum()
    for g, like in zip(jax.grad(permute_loss, argnums=(0, 1))(tokens, probs), (tokens, probs)):
        assert g.shape == like.shape and not np.asarray(g).any()

    rows, row_probs = jnp.ones((3, 8)), jnp.ones(3)
    for with_probs in (False, True):
        def unpermute_loss(y, p):
            out = ops.unpermute(y, jnp.full((3,), -1, jnp.int32), num_tokens=0,
                                probs=p if with_probs else None, impl=impl)
            assert out.shape == (0, 8)
            return out.sum()
        gy, gp = jax.grad(unpermute_loss, argnums=(0, 1))(rows, row_probs)
        assert gy.shape == rows.shape and not np.asarray(gy).any() and not np.asarray(gp).any()


def test_permute_unpermute_chain_grad(rng):
    """grad through permute -> expert scaling -> unpermute(probs) equals autodiff of the reference,
    for pad_multiple and drop_and_pad layouts."""
    T, E, H = 12, 4, 8
    routing_map, probs = _routing_and_probs(rng, T, E, density=0.5)
    tokens = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    scale = jnp.asarray(rng.standard_normal((12 * E, H)).astype(np.float32))
    rmap, p = jnp.asarray(routing_map), jnp.asarray(probs)
    for pad, drop, n in [(None, False, int(routing_map.sum())), (4, False, 12 * E),
                         (None, True, 3 * E)]:
        def loss(tokens, p, impl):
            permuted, pp, si, _ = ops.permute(tokens, rmap, p, num_out_tokens=n, pad_multiple=pad,
                                              drop_and_pad=drop, impl=impl)
            y = permuted * scale[:n]
            out = ops.unpermute(y, si, num_tokens=T, probs=pp, impl=impl)
            return (out ** 2).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        g_ffi, g_ref = grad(tokens, p, "ffi"), grad(tokens, p, "xla")
        for a, b in zip(g_ffi, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _grad_of_grad(loss, argnums):
    """d/d(args) of the sum of squares of loss's gradient in `argnums` (reverse over reverse):
    a gradient penalty, which differentiates the ops' VJPs themselves."""
    def penalty(*args):
        return sum(jnp.sum(g.astype(jnp.float32) ** 2)
                   for g in jax.grad(loss, argnums=argnums)(*args))
    return jax.jit(jax.grad(penalty, argnums=argnums), static_argnums=len(argnums))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_permute_unpermute_gradients_of_gradients_match_reference(rng, dtype):
    """Second order through permute -> scaling -> unpermute(probs): the FFI ops' VJPs are
    themselves differentiable (each the other's VJP) and equal the reference's autodiff, with
    padded blocks, drop-and-pad and dropped rows."""
    T, E, H = 12, 4, 8
    routing_map, probs = _routing_and_probs(rng, T, E, density=0.5)
    tokens = jnp.asarray(rng.standard_normal((T, H)), dtype)
    scale = jnp.asarray(rng.standard_normal((12 * E, H)), dtype)
    rmap, p = jnp.asarray(routing_map), jnp.asarray(probs)
    for pad, drop, n in [(None, False, int(routing_map.sum())), (4, False, 12 * E),
                         (None, True, 3 * E), (None, False, 5)]:
        def loss(tokens, p, impl):
            permuted, pp, si, _ = ops.permute(tokens, rmap, p, num_out_tokens=n,
                                              pad_multiple=pad, drop_and_pad=drop, impl=impl)
            y = jnp.sin(permuted * scale[:n])
            out = ops.unpermute(y, si, num_tokens=T, probs=pp, impl=impl)
            plain = ops.unpermute(y, si, num_tokens=T, impl=impl)
            return (out.astype(jnp.float32) ** 3).sum() + jnp.sum(jnp.cos(plain))

        got, want = (_grad_of_grad(loss, (0, 1))(tokens, p, impl) for impl in ("ffi", "xla"))
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if dtype == F32:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            else:  # bf16 roundings in a different order on the two paths (~10 bf16 ulps)
                assert np.linalg.norm(a - b) <= 4e-2 * np.linalg.norm(b)


def test_gather_rows_gradients_of_gradients_match_reference(rng):
    """gather_rows' VJP sums cotangent rows back (repeated and out-of-range indices, rows of
    any trailing shape) and is itself differentiable."""
    x = jnp.asarray(rng.standard_normal((6, 3, 4)).astype(np.float32))
    idx = jnp.asarray([0, 5, -1, 2, 2, 7, 1, 5], jnp.int32)

    def loss(x, impl):
        return jnp.sum(ops.gather_rows(x, idx, impl=impl) ** 3)

    got, want = (_grad_of_grad(loss, (0,))(x, impl)[0] for impl in ("ffi", "xla"))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    first = jax.grad(loss)(x, "ffi")  # rows 3 and 4 are never read, row 5 twice
    assert not np.asarray(first[3:5]).any()
    np.testing.assert_allclose(first[5], 2 * 3 * np.asarray(x[5]) ** 2, rtol=1e-6)


def test_gather_rows_grad_of_a_replicated_table_inside_shard_map(ep_mesh, rng):
    """A table replicated over the mesh (P()) read by ids that vary over it: the gradient sums
    every device's reads, as the reference's does (the table is typed varying first)."""
    x = jnp.asarray(rng.standard_normal((6, 3)).astype(np.float32))
    idx = jnp.asarray(rng.integers(-1, 7, 4 * ep_mesh.size), jnp.int32)
    grads = {}
    for impl in ("ffi", "xla"):
        def loss(x, idx, impl=impl):
            per_device = jax.shard_map(
                lambda x, i: jnp.sum(ops.gather_rows(x, i, impl=impl) ** 2)[None],
                mesh=ep_mesh, in_specs=(P(), P("ep")), out_specs=P("ep"))
            return jnp.sum(per_device(x, idx))
        grads[impl] = jax.jit(jax.grad(loss))(x, idx)
    np.testing.assert_allclose(grads["ffi"], grads["xla"], rtol=1e-6)
    assert np.abs(np.asarray(grads["ffi"])).max() > 0


# ----------------------------------------------------------------------------- hypothesis

ROUTING = dict(T=st.integers(1, 10), E=st.integers(1, 6), H=st.sampled_from([1, 3]),
               pad=st.sampled_from([None, 1, 2, 3]), drop=st.booleans(),
               extra=st.integers(-6, 4), density=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
               seed=st.integers(0, 2**16))


def _draw_case(T, E, H, pad, drop, extra, density, seed):
    rng = np.random.default_rng(seed)
    routing_map = random_routing_map(rng, T, E, density)
    probs = np.where(routing_map, rng.random((T, E)), 0.0).astype(np.float32)
    tokens = rng.integers(-8, 9, (T, H)).astype(np.float32)  # small ints: sums are exact
    n = max(0, _num_out(routing_map, pad, "fit") + extra)
    return routing_map, probs, tokens, n


@given(**ROUTING)
def test_property_permute_unpermute_roundtrip(T, E, H, pad, drop, extra, density, seed):
    routing_map, probs, tokens, n = _draw_case(T, E, H, pad, drop, extra, density, seed)
    permuted, pp, si, tpe, dropped = ops.permute(
        jnp.asarray(tokens), jnp.asarray(routing_map), jnp.asarray(probs), num_out_tokens=n,
        pad_multiple=pad, drop_and_pad=drop, return_num_dropped=True)
    si, tpe = np.asarray(si), np.asarray(tpe)
    kept = np.bincount(si[si >= 0], minlength=T)
    # probs=None: every token comes back times the number of its routes that were kept.
    back = ops.unpermute(permuted, jnp.asarray(si), num_tokens=T)
    np.testing.assert_array_equal(back, tokens * kept[:, None])
    assert int(dropped) == int(routing_map.sum()) - int(kept.sum())
    # With probs: times the sum of the kept routes' probs (each kept row carries one route's
    # prob; test_property_permute_layout checks which).
    pp = np.asarray(pp)
    kept_probs = np.bincount(si[si >= 0], weights=pp[si >= 0], minlength=T)
    assert np.all(kept_probs <= probs.sum(axis=1) + 1e-6)
    back = ops.unpermute(permuted, jnp.asarray(si), num_tokens=T, probs=jnp.asarray(pp))
    np.testing.assert_allclose(back, tokens * kept_probs[:, None], rtol=1e-6, atol=1e-5)


@given(**ROUTING)
def test_property_permute_layout(T, E, H, pad, drop, extra, density, seed):
    routing_map, probs, tokens, n = _draw_case(T, E, H, pad, drop, extra, density, seed)
    permuted, pp, si, tpe, dropped = map(np.asarray, ops.permute(
        jnp.asarray(tokens), jnp.asarray(routing_map), jnp.asarray(probs), num_out_tokens=n,
        pad_multiple=pad, drop_and_pad=drop, return_num_dropped=True))
    m = pad or 1
    want_si, want_tpe, want_dropped, row_of = plan_oracle(routing_map, n, pad, drop)
    np.testing.assert_array_equal(si, want_si)
    np.testing.assert_array_equal(tpe, want_tpe)
    assert int(dropped) == want_dropped
    assert tpe.sum() <= n and (tpe >= 0).all()
    assert (tpe % m == 0).all()  # every block is a whole number of multiples of m
    kept_per_expert = np.array([(si[s:s + c] >= 0).sum() for s, c in
                                zip(np.concatenate([[0], np.cumsum(tpe)[:-1]]), tpe)])
    if drop:
        assert (tpe == (n // E) // m * m).all()
    else:
        np.testing.assert_array_equal(tpe, -(-kept_per_expert // m) * m)
        if int(dropped) == 0:
            np.testing.assert_array_equal(tpe, -(-routing_map.sum(axis=0) // m) * m)
    starts = np.concatenate([[0], np.cumsum(tpe)])
    for e in range(E):
        block = si[starts[e]:starts[e + 1]]
        used = block[block >= 0]
        # Token-ascending, padding only after the used rows, first tokens of the expert kept.
        assert (np.diff(used) > 0).all()
        assert (block[len(used):] == -1).all()
        np.testing.assert_array_equal(used, np.nonzero(routing_map[:, e])[0][:len(used)])
        np.testing.assert_array_equal(pp[starts[e]:starts[e] + len(used)], probs[used, e])
    assert (si[starts[E]:] == -1).all()
    pad_rows = si < 0
    assert not permuted[pad_rows].any() and not pp[pad_rows].any()
    np.testing.assert_array_equal(permuted[~pad_rows], tokens[si[~pad_rows]])


@settings(max_examples=10)
@given(T=st.integers(1, 8), E=st.integers(1, 5), pad=st.sampled_from([None, 2]),
       drop=st.booleans(), extra=st.integers(-3, 2), seed=st.integers(0, 2**16))
def test_property_permute_ffi_equals_reference(T, E, pad, drop, extra, seed):
    routing_map, probs, tokens, n = _draw_case(T, E, 3, pad, drop, extra, 0.5, seed)
    kw = dict(num_out_tokens=n, pad_multiple=pad, drop_and_pad=drop, return_num_dropped=True)
    args = (jnp.asarray(tokens), jnp.asarray(routing_map), jnp.asarray(probs))
    _assert_permute_equal(ops.permute(*args, **kw), ref(ops.permute, *args, **kw))


# ------------------------------------------------------------------------ jit / vmap / shard_map


def test_permute_unpermute_under_jit(rng):
    T, H, E, n = 16, 8, 4, 40
    routing_map, probs = _routing_and_probs(rng, T, E)
    tokens = jnp.asarray(rng.standard_normal((T, H)).astype(BF16))

    @partial(jax.jit, static_argnames="impl")
    def f(tokens, rmap, probs, impl):
        permuted, pp, si, tpe = ops.permute(tokens, rmap, probs, num_out_tokens=n, pad_multiple=4,
                                            impl=impl)
        rows = ops.gather_rows(permuted, si, impl=impl)
        return permuted, pp, si, tpe, rows, ops.unpermute(permuted, si, num_tokens=T, probs=pp,
                                                          impl=impl)

    got = f(tokens, jnp.asarray(routing_map), jnp.asarray(probs), "ffi")
    want = f(tokens, jnp.asarray(routing_map), jnp.asarray(probs), "xla")
    for x, y in zip(got[:5], want[:5]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_allclose(_f32(got[5]), _f32(want[5]), **TOL[BF16])


def test_permute_unpermute_under_vmap(rng):
    B, T, H, E, n = 3, 10, 4, 4, 24
    maps, probs = zip(*[_routing_and_probs(rng, T, E) for _ in range(B)])
    rmap, probs = jnp.asarray(np.stack(maps)), jnp.asarray(np.stack(probs))
    tokens = jnp.asarray(rng.standard_normal((B, T, H)).astype(np.float32))

    def f(tokens, rmap, probs, impl):
        permuted, pp, si, tpe, dropped = ops.permute(
            tokens, rmap, probs, num_out_tokens=n, pad_multiple=2, impl=impl,
            return_num_dropped=True)
        noprobs = ops.permute(tokens, rmap, num_out_tokens=n, drop_and_pad=True, impl=impl)
        back = ops.unpermute(permuted, si, num_tokens=T, probs=pp, impl=impl)
        back_np = ops.unpermute(noprobs[0], noprobs[2], num_tokens=T, impl=impl)
        return (permuted, pp, si, tpe, dropped, noprobs[0], noprobs[2], noprobs[3],
                ops.gather_rows(tokens, si, impl=impl), back, back_np)

    got = jax.vmap(partial(f, impl="ffi"))(tokens, rmap, probs)
    got_jit = jax.jit(jax.vmap(partial(f, impl="ffi")))(tokens, rmap, probs)
    ref_f = jax.jit(partial(f, impl="xla"))
    for b in range(B):
        want = ref_f(tokens[b], rmap[b], probs[b])
        for i, (x, y) in enumerate(zip(got, want)):
            if i >= 9:
                np.testing.assert_allclose(np.asarray(x)[b], np.asarray(y), rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(np.asarray(x)[b], np.asarray(y))
    for x, y in zip(got, got_jit):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_permute_unpermute_inside_shard_map(ep_mesh, rng):
    D = ep_mesh.shape["ep"]
    T, H, E, n = 6, 8, 4, 16
    routing_map, probs = _routing_and_probs(rng, D * T, E)
    tokens = rng.standard_normal((D * T, H)).astype(BF16)
    sharding = NamedSharding(ep_mesh, P("ep"))
    args = [jax.device_put(a, sharding) for a in (tokens, routing_map, probs)]

    def local(tokens, rmap, probs):
        permuted, pp, si, tpe, dropped = ops.permute(tokens, rmap, probs, num_out_tokens=n,
                                                     pad_multiple=2, return_num_dropped=True)
        rows = ops.gather_rows(tokens, si)
        back = ops.unpermute(permuted, si, num_tokens=T, probs=pp)
        return permuted, pp, si, tpe, dropped[None], rows, back

    f = jax.jit(jax.shard_map(local, mesh=ep_mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    got = [np.asarray(x) for x in f(*args)]

    @jax.jit
    def ref_local(tokens, rmap, probs):
        permuted, pp, si, tpe, dropped = ops.permute(tokens, rmap, probs, num_out_tokens=n,
                                                     pad_multiple=2, return_num_dropped=True,
                                                     impl="xla")
        rows = ops.gather_rows(tokens, si, impl="xla")
        back = ops.unpermute(permuted, si, num_tokens=T, probs=pp, impl="xla")
        return permuted, pp, si, tpe, dropped[None], rows, back

    for d in range(D):
        sl = slice(d * T, (d + 1) * T)
        want = ref_local(jnp.asarray(tokens[sl]), jnp.asarray(routing_map[sl]),
                         jnp.asarray(probs[sl]))
        for i, (x, y) in enumerate(zip(got, want)):
            k = y.shape[0]
            if i == 6:
                np.testing.assert_allclose(_f32(x[d * k:(d + 1) * k]), _f32(y), **TOL[BF16])
            else:
                np.testing.assert_array_equal(x[d * k:(d + 1) * k], np.asarray(y))


def test_permute_grad_inside_shard_map(ep_mesh, rng):
    D = ep_mesh.shape["ep"]
    T, H, E, n = 5, 4, 4, 12
    routing_map, probs = _routing_and_probs(rng, D * T, E, density=0.5)
    tokens = rng.standard_normal((D * T, H)).astype(np.float32)
    sharding = NamedSharding(ep_mesh, P("ep"))
    args = [jax.device_put(a, sharding) for a in (tokens, routing_map, probs)]

    def loss(tokens, rmap, probs, impl):
        permuted, pp, si, _ = ops.permute(tokens, rmap, probs, num_out_tokens=n, pad_multiple=2,
                                          impl=impl)
        out = ops.unpermute(permuted * 2.0 + 1.0, si, num_tokens=T, probs=pp, impl=impl)
        return (out ** 2).sum()

    def local_grad(tokens, rmap, probs):
        return jax.grad(loss, argnums=(0, 2))(tokens, rmap, probs, "ffi")

    f = jax.jit(jax.shard_map(local_grad, mesh=ep_mesh, in_specs=(P("ep"),) * 3,
                              out_specs=P("ep")))
    g_tokens, g_probs = map(np.asarray, f(*args))
    ref_grad = jax.jit(jax.grad(partial(loss, impl="xla"), argnums=(0, 2)))
    for d in range(D):
        sl = slice(d * T, (d + 1) * T)
        want_t, want_p = ref_grad(jnp.asarray(tokens[sl]), jnp.asarray(routing_map[sl]),
                                  jnp.asarray(probs[sl]))
        np.testing.assert_allclose(g_tokens[sl], want_t, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g_probs[sl], want_p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_empty_results_vary_like_their_inputs_inside_shard_map(ep_mesh, impl):
    # jax.numpy returns a scatter of zero updates as its fresh (unvarying) zeros; a custom_vjp
    # backward that does so fails JAX's type check (dispatch_chunked_forward's empty chunks).
    # Both impls type every output like the FFI call: varying over the inputs' axes.
    unvarying = []

    def local(x, idx, probs):  # per rank: x [2,128], idx i32[2,2], probs f32[2,4]
        none, rows, rmap = idx[:0, 0], jnp.full((2,), -1, jnp.int32), probs[:0] > 0
        outs = {
            "unpermute(no rows)": ops.unpermute(x[:0], none, num_tokens=3, impl=impl),
            "unpermute(-1 rows)": ops.unpermute(x, rows, num_tokens=3, impl=impl),
            "gather_rows": ops.gather_rows(x[:0], rows, impl=impl),
            "multihot": ops.indices_to_multihot(idx[:0], probs[:0, :2], num_experts=4,
                                                impl=impl),
            "permute": ops.permute(x[:0], rmap, probs[:0], num_out_tokens=4, impl=impl),
            "layout": ops.get_dispatch_layout(idx[:0], num_experts=4, num_ranks=2, impl=impl),
            "send_layout": ops.build_send_layout(idx[:0], probs[:0, :2], num_ranks=2,
                                                 num_local_experts=2, impl=impl),
            "cast_to_fp8": ops.per_token_cast_to_fp8(x[:0], impl=impl),
        }
        for name, out in outs.items():
            for leaf in jax.tree.leaves(out):
                if "ep" not in varying_axes(leaf):
                    unvarying.append(name)
        return x

    sharding = NamedSharding(ep_mesh, P("ep"))
    args = [jax.device_put(a, sharding) for a in (
        np.ones((16, 128), np.float32), np.zeros((16, 2), np.int32), np.ones((16, 4), np.float32))]
    jax.jit(jax.shard_map(local, mesh=ep_mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(*args)
    assert unvarying == []


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_permute_bad_arguments(impl):
    x = jnp.ones((4, 8))
    rmap = jnp.ones((4, 3), bool)
    permute = partial(ops.permute, impl=impl)
    with pytest.raises(ValueError, match="tokens"):
        permute(jnp.ones((4,)), rmap, num_out_tokens=4)
    with pytest.raises(ValueError, match="tokens"):
        permute(jnp.ones((4, 8), jnp.int32), rmap, num_out_tokens=4)
    with pytest.raises(ValueError, match="routing_map"):
        permute(x, jnp.ones((4, 3), jnp.int32), num_out_tokens=4)
    with pytest.raises(ValueError, match="routing_map"):
        permute(x, jnp.ones((5, 3), bool), num_out_tokens=4)
    with pytest.raises(ValueError, match="routing_map"):
        permute(x, jnp.ones((4, 3, 1), bool), num_out_tokens=4)
    with pytest.raises(ValueError, match="probs"):
        permute(x, rmap, jnp.ones((4, 2)), num_out_tokens=4)
    with pytest.raises(ValueError, match="num_out_tokens"):
        permute(x, rmap, num_out_tokens=-1)
    with pytest.raises(ValueError, match="num_out_tokens"):
        permute(x, rmap, num_out_tokens=4.0)
    with pytest.raises(ValueError, match="pad_multiple"):
        permute(x, rmap, num_out_tokens=4, pad_multiple=0)
    with pytest.raises(ValueError, match="pad_multiple"):
        permute(x, rmap, num_out_tokens=4, pad_multiple=-2)
    with pytest.raises(ValueError, match="impl"):
        ops.permute(x, rmap, num_out_tokens=4, impl="triton")


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_unpermute_and_gather_rows_bad_arguments(impl):
    unpermute = partial(ops.unpermute, impl=impl)
    si = jnp.zeros((6,), jnp.int32)
    with pytest.raises(ValueError, match="permuted"):
        unpermute(jnp.ones((6,)), si, num_tokens=2)
    with pytest.raises(ValueError, match="permuted"):
        unpermute(jnp.ones((6, 4), jnp.int32), si, num_tokens=2)
    with pytest.raises(ValueError, match="sorted_indices"):
        unpermute(jnp.ones((6, 4)), jnp.zeros((5,), jnp.int32), num_tokens=2)
    with pytest.raises(ValueError, match="sorted_indices"):
        unpermute(jnp.ones((6, 4)), jnp.zeros((6, 1), jnp.int32), num_tokens=2)
    with pytest.raises(ValueError, match="probs"):
        unpermute(jnp.ones((6, 4)), si, num_tokens=2, probs=jnp.ones((5,)))
    with pytest.raises(ValueError, match="num_tokens"):
        unpermute(jnp.ones((6, 4)), si, num_tokens=-1)
    with pytest.raises(ValueError, match="row_idx"):
        ops.gather_rows(jnp.ones((6, 4)), jnp.zeros((2, 2), jnp.int32), impl=impl)
    with pytest.raises(ValueError, match="x"):
        ops.gather_rows(jnp.float32(1.0), jnp.zeros((2,), jnp.int32), impl=impl)
    with pytest.raises(ValueError, match="row_idx: expected integer"):
        ops.gather_rows(jnp.ones((6, 4)), jnp.zeros((2,), jnp.float32), impl=impl)
    with pytest.raises(ValueError, match="sorted_indices: expected integer"):
        unpermute(jnp.ones((6, 4)), jnp.zeros((6,), jnp.float32), num_tokens=2)


def test_unpermute_index_out_of_range_raises_at_run_time():
    permuted = jnp.ones((4, 2))
    if cuda_contract():  # the CUDA handler ignores such rows, as the reference does
        for idx, probs in [([0, 1, 99, -1], None), ([0, -2, 1, -1], jnp.ones(4))]:
            kw = dict(num_tokens=3, probs=probs)
            idx = jnp.asarray(idx, jnp.int32)
            np.testing.assert_array_equal(ops.unpermute(permuted, idx, **kw),
                                          ops.unpermute(permuted, idx, impl="xla", **kw))
        return
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(ops.unpermute(permuted, jnp.asarray([0, 1, 99, -1], jnp.int32),
                                            num_tokens=3))
    with pytest.raises(Exception, match="outside"):
        jax.block_until_ready(ops.unpermute(permuted, jnp.asarray([0, -2, 1, -1], jnp.int32),
                                            num_tokens=3, probs=jnp.ones(4)))


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_unpermute_is_bitwise_deterministic(rng, dtype):
    N, H, T = 512, 64, 16  # ~32 rows per token: plenty of reordering room for a racy sum
    permuted = jnp.asarray((rng.standard_normal((N, H)) * 10 ** rng.uniform(-3, 3, (N, 1)))
                           .astype(dtype))
    si = jnp.asarray(rng.integers(-1, T, N).astype(np.int32))
    probs = jnp.asarray(rng.random(N).astype(np.float32))
    f = jax.jit(partial(ops.unpermute, num_tokens=T))
    runs = [np.asarray(f(permuted, si, probs=probs)) for _ in range(3)]
    runs += [np.asarray(ops.unpermute(permuted, si, num_tokens=T, probs=probs)) for _ in range(2)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r.view(np.uint8), runs[0].view(np.uint8))
    # The backward (a gather, then fp32 products) is reproducible too.
    g = [np.asarray(jax.grad(lambda x: (f(x, si, probs=probs).astype(jnp.float32) ** 2).sum())(
        permuted)) for _ in range(2)]
    np.testing.assert_array_equal(g[0].view(np.uint8), g[1].view(np.uint8))

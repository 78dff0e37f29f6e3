"""jax_ep.ops.grouped_matmul: values and gradients of the "ffi", "tiled" and "blocks" impls equal
jax.lax.ragged_dot's (random group sizes with zeros, one group holding every row, rows past the
groups, sums above N; "blocks" both in its block sizes and past them, where it takes the tiled
loop, every rung of the ladder, lopsided steps, mixed dtypes), inside shard_map and vmap
(values and gradients), and a compiled-program check that the tiled path's dots do not
grow with the number of groups. The blocked grouped SwiGLU (swiglu_experts impl="blocks") against
the tiled one, the same way."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jax_ep import ops

N, H, F, G, TILE = 24, 16, 8, 4, 4
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _loss(impl, tile_rows=TILE):
    def f(x, w, sizes):
        y = ops.grouped_matmul(x, w, sizes, impl=impl, tile_rows=tile_rows)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


_LOSSES = {impl: _loss(impl) for impl in ("ffi", "tiled", "blocks", "ragged_dot")}
IMPLS = ("ffi", "tiled", "blocks")


def _operands(seed, dtype, rows=N, groups=G):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, H)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, H, F)) / 4, dtype)
    return x, w


def _cut_sizes(sizes, num_rows):
    """The group sizes that a grouped GEMM over num_rows rows runs: negatives as 0, the sum
    cut at num_rows, in int64 (ragged_dot's own int32 running sum wraps past 2^31)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), num_rows)
    return jnp.asarray(np.diff(ends, prepend=0), jnp.int32)


def _assert_matches_ragged_dot(x, w, sizes, dtype, impl):
    (_, y), (dx, dw) = _LOSSES[impl](x, w, jnp.asarray(sizes, jnp.int32))
    (_, y_ref), (dx_ref, dw_ref) = _LOSSES["ragged_dot"](x, w, _cut_sizes(sizes, x.shape[0]))
    assert y.dtype == y_ref.dtype == dtype and dx.dtype == dw.dtype == dtype
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **TOL[dtype])
    end = min(int(np.sum(np.asarray(sizes, np.int64))), x.shape[0])
    assert not np.asarray(y[end:], np.float32).any()  # rows past the groups are zero


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [[0, 0, 0, 0], [N, 0, 0, 0], [0, 0, 0, N], [0, N, 0, 0],
                                   [5, 0, 3, 0], [1, 1, 1, 1], [3, 4, 5, 12], [0, 40, 0, 0],
                                   [20, 0, 0, 9], [2**31 - 1, 1, 0, 0],
                                   [0, 2**31 - 1, 2**31 - 1, 5]])
@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_edge_group_sizes_match_ragged_dot(sizes, dtype, impl):
    # "blocks" over N = 24 rows in G = 4 groups: blocks of 6 rows, the tiled loop past that;
    # sizes near 2^31 must not overflow the groups' running sum (it wrapped negative before)
    x, w = _operands(sum(sizes), dtype)
    _assert_matches_ragged_dot(x, w, sizes, dtype, impl)


@pytest.mark.parametrize("sizes", [[2**31 - 1, 1, 0, 0], [0, 2**31 - 1, 2**31 - 1, 5],
                                   [-3, 30, -(2**31), 2**31 - 1]])
def test_ragged_dot_impl_cuts_sizes_whose_sum_wraps_int32(sizes):
    # jax.lax.ragged_dot itself wraps its running sum: [0, 2^31 - 1, 2^31 - 1, 5] gives
    # rows 0-2 to the last group too
    x, w = _operands(7, jnp.float32)
    _assert_matches_ragged_dot(x, w, sizes, jnp.float32, "ragged_dot")


def test_narrow_integer_group_sizes():
    """int8 / uint8 sizes: the row bound (1000, 300) does not fit their dtype, so the bounds
    are computed in int32 (clipping int8 sizes at 1000 wrapped to -24 before)."""
    starts, ends = ops.group_bounds(jnp.array([3, 4, 5], jnp.int8), 1000)
    np.testing.assert_array_equal(starts, [0, 3, 7])
    np.testing.assert_array_equal(ends, [3, 7, 12])
    np.testing.assert_array_equal(ops.group_bounds(jnp.array([250, 5], jnp.uint8), 300)[1],
                                  [250, 255])
    x, w = jnp.ones((300, 2)), jnp.ones((3, 2, 1))
    for impl in ("ragged_dot",) + IMPLS:
        y = ops.grouped_matmul(x, w, jnp.array([100, 100, 100], jnp.int8), impl=impl)
        np.testing.assert_array_equal(np.asarray(y), 2.0)


@settings(max_examples=20)
@given(sizes=st.lists(st.integers(0, 12), min_size=G, max_size=G),
       seed=st.integers(0, 2**16), bf16=st.booleans(), impl=st.sampled_from(IMPLS))
def test_grouped_matmul_random_group_sizes_match_ragged_dot(sizes, seed, bf16, impl):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    x, w = _operands(seed, dtype)
    _assert_matches_ragged_dot(x, w, sizes, dtype, impl)


@pytest.mark.parametrize("sizes,rung", [([5, 0, 2], 0), ([14, 0, 5], 1), ([20, 10, 3], 2),
                                        ([30, 30, 30], 3), ([34, 34, 32], 4), ([10, 40, 30], 5)])
def test_blocks_on_every_rung_of_the_ladder_match_ragged_dot(sizes, rung):
    # N = 100 rows in G = 3 groups: the ladder is 8, 16, 24, 32, 34 rows; rung 5 = tiled loop
    x, w = _operands(rung, jnp.float32, rows=100, groups=3)
    assert ops.block_ladder(100, 3) == (8, 16, 24, 32, 34)
    index = ops.group_block_choice(jnp.asarray(sizes, jnp.int32), 100, (8, 16, 24, 32, 34))[0]
    assert int(index) == rung
    sizes = jnp.asarray(sizes, jnp.int32)
    (_, y), grads = _LOSSES["blocks"](x, w, sizes)
    (_, y_ref), grads_ref = _LOSSES["ragged_dot"](x, w, sizes)
    for got, want in zip((y, *grads), (y_ref, *grads_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_lopsided_step_takes_the_tiled_loop_with_the_same_values(impl):
    # G = 16 groups over N = 512 rows (ladder up to 32): one group of 30 rows, the rest empty;
    # 16 blocks of 32 rows are above 3x the 30 rows + 8 per group, so "blocks" loops instead
    x, w = _operands(9, jnp.float32, rows=512, groups=16)
    sizes = jnp.zeros((16,), jnp.int32).at[11].set(30)
    ladder = ops.block_ladder(512, 16)
    assert int(ops.group_block_choice(sizes, 512, ladder)[0]) == len(ladder)
    _assert_matches_ragged_dot(x, w, sizes, jnp.float32, impl)


@pytest.mark.parametrize("impl", ["ffi", "blocks"])
def test_mixed_dtypes_promote_and_return_each_operands_gradient_dtype(impl):
    # bf16 rows, f32 weights: the product and dw in f32, dx in bf16, as ragged_dot on f32 rows
    x, w = _operands(12, jnp.bfloat16)
    w = w.astype(jnp.float32)
    sizes = jnp.asarray([3, 9, 0, 7], jnp.int32)
    (_, y), (dx, dw) = _LOSSES[impl](x, w, sizes)
    (_, y_ref), (dx_ref, dw_ref) = _LOSSES["ragged_dot"](x.astype(jnp.float32), w, sizes)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx, np.float32), dx_ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,tile", [(7, 4), (24, 32), (1, 1)])
def test_grouped_matmul_rows_not_a_multiple_of_the_tile(rows, tile, impl):
    x, w = _operands(rows, jnp.float32, rows=rows)
    sizes = jnp.asarray([rows // 2, 0, rows - rows // 2, 0], jnp.int32)
    got = ops.grouped_matmul(x, w, sizes, impl=impl, tile_rows=tile)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_inside_shard_map_with_replicated_weights(impl):
    # Tokens vary over both mesh axes, weights only over "expert": dw sums over "data"; each
    # device picks its own block size ("blocks").
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "expert"))
    x, w = _operands(1, jnp.float32, rows=4 * N, groups=2 * G)
    sizes = jnp.asarray(np.random.default_rng(2).integers(0, 8, (4 * G,)), jnp.int32)

    def loss(impl):
        def local(x, w, sizes):
            y = ops.grouped_matmul(x, w, sizes, impl=impl, tile_rows=TILE)
            return jax.lax.psum(jnp.sum(jnp.sin(y)), ("data", "expert"))
        body = jax.shard_map(local, mesh=mesh, out_specs=P(),
                             in_specs=(P(("data", "expert")), P("expert"),
                                       P(("data", "expert"))))
        return jax.jit(jax.value_and_grad(body, argnums=(0, 1)))

    (v, (dx, dw)), (v_ref, (dx_ref, dw_ref)) = (loss(impl)(x, w, sizes),
                                                loss("ragged_dot")(x, w, sizes))
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_under_vmap(impl):
    x, w = _operands(3, jnp.float32)
    sizes = jnp.asarray([[3, 0, 5, 6], [0, 24, 0, 0]], jnp.int32)  # "blocks": blocks, tiled
    got = jax.vmap(lambda s: ops.grouped_matmul(x, w, s, impl=impl, tile_rows=TILE))(sizes)
    for b in range(2):
        np.testing.assert_allclose(got[b], jax.lax.ragged_dot(x, w, sizes[b]), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmul_gradients_under_vmap_with_batched_group_sizes(impl):
    # one batch element per branch of "blocks": a block size, the tiled loop (past the ladder)
    x, w = _operands(13, jnp.float32)
    sizes = jnp.asarray([[3, 0, 5, 6], [0, 24, 0, 0], [6, 6, 6, 6]], jnp.int32)

    def grads(impl):
        def loss(x, w, s):
            return jnp.sum(jnp.sin(ops.grouped_matmul(x, w, s, impl=impl, tile_rows=TILE)))
        return jax.grad(loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(grads(impl), in_axes=(None, None, 0)))(x, w, sizes)
    for b in range(3):  # ragged_dot's gradient does not vmap over group_sizes: one at a time
        want = jax.jit(grads("ragged_dot"))(x, w, sizes[b])
        for a, c in zip(got, want):
            np.testing.assert_allclose(a[b], c, rtol=1e-5, atol=1e-5)


def _lowered(x, w, sizes, impl):
    return jax.jit(lambda x, w, s: ops.grouped_matmul(x, w, s, impl=impl)).lower(
        x, w, sizes).as_text()


def test_grouped_matmul_auto_on_cpu_and_argument_checks(monkeypatch):
    # "auto" on CPU is the CPU handler: one custom call forward, two in the backward
    sizes = jnp.asarray([6, 6, 6, 6], jnp.int32)
    x, w = _operands(4, jnp.float32)
    auto = _lowered(x, w, sizes, "auto")
    assert auto == _lowered(x, w, sizes, "ffi")
    assert auto.count("@jax_ep_grouped_gemm(") == 1
    assert "stablehlo.while" not in auto and "stablehlo.case" not in auto
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(ops.grouped_matmul(x, w, sizes) ** 2),
                            argnums=(0, 1))).lower(x, w).as_text()
    assert grad.count("@jax_ep_grouped_gemm(") == 2 and grad.count("@jax_ep_grouped_gemm_dw(") == 1
    from jax_ep.flax import swiglu_experts  # both GEMMs of the SwiGLU take the handler
    text = jax.jit(lambda x, a, b: swiglu_experts(x, sizes, a, b)).lower(
        x, jnp.zeros((4, H, 2 * F)), jnp.zeros((4, F, H))).as_text()
    assert text.count("@jax_ep_grouped_gemm(") == 2
    # the resolution for a float64 dtype (grouped_matmul itself refuses float64 operands):
    # the handler computes in float32, "auto" takes "tiled"
    assert ops.grouped_matmul_impl("auto", jnp.bfloat16) == "ffi"
    assert ops.grouped_matmul_impl("auto", np.float64) == "tiled"
    with pytest.raises(ValueError, match="impl: 'ffi' computes in float32, the operands are "
                                         "float64"):
        ops.grouped_matmul_impl("ffi", np.float64)
    monkeypatch.setattr(ops._ffi, "trace_platform", lambda: "gpu")  # a program on GPUs
    with pytest.raises(ValueError, match="impl: 'ffi' is the grouped GEMM's CPU handler, "
                                         "this program runs on gpu"):
        ops.grouped_matmul_impl("ffi")
    monkeypatch.undo()
    x, w = _operands(4, jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        ops.grouped_matmul(x, w, sizes, impl="megablox")
    with pytest.raises(ValueError, match="w"):
        ops.grouped_matmul(x, w[:, :3], sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        ops.grouped_matmul(x, w, sizes[:3])
    with pytest.raises(ValueError, match="tile_rows"):
        ops.grouped_matmul(x, w, sizes, tile_rows=0)
    with pytest.raises(ValueError, match="group_sizes: expected an integer"):
        ops.grouped_matmul(x, w, sizes.astype(jnp.float32), impl="blocks")


def _group_rows(sizes, num_rows):
    """The row slice of each group: consecutive from row 0, negative sizes as 0, cut at
    num_rows."""
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), num_rows)
    return [slice(int(s), int(e)) for s, e in zip(np.concatenate([[0], ends[:-1]]), ends)]


def _grouped_f64(x, w, sizes):
    """numpy float64 model: out[r] = x[r] @ w[g] for the rows of group g, 0 past the groups."""
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, rows in enumerate(_group_rows(sizes, x.shape[0])):
        out[rows] = x[rows].astype(np.float64) @ w[g].astype(np.float64)
    return out


@pytest.mark.parametrize("platform, rows, w_shape, dtype, expected", [
    ("gpu", 8192, (8, 2048, 1408), jnp.bfloat16, "ragged_dot"),  # the H200's faster case
    ("gpu", 32768, (32, 7168, 2048), jnp.bfloat16, "tiled"),  # ... and its slower one
    ("gpu", 8192, (256, 1024, 2048), jnp.bfloat16, "tiled"),  # the 64 GiB request
    ("gpu", 64, (9, 16, 16), jnp.float32, "tiled"),  # one group past the bound
    ("gpu", 65536, (8, 7168, 4096), jnp.bfloat16, "tiled"),  # 8 groups, a 7 GiB broadcast
    ("gpu", 64, (8, 16, 16), jnp.float32, "ragged_dot"),
    ("gpu", None, None, jnp.float32, "tiled"),  # no shapes: the loop, whose work follows rows
    ("tpu", 8192, (256, 1024, 2048), jnp.bfloat16, "ragged_dot"),  # a grouped kernel there
])
def test_auto_off_cpu_takes_ragged_dot_where_its_dense_expansion_is_cheap(
        monkeypatch, platform, rows, w_shape, dtype, expected):
    monkeypatch.setattr(ops._ffi, "trace_platform", lambda: platform)
    assert ops.grouped_matmul_impl("auto", dtype, num_rows=rows, w_shape=w_shape) == expected


@pytest.mark.parametrize("groups, expected", [(4, "ragged_dot_general"), (16, "while")])
def test_auto_grouped_gemms_of_a_gpu_program(monkeypatch, groups, expected):
    """grouped_matmul and swiglu_experts in a program for GPUs: ragged_dot up to
    GPU_RAGGED_DOT_MAX_GROUPS local experts, the tiled loop (no ragged_dot) beyond."""
    from jax_ep.flax import swiglu_experts
    monkeypatch.setattr(ops._ffi, "trace_platform", lambda: "gpu")
    x, w = _operands(5, jnp.float32, rows=64, groups=groups)
    sizes = jnp.full((groups,), 64 // groups, jnp.int32)
    w_gate_up, w_down = jnp.zeros((groups, H, 2 * F)), jnp.zeros((groups, F, H))
    for fn, args in ((lambda x, w: ops.grouped_matmul(x, w, sizes), (x, w)),
                     (lambda x, a, b: swiglu_experts(x, sizes, a, b), (x, w_gate_up, w_down))):
        text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=1))(*args))
        assert expected in text
        assert ("ragged_dot_general" in text) == (groups <= ops.GPU_RAGGED_DOT_MAX_GROUPS)


@pytest.mark.parametrize("rows,depth,width,sizes", [
    (263, 300, 70, [0, 7, 261, 9]),     # row tiles of 6 with a tail, depth past 256, 70 cols
    (13, 5, 1, [-3, 13, 4]),            # a negative size, one column, a sum above the rows
    (40, 16, 129, [0, 0, 0]),           # no rows in any group: all zero
    (300, 8, 16, [300]),                # one group, dw's depth (its rows) past 256
    (20, 32, 84, [9, 11]),              # last panel: one whole vector and part of another
    (30, 45, 301, [10, 20]),            # dx's transposed pack: squares, tails, depth past 256
    (330, 1024, 602, [20, 0, 290, 20]),  # dw's 9.4 MiB output streamed (rows of 2408 bytes:
    #   aligned and not, at 4, 8 and 16 lanes); a group past 256 rows and an empty one
])
def test_ffi_handlers_against_a_float64_model(rows, depth, width, sizes):
    # The handlers themselves: forward, the transposed forward (dx) and dw, against float64;
    # the shapes cross the register tile's row tail, the packed panel's column tail and the
    # 256-deep blocks the sums are split into.
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = rng.standard_normal((len(sizes), depth, width)).astype(np.float32)
    dy = rng.standard_normal((rows, width)).astype(np.float32)
    g = np.asarray(sizes, np.int32)
    call = functools.partial(ops._ffi.call, cuda_twin=False)
    out = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    y = call("jax_ep_grouped_gemm", out, x, w, g, transpose_rhs=False)
    np.testing.assert_allclose(y, _grouped_f64(x, w, sizes), rtol=1e-5, atol=1e-4)
    dx = call("jax_ep_grouped_gemm", jax.ShapeDtypeStruct((rows, depth), jnp.float32), dy, w, g,
              transpose_rhs=True)  # w [G, depth, width] read as [G, N, K]: dy @ w[g]^T
    np.testing.assert_allclose(dx, _grouped_f64(dy, w.swapaxes(1, 2), sizes), rtol=1e-5,
                               atol=1e-4)
    dw = call("jax_ep_grouped_gemm_dw", jax.ShapeDtypeStruct(w.shape, jnp.float32), x, dy, g)
    for k, group in enumerate(_group_rows(sizes, rows)):
        want = x[group].T.astype(np.float64) @ dy[group]
        np.testing.assert_allclose(dw[k], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes", [[5, 0, 12, 4], [30, 0, 0, 0], [3, 9, 2, 1]])
def test_ffi_gradients_of_gradients_match_a_dense_grouped_product(sizes):
    """Second order through impl="ffi" (a gradient penalty: the gradient of the squared norm
    of the gradient): its three handler products are each the others' VJPs, so they are
    differentiable again; equal to the autodiff of a dense one-hot product, with rows past
    the groups (sum 21 < 24), an empty group and a sum above the rows (30)."""
    x, w = _operands(3, jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    rows = np.zeros(N, np.int32)
    mask = np.zeros((N, 1), np.float32)
    for g, sl in enumerate(_group_rows(sizes, N)):
        rows[sl], mask[sl] = g, 1.0

    def dense(x, w):
        return jnp.einsum("nh,nhf->nf", x, w[rows]) * mask

    def penalty(product):
        def loss(x, w):
            return jnp.sum(jnp.sin(product(x, w)))
        return lambda x, w: sum(jnp.sum(g ** 2) for g in jax.grad(loss, argnums=(0, 1))(x, w))

    got = jax.jit(jax.grad(penalty(lambda x, w: ops.grouped_matmul(
        x, w, group_sizes, impl="ffi")), argnums=(0, 1)))(x, w)
    want = jax.grad(penalty(dense), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_ffi_handler_refuses_mismatched_operands():
    call = functools.partial(ops._ffi.call, cuda_twin=False)
    x, w = np.zeros((6, 4), np.float32), np.zeros((2, 5, 3), np.float32)
    sizes = np.asarray([3, 3], np.int32)
    with pytest.raises(Exception, match=r"rhs: expected \[G, K=4, N\] to match lhs"):
        call("jax_ep_grouped_gemm", jax.ShapeDtypeStruct((6, 3), jnp.float32), x, w, sizes,
             transpose_rhs=False)
    with pytest.raises(Exception, match=r"group_sizes: expected shape \[2\], got \[3\]"):
        call("jax_ep_grouped_gemm", jax.ShapeDtypeStruct((6, 3), jnp.float32), x,
             np.zeros((2, 4, 3), np.float32), np.asarray([1, 2, 3], np.int32),
             transpose_rhs=False)
    with pytest.raises(Exception, match="rhs: expected 6 rows to match lhs"):
        call("jax_ep_grouped_gemm_dw", jax.ShapeDtypeStruct((2, 4, 3), jnp.float32), x,
             np.zeros((5, 3), np.float32), sizes)


def test_ffi_grouped_matmul_runs_its_cpu_handler_under_emulated_cuda():
    # No CUDA twin: with the emulated CUDA handlers in use, the CPU handler still runs.
    from jax_ep import _ffi
    if not _ffi.WITH_CUDA_EMU:
        pytest.skip("this build has no emulated CUDA handlers")
    x, w = _operands(5, jnp.float32)
    sizes = jnp.asarray([3, 9, 0, 7], jnp.int32)
    with _ffi.use_handlers("cuda_emu"):
        got = jax.jit(lambda x, w: ops.grouped_matmul(x, w, sizes, impl="ffi"))(x, w)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)


def test_block_ladder_and_the_block_each_largest_group_gets():
    # 8 * 2^(j/2) rounded up to 8, up to ceil(N/G); the first size holding the largest group,
    # len(ladder) (the tiled loop) past the last or where the blocks would be lopsided
    assert ops.block_ladder(1024, 2) == (8, 16, 24, 32, 48, 64, 96, 128, 184, 256, 368, 512)
    assert ops.block_ladder(4096, 64) == (8, 16, 24, 32, 48, 64)
    assert ops.block_ladder(24, 4) == (6,) and ops.block_ladder(1, 8) == (1,)
    ladder = ops.block_ladder(1024, 2)
    for sizes, want in (([0, 0], 0), ([8, 3], 0), ([9, 0], 1), ([100, 120], 7), ([512, 512], 11),
                        ([513, 0], 12), ([-5, 600], 12), ([2000, 0], 12)):
        index, starts, ends = ops.group_block_choice(jnp.asarray(sizes, jnp.int32), 1024, ladder)
        assert int(index) == want, sizes
    # lopsided: 64 blocks of 64 rows for 60 rows in groups is above 3x them (+ 8 per group)
    lopsided = jnp.zeros((64,), jnp.int32).at[5].set(60)
    assert int(ops.group_block_choice(lopsided, 4096, ops.block_ladder(4096, 64))[0]) == 6
    balanced = jnp.full((64,), 16, jnp.int32).at[5].set(20)
    assert int(ops.group_block_choice(balanced, 4096, ops.block_ladder(4096, 64))[0]) == 2
    # cut at N: 2000 rows of 1024 -> the group holds 1024; ends/starts as the tiled loop's
    index, starts, ends = ops.group_block_choice(jnp.asarray([700, 500], jnp.int32), 1024, ladder)
    assert starts.tolist() == [0, 700] and ends.tolist() == [700, 1024]


def test_group_blocks_gather_and_scatter_back_hand_checked():
    x = jnp.arange(7 * 2, dtype=jnp.float32).reshape(7, 2) + 1
    starts, ends = jnp.asarray([0, 2, 2]), jnp.asarray([2, 2, 5])  # sizes 2, 0, 3; rows 5, 6 out
    blocks = ops.to_group_blocks(x, starts, ends, 3)
    assert blocks[:, :, 0].tolist() == [[1, 3, 0], [0, 0, 0], [5, 7, 9]]
    back = ops.from_group_blocks(blocks * 10, starts, ends, 7)
    assert back[:, 0].tolist() == [10, 30, 50, 70, 90, 0, 0]


def _dot_shapes(groups):
    """The operand shapes of every dot in the optimized CPU program of the tiled grouped GEMM
    (forward and backward) over 512 rows and `groups` groups."""
    x, w = _operands(5, jnp.float32, rows=512, groups=groups)
    sizes = jnp.full((groups,), 512 // groups, jnp.int32)
    fn = jax.jit(jax.grad(lambda x, w: jnp.sum(ops.grouped_matmul(x, w, sizes, impl="tiled",
                                                                  tile_rows=32) ** 2), (0, 1)))
    text = fn.lower(x, w).compile().as_text()
    return sorted(m.group(1) for m in re.finditer(r"=\s*(f32\[[\d,]*\])[^\n]*\bdot\(", text))


def test_tiled_dots_do_not_grow_with_the_number_of_groups():
    # ragged_dot on XLA:CPU multiplies every row by every group's weights; the tiled loop's
    # dots are one row tile by one group's weights, whatever G (the trip count is dynamic).
    few, many = _dot_shapes(2), _dot_shapes(16)
    assert few and few == many, (few, many)
    assert all(re.fullmatch(r"f32\[(32,\d+|16,8)\]", s) for s in few), few


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_expert_blocks_is_the_grouped_swiglu_of_equal_blocks(dtype):
    # drop-and-pad's experts: L = 3 blocks of C = 5 rows (zero padding rows among them) as one
    # batched GEMM per weight give the grouped SwiGLU's values and gradients
    from jax_ep.flax import swiglu_expert_blocks, swiglu_experts
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (15, 8), dtype).at[3:5].set(0).at[14].set(0)
    wgu = (jax.random.normal(keys[1], (3, 8, 12)) * 0.3).astype(dtype)
    wd = (jax.random.normal(keys[2], (3, 6, 8)) * 0.3).astype(dtype)
    cot = jax.random.normal(keys[3], (15, 8), jnp.float32)
    sizes = jnp.full((3,), 5, jnp.int32)

    def loss(fn):
        return jax.jit(jax.value_and_grad(
            lambda x, a, b: jnp.sum(fn(x, a, b).astype(jnp.float32) * cot), (0, 1, 2)))
    got = loss(swiglu_expert_blocks)(x, wgu, wd)
    want = loss(lambda x, a, b: swiglu_experts(x, sizes, a, b, impl="tiled", tile_rows=4))(
        x, wgu, wd)
    assert swiglu_expert_blocks(x, wgu, wd).dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tol, atol=tol)


def _swiglu_operands(rows, experts, dtype, seed=11):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (rows, 8), dtype)
    wgu = (jax.random.normal(keys[1], (experts, 8, 12)) * 0.3).astype(dtype)
    wd = (jax.random.normal(keys[2], (experts, 6, 8)) * 0.3).astype(dtype)
    return x, wgu, wd, jax.random.normal(keys[3], (rows, 8), jnp.float32)


@functools.cache
def _swiglu_loss(impl):
    """jit(value_and_grad) of sum(swiglu_experts(x, sizes, a, b) * cot) in (x, a, b): one
    program per impl and shapes, whatever the sizes."""
    from jax_ep.flax import swiglu_experts
    return jax.jit(jax.value_and_grad(lambda x, a, b, sizes, cot: jnp.sum(
        swiglu_experts(x, sizes, a, b, impl=impl, tile_rows=4).astype(jnp.float32) * cot),
        (0, 1, 2)))


def _assert_swiglu_matches_tiled(impl, sizes, dtype):
    """swiglu_experts(impl) over N = 100 rows and L = 3 experts: the value and the gradients
    equal the tiled SwiGLU's, in dtype."""
    x, wgu, wd, cot = _swiglu_operands(100, 3, dtype)
    (v, grads), (v_ref, grads_ref) = (_swiglu_loss(name)(x, wgu, wd, sizes, cot)
                                      for name in (impl, "tiled"))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(v, v_ref, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,rung", [([0, 0, 0], 0), ([5, 0, 2], 0), ([14, 0, 5], 1),
                                        ([20, 10, 3], 2), ([30, 30, 30], 3), ([34, 0, 34], 4),
                                        ([33, 33, 33], 4), ([10, 40, 30], 5), ([0, 95, 5], 5),
                                        ([-3, 120, 1], 5)])
def test_blocked_swiglu_matches_the_tiled_grouped_swiglu(sizes, rung, dtype):
    # N = 100 rows, L = 3: blocks of 8, 16, 24, 32 or 34 rows (rungs 0-4); rung 5 is the tiled
    # loop, for a largest group above 34 rows
    sizes = jnp.asarray(sizes, jnp.int32)
    assert int(ops.group_block_choice(sizes, 100, ops.block_ladder(100, 3))[0]) == rung
    _assert_swiglu_matches_tiled("blocks", sizes, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [[0, 0, 0], [5, 0, 2], [33, 33, 33], [0, 95, 5],
                                   [-3, 120, 1]])
def test_ffi_swiglu_matches_the_tiled_grouped_swiglu(sizes, dtype):
    _assert_swiglu_matches_tiled("ffi", jnp.asarray(sizes, jnp.int32), dtype)


@pytest.mark.parametrize("impl", ["blocks", "ffi"])
def test_swiglu_per_device_groups_in_shard_map_and_under_vmap(impl):
    # each device of the shard_map has its own groups ("blocks": its own block size, one
    # takes the tiled loop)
    from jax_ep.flax import swiglu_experts
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    x, wgu, wd, cot = _swiglu_operands(4 * 40, 2, jnp.float32)
    sizes = jnp.asarray([[3, 5], [20, 20], [0, 38], [0, 0]], jnp.int32)

    def loss(name):
        def local(x, wgu, wd, sizes, cot):
            y = swiglu_experts(x, sizes[0], wgu, wd, impl=name, tile_rows=4)
            return jax.lax.psum(jnp.sum(y * cot), "expert")
        body = jax.shard_map(local, mesh=mesh, out_specs=P(),
                             in_specs=(P("expert"), P(), P(), P("expert"), P("expert")))
        return jax.jit(jax.value_and_grad(body, argnums=(0, 1, 2)))
    got, want = (loss(name)(x, wgu, wd, sizes, cot) for name in (impl, "tiled"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def rows_of(name):
        return jax.jit(jax.vmap(lambda s: swiglu_experts(x[:40], s, wgu, wd, impl=name)))
    np.testing.assert_allclose(rows_of(impl)(sizes), rows_of("tiled")(sizes), rtol=1e-5,
                               atol=1e-5)


def test_blocked_swiglu_checks_its_weights():
    from jax_ep.flax import swiglu_experts
    x, wgu, wd, _ = _swiglu_operands(10, 2, jnp.float32)
    sizes = jnp.asarray([5, 5], jnp.int32)
    with pytest.raises(ValueError, match="w_down"):
        swiglu_experts(x, sizes, wgu, wd[:, :4], impl="blocks")
    with pytest.raises(ValueError, match="w_gate_up"):
        swiglu_experts(x, sizes, wgu[:, :3], wd, impl="blocks")
    with pytest.raises(ValueError, match="w_down: expected float"):
        swiglu_experts(x, sizes, wgu, wd.astype(jnp.int32), impl="blocks")
    assert swiglu_experts(x[:0], sizes, wgu, wd, impl="blocks").shape == (0, 8)
    assert swiglu_experts(x, sizes, wgu, wd[:, :, :0], impl="blocks").shape == (10, 0)
    with pytest.raises(ValueError, match="tile_rows"):
        swiglu_experts(x, sizes, wgu, wd, impl="blocks", tile_rows=0)
    # F = 0: no hidden units, zero output and zero gradients, as the tiled SwiGLU gives
    cot = jnp.ones((10, 8), jnp.float32)
    (v, grads), (v_ref, grads_ref) = (_swiglu_loss(impl)(x, wgu[:, :, :0], wd[:, :0], sizes, cot)
                                      for impl in ("blocks", "tiled"))
    assert float(v) == float(v_ref) == 0.0
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and not np.asarray(a).any() and not np.asarray(b).any()


def test_swiglu_lopsided_step_and_mixed_dtypes():
    # L = 16 experts over N = 512 rows: one expert with 30 rows takes the tiled loop (lopsided);
    # bf16 tokens with f32 weights run both GEMMs in f32: the tiled SwiGLU of f32 tokens
    x, wgu, wd, cot = _swiglu_operands(512, 16, jnp.float32)
    ladder = ops.block_ladder(512, 16)
    lopsided, balanced = jnp.zeros((16,), jnp.int32).at[11].set(30), jnp.full((16,), 31, jnp.int32)
    assert int(ops.group_block_choice(lopsided, 512, ladder)[0]) == len(ladder)
    assert int(ops.group_block_choice(balanced, 512, ladder)[0]) == len(ladder) - 1
    for sizes in (lopsided, balanced):
        (v, grads), (v_ref, grads_ref) = (_swiglu_loss(impl)(x, wgu, wd, sizes, cot)
                                          for impl in ("blocks", "tiled"))
        for a, b in zip((v, *grads), (v_ref, *grads_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    x16, sizes = x.astype(jnp.bfloat16), jnp.asarray([31, 0, 5] + [20] * 13, jnp.int32)
    for impl in ("blocks", "ffi"):
        (v, (dx, *dws)), (v_ref, (dx_ref, *dws_ref)) = (
            _swiglu_loss(impl)(x16, wgu, wd, sizes, cot),
            _swiglu_loss("tiled")(x16.astype(jnp.float32), wgu, wd, sizes, cot))
        assert dx.dtype == jnp.bfloat16
        np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(dx, np.float32), dx_ref, rtol=1e-2, atol=1e-2)
        for a, b in zip(dws, dws_ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_blocked_swiglu_fallback_backward_reruns_no_forward_gemm():
    # the blocks' tiled fallback keeps its gate/up activations, so its backward holds only the
    # two GEMMs' backward products (dx and dw each): 4 dots. With 5 ladder sizes (2 dots
    # forward, 4 backward each) and the fallback's 2 forward dots, the gradient program holds
    # 10 + 2 + 20 + 4 = 36 dots (37 when the fallback's backward recomputed gate/up)
    x, wgu, wd, cot = _swiglu_operands(100, 3, jnp.float32)
    sizes = jnp.asarray([10, 40, 30], jnp.int32)
    program = _swiglu_loss("blocks").lower(x, wgu, wd, sizes, cot).as_text()
    assert len(ops.block_ladder(100, 3)) == 5
    assert program.count("stablehlo.dot_general") == 36
    assert program.count("stablehlo.case") == 2  # the forward's switch and the backward's


def _dense_biased_experts(x, sizes, wgu, wd, bgu, bd):
    """The per-row reference of swiglu_experts with biases: row r of group g gets
    swiglu(x_r @ wgu[g] + bgu[g]) @ wd[g] + bd[g]; rows past the groups 0."""
    from jax_ep.flax.activations import swiglu
    ends = jnp.cumsum(jnp.maximum(sizes, 0))
    rows = jnp.arange(x.shape[0])
    group = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # G for rows past the groups
    every = jnp.einsum("lnf,lfh->lnh", swiglu(jnp.einsum("nh,lhf->lnf", x, wgu)
                                               + bgu[:, None]), wd) + bd[:, None]
    picked = every[jnp.minimum(group, sizes.shape[0] - 1), rows]
    return jnp.where((group < sizes.shape[0])[:, None], picked, 0.0)


@pytest.mark.parametrize("impl", ["tiled", "ffi", "blocks", "ragged_dot"])
@pytest.mark.parametrize("sizes", [[14, 0, 5], [33, 33, 33], [0, 95, 5], [-3, 120, 1]])
def test_swiglu_experts_with_biases_match_the_per_row_reference(impl, sizes):
    """Megatron's add_bias_linear: b_gate_up [L, 2F] and b_down [L, H] on each expert's rows,
    on every impl ("blocks" on a ladder rung and, for a largest group above 34 rows, its tiled
    fallback); rows past the groups stay zero; gradients in all five operands."""
    from jax_ep.flax import swiglu_experts
    x, wgu, wd, cot = _swiglu_operands(100, 3, jnp.float32)
    bgu, bd = (jax.random.normal(jax.random.key(k), shape) for k, shape in ((7, (3, 12)),
                                                                             (8, (3, 8))))
    sizes = jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), (0, 1, 2, 3, 4)))
    (v, grads), (v_ref, grads_ref) = (
        loss(lambda x, a, b, c, d: swiglu_experts(x, sizes, a, b, impl=impl, tile_rows=4,
                                                  b_gate_up=c, b_down=d))(x, wgu, wd, bgu, bd),
        loss(lambda *a: _dense_biased_experts(a[0], sizes, *a[1:]))(x, wgu, wd, bgu, bd))
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(grads, grads_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    y = swiglu_experts(x, sizes, wgu, wd, impl=impl, b_gate_up=bgu, b_down=bd)
    routed = int(jnp.sum(jnp.maximum(sizes, 0)))
    assert not np.asarray(y[routed:]).any()
    assert np.abs(np.asarray(y[:routed] - swiglu_experts(x, sizes, wgu, wd, impl=impl)[
        :routed])).min() > 0  # every routed row moved by its biases


def test_swiglu_experts_checks_its_biases_and_keeps_the_gemm_dtype():
    # a bias of the wrong shape is refused (not broadcast); an f32 bias with bf16 operands
    # runs in bf16 on every impl (the biases promote nothing)
    from jax_ep.flax import swiglu_experts
    x, wgu, wd, _ = _swiglu_operands(10, 2, jnp.bfloat16)
    sizes = jnp.asarray([5, 5], jnp.int32)
    bgu, bd = jnp.ones((2, 12), jnp.float32), jnp.ones((2, 8), jnp.float32)
    for impl in ("blocks", "ffi", "tiled"):
        y = swiglu_experts(x, sizes, wgu, wd, impl=impl, b_gate_up=bgu, b_down=bd)
        assert y.dtype == jnp.bfloat16
        with pytest.raises(ValueError, match=r"b_down: expected shape \(2, 8\)"):
            swiglu_experts(x, sizes, wgu, wd, impl=impl, b_down=bd[:, :1])
        with pytest.raises(ValueError, match=r"b_gate_up: expected shape \(2, 12\)"):
            swiglu_experts(x, sizes, wgu, wd, impl=impl, b_gate_up=bgu[0])
        with pytest.raises(ValueError, match="b_down: expected a float"):
            swiglu_experts(x, sizes, wgu, wd, impl=impl, b_down=bd.astype(jnp.int32))

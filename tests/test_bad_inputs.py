"""Bad inputs found by fuzzing the public API: each is now a ValueError naming the argument.
Before, 4-bit rows corrupted memory in every FFI row mover (a row was read at twice its
size: wrong rows, SIGSEGV or a heap abort), a huge pad_multiple overflowed the permute
plan's offsets (heap abort), wide or unsigned group sizes wrapped to wrong products, and the
other cases were silently accepted or failed deep inside with errors naming internals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_ep
from ep_utils import AXIS, ep_mesh, random_routing, run_ep
from jax_ep import _ffi, deepep, ops
from jax_ep.flax import MoELayer

T, H, K, E = 4, 8, 2, 8
SUB_BYTE = [jnp.int4, jnp.uint4, jnp.float4_e2m1fn]
PACKED = "packs two values per byte"


def _routing(num_ranks, seed=0):
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    return np.asarray(idx, np.int32), np.asarray(w, np.float32)


@pytest.mark.parametrize("dtype", SUB_BYTE)
def test_sub_byte_rows_are_refused_by_every_row_mover(dtype):
    x = jnp.zeros((8, 64), dtype)
    with pytest.raises(ValueError, match=f"^x: .*{PACKED}"):
        ops.gather_rows(x, jnp.array([7, 0, 3]))
    with pytest.raises(ValueError, match=f"jax_ep_gather_rows: operand 0: .*{PACKED}"):
        _ffi.call("jax_ep_gather_rows", jax.ShapeDtypeStruct((3, 64), dtype), x,
                  jnp.array([7, 0, 3], jnp.int32))  # the backstop below every entry point
    mesh = ep_mesh(4)
    idx, w = _routing(4)
    rows = np.zeros((4 * T, H), np.float32)
    cases = {
        "dispatch": lambda x, i, w: jax_ep.dispatch(x.astype(dtype), i, w, num_experts=E,
                                                    axis_name=AXIS)[0],
        "dispatch alltoall": lambda x, i, w: jax_ep.dispatch(
            x.astype(dtype), i, w, num_experts=E, axis_name=AXIS, backend="alltoall",
            transport="all_to_all")[0],
        "hybridep": lambda x, i, w: jax_ep.hybridep_dispatch(
            x.astype(dtype), topk_idx=i, num_experts=E, axis_name=AXIS)[0],
        "low_latency": lambda x, i, w: jax_ep.low_latency_dispatch(
            x.astype(dtype), i, num_max_dispatch_tokens_per_rank=T, num_experts=E,
            axis_name=AXIS)[0],
        "all_to_all_single": lambda x, i, w: jax_ep.all_to_all_single(
            x.astype(dtype), jnp.ones(4, jnp.int32), jnp.ones(4, jnp.int32), axis_name=AXIS),
    }
    for name, body in cases.items():
        with pytest.raises(ValueError, match=f"^x: .*{PACKED}"):
            run_ep(body, mesh, rows, idx, w)
    # a tuple of row arrays (an FP8 pair's place): every array is checked before any moves
    tuples = {
        "dispatch": lambda x, i, w: jax_ep.dispatch((x, x.astype(dtype)), i, w, num_experts=E,
                                                    axis_name=AXIS)[0][1],
        "dispatch alltoall": lambda x, i, w: jax_ep.dispatch(
            (x, x.astype(dtype)), i, w, num_experts=E, axis_name=AXIS, backend="alltoall")[0][1],
        "hybridep": lambda x, i, w: jax_ep.hybridep_dispatch(
            (x, x.astype(dtype)), topk_idx=i, num_experts=E, axis_name=AXIS)[0][1],
    }
    for name, body in tuples.items():
        with pytest.raises(ValueError, match=rf"^x\[1\]: .*{PACKED}"):
            run_ep(body, mesh, rows, idx, w)


def test_sizes_past_int32_are_refused_before_the_kernels():
    tokens, routing_map = jnp.ones((4, 4)), jnp.ones((4, 4), bool)
    for impl in ("ffi", "xla"):
        for pad in (2**31, 2**62 + 1, 2**63):
            with pytest.raises(ValueError, match=r"^pad_multiple: expected an int <= 2147483647"):
                ops.permute(tokens, routing_map, num_out_tokens=4, pad_multiple=pad, impl=impl)
        with pytest.raises(ValueError, match=r"^num_out_tokens: expected an int <= 2147483647"):
            ops.permute(tokens, routing_map, num_out_tokens=2**31, impl=impl)
    with pytest.raises(ValueError, match="moe_router_expert_pad_multiple: expected None or a "
                                         "positive int <= 2147483647"):
        jax_ep.TokenDispatcherConfig(moe_router_expert_pad_multiple=2**62 + 1)


@pytest.mark.parametrize("impl", ["ffi", "tiled", "ragged_dot"])
def test_wide_group_sizes_are_clipped_not_wrapped(impl):
    """A size above N counts as N (the documented cut), whatever its dtype: 3e9 as uint32
    used to wrap to a negative int32 (all rows zero)."""
    x, w = jnp.ones((4, 2)), jnp.ones((2, 2, 3))
    want = np.asarray(ops.grouped_matmul(x, w, jnp.array([4, 0], jnp.int32), impl=impl))
    assert (want == 2).all()
    got = ops.grouped_matmul(x, w, jnp.array([3_000_000_000, 0], jnp.uint32), impl=impl)
    np.testing.assert_array_equal(np.asarray(got), want)
    grads = jax.grad(lambda x: ops.grouped_matmul(
        x, w, jnp.array([3_000_000_000, 0], jnp.uint32), impl=impl).sum())(x)
    np.testing.assert_array_equal(np.asarray(grads), np.full((4, 2), 3.0))


def test_dispatch_with_a_handle_checks_the_weights():
    mesh = ep_mesh(4)
    idx, w = _routing(4)
    x = np.ones((4 * T, H), np.float32)

    def again(weights):
        def body(x, i, w):
            _, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS)
            return jax_ep.dispatch(x, handle=h, topk_weights=weights(w), axis_name=AXIS)[2]
        return body
    for weights, match in [(lambda w: w[:-1], r"^topk_weights: expected shape \(4, 2\)"),
                           (lambda w: jnp.concatenate([w, w], 1), "^topk_weights: expected sh"),
                           (lambda w: w.astype(jnp.int32), "^topk_weights: expected a float")]:
        with pytest.raises(ValueError, match=match):
            run_ep(again(weights), mesh, x, idx, w)


def test_an_axis_named_twice_is_refused():
    # JAX sizes the pair (ep, ep) as P^2, a rank layout no mesh has: every token went to the
    # wrong experts (the flat pair) or the message blamed num_experts
    mesh = ep_mesh(4)
    idx, w = _routing(4)
    for pair in ((AXIS, AXIS), [AXIS, AXIS]):
        with pytest.raises(ValueError, match="^axis_name: expected distinct mesh axes"):
            run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=16,
                                                   axis_name=pair)[0],
                   mesh, np.ones((4 * T, H), np.float32), idx, w)


def test_chunked_forward_checks_x_against_the_routing():
    mesh = ep_mesh(2)
    idx, w = _routing(2)
    kernel = lambda rx, ri, rw: rx  # noqa: E731

    def chunked(x_of):
        return lambda x, i, w: deepep.dispatch_chunked_forward(
            x_of(x), i, w, kernel, num_local_experts=E // 2, axis_name=AXIS, chunks=2)
    for x_of, match in [(lambda x: x[:-1], r"^topk_idx: expected 3 rows"),
                        (lambda x: x.astype(jnp.int32), "^x: expected float32"),
                        (lambda x: x[:, 0], "^x: expected a rank-2 array")]:
        with pytest.raises(ValueError, match=match):
            run_ep(chunked(x_of), mesh, np.ones((2 * T, H), np.float32), idx, w)


def test_hybridep_routing_map_must_be_bool():
    mesh = ep_mesh(2)
    with pytest.raises(ValueError, match="^routing_map: expected bool, got float32"):
        run_ep(lambda x: jax_ep.hybridep_dispatch(
            x, routing_map=jnp.full((T, E), 0.3), num_experts=E, axis_name=AXIS)[0],
            mesh, np.ones((2 * T, H), np.float32))


def test_all_to_all_single_splits_must_be_integers():
    mesh = ep_mesh(4)
    with pytest.raises(ValueError, match="^output_splits: expected integer row counts"):
        run_ep(lambda x: jax_ep.all_to_all_single(
            x, jnp.array([1.5, 1, 1, 1]), jnp.ones(4, jnp.int32), axis_name=AXIS),
            mesh, np.ones((4 * T, H), np.float32))


@pytest.mark.parametrize("over,cut", [([3, -1, 2, 2], [3, 0, 1, 0]),
                                      ([2**31 - 1, 1, 0, 0], [4, 0, 0, 0]),
                                      ([1, 2**31 - 1, 2**31 - 1, 1], [1, 3, 0, 0])])
def test_all_to_all_single_cuts_splits_past_the_rows(over, cut):
    """input_splits summing above the S = 4 rows (a negative one counts as 0; a sum past
    2^31 does not wrap) send the S rows, the last destinations' cut first: the values and
    gradient of the cut splits. Before, the exchange failed at run time with an error naming
    an internal row map."""
    mesh = ep_mesh(4)
    over, cut = jnp.array(over, jnp.int32), jnp.array(cut, jnp.int32)
    x = np.random.default_rng(3).standard_normal((4 * T, H)).astype(np.float32)

    def body(splits):
        def f(x):
            y = jax_ep.all_to_all_single(x, splits, splits, axis_name=AXIS)
            return y, jax.grad(lambda x: jnp.sum(jnp.sin(jax_ep.all_to_all_single(
                x, splits, splits, axis_name=AXIS))))(x)
        return f

    got, want = run_ep(body(over), mesh, x), run_ep(body(cut), mesh, x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert np.asarray(want[0]).any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=-16), "^hidden_size: expected an int > 0"),
    (dict(hidden_size=0), "^hidden_size: expected an int > 0"),
    (dict(hidden_size=16.0), "^hidden_size: expected an int, got 16.0"),
    (dict(ffn_hidden_size=-32), "^ffn_hidden_size: expected an int > 0"),
    (dict(ffn_hidden_size=32.5), "^ffn_hidden_size: expected an int"),
    (dict(param_dtype=jnp.int32), "^param_dtype: expected a float dtype"),
    (dict(dtype="bf16"), "^dtype: expected None or a float dtype"),
    (dict(mesh="expert"), "^mesh: expected a jax.sharding.Mesh, got str"),
    (dict(mesh=None, expert_parallel_size=0), "^expert_parallel_size: expected an int > 0"),
    (dict(mesh=None, expert_parallel_size=4.0), "^expert_parallel_size: expected an int"),
])
def test_layer_arguments_are_checked_at_construction(kwargs, match):
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K)
    args = dict(hidden_size=16, ffn_hidden_size=32,
                mesh=jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])) | kwargs
    with pytest.raises(ValueError, match=match):
        MoELayer(cfg, args.pop("hidden_size"), args.pop("ffn_hidden_size"),
                 rngs=nnx.Rngs(0), **args)


def test_handlers_refuse_what_the_python_checks_refuse():
    """The CPU handlers check the same things themselves (an error, not a crash), for callers
    that reach the FFI targets past jax_ep's Python."""
    x = jnp.zeros((8, 64), jnp.int4)
    gather = jax.ffi.ffi_call("jax_ep_gather_rows", jax.ShapeDtypeStruct((3, 64), jnp.int4))
    with pytest.raises(Exception, match="x: sub-byte element types"):
        jax.block_until_ready(gather(x, jnp.array([7, 0, 3], jnp.int32)))
    results = (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32),
               jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
               jax.ShapeDtypeStruct((), jnp.int32))
    permute = jax.ffi.ffi_call("jax_ep_permute", results)
    with pytest.raises(Exception, match="pad_multiple: expected at most 2147483647"):
        jax.block_until_ready(permute(jnp.ones((4, 4)), jnp.ones((4, 4), bool),
                                      jnp.zeros((4, 4)), pad_multiple=np.int64(2**62 + 1),
                                      drop_and_pad=False))


@pytest.mark.parametrize("counts", [8, np.zeros((2, 4), np.int32)])
def test_buffer_dispatch_checks_the_expert_counts_shape(counts):
    """Buffer.dispatch reads E from num_tokens_per_expert: a scalar gave an IndexError."""
    idx, w = _routing(2)
    buf = jax_ep.Buffer(AXIS)

    def body(x, idx, w):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=counts)[0]

    with pytest.raises(ValueError, match=r"num_tokens_per_expert: expected the i32\[E\] counts "
                                         r".*got shape"):
        run_ep(body, ep_mesh(2), np.zeros((2 * T, H), np.float32), idx, w)


def test_a_list_of_rows_is_refused_by_name():
    with pytest.raises(ValueError, match="^x: expected an array of rows, got list"):
        ops.gather_rows([[1.0, 2.0]], jnp.array([0]))
    with pytest.raises(ValueError, match="^x: expected an array of rows, got list"):
        run_ep(lambda x: jax_ep.all_to_all_single(
            [[1.0]], jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32), axis_name=AXIS),
            ep_mesh(2), np.ones((2, H), np.float32))

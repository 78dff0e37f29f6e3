"""Bad inputs found by fuzzing the public API: each is now a ValueError naming the argument.
Before, 4-bit rows corrupted memory in every FFI row mover (a row was read at twice its
size: wrong rows, SIGSEGV or a heap abort), a huge pad_multiple overflowed the permute
plan's offsets (heap abort), wide or unsigned group sizes wrapped to wrong products, and the
other cases were silently accepted or failed deep inside with errors naming internals."""

from __future__ import annotations

import re

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
    # read by truthiness before: "False" switched jitter, the losses and the updates off
    (dict(deterministic="False"), "^deterministic: expected a bool, got 'False'"),
    (dict(sow_aux="no"), "^sow_aux: expected a bool, got 'no'"),
    # accepted at construction before, failing at the call with errors naming internals
    (dict(rngs=None), "^rngs: expected an nnx.Rngs, got NoneType"),
    (dict(dispatcher="x"), "^dispatcher: expected None or a MoEFlexTokenDispatcher, got str"),
    (dict(dispatcher="4 local"), "^dispatcher: has 4 local experts, the layer 2"),
    (dict(data_axis="expert"), "^data_axis: 'expert' is the layer's expert axis"),
    (dict(hidden_size=64, fp8=True), "^TokenDispatcherConfig.moe_fp8_dispatch: needs rows of "
                                     "a multiple of 128 channels on the wire, got hidden_size=64"),
])
def test_layer_arguments_are_checked_at_construction(kwargs, match):
    from jax_ep.flax import MoEFlexTokenDispatcher
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_fp8_dispatch=kwargs.pop("fp8", False))
    if kwargs.get("dispatcher") == "4 local":  # a dispatcher of another expert count
        kwargs["dispatcher"] = MoEFlexTokenDispatcher(4, range(4), cfg)
    args = dict(hidden_size=16, ffn_hidden_size=32, rngs=nnx.Rngs(0),
                mesh=jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])) | kwargs
    with pytest.raises(ValueError, match=match):
        MoELayer(cfg, args.pop("hidden_size"), args.pop("ffn_hidden_size"), **args)


def test_configs_and_shard_state_name_what_they_refuse():
    """Config values that built a 2^29-tuple (E past int32), read "False" as True (Megatron's
    padding switch), failed with TypeError unhashable / not iterable, or named another field;
    shard_state placing a layer's state on a mesh other than its own (jax's "incompatible
    devices" at the call) or taking None as a model; complex tokens (named router_dtype)."""
    from jax_ep.flax import MoEConfig, shard_params, shard_state
    base = dict(num_moe_experts=E, moe_router_topk=K)
    cases = [
        (lambda: jax_ep.TokenDispatcherConfig(num_moe_experts=2**40),
         "TokenDispatcherConfig.num_moe_experts: expected a positive int <= 2147483647"),
        (lambda: MoEConfig(num_moe_experts=2**31, moe_router_topk=K),
         "MoEConfig.num_moe_experts: expected a positive int <= 2147483647"),
        (lambda: MoEConfig.from_dict(base | {"moe_router_padding_for_fp8": "False"}),
         "MoEConfig.moe_router_padding_for_fp8: expected a bool, got 'False'"),
        (lambda: MoEConfig.from_dict(base | {"fp8_recipe": "MXFP8"}),
         "MoEConfig.fp8_recipe: expected None or one of Megatron's"),
        (lambda: MoEConfig.from_dict(None), "MoEConfig.from_dict: fields: expected a dict"),
        (lambda: MoEConfig.from_dict(base, ignore_unknown="yes"),
         "MoEConfig.from_dict: ignore_unknown: expected a bool"),
        (lambda: MoEConfig.from_dict(base | {"moe_token_dispatcher_type": ["flex"]}),
         "MoEConfig.moe_token_dispatcher_type: expected one of"),
        (lambda: MoEConfig.from_dict(base | {"moe_router_topk_limited_devices": "2",
                                             "expert_model_parallel_size": 4}),
         "MoEConfig.moe_router_topk_limited_devices: expected None or a positive int"),
        (lambda: MoEConfig(**base, moe_router_load_balancing_type=[["aux_loss"]],
                           moe_aux_loss_coeff=[0.1]),
         "MoEConfig.moe_router_load_balancing_type: expected one of"),
        (lambda: jax_ep.TokenDispatcherConfig(expert_axis_name=[["a"], ["b"]]),
         "TokenDispatcherConfig.expert_axis_name: expected a mesh axis name"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match="^" + re.escape(match)):
            call()
    cfg = jax_ep.TokenDispatcherConfig(**base)
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    layer = MoELayer(cfg, H, 16, rngs=nnx.Rngs(0), mesh=mesh)
    with pytest.raises(ValueError, match=r"^mesh: .*built with the mesh \{'expert': 4\}"):
        shard_params(layer, jax.make_mesh((8,), ("expert",)))
    with pytest.raises(ValueError, match="^model: expected an nnx.Module, got NoneType"):
        shard_state(None, None, mesh)
    unplaced = MoELayer(cfg, H, 16, rngs=nnx.Rngs(0), mesh=None, expert_parallel_size=4)
    for other in (jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]),
                  jax.make_mesh((3,), ("expert",), devices=jax.devices()[:3])):
        with pytest.raises(ValueError, match=r"^mesh: the state's sharding does not fit the "
                                             r"mesh \{'(data': 4|expert': 3)\}"):
            shard_params(unplaced, other)
    with pytest.raises(ValueError, match="^x: expected real tokens, got complex64"):
        layer(jnp.ones((4, 2, H), jnp.complex64))


def test_router_flags_and_padding_mask_are_checked():
    """TopKRouter's flags were read by truthiness; routing's padding_mask was checked for its
    shape only, and ~ of an int mask weighed the tokens -1 and -2 in the losses (z-loss
    -29.4 for 4.3); a list of logits failed reading .shape."""
    from jax_ep.flax import MoEConfig, TopKRouter
    cfg = MoEConfig(num_moe_experts=E, moe_router_topk=K, moe_z_loss_coeff=1e-3)
    for flag in ("deterministic", "sow_aux"):
        with pytest.raises(ValueError, match=f"^{flag}: expected a bool, got 'False'"):
            TopKRouter(cfg, H, rngs=nnx.Rngs(0), **{flag: "False"})
    router = TopKRouter(cfg, H, rngs=nnx.Rngs(0))
    logits = jnp.ones((T, E))
    with pytest.raises(ValueError, match="^padding_mask: expected bool .*, got int32"):
        router.routing(logits, padding_mask=jnp.array([0, 1, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="^logits: expected an array, got list"):
        router.routing([[1.0] * E] * T)
    router.routing(logits, padding_mask=jnp.array([False, True, False, False]))


def test_layer_lists_are_named():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K)
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    layer = MoELayer(cfg, H, 16, rngs=nnx.Rngs(0), mesh=mesh)
    with pytest.raises(ValueError, match="^x: expected an array, got list"):
        layer([[[0.0] * H] * 2] * 4)
    from jax_ep.flax import dense_forward
    for devices in (0, 3):  # a ZeroDivisionError and a jax reshape error before
        with pytest.raises(ValueError, match="^(num_devices: expected an int > 0|x: expected "
                                             r"\[B, ..., H\] tokens in num_devices=3)"):
            dense_forward(layer, jnp.ones((4, 2, H)), num_devices=devices)
    with pytest.raises(ValueError, match="^padding_mask: expected None or a bool array, got "
                                         "list"):
        layer(jnp.ones((4, 2, H)), padding_mask=[[False, False]] * 4)


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
                                         r".*got (shape|int\n)"):
        run_ep(body, ep_mesh(2), np.zeros((2 * T, H), np.float32), idx, w)


def test_a_list_of_rows_is_refused_by_name():
    with pytest.raises(ValueError, match="^x: expected an array of rows, got list"):
        ops.gather_rows([[1.0, 2.0]], jnp.array([0]))
    with pytest.raises(ValueError, match="^x: expected an array of rows, got list"):
        run_ep(lambda x: jax_ep.all_to_all_single(
            [[1.0]], jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32), axis_name=AXIS),
            ep_mesh(2), np.ones((2, H), np.float32))


def test_buffer_layout_with_a_bad_id_on_one_rank_routes_it_nowhere():
    """DeepEP's flow (Buffer.get_dispatch_layout, then dispatch with that layout) with an
    expert id >= E on rank 0 only: the id is routed nowhere and counted, as the dispatch does.
    Before, the layout kernel raised on rank 0 alone and the other ranks waited in the next
    collective: the peer transport's 60 s bound, or an XLA rendezvous abort of the process."""
    idx, w = _routing(2)
    bad = idx.copy()
    bad[0, 0], bad[T + 1, 1] = E, -1  # rank 0: an invalid id; rank 1: a valid slot unrouted
    unrouted = bad.copy()
    unrouted[0, 0] = -1
    buf = jax_ep.Buffer(AXIS)

    def body(x, i, w):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(i, E)
        recv_x, recv_i, recv_w, per_local, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=i, topk_weights=w)
        return recv_x, recv_i, recv_w, per_local, handle.num_invalid[None], per_rank, in_rank

    x = np.random.default_rng(1).standard_normal((2 * T, H)).astype(np.float32)
    got = run_ep(body, ep_mesh(2), x, bad, w)
    want = run_ep(body, ep_mesh(2), x, unrouted, w)
    np.testing.assert_array_equal(np.asarray(got[4]), [1, 0])
    for name, g, r in zip(["recv_x", "recv_idx", "recv_w", "per_local"], got[:4], want[:4]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    for g, r in zip(got[5:], want[5:]):  # the layout counts the bad slot nowhere
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("transport", ["peer", "all_to_all"])
def test_layout_counts_that_disagree_with_topk_idx_never_misplace_rows(transport):
    """dispatch(layout=) whose per-rank counts disagree with topk_idx (one above, the first
    destination's one below, all zero): the same rows, ids and counts as without a layout.
    Before, the exchange took the given counts while the send buffer followed topk_idx: zero
    padding rows arrived as tokens of local expert 0 and the next destination lost its last
    rows (all_to_all), or the peer exchange failed naming its row map."""
    idx, w = _routing(2)
    x = np.random.default_rng(2).standard_normal((2 * T, H)).astype(np.float32)

    def body(x, i, w):
        layout = ops.get_dispatch_layout(i, num_experts=E, num_ranks=2)
        out = []
        for counts in (None, layout[0] + 1, jnp.maximum(layout[0].at[0].add(-1), 0),
                       layout[0] * 0):
            given = None if counts is None else (counts,) + tuple(layout[1:])
            recv_x, recv_i, recv_w, h = jax_ep.dispatch(
                x, i, w, num_experts=E, axis_name=AXIS, transport=transport, layout=given)
            out += [recv_x, recv_i, recv_w, h.num_recv_tokens[None], h.num_dropped[None]]
        return tuple(out)

    got = [np.asarray(a) for a in run_ep(body, ep_mesh(2), x, idx, w)]
    plain = got[:5]
    assert plain[3].sum() > 0 and (plain[1] >= 0).any()
    for case in range(1, 4):
        for g, r in zip(got[5 * case:5 * case + 5], plain):
            np.testing.assert_array_equal(g, r, err_msg=f"case {case}")


def test_router_functions_check_top_k_before_tracing():
    """A float top-k reached jax.lax.top_k, whose cache then failed every later call with an
    equal int (2.0 == 2) in the process; 0 routed nothing silently."""
    from jax_ep.flax import moe_utils, router

    logits = jnp.arange(12.0).reshape(3, 4)
    for bad in (2.0, 0, None):
        with pytest.raises(ValueError, match="^topk: expected an int"):
            moe_utils.topk_routing_with_score_function(logits, bad)
        with pytest.raises(ValueError, match="^topk: expected an int"):
            router.compute_routing_scores_for_aux_loss(logits, bad, "softmax")
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, 2)
    np.testing.assert_array_equal(np.asarray(routing_map).sum(axis=1), [2, 2, 2])
    with pytest.raises(ValueError, match="^topk: top-k 5 exceeds num_experts 4"):
        router.compute_routing_scores_for_aux_loss(logits, 5, "softmax")
    with pytest.raises(ValueError, match=r"^precomputed_indices: expected shape \(3, 2\)"):
        moe_utils.topk_routing_with_score_function(logits, 2,
                                                   precomputed_indices=jnp.zeros((3, 1), int))
    with pytest.raises(ValueError, match="^logits: expected a float"):
        moe_utils.topk_routing_with_score_function(jnp.ones(4), 1)


def _in_shard_map(fn, num_ranks=2):
    """Runs fn() (traced inside a shard_map over the test axis) for its trace-time errors."""
    return run_ep(lambda x: fn() + 0 * x.sum(), ep_mesh(num_ranks),
                  np.zeros((num_ranks, 1), np.float32))


def _named_argument_cases():
    """(call, the message an error must start with): each failed before with an error
    naming another argument or an internal, or was accepted."""
    from jax_ep import hybridep, low_latency
    from jax_ep.flax import (HybridEPMetadataProcessor, MoEFlexTokenDispatcher,
                             expert_tile_rows, moe_utils, router, swiglu_experts)

    idx = jnp.zeros((T, K), jnp.int32)
    w = jnp.ones((T, K), jnp.float32)
    x = jnp.ones((T, H), jnp.float32)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       expert_axis_name=AXIS)
    dispatcher = MoEFlexTokenDispatcher(E // 2, range(E // 2), cfg)
    buf = jax_ep.Buffer(AXIS)
    big = 2**31

    def ll_handle():
        return low_latency.low_latency_dispatch(x, idx, num_max_dispatch_tokens_per_rank=T,
                                                num_experts=E, axis_name=AXIS)
    sm = _in_shard_map
    return {
        "dispatch num_experts 0": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx, w, num_experts=0, axis_name=AXIS)[0]), "num_experts: expected an int > 0"),
        "low_latency num_experts < 0": (lambda: sm(lambda: low_latency.low_latency_dispatch(
            x, idx, num_max_dispatch_tokens_per_rank=T, num_experts=-2, axis_name=AXIS)[0]),
            "num_experts: expected an int > 0"),
        "hybridep num_permuted_tokens": (lambda: sm(lambda: hybridep.hybridep_dispatch(
            x, topk_idx=idx, num_experts=E, axis_name=AXIS, num_permuted_tokens=big)[0]),
            "num_permuted_tokens: expected an int <= 2147483647"),
        "hybridep pad_multiple": (lambda: sm(lambda: hybridep.hybridep_dispatch(
            x, topk_idx=idx, num_experts=E, axis_name=AXIS, pad_multiple=big)[0]),
            "pad_multiple: expected an int <= 2147483647"),
        "low_latency Tmax": (lambda: sm(lambda: low_latency.low_latency_dispatch(
            x, idx, num_max_dispatch_tokens_per_rank=big, num_experts=E, axis_name=AXIS)[0]),
            "num_max_dispatch_tokens_per_rank: expected an int <= 2147483647"),
        "dispatch num_worst_tokens": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx, w, num_experts=E, axis_name=AXIS, num_worst_tokens=2**40)[0]),
            "num_worst_tokens: expected an int <= 2147483647"),
        "all_to_all_single num_recv": (lambda: sm(lambda: jax_ep.all_to_all_single(
            x, jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32), axis_name=AXIS,
            num_recv=big)), "num_recv: expected an int <= 2147483647"),
        "an int axis_name": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx, w, num_experts=E, axis_name=0)[0]), "axis_name: expected a mesh axis"),
        "low_latency_combine weights None": (lambda: sm(lambda: low_latency.low_latency_combine(
            jnp.zeros((E // 2, 2 * T, H)), idx, None, ll_handle()[2])),
            r"topk_weights: expected a float array of shape \(4, 2\), got None"),
        "layout float counts": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx, w, num_experts=E, axis_name=AXIS,
            layout=(jnp.ones(2), jnp.ones((T, 2), bool), jnp.ones(E, jnp.int32)))[0]),
            "layout.num_tokens_per_rank: expected get_dispatch_layout's i32 array"),
        "Buffer is_token_in_rank float": (lambda: sm(lambda: buf.dispatch(
            x, is_token_in_rank=jnp.full((T, 2), 0.5),
            num_tokens_per_expert=jnp.zeros(E, jnp.int32))[0]),
            r"is_token_in_rank: expected bool\[T,P\], got float32"),
        "Buffer num_tokens_per_expert E % P": (lambda: sm(lambda: buf.dispatch(
            x, is_token_in_rank=jnp.ones((T, 2), bool),
            num_tokens_per_expert=jnp.zeros(1, jnp.int32))[0]),
            "num_tokens_per_expert: expected get_dispatch_layout's i32"),
        "Buffer cumulative stats int8": (lambda: sm(lambda: buf.low_latency_dispatch(
            x, idx, T, E, cumulative_local_expert_recv_stats=jnp.zeros(E // 2, jnp.int8),
            use_fp8=False)[0]),
            "cumulative_local_expert_recv_stats: expected int32, got int8"),
        "Buffer low_latency_combine out int": (lambda: sm(lambda: buf.low_latency_combine(
            jnp.zeros((E // 2, 2 * T, H), jnp.bfloat16), idx, w, ll_handle()[2],
            out=jnp.zeros((T, H), jnp.int32))[0]), "out: expected float32"),
        "combine dtype": (lambda: sm(lambda: jax_ep.combine(
            jnp.zeros((2 * T, H)), jax_ep.dispatch(x, idx, w, num_experts=E,
                                                   axis_name=AXIS)[3], dtype="bogus")[0]),
            "dtype: expected a dtype, got 'bogus'"),
        "build_send_layout weights None": (lambda: ops.build_send_layout(
            idx, None, num_ranks=2, num_local_experts=4),
            r"topk_weights: expected a float array of shape \(4, 2\), got None"),
        "indices_to_multihot probs None": (lambda: ops.indices_to_multihot(
            idx, None, num_experts=E), "topk_probs: expected a float array"),
        "indices_to_multihot probs shape": (lambda: ops.indices_to_multihot(
            idx, jnp.ones((T, 1)), num_experts=E), r"topk_probs: expected shape \(4, 2\)"),
        "permute no experts": (lambda: ops.permute(
            x, jnp.zeros((T, 0), bool), num_out_tokens=4, drop_and_pad=True),
            "routing_map: drop_and_pad needs at least one expert"),
        "permute int probs": (lambda: ops.permute(
            x, jnp.ones((T, 2), bool), jnp.ones((T, 2), jnp.int32), num_out_tokens=8),
            "probs: expected a float array, got int32"),
        "permute drop_and_pad str": (lambda: ops.permute(
            x, jnp.ones((T, 2), bool), num_out_tokens=8, drop_and_pad="no"),
            "drop_and_pad: expected a bool .*, got 'no'"),
        "unpermute num_tokens": (lambda: ops.unpermute(
            x, jnp.zeros(T, jnp.int32), num_tokens=big),
            "num_tokens: expected an int <= 2147483647"),
        "unpermute complex probs": (lambda: ops.unpermute(
            x, jnp.zeros(T, jnp.int32), num_tokens=T, probs=jnp.ones(T, jnp.complex64)),
            "probs: expected a float array, got complex64"),
        "cast_back dtype": (lambda: ops.per_token_cast_back(
            jnp.zeros((T, 128), jnp.float8_e4m3fn), jnp.ones((T, 1)), dtype="bogus"),
            "dtype: expected a dtype, got 'bogus'"),
        "cast round_scale str": (lambda: ops.per_token_cast_to_fp8(
            jnp.ones((T, 128)), round_scale="no"), "round_scale: expected a bool"),
        "get_capacity no experts": (lambda: router.get_capacity(10, 0, 1.0),
                                    "num_experts: expected an int > 0"),
        "token dropping no experts": (lambda: router.apply_router_token_dropping(
            jnp.zeros((3, 0)), jnp.zeros((3, 0), bool), 1, 1.0),
            "routing_probs: expected .* at least one expert"),
        "token dropping map shape": (lambda: router.apply_router_token_dropping(
            jnp.zeros((3, 4)), jnp.zeros((3, 2), bool), 1, 1.0),
            r"routing_map: expected shape \(3, 4\)"),
        "switch loss top-k 0": (lambda: router.switch_load_balancing_loss_func(
            jnp.ones((3, 4)), jnp.ones(4), 6, 0, 4, 0.1), "topk: expected an int > 0"),
        "switch loss counts": (lambda: router.switch_load_balancing_loss_func(
            jnp.ones((3, 4)), jnp.ones(3), 6, 2, 4, 0.1),
            r"tokens_per_expert: expected shape \(4,\)"),
        "expert bias shape": (lambda: router.get_updated_expert_bias(
            jnp.ones(4), jnp.zeros(3), 0.1), r"expert_bias: expected shape \(4,\)"),
        "sinkhorn rank": (lambda: router.sinkhorn(jnp.ones(4)), "cost: expected a rank-2"),
        "gating weight width": (lambda: router.router_gating_linear(
            x, jnp.ones((E, H + 1)), None, jnp.float32), r"weight: expected \[E, H\]"),
        "gating bias": (lambda: router.router_gating_linear(
            x, jnp.ones((E, H)), jnp.ones(E + 1), jnp.float32), r"bias: expected shape \(8,\)"),
        "sort_chunks out-of-range": (lambda: moe_utils.sort_chunks_by_idxs(
            jnp.arange(4.0)[:, None], jnp.array([1, 3]), jnp.array([5, 0])),
            "sorted_idxs: expected a permutation of range"),
        "sort_chunks repeated": (lambda: moe_utils.sort_chunks_by_idxs(
            jnp.arange(4.0)[:, None], jnp.array([1, 3]), jnp.array([1, 1])),
            "sorted_idxs: expected a permutation of range"),
        "sort_chunks negative size": (lambda: moe_utils.sort_chunks_by_idxs(
            jnp.arange(4.0)[:, None], jnp.array([-1, 5]), jnp.array([1, 0])),
            "split_sizes: expected row counts >= 0"),
        "sort_chunks float sizes": (lambda: moe_utils.sort_chunks_by_idxs(
            jnp.arange(4.0)[:, None], jnp.array([1.5, 2.5]), jnp.array([1, 0])),
            "split_sizes: expected integers"),
        "unpermute restore_shape": (lambda: moe_utils.unpermute(
            jnp.ones((4, 4)), jnp.zeros(4, jnp.int32), (2.7, 4)), "restore_shape: expected"),
        "required_capacity None": (lambda: hybridep.required_capacity(None),
                                   "num_tokens: expected an int"),
        "dispatcher indices None": (lambda: MoEFlexTokenDispatcher(4, None, cfg),
                                    "local_expert_indices: expected a list of 4"),
        "dispatch_preprocess token count": (lambda: dispatcher.dispatch_preprocess(
            x, 2, jnp.ones((2, E))), "num_local_tokens: expected the 4 tokens"),
        "dispatch_preprocess float count": (lambda: dispatcher.dispatch_preprocess(
            x, 4.0, jnp.ones((4, E))), "num_local_tokens: expected the 4 tokens"),
        "dispatch_preprocess int probs": (lambda: dispatcher.dispatch_preprocess(
            x, T, jnp.ones((T, E), jnp.int32)), "probs: expected a float array"),
        "dispatch_preprocess2 token count": (lambda: dispatcher.dispatch_preprocess2(
            x, -2, w, idx), "num_local_tokens: expected the 4 tokens"),
        "dispatch_preprocess routing_map rows": (lambda: dispatcher.dispatch_preprocess(
            x, jnp.ones((2, E), bool), jnp.ones((2, E))), "routing_map: expected the 4 tokens"),
        "dispatch fp8 flag str": (lambda: sm(lambda: jax_ep.dispatch(
            jnp.ones((T, 128)), idx, w, num_experts=E, axis_name=AXIS, use_fp8=True,
            round_scale="no")[0]), "round_scale: expected a bool"),
        # use_fp8 / use_logfmt / the Buffer's hook flags were read by truthiness: "False"
        # sent FP8, returned a hook
        "dispatch use_fp8 str": (lambda: sm(lambda: jax_ep.dispatch(
            jnp.ones((T, 128)), idx, w, num_experts=E, axis_name=AXIS,
            use_fp8="False")[0]), "use_fp8: expected a bool .*, got 'False'"),
        "hybridep use_fp8 str": (lambda: sm(lambda: hybridep.hybridep_dispatch(
            jnp.ones((T, 128)), topk_idx=idx, probs=w, num_experts=E, axis_name=AXIS,
            use_fp8="False")[0]), "use_fp8: expected a bool .*, got 'False'"),
        "low_latency use_fp8 str": (lambda: sm(lambda: low_latency.low_latency_dispatch(
            x, idx, num_max_dispatch_tokens_per_rank=T, num_experts=E, axis_name=AXIS,
            use_fp8="False")[0]), "use_fp8: expected a bool .*, got 'False'"),
        "low_latency_combine use_logfmt str": (lambda: sm(
            lambda: low_latency.low_latency_combine(
                jnp.zeros((E // 2, 2 * T, H)), idx, w, ll_handle()[2], use_logfmt="False")),
            "use_logfmt: expected a bool .*, got 'False'"),
        "Buffer return_recv_hook str": (lambda: sm(lambda: buf.low_latency_dispatch(
            x, idx, T, E, use_fp8=False, return_recv_hook="False")[0]),
            "return_recv_hook: expected a bool, got 'False'"),
        "Buffer async_finish and return_recv_hook": (lambda: sm(
            lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=False, async_finish=True,
                                             return_recv_hook=True)[0]),
            "async_finish / return_recv_hook: DeepEP's low-latency methods do not take both"),
        "Buffer low_latency_combine zero_copy str": (lambda: sm(
            lambda: buf.low_latency_combine(jnp.zeros((E // 2, 2 * T, H), jnp.bfloat16), idx,
                                            w, ll_handle()[2], use_logfmt=True,
                                            zero_copy="False")[0]),
            "zero_copy: expected a bool, got 'False'"),
        "Buffer cached dispatch with topk_idx": (lambda: sm(lambda: buf.dispatch(
            x, topk_idx=idx, handle=jax_ep.dispatch(x, idx, w, num_experts=E,
                                                    axis_name=AXIS)[3])[0]),
            "topk_idx / topk_weights: a cached dispatch"),
        "Buffer low_latency_combine out list": (lambda: sm(lambda: buf.low_latency_combine(
            jnp.zeros((E // 2, 2 * T, H), jnp.bfloat16), idx, w, ll_handle()[2],
            out=[[0.0] * H] * T)[0]), "out: expected an array, got list"),
        # A Python list of the right shape passed the shape checks and failed reading .dtype
        "Buffer combine bias list": (lambda: sm(lambda: buf.combine(
            jnp.zeros((2 * T, H)), jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)[3],
            bias=(x, [[0.0] * H] * T))[0]), r"bias\[1\]: expected an array, got list"),
        "combine topk_weights list": (lambda: sm(lambda: jax_ep.combine(
            jnp.zeros((2 * T, H)), jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)[3],
            topk_weights=[[1.0] * K] * (2 * T))[0]),
            "topk_weights: expected a rank-2 array, got list"),
        "combine topk_weights complex": (lambda: sm(lambda: jax_ep.combine(
            jnp.zeros((2 * T, H)), jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)[3],
            topk_weights=jnp.ones((2 * T, K), jnp.complex64))[0]),
            "topk_weights: expected a float array, got complex64"),
        "unpermute sorted_indices list": (lambda: ops.unpermute(
            x, [0, 1, 2, 3], num_tokens=T), "sorted_indices: expected an array, got list"),
        "grouped_matmul group_sizes list": (lambda: ops.grouped_matmul(
            x, jnp.ones((2, H, 4)), [2, 2]), "group_sizes: expected an array, got list"),
        "hybridep routing_map list": (lambda: sm(lambda: hybridep.hybridep_dispatch(
            x, routing_map=[[True] * E] * T, probs=jnp.ones((T, E)), num_experts=E,
            axis_name=AXIS)[0]), "routing_map: expected an array, got list"),
        "Buffer num_tokens_per_expert list": (lambda: sm(lambda: buf.dispatch(
            x, is_token_in_rank=jnp.ones((T, 2), bool), num_tokens_per_expert=[0] * E)[0]),
            "num_tokens_per_expert: expected the i32\\[E\\] counts .*, got list"),
        # Flags read by truthiness: "False" acted as True
        "ops.permute return_num_dropped str": (lambda: ops.permute(
            x, jnp.ones((T, 2), bool), num_out_tokens=8, return_num_dropped="False"),
            "return_num_dropped: expected a bool"),
        "moe_utils.permute drop_and_pad str": (lambda: moe_utils.permute(
            x, jnp.ones((T, 2), bool), num_out_tokens=8, drop_and_pad="False"),
            "drop_and_pad: expected a bool"),
        "moe_utils.unpermute drop_and_pad str": (lambda: moe_utils.unpermute(
            jnp.ones((8, H)), jnp.zeros(8, jnp.int32), (T, H), drop_and_pad="False"),
            "drop_and_pad: expected a bool"),
        "topk routing use_pre_softmax str": (lambda: moe_utils.topk_routing_with_score_function(
            jnp.ones((T, E)), K, use_pre_softmax="False"), "use_pre_softmax: expected a bool"),
        "topk routing dense_output str": (lambda: moe_utils.topk_routing_with_score_function(
            jnp.ones((T, E)), K, dense_output="False"), "dense_output: expected a bool"),
        "qb_dual_update update_beta str": (lambda: moe_utils.qb_dual_update(
            jnp.ones((T, E)), K, jnp.zeros(E), update_beta="False"),
            "update_beta: expected a bool"),
        "apply_router_token_dropping pad_to_capacity str": (
            lambda: moe_utils.apply_router_token_dropping(
                jnp.ones((T, E)), jnp.ones((T, E), bool), K, 1.0, pad_to_capacity="False"),
            "pad_to_capacity: expected a bool"),
        "weighted_bias_swiglu_impl fp8_input_store str": (
            lambda: moe_utils.weighted_bias_swiglu_impl(
                jnp.ones((T, 2 * H)), jnp.ones((T, 1)), fp8_input_store="no"),
            "fp8_input_store: expected a bool"),
        "tokens per expert with_padding_mask str": (
            lambda: moe_utils.get_tokens_per_expert_and_token_count(
                jnp.ones((T, E), bool), None, K, with_padding_mask="no"),
            "with_padding_mask: expected a bool"),
        "HybridEPMetadataProcessor permute_fusion str": (
            lambda: HybridEPMetadataProcessor(num_experts=E, permute_fusion="no"),
            "permute_fusion: expected a bool"),
        "UCCLBuffer overlap str": (lambda: sm(lambda: jax_ep.UCCLBuffer(AXIS).low_latency_combine(
            jnp.zeros((E // 2, 2 * T, H), jnp.bfloat16), idx, w, ll_handle()[2],
            overlap="False")[0]), "overlap: expected a bool"),
        "Buffer dispatch async_finish str": (lambda: sm(lambda: buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=jnp.zeros(E, jnp.int32),
            async_finish="False")[0]), "async_finish: expected a bool"),
        "Buffer combine allocate_on_comm_stream str": (lambda: sm(lambda: buf.combine(
            jnp.zeros((2 * T, H)), jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)[3],
            allocate_on_comm_stream="no")[0]), "allocate_on_comm_stream: expected a bool"),
        "Buffer layout async_finish str": (lambda: sm(lambda: buf.get_dispatch_layout(
            idx, E, async_finish="False")[0]), "async_finish: expected a bool"),
        "Buffer low_latency_combine zero_copy str without logfmt": (lambda: sm(
            lambda: buf.low_latency_combine(jnp.zeros((E // 2, 2 * T, H), jnp.bfloat16), idx,
                                            w, ll_handle()[2], zero_copy="False")[0]),
            "zero_copy: expected a bool"),
        # swiglu_experts' errors named grouped_matmul's internals (x, w, group_sizes)
        "swiglu_experts int tokens": (lambda: swiglu_experts(
            jnp.ones((T, H), jnp.int32), jnp.array([2, 2]), jnp.ones((2, H, 8)),
            jnp.ones((2, 4, H))), "tokens: expected float32"),
        "swiglu_experts w_down width": (lambda: swiglu_experts(
            x, jnp.array([2, 2]), jnp.ones((2, H, 8)), jnp.ones((2, 5, H)), impl="tiled"),
            r"w_down: expected \[L=2, F, H_out\] with fc1's 2F columns = w_gate_up's 8"),
        "swiglu_experts tokens_per_expert length": (lambda: swiglu_experts(
            x, jnp.array([2, 1, 1]), jnp.ones((2, H, 8)), jnp.ones((2, 4, H))),
            r"tokens_per_expert: expected shape \(2,\)"),
        # the front ends of the flex dispatcher read .shape / .reshape of what they got
        "dispatch_preprocess hidden_states list": (lambda: dispatcher.dispatch_preprocess(
            [[1.0] * H] * T, T, jnp.ones((T, E))),
            "hidden_states: expected an array of rows, got list"),
        "dispatch_preprocess probs None": (lambda: dispatcher.dispatch_preprocess(
            jnp.ones((T, H)), T, None), "probs: expected .* router probabilities, got None"),
        "dispatch_preprocess2 token_indices None": (lambda: dispatcher.dispatch_preprocess2(
            jnp.ones((T, H)), T, w, None), "token_indices: expected a .* array, got None"),
        "combine_postprocess rows": (lambda: dispatcher.combine_postprocess(
            jnp.ones((T + 1, H)), dispatcher.dispatch_preprocess2(x, T, w, idx)[1]),
            r"hidden_states: expected the combined \[T,H\] of the dispatch input \(4, 8\)"),
        "local_expert_indices floats": (lambda: MoEFlexTokenDispatcher(
            E // 2, [0.0, 1.9, 2.5, 3.2], cfg), "local_expert_indices: expected a list of 4 "
            "integer expert ids"),
        "local_expert_indices str": (lambda: MoEFlexTokenDispatcher(E // 2, "0123", cfg),
                                     "local_expert_indices: expected a list of 4 integer"),
        # the weights were checked against topk_idx's rows before topk_idx against x
        "dispatch short topk_idx": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx[:2], w, num_experts=E, axis_name=AXIS)[0]),
            r"topk_idx: expected 4 rows to match x \(4, 8\)"),
        # ZeroDivisionError / a jax reshape error before
        "expert_tile_rows no local experts": (lambda: expert_tile_rows(8, 2, 0),
                                              "num_local_experts: expected an int > 0"),
        # sinkhorn's loop runs until the error is below tol: tol <= 0 never ended
        "sinkhorn tol <= 0": (lambda: router.sinkhorn(jnp.zeros((T, E)), tol=-1.0),
                              "tol: expected a finite float > 0, got -1.0"),
        # sizes past int32: a jax OverflowError deep inside before
        "dispatch num_experts 2**40": (lambda: sm(lambda: jax_ep.dispatch(
            x, idx, w, num_experts=2**40, axis_name=AXIS)[0]),
            "num_experts: expected an int <= 2147483647"),
        "grouped_matmul tile_rows 2**40": (lambda: ops.grouped_matmul(
            x, jnp.ones((2, H, 4)), jnp.array([2, 2]), impl="tiled", tile_rows=2**40),
            "tile_rows: expected an int <= 2147483647"),
        # a transposed [K,T] / [E,T] has the size of [T,K] / [T,E]: it routed to wrong experts
        "dispatch_preprocess2 transposed indices": (lambda: dispatcher.dispatch_preprocess2(
            jnp.ones((T, H)), T, jnp.ones((K, T)), jnp.zeros((K, T), jnp.int32)),
            "token_indices: expected \\[num_local_tokens=4, top-k\\]"),
        "dispatch_preprocess transposed probs": (lambda: dispatcher.dispatch_preprocess(
            jnp.ones((T, H)), T, jnp.ones((E, T))),
            "probs: expected \\[num_local_tokens=4, num_moe_experts=8\\]"),
    }


def _helper_cases():
    """The moe_utils / router helpers and TopKRouter (a probe of ~460 calls, session 31). "S"
    marks what returned a silently wrong result before; the rest failed with errors naming
    internals (jnp's, Python's, a wrong argument)."""
    from jax_ep.flax import moe_utils, router
    from jax_ep.flax.moe import MoEAuxLossAutoScaler, TopKRouter
    from jax_ep.flax.moe_config import MoEConfig

    F = 4
    y, g, w = jnp.ones((F, 2 * F)), jnp.ones((F, F)), jnp.ones((F, 1))
    logits = jnp.asarray(np.random.default_rng(6).standard_normal((T, E)), jnp.float32)
    cfg = MoEConfig(num_moe_experts=E, moe_router_topk=K)
    ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1))
    seq_cfg = MoEConfig(num_moe_experts=E, moe_router_topk=K,
                        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    seq_router = TopKRouter(seq_cfg, H, rngs=nnx.Rngs(0))
    return {
        # S: weights [T] (T == F) weighted the columns, not the tokens
        "weighted_swiglu weights [T]": (lambda: moe_utils.weighted_swiglu(y, jnp.ones(F)),
                                        r"weights: expected shape \(4, 1\), got \(4,\)"),
        "weighted_geglu weights None": (lambda: moe_utils.weighted_geglu(y, None),
                                        "weights: expected an array, got NoneType"),
        # S: integer weights truncated their gradient
        "weighted_swiglu_back int weights": (lambda: moe_utils.weighted_swiglu_back(
            g, y, jnp.ones((F, 1), jnp.int32)), "weights: expected a float array, got int32"),
        "swiglu_back g [T, 2F]": (lambda: moe_utils.swiglu_back(y, y),
                                  r"g: expected shape \(4, 4\), got \(4, 8\)"),
        "swiglu odd width": (lambda: moe_utils.swiglu(jnp.ones((F, 7))),
                             r"y: expected \[..., 2F\] \(\[gate \| up\]: an even last axis\)"),
        "quick_geglu_back linear_offset str": (lambda: moe_utils.quick_geglu_back(
            g, y, linear_offset="a"), "linear_offset: expected a finite float, got 'a'"),
        "weighted_bias_quick_geglu bias width": (lambda: moe_utils.weighted_bias_quick_geglu(
            y, jnp.ones(2 * F + 1), w), r"bias: expected a shape that broadcasts to y's"),
        # S: rank 1 and rank 4 inputs returned wrong shapes
        "weighted_bias_swiglu_impl rank 1": (lambda: moe_utils.weighted_bias_swiglu_impl(
            jnp.ones(8), jnp.ones((1, 1))), r"input: expected rank 2 or 3, got shape \(8,\)"),
        "weighted_bias_geglu_impl rank 4": (lambda: moe_utils.weighted_bias_geglu_impl(
            jnp.ones((2, 2, 2, 8)), jnp.ones((8, 1))), "input: expected rank 2 or 3"),
        # S: a negative clamp clamped every gate to -1; NaN clamped nothing; True read as 1
        "quick_geglu_impl clamp -1": (lambda: moe_utils.weighted_bias_quick_geglu_impl(
            y, None, w, clamp_value=-1.0), "clamp_value: expected None or a finite float > 0"),
        "quick_geglu_impl clamp nan": (lambda: moe_utils.weighted_bias_quick_geglu_impl(
            y, None, w, clamp_value=float("nan")), "clamp_value: expected None or a finite"),
        "quick_geglu_impl clamp True": (lambda: moe_utils.weighted_bias_quick_geglu_impl(
            y, None, w, clamp_value=True), "clamp_value: expected None or a finite"),
        "quick_geglu_impl alpha str": (lambda: moe_utils.weighted_bias_quick_geglu_impl(
            y, None, w, alpha="x"), "alpha: expected 1.702"),
        "quick_gelu alpha nan": (lambda: moe_utils.quick_gelu(y, float("nan")),
                                 "alpha: expected a finite float, got nan"),
        # S: the coefficients took NaN, negatives and True (read as 1)
        "z_loss_func coeff nan": (lambda: router.z_loss_func(logits, float("nan")),
                                  "z_loss_coeff: expected a finite number >= 0, got nan"),
        "z_loss_func coeff True": (lambda: router.z_loss_func(logits, True),
                                   "z_loss_coeff: expected a number >= 0"),
        "z_loss_func coeff [T] array": (lambda: router.z_loss_func(logits, jnp.ones(T)),
                                        r"z_loss_coeff: expected a scalar, got float32 of shape"),
        "switch loss coeff -0.1": (lambda: router.switch_load_balancing_loss_func(
            logits, jnp.ones(E), T, K, E, -0.1), "moe_aux_loss_coeff: expected a finite"),
        "switch loss total_num_tokens nan": (lambda: router.switch_load_balancing_loss_func(
            logits, jnp.ones(E), float("nan"), K, E, 0.1), "total_num_tokens: expected a finite"),
        "switch loss coeff str": (lambda: router.switch_load_balancing_loss_func(
            logits, jnp.ones(E), T, K, E, "0.1"), "moe_aux_loss_coeff: expected a number"),
        "switch loss topk > E": (lambda: router.switch_load_balancing_loss_func(
            logits, jnp.ones(E), T, E + 1, E, 0.1), "topk: top-k 9 exceeds num_experts 8"),
        "expert bias rate nan": (lambda: router.get_updated_expert_bias(
            jnp.ones(E), jnp.zeros(E), float("nan")), "expert_bias_update_rate: expected"),
        "scaling_factor -1": (lambda: router.topk_routing_with_score_function(
            logits, K, scaling_factor=-1.0), "scaling_factor: expected a finite number >= 0"),
        # S: padding masks of [T, 1] / [1] broadcast; a string read as one True
        "aux scores padding_mask [T, 1]": (lambda: router.compute_routing_scores_for_aux_loss(
            logits, K, "softmax", padding_mask=jnp.zeros((T, 1), bool)),
            r"padding_mask: expected None or bool\[4\]"),
        "z_loss_func padding_mask str": (lambda: router.z_loss_func(
            logits, 0.1, padding_mask="abc"), r"padding_mask: expected None or bool\[4\]"),
        "switch loss padding_mask [1]": (lambda: router.switch_load_balancing_loss_func(
            logits, jnp.ones(E), T, K, E, 0.1, padding_mask=jnp.ones(1, bool)),
            r"padding_mask: expected None or bool\[4\]"),
        # S: logits of the wrong width or transposed routed over the wrong experts
        "route logits [T, E+1]": (lambda: router.route(jnp.ones((T, E + 1)), cfg),
                                  r"logits: expected \[num_tokens, num_moe_experts=8\]"),
        "route training str": (lambda: router.route(logits, cfg, training="False"),
                               "training: expected a bool"),
        "route cfg None": (lambda: router.route(logits, None), "cfg: expected a MoEConfig"),
        # S: transposed ids read as 2 tokens of 4 slots
        "capacity_drop transposed ids": (lambda: router.capacity_drop(
            jnp.ones((K, T)), ids.T, cfg), r"ids: expected integer expert ids \[T, "),
        # S: ids >= E (and -1) passed through as routed
        "capacity_drop ids E": (lambda: router.capacity_drop(
            jnp.ones((T, K)), ids.at[0, 1].set(E), cfg),
            r"ids: expected expert ids in \[0, 8\), got 8"),
        "capacity_drop ids -1": (lambda: router.capacity_drop(
            jnp.ones((T, K)), ids.at[2, 0].set(-1), cfg),
            r"ids: expected expert ids in \[0, 8\), got -1"),
        # S: k = 0 and k = True
        "qb_dual_update k 0": (lambda: router.qb_dual_update(logits, 0, jnp.zeros(E)),
                               "k: expected an int > 0"),
        "qb_dual_update k True": (lambda: router.qb_dual_update(logits, True, jnp.zeros(E)),
                                  "k: expected an int"),
        "qb_dual_update beta [E+1]": (lambda: router.qb_dual_update(logits, K, jnp.zeros(E + 1)),
                                      r"beta: expected shape \(8,\)"),
        # S: get_capacity(-10 tokens) was -2; min_capacity 5.5 a float capacity
        "get_capacity negative tokens": (lambda: router.get_capacity(-10, E, 1.0),
                                         "num_tokens: expected an int >= 0"),
        "get_capacity float min": (lambda: router.get_capacity(10, E, 1.0, 5.5),
                                   "min_capacity: expected an int"),
        "get_capacity factor inf": (lambda: router.get_capacity(10, E, float("inf")),
                                    "capacity_factor: expected a finite float > 0"),
        # S: integer logits
        "router_gating_linear int dtype": (lambda: router.router_gating_linear(
            jnp.ones((T, H)), jnp.ones((E, H)), None, jnp.int32),
            "router_dtype: expected a float dtype"),
        "router_gating_linear bogus dtype": (lambda: router.router_gating_linear(
            jnp.ones((T, H)), jnp.ones((E, H)), None, "bogus"), "router_dtype: expected a dtype"),
        # S: -1 wrapped to the last expert; out-of-range ids routed nowhere
        "precomputed_indices -1": (lambda: router.topk_routing_with_score_function(
            logits, K, precomputed_indices=-jnp.ones((T, K), jnp.int32)),
            r"precomputed_indices: expected expert ids in \[0, 8\), got -1"),
        "apply_biased_logits bias [T, 1]": (lambda: router.apply_biased_logits(
            logits, jax.random.key(0), jnp.ones((T, 1))), r"bias: expected shape \(8,\)"),
        "apply_random_logits int key": (lambda: router.apply_random_logits(logits, 0),
                                        "key: expected a jax.random key"),
        "apply_random_logits int logits": (lambda: router.apply_random_logits(
            jnp.ones((T, E), jnp.int32), jax.random.key(0)), "logits: expected a float array"),
        "sinkhorn no experts": (lambda: router.sinkhorn(jnp.ones((T, 0))),
                                "cost: expected at least one expert column"),
        "group_limited_topk scores None": (lambda: router.group_limited_topk(
            None, K, T, E, 2, 1), "scores: expected a rank-2 array, got NoneType"),
        # S: a float map's NaN counted as routed; 0.4 truncated to 0 by the counts
        "permute float map": (lambda: moe_utils.permute(jnp.ones((T, H)), jnp.ones((T, E))),
                              "routing_map: expected a bool or integer map, got float32"),
        "token counts float map": (lambda: moe_utils.get_tokens_per_expert_and_token_count(
            jnp.ones((T, E)), None), "routing_map: expected a bool or integer map"),
        "token counts unbound axis": (lambda: moe_utils.get_tokens_per_expert_and_token_count(
            jnp.ones((T, E), bool), "ep"), "reduce_group: mesh axis 'ep' is not bound here"),
        "token counts axis int": (lambda: moe_utils.get_tokens_per_expert_and_token_count(
            jnp.ones((T, E), bool), 3), "reduce_group: expected None, a mesh axis name"),
        "expert bias unbound axis": (lambda: router.get_updated_expert_bias(
            jnp.ones(E), jnp.zeros(E), 0.1, tp_dp_cp_group="dp"),
            "tp_dp_cp_group: mesh axis 'dp' is not bound here"),
        "permute num_out_tokens str": (lambda: moe_utils.permute(
            jnp.ones((T, H)), jnp.ones((T, E), bool), num_out_tokens="8", drop_and_pad=True),
            "num_out_tokens: expected an int"),
        "unpermute restore_shape None": (lambda: moe_utils.unpermute(
            jnp.ones((8, H)), jnp.zeros(8, jnp.int32), None), "restore_shape: expected"),
        "unpermute int tokens": (lambda: moe_utils.unpermute(
            jnp.ones((8, H), jnp.int32), jnp.zeros(8, jnp.int32), (T, H)),
            "permuted_tokens: expected float32"),
        # S: chunks past the input's rows were cut
        "sort_chunks sizes past the rows": (lambda: moe_utils.sort_chunks_by_idxs(
            jnp.ones((8, 1)), [5, 5], [1, 0]), "split_sizes: the chunks sum to 10 rows"),
        # S: seq_len 0 zeroed the sequence loss (1.279 with seq_len 3)
        "TopKRouter seq_len 0": (lambda: seq_router.routing(logits, seq_len=0),
                                 "seq_len: expected an int > 0"),
        "TopKRouter seq_len 3 of 4 tokens": (lambda: seq_router.routing(logits, seq_len=3),
                                             "seq_len: expected a divisor of the 4 tokens"),
        # S: integer logits from integer tokens
        "TopKRouter gating int x": (lambda: seq_router.gating(jnp.ones((T, H), jnp.int32)),
                                    "x: expected a float array, got int32"),
        "TopKRouter gating width": (lambda: seq_router.gating(jnp.ones((T, H + 1))),
                                    r"x: expected \[..., hidden_size=8\]"),
        "TopKRouter param_dtype int": (lambda: TopKRouter(cfg, H, rngs=nnx.Rngs(0),
                                                          param_dtype=jnp.int32),
                                       "param_dtype: expected a float dtype"),
        "TopKRouter rngs None": (lambda: TopKRouter(cfg, H, rngs=None),
                                 "rngs: expected an nnx.Rngs"),
        "set_loss_scale str": (lambda: MoEAuxLossAutoScaler.set_loss_scale("a"),
                               "scale: expected a finite number"),
        "set_loss_scale traced": (lambda: jax.jit(MoEAuxLossAutoScaler.set_loss_scale)(1.0),
                                  "scale: expected a concrete number"),
    }


def _all_cases():
    cases = _named_argument_cases()
    helpers = _helper_cases()
    assert not set(cases) & set(helpers)
    return {**cases, **helpers}


_CASES = _all_cases()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_arguments_are_named(case):
    call, match = _CASES[case]
    with pytest.raises(ValueError, match="^" + match):
        call()


def test_python_lists_where_pytorch_takes_them():
    """all_to_all_single's splits as Python lists (PyTorch's output_split_sizes /
    input_split_sizes are lists); a numpy float64 x of gather_rows without x64 (it failed in
    the handler's row check)."""
    x = np.random.default_rng(4).standard_normal((4 * T, H)).astype(np.float32)
    got = run_ep(lambda x: jax_ep.all_to_all_single(x, [1, 1, 1, 1], [1, 1, 1, 1],
                                                    axis_name=AXIS), ep_mesh(4), x)
    want = run_ep(lambda x: jax_ep.all_to_all_single(
        x, jnp.ones(4, jnp.int32), jnp.ones(4, jnp.int32), axis_name=AXIS), ep_mesh(4), x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    rows = np.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(np.asarray(ops.gather_rows(rows, jnp.array([3, 0]))),
                                  rows[[3, 0]])


def test_kernel_flags_take_any_concrete_bool():
    """The layer-1 flags take what selects a kernel statically: numpy and concrete JAX bools
    and 0 / 1 (a string such as "no", truthy, is refused above)."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((T, 128)).astype(np.float32))
    want = ops.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    for flag in (np.bool_(True), jnp.array(True), 1, jnp.int32(1)):
        got = ops.per_token_cast_to_fp8(x, round_scale=flag, use_ue8m0=flag)
        for g, r in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    with pytest.raises(ValueError, match="^drop_and_pad: expected a bool"):
        jax.jit(lambda flag: ops.permute(x, jnp.ones((T, 2), bool), num_out_tokens=8,
                                         drop_and_pad=flag))(jnp.array(False))


def test_coefficients_may_be_traced_and_python_zero_scaling_is_none():
    """The coefficient checks let traced values through: topk_routing_with_score_function's
    `if scaling_factor:` raised TracerBoolConversionError under jit; z-loss and switch-loss
    coefficients and the bias update rate are traced as before. A Python 0 scaling factor is
    none (Megatron's truthiness)."""
    from jax_ep.flax import router
    from jax_ep.flax.moe import MoEAuxLossAutoScaler

    logits = jnp.asarray(np.random.default_rng(7).standard_normal((T, E)), jnp.float32)
    plain = router.topk_routing_with_score_function(logits, K)[0]
    scaled = jax.jit(lambda s: router.topk_routing_with_score_function(
        logits, K, scaling_factor=s)[0])(2.5)
    np.testing.assert_allclose(scaled, 2.5 * plain, rtol=1e-6)
    np.testing.assert_array_equal(
        router.topk_routing_with_score_function(logits, K, scaling_factor=0)[0], plain)
    z = jax.jit(lambda c: router.z_loss_func(logits, c))(0.5)
    np.testing.assert_allclose(z, 0.5 * router.z_loss_func(logits, 1.0), rtol=1e-6)
    counts = jnp.arange(E, dtype=jnp.float32)
    bias = jax.jit(lambda r: router.get_updated_expert_bias(counts, jnp.zeros(E), r))(0.25)
    np.testing.assert_array_equal(bias, 0.25 * np.sign(3.5 - np.arange(E)))
    try:  # a concrete 0-d array (Megatron passes a tensor), then None: back to scale 1
        MoEAuxLossAutoScaler.set_loss_scale(jnp.float32(0.25))
        assert MoEAuxLossAutoScaler.main_loss_backward_scale == 0.25
        MoEAuxLossAutoScaler.set_loss_scale(None)
        d_aux = jax.grad(lambda a: MoEAuxLossAutoScaler.apply(jnp.ones(2), a).sum())(1.0)
        assert float(d_aux) == 1.0
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(1.0)

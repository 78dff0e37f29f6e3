"""Regression guard on the programs jax_ep emits (not a timing test): exactly the expected
collectives, no all-gather of tokens, buffer sizes equal to the documented formulas."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import AXIS, ep_mesh, random_routing, shard
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import hybridep

NUM_RANKS, T, H, K, E = 4, 6, 16, 2, 8
# The programs of the padded all_to_all transport ("peer" has its own in test_peer_transport).
pytestmark = pytest.mark.usefixtures("padded_auto")


def _collectives(fn, *arrays):
    mesh = ep_mesh(NUM_RANKS)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * len(arrays),
                           out_specs=P(AXIS))
    text = jax.jit(mapped).lower(*shard(mesh, *arrays)).as_text()
    found = []
    for line in text.splitlines():
        m = re.search(r'"?stablehlo\.(all_to_all|all_gather|all_reduce|ragged_all_to_all|'
                      r'collective_permute|reduce_scatter)"?', line)
        if m:
            operand = re.search(r":\s*\((tensor<[^>]*>)", line)
            found.append((m.group(1), operand.group(1) if operand else line))
    return found


def _inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, H)), dtype)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)
    return x, idx, w


@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
@pytest.mark.parametrize("capacity", [None, 4])
def test_deepep_dispatch_combine_collectives(backend, capacity):
    def f(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, backend=backend,
                                        capacity=capacity)
        return jax_ep.combine(rx, h)[0], rw

    c = capacity or T  # rows per destination
    found = _collectives(f, *_inputs())
    assert found == [
        ("all_gather", f"tensor<1x{NUM_RANKS}xi32>"),                # the one count exchange
        ("all_to_all", f"tensor<{NUM_RANKS}x{c}x{K}xi32>"),          # local expert ids
        ("all_to_all", f"tensor<{NUM_RANKS}x{c}x{H}xui16>"),         # tokens
        ("all_to_all", f"tensor<{NUM_RANKS}x{c}x{K}xf32>"),          # routing weights
        ("all_to_all", f"tensor<{NUM_RANKS}x{c}x{H}xui16>"),         # combine
    ], found


@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
def test_dispatch_without_weights_and_cached_dispatch_send_no_weights(backend):
    # Weights of ones arrive as ones: a dispatch without topk_weights, and a cached dispatch
    # (a second part through the first's handle), exchange no weights.
    def f(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, num_experts=E, axis_name=AXIS, backend=backend)
        again = jax_ep.dispatch(x.astype(jnp.float32), axis_name=AXIS, backend=backend,
                                handle=h)[0]
        return rx, rw, again

    found = _collectives(f, *_inputs())
    assert found == [
        ("all_gather", f"tensor<1x{NUM_RANKS}xi32>"),
        ("all_to_all", f"tensor<{NUM_RANKS}x{T}x{K}xi32>"),          # local expert ids
        ("all_to_all", f"tensor<{NUM_RANKS}x{T}x{H}xui16>"),         # tokens
        ("all_to_all", f"tensor<{NUM_RANKS}x{T}x{H}xf32>"),          # cached: tokens only
    ], found


def test_receive_buffer_is_num_worst_tokens_rows():
    def f(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                        num_worst_tokens=NUM_RANKS * T + 5)
        return rx, ri, rw

    mesh = ep_mesh(NUM_RANKS)
    out = jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS),) * 3,
                                       out_specs=P(AXIS)), *shard(mesh, *_inputs()))
    assert out[0].shape == (NUM_RANKS * (NUM_RANKS * T + 5), H)
    assert out[1].shape == out[2].shape == (NUM_RANKS * (NUM_RANKS * T + 5), K)


def test_hybridep_collectives_compact_routing_sends_only_indices():
    def f(x, i, w):
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, topk_idx=i, probs=w, num_experts=E,
                                                    axis_name=AXIS, num_permuted_tokens=24)
        return hybridep.hybridep_combine(px, h), pp

    tp = hybridep.equalized_num_tokens(T)
    found = _collectives(f, *_inputs())
    assert [kind for kind, _ in found] == ["all_gather"] + ["all_to_all"] * 4
    assert found[1][1] == f"tensor<{NUM_RANKS}x{tp}x{K}xi32>"   # top-k ids, not a [T,E] map
    assert found[2][1] == f"tensor<{NUM_RANKS}x{tp}x{K}xf32>"   # top-k probs
    assert found[3][1] == f"tensor<{NUM_RANKS}x{tp}x{H}xui16>"  # tokens (fused permute)
    assert found[4][1] == f"tensor<{NUM_RANKS}x{tp}x{H}xui16>"  # combine


def test_low_latency_buffer_sizes():
    tmax = 8

    def f(x, i, w):
        recv, count, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=tmax,
                                                     num_experts=E, axis_name=AXIS)
        return jax_ep.low_latency_combine(recv, i, w, h)

    L = E // NUM_RANKS
    found = _collectives(f, *_inputs())
    shapes = [s for k, s in found if k == "all_to_all"]
    # Blocks of the true worst case T*min(K, L) = 12 slots per destination, not L*Tmax = 16.
    C = T * min(K, L)
    assert C < L * tmax
    assert shapes == [f"tensor<{NUM_RANKS}x{L}xi32>",        # counts per (rank, expert)
                      f"tensor<{NUM_RANKS}x{C}xi32>",        # source token of each wire row
                      f"tensor<{NUM_RANKS}x{C}x{H}xui16>",   # dispatch
                      f"tensor<{NUM_RANKS}x{C}x{H}xui16>"]   # combine
    assert not [k for k, _ in found if k == "all_gather"]


def _compiled_layer_step(data=1, **dispatch):
    """MoELayer's training step compiled (only: the layer is built abstractly), T = 256 tokens
    per device, H = F = 128, E = 64, K = 8 on 8 emulated devices as mesh (data, expert =
    8 / data)."""
    from flax import nnx
    from jax.sharding import NamedSharding

    from jax_ep.flax import MoELayer
    mesh = jax.make_mesh((data, 8 // data), ("data", "expert"))
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=64, moe_router_topk=8,
                                       moe_share_token_dispatcher=False, **dispatch)
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: MoELayer(cfg, 128, 128, rngs=nnx.Rngs(0), mesh=mesh)))
    state = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                         state, nnx.get_named_sharding(state, mesh))
    x = jax.ShapeDtypeStruct((8 * 256, 128), jnp.float32,
                             sharding=NamedSharding(mesh, P(("data", "expert"))))

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x)[0] ** 2)
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss)).lower(state, x).compile()


def _layer_step_peak_bytes(**dispatch):
    """Peak bytes per device (arguments + outputs + temp, XLA's memory analysis) of
    _compiled_layer_step on mesh (data 1, expert 8)."""
    m = _compiled_layer_step(**dispatch).memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def test_dropless_buffer_factor_bounds_the_programs_memory():
    """dropless_buffer_factor f = 1.25: the worst case is 8 ranks x 8 local slots per token,
    6.4 times the bounded buffers' 1.25 x 8, and the overflow fallback runs in chunks that fit
    the bounded size, so the whole step's peak stays well under the worst-case program's:
    0.30 of it (before the chunked fallback, with both branches' buffers in one program, 1.03
    times it)."""
    worst = _layer_step_peak_bytes()
    bounded = _layer_step_peak_bytes(dropless_buffer_factor=1.25)
    assert bounded < 0.5 * worst, (bounded, worst)


def test_bounded_fallback_reduces_the_expert_gradients_over_data_once_not_per_chunk():
    """Mesh (data 2, expert 4): the expert weights are replicated over the data axis, so their
    gradient is summed over it once per step. The overflow fallback of dropless_buffer_factor
    runs its chunks in a loop (8 here: 256 tokens, worst case 4 x 32 x 8 rows per chunk
    against the bounded 2,560); the all-reduce of those gradients stays out of it (it ran in
    every chunk before)."""
    text = _compiled_layer_step(data=2, dropless_buffer_factor=1.25).as_text()
    reduces = [line for line in text.splitlines() if " all-reduce(" in line]
    assert [line for line in reduces if "f32[16,128,256]" in line]  # w_gate_up's gradient
    in_loops = [re.search(r'op_name="([^"]*)"', line).group(1) for line in reduces
                if "/while" in line]
    assert not in_loops, in_loops

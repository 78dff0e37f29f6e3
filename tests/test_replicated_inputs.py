"""Gradients of inputs replicated over the expert axis (`in_specs=P()` inside `jax.shard_map`)
while the routing varies per rank: the gradient of a replicated input is the sum over ranks of
each rank's gradient, i.e. what the same program gives for the input tiled over the ranks,
summed. Every op and exchange with a hand-written VJP must type its cotangents as the primal
(the cast of a replicated operand to varying, outside the custom_vjp, sums them); before, they
raised JAX's "Custom VJP bwd rule must produce an output with the same type" error where the
XLA reference ops worked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_utils import AXIS, ep_mesh, random_routing
from jax_ep import deepep, ops

NUM_RANKS, T, H, K, E = 4, 6, 128, 2, 8


def _deepep(backend, **kwargs):
    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend, **kwargs)
        y = rx * jnp.where(ri >= 0, rw, 0.0).sum(-1, keepdims=True)
        return jax_ep.combine(y, h)[0]
    return body


def _deepep_biased(x, idx, w):
    rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
    return deepep.combine_with_bias(rx, h, x * w[:, :1])[0]


def _hybridep(x, idx, w):
    px, pp, _, h = jax_ep.hybridep_dispatch(x, topk_idx=idx, probs=w, num_experts=E,
                                            axis_name=AXIS)
    return jax_ep.hybridep_combine(px * pp[:, None], h)


def _low_latency(x, idx, w):
    rx, _, h = jax_ep.low_latency_dispatch(x.astype(jnp.bfloat16), idx,
                                           num_max_dispatch_tokens_per_rank=T, num_experts=E,
                                           axis_name=AXIS)
    return jax_ep.low_latency_combine(rx, idx, w, h).astype(jnp.float32)


def _all_to_all_single(x, idx, w):
    splits = jnp.bincount(jnp.clip(idx[:, 0], 0) % NUM_RANKS, length=NUM_RANKS)
    return jax_ep.all_to_all_single(x * w[:, :1], splits, splits, axis_name=AXIS)[:T]


def _layer1(impl):
    def body(x, idx, w):
        routing_map, probs = ops.indices_to_multihot(idx, w, num_experts=E, impl=impl)
        px, pp, rows, _ = ops.permute(x, routing_map, probs, num_out_tokens=T * K, impl=impl)
        return ops.unpermute(px, rows, num_tokens=T, probs=pp, impl=impl)
    return body


CASES = {
    "deepep": _deepep("deepep"),
    "alltoall backend": _deepep("alltoall"),
    "deepep fp8 cast_back": _deepep("deepep", use_fp8=True, fp8_output="cast_back"),
    "deepep with bias": _deepep_biased,
    "hybridep": _hybridep,
    "low_latency": _low_latency,
    "all_to_all_single": _all_to_all_single,
    "layer-1 ops ffi": _layer1("ffi"),
    "layer-1 ops xla": _layer1("xla"),
}


def _grads(body, mesh, x, idx, w, replicated):
    """d sum(sin(body)) / d (x, w), with x and w replicated (P()) or split over the ranks."""
    spec = P() if replicated else P(AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(AXIS), spec), out_specs=P(AXIS))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    loss = lambda x, w: jnp.sum(jnp.sin(fn(x, put(idx, P(AXIS)), w)))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(put(x, spec), put(w, spec))


@pytest.mark.parametrize("case", list(CASES))
def test_replicated_input_gradient_is_the_sum_over_ranks(case):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx, _ = random_routing(rng, NUM_RANKS * T, K, E)  # each rank routes the same x its own way
    w = rng.uniform(0.5, 1.5, (T, K)).astype(np.float32)
    mesh = ep_mesh(NUM_RANKS)
    got = _grads(CASES[case], mesh, x, np.asarray(idx, np.int32), w, replicated=True)
    tiled = _grads(CASES[case], mesh, np.tile(x, (NUM_RANKS, 1)), np.asarray(idx, np.int32),
                   np.tile(w, (NUM_RANKS, 1)), replicated=False)
    for g, per_rank in zip(got, tiled):
        want = np.asarray(per_rank).reshape((NUM_RANKS,) + g.shape).sum(axis=0)
        assert np.abs(want).max() > 0
        tol = 1e-2 if case == "low_latency" else 2e-5  # bf16 rows: the ranks' sum rounds
        np.testing.assert_allclose(np.asarray(g), want, rtol=tol, atol=tol)

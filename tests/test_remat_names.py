"""Remat policies by collective name: `jax.checkpoint(policy=save_only_these_names("ep_counts",
"ep_dispatch", "ep_combine"))` around an EP body must save every exchange's result, so its
backward runs exactly the collectives of the plain (no remat) backward: the transposed
exchanges, none of the forward's again. With nothing saved the forward's exchanges do run
again, which shows the count below sees a re-run. The exchanges are wrapped in `custom_vjp`s,
whose inner names remat cannot see; the names sit on the wrappers' results."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import deepep
from ep_utils import AXIS, ep_mesh, nested_eqns, random_routing

NAMES = ("ep_counts", "ep_dispatch", "ep_combine")
COLLECTIVES = ("all_to_all", "all_gather", "ragged_all_to_all", "psum", "psum_invariant",
               "reduce_scatter")
T, H, K, E = 6, 512, 2, 8  # H: FP8 (128) and LogFMT (512) need its multiples


def _collectives(jaxpr, counts):
    """Collective equations (and peer exchange custom calls) in jaxpr and its sub-jaxprs."""
    for _, eqn in nested_eqns(jaxpr):
        name = eqn.primitive.name
        if name in COLLECTIVES:
            counts[name] += 1
        elif name == "ffi_call" and "peer" in str(eqn.params.get("target_name")):
            counts["peer"] += 1
    return counts


def _grad_collectives(body, mesh, args, policy):
    """Collectives in the jaxpr of grad(sum(shard_map(body)^2)) w.r.t. the float arguments
    (split over every mesh axis), body wrapped in jax.checkpoint(policy) unless policy is
    None."""
    if policy is not None:
        body = jax.checkpoint(body, policy=policy)
    spec = P(mesh.axis_names)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)
    floats = tuple(i for i, a in enumerate(args) if a.dtype == np.float32)

    def loss(*float_args):
        full = list(args)
        for i, a in zip(floats, float_args):
            full[i] = a
        return jnp.sum(fn(*full) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(floats)))))(
        *(args[i] for i in floats))
    return _collectives(jaxpr.jaxpr, collections.Counter())


def _experts(rows, ids, weights):
    """A stand-in local kernel: each row scaled by its weights on local slots (ids >= 0)."""
    return rows * jnp.where(ids >= 0, weights, 0.0).sum(-1, keepdims=True)


def _deepep(transport, backend="deepep", **kwargs):
    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        backend=backend, transport=transport, **kwargs)
        return jax_ep.combine(jnp.sin(_experts(rx, ri, rw)), h)[0]
    return body


def _deepep_biased(transport):
    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                        transport=transport)
        return deepep.combine_with_bias(jnp.sin(_experts(rx, ri, rw)), h, x)[0]
    return body


def _chunked(transport):
    def body(x, idx, w):
        return jax_ep.dispatch_chunked_forward(
            x, idx, w, lambda rx, ri, rw: jnp.sin(_experts(rx, ri, rw)),
            num_local_experts=E // jax.lax.axis_size(AXIS), axis_name=AXIS, chunks=3,
            backend="deepep", transport=transport)
    return body


def _hybridep(transport):
    def body(x, idx, w):
        px, pp, _, h = jax_ep.hybridep_dispatch(x, topk_idx=idx, probs=w, num_experts=E,
                                                axis_name=AXIS, transport=transport)
        return jax_ep.hybridep_combine(jnp.sin(px) * pp[:, None], h)
    return body


def _low_latency(transport, use_logfmt=False):
    def body(x, idx, w):
        x = x.astype(jnp.bfloat16)
        rx, _, h = jax_ep.low_latency_dispatch(x, idx, num_max_dispatch_tokens_per_rank=T,
                                               num_experts=E, axis_name=AXIS,
                                               transport=transport)
        out = jax_ep.low_latency_combine(jnp.sin(rx), idx, w, h, use_logfmt=use_logfmt)
        return out.astype(jnp.float32)
    return body


def _all_to_all_single(transport):
    del transport  # all_to_all_single picks its own ("auto")

    def body(x, idx, w):
        del w
        num_ranks = jax.lax.axis_size(AXIS)
        splits = jnp.bincount(jnp.clip(idx[:, 0], 0) % num_ranks, length=num_ranks)
        back = jax_ep.all_to_all_single(jnp.sin(x), splits, splits, axis_name=AXIS)
        return jnp.sin(back[:x.shape[0]])
    return body


def _bounded(transport):
    """The layer's dropless bounded path (MoEFlexTokenDispatcher.bounded_forward, itself a
    custom_vjp around dispatch -> experts -> combine)."""
    from jax_ep.flax import MoEFlexTokenDispatcher

    def body(x, idx, w):
        num_ranks = jax.lax.axis_size(AXIS)
        config = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                              moe_flex_dispatcher_backend="deepep",
                                              expert_axis_name=AXIS, transport=transport,
                                              dropless_buffer_factor=1.25)
        num_local = E // num_ranks
        dispatcher = MoEFlexTokenDispatcher(num_local, list(range(num_local)), config)
        y, _, _ = dispatcher.bounded_forward(
            x, w, idx, lambda rows, counts, probs, scale: jnp.sin(rows * scale) * probs[:, None],
            x[0, 0])
        return y
    return body


CASES = {
    "deepep": _deepep,
    "alltoall backend": lambda t: _deepep(t, backend="alltoall"),
    "deepep fp8 cast_back": lambda t: _deepep(t, use_fp8=True, fp8_output="cast_back"),
    "deepep with bias": _deepep_biased,
    "chunked": _chunked,
    "hybridep": _hybridep,
    "low_latency": _low_latency,
    "low_latency logfmt": lambda t: _low_latency(t, use_logfmt=True),
    "all_to_all_single": _all_to_all_single,
    "bounded (layer)": _bounded,
}
# all_to_all_single picks its own transport; the alltoall backend refuses peer (XLA ops only)
PAIRS = [(case, transport) for case in CASES for transport in ("all_to_all", "peer")
         if (case != "all_to_all_single" or transport == "peer")
         and (case != "alltoall backend" or transport != "peer")]


def _assert_saving_reruns_nothing(body, mesh):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((mesh.size * T, H)).astype(np.float32)
    idx, w = random_routing(rng, mesh.size * T, K, E)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    args = tuple(jax.device_put(a, sharding)
                 for a in (x, np.asarray(idx, np.int32), np.asarray(w, np.float32)))
    plain = _grad_collectives(body, mesh, args, None)
    saved = _grad_collectives(body, mesh, args,
                              jax.checkpoint_policies.save_only_these_names(*NAMES))
    recomputed = _grad_collectives(body, mesh, args, jax.checkpoint_policies.nothing_saveable)
    assert sum(plain.values()) > 0
    assert saved == plain, (saved, plain)
    assert sum(recomputed.values()) > sum(plain.values()), (recomputed, plain)


@pytest.mark.parametrize("case,transport", PAIRS)
def test_saving_the_named_exchanges_runs_none_again(case, transport):
    _assert_saving_reruns_nothing(CASES[case](transport), ep_mesh(4))


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_two_hops_saved_by_the_same_names(backend):
    """(node, local) two-hop dispatch: both hops' rows are saved by the three names."""
    mesh = jax.make_mesh((2, 2), ("node", "local"), devices=jax.devices()[:4])

    def body(x, idx, w):
        if backend == "hybridep":
            px, pp, _, h = jax_ep.hybridep_dispatch(x, topk_idx=idx, probs=w, num_experts=E,
                                                    axis_name=("node", "local"))
            return jax_ep.hybridep_combine(jnp.sin(px) * pp[:, None], h)
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=("node", "local"))
        return jax_ep.combine(jnp.sin(_experts(rx, ri, rw)), h)[0]
    _assert_saving_reruns_nothing(body, mesh)



def test_all_to_all_single_backward_exchanges_no_counts():
    """Its VJP reuses the forward's count matrix: one count exchange and one row exchange
    forward, one row exchange back (PyTorch's backward is the same op with the splits
    swapped, one collective)."""
    mesh = ep_mesh(4)
    x = jax.device_put(np.ones((4 * T, H), np.float32), NamedSharding(mesh, P(AXIS)))

    def body(x):
        splits = jnp.full((4,), T // 4 + 1, jnp.int32).at[0].set(T - 3 * (T // 4 + 1))
        return jnp.sin(jax_ep.all_to_all_single(x, splits, splits, axis_name=AXIS)[:T])
    fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(fn(x) ** 2)))(x)
    assert sum(_collectives(jaxpr.jaxpr, collections.Counter()).values()) == 3


def test_expert_tensor_parallel_collectives_saved_by_the_same_names():
    """With expert_tensor_parallel_size = 2 the layer's tensor-axis all-gathers (counts, rows)
    and its reduce-scatter carry the names too: saving them re-runs none of the forward's
    exchanges (every collective of the forward appears in the backward only as often as in the
    plain backward)."""
    from flax import nnx

    from jax_ep.flax import MoEConfig, MoELayer, shard_params
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"))
    cfg = MoEConfig(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=16,
                    expert_tensor_parallel_size=2,
                    token_dispatcher=jax_ep.TokenDispatcherConfig(transport="all_to_all"))
    layer = MoELayer(cfg, 16, 16, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    graph, state = nnx.split(layer)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, T, 16)),
                       NamedSharding(mesh, P(mesh.axis_names)))
    counts = {}
    for policy in (None, jax.checkpoint_policies.save_only_these_names(*NAMES),
                   jax.checkpoint_policies.nothing_saveable):
        def loss(state, x):
            return jnp.sum(nnx.merge(graph, state)(x)[0] ** 2)
        if policy is not None:
            loss = jax.checkpoint(loss, policy=policy)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(jax.grad(loss))(state, x)
        found = _collectives(jaxpr.jaxpr, collections.Counter())
        counts[policy] = {k: found[k] for k in ("all_gather", "all_to_all", "reduce_scatter")}
    plain, saved, recomputed = counts.values()
    assert plain["all_gather"] > 1 and plain["reduce_scatter"] == 1, plain
    assert saved == plain, (saved, plain)
    assert recomputed["all_gather"] > plain["all_gather"], (recomputed, plain)

"""Megatron-Core router parity (jax_ep.flax.router, MoEConfig, MoELayer's losses and statistics)
against Megatron's PyTorch formulation written here in numpy (float64): topk_softmax_with_capacity,
group_limited_topk, apply_router_token_dropping, compute_routing_scores_for_aux_loss,
switch_load_balancing_loss_func, z_loss_func, get_updated_expert_bias."""

from __future__ import annotations

import dataclasses
from functools import partial
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import assert_param_grads_close, layer_vs_dense
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.flax import MoEConfig, MoELayer, dense_forward, shard_params
from jax_ep.flax import moe
from jax_ep.flax import router as routing

E, K, H = 8, 2, 16


# ----------------------------------------------------------------- Megatron in numpy (float64)

def np_topk(x, k):
    """torch.topk(x, k, dim=1): values and indices, descending."""
    idx = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x, idx, 1), idx


def np_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_group_limited_topk(scores, topk, num_groups, group_topk):
    T, num_experts = scores.shape
    grouped = scores.reshape(T, num_groups, -1)
    group_scores = -np.sort(-grouped, axis=-1)[..., :topk // group_topk].sum(axis=-1)
    _, group_idx = np_topk(group_scores, group_topk)
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.repeat(group_mask, num_experts // num_groups, axis=1).astype(bool)
    return np_topk(np.where(score_mask, scores, -np.inf), topk)


def np_scores(logits, score_function):
    """Megatron's sigmoid, or sqrtsoftplus: sqrt(torch.nn.functional.softplus(x)), which is x
    itself above its threshold 20."""
    if score_function == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    return np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20)))))


def np_sinkhorn(cost, tol=1e-4):
    """Megatron's sinkhorn (moe_utils.sinkhorn), float64."""
    cost = np.exp(cost)
    d0, d1 = np.ones(cost.shape[0]), np.ones(cost.shape[1])
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size) / (np.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size) / (np.sum(d0[:, None] * cost, 0) + eps)
        error = np.mean(np.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0[:, None]


def np_sinkhorn_route(logits, c: MoEConfig, training=True):
    """TopKRouter.sinkhorn_load_balancing -> (probs [T,K], top [T,K])."""
    act = (1 / (1 + np.exp(-logits))) if c.moe_router_topk == 1 else np_softmax(logits)
    _, top = np_topk(np_sinkhorn(logits) if training else act, c.moe_router_topk)
    return np.take_along_axis(act, top, 1), top


def np_route(logits, c: MoEConfig, expert_bias=None):
    """topk_softmax_with_capacity + apply_router_token_dropping -> (probs [T,E], map [T,E])."""
    def topk(s):
        if c.moe_router_group_topk:
            return np_group_limited_topk(s, c.moe_router_topk, c.moe_router_num_groups,
                                         c.moe_router_group_topk)
        return np_topk(s, c.moe_router_topk)

    if c.moe_router_load_balancing_type == "sinkhorn":
        probs, top = np_sinkhorn_route(logits, c)
    elif c.moe_router_score_function == "softmax":
        if c.moe_router_pre_softmax:
            probs, top = topk(np_softmax(logits))
        else:
            scores, top = topk(logits)
            probs = np_softmax(scores)
    else:
        scores = np_scores(logits, c.moe_router_score_function)
        if expert_bias is not None:
            _, top = topk(scores + expert_bias)
            scores = np.take_along_axis(scores, top, 1)
        else:
            scores, top = topk(scores)
        probs = scores / (scores.sum(-1, keepdims=True) + 1e-20) if c.moe_router_topk > 1 \
            else scores
    if c.moe_router_topk_scaling_factor and c.moe_router_load_balancing_type != "sinkhorn":
        probs = probs * c.moe_router_topk_scaling_factor
    routing_probs = np.zeros_like(logits)
    np.put_along_axis(routing_probs, top, probs, axis=1)
    routing_map = np.zeros(logits.shape, bool)
    np.put_along_axis(routing_map, top, True, axis=1)
    if c.moe_expert_capacity_factor is None:
        return routing_probs, routing_map
    return np_token_dropping(routing_probs, routing_map, c.moe_router_topk,
                             c.moe_expert_capacity_factor, c.moe_token_drop_policy,
                             c.moe_pad_expert_input_to_capacity)


def np_token_dropping(routing_probs, routing_map, topk, factor, policy, pad):
    """apply_router_token_dropping: (final_probs [T,E], final_map [T,E])."""
    T, num_experts = routing_probs.shape
    capacity = int(np.ceil(T * topk / num_experts * factor))
    if capacity > T:
        return routing_probs, routing_map
    key = routing_probs if policy == "probs" else routing_map.astype(float)
    # torch.topk(key, capacity, dim=0); ties (equal probs / the 1s of the map) keep the lower
    # token index, the order jax_ep documents.
    order = np.argsort(-key, axis=0, kind="stable")[:capacity]
    capacity_mask = np.zeros(routing_probs.shape, bool)
    np.put_along_axis(capacity_mask, order, True, axis=0)
    final_map = capacity_mask if pad else routing_map & capacity_mask
    return routing_probs * final_map, final_map


def np_switch(logits, c: MoEConfig):
    """compute_routing_scores_for_aux_loss + switch_load_balancing_loss_func, coeff 1."""
    if c.moe_router_score_function == "softmax":
        scores = np_softmax(logits)
    else:
        scores = np_scores(logits, c.moe_router_score_function)
        scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    _, top = np_topk(scores, c.moe_router_topk)
    routing_map = np.zeros(logits.shape, bool)
    np.put_along_axis(routing_map, top, True, axis=1)
    T, num_experts = logits.shape
    return np.sum(scores.sum(0) * routing_map.sum(0)) * num_experts / (c.moe_router_topk * T * T)


def np_z_loss(logits):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return np.mean(lse ** 2)


def np_switch_counts(logits, c: MoEConfig):
    """(aux-loss scores summed over tokens [E], plain top-k counts [E]) of tokens [N,E]."""
    scores = np_aux_scores(logits, c)
    _, top = np_topk(scores, c.moe_router_topk)
    routing_map = np.zeros(logits.shape, bool)
    np.put_along_axis(routing_map, top, True, axis=1)
    return scores.sum(0), routing_map.sum(0)


def np_aux_scores(logits, c: MoEConfig):
    if c.moe_router_score_function == "softmax":
        return np_softmax(logits)
    scores = np_scores(logits, c.moe_router_score_function)
    return scores / (scores.sum(-1, keepdims=True) + 1e-20)


def np_types(c: MoEConfig):
    """{type: coefficient} of Megatron's get_aux_loss_coeff for the three loss types."""
    kinds, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    if isinstance(kinds, str):
        kinds, coeffs = (kinds,), (coeffs,)
    return {k: v for k, v in zip(kinds, coeffs)
            if k in ("aux_loss", "seq_aux_loss", "global_aux_loss") and v > 0}


def np_global(logits, c: MoEConfig, tracked=None, steps=0):
    """_apply_global_aux_loss on one micro-batch [N,E] (coeff 1): the expert counts the running
    mean (tracked + this micro-batch's) / (steps + 1)."""
    scores, counts = np_switch_counts(logits, c)
    avg = ((0 if tracked is None else tracked) + counts) / (steps + 1)
    T, num_experts = logits.shape
    return np.sum(scores * avg) * num_experts / (c.moe_router_topk * T * T)


def np_losses(logits, c: MoEConfig, num_devices, seq_len):
    """The layer's unscaled ({type: load-balancing loss}, z_loss) over the global tokens [N,E]
    (the first micro-batch of a step)."""
    losses = {}
    for kind in np_types(c):
        if kind == "aux_loss":
            losses[kind] = np.mean([np_switch(b, c) for b in np.split(logits, num_devices)])
        elif kind == "seq_aux_loss":
            losses[kind] = np.mean([np_switch(b, c)
                                    for b in np.split(logits, len(logits) // seq_len)])
        else:
            losses[kind] = np_global(logits, c)
    return losses, (np_z_loss(logits) if c.moe_z_loss_coeff is not None else 0.0)


# ----------------------------------------------------------------- function-level parity

ROUTERS = {
    "softmax": dict(),
    "pre_softmax": dict(moe_router_pre_softmax=True),
    "sigmoid_scaled": dict(moe_router_score_function="sigmoid",
                           moe_router_topk_scaling_factor=2.5),
    "sigmoid_top1": dict(moe_router_score_function="sigmoid", moe_router_topk=1),
    "groups": dict(moe_router_num_groups=4, moe_router_group_topk=2),
    "groups_pre_softmax": dict(moe_router_num_groups=4, moe_router_group_topk=1,
                               moe_router_pre_softmax=True),
    "sigmoid_bias_groups": dict(moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_router_num_groups=2,
                                moe_router_group_topk=2, moe_router_topk=4),
    "sqrtsoftplus_scaled": dict(moe_router_score_function="sqrtsoftplus",
                                moe_router_topk_scaling_factor=2.5),
    "sqrtsoftplus_top1": dict(moe_router_score_function="sqrtsoftplus", moe_router_topk=1),
    "sqrtsoftplus_bias_groups": dict(moe_router_score_function="sqrtsoftplus",
                                     moe_router_enable_expert_bias=True,
                                     moe_router_num_groups=2, moe_router_group_topk=2,
                                     moe_router_topk=4),
    "capacity_probs": dict(moe_expert_capacity_factor=0.5),
    "capacity_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "capacity_pad": dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True,
                         moe_router_pre_softmax=True),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=3,
                     moe_router_topk_scaling_factor=4.0),  # scaling ignored, as Megatron
    "sinkhorn_top1": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1),
}


def _cfg(**fields):
    return MoEConfig(**dict(dict(num_moe_experts=E, moe_router_topk=K), **fields))


def _dense(probs, ids, num_experts=E):
    """probs [T,K], ids [T,K] (-1 dropped) -> (probs [T,E], map [T,E])."""
    probs, ids = np.asarray(probs, np.float64), np.asarray(ids)
    dense = np.zeros((ids.shape[0], num_experts))
    mask = np.zeros((ids.shape[0], num_experts), bool)
    for t, k in zip(*np.nonzero(ids >= 0)):
        dense[t, ids[t, k]] += probs[t, k]
        mask[t, ids[t, k]] = True
    return dense, mask


@pytest.mark.parametrize("name", ROUTERS)
def test_route_and_drop_match_megatron_values_and_gradients(name):
    c = _cfg(**ROUTERS[name])
    logits = np.asarray(jax.random.normal(jax.random.key(0), (16, E)), np.float64) * 2
    bias = (np.asarray(jax.random.normal(jax.random.key(1), (E,))) * 0.3
            if c.moe_router_enable_expert_bias else None)

    @jax.jit
    def ours(lg):
        probs, ids = routing.route(lg, c, None if bias is None else jnp.asarray(bias,
                                                                                 jnp.float32))
        return routing.capacity_drop(probs, ids, c)

    probs, ids, dropped = ours(jnp.asarray(logits, jnp.float32))
    want_probs, want_map = np_route(logits, c, bias)
    got_probs, got_map = _dense(probs, ids)
    routed = np_route(logits, dataclasses.replace(c, moe_expert_capacity_factor=None,
                                                  moe_pad_expert_input_to_capacity=False),
                      bias)[1]
    # Megatron's padded map also holds each expert's padding rows (probability 0): the routed
    # part of it is ours, and the probs are equal.
    np.testing.assert_array_equal(got_map, want_map & routed)
    np.testing.assert_allclose(got_probs, want_probs, rtol=1e-5, atol=1e-7)
    if bias is not None:  # the bias must matter here, or this case checks nothing of it
        assert (np_route(logits, c)[1] != want_map).any()
    np.testing.assert_array_equal(np.asarray(dropped), (routed & ~want_map).sum(0))
    # d/d logits of sum(probs * weights): jax.grad vs central differences of the numpy form.
    weights = np.asarray(jax.random.normal(jax.random.key(2), (16, E)), np.float64)
    direction = np.asarray(jax.random.normal(jax.random.key(3), (16, E)), np.float64)

    def f(lg):
        p, i, _ = ours(lg)
        return jnp.sum(jnp.asarray(_scatter(p, i)) * weights.astype(np.float32))

    grad = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(logits, jnp.float32)), np.float64)
    eps = 1e-5
    fd = (np.sum(np_route(logits + eps * direction, c, bias)[0] * weights)
          - np.sum(np_route(logits - eps * direction, c, bias)[0] * weights)) / (2 * eps)
    np.testing.assert_allclose(np.sum(grad * direction), fd, rtol=2e-4, atol=1e-5)


def _scatter(probs, ids):
    """probs [T,K], ids [T,K] (-1 dropped) -> [T,E], differentiable in probs."""
    return jnp.zeros((ids.shape[0], E), probs.dtype).at[
        jnp.arange(ids.shape[0])[:, None], jnp.where(ids < 0, E, ids)].add(probs, mode="drop")


def test_group_limited_routing_keeps_every_token_within_group_topk_groups():
    c = _cfg(num_moe_experts=16, moe_router_topk=4, moe_router_num_groups=4,
             moe_router_group_topk=2)
    logits = jax.random.normal(jax.random.key(5), (256, 16))
    _, ids = routing.route(logits, c)
    groups = np.asarray(ids) // 4
    assert max(len(set(row)) for row in groups) <= 2
    assert (np.asarray(ids) >= 0).all()
    # A group's score is the sum of its top K / group_topk = 2 scores: token 0 below has its
    # single best expert in group 3 but groups 0 and 1 hold the best pairs.
    row = np.full(16, -5.0)
    row[[0, 1, 4, 5, 12]] = [2.0, 2.0, 1.9, 1.9, 3.0]
    _, ids = routing.route(jnp.asarray(row[None], jnp.float32), c)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1, 4, 5]


def test_drop_policies_by_hand():
    # 4 tokens, 2 experts, top-1, capacity ceil(4*1/2 * 1.0) = 2; every token prefers expert 0
    # with pre-softmax probs ordered by the logit gap: tokens 1 and 2 are the most confident.
    logits = jnp.asarray([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.5, 0.0]])
    for policy, kept in (("probs", [1, 2]), ("position", [0, 1])):
        c = MoEConfig(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True,
                      moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy)
        probs, ids = routing.route(logits, c)
        probs, ids, dropped = routing.capacity_drop(probs, ids, c)
        assert np.nonzero(np.asarray(ids)[:, 0] == 0)[0].tolist() == kept, policy
        assert np.asarray(dropped).tolist() == [2, 0]
        assert (np.asarray(probs)[np.asarray(ids) < 0] == 0).all()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_megatron_aux_loss_functions_by_name(score_function):
    # compute_routing_scores_for_aux_loss -> switch_load_balancing_loss_func, z_loss_func with
    # Megatron's arguments, against the float64 model; padding masks as Megatron's code reads
    # them: True = padding for the scores and the z-loss, True = valid for the switch loss
    T = 12
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((T, E)) * 2
    pad = np.zeros(T, bool)
    pad[[3, 7]] = True
    c = _cfg(moe_router_score_function=score_function)
    routing_map, scores = routing.compute_routing_scores_for_aux_loss(
        jnp.asarray(logits, jnp.float32), K, score_function, fused=True)
    want_scores = np_aux_scores(logits, c)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5, atol=1e-7)
    _, top = np_topk(want_scores, K)
    want_map = np.zeros((T, E), bool)
    np.put_along_axis(want_map, top, True, axis=1)
    np.testing.assert_array_equal(np.asarray(routing_map), want_map)
    got = routing.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, K, E, 0.5)
    np.testing.assert_allclose(float(got), 0.5 * np_switch(logits, c), rtol=1e-5)
    masked_map, masked = routing.compute_routing_scores_for_aux_loss(
        jnp.asarray(logits, jnp.float32), K, score_function, padding_mask=jnp.asarray(pad))
    assert not np.asarray(masked_map)[pad].any() and not np.asarray(masked)[pad].any()
    np.testing.assert_array_equal(np.asarray(masked_map)[~pad], want_map[~pad])
    n = int((~pad).sum())
    got = routing.switch_load_balancing_loss_func(scores, masked_map.sum(0), n, K, E, 1.0,
                                                  padding_mask=jnp.asarray(~pad))
    want = np.sum(want_scores[~pad].sum(0) * want_map[~pad].sum(0)) * E / (K * n * n)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # z-loss: coeff * mean of logsumexp^2, over the non-padding tokens with a mask
    np.testing.assert_allclose(float(routing.z_loss_func(jnp.asarray(logits, jnp.float32),
                                                         1e-3)),
                               1e-3 * np_z_loss(logits), rtol=1e-5)
    np.testing.assert_allclose(float(routing.z_loss_func(jnp.asarray(logits, jnp.float32), 2.0,
                                                         padding_mask=jnp.asarray(pad))),
                               2.0 * np_z_loss(logits[~pad]), rtol=1e-5)
    all_pad = routing.z_loss_func(jnp.asarray(logits, jnp.float32), 1.0,
                                  padding_mask=jnp.ones(T, bool))
    assert float(all_pad) == 0.0  # Megatron clamps the count at 1
    assert routing.z_loss_func(jnp.asarray(logits, jnp.bfloat16), 1.0).dtype == jnp.bfloat16


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_apply_router_token_dropping_is_megatrons(policy, pad):
    # Megatron's dense drop vs the float64 model, and (without pad) the same kept slots as the
    # layer's sparse capacity_drop
    T, factor = 16, 0.75
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((T, E))
    c = _cfg(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy,
             moe_pad_expert_input_to_capacity=pad)
    probs, ids = routing.route(jnp.asarray(logits, jnp.float32), c)
    dense_probs, dense_map = _dense(probs, ids)
    got_probs, got_map = routing.apply_router_token_dropping(
        jnp.asarray(dense_probs), jnp.asarray(dense_map), K, factor, policy, pad)
    want_probs, want_map = np_token_dropping(dense_probs.astype(np.float64), dense_map, K,
                                             factor, policy, pad)
    np.testing.assert_array_equal(np.asarray(got_map), want_map)
    np.testing.assert_allclose(np.asarray(got_probs), want_probs, rtol=1e-6)
    capacity = routing.get_capacity(T * K, E, factor)
    assert capacity == int(np.ceil(T * K / E * factor)) == 3
    if pad:
        assert (np.asarray(got_map).sum(0) == capacity).all()
    else:
        kept_probs, kept_ids, _ = routing.capacity_drop(probs, ids, c)
        np.testing.assert_array_equal(np.asarray(got_map), _dense(kept_probs, kept_ids)[1])
    assert routing.get_capacity(10, 4, 1.0) == 3 and routing.get_capacity(10, 4, 1.0, 5) == 5
    with pytest.raises(ValueError, match="drop_policy"):
        routing.apply_router_token_dropping(jnp.asarray(dense_probs), jnp.asarray(dense_map), K,
                                            factor, "random")


def test_expert_bias_update_is_megatrons_sign_rule():
    bias = jnp.asarray([0.5, 0.0, -0.25, 1.0])
    got = routing.get_updated_expert_bias(jnp.asarray([3, 1, 2, 2]), bias, 0.1)
    np.testing.assert_allclose(np.asarray(got), [0.4, 0.1, -0.25, 1.0], rtol=1e-6)
    # Megatron's finalize_model_grads stacks the layers' counts [layers, E]: a mean per row
    stacked = routing.get_updated_expert_bias(jnp.asarray([[1, 2, 3, 6], [10, 10, 10, 10]]),
                                              jnp.zeros((2, 4)), 0.1)
    np.testing.assert_allclose(np.asarray(stacked), [[0.1, 0.1, 0, -0.1], [0, 0, 0, 0]])
    # balanced counts over E experts where 1/E is inexact (E = 60: the mean as sum * (1/E)
    # is 5 + 4.8e-7): every expert sits at the mean, Megatron's sum / E, and none moves
    for num_experts in (7, 13, 60, 120):
        balanced = jnp.full((num_experts,), 5)
        for update in (routing.get_updated_expert_bias,
                       jax.jit(routing.get_updated_expert_bias)):  # XLA folds constants
            moved = update(balanced, jnp.zeros(num_experts), 1e-3)
            np.testing.assert_array_equal(np.asarray(moved), np.zeros(num_experts))
    # tp_dp_cp_group: the counts summed over that mesh axis first (Megatron's all-reduce);
    # each device's [2, 1] and [1, 2] sum to [3, 3]: balanced, no move
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    local = jnp.asarray([[2, 1], [1, 2]])
    sharded = jax.device_put(local, NamedSharding(mesh, P("data")))
    moved = jax.jit(jax.shard_map(
        lambda c: routing.get_updated_expert_bias(c[0], jnp.zeros(2), 0.1, "data")[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data")))(sharded)
    np.testing.assert_array_equal(np.asarray(moved), np.zeros((2, 2)))
    np.testing.assert_allclose(np.asarray(routing.get_updated_expert_bias(
        local[0], jnp.zeros(2), 0.1)), [-0.1, 0.1])  # without the group: this device's view


# ----------------------------------------------------------------- MoEConfig

def test_moe_config_has_megatrons_defaults_and_builds_the_dispatcher_config():
    c = MoEConfig(num_moe_experts=E)
    megatron = dict(moe_router_topk=2, moe_ffn_hidden_size=None,
                    moe_shared_expert_intermediate_size=None, moe_router_score_function="softmax",
                    moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None,
                    moe_router_num_groups=None, moe_router_group_topk=None,
                    moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
                    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                    moe_z_loss_coeff=None, moe_expert_capacity_factor=None,
                    moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs",
                    moe_router_dtype=None)
    for name, value in megatron.items():
        assert getattr(c, name) == value, name
    d = MoEConfig(num_moe_experts=16, moe_router_topk=4, moe_expert_capacity_factor=1.5,
                  moe_router_dtype="fp32", token_dispatcher=jax_ep.TokenDispatcherConfig(
                      moe_flex_dispatcher_backend="hybridep")).dispatcher_config()
    assert (d.num_moe_experts, d.moe_router_topk, d.moe_expert_capacity_factor,
            d.moe_router_dtype, d.backend) == (16, 4, 1.5, "fp32", "hybridep")


def test_topk_above_the_experts_builds_and_fails_when_called():
    # Megatron's test_te_moe_layer builds a layer of one expert with top-2; it cannot route
    c = MoEConfig(num_moe_experts=1, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                  moe_ffn_hidden_size=128)
    layer = MoELayer(c, 12, rngs=nnx.Rngs(0), expert_parallel_size=1)
    assert layer.w_gate_up.shape == (1, 12, 256)
    with pytest.raises(ValueError,
                       match="MoEConfig.moe_router_topk: top-k 2 exceeds num_moe_experts 1"):
        layer(jnp.zeros((2, 3, 12)))


def test_moe_config_from_dict_names_unknown_fields_or_warns():
    pasted = dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                  moe_flex_dispatcher_backend="alltoall", moe_grouped_gemm=True,
                  hidden_dropout=0.1, moe_not_a_field=True)
    unknown = r"\['hidden_dropout', 'moe_not_a_field'\]"
    with pytest.raises(ValueError, match=unknown):
        MoEConfig.from_dict(pasted)
    with pytest.warns(UserWarning, match=unknown):
        c = MoEConfig.from_dict(pasted, ignore_unknown=True)
    assert c.moe_aux_loss_coeff == 1e-2 and c.token_dispatcher.backend == "alltoall"
    assert c.dispatcher_config().num_moe_experts == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoEConfig.from_dict(dict(num_moe_experts=8))


def test_moe_config_from_dict_reads_megatrons_implementation_fields():
    # Megatron's unit-test configs set these: each is read into jax_ep's field of the same
    # effect, or accepted without one (a kernel choice).
    base = dict(num_moe_experts=8, moe_router_topk=2, moe_grouped_gemm=True,
                moe_router_fusion=True, expert_model_parallel_size=4, ffn_hidden_size=48)
    c = MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="alltoall",
                                 moe_router_padding_for_fp8=True))
    assert c.token_dispatcher.backend == "alltoall" and c.moe_ffn_hidden_size == 48
    assert c.dispatcher_config().moe_router_expert_pad_multiple == 16
    c = MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="allgather",
                                 moe_router_padding_for_quantization=True, fp8_recipe="mxfp8",
                                 moe_ffn_hidden_size=24))
    assert c.token_dispatcher.backend == "alltoall" and c.moe_ffn_hidden_size == 24
    assert c.token_dispatcher.moe_router_expert_pad_multiple == 32
    c = MoEConfig.from_dict(dict(base, moe_router_padding_for_quantization=True, fp4="nvfp4"))
    assert c.token_dispatcher.moe_router_expert_pad_multiple == 32
    # a whole pasted config holds both keys (fp4 None): both are read, neither is "unknown"
    for recipe, fp4, multiple in (("mxfp8", None, 32), ("delayed", None, 16),
                                  ("mxfp8", "nvfp4", 32)):
        c = MoEConfig.from_dict(dict(base, moe_router_padding_for_quantization=True,
                                     fp8="hybrid", fp8_recipe=recipe, fp4=fp4))
        assert c.token_dispatcher.moe_router_expert_pad_multiple == multiple
    c = MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="flex",
                                 moe_flex_dispatcher_backend="hybridep",
                                 moe_permute_fusion_into_hybridep=True))
    assert c.token_dispatcher.backend == "hybridep"
    assert c.token_dispatcher.moe_hybridep_permute_fusion is True
    c = MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="flex",
                                 moe_router_padding_for_fp8=False))
    assert c.token_dispatcher.backend == "deepep"
    assert c.token_dispatcher.moe_router_expert_pad_multiple is None
    with pytest.raises(ValueError, match="MoEConfig.moe_token_dispatcher_type: expected one of"):
        MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="ncclep"))
    # Megatron's deprecated moe_enable_deepep: flex only, not with hybridep; picks deepep
    c = MoEConfig.from_dict(dict(base, moe_token_dispatcher_type="flex", moe_enable_deepep=True,
                                 moe_flex_dispatcher_backend="uccl_ep"))
    assert c.token_dispatcher.backend == "deepep"
    for kind, backend in (("alltoall", "deepep"), ("flex", "hybridep")):
        with pytest.raises(ValueError, match="MoEConfig.moe_enable_deepep: expected False with"):
            MoEConfig.from_dict(dict(base, moe_token_dispatcher_type=kind, moe_enable_deepep=True,
                                     moe_flex_dispatcher_backend=backend))
    # Megatron's deprecated per-backend SM counts, None unless set (a pasted vars() has them)
    unset = MoEConfig.from_dict(dict(base, moe_deepep_num_sms=None, moe_hybridep_num_sms=None))
    assert unset == MoEConfig.from_dict(base)
    assert (unset.token_dispatcher.moe_deepep_num_sms,
            unset.token_dispatcher.moe_hybridep_num_sms) == (20, 24)
    assert MoEConfig.from_dict(dict(base, moe_deepep_num_sms=32)
                               ).token_dispatcher.moe_deepep_num_sms == 32
    # Megatron's expert_tensor_parallel_size None (its default): tensor_model_parallel_size,
    # else 1; ETP given wins over TP
    assert MoEConfig.from_dict(dict(base, expert_tensor_parallel_size=None)
                               ) == MoEConfig.from_dict(base)
    for fields, etp in ((dict(expert_tensor_parallel_size=None), 1),
                        (dict(expert_tensor_parallel_size=None, tensor_model_parallel_size=2), 2),
                        (dict(tensor_model_parallel_size=4), 4),
                        (dict(expert_tensor_parallel_size=1, tensor_model_parallel_size=4), 1)):
        c = MoEConfig.from_dict(dict(base, moe_ffn_hidden_size=64, **fields))
        assert c.expert_tensor_parallel_size == etp, fields
    with pytest.raises(ValueError, match="MoEConfig.tensor_model_parallel_size: expected"):
        MoEConfig.from_dict(dict(base, tensor_model_parallel_size="2"))
    # every other Megatron MoE field: a kernel / schedule / memory choice, accepted
    inert = dict(moe_layer_recompute=True, moe_shared_expert_overlap=True,
                 moe_per_layer_logging=True, moe_flex_dispatcher_num_sms=24,
                 moe_single_grouped_weight=True, moe_single_grouped_bias=True,
                 moe_use_grouped_tensor=True, moe_paged_stash=True,
                 moe_paged_stash_buffer_size_factor_cpu=1.5,
                 moe_paged_stash_buffer_size_factor_cuda=1.1, moe_paged_stash_page_size=64,
                 moe_pad_experts_for_cuda_graph_inference=True, moe_ncclep_zero_copy=True,
                 moe_hybridep_pad_uneven_dispatch_inputs=True, moe_layer_freq=2)
    assert MoEConfig.from_dict(dict(base, **inert)) == MoEConfig.from_dict(base)
    # ... or read into jax_ep's field of the same effect
    c = MoEConfig.from_dict(dict(base, moe_router_topk_limited_devices=2))
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (4, 2)  # EP groups
    with pytest.raises(ValueError, match="MoEConfig.moe_router_topk_limited_devices"):
        MoEConfig.from_dict(dict(base, moe_router_topk_limited_devices=2,
                                 moe_router_num_groups=4, moe_router_group_topk=2))
    hybrid = dict(base, moe_flex_dispatcher_backend="hybridep", moe_expert_rank_capacity_factor=1.5)
    assert MoEConfig.from_dict(hybrid).token_dispatcher.ragged_buffer_factor == 1.5
    assert MoEConfig.from_dict(dict(hybrid, moe_flex_dispatcher_backend="deepep")
                               ).token_dispatcher.ragged_buffer_factor is None
    # ... or at Megatron's default only, refused otherwise with the reason
    defaults = dict(moe_enable_routing_replay=False, moe_token_dropping=False,
                    moe_mlp_glu_interleave_size=None,
                    moe_shared_expert_glu_interleave_size=None, moe_latent_size=None,
                    moe_dispatch_fwd_dtype="bf16", moe_combine_bwd_dtype="bf16")
    assert MoEConfig.from_dict(dict(base, **defaults)) == MoEConfig.from_dict(base)
    for name, value in dict(moe_enable_routing_replay=True, moe_token_dropping=True,
                            moe_shared_expert_glu_interleave_size=32,
                            moe_dispatch_fwd_dtype="mxfp8").items():
        with pytest.raises(ValueError, match=f"MoEConfig.{name}: expected"):
            MoEConfig.from_dict(dict(base, **{name: value}))
    layer = MoELayer(MoEConfig.from_dict(dict(base, moe_router_padding_for_fp8=True)), H,
                     rngs=nnx.Rngs(0), mesh=_mesh())
    assert layer.w_down.shape == (E, 48, H)
    assert layer.dispatcher.config.moe_router_expert_pad_multiple == 16


@pytest.mark.parametrize("field,value", [
    ("num_moe_experts", None), ("moe_router_topk", 0), ("moe_router_score_function", "relu"),
    ("moe_router_load_balancing_type", "switch"), ("moe_token_drop_policy", "random"),
    ("moe_router_topk_scaling_factor", -1.0), ("moe_aux_loss_coeff", -1.0),
    ("moe_z_loss_coeff", float("nan")), ("moe_expert_capacity_factor", 0.0),
    ("moe_pad_expert_input_to_capacity", True), ("moe_router_dtype", "bf16"),
    ("moe_router_enable_expert_bias", True), ("moe_router_pre_softmax", 1),
    ("moe_router_group_topk", 2), ("token_dispatcher", dict()),
    # moe_router_num_groups alone is accepted without effect (Megatron's rule), but checked
    ("moe_router_num_groups", -1), ("moe_router_num_groups", 1.5),
    ("moe_router_num_groups", "x"), ("moe_router_num_groups", float("nan"))])
def test_moe_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MoEConfig(**dict(dict(num_moe_experts=E), **{field: value}))


@pytest.mark.parametrize("groups,top", [(3, 1), (4, 3), (4, 5), (8, 1), (None, 2)])
def test_moe_config_checks_the_groups(groups, top):
    # 8 experts, top-2: 3 does not divide 8; 3 > K (its groups would score K // 3 = 0
    # experts); 5 > 4 groups; 1 group of 1 expert holds fewer than K experts; group_topk
    # without num_groups.
    with pytest.raises(ValueError, match="moe_router_(num_groups|group_topk)"):
        _cfg(moe_router_num_groups=groups, moe_router_group_topk=top)


def test_group_topk_need_not_divide_topk():
    # Megatron's TestGroupLimitedRouter: K = 4 over 8 groups of 2, 3 groups kept; a group
    # scores its top K // 3 = 1 expert. Token 0's best single experts are in groups 0, 1 and 5;
    # group 7's pair sums higher but its best expert is lower.
    c = MoEConfig(num_moe_experts=16, moe_router_topk=4, moe_router_num_groups=8,
                  moe_router_group_topk=3, moe_router_score_function="sigmoid")
    row = np.full((1, 16), -4.0)
    row[0, [0, 1, 2, 10, 14, 15]] = [3.0, 2.0, 2.5, 2.8, 1.9, 1.9]
    probs, ids = routing.route(jnp.asarray(row, jnp.float32), c)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1, 2, 10]
    want, top = np_route(row, c)
    np.testing.assert_allclose(np.asarray(probs)[0], want[0, np.asarray(ids)[0]], rtol=1e-6)
    assert top[0, np.asarray(ids)[0]].all()
    with pytest.raises(ValueError, match="num_tokens=2"):
        routing.group_limited_topk(jnp.zeros((1, 16)), 4, 2, 16, 8, 3)


@pytest.mark.parametrize("topk, kwargs, match", [
    (2, dict(num_groups=3, group_topk=1), "^num_groups: expected a divisor of num_experts 8"),
    (2, dict(num_groups=None, group_topk=2), "^num_groups: expected a divisor"),
    (2, dict(num_groups=4, group_topk=5), r"^group_topk: expected an int in \[1, num_groups=4"),
    (3, dict(num_groups=4, group_topk=1), "^topk: top-k 3 exceeds the experts of the "
                                          "group_topk groups 2"),
    (9, dict(), "^topk: top-k 9 exceeds num_experts 8")])
def test_functional_router_names_bad_arguments(topk, kwargs, match):
    """Megatron's functional router API (MoEConfig checks the same for the layer): a reshape
    TypeError or an unnamed lax.top_k error before."""
    with pytest.raises(ValueError, match=match):
        routing.topk_routing_with_score_function(jnp.zeros((4, 8)), topk, **kwargs)
    if not kwargs:
        with pytest.raises(ValueError, match="^total_num_tokens: expected a count > 0, got 0"):
            routing.switch_load_balancing_loss_func(jnp.ones((4, 8)), jnp.ones(8), 0, 2, 8, 0.1)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("use_pre_softmax", [True, False])
@pytest.mark.parametrize("topk", [1, 2])
def test_topk_routing_with_score_function_as_megatrons(score_function, use_pre_softmax, topk):
    # Megatron's test_topk_routing_precomputed_indices_equivalence, and the sparse results
    # against the float64 model.
    if score_function != "softmax" and use_pre_softmax:
        pytest.skip("pre_softmax only applies to softmax scoring")
    logits = jnp.asarray(np.random.default_rng(123).normal(size=(64, 8)), jnp.float32)
    kwargs = dict(use_pre_softmax=use_pre_softmax, score_function=score_function, fused=False)
    probs_ref, map_ref = routing.topk_routing_with_score_function(logits, topk, **kwargs)
    _, top = routing.topk_routing_with_score_function(logits, topk, dense_output=True, **kwargs)
    probs_pre, map_pre = routing.topk_routing_with_score_function(
        logits, topk, precomputed_indices=top, **kwargs)
    np.testing.assert_array_equal(np.asarray(map_ref), np.asarray(map_pre))
    np.testing.assert_allclose(np.asarray(probs_ref), np.asarray(probs_pre), rtol=1e-6)
    alt = jax.lax.top_k(-logits, topk)[1]  # bottom-k: disjoint from the top-k
    _, map_alt = routing.topk_routing_with_score_function(logits, topk,
                                                          precomputed_indices=alt, **kwargs)
    want_alt = np.zeros((64, 8), bool)
    np.put_along_axis(want_alt, np.asarray(alt), True, axis=1)
    np.testing.assert_array_equal(np.asarray(map_alt), want_alt)
    c = MoEConfig(num_moe_experts=8, moe_router_topk=topk, moe_router_score_function=score_function,
                  moe_router_pre_softmax=use_pre_softmax or (topk == 1
                                                             and score_function == "softmax"))
    if c.moe_router_pre_softmax == use_pre_softmax:
        want_probs, want_map = np_route(np.asarray(logits, np.float64), c)
        np.testing.assert_array_equal(np.asarray(map_ref), want_map)
        np.testing.assert_allclose(np.asarray(probs_ref), want_probs, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="router_replay"):
        routing.topk_routing_with_score_function(logits, topk, router_replay=object())
    with pytest.raises(ValueError, match="score_function"):
        routing.topk_routing_with_score_function(logits, topk, score_function="relu")


def _megatron_scores_f64(logits, score_function):
    """Megatron's unnormalised scores, float64 (no underflow at these logits)."""
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jnp.log1p(jnp.exp(logits)))


@pytest.mark.parametrize("score_function, pre", [("softmax", False), ("softmax", True),
                                                 ("sigmoid", False), ("sqrtsoftplus", False)])
def test_float64_logits_are_scored_in_float32_as_megatron(score_function, pre):
    """Megatron's precision rule: the scores of any logits (float64 included) in fp32, the
    probs cast back to the logits' dtype: float64 logits give the float32 logits' probs."""
    logits = np.asarray(jax.random.normal(jax.random.key(5), (12, 8)), np.float64) * 3
    bias = np.linspace(-0.1, 0.1, 8)
    kw = dict(score_function=score_function, use_pre_softmax=pre, scaling_factor=2.5,
              expert_bias=None if score_function == "softmax" else bias, dense_output=True)
    want_probs, want_ids = routing.topk_routing_with_score_function(
        jnp.asarray(logits, jnp.float32), 3, **kw)
    with jax.enable_x64(True):
        probs, ids = routing.topk_routing_with_score_function(jnp.asarray(logits), 3, **kw)
        assert probs.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_array_equal(np.asarray(probs),
                                      np.asarray(want_probs).astype(np.float64))


@pytest.mark.parametrize("score_function, low", [("sigmoid", -45.0), ("sigmoid", -60.0),
                                                 ("sqrtsoftplus", -90.0),
                                                 ("sqrtsoftplus", -150.0)])
def test_router_gradients_stay_finite_for_very_negative_logits(score_function, low):
    """A token whose top-k logits are all very negative: the renormalised probs' gradient is
    Megatron's float64 one (it was -inf: JAX's quotient rule squares a row sum of ~5e-20), at
    first and second order, and sqrt(softplus) keeps a finite slope where float32 softplus
    underflows (it was NaN)."""
    logits = jnp.array([[low, low - 1, low - 2, low - 3], [1.0, 0.5, -0.5, 0.0]], jnp.float32)
    cot = jnp.array([[1.0, 2.0], [0.5, -1.0]], jnp.float32)

    def loss(logits):
        probs, _ = routing.topk_routing_with_score_function(
            logits, 2, score_function=score_function, dense_output=True)
        return jnp.sum(probs * cot)
    got = jax.grad(loss)(logits)
    v = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.3, 1.0, -1.0, 2.0]], jnp.float32)
    got_hvp = jax.jvp(jax.grad(loss), (logits,), (v,))[1]  # Hessian-vector product
    with jax.enable_x64(True):
        def loss64(logits):  # the top 2 are columns 0 and 1 in both rows
            top = _megatron_scores_f64(logits, score_function)[:, :2]
            return jnp.sum(top / (top.sum(axis=-1, keepdims=True) + 1e-20) * cot)
        logits64 = jnp.asarray(logits, jnp.float64)
        want = np.asarray(jax.grad(loss64)(logits64))
        want_hvp = np.asarray(jax.jvp(jax.grad(loss64), (logits64,),
                                      (jnp.asarray(v, jnp.float64),))[1])
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)
    # second order too (the quotient rule's squared row sum overflowed there: NaN)
    np.testing.assert_allclose(np.asarray(got_hvp), want_hvp, rtol=1e-4,
                               atol=1e-6 * np.abs(want_hvp).max())
    # the aux-loss scores over all E: one very negative logit in a batch
    aux_logits = logits.at[1, 3].set(low)
    aux = jax.grad(lambda l: routing.compute_routing_scores_for_aux_loss(
        l, 2, score_function)[1][:, 0].sum())(aux_logits)
    assert np.isfinite(np.asarray(aux)).all()
    # logits low enough that float32 scores underflow to 0 (a whole row): finite gradients,
    # the old quotient rule's 0 * inf gave NaN even for a zero cotangent
    zero_row = logits.at[0].set(low * 2 - 100)
    assert np.isfinite(np.asarray(jax.grad(loss)(zero_row))).all()
    assert np.isfinite(np.asarray(jax.jvp(jax.grad(loss), (zero_row,), (v,))[1])).all()
    # the scores' second derivative too (the slope divided by a flushed score before)
    second = jax.grad(jax.grad(lambda v: routing._unnormalised_scores(v, score_function)))
    assert np.isfinite(float(second(jnp.float32(low))))


def test_router_gating_linear_is_megatrons():
    rng = np.random.default_rng(0)
    x, w, b = (rng.normal(size=shape) for shape in ((2, 3, 16), (8, 16), (8,)))
    got = routing.router_gating_linear(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                                       jnp.asarray(b, jnp.bfloat16), jnp.float32)
    xb, wb, bb = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, w, b))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 8)
    np.testing.assert_allclose(np.asarray(got), xb @ wb.T + bb, rtol=1e-5, atol=1e-5)
    assert routing.router_gating_linear(jnp.asarray(x), jnp.asarray(w), None,
                                        jnp.float32).shape == (2, 3, 8)


def test_moe_config_follows_megatrons_normalisations():
    # negative capacity factor: dropless; scaling factor 0: no scaling; num_groups alone and
    # pre-softmax with sigmoid scores: accepted and without effect; top-1 softmax needs
    # pre-softmax (a softmax over one logit is 1).
    assert _cfg(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(6, E)), jnp.float32)
    plain = routing.route(logits, _cfg(moe_router_score_function="sigmoid"))
    for fields in (dict(moe_router_topk_scaling_factor=0.0), dict(moe_router_num_groups=4),
                   dict(moe_router_pre_softmax=True)):
        got = routing.route(logits, _cfg(moe_router_score_function="sigmoid", **fields))
        for a, b in zip(got, plain):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="moe_router_pre_softmax"):
        MoEConfig(num_moe_experts=E, moe_router_topk=1)
    MoEConfig(num_moe_experts=E, moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")


def test_scores_are_float32_for_bf16_logits():
    # Megatron computes the scores in float32 and casts only the probs back: an expert bias
    # below bf16's spacing near 0.5 still decides, and near-equal bf16 logits keep their order.
    c = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True)
    _, ids = routing.route(jnp.zeros((1, 4), jnp.bfloat16), c,
                           jnp.asarray([0.0, 0.0, 1e-3, 1e-3], jnp.float32))
    assert sorted(np.asarray(ids)[0].tolist()) == [2, 3]
    c1 = MoEConfig(num_moe_experts=4, moe_router_topk=1, moe_router_score_function="sigmoid")
    probs, ids = routing.route(jnp.asarray([[3.0, 3.03125, -5.0, -5.0]], jnp.bfloat16), c1)
    assert np.asarray(ids)[0, 0] == 1 and probs.dtype == jnp.bfloat16
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, E)).astype(np.float32)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    for fields in (dict(), dict(moe_router_pre_softmax=True),
                   dict(moe_router_score_function="sqrtsoftplus")):
        c = _cfg(**fields)
        probs, ids = routing.route(bf16, c)
        want, _ = np_route(np.asarray(bf16.astype(jnp.float32), np.float64), c)
        got = np.take_along_axis(want, np.asarray(ids), 1)
        # the float64 model's probs rounded once to bf16, as Megatron's final cast
        np.testing.assert_array_equal(np.asarray(probs, np.float32),
                                      np.asarray(jnp.asarray(got, jnp.float32)
                                                 .astype(jnp.bfloat16), np.float32))


# ----------------------------------------------------------------- the layer on a 2 x 4 mesh

def _mesh():
    return jax.make_mesh((2, 4), ("data", "expert"))


def _layer(c, mesh):
    """A sharded layer and its unsharded twin; an expert bias is set to one that changes the
    routing."""
    layer, twin = (MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh) for _ in range(2))
    if c.moe_router_enable_expert_bias:
        for m in (layer, twin):
            m.expert_bias[...] = jnp.asarray(np.linspace(-0.3, 0.3, E), jnp.float32)
    shard_params(layer, mesh)
    return layer, twin


LAYER_CASES = {
    "aux_z": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "seq_pre_softmax_position": dict(moe_router_load_balancing_type="seq_aux_loss",
                                     moe_aux_loss_coeff=0.1, moe_router_pre_softmax=True,
                                     moe_expert_capacity_factor=0.5,
                                     moe_token_drop_policy="position"),
    "global_sigmoid_bias_groups": dict(moe_router_load_balancing_type="global_aux_loss",
                                       moe_aux_loss_coeff=0.1,
                                       moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True,
                                       moe_router_num_groups=4, moe_router_group_topk=1,
                                       moe_router_topk_scaling_factor=2.0,
                                       moe_shared_expert_intermediate_size=8),
    "aux_sqrtsoftplus_bias": dict(moe_aux_loss_coeff=0.1, moe_router_score_function="sqrtsoftplus",
                                  moe_router_enable_expert_bias=True),
    "none_probs_drop": dict(moe_router_load_balancing_type="none",
                            moe_expert_capacity_factor=0.5, moe_z_loss_coeff=1e-2),
    "list_of_three": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss",
                                                          "global_aux_loss", "none"],
                          moe_aux_loss_coeff=[1e-2, 0.1, 0.05, 0.3],
                          moe_router_score_function="sigmoid"),
    "list_coeff_zero_sinkhorn": dict(moe_router_load_balancing_type=["seq_aux_loss", "aux_loss",
                                                                     "sinkhorn"],
                                     moe_aux_loss_coeff=[0.1, 0.0, 0.2]),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3,
                     moe_shared_expert_intermediate_size=8),
}


def test_apply_random_logits_is_a_straight_through_draw():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, E)), jnp.float32)
    key = jax.random.key(3)
    out, vjp = jax.vjp(lambda l: routing.apply_random_logits(l, key), logits)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.random.normal(key, (5, E))))
    cot = jnp.arange(5 * E, dtype=jnp.float32).reshape(5, E)
    np.testing.assert_array_equal(np.asarray(vjp(cot)[0]), np.asarray(cot))
    assert routing.apply_random_logits(logits.astype(jnp.bfloat16), key).dtype == jnp.bfloat16


def _layer_matching_dense(c, mesh):
    """A layer of config c and its twin (`_layer`) on x [16, 3, H]: one training call of each
    (the layer under jit on mesh, the twin's dense_forward), their losses and parameter
    gradients asserted equal. Returns (layer, twin, x, the layer's gradients)."""
    layer, twin = _layer(c, mesh)
    x = jax.random.normal(jax.random.key(1), (16, 3, H))
    got, _, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=3e-5, atol=3e-6)
    return layer, twin, x, grads


def test_force_load_balancing_routes_by_random_logits():
    # Megatron's moe_router_force_load_balancing: the routing ignores the router weights (a
    # router scaled by 100 routes the same), draws anew per call and device, and the router
    # still gets a gradient (straight through); the dense oracle draws the same logits
    c = _cfg(moe_router_force_load_balancing=True, moe_aux_loss_coeff=1e-2,
             moe_z_loss_coeff=1e-3)
    mesh = _mesh()
    layer, twin, x, grads = _layer_matching_dense(c, mesh)
    assert float(jnp.linalg.norm(grads["router"][...])) > 0
    start = int(twin.force_balance_step[...])  # the twin's: same seed, same start
    assert int(layer.force_balance_step[...]) == start + 1
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))

    def counts(m):
        with jax.set_mesh(mesh):
            return np.asarray(nnx.jit(lambda m, x: m(x)[1]["tokens_per_expert"])(m, xs))
    plain = _layer(_cfg(moe_aux_loss_coeff=1e-2), mesh)[0]
    scaled = _layer(c, mesh)[0]
    scaled.router[...] = scaled.router[...] * 100
    first, again, plain_counts = counts(twin), counts(twin), counts(plain)
    np.testing.assert_array_equal(counts(scaled), first)  # the weights do not route
    assert (first != again).any() and (first != plain_counts).any()
    assert int(twin.force_balance_step[...]) == start + 2
    assert first.sum() == again.sum() == 16 * 3 * K
    other = MoELayer(c, H, 32, rngs=nnx.Rngs(1), mesh=mesh)  # another layer draws differently
    assert int(other.force_balance_step[...]) != start
    with pytest.raises(ValueError, match="moe_router_force_load_balancing"):
        _cfg(moe_router_force_load_balancing=1)


@pytest.mark.parametrize("std", [2.0, -2.0])
def test_force_biased_routes_by_random_logits_plus_a_shared_bias(std):
    # Megatron's moe_router_force_biased: force balancing's random logits plus a normal(0,
    # |std|) bias per expert that every device shares: a new one per call for std > 0
    # (force_biased_key of the call's counter), one per layer for std < 0 (ForcedBias). The
    # layer equals the dense oracle and the router gets its straight-through gradient
    c = _cfg(moe_router_force_biased=std, moe_aux_loss_coeff=1e-2)
    mesh = _mesh()
    layer, twin, x, grads = _layer_matching_dense(c, mesh)
    assert float(jnp.linalg.norm(grads["router"][...])) > 0
    assert (layer.forced_bias is None) == (std > 0)
    # With |std| = 1000 the bias outweighs the N(0, 1) logits: every token on every device
    # takes the top K experts of the call's bias
    big = _cfg(moe_router_force_biased=1000.0 if std > 0 else -1000.0)
    model = _layer(big, mesh)[0]
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    step = jax.jit(lambda state, x: nnx.merge(nnx.graphdef(model), state)(x)[1][
        "tokens_per_expert"])
    seen = []
    for _ in range(3):
        counter = int(model.force_balance_step[...])
        bias = 1000.0 * np.asarray(model.forced_bias[...] if std < 0 else
                                   jax.random.normal(moe.force_biased_key(counter), (E,)))
        want = np.zeros(E, np.int64)
        want[np.argsort(-bias)[:K]] = 16 * 3
        with jax.set_mesh(mesh):
            got = np.asarray(step(nnx.state(model), xs))
        np.testing.assert_array_equal(got, want)
        model.force_balance_step[...] += 1  # what a call through nnx.jit would do
        seen.append(tuple(np.flatnonzero(got)))
    assert (len(set(seen)) == 1) == (std < 0)  # per call (these draws differ) or per layer
    bias_of = [np.asarray(m.forced_bias[...]) for m in (_layer(big, mesh)[0], MoELayer(
        big, H, 32, rngs=nnx.Rngs(1), mesh=mesh))] if std < 0 else None
    if bias_of:  # a standard normal drawn at init from the params stream: another seed,
        # another draw
        assert abs(np.std(bias_of[0]) - 1.0) < 0.6 and (bias_of[0] != bias_of[1]).all()
    with pytest.raises(ValueError, match="moe_router_force_biased"):
        _cfg(moe_router_force_biased=float("nan"))
    with pytest.raises(ValueError, match="moe_router_force_biased"):
        _cfg(moe_router_force_biased=True)


def test_force_biased_logits_ignore_the_router_and_std_zero_is_force_balancing():
    # apply_biased_logits: standard normal logits of the key plus the bias, the gradient
    # straight through to the logits
    logits = jax.random.normal(jax.random.key(5), (6, E)) * 3
    key, bias = jax.random.key(6), jnp.linspace(-1.0, 1.0, E)
    got, grad = jax.value_and_grad(lambda l: routing.apply_biased_logits(l, key, bias).sum())(
        logits)
    np.testing.assert_allclose(
        routing.apply_biased_logits(logits, key, bias),
        jax.random.normal(key, logits.shape) + bias, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(grad, np.ones(logits.shape))
    np.testing.assert_array_equal(  # the bias is a draw: no gradient (Megatron's None)
        jax.grad(lambda b: routing.apply_biased_logits(logits, key, b).sum())(bias), 0.0)
    # in the layer the routing ignores the router weights (scaled by 100: the same counts),
    # in training and in eval (deterministic) calls, and std 0 routes as force balancing
    mesh = _mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 3, H)),
                       NamedSharding(mesh, P(("data", "expert"))))

    def counts(c, scale=1.0, deterministic=False):
        m = _layer(c, mesh)[0]
        m.router[...] = m.router[...] * scale
        m.deterministic = deterministic
        with jax.set_mesh(mesh):
            return np.asarray(nnx.jit(lambda m, x: m(x)[1]["tokens_per_expert"])(m, x))
    for std in (0.5, -0.5):
        c = _cfg(moe_router_force_biased=std)
        for deterministic in (False, True):
            np.testing.assert_array_equal(counts(c, 100.0, deterministic),
                                          counts(c, 1.0, deterministic))
        assert (counts(c) != counts(_cfg())).any()
    np.testing.assert_array_equal(counts(_cfg(moe_router_force_biased=0.0)),
                                  counts(_cfg(moe_router_force_load_balancing=True)))


_DRAWS = {"force_balance": dict(moe_router_force_load_balancing=True),
          "force_biased_per_call": dict(moe_router_force_biased=2.0),
          "force_biased_per_layer": dict(moe_router_force_biased=-2.0),
          "jitter": dict(moe_input_jitter_eps=0.1)}


def _drawn_logits(router, plain, x, step, device):
    """What Megatron's TopKRouter.forward routes for `router`'s config: x [T,H] jittered
    (moe_input_jitter_eps, training only), gated by `plain` (the same weights, no draws), the
    logits replaced by force balancing's random ones (plus the forced bias), from the keys of
    draw counter value `step` on token device `device`."""
    c = router.config
    if c.moe_input_jitter_eps is not None and not router.deterministic:
        eps = c.moe_input_jitter_eps
        x = x * jax.random.uniform(moe.input_jitter_key(step, device), x.shape, x.dtype,
                                   1.0 - eps, 1.0 + eps)
    logits = plain.gating(x)
    std = c.moe_router_force_biased
    key = moe.force_balance_key(step, device)
    if std is not None:
        bias = abs(std) * (router.forced_bias[...] if std < 0 else
                           jax.random.normal(moe.force_biased_key(step), (E,), jnp.float32))
        return routing.apply_biased_logits(logits, key, bias)
    if c.moe_router_force_load_balancing:
        return routing.apply_random_logits(logits, key)
    return logits


@pytest.mark.parametrize("draw", sorted(_DRAWS))
def test_topk_router_draws_as_megatron_forward(draw):
    """TopKRouter applies moe_input_jitter_eps, moe_router_force_load_balancing and
    moe_router_force_biased in __call__ as Megatron's TopKRouter.forward does (jitter, gate,
    random logits plus the forced bias, route; `routing` alone applies none): probs, map and
    the router's gradient equal the router without them routing the logits written from the
    keys (device 0 outside shard_map, the token device's index inside), a new draw per call
    (the counter advances by one), the jitter in training calls only."""
    c = _cfg(moe_aux_loss_coeff=1e-2, **_DRAWS[draw])
    router = jax_ep.flax.TopKRouter(c, H, rngs=nnx.Rngs(3))
    plain = jax_ep.flax.TopKRouter(_cfg(moe_aux_loss_coeff=1e-2), H, rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(router.weight[...], plain.weight[...])
    counter = router.input_jitter_step if draw == "jitter" else router.force_balance_step
    assert (router.forced_bias is not None) == (draw == "force_biased_per_layer")
    x = jax.random.normal(jax.random.key(1), (4, 6, H))
    tokens = x.reshape(-1, H)
    w = jax.random.normal(jax.random.key(2), (24, E))

    def loss(m, x):
        probs, routing_map = m(x)
        return (probs * w).sum(), routing_map

    def want_loss(m, step):
        probs, routing_map = m.routing(_drawn_logits(router, m, tokens, step, 0), None, 6)
        return (probs * w).sum(), routing_map

    seen = []
    for call in range(2):
        step = int(counter[...])
        (got, got_map), grads = nnx.value_and_grad(loss, has_aux=True)(router, x)
        (want, want_map), want_grads = nnx.value_and_grad(want_loss, has_aux=True)(plain, step)
        assert int(counter[...]) == step + 1
        np.testing.assert_array_equal(got_map, want_map)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        np.testing.assert_allclose(grads.weight[...], want_grads.weight[...], rtol=1e-4,
                                   atol=1e-6)
        assert float(jnp.linalg.norm(grads.weight[...])) > 0  # straight through
        seen.append(float(got))
    assert seen[0] != seen[1]  # a new draw per call
    plain_probs = plain(x)[0]
    router_probs = router(x)[0]
    assert not np.allclose(router_probs, plain_probs)
    np.testing.assert_array_equal(router.routing(plain.gating(tokens))[0],  # routing: no draws
                                  plain.routing(plain.gating(tokens))[0])
    router.deterministic = plain.deterministic = True  # eval: jitter off, the rest on
    step = int(counter[...])
    np.testing.assert_allclose(router(x)[0], plain.routing(
        _drawn_logits(router, plain, tokens, step, 0))[0], rtol=1e-6)
    if draw == "jitter":
        np.testing.assert_allclose(router(x)[0], plain(x)[0], rtol=1e-6)

    # inside shard_map: each token device draws with its index over the axes x varies over
    router.deterministic = plain.deterministic = False
    mesh = _mesh()
    graphdef, state = nnx.split(router)

    def body(state, x):
        return nnx.merge(graphdef, state)(x)
    step = int(counter[...])
    xs = jax.random.normal(jax.random.key(4), (8 * 3, H))
    want = [plain.routing(_drawn_logits(router, plain, block, step, d))[0]
            for d, block in enumerate(xs.reshape(8, 3, H))]
    for check_vma in (True, False):  # the index does not rest on the varying-axes types
        sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(("data", "expert"))),
                                        out_specs=P(("data", "expert")), check_vma=check_vma))
        got = sharded(jax.device_put(state, NamedSharding(mesh, P())),
                      jax.device_put(xs, NamedSharding(mesh, P(("data", "expert")))))[0]
        np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-6)


def test_draws_follow_a_swapped_config():
    """A config swapped after construction: a draw whose state the router was not built with
    is a ValueError naming the field (never a silent no-op); a draw switched off routes as
    the plain router does."""
    x = jax.random.normal(jax.random.key(1), (4, 6, H))
    for built, swapped, field in (
            (_cfg(), _cfg(moe_router_force_load_balancing=True),
             "moe_router_force_load_balancing"),
            (_cfg(moe_router_force_biased=1.0), _cfg(moe_router_force_biased=-1.0),
             "moe_router_force_biased"),
            (_cfg(), _cfg(moe_input_jitter_eps=0.1), "moe_input_jitter_eps")):
        router = jax_ep.flax.TopKRouter(built, H, rngs=nnx.Rngs(3))
        router.config = swapped
        with pytest.raises(ValueError, match=f"MoEConfig.{field}: this module was built "
                                             f"without it"):
            router(x)
    router = jax_ep.flax.TopKRouter(_cfg(moe_router_force_biased=-1.0), H, rngs=nnx.Rngs(3))
    z = np.asarray(router.forced_bias[...])  # the per-layer draw scales with the config's std
    np.testing.assert_allclose(router._draws()[2], z)
    router.config = _cfg(moe_router_force_biased=-1000.0)
    np.testing.assert_allclose(router._draws()[2], 1000.0 * z, rtol=1e-6)
    plain = jax_ep.flax.TopKRouter(_cfg(), H, rngs=nnx.Rngs(3))
    for draw in _DRAWS.values():
        router = jax_ep.flax.TopKRouter(_cfg(**draw), H, rngs=nnx.Rngs(3))
        router.config = _cfg()
        np.testing.assert_array_equal(router(x)[0], plain(x)[0])


def np_qb_dual_update(scores, k, beta):
    """Megatron's qb_dual_update in numpy float64: (top-k indices of scores - beta, the column
    quantile: for expert e the (T*k/E + 1)-th largest of scores[:, e] - alpha, alpha each
    token's (k+1)-th largest of scores - beta)."""
    scores, beta = np.asarray(scores, np.float64), np.asarray(beta, np.float64)
    shifted = scores - beta
    order = np.argsort(-shifted, axis=1, kind="stable")
    alpha = np.take_along_axis(shifted, order[:, k:k + 1], axis=1)
    target = scores.shape[0] * k // scores.shape[1]
    quantile = -np.sort(-(scores - alpha), axis=0)[target]
    return order[:, :k], quantile


def test_qb_dual_update_matches_megatrons_formula():
    rng = np.random.default_rng(21)
    for T, E, k in ((12, 6, 2), (16, 8, 1), (24, 8, 3)):
        scores = rng.standard_normal((T, E)).astype(np.float32)
        beta = (rng.standard_normal(E) * 0.3).astype(np.float32)
        ids, quantile = routing.qb_dual_update(jnp.asarray(scores), k, jnp.asarray(beta))
        want_ids, want_quantile = np_qb_dual_update(scores, k, beta)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(quantile), want_quantile, rtol=1e-6, atol=1e-6)
        # the quantile bias gives every expert its T*k/E share of the k-th choices
        shifted = scores - np.asarray(quantile)
        assert np.bincount(np.argsort(-shifted, axis=1)[:, :k].ravel(), minlength=E).max() \
            <= T * k // E + k
    same_ids, same_beta = routing.qb_dual_update(jnp.asarray(scores), 3, jnp.asarray(beta),
                                                 update_beta=False)
    assert same_beta is not None and np.array_equal(np.asarray(same_beta), beta)
    with pytest.raises(ValueError, match="divisible"):
        routing.qb_dual_update(jnp.zeros((5, 8)), 2, jnp.zeros(8))


def test_quantile_balancing_layer_routes_accumulates_and_updates():
    # Megatron's "quantile_balancing": the experts are the top-k of logits - qb_beta (the
    # dense oracle routes the same); a training call adds the devices' mean quantile to
    # qb_beta_accum and 1 to qb_beta_count, eval adds nothing; update_quantile_balancing
    # moves qb_beta by the EMA rule and re-centres it
    c = _cfg(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0,
             moe_router_score_function="sigmoid", moe_router_quantile_balancing_ema=0.25)
    mesh = _mesh()
    layer, twin = (MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh) for _ in range(2))
    beta = jnp.asarray(np.linspace(-0.5, 0.5, E), jnp.float32)
    for m in (layer, twin):
        m.qb_beta[...] = beta
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(1), (16, 4, H))  # 8 tokens a device: 8 * K % E == 0
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=3e-5, atol=3e-6)
    logits = np.asarray(x, np.float64).reshape(8, -1, H) @ np.asarray(twin.router[...])
    want_quantile = np.mean([np_qb_dual_update(block, K, beta)[1] for block in logits], axis=0)
    np.testing.assert_allclose(np.asarray(layer.qb_beta_accum[...]), want_quantile,
                               rtol=1e-5, atol=1e-5)
    assert float(layer.qb_beta_count[...]) == 1.0
    # the dense counts are the top-k of logits - beta on each device
    np_ids = np.concatenate([np_qb_dual_update(block, K, beta)[0] for block in logits])
    np.testing.assert_array_equal(np.asarray(aux["tokens_per_expert"]),
                                  np.bincount(np_ids.ravel(), minlength=E))
    layer.eval()
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    with jax.set_mesh(mesh):
        nnx.jit(lambda m, x: m(x)[0])(layer, xs)
    assert float(layer.qb_beta_count[...]) == 1.0
    layer.train()
    with jax.set_mesh(mesh):
        nnx.jit(lambda m: m.update_quantile_balancing())(layer)
    new = 0.25 * np.asarray(beta) + 0.75 * want_quantile
    np.testing.assert_allclose(np.asarray(layer.qb_beta[...]), new - new.mean(), rtol=1e-5,
                               atol=1e-6)
    assert float(layer.qb_beta_count[...]) == 0.0 and not np.asarray(layer.qb_beta_accum[...]).any()
    with pytest.raises(ValueError, match="padding_mask"):
        layer(x, padding_mask=jnp.zeros(x.shape[:2], bool))


@pytest.mark.parametrize("fields", [
    dict(moe_aux_loss_coeff=1e-2),
    dict(moe_router_num_groups=4, moe_router_group_topk=2),
    dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
    dict(moe_router_quantile_balancing_ema=1.5)])
def test_quantile_balancing_config_rules(fields):
    with pytest.raises(ValueError, match="MoEConfig.moe_"):
        _cfg(moe_router_load_balancing_type="quantile_balancing",
             **dict(dict(moe_aux_loss_coeff=0.0), **fields))


def test_quantile_balancing_only_as_a_plain_string():
    with pytest.raises(ValueError, match="moe_router_load_balancing_type"):
        _cfg(moe_router_load_balancing_type=["aux_loss", "quantile_balancing"],
             moe_aux_loss_coeff=[1e-2, 0.0])
    with pytest.raises(ValueError, match="update_quantile_balancing"):
        MoELayer(_cfg(), H, 32, rngs=nnx.Rngs(0), mesh=_mesh()).update_quantile_balancing()


def test_input_jitter_scales_the_router_input_in_training_only():
    # Megatron's moe_input_jitter_eps: the router's input times uniform [1 - eps, 1 + eps]
    # noise, a new draw per call and device; the dense oracle draws the same noise; eval
    # routes the plain input; the experts see the input unjittered
    c = _cfg(moe_input_jitter_eps=0.5, moe_aux_loss_coeff=1e-2)
    mesh = _mesh()
    layer, twin, x, _ = _layer_matching_dense(c, mesh)
    start = int(twin.input_jitter_step[...])
    assert int(layer.input_jitter_step[...]) == start + 1
    plain = _layer(_cfg(moe_aux_loss_coeff=1e-2), mesh)[1]  # the same weights, no jitter
    y_jitter, y_plain = (np.asarray(dense_forward(m, x)[0]) for m in (twin, plain))
    assert np.abs(y_jitter - y_plain).max() > 1e-3
    twin.eval()
    np.testing.assert_array_equal(np.asarray(dense_forward(twin, x)[0]), y_plain)
    # the noise: uniform in [0.5, 1.5], one draw per (token, channel)
    tokens = jnp.ones((4096, H))
    logits = moe._route(tokens, (jnp.eye(H, E), None), c, None, True, None,
                        moe.input_jitter_key(start, 3))[0]
    assert 0.5 <= float(logits.min()) and float(logits.max()) <= 1.5
    assert abs(float(logits.mean()) - 1.0) < 0.01 and float(logits.std()) > 0.25
    for bad in (-0.1, float("nan"), True):
        with pytest.raises(ValueError, match="moe_input_jitter_eps"):
            _cfg(moe_input_jitter_eps=bad)


@pytest.mark.parametrize("name", LAYER_CASES)
def test_layer_losses_statistics_and_gradients_match_megatron(name):
    c = _cfg(token_dispatcher=jax_ep.TokenDispatcherConfig(moe_permute_fusion=True),
             **LAYER_CASES[name])
    mesh = _mesh()
    layer, twin = _layer(c, mesh)
    x = jax.random.normal(jax.random.key(1), (16, 3, H))  # 8 devices x 2 sequences of 3
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    with jax.set_mesh(mesh):
        aux_grads = nnx.jit(nnx.grad(lambda m, x: m(x)[1]["aux_loss"]))(layer, xs)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=3e-5, atol=3e-6)
    # Against the numpy formulation: losses, counts, drops, and d aux_loss / d router.
    W = np.asarray(twin.router[...], np.float64)
    xf = np.asarray(x, np.float64).reshape(-1, H)
    bias = None if twin.expert_bias is None else np.asarray(twin.expert_bias[...], np.float64)

    def np_aux(W):
        losses, z = np_losses(xf @ W, c, 8, 3)
        total = sum(np_types(c)[k] * v for k, v in losses.items())
        return total + (c.moe_z_loss_coeff or 0.0) * z, losses, z

    total, losses, z = np_aux(W)
    assert sorted(aux["load_balancing_losses"]) == sorted(losses)
    for kind, value in losses.items():
        np.testing.assert_allclose(float(aux["load_balancing_losses"][kind]), value, rtol=1e-5,
                                   atol=1e-7, err_msg=kind)
    np.testing.assert_allclose(float(aux["load_balancing_loss"]), sum(losses.values()),
                               rtol=1e-5, atol=1e-7)
    # Megatron's tracker names for the sequence and global losses, where computed
    for kind, name in (("seq_aux_loss", "seq_load_balancing_loss"),
                       ("global_aux_loss", "global_load_balancing_loss")):
        assert (name in aux) == (kind in losses), name
        if kind in losses:
            assert float(aux[name]) == float(aux["load_balancing_losses"][kind])
    np.testing.assert_allclose(float(aux["z_loss"]), z, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(aux["aux_loss"]), total, rtol=1e-5, atol=1e-8)
    maps = [np_route(b @ W, c, bias)[1] for b in np.split(xf, 8)]
    plain = dataclasses.replace(c, moe_expert_capacity_factor=None)
    routed = sum(np_route(b @ W, plain, bias)[1].sum() for b in np.split(xf, 8))
    counts = sum(m.sum(0) for m in maps)
    np.testing.assert_array_equal(np.asarray(aux["tokens_per_expert"]), counts)
    assert int(aux["num_dropped"]) == routed - counts.sum()
    np.testing.assert_allclose(float(aux["load_ratio"]), counts.max() / counts.mean(),
                               rtol=1e-6)
    direction = np.asarray(jax.random.normal(jax.random.key(4), W.shape), np.float64)
    eps = 1e-5
    fd = (np_aux(W + eps * direction)[0] - np_aux(W - eps * direction)[0]) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(aux_grads.router[...]) * direction), fd,
                               rtol=2e-3, atol=1e-9)


def test_statistics_by_hand_and_sown():
    # Every token picks experts 0 and 1 (router columns 0 > 1 > the rest): 8 devices x 8
    # tokens, capacity ceil(8*2/8 * 1.0) = 2 per expert and device.
    mesh = _mesh()
    for factor, kept, dropped in ((None, 64, 0), (1.0, 16, 96)):
        c = _cfg(moe_expert_capacity_factor=factor)
        layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh, sow_aux=True)
        layer.router[...] = jnp.zeros((H, E)).at[:, 0].set(2.0).at[:, 1].set(1.0)
        shard_params(layer, mesh)
        x = jax.device_put(jnp.abs(jax.random.normal(jax.random.key(3), (8, 8, H))),
                           NamedSharding(mesh, P(("data", "expert"))))

        run = nnx.jit(nnx.capture(lambda m, x: m(x)[1], nnx.Intermediate))
        with jax.set_mesh(mesh):
            aux, sown = run(layer, x)
        assert np.asarray(aux["tokens_per_expert"]).tolist() == [kept, kept] + [0] * 6
        assert int(aux["num_dropped"]) == dropped
        assert float(aux["load_ratio"]) == 4.0  # max kept / (2 * kept / 8)
        (sown_aux,) = sown["moe_aux"]
        assert np.asarray(sown_aux["tokens_per_expert"]).tolist() == [kept, kept] + [0] * 6


def test_expert_bias_is_state_updated_once_per_step_outside_autodiff():
    c = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_bias_update_rate=0.01)
    mesh = _mesh()
    layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    assert not isinstance(layer.expert_bias, nnx.Param)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 4, H)),
                       NamedSharding(mesh, P(("data", "expert"))))

    @nnx.jit
    def step(m, x):
        def loss(m):
            y, aux = m(x)
            return jnp.sum(y), aux
        grads, aux = nnx.grad(loss, has_aux=True)(m)
        m.update_expert_bias(aux["tokens_per_expert"])
        return grads, aux

    with jax.set_mesh(mesh):
        grads, aux = step(layer, x)
    counts = np.asarray(aux["tokens_per_expert"], np.float64)
    np.testing.assert_allclose(np.asarray(layer.expert_bias[...]),
                               0.01 * np.sign(counts.mean() - counts), rtol=1e-6)
    assert "expert_bias" not in grads and "router" in grads
    with pytest.raises(ValueError, match="expert bias"):
        MoELayer(_cfg(), H, 32, rngs=nnx.Rngs(0), mesh=mesh).update_expert_bias(counts)


def test_megatron_forward_is_the_transposed_call_with_its_losses_attached():
    """MoELayer.forward(hidden_states [S,B,H], padding_mask=[B,S]) -> (output [S,B,H], None):
    __call__'s values on the transpose (seq_aux_loss sees the same sequences); a loss of the
    output alone carries the aux loss's gradient (MoEAuxLossAutoScaler) while training, not in
    eval; the counts gather in local_tokens_per_expert, which update_expert_bias() reads and
    zeroes."""
    c = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_bias_update_rate=0.01, moe_router_load_balancing_type="seq_aux_loss",
             moe_aux_loss_coeff=0.1)
    mesh = _mesh()
    layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(1), (8, 4, H))  # [B, S, H]
    mask = jnp.zeros((8, 4), bool).at[:, 3].set(True)
    cot = jax.random.normal(jax.random.key(2), x.shape)
    tokens = NamedSharding(mesh, P(("data", "expert")))
    xs, mask_s = jax.device_put(x, tokens), jax.device_put(mask, tokens)
    seq_first = jax.device_put(jnp.swapaxes(x, 0, 1), NamedSharding(mesh, P(None, ("data",
                                                                                    "expert"))))

    def via_call(m, x, with_aux):
        y, aux = m(x, mask_s)
        return jnp.sum(y * cot) + (aux["aux_loss"] if with_aux else 0), (y, aux)

    def via_forward(m, h):
        out, bias = m.forward(h, padding_mask=mask_s)
        assert bias is None
        return jnp.sum(jnp.swapaxes(out, 0, 1) * cot), out

    def run(fn, *args):
        with jax.set_mesh(mesh):
            return nnx.jit(nnx.value_and_grad(fn, has_aux=True), static_argnums=(2,) if len(
                args) == 2 else ())(layer, *args)

    (want, (y, aux)), want_grads = run(via_call, xs, True)
    (got, out), grads = run(via_forward, seq_first)
    np.testing.assert_allclose(np.asarray(out), np.swapaxes(np.asarray(y), 0, 1), rtol=1e-6)
    np.testing.assert_allclose(float(got), float(want) - float(aux["aux_loss"]), rtol=1e-5)
    assert float(aux["aux_loss"]) > 0
    np.testing.assert_allclose(np.asarray(grads["router"][...]),
                               np.asarray(want_grads["router"][...]), rtol=1e-4, atol=1e-6)
    counts = np.asarray(aux["tokens_per_expert"], np.float64)
    np.testing.assert_array_equal(np.asarray(layer.local_tokens_per_expert[...]), 2 * counts)
    layer.update_expert_bias()
    np.testing.assert_allclose(np.asarray(layer.expert_bias[...]),
                               0.01 * np.sign(counts.mean() - counts), rtol=1e-6)
    assert not np.asarray(layer.local_tokens_per_expert[...]).any()

    layer.eval()
    (_, _), eval_grads = run(via_forward, seq_first)
    (_, _), plain_grads = run(via_call, xs, False)
    np.testing.assert_allclose(np.asarray(eval_grads["router"][...]),
                               np.asarray(plain_grads["router"][...]), rtol=1e-4, atol=1e-6)
    assert not np.asarray(layer.local_tokens_per_expert[...]).any()  # eval counts nothing
    with pytest.raises(ValueError, match="hidden_states"):
        layer.forward(x.reshape(-1, H))
    with pytest.raises(ValueError, match="intermediate_tensors"):
        layer.forward(seq_first, intermediate_tensors=())


def test_dtype_is_compute_and_param_dtype_is_parameters():
    mesh = _mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 2, H)),
                       NamedSharding(mesh, P(("data", "expert"))))
    c = _cfg(moe_router_dtype="fp32")
    for dtype, param_dtype, out in ((jnp.bfloat16, jnp.float32, jnp.bfloat16),
                                    (None, jnp.bfloat16, jnp.float32),
                                    (None, jnp.float32, jnp.float32)):
        make = lambda: MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh,  # noqa: E731
                                dtype=dtype, param_dtype=param_dtype)
        layer, twin = make(), make()
        assert {v.dtype for v in jax.tree.leaves(nnx.state(layer, nnx.Param))} == {
            jnp.dtype(param_dtype)}
        shard_params(layer, mesh)
        with jax.set_mesh(mesh):
            y, aux = nnx.jit(lambda m, x: m(x))(layer, x)
        assert y.dtype == out and aux["aux_loss"].dtype == jnp.float32
        if dtype is None and param_dtype == jnp.float32:
            want = dense_forward(twin, np.asarray(x))[0]
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_seq_aux_loss_needs_sequences():
    mesh = _mesh()
    layer = MoELayer(_cfg(moe_router_load_balancing_type="seq_aux_loss"), H, 32,
                     rngs=nnx.Rngs(0), mesh=mesh)
    with pytest.raises(ValueError, match="seq_aux_loss"):
        layer(jnp.zeros((8, H)))


def test_layer_takes_its_sizes_from_the_config_and_shows_its_signature():
    import inspect
    mesh = _mesh()
    layer = MoELayer(_cfg(moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=8), H,
                     rngs=nnx.Rngs(0), mesh=mesh)
    assert layer.w_gate_up.shape == (E, H, 48) and layer.shared_down.shape == (8, H)
    assert layer.expert_bias is None
    # neither given: Megatron's default, ffn_hidden_size = 4 * hidden_size
    default = MoELayer(_cfg(), H, rngs=nnx.Rngs(0), mesh=mesh)
    assert default.w_gate_up.shape == (E, H, 8 * H) and default.w_down.shape == (E, 4 * H, H)
    # Megatron's attribute names
    assert default.token_dispatcher is default.dispatcher
    assert default.num_local_experts == E // mesh.shape["expert"]
    with pytest.raises(ValueError, match="config"):
        MoELayer(dict(num_moe_experts=E), H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    params = inspect.signature(MoELayer).parameters
    assert list(params)[:3] == ["config", "hidden_size", "ffn_hidden_size"]
    assert {"dtype", "param_dtype", "sow_aux", "rngs", "mesh"} <= set(params)


# ----------------------------------------------------------------- sinkhorn, lists of types

def test_sinkhorn_matches_megatron_and_balances():
    logits = np.asarray(jax.random.normal(jax.random.key(7), (64, E)), np.float64) * 3
    logits[:, 0] += 12.0  # every token prefers expert 0: sinkhorn must spread them
    got = np.asarray(routing.sinkhorn(jnp.asarray(logits, jnp.float32)), np.float64)
    want = np_sinkhorn(logits)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-9)
    np.testing.assert_allclose(got.sum(0), 1 / E, rtol=2e-3)  # columns: 1/E each
    c = _cfg(moe_router_load_balancing_type="sinkhorn")
    _, train_ids = routing.route(jnp.asarray(logits, jnp.float32), c, training=True)
    probs, eval_ids = routing.route(jnp.asarray(logits, jnp.float32), c, training=False)
    load = lambda ids: np.bincount(np.asarray(ids).ravel(), minlength=E)  # noqa: E731
    assert load(eval_ids)[0] == 64 and load(train_ids)[0] < 32  # balanced only when training
    np.testing.assert_array_equal(np.asarray(eval_ids), np_topk(np_softmax(logits), K)[1])
    # The probs are the softmax at the chosen experts, not renormalised over the K.
    np.testing.assert_allclose(np.asarray(probs), np.take_along_axis(
        np_softmax(logits), np.asarray(eval_ids), 1), rtol=1e-5)
    # No gradient flows through sinkhorn (Megatron runs it under no_grad).
    g = jax.grad(lambda lg: routing.sinkhorn(lg).sum())(jnp.asarray(logits, jnp.float32))
    assert not np.asarray(g).any()
    # T = 0 tokens and NaN logits end the iteration (no cap exists to end it otherwise).
    assert routing.sinkhorn(jnp.zeros((0, E))).shape == (0, E)
    assert np.isnan(np.asarray(routing.sinkhorn(jnp.full((4, E), jnp.nan)))).all()


def test_sinkhorn_of_large_logits_is_the_shifted_rows_sinkhorn():
    """Sinkhorn's result does not change when a row of logits is shifted (its d0 absorbs the
    scale), which is how logits past 50 are handled: float32 exp would make d0 subnormal from
    about 80 on (NaN on XLA:CPU, which flushes it) and overflow past 88.7. Here rows at 80-88
    and 89-10^4 against float64 Megatron on the same rows shifted down, and rows below 50
    (unshifted) against float64 Megatron on the logits themselves."""
    base = np.asarray(jax.random.normal(jax.random.key(3), (32, E)), np.float64) * 2
    offsets = np.array([0.0, 10.0, 40.0, 82.0, 86.0, 90.0, 150.0, 1e4] * 4)[:, None]
    logits = (base + offsets).astype(np.float32)
    got = np.asarray(routing.sinkhorn(jnp.asarray(logits)), np.float64)
    assert np.isfinite(got).all()
    want = np_sinkhorn(logits.astype(np.float64) - offsets)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-9)
    low = np.asarray(routing.sinkhorn(jnp.asarray(logits[offsets[:, 0] < 50])))
    np.testing.assert_allclose(low, np_sinkhorn(logits[offsets[:, 0] < 50].astype(np.float64)),
                               rtol=2e-4, atol=1e-9)


def test_load_balancing_lists_and_their_coefficients():
    c = _cfg(moe_router_load_balancing_type=["seq_aux_loss", "none", "aux_loss"],
             moe_aux_loss_coeff=[0.5, 0.25, 0.0])
    assert c.moe_router_load_balancing_type == ("seq_aux_loss", "none", "aux_loss")
    assert hash(c) is not None and not c.sinkhorn
    assert [c.aux_loss_coeff(k) for k in ("aux_loss", "seq_aux_loss", "global_aux_loss")] == [
        0.0, 0.5, 0.0]
    assert c.aux_losses() == ("seq_aux_loss",)
    one = _cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    assert one.aux_loss_coeff("global_aux_loss") == 0.1 and one.aux_loss_coeff("aux_loss") == 0
    assert _cfg(moe_router_load_balancing_type="sinkhorn").sinkhorn
    assert not _cfg(moe_router_load_balancing_type=["sinkhorn"], moe_aux_loss_coeff=[0.0]).sinkhorn
    for fields, name in (
            (dict(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=0.1),
             "moe_aux_loss_coeff"),
            (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                  moe_aux_loss_coeff=[0.1]), "moe_aux_loss_coeff"),
            (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=[0.1]),
             "moe_aux_loss_coeff"),
            (dict(moe_router_load_balancing_type=["aux_loss", "aux_loss"],
                  moe_aux_loss_coeff=[0.1, 0.2]), "moe_router_load_balancing_type"),
            (dict(moe_router_load_balancing_type=[], moe_aux_loss_coeff=[]),
             "moe_router_load_balancing_type"),
            (dict(moe_router_load_balancing_type=["aux_loss", "switch"],
                  moe_aux_loss_coeff=[0.1, 0.1]), "moe_router_load_balancing_type"),
            (dict(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[-1.0]),
             "moe_aux_loss_coeff"),
            (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1),
             "moe_aux_loss_coeff"),
            (dict(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0),
             "moe_router_load_balancing_type")):
        with pytest.raises(ValueError, match=name):
            _cfg(**fields)
    # A list holding seq_aux_loss needs sequences, as the string does.
    layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=_mesh())
    with pytest.raises(ValueError, match="seq_aux_loss"):
        layer(jnp.zeros((8, H)))


def test_global_aux_loss_keeps_megatrons_running_mean_over_micro_batches():
    # Three training micro-batches of one step, then an eval call, then the step's reset:
    # micro-batch i's loss uses the mean of the counts of micro-batches 1..i (Megatron's
    # _apply_global_aux_loss), N being one micro-batch's tokens.
    c = _cfg(moe_router_load_balancing_type=["global_aux_loss", "aux_loss"],
             moe_aux_loss_coeff=[1.0, 0.0])
    mesh = _mesh()
    layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    twin = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    assert not isinstance(layer.ga_steps, nnx.Param)
    W = np.asarray(twin.router[...], np.float64)
    run = nnx.jit(lambda m, x: m(x)[1])
    tracked, steps = np.zeros(E), 0
    for i in range(3):
        x = jax.random.normal(jax.random.key(10 + i), (16, 2, H)) * (1 + i)
        logits = np.asarray(x, np.float64).reshape(-1, H) @ W
        want = np_global(logits, c, tracked, steps)
        # The dense reference reads the same tracker (before this call adds to it).
        for name in ("global_tokens_per_expert", "ga_steps"):
            getattr(twin, name)[...] = np.asarray(getattr(layer, name)[...])
        dense_aux = dense_forward(twin, np.asarray(x), num_devices=8)[1]
        with jax.set_mesh(mesh):
            aux = run(layer, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
        np.testing.assert_allclose(float(aux["load_balancing_losses"]["global_aux_loss"]),
                                   want, rtol=1e-5)
        np.testing.assert_allclose(float(dense_aux), want, rtol=1e-5)
        tracked, steps = tracked + np_switch_counts(logits, c)[1], steps + 1
        np.testing.assert_allclose(np.asarray(layer.global_tokens_per_expert[...]), tracked)
        assert float(layer.ga_steps[...]) == steps
    assert i == 2 and (tracked / 3 != np_switch_counts(logits, c)[1]).any()  # the mean matters
    layer.eval()  # NNX's eval flag: the tracker is read, not added to
    assert layer.deterministic
    with jax.set_mesh(mesh):
        run(layer, jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))))
    assert float(layer.ga_steps[...]) == 3
    layer.reset_global_aux_loss_tracker()
    assert float(layer.ga_steps[...]) == 0 and not np.asarray(
        layer.global_tokens_per_expert[...]).any()
    assert MoELayer(_cfg(), H, 32, rngs=nnx.Rngs(0), mesh=mesh).ga_steps is None


def test_every_balancing_loss_is_zero_on_an_empty_batch():
    """No token on any device: aux, seq_aux and global_aux losses and the z-loss are 0 (not
    0/0 or an index error), the tracker counts nothing but the micro-batch, and the gradients
    are zero."""
    c = _cfg(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
             moe_aux_loss_coeff=[1e-2, 1e-2, 1e-2], moe_z_loss_coeff=1e-3)
    mesh = _mesh()
    layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)

    def loss(layer, x):
        y, aux = layer(x)
        return y.sum() + aux["aux_loss"], aux

    with jax.set_mesh(mesh):
        (value, aux), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(
            layer, jnp.zeros((0, 2, H)))
    assert float(value) == 0.0
    losses = {k: float(v) for k, v in aux["load_balancing_losses"].items()}
    assert losses == {"aux_loss": 0.0, "seq_aux_loss": 0.0, "global_aux_loss": 0.0}, losses
    assert float(aux["z_loss"]) == 0.0
    assert not np.asarray(layer.global_tokens_per_expert[...]).any()
    assert float(layer.ga_steps[...]) == 1
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):
        assert not np.asarray(g[...]).any(), path


def np_padded_losses(logits, valid, c: MoEConfig, num_devices, seq_len):
    """Megatron's losses with a padding mask (valid = ~padding_mask) over the global tokens
    [N,E] of num_devices ranks: compute_routing_scores_for_aux_loss zeroes the padding tokens'
    scores and routing; get_tokens_per_expert_and_token_count counts the valid tokens (the
    per-sequence loss: the rank's valid tokens / its sequences); z_loss_func is each rank's
    mean over its valid tokens (0 for a rank of padding only), averaged over the ranks (DDP).
    Returns ({type: loss}, z_loss, the masked plain top-k counts [E])."""
    scores = np_aux_scores(logits, c) * valid[:, None]
    _, top = np_topk(np_aux_scores(logits, c), c.moe_router_topk)
    routed = np.zeros(logits.shape)
    np.put_along_axis(routed, top, 1.0, axis=1)
    routed *= valid[:, None]
    num_experts, k = logits.shape[1], c.moe_router_topk

    def switch(s, r, n):
        return np.sum(s.sum(0) * r.sum(0)) * num_experts / (k * n * n) if n else 0.0

    per_rank = list(zip(*(np.split(a, num_devices) for a in (scores, routed, valid))))
    losses = {"aux_loss": np.mean([switch(s, r, v.sum()) for s, r, v in per_rank])}
    seqs = []
    for s, r, v in per_rank:
        mean_tokens = v.sum() / (len(v) // seq_len)
        seqs += [switch(a, b, mean_tokens) for a, b in zip(np.split(s, len(v) // seq_len),
                                                          np.split(r, len(v) // seq_len))]
    losses["seq_aux_loss"] = np.mean(seqs)
    losses["global_aux_loss"] = switch(scores, routed, valid.sum())
    z = [np.sum(np.log(np.exp(lg).sum(-1)) ** 2 * v) / max(v.sum(), 1)
         for lg, v in zip(np.split(logits, num_devices), np.split(valid, num_devices))]
    return losses, np.mean(z), routed.sum(0)


def test_padding_mask_leaves_padding_out_of_every_loss_and_count():
    # Megatron's padding_mask (True = padding): still routed and computed, counted nowhere.
    # 8 devices x 2 sequences of 3; device 2 has one padded sequence, device 5 only padding.
    c = _cfg(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
             moe_aux_loss_coeff=[1e-2, 0.1, 0.05], moe_z_loss_coeff=1e-3,
             token_dispatcher=jax_ep.TokenDispatcherConfig(moe_permute_fusion=True))
    mesh = _mesh()
    layer, twin = _layer(c, mesh)
    plain, _ = _layer(c, mesh)
    x = jax.random.normal(jax.random.key(2), (16, 3, H))
    mask = np.zeros((16, 3), bool)
    mask[0, 2] = mask[1, 1:] = mask[4] = mask[10:12] = True
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    ms = jax.device_put(mask, NamedSharding(mesh, P(("data", "expert"))))
    with jax.set_mesh(mesh):
        y, aux = nnx.jit(lambda m, x, p: m(x, padding_mask=p))(layer, xs, ms)
        y_plain, aux_plain = nnx.jit(lambda m, x: m(x))(plain, xs)
        aux_grads = nnx.jit(nnx.grad(lambda m, x, p: m(x, padding_mask=p)[1]["aux_loss"]))(
            layer, xs, ms)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))  # outputs unchanged
    W = np.asarray(twin.router[...], np.float64)
    xf, valid = np.asarray(x, np.float64).reshape(-1, H), ~mask.reshape(-1)

    def np_aux(W):
        losses, z, _ = np_padded_losses(xf @ W, valid, c, 8, 3)
        return sum(np_types(c)[k] * v for k, v in losses.items()) + 1e-3 * z, losses, z

    total, losses, z = np_aux(W)
    for kind, value in losses.items():
        np.testing.assert_allclose(float(aux["load_balancing_losses"][kind]), value, rtol=1e-5,
                                   err_msg=kind)
        assert abs(float(aux_plain["load_balancing_losses"][kind]) - value) > 1e-4 * value
    np.testing.assert_allclose(float(aux["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(aux["aux_loss"]), total, rtol=1e-5)
    np.testing.assert_allclose(float(dense_forward(twin, x, 8, padding_mask=mask)[1]), total,
                               rtol=1e-5)
    routed = np.zeros((48, E))
    np.put_along_axis(routed, np_route(xf @ W, c)[1].argsort(1)[:, -K:], 1.0, axis=1)
    np.testing.assert_array_equal(np.asarray(aux["tokens_per_expert"]),
                                  (routed * valid[:, None]).sum(0))
    np.testing.assert_allclose(np.asarray(layer.global_tokens_per_expert[...]),  # two calls
                               2 * np_padded_losses(xf @ W, valid, c, 8, 3)[2])
    direction = np.asarray(jax.random.normal(jax.random.key(4), W.shape), np.float64)
    fd = (np_aux(W + 1e-5 * direction)[0] - np_aux(W - 1e-5 * direction)[0]) / 2e-5
    np.testing.assert_allclose(np.sum(np.asarray(aux_grads.router[...]) * direction), fd,
                               rtol=2e-3, atol=1e-9)
    for bad in (mask[:, :2], mask.astype(np.int32)):
        with pytest.raises(ValueError, match="padding_mask"):
            layer(x, padding_mask=bad)


# ----------------------------------------------------------------- drop and pad

def test_pad_expert_blocks_by_hand():
    from jax_ep.flax.moe import pad_expert_blocks, unpad_expert_blocks
    rows = jnp.arange(1.0, 7.0)[:, None] * jnp.ones((1, 2))  # 5 rows in blocks [2, 0, 3] + 1 pad
    probs = jnp.asarray([0.1, 0.2, 0.3, 0.4, 0.5, 0.0])
    padded, padded_probs, slots = pad_expert_blocks(rows, jnp.asarray([2, 0, 3], jnp.int32),
                                                    probs, 3)
    assert np.asarray(slots).tolist() == [0, 1, -1, -1, -1, -1, 2, 3, 4]
    assert np.asarray(padded)[:, 0].tolist() == [1, 2, 0, 0, 0, 0, 3, 4, 5]
    np.testing.assert_allclose(np.asarray(padded_probs), [0.1, 0.2, 0, 0, 0, 0, 0.3, 0.4, 0.5])
    back = unpad_expert_blocks(padded * 10, slots, 6)
    assert np.asarray(back)[:, 1].tolist() == [10, 20, 30, 40, 50, 0]


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_pad_expert_input_to_capacity_pads_the_gemm_and_changes_no_value(backend, monkeypatch):
    # Megatron's dispatcher_drop_and_pad_test: the same output and gradients as without
    # padding, every local expert's block cap * EP rows, run as one batched GEMM per weight.
    import jax_ep.flax.moe as moe
    seen = []
    plain_experts, plain_blocks = moe.swiglu_experts, moe.swiglu_expert_blocks

    def recording(tokens, tokens_per_expert, *args, **kwargs):
        seen.append(("grouped", tokens.shape[0]))
        return plain_experts(tokens, tokens_per_expert, *args, **kwargs)

    def recording_blocks(tokens, *args):
        seen.append(("blocks", tokens.shape[0]))
        return plain_blocks(tokens, *args)

    monkeypatch.setattr(moe, "swiglu_experts", recording)
    monkeypatch.setattr(moe, "swiglu_expert_blocks", recording_blocks)
    mesh = _mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 3, H)),
                       NamedSharding(mesh, P(("data", "expert"))))
    results = []
    for pad in (False, True):
        c = _cfg(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad,
                 moe_aux_loss_coeff=1e-2, token_dispatcher=jax_ep.TokenDispatcherConfig(
                     moe_flex_dispatcher_backend=backend))
        layer = MoELayer(c, H, 32, rngs=nnx.Rngs(0), mesh=mesh)
        shard_params(layer, mesh)
        seen.clear()

        def loss(m, x):
            y, aux = m(x)
            return jnp.sum(jnp.sin(y)) + aux["aux_loss"], (y, aux["tokens_per_expert"])

        with jax.set_mesh(mesh):
            (value, (y, counts)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(
                layer, x)
        results.append((value, y, counts, grads, list(seen)))
    (v0, y0, c0, g0, seen0), (v1, y1, c1, g1, seen1) = results
    # the padded blocks run XLA's batched einsum, the unpadded rows the CPU handler (fused
    # multiply-adds): the same products, rounded in another order
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    assert_param_grads_close(g1, g0, rtol=1e-5, atol=2e-6)
    # 6 tokens per device, K=2, E=8, factor 0.5: cap = ceil(6*2/8*0.5) = 1, C = 4 * 1 rows for
    # each of the L = 2 local experts. The counts are Megatron's padded map's: cap slots per
    # expert on each of the 8 devices (the unpadded run counts the kept slots, fewer).
    np.testing.assert_array_equal(np.asarray(c1), np.full(E, 8 * 1))
    assert int(np.asarray(c0).sum()) < 8 * E
    assert seen1 and all(seen == ("blocks", 2 * 4) for seen in seen1), seen1
    assert seen0 and all(kind == "grouped" and rows != 2 * 4 for kind, rows in seen0), seen0


# ----------------------------------------------------------------- TopKRouter (the module)

ROUTER_MODULE_CASES = {
    "softmax_aux_z": dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2),
    "sigmoid_groups_bias": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                                moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.1),
    "seq_aux_capacity": dict(moe_router_load_balancing_type="seq_aux_loss",
                             moe_aux_loss_coeff=0.1, moe_expert_capacity_factor=1.0),
    # Megatron's test_token_dropping with pad: the map is each expert's capacity mask
    "aux_capacity_pad": dict(moe_aux_loss_coeff=0.1, moe_expert_capacity_factor=1.0,
                             moe_pad_expert_input_to_capacity=True),
}


@pytest.mark.parametrize("name", sorted(ROUTER_MODULE_CASES))
def test_topk_router_module_matches_megatron(name):
    """jax_ep.flax.TopKRouter: Megatron's weight layout [E,H], (probs [T,E], routing_map [T,E])
    equal to the float64 model of topk_softmax_with_capacity + token dropping, and the
    gradient of a loss of probs alone carrying the scaled aux losses (MoEAuxLossAutoScaler),
    as Megatron's router adds them in its backward."""
    c = _cfg(**ROUTER_MODULE_CASES[name])
    router = jax_ep.flax.TopKRouter(c, H, rngs=nnx.Rngs(3))
    if router.expert_bias is not None:
        router.expert_bias[...] = jnp.asarray(np.linspace(-0.3, 0.3, E), jnp.float32)
    assert router.weight.shape == (E, H) and (router.topk, router.num_experts) == (K, E)
    assert router.score_function == c.moe_router_score_function
    B, S = 2, 6
    x = jax.random.normal(jax.random.key(2), (B, S, H))
    probs, routing_map = router(x)
    if c.moe_pad_expert_input_to_capacity:  # every expert exactly its capacity of tokens
        capacity = routing.get_capacity(B * S * K, E, c.moe_expert_capacity_factor)
        np.testing.assert_array_equal(np.asarray(routing_map).sum(0), capacity)
        assert int(np.asarray(routing_map).sum()) == B * S * K * c.moe_expert_capacity_factor
    W = np.asarray(router.weight[...], np.float64)
    logits = np.asarray(x, np.float64).reshape(-1, H) @ W.T
    bias = None if router.expert_bias is None else np.asarray(router.expert_bias[...])
    want_probs, want_map = np_route(logits, c, bias)
    np.testing.assert_array_equal(np.asarray(routing_map), want_map)
    np.testing.assert_allclose(np.asarray(probs), want_probs, rtol=1e-5, atol=1e-7)

    cot = jax.random.normal(jax.random.key(4), (B * S, E))
    graphdef, state = nnx.split(router)
    kept = jnp.asarray(routing_map)  # the capacity drop's choice (no gradient)

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] * cot)

    def probs_of(w):  # the routed probs as Megatron's topk_routing_with_score_function gives
        lg = x.reshape(-1, H) @ w.T
        return lg, routing.topk_routing_with_score_function(
            lg, K, use_pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=c.moe_router_score_function,
            expert_bias=None if bias is None else jnp.asarray(bias, jnp.float32))[0] * kept

    def scaled_losses(lg):  # each loss by Megatron's function, times its coefficient
        types = np_types(c)
        if "aux_loss" in types:
            total = types["aux_loss"] * _switch(lg, c)
        else:
            total = types["seq_aux_loss"] * sum(_switch(lg[i * S:(i + 1) * S], c)
                                                for i in range(B)) / B
        if c.moe_z_loss_coeff is not None:
            total = total + routing.z_loss_func(lg, c.moe_z_loss_coeff)
        return total

    def explicit(w, scale=1.0):
        lg, p = probs_of(w)
        return jnp.sum(p * cot) + scale * scaled_losses(lg)

    w = router.weight[...]
    got = jax.grad(loss)(state)["weight"][...]
    np.testing.assert_allclose(got, jax.grad(explicit)(w), rtol=1e-4, atol=1e-6)
    probs_only = jax.grad(lambda w: jnp.sum(probs_of(w)[1] * cot))(w)
    assert np.abs(np.asarray(got - probs_only)).max() > 1e-4  # the losses do reach W
    try:  # Megatron's set_loss_scale: the losses' cotangent
        jax_ep.flax.MoEAuxLossAutoScaler.set_loss_scale(2.0)
        doubled = jax.grad(loss)(state)["weight"][...]
    finally:
        jax_ep.flax.MoEAuxLossAutoScaler.set_loss_scale(1.0)
    np.testing.assert_allclose(doubled, jax.grad(partial(explicit, scale=2.0))(w), rtol=1e-4,
                               atol=1e-6)
    try:  # None, Megatron's initial value (NeMo's tests reset it so): a scale of 1
        jax_ep.flax.MoEAuxLossAutoScaler.main_loss_backward_scale = None
        np.testing.assert_array_equal(jax.grad(loss)(state)["weight"][...], got)
    finally:
        jax_ep.flax.MoEAuxLossAutoScaler.set_loss_scale(1.0)
    router.deterministic = True  # eval: no loss attached, as Megatron outside training
    graphdef, state = nnx.split(router)
    np.testing.assert_allclose(jax.grad(loss)(state)["weight"][...], probs_only, rtol=1e-5,
                               atol=1e-7)


def _switch(logits, c):
    """Megatron's switch_load_balancing_loss_func (coefficient 1) of these tokens."""
    routing_map, scores = routing.compute_routing_scores_for_aux_loss(
        logits, K, c.moe_router_score_function)
    return routing.switch_load_balancing_loss_func(scores, routing_map.sum(0), logits.shape[0],
                                                   K, E, 1.0)


def test_topk_router_module_state_padding_and_refusals():
    """The global_aux_loss tracker counts one micro-batch per training call (not when
    deterministic) and resets; a padding mask leaves padding tokens out of the losses (their
    routing still computed); aux is sown with sow_aux; force load balancing and a wrong
    hidden size are refused naming the field / argument."""
    c = _cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    router = jax_ep.flax.TopKRouter(c, H, rngs=nnx.Rngs(5), sow_aux=True)
    x = jax.random.normal(jax.random.key(6), (2, 5, H))
    run = nnx.jit(nnx.capture(lambda m, x, pad=None: m(x, pad), nnx.Intermediate))
    run(router, x)
    _, sown = run(router, x)
    assert float(router.ga_steps[...]) == 2
    logits = np.asarray(x, np.float64).reshape(-1, H) @ np.asarray(router.weight[...]).T
    np.testing.assert_allclose(np.asarray(router.global_tokens_per_expert[...]),
                               2 * np_switch_counts(logits, c)[1], rtol=1e-6)
    (aux,) = sown["router_aux"]
    assert float(aux["global_load_balancing_loss"]) > 0
    router.deterministic = True
    run(router, x)
    assert float(router.ga_steps[...]) == 2
    router.reset_global_aux_loss_tracker()
    assert float(router.ga_steps[...]) == 0

    plain = jax_ep.flax.TopKRouter(_cfg(moe_aux_loss_coeff=0.1), H, rngs=nnx.Rngs(5),
                                   sow_aux=True)
    pad = np.zeros((2, 5), bool)
    pad[1, 3:] = True  # three padding tokens
    (probs, routing_map), sown = run(plain, x, jnp.asarray(pad))
    assert int(np.asarray(routing_map).sum()) == 10 * K  # still routed
    (aux,) = sown["router_aux"]
    valid = logits[~pad.reshape(-1)]
    np.testing.assert_allclose(float(aux["load_balancing_loss"]), np_switch(valid, plain.config),
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"x: expected \[..., hidden_size=16\]"):
        plain(jnp.zeros((3, H + 1)))


def test_topk_router_counts_tokens_for_the_expert_bias():
    """Megatron's router buffer: local_tokens_per_expert adds each training call's routed
    slots (not in eval); update_expert_bias() moves the bias by them and zeroes them."""
    c = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_bias_update_rate=0.01)
    router = jax_ep.flax.TopKRouter(c, H, rngs=nnx.Rngs(5))
    x = jax.random.normal(jax.random.key(6), (2, 5, H))
    run = nnx.jit(lambda m, x: m(x))
    _, routing_map = run(router, x)
    run(router, x)
    counts = np.asarray(routing_map).sum(axis=0).astype(np.float64)
    assert counts.sum() == 10 * K
    np.testing.assert_array_equal(np.asarray(router.local_tokens_per_expert[...]), 2 * counts)
    router.deterministic = True
    run(router, x)
    np.testing.assert_array_equal(np.asarray(router.local_tokens_per_expert[...]), 2 * counts)
    router.update_expert_bias()
    np.testing.assert_allclose(np.asarray(router.expert_bias[...]),
                               0.01 * np.sign(counts.mean() - counts), rtol=1e-6)
    assert not np.asarray(router.local_tokens_per_expert[...]).any()
    # padding tokens are not counted; an update with explicit counts also empties the buffer
    router.deterministic = False
    pad = jnp.zeros((2, 5), bool).at[1].set(True)
    _, padded_map = nnx.jit(lambda m, x, p: m(x, p))(router, x, pad)
    valid = np.asarray(padded_map)[:5].sum(axis=0)
    np.testing.assert_array_equal(np.asarray(router.local_tokens_per_expert[...]), valid)
    router.update_expert_bias(jnp.asarray(counts))
    assert not np.asarray(router.local_tokens_per_expert[...]).any()
    assert isinstance(router.local_tokens_per_expert, jax_ep.flax.TokenCounts)


def test_topk_router_forward_is_megatrons_sequence_first_order():
    """TopKRouter.forward(input [S,B,H], padding_mask [S,B]) -> rows in Megatron's order
    (s*B + b): __call__'s on the transpose, reordered, with the same seq_aux_loss gradient."""
    c = _cfg(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5)
    router = jax_ep.flax.TopKRouter(c, H, rngs=nnx.Rngs(7))
    x = jax.random.normal(jax.random.key(8), (3, 5, H))  # [B, S, H]
    pad = jnp.zeros((3, 5), bool).at[2, 4].set(True)
    weights = jax.random.normal(jax.random.key(9), (5 * 3, E))

    def megatron(m):
        probs, routing_map = m.forward(jnp.swapaxes(x, 0, 1), jnp.swapaxes(pad, 0, 1))
        return jnp.sum(probs * weights), routing_map

    def jax_style(m):
        probs, routing_map = m(x, pad)
        reorder = lambda a: jnp.swapaxes(a.reshape(3, 5, E), 0, 1).reshape(15, E)  # noqa: E731
        return jnp.sum(reorder(probs) * weights), reorder(routing_map)

    (got, got_map), got_grad = nnx.value_and_grad(megatron, has_aux=True)(router)
    (want, want_map), want_grad = nnx.value_and_grad(jax_style, has_aux=True)(router)
    np.testing.assert_array_equal(np.asarray(got_map), np.asarray(want_map))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad["weight"][...]),
                               np.asarray(want_grad["weight"][...]), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="input"):
        router.forward(x.reshape(-1, H))
    with pytest.raises(ValueError, match="padding_mask"):
        router.forward(jnp.swapaxes(x, 0, 1), pad)


def np_pad_routing_map(routing_map, pad_multiple):
    """Megatron's pad_routing_map, line by line in numpy."""
    routing_map = routing_map.T.copy()  # [E, T]
    num_to_pad = (-routing_map.sum(axis=1)) % pad_multiple
    zero_ranks = np.cumsum(routing_map == 0, axis=1)
    routing_map[zero_ranks <= num_to_pad[:, None]] = 1
    return routing_map.T


@pytest.mark.parametrize("pad_multiple", [1, 4, 16])
@pytest.mark.parametrize("dtype", [bool, np.int32])
def test_pad_routing_map_matches_megatron(pad_multiple, dtype):
    rng = np.random.default_rng(pad_multiple)
    routing_map = (rng.random((40, E)) < 0.3).astype(dtype)
    routing_map[:, 1] = 0
    routing_map[-1, 1] = 1  # one routed token, the last: padded with the first tokens
    routing_map[:, 2] = 1  # no unrouted token left to pad with
    routing_map[:3, 3] = 0
    routing_map[3:, 3] = 1  # three unrouted tokens: all used when more are needed
    got = np.asarray(routing.pad_routing_map(jnp.asarray(routing_map), pad_multiple))
    want = np_pad_routing_map(routing_map, pad_multiple)
    assert got.dtype == routing_map.dtype
    np.testing.assert_array_equal(got, want)
    counts = got.astype(np.int64).sum(0)
    assert (counts[[0, 1] + list(range(4, E))] % pad_multiple == 0).all()
    assert (got >= routing_map).all()  # only unrouted tokens are flipped, the first ones
    # expert 1: its last token routed, then the first pad_multiple - 1 tokens
    np.testing.assert_array_equal(got[:, 1].astype(bool),
                                  (np.arange(40) < pad_multiple - 1) | (np.arange(40) == 39))
    assert routing.pad_routing_map(jnp.zeros((0, E), bool), 4).shape == (0, E)
    with pytest.raises(ValueError, match="pad_multiple"):
        routing.pad_routing_map(jnp.asarray(routing_map), 0)

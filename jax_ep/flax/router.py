"""Megatron-Core's router on one device's tokens (pure functions, no communication): score
functions, sinkhorn, pre-softmax, top-k scaling, expert bias, node-limited (group) top-k, the
capacity drop and the per-token pieces of the load-balancing and z losses. The MoE layer sums the pieces over
the mesh (`jax_ep.flax.moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import deepep, ops
from jax_ep.flax.moe_config import MoEConfig

__all__ = ["capacity_drop", "group_limited_topk", "route", "sinkhorn", "switch_loss_terms",
           "updated_expert_bias", "z_loss_terms"]


def group_limited_topk(scores, top_k, num_groups, group_topk):
    """Node-limited top-k (DeepSeek-V3): scores [T,E] -> (values [T,K], ids i32[T,K]). The E
    experts form num_groups contiguous groups; a group scores the sum of its top
    K // group_topk scores; only the best group_topk groups stay eligible."""
    T, E = scores.shape
    grouped = scores.reshape(T, num_groups, E // num_groups)
    group_score = jax.lax.top_k(grouped, top_k // group_topk)[0].sum(axis=-1)  # [T,G]
    _, best = jax.lax.top_k(group_score, group_topk)
    eligible = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best].set(True)
    masked = jnp.where(jnp.repeat(eligible, E // num_groups, axis=1), scores, -jnp.inf)
    values, ids = jax.lax.top_k(masked, top_k)
    return values, ids


def _topk(scores, cfg: MoEConfig):
    if cfg.moe_router_group_topk:
        return group_limited_topk(scores, cfg.moe_router_topk, cfg.moe_router_num_groups,
                                  cfg.moe_router_group_topk)
    return jax.lax.top_k(scores, cfg.moe_router_topk)


def _unnormalised_scores(logits, score_function):
    """logits [T,E] -> the sigmoid or sqrtsoftplus (sqrt(softplus(x))) scores [T,E]."""
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def sinkhorn(cost, tol=1e-4):
    """Megatron's sinkhorn: cost [T,E] -> f32[T,E] = d1 * exp(cost) * d0, the row scales d0
    and column scales d1 iterated (Sinkhorn-Knopp, eps 1e-8) until the column scales move by
    less than tol on average (no iteration cap, as Megatron; a NaN stops it). Pushes row sums
    towards 1/T and column sums towards 1/E. Not differentiated (Megatron runs it under
    no_grad): the input's gradient is cut."""
    c = jnp.exp(jax.lax.stop_gradient(cost).astype(jnp.float32))
    T, E = c.shape
    if T == 0:
        return c
    eps = 1e-8

    def step(state):
        _, d1, _ = state
        d0 = (1.0 / T) / (c @ d1 + eps)
        new_d1 = (1.0 / E) / (d0 @ c + eps)
        return d0, new_d1, jnp.mean(jnp.abs(new_d1 - d1))

    # The initial scales are made from c so they vary over the same mesh axes (shard_map).
    start = (jnp.ones_like(c.sum(axis=1)), jnp.ones_like(c.sum(axis=0)),
             jnp.full_like(c.sum(), 1e9))
    d0, d1, _ = jax.lax.while_loop(lambda state: state[2] > tol, step, start)
    return d1[None, :] * c * d0[:, None]


def _sinkhorn_route(logits, cfg: MoEConfig, training):
    """moe_router_load_balancing_type="sinkhorn" (Megatron's sinkhorn_load_balancing): logits
    [T,E] -> (probs [T,K], ids i32[T,K]). Training: the experts are the top-K of the sinkhorn
    scores; eval: the top-K of the activation. The probs are the activation (sigmoid for
    K = 1, else softmax over all E in f32, cast to the logits' dtype) at those experts, not
    renormalised; score function, groups, bias and scaling factor do not apply."""
    if cfg.moe_router_topk == 1:
        act = jax.nn.sigmoid(logits)
    else:
        act = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
    _, ids = jax.lax.top_k(sinkhorn(logits) if training else act, cfg.moe_router_topk)
    return jnp.take_along_axis(act, ids, axis=1), ids


def route(logits, cfg: MoEConfig, expert_bias=None, training=True):
    """Megatron's topk_softmax_with_capacity before the drop: logits [T,E] (router dtype) ->
    (probs [T,K] in the logits' dtype, ids i32[T,K]). expert_bias f32[E] (sigmoid /
    sqrtsoftplus) shifts the scores for the choice of experts, not the probs. training:
    Megatron's module.training, read by sinkhorn routing only."""
    if cfg.sinkhorn:
        probs, ids = _sinkhorn_route(logits, cfg, training)
        return probs.astype(logits.dtype), ids.astype(jnp.int32)
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            probs, ids = _topk(jax.nn.softmax(logits, axis=-1), cfg)
        else:
            top, ids = _topk(logits, cfg)
            probs = jax.nn.softmax(top, axis=-1)
    else:
        scores = _unnormalised_scores(logits, cfg.moe_router_score_function)
        if expert_bias is not None:
            _, ids = _topk(scores + expert_bias.astype(scores.dtype), cfg)
            top = jnp.take_along_axis(scores, ids, axis=1)
        else:
            top, ids = _topk(scores, cfg)
        probs = top / (top.sum(axis=-1, keepdims=True) + 1e-20) if cfg.moe_router_topk > 1 \
            else top
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return probs.astype(logits.dtype), ids.astype(jnp.int32)


def capacity_drop(probs, ids, cfg: MoEConfig):
    """moe_expert_capacity_factor with moe_token_drop_policy on one device's T tokens: each
    expert keeps at most ceil(T*K/E * factor) of its (token, slot)s. probs [T,K], ids i32[T,K]
    -> (probs with dropped slots 0, ids with dropped slots -1, dropped i32[E] per expert)."""
    E = cfg.num_moe_experts
    if cfg.moe_expert_capacity_factor is None:
        return probs, ids, jnp.zeros((E,), jnp.int32)
    capacity = deepep.expert_capacity(ids.shape[0], cfg.moe_router_topk, E,
                                      cfg.moe_expert_capacity_factor)
    routing_map, dense = ops.indices_to_multihot(ids, probs.astype(jnp.float32),
                                                 num_experts=E, impl="xla")
    keep, _, _ = deepep.drop_to_expert_capacity(routing_map, dense, capacity=capacity,
                                                drop_policy=cfg.moe_token_drop_policy)
    kept = jnp.take_along_axis(keep, ids, axis=1)
    dropped = (routing_map & ~keep).sum(axis=0, dtype=jnp.int32)
    return jnp.where(kept, probs, 0).astype(probs.dtype), jnp.where(kept, ids, -1), dropped


def switch_loss_terms(logits, cfg: MoEConfig):
    """Per-token pieces of Megatron's switch load-balancing loss (compute_routing_scores_for_
    aux_loss): logits [T,E] -> (scores f32[T,E]: softmax, or sigmoid / sqrtsoftplus normalised
    over E;
    routed i32[T,E]: the plain top-K of those scores, no bias and no groups). Over a token set
    B of N tokens the loss is E / (K * N^2) * sum_e (sum_B scores[:, e]) * (sum_B routed[:, e])."""
    logits = logits.astype(jnp.float32)
    if cfg.moe_router_score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = _unnormalised_scores(logits, cfg.moe_router_score_function)
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    _, ids = jax.lax.top_k(scores, cfg.moe_router_topk)
    routed = jax.nn.one_hot(ids, cfg.num_moe_experts, dtype=jnp.int32).sum(axis=1)
    return scores, jax.lax.stop_gradient(routed)


def z_loss_terms(logits):
    """logits [T,E] -> f32[T]: logsumexp(logits)^2 per token (ST-MoE's z-loss is their mean)."""
    return jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


def updated_expert_bias(expert_bias, tokens_per_expert, update_rate):
    """Aux-loss-free balancing (Megatron's get_updated_expert_bias): each expert's bias f32[E]
    moves by update_rate towards balance, up when it got fewer than the mean of
    tokens_per_expert [E] (global counts), down when more, unchanged at the mean."""
    counts = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    offset = counts.mean() - counts
    return expert_bias + jnp.sign(offset) * update_rate

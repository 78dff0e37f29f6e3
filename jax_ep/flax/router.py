"""Megatron-Core's router on one device's tokens (pure functions, no communication): score
functions, sinkhorn, pre-softmax, top-k scaling, expert bias, node-limited (group) top-k, the
capacity drop and the per-token pieces of the load-balancing and z losses, with Megatron's
moe_utils names where it has them. The MoE layer sums the pieces over the mesh
(`jax_ep.flax.moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, deepep, ops
from jax_ep.flax.moe_config import MoEConfig

__all__ = ["apply_biased_logits", "apply_random_logits", "apply_router_token_dropping",
           "capacity_drop", "check_top_k", "compute_routing_scores_for_aux_loss",
           "get_capacity", "get_updated_expert_bias", "group_limited_topk", "pad_routing_map",
           "qb_dual_update", "route", "router_gating_linear",
           "sinkhorn", "switch_load_balancing_loss_func", "switch_loss_terms",
           "topk_routing_with_score_function", "z_loss_func", "z_loss_terms"]


def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    """Node-limited top-k (DeepSeek-V3; Megatron's group_limited_topk, same arguments): scores
    [num_tokens, num_experts] -> (values [T,topk], ids i32[T,topk]). The experts form
    num_groups contiguous groups; a group scores the sum of its top topk // group_topk scores;
    only the best group_topk groups stay eligible (the others' scores -inf)."""
    topk = _checks.check_positive(topk, "topk")
    _checks.check_positive(num_tokens, "num_tokens", allow_zero=True)
    _checks.check_positive(num_experts, "num_experts")
    _checks.check_rank(scores, 2, "scores")
    if scores.shape != (num_tokens, num_experts):
        raise ValueError(f"group_limited_topk: scores must be [num_tokens={num_tokens}, "
                         f"num_experts={num_experts}], got {scores.shape}")
    if not _checks.is_int(num_groups) or num_experts % num_groups:
        raise ValueError(f"num_groups: expected a divisor of num_experts {num_experts}, got "
                         f"{num_groups!r}")
    if not _checks.is_int(group_topk) or group_topk > num_groups:
        raise ValueError(f"group_topk: expected an int in [1, num_groups={num_groups}], got "
                         f"{group_topk!r}")
    _checks.check_top_k(topk, group_topk * (num_experts // num_groups), "topk",
                        "the experts of the group_topk groups")
    grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
    group_score = jax.lax.top_k(grouped, topk // group_topk)[0].sum(axis=-1)  # [T,G]
    _, best = jax.lax.top_k(group_score, group_topk)
    eligible = jnp.zeros((num_tokens, num_groups), bool).at[
        jnp.arange(num_tokens)[:, None], best].set(True)
    masked = jnp.where(jnp.repeat(eligible, num_experts // num_groups, axis=1), scores, -jnp.inf)
    return jax.lax.top_k(masked, topk)


def _unnormalised_scores(logits, score_function):
    """logits [T,E] -> the sigmoid or sqrtsoftplus (sqrt(softplus(x))) scores [T,E]; any
    other score_function but "softmax" (which its callers take first) is a ValueError."""
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_function == "sqrtsoftplus":
        return _sqrt_softplus(logits)
    raise ValueError(f"score_function: expected 'softmax', 'sigmoid' or 'sqrtsoftplus', got "
                     f"{score_function!r}")


# Below these logits sqrt(softplus(x)) is exp(x / 2) to within the dtype's rounding (their
# ratio is 1 + O(exp(x))); float32 softplus itself underflows into flushed denormals near -87.
def _sqrt_softplus_tail(dtype):
    return -40.0 if jnp.dtype(dtype).itemsize > 4 else -20.0


@jax.custom_jvp
def _sqrt_softplus(x):
    """sqrt(softplus(x)), exp(x / 2) in the far negative tail: finite and non-zero down to
    x = -174 (float32) under XLA:CPU's flushed denormals, where sqrt(softplus) gave 0 (and a NaN
    gradient, sqrt's infinite slope at 0 times softplus' 0)."""
    tail = x < _sqrt_softplus_tail(x.dtype)
    return jnp.where(tail, jnp.exp(0.5 * jnp.where(tail, x, 0)),
                     jnp.sqrt(jax.nn.softplus(jnp.where(tail, 0, x))))


@_sqrt_softplus.defjvp
def _sqrt_softplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _sqrt_softplus(x)
    # d/dx = sigmoid(x) / (2 y), which is y / 2 in the tail (where y is never divided by, so
    # second derivatives stay finite too)
    tail = x < _sqrt_softplus_tail(x.dtype)
    slope = jnp.where(tail, 0.5 * y, jax.nn.sigmoid(x) / (2 * jnp.where(tail, 1, y)))
    return y, slope * dx


def _normalised(scores):
    """scores [T,N] (>= 0) / (their row sum + 1e-20), Megatron's renormalisation, with finite
    first and second derivatives. A row whose largest score is below 2^-30 (sigmoid logits
    under about -21) is first divided by that score (at least 2^-100, so an all-zero row of
    underflowed scores is divided too), a constant to differentiation, and eps with it: the
    same ratio, but JAX's quotient rule no longer squares a row sum of ~5e-20 (sigmoid logits
    under -45: inf) or the bare 1e-20 of a zero row (0 * inf: NaN). Other rows are Megatron's
    arithmetic exactly."""
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    scale = jnp.where(row_max < 2.0**-30, jnp.maximum(row_max, 2.0**-100), 1.0)
    scaled = scores / scale
    return scaled / (scaled.sum(axis=-1, keepdims=True) + 1e-20 / scale)


def sinkhorn(cost, tol=1e-4):
    """Megatron's sinkhorn: cost [T,E] -> f32[T,E] = d1 * exp(cost) * d0, the row scales d0
    and column scales d1 iterated (Sinkhorn-Knopp, eps 1e-8) until the column scales move by
    less than tol on average (no iteration cap, as Megatron; a NaN stops it). Pushes row sums
    towards 1/T and column sums towards 1/E; finite for logits past 80, where Megatron's
    float32 arithmetic is not (see the row shift below). Not differentiated (Megatron runs it
    under no_grad): the input's gradient is cut. tol: a float > 0 (a tolerance <= 0 would
    never be met: ValueError)."""
    _checks.check_real(tol, "tol", positive=True)
    _checks.check_rank(cost, 2, "cost")
    _checks.check_float_weights(cost, "cost")
    cost = jax.lax.stop_gradient(cost).astype(jnp.float32)
    T, E = cost.shape
    if E == 0:
        raise ValueError(f"cost: expected at least one expert column, got shape {cost.shape}")
    if T == 0:
        return cost
    # A row's scale is absorbed by its d0, so a row whose largest logit passes 50 is shifted
    # down to 50: exp stays finite and d0 normal. Unshifted, d0 is an fp32 subnormal from about
    # 80 on (flushed to 0 on XLA:CPU: NaN scores) and exp overflows past 88.7 (NaN in Megatron
    # too). Rows below 50 are Megatron's arithmetic exactly.
    row_max = cost.max(axis=1, keepdims=True)
    c = jnp.exp(cost - jnp.where(row_max > 50.0, row_max - 50.0, 0.0))
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


def apply_random_logits(logits, key):
    """Megatron's apply_random_logits (moe_router_force_load_balancing), with its random
    state as an explicit key: standard normal logits of logits' shape and dtype, with the
    gradient passing straight through to `logits` (Megatron's RandomSTE)."""
    _checks.check_float_weights(logits, "logits")
    _check_key(key)
    noise = jax.random.normal(key, logits.shape, logits.dtype)
    return noise + (logits - jax.lax.stop_gradient(logits))


def _check_key(key):
    """ValueError naming key unless it is a jax.random key (typed, or raw uint32[2])."""
    typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = (hasattr(key, "dtype") and key.dtype == jnp.uint32 and jnp.ndim(key) == 1
           and key.shape[0] == 2)
    if not (typed or raw):
        got = f"{key.dtype}{list(key.shape)}" if hasattr(key, "dtype") else repr(key)
        raise ValueError(f"key: expected a jax.random key (jax.random.key(seed)), got {got}")


def apply_biased_logits(logits, key, bias):
    """Megatron's apply_biased_logits (moe_router_force_biased), with its random state as
    explicit values: apply_random_logits(logits, key) plus bias [E] (Megatron's normal(0,
    |std|) draw, the same on every rank), cast to logits' dtype; the gradient passes straight
    through to `logits`, none to `bias` (a draw, as Megatron's RandomSTEShared)."""
    _checks.check_float_weights(logits, "logits")
    _checks.check_shape(bias, logits.shape[-1:], "bias")
    _checks.check_float_weights(bias, "bias")
    return apply_random_logits(logits, key) + jax.lax.stop_gradient(bias).astype(logits.dtype)


def router_gating_linear(inp, weight, bias, router_dtype):
    """Megatron's router_gating_linear: inp [..., H], weight [E, H] (torch's Linear layout), bias
    [E] or None -> logits [..., E] = inp @ weight^T + bias, computed in router_dtype."""
    _checks.check_rank(weight, 2, "weight")
    _checks.check_rows(inp, "inp")
    if inp.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected [E, H] with H = inp's {inp.shape[-1]} channels, got "
                         f"shape {weight.shape}")
    if bias is not None:
        _checks.check_shape(bias, weight.shape[:1], "bias")
    router_dtype = _checks.as_dtype(router_dtype, "router_dtype")
    if not jnp.issubdtype(router_dtype, jnp.floating):
        raise ValueError(f"router_dtype: expected a float dtype, got {router_dtype}")
    logits = inp.astype(router_dtype) @ weight.astype(router_dtype).T
    return logits if bias is None else logits + bias.astype(router_dtype)


def topk_routing_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None,
                                     group_topk=None, scaling_factor=None,
                                     score_function="softmax", expert_bias=None, fused=False,
                                     router_replay=None, dense_output=False,
                                     precomputed_indices=None):
    """Megatron's topk_routing_with_score_function (same arguments and results): logits [T,E]
    -> (routing_probs [T,E], routing_map bool[T,E]), or with dense_output=True (probs [T,topk],
    top_indices i32[T,topk]). As Megatron, the scores are computed in float32 whatever the
    logits' dtype (float64 logits too: Megatron's precision rule) and cast back: softmax
    (use_pre_softmax: over all E before the top-k; else over the topk logits chosen), sigmoid
    or sqrtsoftplus (renormalised over the topk chosen when topk > 1; expert_bias shifts the
    choice, not the probs), times
    scaling_factor (None or 0: none), cast to the logits' dtype. num_groups / group_topk:
    group-limited top-k. precomputed_indices i32[T,topk]: the experts, the probs computed at
    them. fused is accepted and has no effect (XLA fuses); router_replay must be None."""
    if router_replay is not None:
        raise ValueError("router_replay: not supported in jax_ep (pass None)")
    use_pre_softmax = _checks.check_flag(use_pre_softmax, "use_pre_softmax")
    dense_output = _checks.check_flag(dense_output, "dense_output")
    logits = _logits(logits)
    num_tokens, num_experts = logits.shape
    topk = _checks.check_positive(topk, "topk")
    _checks.check_top_k(topk, num_experts, "topk")
    scaling_factor = _checks.check_coeff(scaling_factor, "scaling_factor", allow_none=True)
    if expert_bias is not None:
        _checks.check_shape(expert_bias, (num_experts,), "expert_bias")
        _checks.check_float_weights(expert_bias, "expert_bias")
    if precomputed_indices is not None:
        precomputed_indices = jnp.asarray(precomputed_indices)
        _checks.check_shape(precomputed_indices, (num_tokens, topk), "precomputed_indices")
        if not jnp.issubdtype(precomputed_indices.dtype, jnp.integer):
            raise ValueError(f"precomputed_indices: expected integer expert ids, got "
                             f"{precomputed_indices.dtype}")
        _check_concrete_ids(precomputed_indices, num_experts, "precomputed_indices")
    wide = jnp.float32  # Megatron: scores and every intermediate in fp32

    def choose(scores):
        if precomputed_indices is not None:
            ids = jnp.asarray(precomputed_indices, jnp.int32)
            return jnp.take_along_axis(scores, ids, axis=1), ids
        if group_topk:
            return group_limited_topk(scores, topk, num_tokens, num_experts, num_groups,
                                      group_topk)
        return jax.lax.top_k(scores, topk)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, ids = choose(jax.nn.softmax(logits.astype(wide), axis=-1))
        else:
            top, ids = choose(logits)
            probs = jax.nn.softmax(top.astype(wide), axis=-1)
    else:
        scores = _unnormalised_scores(logits.astype(wide), score_function)
        if expert_bias is not None and precomputed_indices is None:
            _, ids = choose(scores + expert_bias.astype(wide))
            top = jnp.take_along_axis(scores, ids, axis=1)
        else:
            top, ids = choose(scores)
        probs = _normalised(top) if topk > 1 else top
    if scaling_factor is not None and not (_checks.is_real(scaling_factor)
                                           and scaling_factor == 0):  # 0: none, as Megatron
        probs = probs * scaling_factor
    probs, ids = probs.astype(logits.dtype), ids.astype(jnp.int32)
    if dense_output:
        return probs, ids
    rows = jnp.arange(num_tokens)[:, None]
    return (jnp.zeros_like(logits).at[rows, ids].set(probs),
            jnp.zeros(logits.shape, bool).at[rows, ids].set(True))


def _check_concrete_ids(ids, num_experts, name):
    """ValueError naming `name` where ids are concrete and one is outside [0, num_experts)
    (a gather would wrap -1 to the last expert); traced ids are not read (no host sync)."""
    try:
        values = np.asarray(ids)
    except jax.errors.TracerArrayConversionError:
        return
    bad = (values < 0) | (values >= num_experts)
    if bad.any():
        raise ValueError(f"{name}: expected expert ids in [0, {num_experts}), got "
                         f"{values[bad].ravel()[0]}")


def _logits(logits):
    """logits as a [num_tokens, num_experts] float array (a nested list too), else a
    ValueError naming logits."""
    try:
        logits = jnp.asarray(logits)
    except (TypeError, ValueError):
        raise ValueError(f"logits: expected a float [num_tokens, num_experts] array, got "
                         f"{type(logits).__name__}") from None
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits: expected a float [num_tokens, num_experts] array, got "
                         f"{logits.dtype} of shape {logits.shape}")
    return logits


def _check_config(cfg):
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"cfg: expected a MoEConfig, got {type(cfg).__name__}")


def _route_logits(logits, cfg):
    """logits [T, E] of cfg's E experts, else a ValueError naming logits."""
    logits = _logits(logits)
    if logits.shape[1] != cfg.num_moe_experts:
        raise ValueError(f"logits: expected [num_tokens, num_moe_experts={cfg.num_moe_experts}],"
                         f" got shape {logits.shape}")
    return logits


def check_top_k(cfg: MoEConfig):
    """ValueError naming MoEConfig.moe_router_topk when it exceeds num_moe_experts (the config
    accepts that, as Megatron's does; no router can pick K of fewer experts)."""
    _check_config(cfg)
    _checks.check_top_k(cfg.moe_router_topk, cfg.num_moe_experts, "MoEConfig.moe_router_topk",
                        "num_moe_experts")


def qb_dual_update(scores, k, beta, update_beta=True):
    """Megatron's qb_dual_update (quantile balancing): scores [T,E] (the router's logits),
    beta f32[E] the per-expert bias -> (indices i32[T,k]: the top-k of scores - beta, and with
    update_beta the column quantile f32[E] that would give each expert T*k/E tokens: for
    expert e the (T*k/E + 1)-th largest of scores[:, e] - alpha, alpha each token's (k+1)-th
    largest score - beta; else beta). Computed in float32, no gradient. T*k must be divisible
    by E (ValueError); T = 0 gives beta back."""
    update_beta = _checks.check_flag(update_beta, "update_beta")
    _checks.check_rank(scores, 2, "scores")
    _checks.check_float_weights(scores, "scores")
    k = _checks.check_positive(k, "k")
    scores = jax.lax.stop_gradient(scores).astype(jnp.float32)
    num_tokens, num_experts = scores.shape
    if beta is None:
        raise ValueError(f"beta: expected the f32[{num_experts}] quantile bias (qb_beta), got "
                         f"None")
    _checks.check_shape(beta, (num_experts,), "beta")
    _checks.check_float_weights(beta, "beta")
    if k + 1 > num_experts:
        raise ValueError(f"k: quantile balancing needs top-k + 1 <= num_experts, got k={k}, "
                         f"E={num_experts}")
    values, indices = jax.lax.top_k(scores - beta, k + 1)
    if not update_beta or num_tokens == 0:
        return indices[:, :k].astype(jnp.int32), beta
    if (num_tokens * k) % num_experts:
        raise ValueError(f"scores: quantile balancing needs the routed slots (T={num_tokens} "
                         f"tokens * top-{k}) divisible by the {num_experts} experts")
    column_target = num_tokens * k // num_experts
    alpha = values[:, -1:]
    quantile = jax.lax.top_k((scores - alpha).T, column_target + 1)[0][:, -1]
    return indices[:, :k].astype(jnp.int32), quantile


def route(logits, cfg: MoEConfig, expert_bias=None, training=True):
    """The layer's routing before the capacity drop: logits [T,E] (router dtype) -> (probs
    [T,K] in the logits' dtype, ids i32[T,K]): sinkhorn (Megatron's sinkhorn_load_balancing),
    quantile balancing (the experts: qb_dual_update's top-k of logits - expert_bias, here
    the quantile bias qb_beta; the probs: the score function's at them), else
    `topk_routing_with_score_function` with cfg's fields. expert_bias f32[E] (sigmoid /
    sqrtsoftplus) shifts the scores for the choice of experts, not the probs. training:
    Megatron's module.training, read by sinkhorn routing only."""
    check_top_k(cfg)
    logits = _route_logits(logits, cfg)
    training = _checks.check_flag(training, "training")
    if cfg.sinkhorn:
        probs, ids = _sinkhorn_route(logits, cfg, training)
        return probs.astype(logits.dtype), ids.astype(jnp.int32)
    if cfg.quantile_balancing:
        if expert_bias is None:
            raise ValueError(f"expert_bias: quantile balancing routes by the f32"
                             f"[{cfg.num_moe_experts}] qb_beta, got None")
        _checks.check_shape(expert_bias, (cfg.num_moe_experts,), "expert_bias")
        ids, _ = qb_dual_update(logits, cfg.moe_router_topk, expert_bias, update_beta=False)
        return topk_routing_with_score_function(
            logits, cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=cfg.moe_router_score_function, dense_output=True,
            precomputed_indices=ids)
    return topk_routing_with_score_function(
        logits, cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=cfg.moe_router_score_function, expert_bias=expert_bias,
        dense_output=True)


def capacity_drop(probs, ids, cfg: MoEConfig):
    """moe_expert_capacity_factor with moe_token_drop_policy on one device's T tokens: each
    expert keeps at most ceil(T*K/E * factor) of its (token, slot)s. probs [T,K], ids i32[T,K]
    -> (probs with dropped slots 0, ids with dropped slots -1, dropped i32[E] per expert).
    Concrete ids outside [0, E) are refused (traced ones are not read)."""
    _check_config(cfg)
    _checks.check_rank(ids, 2, "ids")
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] != cfg.moe_router_topk:
        raise ValueError(f"ids: expected integer expert ids [T, moe_router_topk="
                         f"{cfg.moe_router_topk}], got {ids.dtype}{list(ids.shape)}")
    _checks.check_shape(probs, ids.shape, "probs")
    _checks.check_float_weights(probs, "probs")
    E = cfg.num_moe_experts
    _check_concrete_ids(ids, E, "ids")
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


def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False,
                                        padding_mask=None):
    """Megatron's compute_routing_scores_for_aux_loss (same arguments and results): logits
    [T,E] -> (routing_map bool[T,E]: the plain top-k of the scores, no bias and no groups,
    scores f32[T,E]: softmax, or sigmoid / sqrtsoftplus normalised over E (+ 1e-20)).
    padding_mask bool[T]: True marks padding (as Megatron's code reads it), whose row of both
    is zeroed. fused has no effect (XLA fuses)."""
    del fused
    logits = _logits(logits).astype(jnp.float32)
    topk = _checks.check_positive(topk, "topk")
    _checks.check_top_k(topk, logits.shape[1], "topk")
    padding_mask = _checks.check_padding_mask(padding_mask, logits.shape[:1])
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = _unnormalised_scores(logits, score_function)
        scores = _normalised(scores)
    _, ids = jax.lax.top_k(scores, topk)
    routing_map = jnp.zeros(scores.shape, bool).at[jnp.arange(scores.shape[0])[:, None],
                                                   ids].set(True)
    if padding_mask is not None:
        valid = ~padding_mask[:, None]
        routing_map, scores = routing_map & valid, scores * valid
    return routing_map, scores


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk,
                                    num_experts, moe_aux_loss_coeff, fused=False,
                                    padding_mask=None):
    """Megatron's switch_load_balancing_loss_func (same arguments): probs [T,E] (this rank's
    scores), tokens_per_expert [E] (the counts at the level of total_num_tokens) -> f32[]
    = sum_e (sum_T probs[:, e]) * tokens_per_expert[e] * E * coeff / (topk * N^2), N =
    total_num_tokens. padding_mask bool[T]: True marks a valid token (as Megatron's code reads
    it here), padding rows of probs add nothing. fused has no effect."""
    del fused
    _checks.check_coeff(total_num_tokens, "total_num_tokens")
    if _checks.is_real(total_num_tokens) and total_num_tokens <= 0:
        raise ValueError(f"total_num_tokens: expected a count > 0, got {total_num_tokens}")
    _checks.check_coeff(moe_aux_loss_coeff, "moe_aux_loss_coeff")
    _checks.check_positive(topk, "topk")
    _checks.check_positive(num_experts, "num_experts")
    _checks.check_top_k(topk, num_experts, "topk")
    probs = jnp.asarray(probs)
    _checks.check_rank(probs, 2, "probs")
    probs = probs.astype(jnp.float32)
    padding_mask = _checks.check_padding_mask(padding_mask, probs.shape[:1])
    if padding_mask is not None:
        probs = probs * padding_mask[:, None]
    counts = jnp.asarray(tokens_per_expert)
    _checks.check_shape(counts, probs.shape[1:], "tokens_per_expert")
    counts = counts.astype(jnp.float32)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return jnp.sum(probs.sum(axis=0) * counts) * scale


def switch_loss_terms(logits, cfg: MoEConfig):
    """Per-token pieces of Megatron's switch load-balancing loss: logits [T,E] -> (scores
    f32[T,E], routed i32[T,E]) of compute_routing_scores_for_aux_loss with cfg's top-k and
    score function. Over a token set B of N tokens the loss is E / (K * N^2) * sum_e
    (sum_B scores[:, e]) * (sum_B routed[:, e])."""
    _check_config(cfg)
    routing_map, scores = compute_routing_scores_for_aux_loss(
        _route_logits(logits, cfg), cfg.moe_router_topk, cfg.moe_router_score_function)
    return scores, jax.lax.stop_gradient(routing_map.astype(jnp.int32))


def z_loss_terms(logits):
    """logits [T,E] -> f32[T]: logsumexp(logits)^2 per token (ST-MoE's z-loss is their mean)."""
    logits = _logits(logits)
    return jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


def z_loss_func(logits, z_loss_coeff, padding_mask=None):
    """Megatron's z_loss_func (same arguments): logits [T,E] -> [] = z_loss_coeff * the mean of
    logsumexp(logits)^2 over the tokens, computed in the logits' dtype as Megatron does (the
    layer's z-loss, z_loss_terms, is float32). padding_mask bool[T]: True marks padding (as
    Megatron's code reads it here): the mean over the other tokens (0 when there are none)."""
    _checks.check_rows(logits, "logits")
    _checks.check_float_weights(logits, "logits")
    z_loss_coeff = _checks.check_coeff(z_loss_coeff, "z_loss_coeff")
    padding_mask = _checks.check_padding_mask(padding_mask, logits.shape[:-1])
    values = jnp.square(jax.nn.logsumexp(logits, axis=-1))
    if padding_mask is None:
        return jnp.mean(values) * z_loss_coeff
    valid = ~padding_mask
    total = jnp.sum(values * valid)
    return total / jnp.maximum(valid.sum(), 1).astype(total.dtype) * z_loss_coeff


def get_capacity(num_tokens, num_experts, capacity_factor, min_capacity=None):
    """Megatron's get_capacity: ceil(num_tokens / num_experts * capacity_factor), at least
    min_capacity when given."""
    _checks.check_positive(num_tokens, "num_tokens", allow_zero=True)
    _checks.check_positive(num_experts, "num_experts")
    if min_capacity is not None:
        _checks.check_positive(min_capacity, "min_capacity", allow_zero=True)
    capacity = deepep.expert_capacity(num_tokens, 1, num_experts, capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def apply_router_token_dropping(routing_probs, routing_map, router_topk, capacity_factor,
                                drop_policy="probs", pad_to_capacity=False):
    """Megatron's apply_router_token_dropping (same arguments and results): routing_probs
    [T,E], routing_map bool[T,E] -> (final_probs [T,E], final_map bool[T,E]). Each expert
    keeps get_capacity(T * router_topk, E, capacity_factor) tokens: the highest routing_probs
    ("probs") or its first routed tokens ("position"), equal values to the lower token index;
    no drop when that capacity exceeds T. pad_to_capacity: final_map is that capacity mask
    itself (each expert exactly capacity tokens, unrouted ones with prob 0). The dense form
    of capacity_drop."""
    pad_to_capacity = _checks.check_flag(pad_to_capacity, "pad_to_capacity")
    if drop_policy not in deepep.DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {deepep.DROP_POLICIES}, got "
                         f"{drop_policy!r}")
    _checks.check_rank(routing_probs, 2, "routing_probs")
    _checks.check_float_weights(routing_probs, "routing_probs")
    num_tokens, num_experts = routing_probs.shape
    if num_experts == 0:
        raise ValueError(f"routing_probs: expected [num_tokens, num_experts] with at least one "
                         f"expert, got shape {routing_probs.shape}")
    _checks.check_positive(router_topk, "router_topk")
    _checks.check_top_k(router_topk, num_experts, "router_topk")
    _checks.check_shape(routing_map, routing_probs.shape, "routing_map")
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    routing_map = _checks.check_map(routing_map)
    if capacity > num_tokens:
        capacity_mask = jnp.ones(routing_map.shape, bool)
    else:
        score = routing_probs if drop_policy == "probs" else routing_map.astype(jnp.int32)
        capacity_mask = deepep.top_per_expert(score, capacity)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


def pad_routing_map(routing_map, pad_multiple):
    """Megatron's pad_routing_map (same arguments and result): routing_map [T,E] (bool or
    integer) -> the same map with, in each expert's column, its first (-count) % pad_multiple
    unrouted tokens (in token order) marked routed, so that each expert's token count is a
    multiple of pad_multiple where the column has that many unrouted tokens (all of them
    otherwise). Megatron's alignment for FP8 grouped GEMMs (moe_router_padding_for_fp8): the
    padding tokens are real ones, with prob 0; jax_ep's moe_router_expert_pad_multiple pads
    with zero rows instead."""
    pad_multiple = _checks.check_positive(pad_multiple, "pad_multiple")
    _checks.check_map(routing_map)
    is_zero = routing_map == 0
    num_to_pad = (-(~is_zero).sum(axis=0)) % pad_multiple
    zero_ranks = jnp.cumsum(is_zero.astype(jnp.int32), axis=0)
    return jnp.where(zero_ranks <= num_to_pad[None, :], jnp.ones_like(routing_map),
                     routing_map)


def get_updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate,
                            tp_dp_cp_group=None):
    """Aux-loss-free balancing (Megatron's get_updated_expert_bias, same arguments): each
    expert's bias moves by expert_bias_update_rate towards balance, up when it got fewer
    than the mean of its row of tokens_per_expert [..., E] (Megatron stacks one row per layer,
    [layers, E]), down when more, unchanged at the mean. tp_dp_cp_group: the mesh axis name
    (or names) to sum the counts over first, Megatron's all-reduce (call inside shard_map);
    None: the counts are global already (as MoELayer passes them)."""
    _checks.check_rows(tokens_per_expert, "tokens_per_expert")
    _checks.check_array(tokens_per_expert, "tokens_per_expert")
    counts = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    _checks.check_shape(expert_bias, counts.shape, "expert_bias")
    _checks.check_coeff(expert_bias_update_rate, "expert_bias_update_rate")
    tp_dp_cp_group = _checks.check_axis_names(tp_dp_cp_group, "tp_dp_cp_group")
    if tp_dp_cp_group is not None:
        counts = jax.lax.psum(counts, tp_dp_cp_group)
    # sign(mean - count) as sign(sum - E * count): exact for integer counts, so an expert at
    # the mean stays put (Megatron's sum / E is exact there; jnp.mean, and XLA's rewrite of
    # a division by the constant E, multiply by the rounded 1/E: balanced counts at E = 7,
    # 13, 60, ... moved every expert)
    offset = counts.sum(axis=-1, keepdims=True) - counts * counts.shape[-1]
    return expert_bias + jnp.sign(offset) * expert_bias_update_rate

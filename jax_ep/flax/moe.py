"""MoELayer (Flax NNX): router top-k, gated (SwiGLU by default) or MLP experts as grouped
GEMMs (`jax_ep.flax.experts`: `jax_ep.ops.grouped_matmul`, jax_ep's CPU handler on CPU, the
tiled loop or `jax.lax.ragged_dot` elsewhere, chosen by
`TokenDispatcherConfig.grouped_gemm_impl`) sharded over the expert mesh axis, the flex
dispatcher, an optional shared expert, Megatron-Core's router (`jax_ep.flax.router`,
configured by `jax_ep.flax.MoEConfig`) and its losses and statistics. The expert functions
are re-exported here under their old import path.

Use it under `jax.jit` with inputs sharded over a `Mesh(("data", "expert"))` (the layer runs
its body in `jax.shard_map`, tokens split over both axes, experts over "expert"), or call it
inside your own `jax.shard_map` that binds the expert axis. With
`MoEConfig.expert_tensor_parallel_size` > 1 the mesh has a tensor axis too
(`("data", "expert", "tensor")`): tokens split over all three, each expert's FFN over "tensor".
"""

from __future__ import annotations

import inspect
import math
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import flax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep.config import BUFFER_BOUNDS, TokenDispatcherConfig
from jax_ep.flax import router as routing
from jax_ep.flax.dispatcher import MoEFlexTokenDispatcher, router_dtype, shared_dispatcher
from jax_ep.flax.moe_config import MoEConfig
from jax_ep.flax.training import shard_state
from jax_ep import _ffi, deepep, ops, transport
from jax_ep.reference import FP8_BLOCK
from jax_ep._checks import (check_array, check_bool, check_float_weights,
                            check_positive, check_rank, check_shape, is_real)
from jax_ep.flax.experts import (_ffn, _linear, _shared_expert, _tensor_parallel, _weighted,
                                 _with_probs, expert_tile_rows, gate_up_from_etp,
                                 gate_up_to_etp, pad_expert_blocks, swiglu_expert_blocks,
                                 swiglu_experts, unpad_expert_blocks)

__all__ = ["AuxLossTracker", "ExpertBias", "ForceBalanceStep", "ForcedBias", "InputJitterStep",
           "MoEAuxLossAutoScaler", "MoELayer", "TokenCounts", "TopKRouter", "dense_forward",
           "expert_tile_rows", "force_balance_key", "force_biased_key", "gate_up_from_etp",
           "gate_up_to_etp", "input_jitter_key", "load_ratio", "pad_expert_blocks",
           "shard_params", "swiglu_expert_blocks", "swiglu_experts", "unpad_expert_blocks"]
# The nnx.Param metadata key nnx.get_named_sharding reads (renamed in flax 0.12).
_SHARDING_KEY = ("out_sharding" if tuple(int(v) for v in flax.__version__.split(".")[:2])
                 >= (0, 12) else "sharding_names")


def _route(tokens, router, cfg: MoEConfig, expert_bias, training=True, noise_key=None,
           jitter_key=None, forced_bias=None):
    """tokens [T,H], router (weight [H,E], bias [E] or None) -> (logits [T,E] router dtype,
    top-k probs f32[T,K], ids i32[T,K], dropped i32[E]: slots each expert dropped to the
    capacity factor). noise_key: with moe_router_force_load_balancing or
    moe_router_force_biased, this device's key of the random logits; forced_bias f32[E]:
    with moe_router_force_biased, the bias added to them; jitter_key: with
    moe_input_jitter_eps eps, this device's key of the uniform [1 - eps, 1 + eps] noise the
    router's input is multiplied by."""
    weight, bias = router
    logits = _gate(_jittered(tokens, jitter_key, cfg), weight.T, cfg, bias)
    logits = _forced_logits(logits, noise_key, forced_bias)
    return (logits, *_routed(logits, cfg, expert_bias, training))


def _jittered(tokens, jitter_key, cfg: MoEConfig):
    """tokens [T,H] times uniform [1 - eps, 1 + eps] noise of jitter_key (eps =
    moe_input_jitter_eps), or unchanged where jitter_key is None."""
    if jitter_key is None:
        return tokens
    eps = cfg.moe_input_jitter_eps
    return tokens * jax.random.uniform(jitter_key, tokens.shape, tokens.dtype, 1.0 - eps,
                                       1.0 + eps)


def _forced_logits(logits, noise_key, forced_bias):
    """logits [T,E] replaced by force balancing's random logits of noise_key, plus
    forced_bias f32[E] (moe_router_force_biased) when given; unchanged where noise_key is None.
    The gradient passes straight through."""
    if forced_bias is not None:
        return routing.apply_biased_logits(logits, noise_key, forced_bias)
    if noise_key is not None:
        return routing.apply_random_logits(logits, noise_key)
    return logits


def _gate(tokens, weight, cfg: MoEConfig, bias=None):
    """tokens [T,H], weight [E,H], bias [E] or None -> logits [T,E] in moe_router_dtype (None:
    the tokens')."""
    dtype = router_dtype(cfg.dispatcher_config(), tokens.dtype)
    return routing.router_gating_linear(tokens, weight, bias, dtype)


def _routed(logits, cfg: MoEConfig, expert_bias, training):
    """logits [T,E] -> (top-k probs f32[T,K], ids i32[T,K], dropped i32[E]): the router's
    choice (or moe_benchmark_static_routing's), then the capacity drop."""
    probs, ids = routing.route(logits, cfg, expert_bias, training)
    if cfg.token_dispatcher.moe_benchmark_static_routing:  # token t takes (t*K + k) mod E
        k = cfg.moe_router_topk
        t = jnp.arange(logits.shape[0])[:, None]
        ids = ((t * k + jnp.arange(k)) % cfg.num_moe_experts).astype(jnp.int32)
        probs = jnp.full(ids.shape, 1.0 / k, logits.dtype)
    probs, ids, dropped = routing.capacity_drop(probs, ids, cfg)
    return probs.astype(jnp.float32), ids, dropped


def _tokens_per_expert(ids, valid, cfg: MoEConfig):
    """ids i32[T,K] (-1: dropped), valid bool[T] or None (False: padding) -> i32[E]: the slots
    each expert got, dropped slots and padding tokens counting nowhere. With
    moe_pad_expert_input_to_capacity instead each expert's column of Megatron's padded routing
    map (apply_router_token_dropping's capacity mask): min(capacity, T) for every expert, its
    filler tokens counted whatever they are (padding ones too), as Megatron's router counts
    that map."""
    E = cfg.num_moe_experts
    if cfg.moe_pad_expert_input_to_capacity:
        capacity = deepep.expert_capacity(ids.shape[0], cfg.moe_router_topk, E,
                                          cfg.moe_expert_capacity_factor)
        return jnp.full((E,), min(capacity, ids.shape[0]), jnp.int32)
    counted = ids >= 0 if valid is None else (ids >= 0) & valid[:, None]
    return jnp.zeros((E,), jnp.int32).at[jnp.where(counted, ids, E).reshape(-1)].add(
        1, mode="drop")


def _check_rngs(rngs):
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(f"rngs: expected an nnx.Rngs, got {type(rngs).__name__}")


def _is_float_dtype(dtype) -> bool:
    """Whether dtype names a float dtype (jnp.bfloat16, "float32", ...)."""
    try:
        return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        return False


# Permuted-buffer bytes per device above which a layer whose buffers follow the no-drop worst
# case, over UNBOUNDED_BUFFER_RATIO times the routed rows, warns once per message.
UNBOUNDED_BUFFER_WARN_BYTES = 256 << 20
UNBOUNDED_BUFFER_RATIO = 4


def _warn_unbounded_buffers(permuted, routed_rows, dcfg: TokenDispatcherConfig):
    """A UserWarning (at trace time) when the dropless worst-case buffers (no
    dropless_buffer_factor, ragged_buffer_factor or capacity factor, nor the backend's own
    bound: num_permuted_tokens for hybridep, num_worst_tokens for the deepep family) hold more
    than UNBOUNDED_BUFFER_RATIO times the T*K rows routed on average and
    UNBOUNDED_BUFFER_WARN_BYTES of rows: permuted [N, H] is the expert GEMMs' input. The worst
    case grows with the expert axis (P*T*min(K, L) rows) while the need stays T*K: one
    DeepSeek-V3-shaped layer's training step at EP 64 peaks at 157 GiB a device in XLA's
    memory analysis (benchmarks/RESULTS.md, session 28). A capacity factor drops by design and
    bounds the buffers itself: no warning then."""
    ignored = "num_worst_tokens" if dcfg.backend == "hybridep" else "num_permuted_tokens"
    bounds = [name for name in ("dropless_buffer_factor",) + BUFFER_BOUNDS if name != ignored]
    if any(getattr(dcfg, name) is not None for name in bounds):  # bounded, or dropping
        return
    rows = permuted.shape[0]
    nbytes = rows * math.prod(permuted.shape[1:]) * permuted.dtype.itemsize
    if rows > UNBOUNDED_BUFFER_RATIO * max(routed_rows, 1) and nbytes > UNBOUNDED_BUFFER_WARN_BYTES:
        warnings.warn(
            f"MoELayer: the dropless worst-case buffers hold {rows} permuted rows per device "
            f"({nbytes / 2**30:.1f} GiB of {permuted.dtype} [N, H] before the expert "
            f"activations) for {routed_rows} routed on average (T*K); "
            f"TokenDispatcherConfig(dropless_buffer_factor=1.25) bounds them and still keeps "
            f"every token (README, 'Buffer sizes')", stacklevel=2)


def _sum_over(axes, *values):
    """psum of per-device values over the mesh `axes` (inside shard_map; none: the values). A
    value that does not vary over one of them (a constant, e.g. a count of an empty batch)
    still counts once per device."""
    if not axes:
        return values
    return jax.lax.psum(tuple(_ffi.make_varying(v, frozenset(axes)) for v in values), axes)


def _switch(score_sums, counts, num_tokens, top_k):
    """Megatron's switch_load_balancing_loss_func (coefficient 1) of S token sets: score_sums
    f32[S,E] (each set's scores summed over its tokens), counts [S,E] (its routed slots per
    expert), num_tokens f32[S] (its tokens) -> f32[S], E / (K * n^2) * sum_e score_sums *
    counts; 0 for a set of no tokens."""
    n = jnp.maximum(num_tokens, 1.0)
    return (score_sums * counts).sum(axis=-1) * (score_sums.shape[-1] / (top_k * n * n))


def _set_sums(scores, routed, tokens, size):
    """Sums over sets of `size` consecutive tokens: scores f32[M,E], routed i32[M,E], tokens
    f32[M] (1 a token, 0 padding) -> ([S,E], [S,E], f32[S]), S = M / size."""
    E = scores.shape[-1]
    return (scores.reshape(-1, size, E).sum(axis=1), routed.reshape(-1, size, E).sum(axis=1),
            tokens.reshape(-1, size).sum(axis=1))


def _balancing_loss(kind, scores, routed, tokens, seq_len, cfg: MoEConfig, axes, num_devices,
                    tracker):
    """One load-balancing loss (unscaled) over every token of the mesh `axes` (see _losses),
    and for "global_aux_loss" the tracker's new counts: scores f32[D*N,E], routed i32[D*N,E]
    and tokens f32[D*N] (padding: 0 in all three); tracker (f32[E] counts summed over this
    step's earlier micro-batches, f32[] their number)."""
    K = cfg.moe_router_topk
    if kind == "global_aux_loss":  # Megatron: the expert counts a running mean over micro-batches
        num_rows = scores.shape[0]
        sums = ([a[0] for a in _set_sums(scores, routed, tokens, num_rows)] if num_rows
                else [scores.sum(0), routed.sum(0), tokens.sum()])  # no token on this device
        s, r, n = _sum_over(axes, *sums)
        counts = tracker[0] + r
        return _switch(s[None], (counts / (tracker[1] + 1.0))[None], n, K)[0], counts
    size = scores.shape[0] // num_devices if kind == "aux_loss" else seq_len
    sets = jnp.zeros((0,), jnp.float32)
    if size:
        score_sums, counts, n = _set_sums(scores, routed, tokens, size)
        if kind == "seq_aux_loss":  # Megatron: each sequence counts its device's mean tokens
            per_device = n.reshape(num_devices, -1)
            n = jnp.repeat(per_device.mean(axis=1), per_device.shape[1])
        sets = _switch(score_sums, counts, n, K)
    total, count = _sum_over(axes, sets.sum(), jnp.asarray(sets.shape[0], jnp.float32))
    return total / jnp.maximum(count, 1.0), None


def _losses(logits, seq_len, cfg: MoEConfig, axes, num_devices=1, tracker=None, valid=None):
    """The unscaled losses over every token of the mesh `axes`: logits [D*N, E] are the tokens
    of num_devices devices (D blocks of N, each a whole number of sequences of seq_len tokens;
    D = 1 inside shard_map). Returns ({kind: f32[]} for each of cfg.aux_losses(), z_loss f32[],
    the global_aux_loss tracker's new counts f32[E] or None). tracker: the layer's
    (global_tokens_per_expert f32[E], ga_steps f32[]) when global_aux_loss is on. valid
    bool[D*N] or None: False for padding tokens, which no loss counts (Megatron's padding_mask:
    their scores and routing are zeroed, the token counts are the valid tokens')."""
    tokens = jnp.ones(logits.shape[:1], jnp.float32) if valid is None else \
        valid.astype(jnp.float32)
    balancing, counts = {}, None
    if cfg.aux_losses():  # as Megatron: a loss at coefficient 0 is not computed
        scores, routed = routing.switch_loss_terms(logits, cfg)
        if valid is not None:
            scores, routed = scores * tokens[:, None], routed * valid[:, None]
        for kind in cfg.aux_losses():
            balancing[kind], new = _balancing_loss(kind, scores, routed, tokens, seq_len, cfg,
                                                   axes, num_devices, tracker)
            counts = counts if new is None else new
    z = jnp.zeros((), jnp.float32)
    if cfg.moe_z_loss_coeff is not None:  # Megatron: each rank's mean, DDP averages the ranks
        terms = (routing.z_loss_terms(logits) * tokens).reshape(num_devices, -1).sum(axis=1)
        means = terms / jnp.maximum(tokens.reshape(num_devices, -1).sum(axis=1), 1.0)
        total, devices = _sum_over(axes, means.sum(), jnp.float32(num_devices))
        z = total / devices
    return balancing, z, counts


def _scaled(cfg: MoEConfig, balancing, z):
    """The aux_loss term: the sum of each load-balancing loss times its coefficient, plus
    moe_z_loss_coeff * z."""
    total = sum((cfg.aux_loss_coeff(kind) * loss for kind, loss in balancing.items()),
                jnp.zeros((), jnp.float32))
    return total + (cfg.moe_z_loss_coeff or 0.0) * z


def load_ratio(tokens_per_expert):
    """Megatron's overload factor: max / mean of tokens_per_expert i32[E] -> f32[] (0 when
    no token is routed)."""
    mean = tokens_per_expert.sum() / tokens_per_expert.shape[0]
    ratio = jnp.where(mean > 0, tokens_per_expert.max() / jnp.maximum(mean, 1e-30), 0.0)
    return ratio.astype(jnp.float32)


# The names Megatron's aux-loss tracker logs the sequence and global balancing losses under.
_TRACKER_NAMES = {"seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def _aux(cfg: MoEConfig, balancing, z, counts, dropped):
    lb = sum(balancing.values(), jnp.zeros((), jnp.float32))
    tracked = {_TRACKER_NAMES[kind]: loss for kind, loss in balancing.items()
               if kind in _TRACKER_NAMES}
    return {"aux_loss": _scaled(cfg, balancing, z), "load_balancing_loss": lb,
            "load_balancing_losses": balancing, **tracked, "z_loss": z,
            "tokens_per_expert": counts, "load_ratio": load_ratio(counts),
            "num_dropped": dropped}


def _as_moe_config(config):
    if isinstance(config, MoEConfig):
        return config
    if isinstance(config, TokenDispatcherConfig):
        return MoEConfig(num_moe_experts=config.num_moe_experts,
                         moe_router_topk=config.moe_router_topk,
                         moe_expert_capacity_factor=config.moe_expert_capacity_factor,
                         moe_router_dtype=config.moe_router_dtype, token_dispatcher=config)
    raise ValueError(f"config: expected a MoEConfig or a TokenDispatcherConfig, got "
                     f"{type(config).__name__}")


def _replicated(kind, value):
    """A non-trainable state variable of nnx.Variable subclass `kind` holding `value`,
    replicated over the mesh (every dimension unsharded). A scalar carries no sharding
    metadata: an empty one breaks Flax's scanned layers (nnx.vmap's transform_metadata adds
    no layer axis to an empty sharding, and nnx.scan's then removes one from it)."""
    if jnp.ndim(value) == 0:
        return kind(value, eager_sharding=False)
    return kind(value, eager_sharding=False, **{_SHARDING_KEY: (None,) * jnp.ndim(value)})


class _RouterState:
    """The router's non-trainable state and its updates, shared by MoELayer and TopKRouter:
    expert_bias (ExpertBias f32[E] or None) with local_tokens_per_expert (TokenCounts f32[E]:
    the slots each expert got in the training calls since the last update_expert_bias,
    Megatron's router buffer; None without expert bias), the global_aux_loss tracker
    (global_tokens_per_expert f32[E], ga_steps f32[], or None), quantile balancing's bias and
    trackers, and the random draws' counters and forced bias (`_init_draws`)."""

    layer_number = None  # Megatron's, set by set_layer_number

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """Megatron's router method: the coefficient of load-balancing loss aux_loss_type
        (`MoEConfig.aux_loss_coeff`; 0 for a type not configured)."""
        return self.config.aux_loss_coeff(aux_loss_type)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's: records the layer's 1-based number as `layer_number` (Megatron names
        its logged losses by it; here the losses come back in aux, so nothing else reads
        it)."""
        self.layer_number = check_positive(layer_number, "layer_number")

    def _init_router_state(self, config: MoEConfig):
        E = config.num_moe_experts
        if config.moe_router_enable_expert_bias:
            self.expert_bias, self.local_tokens_per_expert = (
                _replicated(kind, jnp.zeros((E,), jnp.float32))
                for kind in (ExpertBias, TokenCounts))
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        if "global_aux_loss" in config.aux_losses():
            self.global_tokens_per_expert, self.ga_steps = (
                _replicated(AuxLossTracker, jnp.zeros(shape, jnp.float32))
                for shape in ((E,), ()))
        else:
            self.global_tokens_per_expert = self.ga_steps = None
        if config.quantile_balancing:
            self.qb_beta = _replicated(QuantileBias, jnp.zeros((E,), jnp.float32))
            self.qb_beta_accum, self.qb_beta_count = (
                _replicated(QuantileTracker, jnp.zeros(shape, jnp.float32))
                for shape in ((E,), ()))
        else:
            self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None

    def _init_draws(self, config: MoEConfig, rngs: nnx.Rngs):
        """The random draws' state (`_draw_switches`): force_balance_step (ForceBalanceStep),
        forced_bias (ForcedBias f32[E], a standard normal draw) and input_jitter_step
        (InputJitterStep), each None where its feature is off; drawn from the params stream
        in that order."""
        forcing, per_layer_bias, jitter = _draw_switches(config)
        self.force_balance_step = _draw_counter(ForceBalanceStep, rngs, forcing)
        self.forced_bias = (_replicated(ForcedBias, jax.random.normal(
            rngs.params(), (config.num_moe_experts,), jnp.float32)) if per_layer_bias else None)
        self.input_jitter_step = _draw_counter(InputJitterStep, rngs, jitter)

    def _draws(self):
        """(ForceBalanceStep i32[] or None, InputJitterStep i32[] or None, the forced bias
        f32[E] of this call or None: moe_router_force_biased's). ValueError where the config
        enables a draw whose state the module was not built with (a config swapped after
        construction)."""
        cfg = self.config
        std = cfg.moe_router_force_biased
        forcing, per_layer_bias, jitter = _draw_switches(cfg)
        for field, on, state in (
                ("moe_router_force_biased" if std is not None
                 else "moe_router_force_load_balancing", forcing, self.force_balance_step),
                ("moe_router_force_biased", per_layer_bias, self.forced_bias),
                ("moe_input_jitter_eps", jitter, self.input_jitter_step)):
            if on and state is None:
                raise ValueError(f"MoEConfig.{field}: this module was built without it (its "
                                 f"random draw state is made at construction); build the "
                                 f"module with the config that sets it")
        force_step = _value(self.force_balance_step) if forcing else None
        if std is None:
            forced = None
        elif per_layer_bias:
            forced = -std * _value(self.forced_bias)
        else:
            forced = std * jax.random.normal(force_biased_key(force_step),
                                             (cfg.num_moe_experts,), jnp.float32)
        return force_step, _value(self.input_jitter_step) if jitter else None, forced

    def _draw_keys(self, force_step, jitter_step, device):
        """(force balancing's random-logits key, the input jitter's key) of this call on
        token device `device`, None where off (the jitter in training calls only)."""
        jitter = jitter_step is not None and not self.deterministic
        return (None if force_step is None else force_balance_key(force_step, device),
                input_jitter_key(jitter_step, device) if jitter else None)

    def _advance_draws(self):
        """Every call adds 1 to each draw counter."""
        for counter in (self.force_balance_step, self.input_jitter_step):
            if counter is not None:
                counter[...] += 1

    def _quantile(self, logits, qb_beta):
        """Quantile balancing's quantile f32[E] of these logits [T,E] in a training call
        (qb_dual_update), else None."""
        if self.qb_beta is None or self.deterministic:
            return None
        return routing.qb_dual_update(logits, self.config.moe_router_topk, qb_beta)[1]

    def _choice_bias(self):
        """The per-expert bias the router's choice reads: quantile balancing's qb_beta f32[E]
        (subtracted from the logits), the expert bias f32[E] (added to the scores), or None."""
        return _value(self.qb_beta if self.qb_beta is not None else self.expert_bias)

    def _check_quantile_padding(self, padding_mask):
        if self.qb_beta is not None and padding_mask is not None:
            raise ValueError("padding_mask: expected None with quantile balancing (Megatron "
                             "asserts the same: the quantile counts every token)")

    def _accumulate_quantile(self, quantile):
        """Adds a training call's quantile f32[E] (None: none) to qb_beta_accum, 1 to
        qb_beta_count (Megatron's per-micro-batch accumulation)."""
        if quantile is not None and not self.deterministic:
            self.qb_beta_accum[...] += quantile
            self.qb_beta_count[...] += 1.0

    def update_quantile_balancing(self, dp_cp_group=None):
        """Quantile balancing's update, once per optimizer step after its micro-batches
        (Megatron's _update_router_qb_beta in finalize_model_grads): qb_beta = ema * qb_beta +
        (1 - ema) * qb_beta_accum / max(qb_beta_count, 1), then minus its mean over experts
        (ema = moe_router_quantile_balancing_ema); qb_beta_accum and qb_beta_count start again
        from zero. dp_cp_group: mesh axis name(s) to average the accumulated quantile over,
        inside shard_map (Megatron's data-parallel average; MoELayer's quantiles are averaged
        over its mesh already, a TopKRouter's are its device's)."""
        if self.qb_beta is None:
            raise ValueError("update_quantile_balancing: there is no quantile bias "
                             "(MoEConfig.moe_router_load_balancing_type is not "
                             "'quantile_balancing')")
        average = self.qb_beta_accum[...] / jnp.maximum(self.qb_beta_count[...], 1.0)
        if dp_cp_group:
            average = jax.lax.pmean(average, dp_cp_group)
        ema = self.config.moe_router_quantile_balancing_ema
        beta = ema * self.qb_beta[...] + (1.0 - ema) * average
        self.qb_beta[...] = beta - beta.mean()
        self.qb_beta_accum[...] = jnp.zeros_like(self.qb_beta_accum[...])
        self.qb_beta_count[...] = jnp.zeros_like(self.qb_beta_count[...])

    def update_expert_bias(self, tokens_per_expert=None, tp_dp_cp_group=None):
        """Aux-loss-free balancing, once per step outside autodiff (Megatron's rule): the
        bias moves by moe_router_bias_update_rate up for experts below the mean of
        tokens_per_expert i32[E] (the global aux["tokens_per_expert"] of the step; None: the
        counts local_tokens_per_expert gathered since the last update, as Megatron's
        optimizer step reads its router's buffer), down for those above. tp_dp_cp_group:
        the mesh axis name(s) to sum the counts over first, inside shard_map (Megatron's
        all-reduce; MoELayer's counts are global already, a TopKRouter's are its device's).
        Either way local_tokens_per_expert starts again from zero."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias: there is no expert bias "
                             "(MoEConfig.moe_router_enable_expert_bias=False)")
        counts = self.local_tokens_per_expert[...]
        self.expert_bias[...] = routing.get_updated_expert_bias(
            counts if tokens_per_expert is None else tokens_per_expert, self.expert_bias[...],
            self.config.moe_router_bias_update_rate, tp_dp_cp_group)
        self.local_tokens_per_expert[...] = jnp.zeros_like(counts)

    def _count_tokens(self, tokens_per_expert):
        """Adds a training call's counts i32[E] to local_tokens_per_expert (if any)."""
        if self.local_tokens_per_expert is not None and not self.deterministic:
            self.local_tokens_per_expert[...] += tokens_per_expert.astype(jnp.float32)

    def reset_global_aux_loss_tracker(self):
        """Zeroes the global_aux_loss tracker (Megatron's reset_global_aux_loss_tracker): call
        it once per optimizer step, after the step's micro-batches. No-op without one."""
        if self.ga_steps is not None:
            self.global_tokens_per_expert[...] = jnp.zeros_like(
                self.global_tokens_per_expert[...])
            self.ga_steps[...] = jnp.zeros_like(self.ga_steps[...])

    def _tracker(self):
        """(global_tokens_per_expert f32[E], ga_steps f32[]) or None."""
        if self.ga_steps is None:
            return None
        return self.global_tokens_per_expert[...], self.ga_steps[...]

    def _track(self, tracked, tracker):
        """Stores the tracker's new counts after a training call (not with deterministic)."""
        if tracked is not None and not self.deterministic:
            self.global_tokens_per_expert[...] = tracked
            self.ga_steps[...] = tracker[1] + 1.0


class ExpertBias(nnx.Variable):
    """The router's aux-loss-free expert bias f32[E]: non-trainable state (not an nnx.Param),
    changed only by `update_expert_bias`."""


class TokenCounts(nnx.Variable):
    """local_tokens_per_expert f32[E]: the slots each expert got in the training calls since
    the last `update_expert_bias` (Megatron's router buffer; saved with the state, where
    Megatron's is not persistent). Non-trainable; every training call adds to it."""


class QuantileBias(nnx.Variable):
    """Quantile balancing's per-expert bias qb_beta f32[E] (Megatron's persistent router
    buffer): subtracted from the logits for the choice of experts; non-trainable, moved by
    `update_quantile_balancing`."""


class QuantileTracker(nnx.Variable):
    """Quantile balancing's running state over the micro-batches of one optimizer step
    (Megatron's qb_beta_accum f32[E] and qb_beta_count f32[]): added to by every training call,
    read and zeroed by `update_quantile_balancing`."""


class AuxLossTracker(nnx.Variable):
    """global_aux_loss's running state over the micro-batches of one optimizer step (Megatron's
    global_tokens_per_expert f32[E] and ga_steps f32[]): non-trainable, added to by every
    training call, zeroed by `MoELayer.reset_global_aux_loss_tracker`."""


class ForceBalanceStep(nnx.Variable):
    """The draw counter i32[] of moe_router_force_load_balancing and moe_router_force_biased:
    at value n the layer routes by the random logits of key fold_in(fold_in(key(42), n),
    device) (Megatron seeds 42 + rank and draws anew per call, one generator for all layers),
    plus with force_biased std > 0 the bias of `force_biased_key(n)`. It starts at a random
    value drawn from the layer's params stream, so layers draw differently. Non-trainable;
    every call adds 1."""


def force_balance_key(step, device):
    """The random logits' key of call `step` on token device `device` (ForceBalanceStep)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(42), step), device)


def force_biased_key(step):
    """moe_router_force_biased's key of call `step` (ForceBalanceStep) for std > 0: the bias
    normal(0, std) f32[E] of that key, the same on every device."""
    return jax.random.fold_in(jax.random.key(44), step)


class ForcedBias(nnx.Variable):
    """moe_router_force_biased std < 0: the layer's standard normal draw z f32[E], made at
    init from the params stream; every call adds |std| * z (std read from the config) to the
    random logits. Non-trainable."""


class InputJitterStep(nnx.Variable):
    """moe_input_jitter_eps's draw counter i32[]: at value n a training call multiplies the
    router's input by the uniform noise of key input_jitter_key(n, device). It starts at a
    random value drawn from the layer's params stream, so layers draw differently.
    Non-trainable; every call adds 1."""


def input_jitter_key(step, device):
    """The router input jitter's key of call `step` on token device `device`
    (InputJitterStep)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(43), step), device)


def _draw_switches(config: MoEConfig):
    """Which random draws `config` turns on: (the random logits: moe_router_force_load_balancing
    or moe_router_force_biased; a per-layer forced bias: moe_router_force_biased < 0; the input
    jitter: moe_input_jitter_eps)."""
    std = config.moe_router_force_biased
    return (config.moe_router_force_load_balancing or std is not None,
            std is not None and std < 0, config.moe_input_jitter_eps is not None)


def _draw_counter(kind, rngs, enabled):
    """A random draw counter variable (ForceBalanceStep, InputJitterStep) starting at a random
    value from the params stream, or None when its feature is off."""
    if not enabled:
        return None
    return _replicated(kind, jax.random.randint(rngs.params(), (), 0, 2**30, jnp.int32))


class MoELayer(_RouterState, nnx.Module):
    """Mixture-of-experts feed-forward layer with expert parallelism (Megatron-Core's MoELayer).

      config: a MoEConfig (router, losses, capacity, expert sizes, its TokenDispatcherConfig),
        or a bare TokenDispatcherConfig (= MoEConfig with Megatron's defaults around it).
      hidden_size H; ffn_hidden_size F (default config.moe_ffn_hidden_size): each expert is
        a GLU H -> 2F -> H (SwiGLU, or config.activation_func's), or with
        config.gated_linear_unit=False an MLP H -> F -> H;
        config.moe_shared_expert_intermediate_size adds a shared expert (gated by a sigmoid
        with moe_shared_expert_gate). With config.moe_latent_size D the experts work in D:
        the tokens are projected H -> D (fc1_latent_proj) after the router and D -> H
        (fc2_latent_proj) after the combine; with add_bias_linear the router, the experts'
        GEMMs and the projections have biases (router_bias, b_gate_up, b_down, ...).
      mesh: a Mesh with the expert axis (and optionally data_axis) for calls under jit; or
        expert_parallel_size P when the layer is called inside your shard_map.
      tensor_axis: the mesh axis of expert tensor parallelism (Megatron's ETP group), used
        when config.expert_tensor_parallel_size > 1; a mesh's axis of that name must have
        expert_tensor_parallel_size devices (None: no tensor axis, ETP must be 1). With ETP = S
        > 1 tokens are split over (data, expert, tensor); each device routes its own, the
        dispatch runs over the expert axis, the received rows are all-gathered over the
        tensor axis, w_gate_up [E,H,2F] is split (expert, -, tensor) into S column shards
        [gate_t | up_t] (the `gate_up_to_etp` layout: a plain [gate | up] weight is
        `gate_up_to_etp(w, S)`; a non-gated [E,H,F], or with moe_mlp_glu_interleave_size
        Megatron's interleaved one, into plain column shards), w_down
        [E,F,H] (expert, tensor, -) into row shards, and the partial outputs are
        reduce-scattered over the tensor axis (the one reduction) before the combine. The
        shared expert stays replicated (each device runs it on its tokens).
      dtype: the compute dtype (None: promoted from the input's and the parameters' dtypes),
        param_dtype: the parameters' dtype, as in nnx.Linear. The router's logits, scores and
        probs use config.moe_router_dtype (None: the compute dtype).
      sow_aux: also sow the aux dict below as nnx.Intermediate "moe_aux" (read it with
        nnx.capture(fn, nnx.Intermediate)).
      deterministic: NNX's eval flag (`model.eval()` sets it True, `model.train()` False):
        Megatron's `not module.training`. In eval, sinkhorn routing takes the top-k of the
        activation, and the global_aux_loss tracker is read but not added to.
    __call__(x [..., H], padding_mask=None) -> (y [..., H] in the compute dtype, aux);
    forward(hidden_states [S, B, H], ...) -> (output, None) is Megatron's entry (see there).
    padding_mask: None or bool[...] of x's shape without H, True for padding tokens (Megatron's
    MoELayer / Router argument): they are still routed and computed, but no loss counts them
    (their scores and routing are zeroed in the load-balancing losses, whose token counts are
    the valid tokens', and the z-loss is each device's mean over its valid tokens) and
    neither do "tokens_per_expert" (so neither does the expert-bias update) nor the
    global_aux_loss tracker. aux is over every token of the mesh (summed over the data,
    expert and tensor axes, or the axes of your shard_map):
      "aux_loss" f32[]: moe_aux_loss_coeff * load_balancing_loss + moe_z_loss_coeff * z_loss,
        the term to add to the training loss (already scaled).
      "load_balancing_loss" f32[]: unscaled, by moe_router_load_balancing_type: "aux_loss" the
        switch loss of each device's tokens averaged over devices (Megatron's per-rank loss,
        each device a data-parallel rank), "seq_aux_loss" that of each sequence (x's
        second-to-last axis) averaged over sequences, "global_aux_loss" that of the whole
        batch with the expert counts averaged over this step's micro-batches so far (the
        tracker); 0 for "none" or moe_aux_loss_coeff=0 (not computed, as Megatron). With a list
        of types, the sum of their unscaled losses.
      "load_balancing_losses" {type: f32[]}: each computed type's unscaled loss; also under
        Megatron's tracker names "seq_load_balancing_loss" and "global_load_balancing_loss"
        where computed (Megatron's "load_balancing_loss", the "aux_loss" type alone, is
        load_balancing_losses["aux_loss"]).
      "z_loss" f32[]: unscaled, each device's mean over its tokens of logsumexp(logits)^2,
        averaged over the devices (Megatron's per-rank z-loss under DDP; 0 without a coeff).
      "tokens_per_expert" i32[E]: (token, expert) slots each expert got, after the capacity
        drop, summed over the mesh (padding tokens not counted). "load_ratio" f32[]: max /
        mean of it (Megatron's overload factor; 0 for an empty batch). "num_dropped" i32[]:
        slots dropped to the capacity.
      With a (node, local) expert axis also "rows_across_nodes" i32[] (rows the two-hop
        dispatch sends over the node axis, global, before drops) and "flat_rows_across_nodes"
        i32[] (what the flat exchange would send).
      With TokenDispatcherConfig.dropless_buffer_factor also "buffer_overflow" i32[]: 1 in a
        step whose routing did not fit the bounded buffers on some device (dispatch, experts
        and combine then ran again on every device, over token chunks whose worst case fits
        buffers of the bounded size), else 0.
    """

    def __init__(self, config, hidden_size: int, ffn_hidden_size: int | None = None, *,
                 rngs: nnx.Rngs, mesh=None, expert_parallel_size=None, data_axis="data",
                 tensor_axis="tensor", dtype=None, param_dtype=jnp.float32,
                 sow_aux: bool = False, dispatcher: MoEFlexTokenDispatcher | None = None,
                 deterministic: bool = False):
        config = _as_moe_config(config)
        dcfg = config.dispatcher_config()
        axis = dcfg.expert_axis_name
        hidden_size = check_positive(hidden_size, "hidden_size")
        _check_rngs(rngs)
        if dispatcher is not None and not isinstance(dispatcher, MoEFlexTokenDispatcher):
            raise ValueError(f"dispatcher: expected None or a MoEFlexTokenDispatcher, got "
                             f"{type(dispatcher).__name__}")
        if mesh is not None and data_axis in _names(axis):
            raise ValueError(f"data_axis: {data_axis!r} is the layer's expert axis "
                             f"(TokenDispatcherConfig.expert_axis_name)")
        if ffn_hidden_size is not None:
            ffn_hidden_size = check_positive(ffn_hidden_size, "ffn_hidden_size")
        if not _is_float_dtype(param_dtype):
            raise ValueError(f"param_dtype: expected a float dtype, got {param_dtype!r}")
        if dtype is not None and not _is_float_dtype(dtype):
            raise ValueError(f"dtype: expected None or a float dtype, got {dtype!r}")
        if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh,
                                                      jax.sharding.AbstractMesh)):
            raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
        if mesh is not None:
            if not set(_names(axis)) <= set(mesh.axis_names):
                raise ValueError(f"mesh: has axes {mesh.axis_names}, missing the expert axis "
                                 f"{axis!r} (TokenDispatcherConfig.expert_axis_name)")
            expert_parallel_size = math.prod(mesh.shape[a] for a in _names(axis))
        if expert_parallel_size is None:
            raise ValueError("mesh / expert_parallel_size: pass one so the layer knows P")
        expert_parallel_size = check_positive(expert_parallel_size, "expert_parallel_size")
        num_experts = config.num_moe_experts
        if num_experts % expert_parallel_size:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by the expert "
                             f"parallel size ({expert_parallel_size})")
        # Megatron: moe_ffn_hidden_size defaults to ffn_hidden_size, which defaults to 4 * H.
        F = ffn_hidden_size or config.moe_ffn_hidden_size or 4 * hidden_size
        if F % config.expert_tensor_parallel_size:
            raise ValueError(f"MoEConfig.expert_tensor_parallel_size: "
                             f"{config.expert_tensor_parallel_size} must divide "
                             f"ffn_hidden_size={F}")
        config.check_glu_interleave(F)
        wire = config.moe_latent_size or hidden_size  # the rows' width on the wire
        if dcfg.moe_fp8_dispatch and wire % FP8_BLOCK:
            which = "MoEConfig.moe_latent_size" if config.moe_latent_size else "hidden_size"
            raise ValueError(f"TokenDispatcherConfig.moe_fp8_dispatch: needs rows of a multiple "
                             f"of {FP8_BLOCK} channels on the wire, got {which}={wire}")
        num_local = num_experts // expert_parallel_size
        if dispatcher is not None and dispatcher.num_local_experts != num_local:
            raise ValueError(f"dispatcher: has {dispatcher.num_local_experts} local experts, the "
                             f"layer {num_local} ({num_experts} experts over "
                             f"{expert_parallel_size} devices)")
        self.config = config
        self.dispatch_config = dcfg
        self.mesh = mesh
        self.data_axis = data_axis if mesh is not None and data_axis in mesh.axis_names else None
        self.tensor_axis = _tensor_axis(tensor_axis, config.expert_tensor_parallel_size, mesh,
                                        _names(axis) + (self.data_axis,))
        self.dtype, self.param_dtype = dtype, param_dtype
        self.sow_aux = check_bool(sow_aux, "sow_aux")
        self.deterministic = check_bool(deterministic, "deterministic")
        H = hidden_size
        init = jax.nn.initializers.normal

        def param(key, shape, scale, names):
            return nnx.Param(init(scale)(key, shape, param_dtype), eager_sharding=False,
                             **{_SHARDING_KEY: names})

        def bias(shape, names):  # add_bias_linear's biases start at zero (as TE's, nnx's)
            if not config.add_bias_linear:
                return None
            return nnx.Param(jnp.zeros(shape, param_dtype), eager_sharding=False,
                             **{_SHARDING_KEY: names})

        D = config.moe_latent_size or H  # the width the experts (and the wire) see
        self.router = param(rngs.params(), (H, num_experts), H ** -0.5, (None, None))
        fc1_columns = config.gated_activation().fc1_columns
        self.w_gate_up = param(rngs.params(), (num_experts, D, fc1_columns(F)), D ** -0.5,
                               (axis, None, self.tensor_axis))
        self.w_down = param(rngs.params(), (num_experts, F, D), F ** -0.5,
                            (axis, self.tensor_axis, None))
        self.router_bias = bias((num_experts,), (None,))
        self.b_gate_up = bias((num_experts, fc1_columns(F)), (axis, self.tensor_axis))
        self.b_down = bias((num_experts, D), (axis, None))
        S = config.moe_shared_expert_intermediate_size
        if S:
            self.shared_gate_up = param(rngs.params(), (H, fc1_columns(S)), H ** -0.5,
                                        (None, None))
            self.shared_down = param(rngs.params(), (S, H), S ** -0.5, (None, None))
        else:
            self.shared_gate_up = self.shared_down = None
        self._init_router_state(config)
        self.shared_gate = (param(rngs.params(), (H, 1), H ** -0.5, (None, None))
                            if S and config.moe_shared_expert_gate else None)
        latent = config.moe_latent_size
        self.fc1_latent_proj, self.fc2_latent_proj = (
            (param(rngs.params(), (H, D), H ** -0.5, (None, None)),
             param(rngs.params(), (D, H), D ** -0.5, (None, None))) if latent else (None, None))
        self.fc1_latent_proj_bias, self.fc2_latent_proj_bias = (
            (bias((D,), (None,)), bias((H,), (None,))) if latent else (None, None))
        self._init_draws(config, rngs)
        self.dispatcher = dispatcher or shared_dispatcher(num_local, dcfg, axis)

    @property
    def token_dispatcher(self) -> MoEFlexTokenDispatcher:
        """The layer's dispatcher under Megatron's attribute name (MoELayer.token_dispatcher)."""
        return self.dispatcher

    @property
    def num_local_experts(self) -> int:
        """Experts per expert-parallel rank, L = E / P (Megatron's MoELayer attribute)."""
        return self.dispatcher.num_local_experts

    def _token_axes(self):
        axes = _names(self.dispatch_config.expert_axis_name)
        axes = (self.data_axis,) + axes if self.data_axis else axes
        return axes + (self.tensor_axis,) if self.tensor_axis else axes

    def _local(self, x, router, expert_weights, shared, latent, expert_bias, tracker, padding,
               draws):
        """The per-device body (inside shard_map): x [..., H] local tokens, router (weight
        [H,E], bias [E] or None), expert_weights (w_gate_up, w_down, b_gate_up or None,
        b_down or None) of the local experts, shared (gate_up, down, gate or None) or None,
        latent (fc1 [H,D], fc2 [D,H], their biases or None) or None, padding bool[...] or
        None, draws (ForceBalanceStep i32[] or None, InputJitterStep i32[] or None, the
        forced bias f32[E] or None: `_draws`);
        expert_bias: the router choice's bias (`_choice_bias`). Returns (y, aux, (the
        global_aux_loss tracker's new counts f32[E] or None, quantile balancing's quantile
        f32[E] of a training call, averaged over the token devices, or None))."""
        cfg, dcfg = self.config, self.dispatch_config
        tokens = x.reshape(-1, x.shape[-1])
        valid = None if padding is None else ~padding.reshape(-1)
        axes = self._token_axes()
        keys = self._draw_keys(*draws[:2], jax.lax.axis_index(axes) if axes else 0)
        logits, probs, ids, dropped_per_expert = _route(tokens, router, cfg, expert_bias,
                                                        not self.deterministic, *keys, draws[2])
        balancing, z, tracked = _losses(logits, x.shape[-2] if x.ndim > 2 else 1, cfg, axes,
                                        tracker=tracker, valid=valid)
        quantile = self._quantile(logits, expert_bias)
        if quantile is not None and axes:
            quantile = jax.lax.pmean(quantile, axes)
        d = self.dispatcher
        activation = cfg.gated_activation()
        experts = partial(swiglu_experts, impl=dcfg.grouped_gemm_impl, tile_rows=expert_tile_rows(
            tokens.shape[0] * cfg.expert_tensor_parallel_size, cfg.moe_router_topk,
            d.num_local_experts), activation=activation)
        if self.tensor_axis:
            experts = partial(_tensor_parallel, experts, self.tensor_axis)

        def experts_of(rows, tokens_per_expert, rows_probs, weights):
            w_gate_up, w_down, b_gate_up, b_down = weights
            return _with_probs(lambda r: experts(r, tokens_per_expert, w_gate_up, w_down,
                                                 b_gate_up=b_gate_up, b_down=b_down),
                               rows, rows_probs, cfg)

        def weighted_experts(rows, tokens_per_expert, rows_probs):
            return experts_of(rows, tokens_per_expert, rows_probs, expert_weights)

        def weighted_blocks(rows, _, rows_probs):  # padded to capacity: blocks of equal size
            return _with_probs(lambda r: swiglu_expert_blocks(
                r, *expert_weights[:2], activation, *expert_weights[2:]), rows, rows_probs, cfg)
        if cfg.moe_pad_expert_input_to_capacity:
            # (with a tensor axis the S ranks' blocks are gathered and reordered first: the
            # grouped GEMM of `experts` does that)
            weighted_experts = partial(self._padded_experts,
                                       weighted_experts if self.tensor_axis else weighted_blocks,
                                       tokens.shape[0])
        overflow = None  # dropless_buffer_factor: 1 where the chunked fallback ran
        # what the dispatch moves: the tokens, or with moe_latent_size their projections
        moved = tokens if latent is None else _linear(tokens, latent[0], latent[2])
        if dcfg.moe_deepep_async_dispatch and d.backend != "hybridep":
            def local_kernel(recv_x, recv_idx, recv_w):
                routing_map, rprobs = d.local_multihot(recv_idx, recv_w)
                n = d._num_permuted(recv_x.shape[0], recv_idx.shape[1])
                px, pp, rows, tpe = ops.permute(recv_x, routing_map, rprobs, num_out_tokens=n,
                                                pad_multiple=dcfg.moe_router_expert_pad_multiple,
                                                impl=d._local_impl)
                out = weighted_experts(px, tpe, pp)
                return ops.unpermute(out, rows, num_tokens=recv_x.shape[0], impl=d._local_impl)
            y, dropped = d.overlapped_forward(moved, probs, ids, local_kernel)
        elif dcfg.dropless_buffer_factor is not None:
            y, overflow, dropped = d.bounded_forward(moved, probs, ids, experts_of,
                                                     expert_weights)
        else:
            permuted, tpe, pp, state = d.token_permutation2(moved, moved.shape[0], probs, ids)
            _warn_unbounded_buffers(permuted, moved.shape[0] * cfg.moe_router_topk, dcfg)
            y = d.token_unpermutation(weighted_experts(permuted, tpe, pp), state)
            dropped = state.num_dropped
        if latent is not None:
            y = _latent_up(y, latent)
        if shared is not None:
            y = y + _shared_expert(tokens, shared, cfg.gated_activation(shared=True))
        counts = _tokens_per_expert(ids, valid, cfg)
        counts, dropped = _sum_over(axes, counts, dropped + dropped_per_expert.sum())
        aux = _aux(cfg, balancing, z, counts, dropped)
        if overflow is not None:
            aux["buffer_overflow"] = overflow
        if not isinstance(dcfg.expert_axis_name, str):
            aux.update(zip(("rows_across_nodes", "flat_rows_across_nodes"), _sum_over(
                axes, *_rows_across_nodes(ids, cfg.num_moe_experts, dcfg.expert_axis_name))))
        return y.reshape(x.shape), aux, (tracked, quantile)

    def _padded_experts(self, weighted_experts, num_tokens, rows, tokens_per_expert, probs):
        """moe_pad_expert_input_to_capacity: `weighted_experts` (rows [N,H], tokens_per_expert
        i32[L], probs [N] -> outputs times probs [N,H]) run on every local expert's block padded
        to C = P * ceil(T*K/E * factor) rows (each of the P ranks sends an expert at most its
        capacity), rounded up to moe_router_expert_pad_multiple. Returns the weighted outputs
        [N,H] in the rows' order (weighted on the input with moe_apply_probs_on_input)."""
        cfg = self.config
        pad = self.dispatch_config.moe_router_expert_pad_multiple or 1
        capacity = self.dispatcher.ep_size * deepep.expert_capacity(
            num_tokens, cfg.moe_router_topk, cfg.num_moe_experts, cfg.moe_expert_capacity_factor)
        capacity = -(-capacity // pad) * pad
        padded, padded_probs, slots = pad_expert_blocks(rows, tokens_per_expert, probs, capacity)
        sizes = jnp.full(tokens_per_expert.shape, capacity, jnp.int32)
        return unpad_expert_blocks(weighted_experts(padded, sizes, padded_probs), slots,
                                   rows.shape[0])

    def __call__(self, x, padding_mask=None):
        routing.check_top_k(self.config)
        _check_tokens(x, self.router.shape[0], self.config)
        x, router, expert_weights, shared, latent = self._weights(x)
        tracker = self._tracker()
        draws = self._draws()
        self._check_quantile_padding(padding_mask)
        params = (router, expert_weights, shared, latent, self._choice_bias(), tracker,
                  _checked_padding_mask(padding_mask, x), draws)
        axis = self.dispatch_config.expert_axis_name
        try:
            jax.lax.axis_size(axis)
            inside_shard_map = True
        except NameError:
            inside_shard_map = False
        if inside_shard_map:
            self._check_tensor_axis_bound()
            y, aux, (tracked, quantile) = self._local(x, *params)
        else:
            y, aux, (tracked, quantile) = self._sharded(x, params)
        self._track(tracked, tracker)
        self._accumulate_quantile(quantile)
        self._count_tokens(aux["tokens_per_expert"])
        self._advance_draws()
        if self.sow_aux:
            self.sow(nnx.Intermediate, "moe_aux", aux)
        return y, aux

    def _weights(self, x):
        """x and the parameters in the compute dtype (self.dtype, or promoted from x's and
        theirs): (x, router (weight [H,E], bias [E] or None), (w_gate_up, w_down, b_gate_up or
        None, b_down or None), shared expert (gate_up, down, gate or None) or None, latent
        projections (fc1 [H,D], fc2 [D,H], their biases or None) or None)."""
        router = (self.router[...], _value(self.router_bias))
        expert_weights = tuple(_value(v) for v in (self.w_gate_up, self.w_down, self.b_gate_up,
                                                   self.b_down))
        shared = (None if self.shared_gate_up is None
                  else (self.shared_gate_up[...], self.shared_down[...], _value(self.shared_gate)))
        latent = (None if self.fc1_latent_proj is None
                  else tuple(_value(v) for v in (self.fc1_latent_proj, self.fc2_latent_proj,
                                                 self.fc1_latent_proj_bias,
                                                 self.fc2_latent_proj_bias)))
        tree = (x, router, expert_weights, shared, latent)
        dtype = self.dtype or jnp.result_type(*jax.tree.leaves(tree))
        return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        """Megatron's MoELayer.forward: hidden_states [S, B, H] (sequence first) -> (output
        [S, B, H], mlp_bias None). padding_mask: None or bool [B, S] (Megatron's [bsz,
        seq_length] argument; True marks padding, as __call__'s). The losses are not returned:
        while training (not deterministic) they are attached to the output by
        MoEAuxLossAutoScaler, so the gradient of any loss of the output carries theirs, as in
        Megatron; the counts go to local_tokens_per_expert for update_expert_bias(). The
        same computation as __call__ on the [B, S, H] transpose."""
        if intermediate_tensors is not None:
            raise ValueError("intermediate_tensors: expected None (Megatron's partial CUDA-graph "
                             "replay has no XLA counterpart: the whole step is one program)")
        if jnp.ndim(hidden_states) != 3:
            raise ValueError(f"hidden_states: expected [seq_length, batch, hidden_size], got "
                             f"shape {jnp.shape(hidden_states)}")
        y, aux = self(jnp.swapaxes(hidden_states, 0, 1), padding_mask)
        y = jnp.swapaxes(y, 0, 1)
        if not self.deterministic:  # Megatron attaches its losses while training only
            y = MoEAuxLossAutoScaler.apply(y, aux["aux_loss"])
        return y, None

    def _check_tensor_axis_bound(self):
        """Inside the user's shard_map: the tensor axis (ETP > 1) bound with ETP devices."""
        if not self.tensor_axis:
            return
        etp = self.config.expert_tensor_parallel_size
        try:
            size = jax.lax.axis_size(self.tensor_axis)
        except NameError:
            size = None
        if size != etp:
            raise ValueError(f"tensor_axis: MoEConfig.expert_tensor_parallel_size={etp} needs "
                             f"the enclosing shard_map to bind {self.tensor_axis!r} with {etp} "
                             f"devices, got {'no such axis' if size is None else size}")

    def _sharded(self, x, params):
        axis = self.dispatch_config.expert_axis_name
        if self.mesh is None:
            raise ValueError(f"mesh: the layer was built without a mesh, so call it inside a "
                             f"jax.shard_map that binds {axis!r}")
        token_axes = self._token_axes()
        devices = math.prod(self.mesh.shape[a] for a in token_axes)
        if x.ndim < 2 or x.shape[0] % devices:
            raise ValueError(f"x: expected [batch, ..., hidden_size] with batch divisible by the "
                             f"{devices} devices of mesh axes {token_axes}, got shape {x.shape}")
        tokens_spec = P(token_axes)
        router, _, shared, latent, expert_bias, tracker, padding, (force, jitter, forced) = \
            params
        t = self.tensor_axis
        router_spec = (P(), _spec_of(router[1], P()))
        experts_spec = (P(axis, None, t), P(axis, t, None), _spec_of(self.b_gate_up, P(axis, t)),
                        _spec_of(self.b_down, P(axis, None)))
        shared_spec = _spec_of(shared, (P(), P(), _spec_of(self.shared_gate, P())))
        latent_spec = _spec_of(latent, (P(), P(), _spec_of(self.fc1_latent_proj_bias, P()),
                                        _spec_of(self.fc2_latent_proj_bias, P())))
        in_specs = (tokens_spec, router_spec, experts_spec, shared_spec, latent_spec,
                    _spec_of(expert_bias, P()), _spec_of(tracker, (P(), P())),
                    _spec_of(padding, tokens_spec),
                    (_spec_of(force, P()), _spec_of(jitter, P()), _spec_of(forced, P())))
        fn = jax.shard_map(self._local, mesh=self.mesh, in_specs=in_specs,
                           out_specs=(tokens_spec, P(), P()))
        return fn(*_laid_out(self.mesh, (x, *params), in_specs))


# help(MoELayer) shows __init__'s signature (nnx.Module's metaclass hides it otherwise).
MoELayer.__signature__ = inspect.signature(MoELayer.__init__).replace(
    parameters=list(inspect.signature(MoELayer.__init__).parameters.values())[1:])


class MoEAuxLossAutoScaler:
    """Megatron's MoEAuxLossAutoScaler: `apply(output, aux_loss)` returns output unchanged and,
    in the backward pass, gives aux_loss f32[] the cotangent main_loss_backward_scale (1 unless
    `set_loss_scale` changed it), so the gradient of any loss of `output` also carries that of
    aux_loss: how Megatron's router adds its losses without returning them. The scale is a
    Python float read when `apply` is traced (Megatron reads it in the backward): set it
    before the first trace of a jitted step; a jitted function already traced keeps the scale
    it was traced with (jit's cache does not see the change). None (Megatron's initial value,
    which code resets it to) is 1."""

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def apply(output, aux_loss):
        check_array(output, "output")
        if is_real(aux_loss):
            aux_loss = jnp.asarray(aux_loss, jnp.float32)
        check_array(aux_loss, "aux_loss")
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        return _with_aux_loss(output, aux_loss, 1.0 if scale is None else scale)

    @staticmethod
    def set_loss_scale(scale):
        """The cotangent aux losses get from now on (Megatron sets 1 / the number of
        micro-batches when the main loss is scaled so): a finite number or a concrete 0-d
        array (Megatron passes a tensor); None restores the initial state (scale 1)."""
        if scale is not None:
            is_scalar = (hasattr(scale, "dtype") and jnp.ndim(scale) == 0
                         and scale.dtype != jnp.bool_)
            try:
                value = float(scale) if is_real(scale) or is_scalar else math.nan
            except jax.errors.ConcretizationTypeError:
                raise ValueError("scale: expected a concrete number (it is kept on the host), "
                                 "got a traced value") from None
            if not math.isfinite(value):
                raise ValueError(f"scale: expected a finite number, got {scale!r}")
            scale = value
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_aux_loss(output, aux_loss, scale):
    del aux_loss, scale
    return output


def _with_aux_loss_fwd(output, aux_loss, scale):
    return output, aux_loss


def _with_aux_loss_bwd(scale, aux_loss, d_output):
    # typed like aux_loss (varying over the same mesh axes), whatever its value (NaN included)
    return d_output, _ffi.vary_like(jnp.full(jnp.shape(aux_loss), scale, aux_loss.dtype),
                                    aux_loss)


_with_aux_loss.defvjp(_with_aux_loss_fwd, _with_aux_loss_bwd)


class TopKRouter(_RouterState, nnx.Module):
    """Megatron-Core's TopKRouter as an NNX module, for code written against the router alone
    (MoELayer routes the same way, with its own router weight [H,E]).

      config: a MoEConfig (or TokenDispatcherConfig); hidden_size H.
      weight: nnx.Param [E, H] (Megatron's layout), normal with std H^-0.5; bias: nnx.Param
        [E] (zeros) with config.add_bias_linear, else None (Megatron's router bias).
      expert_bias, local_tokens_per_expert, global_tokens_per_expert / ga_steps: as
        MoELayer's (update_expert_bias, reset_global_aux_loss_tracker); the counts are those
        of this router's training calls.
      topk, score_function, num_experts: K, the score function and E (Megatron's attributes).
      deterministic: Megatron's `not module.training` (sinkhorn routing, the tracker).
    gating(x [T,H]) -> logits [T,E] in moe_router_dtype (router_gating_linear).
    routing(logits [T,E], padding_mask=None, seq_len=1) -> (probs [T,E] in the logits' dtype,
      routing_map bool[T,E]): the layer's top-k (and sinkhorn, groups, expert bias, capacity
      drop), dense; the losses of the config over these T tokens only (seq_aux_loss over
      sequences of seq_len consecutive tokens; no reduction over other devices: Megatron
      all-reduces global_aux_loss's counts over its tp/dp/cp group, and aux_loss's over tp/cp
      when those are > 1; MoELayer sums over its mesh) attached to probs by
      MoEAuxLossAutoScaler while training (not deterministic), so a loss of probs carries
      their gradient, as in Megatron. padding_mask bool[T] (True: padding).
    __call__(x [..., H], padding_mask=None) -> routing(gating(x)) of x's tokens, x [B, S, H]
      as MoELayer's (seq_len is x's second-to-last axis); forward(input [S, B, H],
      padding_mask=None) is Megatron's sequence-first entry. With
      sow_aux the unscaled losses are sown as nnx.Intermediate "router_aux" (MoELayer's aux
      keys: aux_loss, load_balancing_loss(es), z_loss, ...).
    moe_router_force_load_balancing, moe_router_force_biased and moe_input_jitter_eps act in
    __call__ / forward as in Megatron's TopKRouter.forward (jitter the input, gate, replace the
    logits by random ones (plus the forced bias), route); `routing` alone applies none of them.
    The router keeps its own state, named as MoELayer's (force_balance_step, forced_bias,
    input_jitter_step; every __call__ adds 1 to each counter); the device index of their keys
    is this device's over every manual mesh axis inside shard_map, as Megatron seeds each rank
    (0 outside: one draw over all the tokens).
    """

    def __init__(self, config, hidden_size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 sow_aux: bool = False, deterministic: bool = False):
        config = _as_moe_config(config)
        E, H = config.num_moe_experts, check_positive(hidden_size, "hidden_size")
        _check_rngs(rngs)
        if not _is_float_dtype(param_dtype):
            raise ValueError(f"param_dtype: expected a float dtype, got {param_dtype!r}")
        self.config = config
        self.weight = nnx.Param(jax.nn.initializers.normal(H ** -0.5)(
            rngs.params(), (E, H), param_dtype))
        self.bias = (nnx.Param(jnp.zeros((E,), param_dtype)) if config.add_bias_linear
                     else None)
        self._init_router_state(config)
        self._init_draws(config, rngs)
        self.sow_aux = check_bool(sow_aux, "sow_aux")
        self.deterministic = check_bool(deterministic, "deterministic")

    @property
    def topk(self) -> int:
        return self.config.moe_router_topk

    @property
    def score_function(self) -> str:
        return self.config.moe_router_score_function

    @property
    def num_experts(self) -> int:
        return self.config.num_moe_experts

    def gating(self, x):
        """x [T,H] -> logits [T,E] = x @ weight^T (+ bias) in moe_router_dtype (None: x's
        dtype)."""
        H = self.weight.shape[1]
        check_float_weights(x, "x")
        if jnp.ndim(x) < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected [..., hidden_size={H}], got shape {jnp.shape(x)}")
        return _gate(x, self.weight[...], self.config, _value(self.bias))

    def routing(self, logits, padding_mask=None, seq_len: int = 1):
        cfg = self.config
        E = cfg.num_moe_experts
        check_array(logits, "logits")
        check_rank(logits, 2, "logits")
        check_shape(logits, (logits.shape[0], E), "logits")
        check_positive(seq_len, "seq_len")
        if "seq_aux_loss" in cfg.load_balancing_types() and logits.shape[0] % seq_len:
            raise ValueError(f"seq_len: expected a divisor of the {logits.shape[0]} tokens "
                             f"(seq_aux_loss reads them as sequences of seq_len), got {seq_len}")
        if padding_mask is not None:
            check_shape(padding_mask, (logits.shape[0],), "padding_mask")
            if padding_mask.dtype != bool:  # ~ of an int mask would weigh tokens -1 / -2
                raise ValueError(f"padding_mask: expected bool (True marks padding), got "
                                 f"{padding_mask.dtype}")
        valid = None if padding_mask is None else ~padding_mask.reshape(-1)
        self._check_quantile_padding(padding_mask)
        bias = self._choice_bias()
        probs, ids, dropped = _routed(logits, cfg, bias, not self.deterministic)
        self._accumulate_quantile(self._quantile(logits, bias))
        tracker = self._tracker()
        balancing, z, tracked = _losses(logits, seq_len, cfg, (), tracker=tracker, valid=valid)
        self._track(tracked, tracker)
        counts = _tokens_per_expert(ids, valid, cfg)
        self._count_tokens(counts)
        aux = _aux(cfg, balancing, z, counts, dropped.sum())
        if self.sow_aux:
            self.sow(nnx.Intermediate, "router_aux", aux)
        routing_map, dense = ops.indices_to_multihot(ids, probs, num_experts=E, impl="xla")
        if cfg.moe_pad_expert_input_to_capacity:  # Megatron: the map is the capacity mask
            dense, routing_map = routing.apply_router_token_dropping(
                dense, routing_map, cfg.moe_router_topk, cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy, pad_to_capacity=True)
        dense = dense.astype(logits.dtype)
        if not self.deterministic:  # Megatron attaches its losses while training only
            dense = MoEAuxLossAutoScaler.apply(dense, aux["aux_loss"])
        return dense, routing_map

    def __call__(self, x, padding_mask=None):
        H = self.weight.shape[1]
        _check_tokens(x, H, self.config)
        mask = _checked_padding_mask(padding_mask, x)
        tokens = x.reshape(-1, H)
        force_step, jitter_step, forced_bias = self._draws()
        noise_key, jitter_key = self._draw_keys(force_step, jitter_step, _device_index())
        logits = _forced_logits(self.gating(_jittered(tokens, jitter_key, self.config)),
                                noise_key, forced_bias)
        self._advance_draws()
        return self.routing(logits, None if mask is None else mask.reshape(-1),
                            x.shape[-2] if x.ndim > 2 else 1)

    def forward(self, input, padding_mask=None):
        """Megatron's TopKRouter.forward: input [S, B, H] (sequence first), padding_mask None
        or bool [S, B] (True: padding) -> (probs [S*B, E], routing_map bool[S*B, E]) with
        the tokens in Megatron's order (row s*B + b): __call__ on the [B, S, H] transpose
        (seq_aux_loss over the S tokens of each sequence), rows reordered."""
        check_array(input, "input")
        if padding_mask is not None:
            check_array(padding_mask, "padding_mask")
        if jnp.ndim(input) != 3:
            raise ValueError(f"input: expected [seq_length, batch, hidden_size], got shape "
                             f"{jnp.shape(input)}")
        if padding_mask is not None and jnp.shape(padding_mask) != jnp.shape(input)[:2]:
            raise ValueError(f"padding_mask: expected None or bool{list(jnp.shape(input)[:2])}"
                             f" ([seq_length, batch]), got shape {jnp.shape(padding_mask)}")
        seq, batch = input.shape[:2]
        probs, routing_map = self(jnp.swapaxes(input, 0, 1),
                                  None if padding_mask is None else jnp.swapaxes(padding_mask, 0,
                                                                                 1))
        return tuple(jnp.swapaxes(a.reshape(batch, seq, -1), 0, 1).reshape(seq * batch, -1)
                     for a in (probs, routing_map))


def _device_index():
    """This device's index (i32[]) over every manual mesh axis, in the mesh's order, inside
    shard_map (Megatron seeds each rank's draws by its rank); 0 outside."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
    return jax.lax.axis_index(axes) if axes else 0


def _check_tokens(x, hidden: int, cfg: MoEConfig):
    """x [..., hidden] (and [batch, seq, hidden] for seq_aux_loss), else ValueError."""
    check_array(x, "x")
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ValueError(f"x: expected real tokens, got {x.dtype}")
    if jnp.ndim(x) < 1 or x.shape[-1] != hidden:
        raise ValueError(f"x: expected [..., hidden_size={hidden}], got shape {jnp.shape(x)}")
    if "seq_aux_loss" in cfg.load_balancing_types() and jnp.ndim(x) < 3:
        raise ValueError(f"x: seq_aux_loss needs [batch, seq, hidden_size], got shape "
                         f"{jnp.shape(x)}")


def _checked_padding_mask(padding_mask, x):
    """padding_mask: None, or bool of x's shape without the hidden axis (True: a padding token,
    Megatron's convention) -> itself; else ValueError."""
    if padding_mask is None:
        return None
    if not hasattr(padding_mask, "dtype"):
        raise ValueError(f"padding_mask: expected None or a bool array, got "
                         f"{type(padding_mask).__name__}")
    if jnp.shape(padding_mask) != jnp.shape(x)[:-1] or padding_mask.dtype != bool:
        raise ValueError(f"padding_mask: expected None or bool{list(jnp.shape(x)[:-1])} (x's "
                         f"shape without the hidden axis; True marks padding), got "
                         f"{jnp.result_type(padding_mask)}{list(jnp.shape(padding_mask))}")
    return jnp.asarray(padding_mask)


def _rows_across_nodes(ids, num_experts, axes):
    """Rows this rank's tokens (ids i32[T,K]) send over the node axis of axes=(node, local)
    before drops: the two-hop dispatch's (token, other node) pairs and the flat exchange's
    (token, rank on another node) pairs, i32[] each."""
    node, num_nodes = transport.axis_rank_and_size(axes[0])
    num_ranks = num_nodes * transport.axis_rank_and_size(axes[1])[1]
    per_node = ops.get_dispatch_layout(ids, num_experts=num_experts, num_ranks=num_nodes)[0]
    per_rank = ops.get_dispatch_layout(ids, num_experts=num_experts, num_ranks=num_ranks)[0]
    own_ranks = num_ranks // num_nodes
    on_own_node = jax.lax.dynamic_slice_in_dim(per_rank, node * own_ranks, own_ranks).sum()
    return per_node.sum() - per_node[node], per_rank.sum() - on_own_node


def _latent_up(y, latent):
    """The combined rows y [T, moe_latent_size] projected back to the hidden size: [T,H]. With
    no token (T = 0) the projection is not built: its weight gradient y^T dy would be a
    shard_map body of constants only, which XLA's Shardy pass cannot compile; the weights'
    gradient is zero either way."""
    if y.shape[0] == 0:
        return jnp.zeros((0, latent[1].shape[1]), jnp.result_type(y, latent[1]))
    return _linear(y, latent[1], latent[3])


def _tensor_axis(tensor_axis, etp, mesh, other_axes):
    """The layer's tensor axis name (None when etp = expert_tensor_parallel_size is 1); a
    mesh's axis of that name must have etp devices and be none of the layer's other axes."""
    if etp > 1 and tensor_axis is None:
        raise ValueError(f"tensor_axis: MoEConfig.expert_tensor_parallel_size={etp} needs a "
                         f"tensor mesh axis name, got None")
    if etp > 1 and tensor_axis in other_axes:
        raise ValueError(f"tensor_axis: {tensor_axis!r} is the layer's data or expert axis")
    if mesh is not None:
        size = mesh.shape[tensor_axis] if tensor_axis in mesh.axis_names else None
        if (size or 1) != etp:
            raise ValueError(f"mesh: MoEConfig.expert_tensor_parallel_size={etp} needs a "
                             f"tensor axis {tensor_axis!r} (tensor_axis) of {etp} devices; the "
                             f"mesh {dict(mesh.shape)} has "
                             f"{'none' if size is None else size}")
    return tensor_axis if etp > 1 else None


def _value(variable):
    """An optional nnx.Variable's value, None for None."""
    return None if variable is None else variable[...]


def _spec_of(value, spec):
    """A shard_map in_spec for an optional argument: None where the value is None."""
    return None if value is None else spec


def _names(axis):
    """The mesh axis names of an expert axis (a name or a (node, local) pair) as a tuple."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _spec_axes(spec):
    """The mesh axis names a PartitionSpec shards over, as a set."""
    return {name for part in spec if part is not None for name in _names(part)}


def _laid_out(mesh, args, specs):
    """args resharded to their shard_map in_specs where the mesh axes are Explicit: there
    shard_map takes only inputs already laid out as it says (not a batch split over "data"
    alone, nor one made inside jit), while with Auto axes it reshards them itself. An arg may
    be None or a tuple of arrays (with a tuple of specs)."""
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit}

    def place(a, spec):
        if a is None:
            return None
        if isinstance(a, tuple):
            return tuple(place(u, v) for u, v in zip(a, spec))
        if explicit and _spec_axes(spec) <= explicit:
            return jax.sharding.reshard(a, NamedSharding(mesh, spec))
        return a

    return tuple(place(a, spec) for a, spec in zip(args, specs))


def _unsharded(a):
    """a with the Explicit mesh axes of its type gathered (a itself where it has none): the
    dense reference multiplies every token by every expert and picks rows by routed id, which
    Explicit axes would have to say how to shard."""
    sharding = jax.typeof(a).sharding
    explicit = set(getattr(sharding.mesh, "explicit_axes", ()))
    return (jax.sharding.reshard(a, sharding.update(spec=P()))
            if _spec_axes(sharding.spec) & explicit else a)


def dense_forward(layer: MoELayer, x, num_devices=None, padding_mask=None):
    """Single-device reference of `layer` (no expert parallelism): the oracle the layer is
    tested against. x [B, ..., H] is taken as num_devices equal blocks of the batch (default:
    the devices of the layer's token mesh axes, 1 without a mesh), each routed, dropped to
    capacity and counted in the losses as that device does (with force load balancing and
    input jitter: by the random draws of the layer's next call); padding_mask as the layer's.
    A gated w_gate_up (and b_gate_up) is read in the layout of
    config.expert_tensor_parallel_size column shards (`gate_up_from_etp`; an interleaved one,
    moe_mlp_glu_interleave_size, as it is). Returns (y [..., H], aux_loss f32[]: what the
    layer reports as aux["aux_loss"])."""
    cfg = layer.config
    if num_devices is None:
        num_devices = (1 if layer.mesh is None
                       else math.prod(layer.mesh.shape[a] for a in layer._token_axes()))
    check_array(x, "x")
    check_positive(num_devices, "num_devices")
    if jnp.ndim(x) < 2 or math.prod(jnp.shape(x)[:-1]) % num_devices:
        raise ValueError(f"x: expected [B, ..., H] tokens in num_devices={num_devices} equal "
                         f"blocks, got shape {jnp.shape(x)}")
    # one device's computation: arrays on a mesh with Explicit axes are gathered first
    x, router, (w_gate_up, w_down, b_gate_up, b_down), shared, latent = jax.tree.map(
        _unsharded, layer._weights(x))
    padding_mask = None if padding_mask is None else _unsharded(padding_mask)
    if cfg.gated_linear_unit and cfg.moe_mlp_glu_interleave_size is None:
        w_gate_up, b_gate_up = (None if a is None else
                                gate_up_from_etp(a, cfg.expert_tensor_parallel_size)
                                for a in (w_gate_up, b_gate_up))
    tokens = x.reshape(-1, x.shape[-1])
    bias = layer._choice_bias()
    blocks = tokens.reshape(num_devices, -1, tokens.shape[-1])
    draws = layer._draws()
    keys = jax.vmap(lambda device: layer._draw_keys(*draws[:2], device))(jnp.arange(num_devices))
    logits, probs, ids, _ = jax.vmap(lambda t, k: _route(
        t, router, cfg, bias, not layer.deterministic, *k, draws[2]))(blocks, keys)
    logits, probs, ids = (a.reshape(-1, a.shape[-1]) for a in (logits, probs, ids))
    padding = _checked_padding_mask(padding_mask, x)
    balancing, z, _ = _losses(logits, x.shape[-2] if x.ndim > 2 else 1, cfg, (), num_devices,
                              layer._tracker(), None if padding is None else ~padding.reshape(-1))
    activation = cfg.gated_activation()
    inputs = tokens if latent is None else _linear(tokens, latent[0], latent[2])
    # with moe_apply_probs_on_input (K = 1) every expert sees the token times its prob
    if cfg.moe_apply_probs_on_input:
        inputs = _weighted(inputs, probs[:, 0])
    every = jax.vmap(lambda *w: _ffn(inputs, *w[:2], activation, *w[2:]))(
        w_gate_up, w_down, b_gate_up, b_down)
    picked = every[jnp.maximum(ids, 0), jnp.arange(tokens.shape[0])[:, None]]  # [T,K,D]
    if not cfg.moe_apply_probs_on_input:
        picked = _weighted(picked, probs)
    y = jnp.sum(jnp.where((ids >= 0)[..., None], picked, 0), axis=1)  # dropped slots: none
    if latent is not None:
        y = _linear(y, latent[1], latent[3])
    if shared is not None:
        y = y + _shared_expert(tokens, shared, cfg.gated_activation(shared=True))
    return y.reshape(x.shape), _scaled(cfg, balancing, z)


def shard_params(model, mesh):
    """Places all nnx state of `model` on `mesh` by its sharding metadata (experts over the
    expert axis, the rest replicated), spelled as a jitted step returns it:
    `shard_state(model, None, mesh)` (see there; pass the optimizer to shard_state too, or
    its step counter recompiles step 2). Returns model."""
    return shard_state(model, None, mesh)[0]

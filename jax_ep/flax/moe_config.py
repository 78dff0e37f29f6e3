"""MoEConfig: Megatron-Core's MoE fields (router, losses, capacity, expert sizes), same names and
defaults as megatron.core.transformer.TransformerConfig, plus the TokenDispatcherConfig the
layer's dispatcher uses. `MoEConfig.from_dict` takes a pasted Megatron/flex-dispatcher config."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping

import numpy as np

from jax_ep._checks import MAX_INT32, is_int, is_real
from jax_ep.config import ROUTER_DTYPES, TokenDispatcherConfig
from jax_ep.flax.activations import GatedActivation, activation_name

__all__ = ["AUX_LOSS_TYPES", "DROP_POLICIES", "LOAD_BALANCING_TYPES", "MoEConfig",
           "SCORE_FUNCTIONS", "megatron_fields"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                        "quantile_balancing", "none")
# The types that add a loss (each with its own coefficient), in the order Megatron applies them.
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
# Fields MoEConfig and TokenDispatcherConfig share: MoEConfig's value is the one used.
SHARED_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_expert_capacity_factor",
                 "moe_router_dtype")


def _require(ok, field, allowed, value):
    if not ok:
        raise ValueError(f"MoEConfig.{field}: expected {allowed}, got {value!r}")


def _real(value, minimum=0.0, strict=False):
    ok = is_real(value) and math.isfinite(value)
    return ok and (value > minimum if strict else value >= minimum)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Megatron-Core MoE configuration (field names and defaults of TransformerConfig).

      num_moe_experts E (required), moe_router_topk K.
      moe_ffn_hidden_size: each expert's SwiGLU hidden size F (None: pass ffn_hidden_size to
        MoELayer). moe_shared_expert_intermediate_size: an always-on shared SwiGLU expert of
        that hidden size (None: none).
      moe_router_score_function: "softmax", "sigmoid" or "sqrtsoftplus" (Megatron core 0.18's
        sqrt(softplus(logits))). moe_router_pre_softmax: softmax over all E logits before top-k
        (else top-k of the logits, softmax over the K chosen; must be True when K = 1 with
        softmax scores, Megatron's rule; ignored with sigmoid / sqrtsoftplus, as Megatron).
        Sigmoid and sqrtsoftplus scores are renormalised over the K chosen (when K > 1).
      moe_router_topk_scaling_factor: the top-k probs times this (None or 0: 1, as Megatron).
      moe_router_num_groups, moe_router_group_topk: node-limited routing (DeepSeek-V3): E
        experts in that many contiguous groups, a group scored by the sum of its top
        K // group_topk scores, top-K among the best group_topk groups only (group_topk in
        [1, min(num_groups, K)]; num_groups alone routes without groups, as Megatron).
      moe_router_enable_expert_bias: aux-loss-free balancing (sigmoid / sqrtsoftplus only, as
        Megatron): a
        non-trainable f32[E] bias added to the scores for the top-k choice only, updated by
        `MoELayer.update_expert_bias` with step moe_router_bias_update_rate.
      moe_router_load_balancing_type: "aux_loss" (per device's tokens, averaged over devices),
        "seq_aux_loss" (per sequence, averaged over sequences), "global_aux_loss" (over the
        global batch, its expert counts a running mean over the micro-batches of a step, as
        Megatron's), "sinkhorn" (experts chosen by top-k of Sinkhorn-balanced scores while
        training; needs moe_aux_loss_coeff 0 and no capacity factor), "quantile_balancing"
        (Megatron's dual quantile balancing: the top-k of logits - qb_beta, a per-expert bias
        moved once per optimizer step by `MoELayer.update_quantile_balancing` towards the
        quantile that gives every expert T*K/E of a device's T tokens, EMA
        moe_router_quantile_balancing_ema; needs moe_aux_loss_coeff 0, no groups, no expert
        bias, T*K divisible by E, no padding mask), or "none"; or a list /
        tuple of the loss types (Megatron >= core 0.14), each with its coefficient at the same
        index of moe_aux_loss_coeff (a list of the same length); lists never route by
        sinkhorn (Megatron's rule: only the plain string does). Kept as tuples.
        moe_aux_loss_coeff: the weight (0: that loss is off, not computed).
      moe_z_loss_coeff: weight of the router z-loss mean(logsumexp(logits)^2) (None: off).
      moe_expert_capacity_factor: None (or negative, made None as Megatron) = no drop; else
        each expert keeps at most ceil(T*K/E * factor) of a device's T tokens, chosen by
        moe_token_drop_policy: "probs" (the highest probabilities) or "position" (the first in
        token order).
      moe_pad_expert_input_to_capacity: Megatron's drop-and-pad (needs a capacity factor): the
        MoELayer pads every local expert's input block to its capacity, P * ceil(T*K/E *
        factor) rows, so each expert computes exactly that many rows (Megatron's
        tokens_per_expert = cap * EP), as one batched GEMM per weight over [L, C, H]
        (swiglu_expert_blocks; the grouped GEMM with expert tensor parallelism). Padding rows
        carry probability 0 (zero rows here, real unrouted tokens in Megatron), so outputs and
        gradients are those without it.
      moe_router_dtype: "fp32", "fp64" or None (the input dtype) for the logits and the probs;
        the scores between them are computed in at least float32 (Megatron's precision).
      moe_router_force_load_balancing: Megatron's benchmark switch (its perf recipes set it):
        the router's logits are replaced by standard normal ones (`router.apply_random_logits`,
        a new draw per layer, call and device: the layer's (or TopKRouter's)
        `ForceBalanceStep` counter and the device's index), the gradient passing straight
        through to the router weights, so the routing is balanced whatever the weights.
      moe_router_force_biased: None, or std: Megatron's skewed benchmark routing
        (`router.apply_biased_logits`): the random logits of force load balancing plus a bias
        f32[E] of normal(0, |std|) values that every device shares, so some experts get more
        tokens than others. std > 0: a new bias per call (key `force_biased_key` of the
        layer's `ForceBalanceStep` counter, no device index); std < 0: one bias per layer,
        |std| times the standard normal draw made at init (the layer's `ForcedBias`
        variable). The gradient passes straight through to the router weights (none to the
        bias).
      moe_input_jitter_eps: None, or eps >= 0: while training (not deterministic) the
        router's input is multiplied by noise uniform in [1 - eps, 1 + eps] (Switch
        Transformer's jitter), a new draw per layer, call and device (the layer's
        `InputJitterStep` counter and the device's index); the experts see the input
        unchanged. Megatron jitters in eval too; here eval routes the input as it is.
      moe_apply_probs_on_input: the router's probs scale each expert's input rows instead of
        its output (Llama 4's experts); Megatron's rule: only with moe_router_topk 1.
      moe_shared_expert_gate: the shared expert's output is scaled by sigmoid(x @
        shared_gate), shared_gate [H, 1] a parameter (Megatron's gate_weight [1, H]
        transposed; Qwen2-MoE's shared_expert_gate). No effect without a shared expert, as in
        Megatron.
      moe_latent_size: None, or D: latent MoE (Nemotron 3 Super / Ultra): the tokens are
        projected H -> D (fc1_latent_proj [H,D]) after the router and before the dispatch, the
        experts work in D (w_gate_up [E,D,2F], w_down [E,F,D]), the combined rows are projected
        D -> H (fc2_latent_proj [D,H]); the wire moves D-wide rows. The router and the shared
        expert see the full H, as Megatron's. With add_bias_linear both projections get a bias.
      token_dispatcher: the dispatcher's TokenDispatcherConfig (backend, transport, buffer
        sizes, ...); its fields num_moe_experts, moe_router_topk, moe_expert_capacity_factor
        and moe_router_dtype are replaced by this config's (see `dispatcher_config`).
      expert_tensor_parallel_size: Megatron's ETP (ModelParallelConfig's name; default 1
        here, not Megatron's tensor_model_parallel_size): each expert's FFN split over that
        many devices of the layer's tensor mesh axis (see MoELayer); must divide the FFN
        hidden size.
      gated_linear_unit, activation_func, glu_linear_offset, activation_func_clamp_value:
        the experts' (and the shared expert's) activation, TransformerConfig's fields. Gated
        (True, the default here; Megatron's default is a non-gated GELU MLP): fc1 gives
        [gate | up] (w_gate_up [L,H,2F]) and the experts compute activation_func(gate) * (up
        + glu_linear_offset); activation_func_clamp_value c clamps gate to at most c and up to
        [-c, c] first (gpt-oss: quick_gelu, offset 1.0, clamp 7.0). Not gated (False,
        Megatron's MLP experts): fc1 gives F columns (w_gate_up [L,H,F]) and the experts
        compute activation_func(fc1), offset and clamp unused as in Megatron (Nemotron's
        experts: squared_relu). activation_func one of ACTIVATION_FUNCS, None (the default)
        meaning "silu" for gated experts (SwiGLU) and "gelu" for MLP experts (Megatron's
        default F.gelu); it holds the name after construction: "silu", "gelu" (exact),
        "gelu_tanh" (Gemma's GEGLU gated), "quick_gelu" (x *
        sigmoid(1.702 x)), "relu", "squared_relu" (relu(x)^2); torch's and Megatron's
        functions of these names (F.silu, F.gelu, F.relu, quick_gelu, squared_relu) and
        jax.nn.silu / jax.nn.relu are read as the name, other functions refused (jax.nn.gelu
        is tanh by default: pass "gelu" or "gelu_tanh").
      moe_mlp_glu_interleave_size: None, or s: the routed experts' gated fc1 output (so
        w_gate_up's columns and b_gate_up) in Megatron's block-interleaved layout, blocks of s
        columns alternating gate and up (`activations.remove_glu_interleaving`), instead of
        [gate | up]; s must divide F / expert_tensor_parallel_size. Under expert tensor
        parallelism the layout needs no per-rank reordering (each contiguous column shard
        is whole blocks: `gate_up_to_etp` is not applied to it). The shared expert stays [gate
        | up] (Megatron's moe_shared_expert_glu_interleave_size is accepted at None only). A
        non-gated fc1 ignores it, as in Megatron.
      add_bias_linear: TransformerConfig's field (Megatron's default True; False here, as the
        MoE recipes set --disable-bias-linear): the router's logits get a bias [E] and every
        expert's fc1 and fc2 a bias (b_gate_up [E, 2F] or [E, F], b_down [E, H], or [E, D]
        with moe_latent_size; gpt-oss's experts), all starting at zero (Megatron draws its
        router's bias from init_method, its TE linears' biases are zero); the fc2 bias is
        weighted by the token's prob with the rest of the expert's output, as Megatron's.
        With expert_tensor_parallel_size > 1 the fc1 bias is split with fc1's columns and the
        fc2 bias added once after the reduction (Megatron refuses biases with ETP > 1).
        Refused with a shared expert (Megatron's rule).
    Invalid values raise ValueError naming the field.
    """

    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_aux_loss_coeff: float | tuple[float, ...] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_router_dtype: str | None = None
    moe_router_force_load_balancing: bool = False
    moe_router_force_biased: float | None = None
    token_dispatcher: TokenDispatcherConfig = dataclasses.field(
        default_factory=TokenDispatcherConfig)
    expert_tensor_parallel_size: int = 1
    gated_linear_unit: bool = True
    activation_func: str | None = None
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    moe_mlp_glu_interleave_size: int | None = None
    add_bias_linear: bool = False
    moe_input_jitter_eps: float | None = None
    moe_apply_probs_on_input: bool = False
    moe_shared_expert_gate: bool = False
    moe_latent_size: int | None = None
    moe_router_quantile_balancing_ema: float = 0.0

    def __post_init__(self):
        E, K = self.num_moe_experts, self.moe_router_topk
        _require(is_int(E) and E <= MAX_INT32, "num_moe_experts", f"a positive int <= {MAX_INT32}",
                 E)
        # K > E is accepted, as Megatron's TransformerConfig accepts it (its tests build such
        # a layer); MoELayer refuses it when called (the router cannot pick K of E experts).
        _require(is_int(K) and K <= MAX_INT32, "moe_router_topk", f"a positive int <= {MAX_INT32}",
                 K)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "moe_latent_size"):
            v = getattr(self, name)
            _require(v is None or is_int(v), name, "None or a positive int", v)
        _require(self.moe_router_score_function in SCORE_FUNCTIONS,
                 "moe_router_score_function", f"one of {SCORE_FUNCTIONS}",
                 self.moe_router_score_function)
        for name in ("moe_router_pre_softmax", "moe_router_enable_expert_bias",
                     "moe_pad_expert_input_to_capacity", "moe_router_force_load_balancing",
                     "moe_apply_probs_on_input", "moe_shared_expert_gate"):
            _require(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        _require(K != 1 or self.moe_router_pre_softmax or self.sinkhorn
                 or self.moe_router_score_function != "softmax", "moe_router_pre_softmax",
                 "True when moe_router_topk is 1 with softmax scores (Megatron's rule: a "
                 "softmax over one logit is 1, and the router would get no gradient)",
                 self.moe_router_pre_softmax)
        s = self.moe_router_topk_scaling_factor
        _require(s is None or _real(s), "moe_router_topk_scaling_factor",
                 "None or a float >= 0 (0 scales nothing, as Megatron)", s)
        self._check_groups()
        _require(not self.moe_router_enable_expert_bias
                 or self.moe_router_score_function != "softmax", "moe_router_enable_expert_bias",
                 "False unless moe_router_score_function is 'sigmoid' or 'sqrtsoftplus' "
                 "(Megatron's rule)",
                 self.moe_router_enable_expert_bias)
        _require(_real(self.moe_router_bias_update_rate), "moe_router_bias_update_rate",
                 "a float >= 0", self.moe_router_bias_update_rate)
        self._check_load_balancing()
        z = self.moe_z_loss_coeff
        _require(z is None or _real(z), "moe_z_loss_coeff", "None or a float >= 0", z)
        f = self.moe_expert_capacity_factor
        if _real(f, -math.inf) and f < 0:
            object.__setattr__(self, "moe_expert_capacity_factor", f := None)  # Megatron: dropless
        _require(f is None or _real(f, strict=True), "moe_expert_capacity_factor",
                 "None, a negative number (dropless) or a positive finite float", f)
        _require(not self.moe_pad_expert_input_to_capacity or f is not None,
                 "moe_pad_expert_input_to_capacity", "False without moe_expert_capacity_factor",
                 self.moe_pad_expert_input_to_capacity)
        _require(self.moe_token_drop_policy in DROP_POLICIES, "moe_token_drop_policy",
                 f"one of {DROP_POLICIES}", self.moe_token_drop_policy)
        _require(self.moe_router_dtype in ROUTER_DTYPES, "moe_router_dtype",
                 f"one of {ROUTER_DTYPES}", self.moe_router_dtype)
        _require(isinstance(self.token_dispatcher, TokenDispatcherConfig), "token_dispatcher",
                 "a TokenDispatcherConfig", self.token_dispatcher)
        etp = self.expert_tensor_parallel_size
        _require(is_int(etp) and (self.moe_ffn_hidden_size or etp) % etp == 0,
                 "expert_tensor_parallel_size",
                 f"a positive int dividing moe_ffn_hidden_size={self.moe_ffn_hidden_size}", etp)
        self._check_activation()
        if self.moe_ffn_hidden_size:
            self.check_glu_interleave(self.moe_ffn_hidden_size)
        eps = self.moe_input_jitter_eps
        _require(eps is None or _real(eps), "moe_input_jitter_eps", "None or a float >= 0",
                 eps)
        std = self.moe_router_force_biased
        _require(std is None or _real(std, -math.inf, strict=True), "moe_router_force_biased",
                 "None or a finite float (the bias's std; negative: drawn once per layer)", std)
        _require(not self.moe_apply_probs_on_input or K == 1, "moe_apply_probs_on_input",
                 "False unless moe_router_topk is 1 (Megatron's rule)",
                 self.moe_apply_probs_on_input)
        _require(isinstance(self.add_bias_linear, bool) and not (
            self.add_bias_linear and self.moe_shared_expert_intermediate_size),
                 "add_bias_linear", "a bool, False with a shared expert (Megatron's rule: "
                 "the shared expert has no bias)", self.add_bias_linear)
        self.dispatcher_config()  # the merged dispatcher config must be valid too

    def _check_activation(self):
        _require(isinstance(self.gated_linear_unit, bool), "gated_linear_unit", "a bool",
                 self.gated_linear_unit)
        func = self.activation_func
        if func is None:  # SwiGLU experts, or Megatron's default F.gelu for its MLP experts
            func = "silu" if self.gated_linear_unit else "gelu"
        try:
            object.__setattr__(self, "activation_func", activation_name(func))
            self.gated_activation()
        except ValueError as e:
            raise ValueError(f"MoEConfig.{e}") from None
        swiglu_clamped = (self.gated_linear_unit and self.activation_func == "silu"
                          and self.activation_func_clamp_value is not None)
        _require(not swiglu_clamped or self.glu_linear_offset == 0.0, "glu_linear_offset",
                 "0 when activation_func_clamp_value is set for SwiGLU (Megatron's rule)",
                 self.glu_linear_offset)

    def check_glu_interleave(self, ffn_hidden_size: int) -> None:
        """ValueError naming moe_mlp_glu_interleave_size unless its blocks tile each expert
        tensor parallel shard's F / expert_tensor_parallel_size units (gated experts)."""
        s, etp = self.moe_mlp_glu_interleave_size, self.expert_tensor_parallel_size
        _require(s is None or not self.gated_linear_unit or ffn_hidden_size // etp % s == 0,
                 "moe_mlp_glu_interleave_size",
                 f"a divisor of the FFN units per expert tensor parallel rank "
                 f"({ffn_hidden_size} // {etp})", s)

    def gated_activation(self, shared: bool = False) -> GatedActivation:
        """The routed experts' activation these fields describe (shared=True: the shared
        expert's, never interleaved): fc1's output [..., 2F] (gated) or [..., F] -> [..., F]."""
        interleave = None if shared else self.moe_mlp_glu_interleave_size
        return GatedActivation(self.activation_func, self.glu_linear_offset,
                               self.activation_func_clamp_value, self.gated_linear_unit,
                               interleave)

    def _check_load_balancing(self):
        kind, coeff = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(kind, list):
            object.__setattr__(self, "moe_router_load_balancing_type", kind := tuple(kind))
        if isinstance(coeff, list):
            object.__setattr__(self, "moe_aux_loss_coeff", coeff := tuple(coeff))
        if isinstance(kind, str):
            _require(kind in LOAD_BALANCING_TYPES, "moe_router_load_balancing_type",
                     f"one of {LOAD_BALANCING_TYPES} or a list of them", kind)
            _require(_real(coeff), "moe_aux_loss_coeff", "a float >= 0 (one type)", coeff)
        else:
            _require(isinstance(kind, tuple) and len(kind) > 0
                     and all(isinstance(k, str) and k in LOAD_BALANCING_TYPES for k in kind)
                     and len(set(kind)) == len(kind),
                     "moe_router_load_balancing_type", f"one of {LOAD_BALANCING_TYPES} or a "
                     f"non-empty list of distinct ones", kind)
            _require(isinstance(coeff, tuple) and len(coeff) == len(kind)
                     and all(_real(c) for c in coeff), "moe_aux_loss_coeff",
                     f"a list of {len(kind)} floats >= 0, one per load-balancing type", coeff)
        if kind == "sinkhorn":
            _require(coeff == 0, "moe_aux_loss_coeff",
                     "0 with moe_router_load_balancing_type='sinkhorn' (Megatron's rule)", coeff)
        self._check_quantile_balancing(kind, coeff)
        if self.moe_expert_capacity_factor is not None:
            _require("sinkhorn" not in self.load_balancing_types(),
                     "moe_router_load_balancing_type",
                     f"one of {AUX_LOSS_TYPES + ('none',)} (each entry) with "
                     f"moe_expert_capacity_factor (Megatron's rule)", kind)

    def _check_quantile_balancing(self, kind, coeff):
        """Megatron's rules for "quantile_balancing" (a plain string type: in a list Megatron
        never reads it): no aux loss, no group-limited routing; and no expert bias (the
        quantile bias alone picks the experts)."""
        ema = self.moe_router_quantile_balancing_ema
        _require(_real(ema) and ema <= 1, "moe_router_quantile_balancing_ema",
                 "a float in [0, 1]", ema)
        if kind == "quantile_balancing":
            _require(coeff == 0, "moe_aux_loss_coeff", "0 with moe_router_load_balancing_type="
                     "'quantile_balancing' (Megatron's rule: the bias balances the load)", coeff)
            _require(self.moe_router_num_groups is None and self.moe_router_group_topk is None,
                     "moe_router_num_groups", "None with quantile balancing (Megatron's rule)",
                     self.moe_router_num_groups)
            _require(not self.moe_router_enable_expert_bias, "moe_router_enable_expert_bias",
                     "False with quantile balancing (its own per-expert bias picks the "
                     "experts; Megatron would ignore the expert bias)",
                     self.moe_router_enable_expert_bias)
        else:
            _require("quantile_balancing" not in self.load_balancing_types(),
                     "moe_router_load_balancing_type", "'quantile_balancing' as a plain string "
                     "(Megatron reads it only so)", kind)

    @property
    def quantile_balancing(self) -> bool:
        """Whether the router picks experts by quantile balancing (the plain string type)."""
        return self.moe_router_load_balancing_type == "quantile_balancing"

    def load_balancing_types(self) -> tuple[str, ...]:
        """moe_router_load_balancing_type as a tuple (a string type: a tuple of one)."""
        kind = self.moe_router_load_balancing_type
        return (kind,) if isinstance(kind, str) else kind

    @property
    def moe_token_dispatcher_type(self) -> str:
        """Megatron's dispatcher choice, read from token_dispatcher: "alltoall" for the
        alltoall backend, else "flex" (MoEConfig.from_dict reads Megatron's field into the
        backend; the config is frozen, so set it there or with dataclasses.replace on
        token_dispatcher)."""
        backend = self.token_dispatcher.moe_flex_dispatcher_backend
        return "alltoall" if backend == "alltoall" else "flex"

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of load-balancing loss `kind` (Megatron's get_aux_loss_coeff): the
        coefficient at kind's index of a list type, moe_aux_loss_coeff when the type is the
        string kind, else 0."""
        types = self.moe_router_load_balancing_type
        if isinstance(types, str):
            return float(self.moe_aux_loss_coeff) if types == kind else 0.0
        return float(self.moe_aux_loss_coeff[types.index(kind)]) if kind in types else 0.0

    def aux_losses(self) -> tuple[str, ...]:
        """The load-balancing losses this config computes: those of AUX_LOSS_TYPES with a
        coefficient above 0, in Megatron's order."""
        return tuple(k for k in AUX_LOSS_TYPES if self.aux_loss_coeff(k) > 0)

    @property
    def sinkhorn(self) -> bool:
        """Whether the router chooses experts by sinkhorn (the plain string type only)."""
        return self.moe_router_load_balancing_type == "sinkhorn"

    def _check_groups(self):
        E, K = self.num_moe_experts, self.moe_router_topk
        groups, top = self.moe_router_num_groups, self.moe_router_group_topk
        # None or an int (0 is off, as Megatron tests them for truth)
        _require(groups is None or is_int(groups, 0), "moe_router_num_groups",
                 "None or an int >= 0", groups)
        _require(top is None or is_int(top, 0), "moe_router_group_topk", "None or an int >= 0",
                 top)
        _require(groups is not None or not top, "moe_router_group_topk",
                 "None unless moe_router_num_groups is set (Megatron's rule)", top)
        if not top:  # as Megatron, moe_router_num_groups alone routes without groups
            return
        _require(is_int(groups) and E % groups == 0, "moe_router_num_groups",
                 f"a positive divisor of num_moe_experts={E}", groups)
        _require(is_int(top) and top <= min(groups, K) and K <= top * (E // groups),
                 "moe_router_group_topk",
                 f"an int in [1, min(moe_router_num_groups={groups}, moe_router_topk={K})] whose "
                 f"groups hold at least K experts (a group scores its top K // group_topk "
                 f"experts: 0 of them above K)", top)

    def dispatcher_config(self) -> TokenDispatcherConfig:
        """The TokenDispatcherConfig the layer's dispatcher uses: token_dispatcher with the
        shared fields (num_moe_experts, moe_router_topk, moe_expert_capacity_factor,
        moe_router_dtype) taken from this config."""
        return dataclasses.replace(self.token_dispatcher,
                                   **{name: getattr(self, name) for name in SHARED_FIELDS})

    @classmethod
    def from_dict(cls, fields: dict, *, ignore_unknown: bool = False) -> "MoEConfig":
        """A config from a flat dict of Megatron MoE fields and TokenDispatcherConfig fields
        (what a PyTorch user has: e.g. `vars(args)` restricted to the MoE ones). Megatron's
        fields that choose an implementation are read as `megatron_fields` says. Unknown names
        raise ValueError listing them, or with ignore_unknown=True warn (UserWarning) listing
        them and are skipped."""
        if not isinstance(ignore_unknown, (bool, np.bool_)):
            raise ValueError(f"MoEConfig.from_dict: ignore_unknown: expected a bool, got "
                             f"{ignore_unknown!r}")
        fields = megatron_fields(fields)
        own = {f.name for f in dataclasses.fields(cls)} - {"token_dispatcher"}
        disp = {f.name for f in dataclasses.fields(TokenDispatcherConfig)}
        unknown = sorted(set(fields) - own - disp)
        if unknown and not ignore_unknown:
            raise ValueError(f"MoEConfig.from_dict: unknown fields {unknown} (neither Megatron "
                             f"MoE fields of MoEConfig nor TokenDispatcherConfig fields; pass "
                             f"ignore_unknown=True to skip them with a warning)")
        if unknown:
            warnings.warn(f"MoEConfig.from_dict: ignoring unknown fields {unknown}",
                          stacklevel=2)
        dispatcher = TokenDispatcherConfig(**{k: v for k, v in fields.items()
                                              if k in disp and k not in SHARED_FIELDS})
        return cls(**{k: v for k, v in fields.items() if k in own},
                   token_dispatcher=dispatcher)


# Megatron's dispatcher types and the backend that gives their results here.
_DISPATCHER_TYPES = {"alltoall": "alltoall", "allgather": "alltoall", "flex": None}
# Megatron's Fp8Recipe values (fp8_recipe is read for the padding multiple only)
_FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")
# Megatron fields that pick a kernel, a schedule, a memory plan or logging, not a result:
# accepted, no effect under XLA.
_KERNEL_CHOICES = ("moe_grouped_gemm", "moe_router_fusion", "moe_use_legacy_grouped_gemm",
                   "expert_model_parallel_size", "moe_layer_recompute",
                   "moe_shared_expert_overlap", "moe_per_layer_logging",
                   "moe_flex_dispatcher_num_sms", "moe_single_grouped_weight",
                   "moe_single_grouped_bias", "moe_use_grouped_tensor", "moe_paged_stash",
                   "moe_paged_stash_buffer_size_factor_cpu",
                   "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_page_size",
                   "moe_pad_experts_for_cuda_graph_inference", "moe_ncclep_zero_copy",
                   "moe_hybridep_pad_uneven_dispatch_inputs", "moe_layer_freq")
# Megatron fields jax_ep has only at their default: (default, why, what to use instead).
_DEFAULT_ONLY = {
    "moe_enable_routing_replay": (False, "router replay has no XLA counterpart", None),
    "moe_token_dropping": (False, "Megatron's legacy switch (unsupported there too)",
                           "moe_expert_capacity_factor"),
    "moe_shared_expert_glu_interleave_size": (None, "the shared expert is a dense FFN here "
                                              "(Megatron reads it with a grouped-GEMM shared "
                                              "expert only)", None),
    "moe_dispatch_fwd_dtype": ("bf16", "MXFP8 on the wire is the ncclep backend's",
                               "moe_fp8_dispatch"),
    "moe_combine_bwd_dtype": ("bf16", "MXFP8 on the wire is the ncclep backend's", None),
}


def megatron_fields(fields: dict) -> dict:
    """`fields` with Megatron's implementation-choosing fields read into jax_ep's (what
    MoEConfig.from_dict does first):
      moe_token_dispatcher_type: "alltoall" or "allgather" -> moe_flex_dispatcher_backend
        "alltoall" (the same results by XLA's all-to-all; Megatron ignores its flex backend
        field then, and so does this); "flex" -> the given moe_flex_dispatcher_backend
        (default "deepep").
        With it, moe_enable_deepep=True (deprecated there) needs "flex" and a backend other
        than "hybridep", and picks "deepep", as Megatron's __post_init__.
      moe_router_padding_for_quantization / moe_router_padding_for_fp8 (its older name): True
        -> moe_router_expert_pad_multiple 16, or 32 with fp4 set or fp8_recipe "mxfp8"
        (Megatron's alignment for FP8 / MXFP8 / FP4 grouped GEMMs; here zero rows, see the
        config); fp4 and fp8_recipe are read for that only, and fp8 (the format) is accepted
        (Megatron requires fp8 or fp4 with the padding; here the padding needs neither).
        (Megatron refuses the padding with the "allgather" dispatcher; here every backend
        pads.)
      moe_deepep_num_sms / moe_hybridep_num_sms None (Megatron's default: unset) -> NeMo's
        defaults (20 / 24; no effect under XLA either way).
      expert_tensor_parallel_size None or absent (Megatron's default) -> Megatron's
        tensor_model_parallel_size where given, else 1; tensor_model_parallel_size is read
        for that only.
      moe_permute_fusion_into_hybridep -> moe_hybridep_permute_fusion.
      ffn_hidden_size -> moe_ffn_hidden_size where that is not given (Megatron's default).
      moe_expert_rank_capacity_factor f: with the "hybridep" backend (the only one Megatron
        reads it with, besides ncclep) -> ragged_buffer_factor f where that is not given: the
        permuted buffer holds ceil(f * T * K) rows plus each expert's padding room (Megatron:
        int(f * T * K) rounded up to the pad multiple); rows past it are dropped and counted
        (aux "num_dropped"; Megatron's over_budget flag). Other backends: no effect.
      moe_router_topk_limited_devices n (deprecated in Megatron): moe_router_group_topk n and
        moe_router_num_groups = expert_model_parallel_size, as Megatron's __post_init__ (needs
        that field; refused with moe_router_group_topk).
      Kernel, schedule, memory and logging choices (_KERNEL_CHOICES: moe_grouped_gemm,
        moe_router_fusion, moe_use_legacy_grouped_gemm, moe_layer_recompute (use jax.checkpoint
        around the layer), moe_shared_expert_overlap (XLA schedules), moe_flex_dispatcher_num_sms,
        the grouped weight / bias / tensor layouts, the paged stash, moe_per_layer_logging, ...),
        expert_model_parallel_size (the mesh's expert axis decides P) and moe_layer_freq (the
        model decides which layers are MoE layers): accepted, no effect.
      Fields jax_ep has only at Megatron's default (_DEFAULT_ONLY: moe_enable_routing_replay,
        moe_token_dropping, moe_shared_expert_glu_interleave_size, the ncclep wire dtypes):
        the default is accepted, anything else refused with the reason and what to use
        instead.
    Invalid values raise ValueError naming the field."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"MoEConfig.from_dict: fields: expected a dict of Megatron / "
                         f"TokenDispatcherConfig fields, got {type(fields).__name__}")
    fields = dict(fields)
    kind = fields.pop("moe_token_dispatcher_type", None)
    if kind is not None:
        _require(isinstance(kind, str) and kind in _DISPATCHER_TYPES, "moe_token_dispatcher_type",
                 f"one of {tuple(_DISPATCHER_TYPES)}", kind)
        if _DISPATCHER_TYPES[kind] is not None:
            fields["moe_flex_dispatcher_backend"] = _DISPATCHER_TYPES[kind]
        if fields.get("moe_enable_deepep") is True:  # Megatron's deprecated switch, its rules
            _require(kind == "flex", "moe_enable_deepep", "False with moe_token_dispatcher_type "
                     f"{kind!r} (Megatron: DeepEP needs the flex dispatcher)", True)
            _require(fields.get("moe_flex_dispatcher_backend") != "hybridep",
                     "moe_enable_deepep", "False with moe_flex_dispatcher_backend 'hybridep' "
                     "(Megatron: one flex backend)", True)
            fields["moe_flex_dispatcher_backend"] = "deepep"
    # Megatron's deprecated per-backend SM counts are None unless set (routed to
    # moe_flex_dispatcher_num_sms there); unset, they leave NeMo's defaults
    for name in ("moe_deepep_num_sms", "moe_hybridep_num_sms"):
        if name in fields and fields[name] is None:
            del fields[name]
    # Megatron's expert_tensor_parallel_size is None unless set, meaning its
    # tensor_model_parallel_size (ModelParallelConfig.__post_init__; that field is read for
    # this only: the layer's tensor sharding is ETP's, attention's TP is the model's)
    tensor_parallel = fields.pop("tensor_model_parallel_size", None)
    _require(tensor_parallel is None or is_int(tensor_parallel), "tensor_model_parallel_size",
             "None or a positive int (read for expert_tensor_parallel_size only)",
             tensor_parallel)
    if fields.get("expert_tensor_parallel_size") is None:
        fields.pop("expert_tensor_parallel_size", None)
        if tensor_parallel is not None:
            fields["expert_tensor_parallel_size"] = tensor_parallel
    # Megatron's low-precision fields, read for the padding multiple only (fp8, the format,
    # does not change it); all three always, so a pasted config has none "unknown"
    recipe, fp4 = fields.pop("fp8_recipe", None), fields.pop("fp4", None)
    fields.pop("fp8", None)
    _require(recipe is None or recipe in _FP8_RECIPES, "fp8_recipe",
             f"None or one of Megatron's {_FP8_RECIPES}", recipe)
    wide = recipe == "mxfp8" or bool(fp4)
    padded = []
    for name in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
        value = fields.pop(name, False)
        _require(isinstance(value, (bool, np.bool_)), name, "a bool", value)
        if value:
            padded.append(name)
    if padded and fields.get("moe_router_expert_pad_multiple") is None:
        fields["moe_router_expert_pad_multiple"] = 32 if wide else 16
    if "moe_permute_fusion_into_hybridep" in fields:
        fields["moe_hybridep_permute_fusion"] = fields.pop("moe_permute_fusion_into_hybridep")
    ffn = fields.pop("ffn_hidden_size", None)
    if ffn is not None and fields.get("moe_ffn_hidden_size") is None:
        fields["moe_ffn_hidden_size"] = ffn
    rank_factor = fields.pop("moe_expert_rank_capacity_factor", None)
    if (rank_factor is not None and fields.get("moe_flex_dispatcher_backend") == "hybridep"
            and fields.get("ragged_buffer_factor") is None):
        fields["ragged_buffer_factor"] = rank_factor
    limited = fields.pop("moe_router_topk_limited_devices", None)
    _require(limited is None or is_int(limited), "moe_router_topk_limited_devices",
             "None or a positive int", limited)
    if limited:
        ep = fields.get("expert_model_parallel_size")
        _require(not fields.get("moe_router_group_topk") and is_int(ep),
                 "moe_router_topk_limited_devices", "None with moe_router_group_topk "
                 "(Megatron's rule), else given with expert_model_parallel_size (Megatron "
                 "routes over that many groups)", limited)
        fields["moe_router_group_topk"], fields["moe_router_num_groups"] = limited, ep
    for name, (default, why, instead) in _DEFAULT_ONLY.items():
        value = fields.pop(name, default)
        _require(value == default, name, f"{default!r} ({why}"
                 + (f"; use {instead}" if instead else "") + ")", value)
    for name in _KERNEL_CHOICES:
        fields.pop(name, None)
    return fields

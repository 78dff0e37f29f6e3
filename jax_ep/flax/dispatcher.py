"""MoEFlexTokenDispatcher: the PyTorch flex dispatcher's method names on jax_ep's EP modes.

Call the methods inside `jax.shard_map` over `config.expert_axis_name` (the layer in
`jax_ep.flax.moe` does). JAX is functional, so the dispatch state that the PyTorch dispatcher
keeps on `self` flows explicitly here: every dispatch-side method returns it as its last
element and every combine-side method takes it. The module holds no arrays, so it is safe
under `nnx.jit`, `nnx.grad` and `nnx.remat`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from functools import partial

import jax
import jax.extend.core
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_ep import _ffi, deepep, hybridep, ops, transport
from jax_ep._checks import (as_int32_ids, check_bool, check_float_weights, check_positive,
                            check_rows, check_top_k, unroute_invalid_experts)
from jax_ep.config import TokenDispatcherConfig

__all__ = ["DispatchState", "HybridEPMetadataProcessor", "HybridEPPipelineRuntimeInitializer",
           "MoEFlexTokenDispatcher", "reset_hybrid_ep_buffer", "router_dtype", "shared_dispatcher"]

_ROUTER_DTYPES = {"fp32": jnp.float32, "fp64": jnp.float64, None: None}


@partial(jax.tree_util.register_dataclass,
         data_fields=["token_indices", "token_probs", "routing_map", "probs", "handle",
                      "sorted_indices", "num_dropped", "num_invalid"],
         meta_fields=["hidden_shape", "map_top_k"])
@dataclasses.dataclass(frozen=True)
class DispatchState:
    """What the combine side needs from a dispatch (the PyTorch dispatcher's `self` fields).

    token_indices i32[T,K] / token_probs f32[T,K]: top-k routing (DeepEP family, compact
      HybridEP); routing_map bool[T,E] / probs f32[T,E]: dense routing (HybridEP).
    handle: the EP mode's handle (None before dispatch_all_to_all).
    sorted_indices i32[N]: local permutation rows (DeepEP family, after dispatch_postprocess).
    num_dropped i32[]: (token, expert) pairs dropped to moe_expert_capacity_factor, plus the
      (token, destination) rows or (row, expert) pairs the EP mode dropped to its buffers.
    num_invalid i32[]: expert ids outside [-1, E) that dispatch_preprocess2 routed nowhere
      while building HybridEP's dense routing (which cannot hold them); dispatch_all_to_all
      adds them to the handle's num_invalid, where the other modes count theirs.
    hidden_shape: the input's shape, restored by combine_postprocess.
    map_top_k: the most experts a token selects in routing_map where that is known (a map
      the dispatcher built from top-k routing: K), else None (a caller's map, e.g.
      Megatron's drop-and-pad capacity mask, may route a token to more experts).
    """

    token_indices: jax.Array | None = None
    token_probs: jax.Array | None = None
    routing_map: jax.Array | None = None
    probs: jax.Array | None = None
    handle: object = None
    sorted_indices: jax.Array | None = None
    num_dropped: jax.Array | None = None
    num_invalid: jax.Array | None = None
    hidden_shape: tuple = ()
    map_top_k: int | None = None


def router_dtype(config: TokenDispatcherConfig, default):
    """The dtype routing math runs in; fp64 needs jax_enable_x64."""
    dtype = _ROUTER_DTYPES[config.moe_router_dtype]
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("TokenDispatcherConfig.moe_router_dtype: 'fp64' needs "
                         "jax.config.update('jax_enable_x64', True)")
    return default if dtype is None else dtype


def _check_local_expert_indices(indices, num_local_experts, num_experts):
    """The global ids of one rank's experts: L consecutive ids starting at a multiple of L."""
    try:  # integers only: int("0123") or int(1.9) would pass for an id
        ids = tuple(operator.index(i) for i in indices)
    except TypeError:
        raise ValueError(f"local_expert_indices: expected a list of {num_local_experts} "
                         f"integer expert ids, got {indices!r}") from None
    first = ids[0] if ids else 0
    expected = tuple(range(first, first + num_local_experts))
    if ids != expected or first % num_local_experts or first + num_local_experts > num_experts:
        raise ValueError(f"local_expert_indices: expected the {num_local_experts} consecutive "
                         f"ids r*{num_local_experts} ... r*{num_local_experts}+"
                         f"{num_local_experts - 1} of one rank (num_moe_experts={num_experts}), "
                         f"got {list(ids)}")
    return ids


def _check_num_local_tokens(num_local_tokens, hidden) -> int:
    """num_local_tokens as an int (a Python, numpy or concrete JAX integer), else a
    ValueError naming it; it must be hidden's token count."""
    try:
        count = None if isinstance(num_local_tokens, bool) else operator.index(num_local_tokens)
    except TypeError:  # not an integer, or a traced one
        count = None
    if count != hidden.shape[0]:
        raise ValueError(f"num_local_tokens: expected the {hidden.shape[0]} tokens of "
                         f"hidden_states (shape [..., H] read as [T, H]), got "
                         f"{num_local_tokens!r}")
    return count


def _check_state(state, method):
    if not isinstance(state, DispatchState):
        raise ValueError(f"{method}: state: expected the DispatchState returned by the "
                         f"dispatch side, got {type(state).__name__} (pass probs by keyword)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridEPMetadataProcessor:
    """NeMo's _HybridEPMetadataProcessor (the hybridep dispatcher's
    `hybridep_metadata_processor`): top-k routing -> HybridEP's routing metadata and dense
    probs.

    `processor(token_indices, token_probs)` (or NeMo's `processor.forward(...)`):
    token_indices int[T,K] global expert ids (-1 = unrouted), token_probs float[T,K] ->
    (routing_map bool[T,E], multihot_probs f32[T,E]); with compact_routing the metadata is
    token_indices itself (NeMo's alias) and the probs are still the dense f32[T,E].
    `ops.indices_to_multihot` on XLA ops, whatever permute_fusion (kept as NeMo's attribute:
    its fused kernel gives the same values, and XLA fuses this scatter into its neighbours).
    A frozen record: processors of the same fields are equal."""

    num_experts: int
    permute_fusion: bool
    compact_routing: bool = False

    def __post_init__(self):
        object.__setattr__(self, "num_experts", check_positive(self.num_experts, "num_experts"))
        object.__setattr__(self, "permute_fusion",
                           check_bool(self.permute_fusion, "permute_fusion"))
        object.__setattr__(self, "compact_routing",
                           check_bool(self.compact_routing, "compact_routing"))

    def __call__(self, token_indices, token_probs):
        routing_map, probs = ops.indices_to_multihot(
            token_indices, jnp.asarray(token_probs, jnp.float32), num_experts=self.num_experts,
            impl="xla")
        return (token_indices if self.compact_routing else routing_map), probs

    forward = __call__


class MoEFlexTokenDispatcher(nnx.Module):
    """Flex token dispatcher over the "deepep", "uccl_ep", "alltoall" and "hybridep" modes.

    num_local_experts: L = E / P, so the expert axis must have P = E / L devices (checked when
    the dispatch is traced); local_expert_indices: the L consecutive global ids of one rank's
    experts, r*L ... r*L + L - 1 (informational: one module serves every rank of the SPMD
    program, and rank r owns [r*L, (r+1)*L)); config: TokenDispatcherConfig; ep_group: the
    expert mesh axis name (defaults to config.expert_axis_name).

    The methods that take the dispatch state (the PyTorch dispatcher's `self` fields) take it
    as their second argument; async_finish / allocate_on_comm_stream are accepted for
    signature compatibility and ignored (XLA schedules the collectives).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, ep_group=None):
        if not isinstance(config, TokenDispatcherConfig):
            raise ValueError(f"config: expected a TokenDispatcherConfig, got {type(config)}")
        check_positive(num_local_experts, "num_local_experts")
        if config.num_moe_experts % num_local_experts:
            raise ValueError(f"num_local_experts: {num_local_experts} does not divide "
                             f"num_moe_experts={config.num_moe_experts}")
        self.config = config
        self.num_local_experts = int(num_local_experts)
        self.local_expert_indices = _check_local_expert_indices(
            local_expert_indices, self.num_local_experts, config.num_moe_experts)
        self.axis_name = ep_group or config.expert_axis_name
        self.ep_size = config.num_moe_experts // self.num_local_experts
        self.tp_size = 1

    # ------------------------------------------------------------------ helpers

    @property
    def backend(self):
        return self.config.moe_flex_dispatcher_backend

    @property
    def hybridep_metadata_processor(self):
        """NeMo's attribute: a HybridEPMetadataProcessor of the config on the hybridep backend
        (what dispatch_preprocess2 runs there), else None."""
        if self.backend != "hybridep":
            return None
        return HybridEPMetadataProcessor(
            num_experts=self.config.num_moe_experts, permute_fusion=self.config.moe_permute_fusion,
            compact_routing=self.config.moe_hybridep_compact_routing)

    def _initialize_metadata(self, num_local_tokens, probs):
        """NeMo's: probs [num_local_tokens, E] (float) viewed per destination of the TPxEP
        group, [num_local_tokens, tp_size * ep_size, L]; each rank's L columns repeated
        tp_size times (tp_size is 1 here, so [T, P, L], rank p's experts p*L .. p*L + L - 1).
        A ValueError names probs when it does not hold num_local_tokens * E elements."""
        want = num_local_tokens * self.config.num_moe_experts
        if jnp.size(probs) != want:
            raise ValueError(f"probs: expected num_local_tokens * num_moe_experts = {want} "
                             f"elements, got shape {tuple(jnp.shape(probs))}")
        L = self.num_local_experts
        per_rank = jnp.reshape(probs, (num_local_tokens, self.ep_size, 1, L))
        return jnp.broadcast_to(per_rank, (num_local_tokens, self.ep_size, self.tp_size, L)) \
            .reshape(num_local_tokens, self.tp_size * self.ep_size, L)

    @property
    def _local_impl(self):
        return "ffi" if self.config.moe_permute_fusion else "xla"

    def get_pipeline_runtime_initializers(self, hidden_dim, dtype):
        """NeMo's: (HybridEPPipelineRuntimeInitializer(self, hidden_dim, dtype),) for the
        hybridep backend, else ()."""
        if self.backend != "hybridep":
            return ()
        return (HybridEPPipelineRuntimeInitializer(self, hidden_dim, dtype),)

    def rank_capacity(self, num_tokens):
        """Per-destination row bound C of a deepep-family dispatch of num_tokens tokens a rank
        (the `capacity` it passes to `jax_ep.dispatch`): from moe_expert_capacity_factor, or
        None (no bound)."""
        cfg = self.config
        if cfg.moe_expert_capacity_factor is None:
            return None
        return deepep.capacity_from_factor(num_tokens, cfg.moe_router_topk, self.ep_size,
                                           cfg.moe_expert_capacity_factor,
                                           num_experts=cfg.num_moe_experts)

    def _drop_to_expert_capacity(self, state, num_tokens):
        """moe_expert_capacity_factor: Megatron's router drop, each expert keeping at most
        ceil(T*K/E * factor) of this rank's tokens, the highest-probability ones. Returns the
        state with the dropped (token, expert) pairs unrouted, and their count i32[]."""
        cfg = self.config
        if cfg.moe_expert_capacity_factor is None:
            return state, jnp.zeros((), jnp.int32)
        capacity = deepep.expert_capacity(num_tokens, cfg.moe_router_topk, cfg.num_moe_experts,
                                          cfg.moe_expert_capacity_factor)
        if state.token_indices is None:
            routing_map, probs, dropped = deepep.drop_to_expert_capacity(
                state.routing_map, state.probs, capacity=capacity)
            return dataclasses.replace(state, routing_map=routing_map, probs=probs), dropped
        idx, w = state.token_indices, state.token_probs
        routing_map, probs = ops.indices_to_multihot(idx, w, num_experts=cfg.num_moe_experts,
                                                     impl="xla")
        keep, _, dropped = deepep.drop_to_expert_capacity(routing_map, probs, capacity=capacity)
        # Only routed pairs that were dropped change: invalid ids stay for dispatch to count.
        num_experts = cfg.num_moe_experts
        routed = (idx >= 0) & (idx < num_experts)
        drop = routed & ~jnp.take_along_axis(keep, jnp.clip(idx, 0, num_experts - 1), axis=1)
        return dataclasses.replace(state, token_indices=jnp.where(drop, -1, idx),
                                   token_probs=jnp.where(drop, 0.0, w)), dropped

    def _check_axis_size(self):
        """The expert axis (bound by the enclosing shard_map) must have ep_size devices."""
        _, size = transport.axis_rank_and_size(self.axis_name)
        if size != self.ep_size:
            raise ValueError(f"num_local_experts: {self.num_local_experts} local experts of "
                             f"num_moe_experts={self.config.num_moe_experts} need an expert "
                             f"axis of {self.ep_size} devices, but axis {self.axis_name!r} "
                             f"has {size}")

    def _probs_in_router_dtype(self, permuted_probs):
        return permuted_probs.astype(router_dtype(self.config, permuted_probs.dtype))

    def _num_permuted(self, num_rows, top_k, num_tokens=None):
        """Static rows of the permuted buffer: every row's local slots plus block padding; with
        config.ragged_buffer_factor f and the rank's num_tokens T, at most ceil(f*T*K) slots
        (the balanced load times f) plus the padding."""
        pad = self.config.moe_router_expert_pad_multiple or 1
        slots = num_rows * min(top_k, self.num_local_experts)
        factor = self.config.ragged_buffer_factor
        if factor is not None and num_tokens is not None:
            slots = min(slots, math.ceil(factor * num_tokens * top_k))
        return slots + self.num_local_experts * (pad - 1)

    def num_recv_rows(self, num_tokens):
        """Receive rows R of a deepep-family dispatch of num_tokens tokens a rank (the
        `num_worst_tokens` it passes to `jax_ep.dispatch`): config.num_worst_tokens, else with
        config.ragged_buffer_factor f min(P*C, ceil(f*T*min(K, P))), else None (P*C, the
        no-drop worst case; C = rank_capacity(T), T without a capacity factor)."""
        cfg = self.config
        if cfg.num_worst_tokens is not None or cfg.ragged_buffer_factor is None:
            return cfg.num_worst_tokens
        balanced = num_tokens * min(cfg.moe_router_topk, self.ep_size)
        worst = self.ep_size * (self.rank_capacity(num_tokens) or num_tokens)
        return max(1, min(worst, math.ceil(cfg.ragged_buffer_factor * balanced)))

    def hybridep_recv_rows(self, num_tokens, num_permuted):
        """Receive rows R the hybridep dispatch of num_tokens T' (equalised) tokens a rank
        passes as `num_worst_tokens`: min(P*T', N) for its N permuted rows. Every received
        row fills at least one of the N, so R never drops more than N would: as in HybridEP,
        whose only bound is the permuted buffer (Megatron's moe_expert_rank_capacity_factor
        budget), rows drop only where the N rows are full (which ones may differ: past R,
        whole rows of the last source ranks' last tokens). With N below P*T' (a
        ragged_buffer_factor or num_permuted_tokens) the receive buffer and the combine's
        return buffer shrink with it. config.num_worst_tokens is the deepep family's."""
        return max(1, min(self.ep_size * num_tokens, num_permuted))

    def local_multihot(self, recv_idx, recv_w):
        """Received local ids i32[R,K] (-1 for slots owned elsewhere), weights f32[R,K] ->
        (routing_map bool[R,L], probs f32[R,L]) (NeMo's _indices_to_multihot; K may exceed
        L: a token's other slots are -1)."""
        return ops.indices_to_multihot(recv_idx, recv_w, num_experts=self.num_local_experts,
                                       impl=self._local_impl)

    def _topk_from_probs(self, probs):
        """Dense probs [T,E] -> (indices i32[T,K], probs f32[T,K]): the K highest (ties to the
        lower id). With moe_expert_capacity_factor set, slots of prob 0 (the router's drops)
        get index -1; without it they are dispatched with weight 0, as NeMo's and Megatron's
        DeepEP managers do."""
        values, indices = jax.lax.top_k(probs, self.config.moe_router_topk)
        if self.config.moe_expert_capacity_factor is not None:
            indices = jnp.where(values == 0, -1, indices)
        return indices.astype(jnp.int32), values.astype(jnp.float32)

    # ------------------------------------------------------------------ dispatch side

    def dispatch_preprocess(self, hidden_states, num_local_tokens, probs):
        """hidden [..., H], probs [T,E] (zero where not routed) -> (hidden [T,H], state).

        Every backend routes each token to its moe_router_topk highest-prob experts, as
        NeMo's DeepEP manager does with torch.topk (zero probs unrouted only with
        moe_expert_capacity_factor set, as there). HybridEP's dense routing map is built from
        that top-k too: jax_ep's choice, since this signature carries no routing map. So dense
        probs with more than K non-zeros per row (Megatron's dropless test passes 1/K for every
        expert) route K.
        Megatron's form, dispatch_preprocess(hidden_states, routing_map, probs), passes the
        router's routing_map bool[T,E] where num_local_tokens goes: the deepep family still
        routes by the top-k of probs (Megatron's DeepEP manager ignores the map), HybridEP
        (dense routing) takes the map itself, with probs where it is True."""
        check_rows(hidden_states, "hidden_states")
        hidden_shape = tuple(hidden_states.shape)
        hidden = hidden_states.reshape(-1, hidden_shape[-1])
        num_experts = self.config.num_moe_experts
        routing_map = None
        if jnp.ndim(num_local_tokens) == 2:  # Megatron's routing_map in its place
            routing_map = num_local_tokens
            if routing_map.dtype != jnp.bool_ or routing_map.shape[1] != num_experts:
                raise ValueError(f"routing_map: expected bool[T, num_moe_experts={num_experts}]"
                                 f", got {routing_map.dtype}{list(routing_map.shape)}")
            if routing_map.shape[0] != hidden.shape[0]:
                raise ValueError(f"routing_map: expected the {hidden.shape[0]} tokens of "
                                 f"hidden_states as rows, got shape {routing_map.shape}")
            num_local_tokens = routing_map.shape[0]
        num_local_tokens = _check_num_local_tokens(num_local_tokens, hidden)
        if probs is None:
            raise ValueError(f"probs: expected [num_local_tokens={num_local_tokens}, "
                             f"num_moe_experts={num_experts}] router probabilities, got None")
        probs = jnp.asarray(probs)
        check_float_weights(probs, "probs")
        # [T,E] or [..., E] over the T tokens (a transposed [E,T] of the same size would
        # route the tokens to the wrong experts)
        if (jnp.ndim(probs) < 2 or jnp.shape(probs)[-1] != num_experts
                or jnp.size(probs) != num_local_tokens * num_experts):
            raise ValueError(f"probs: expected [num_local_tokens={num_local_tokens}, "
                             f"num_moe_experts={num_experts}] (or [..., {num_experts}] over "
                             f"those tokens), got shape {jnp.shape(probs)}")
        probs = probs.reshape(num_local_tokens, num_experts)
        probs = probs.astype(router_dtype(self.config, probs.dtype))
        check_top_k(self.config.moe_router_topk, num_experts,
                    "TokenDispatcherConfig.moe_router_topk", "num_moe_experts")
        indices, values = self._topk_from_probs(probs)
        if self.backend == "hybridep" and not self.config.moe_hybridep_compact_routing:
            built = routing_map is None
            if built:
                routing_map, dense = ops.indices_to_multihot(indices, values,
                                                             num_experts=num_experts, impl="xla")
            else:
                dense = jnp.where(routing_map, probs, 0).astype(values.dtype)
            state = DispatchState(routing_map=routing_map, probs=dense,
                                  hidden_shape=hidden_shape,
                                  map_top_k=self.config.moe_router_topk if built else None)
        else:
            state = DispatchState(token_indices=indices, token_probs=values,
                                  hidden_shape=hidden_shape)
        return hidden, state

    def dispatch_preprocess2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """Top-k routing given directly: probs [T,K], indices [T,K] (-1 unrouted)."""
        check_rows(hidden_states, "hidden_states")
        for name, value in (("token_probs", token_probs), ("token_indices", token_indices)):
            if value is None:
                raise ValueError(f"{name}: expected a [num_local_tokens, top-k] array, got None")
        hidden_shape = tuple(hidden_states.shape)
        hidden = hidden_states.reshape(-1, hidden_shape[-1])
        num_local_tokens = _check_num_local_tokens(num_local_tokens, hidden)
        token_probs, token_indices = jnp.asarray(token_probs), jnp.asarray(token_indices)
        check_float_weights(token_probs, "token_probs")
        if jnp.shape(token_probs) != jnp.shape(token_indices):
            raise ValueError(f"token_probs: expected the shape of token_indices "
                             f"{jnp.shape(token_indices)}, got {jnp.shape(token_probs)}")
        # [T,K] or [..., K] over the T tokens (a transposed [K,T] would pass a size check
        # and route the tokens to the wrong experts)
        top_k = jnp.shape(token_indices)[-1] if jnp.ndim(token_indices) >= 2 else -1
        if top_k < 0 or jnp.size(token_indices) != num_local_tokens * top_k:
            raise ValueError(f"token_indices: expected [num_local_tokens={num_local_tokens}, "
                             f"top-k] (or [..., top-k] over those tokens), got shape "
                             f"{jnp.shape(token_indices)}")
        check_top_k(top_k, self.config.num_moe_experts, "token_indices", "num_moe_experts")
        token_probs = token_probs.reshape(num_local_tokens, top_k)
        token_indices = as_int32_ids(token_indices.reshape(num_local_tokens, top_k),
                                     self.config.num_moe_experts, "token_indices")
        if self.backend == "hybridep" and not self.config.moe_hybridep_compact_routing:
            # the dense map's buffers hold moe_router_topk local slots a token: wider indices
            # could route a token to more local experts than they hold
            if top_k > self.config.moe_router_topk:
                raise ValueError(
                    f"token_indices: HybridEP's dense routing sizes its buffers for "
                    f"moe_router_topk={self.config.moe_router_topk} experts a token, got "
                    f"{top_k} a token (set moe_router_topk to {top_k}, or "
                    f"moe_hybridep_compact_routing=True)")
            token_indices, num_invalid = unroute_invalid_experts(token_indices,
                                                                 self.config.num_moe_experts)
            routing_map, probs = self.hybridep_metadata_processor(token_indices, token_probs)
            return hidden, DispatchState(routing_map=routing_map, probs=probs,
                                         num_invalid=num_invalid, hidden_shape=hidden_shape,
                                         map_top_k=top_k)
        return hidden, DispatchState(token_indices=token_indices,
                                     token_probs=token_probs.astype(jnp.float32),
                                     hidden_shape=hidden_shape)

    def dispatch_all_to_all(self, hidden_states, state, probs=None, async_finish=True,
                            allocate_on_comm_stream=True):
        """[T,H] -> the EP mode's received rows (HybridEP: already permuted), new state.

        probs is ignored (the routing probs travel in the state), as are async_finish and
        allocate_on_comm_stream. ValueError if the expert axis does not have
        num_moe_experts / num_local_experts devices."""
        del probs, async_finish, allocate_on_comm_stream
        _check_state(state, "dispatch_all_to_all")
        self._check_axis_size()
        cfg = self.config
        state, dropped = self._drop_to_expert_capacity(state, hidden_states.shape[0])
        if self.backend == "hybridep":
            num_tokens = hybridep.equalized_num_tokens(hidden_states.shape[0])
            # A dense map from top-k routing selects at most moe_router_topk experts per token.
            top_k = (state.token_indices.shape[1] if state.token_indices is not None
                     else cfg.moe_router_topk)
            n = cfg.num_permuted_tokens or self._num_permuted(self.ep_size * num_tokens, top_k,
                                                              num_tokens)
            # a map built from top-k bounds its send layout (and the combine's return buffer)
            # at T'*min(K, P) rows instead of T'*P; a caller's map is sent whole
            routing = (dict(topk_idx=state.token_indices, probs=state.token_probs)
                       if state.token_indices is not None
                       else dict(routing_map=state.routing_map, probs=state.probs,
                                 top_k=state.map_top_k))
            px, pp, tpe, handle = hybridep.hybridep_dispatch(
                hidden_states, num_experts=cfg.num_moe_experts, axis_name=self.axis_name,
                num_permuted_tokens=n, pad_multiple=cfg.moe_router_expert_pad_multiple,
                transport=cfg.transport, use_fp8=cfg.moe_fp8_dispatch,
                fp8_output="cast_back", num_worst_tokens=self.hybridep_recv_rows(num_tokens, n),
                **routing)
            if state.num_invalid is not None:
                routing = dataclasses.replace(
                    handle.routing, num_invalid=handle.routing.num_invalid + state.num_invalid)
                handle = dataclasses.replace(handle, routing=routing)
            state = dataclasses.replace(state, handle=handle,
                                        num_dropped=dropped + handle.num_dropped)
            return (px, pp, tpe), state
        recv_x, recv_idx, recv_w, handle = deepep.dispatch(
            hidden_states, state.token_indices, state.token_probs,
            num_experts=cfg.num_moe_experts, axis_name=self.axis_name, backend=self.backend,
            num_worst_tokens=self.num_recv_rows(hidden_states.shape[0]),
            transport=cfg.transport,
            capacity=self.rank_capacity(hidden_states.shape[0]),
            use_fp8=cfg.moe_fp8_dispatch, fp8_output="cast_back")
        state = dataclasses.replace(state, handle=handle,
                                    num_dropped=dropped + handle.num_dropped)
        return (recv_x, recv_idx, recv_w), state

    def dispatch_postprocess(self, hidden_states, state):
        """Received rows -> (global_input_tokens [N,H], tokens_per_expert i32[L],
        permuted_probs [N], state): expert-major rows for a grouped GEMM. permuted_probs is
        float32, or on the deepep family float64 with moe_router_dtype="fp64" (as NeMo's
        DeepEP manager; its HybridEP manager keeps HybridEP's float32)."""
        _check_state(state, "dispatch_postprocess")
        if self.backend == "hybridep":  # f32 probs, HybridEP's (NeMo's HybridEP manager
            px, pp, tpe = hidden_states     # applies no router dtype, unlike its DeepEP one)
            return px, tpe, pp, state
        recv_x, recv_idx, recv_w = hidden_states
        routing_map, probs = self.local_multihot(recv_idx, recv_w)
        n = self._num_permuted(recv_x.shape[0], recv_idx.shape[1], state.handle.num_tokens)
        permuted, permuted_probs, sorted_indices, tokens_per_expert, dropped = ops.permute(
            recv_x, routing_map, probs, num_out_tokens=n,
            pad_multiple=self.config.moe_router_expert_pad_multiple, impl=self._local_impl,
            return_num_dropped=True)
        # Drops happen only where config.ragged_buffer_factor bounds n below every row's slots.
        state = dataclasses.replace(state, sorted_indices=sorted_indices,
                                    num_dropped=state.num_dropped + dropped)
        return permuted, tokens_per_expert, self._probs_in_router_dtype(permuted_probs), state

    def token_permutation(self, hidden_states, num_local_tokens, probs):
        """preprocess -> all_to_all -> postprocess. Returns (global_input_tokens,
        tokens_per_expert, permuted_probs, state). num_local_tokens may be Megatron's
        routing_map (see dispatch_preprocess)."""
        hidden, state = self.dispatch_preprocess(hidden_states, num_local_tokens, probs)
        received, state = self.dispatch_all_to_all(hidden, state)
        return self.dispatch_postprocess(received, state)

    def token_permutation2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """As token_permutation, from top-k probs [T,K] and indices [T,K]."""
        hidden, state = self.dispatch_preprocess2(hidden_states, num_local_tokens, token_probs,
                                                  token_indices)
        received, state = self.dispatch_all_to_all(hidden, state)
        return self.dispatch_postprocess(received, state)

    # ------------------------------------------------------------------ combine side

    def combine_preprocess(self, hidden_states, state):
        """Expert outputs [N,H] -> rows in the received order (HybridEP: unchanged)."""
        _check_state(state, "combine_preprocess")
        check_rows(hidden_states, "hidden_states")
        if self.backend == "hybridep":
            return hidden_states
        rows = state.sorted_indices.shape[0]
        if jnp.ndim(hidden_states) != 2 or hidden_states.shape[0] != rows:
            raise ValueError(f"hidden_states: expected the [{rows}, H] expert-major rows of "
                             f"dispatch_postprocess, got shape {jnp.shape(hidden_states)}")
        return ops.unpermute(hidden_states, state.sorted_indices,
                             num_tokens=state.handle.num_recv, impl=self._local_impl)

    def combine_all_to_all(self, hidden_states, state, async_finish=True,
                           allocate_on_comm_stream=True):
        """Rows back to their source tokens, summed: -> [T,H]. async_finish and
        allocate_on_comm_stream are ignored."""
        del async_finish, allocate_on_comm_stream
        _check_state(state, "combine_all_to_all")
        if self.backend == "hybridep":
            return hybridep.hybridep_combine(hidden_states, state.handle)
        return deepep.combine(hidden_states, state.handle)[0]

    # Megatron's names of the two exchanges (its MoEFlexTokenDispatcher), with the state
    # passed as here.
    token_dispatch = dispatch_all_to_all
    token_combine = combine_all_to_all

    def combine_postprocess(self, hidden_states, state):
        """[T,H] -> the dispatch input's original shape."""
        _check_state(state, "combine_postprocess")
        check_rows(hidden_states, "hidden_states")
        if math.prod(jnp.shape(hidden_states)) != math.prod(state.hidden_shape):
            raise ValueError(f"hidden_states: expected the combined [T,H] of the dispatch input "
                             f"{state.hidden_shape}, got shape {jnp.shape(hidden_states)}")
        return hidden_states.reshape(state.hidden_shape)

    def token_unpermutation(self, hidden_states, state):
        """combine_preprocess -> combine_all_to_all -> combine_postprocess."""
        hidden = self.combine_preprocess(hidden_states, state)
        hidden = self.combine_all_to_all(hidden, state)
        return self.combine_postprocess(hidden, state)

    def bounded_forward(self, hidden_states, token_probs, token_indices, experts, params):
        """config.dropless_buffer_factor f: token_permutation2 -> experts ->
        token_unpermutation with the buffers of ragged_buffer_factor=f, and where those drop a
        row on any device, the whole of it again without dropping (a lax.cond on the drops
        summed over every manual axis of the enclosing shard_map, so all devices take the
        same branch: the peer transport's exchanges meet all of the process's devices, not one
        expert group's). The fallback runs the tokens in `fallback_chunks` chunks one after
        another (a lax.scan), each with the no-drop worst-case buffers of a chunk, which are
        no larger than the bounded ones: the program's buffers stay about f times the
        balanced load (with one chunk, the whole batch in the worst-case buffers). The
        backward takes the same branch: the bounded path's saved vjp, or the fallback
        recomputed chunk by chunk (forward and backward of each, the weights' gradients summed
        over the chunks), so a step saves the bounded path's residuals only and no branch
        fills zeros for the other's. The bounded path's vjp runs outside the branch (faster
        on XLA:CPU, see run_bwd): a step that falls back also runs it and discards it.

        hidden_states [T,H] (or [..., H]: T tokens), token_probs / token_indices [T,K];
        experts: (rows [N,H], tokens_per_expert i32[L], permuted_probs [N], params) -> [N,H];
        params: the arrays it is differentiated in (the expert weights; `experts` must close
        over no other traced value it needs gradients of). Returns (y [T,H] in the input's
        shape, overflow i32[]: 1 where the fallback ran, else 0, num_dropped i32[]: the rows
        the branch taken dropped, 0 unless the worst case itself is bounded).
        """
        cfg = self.config
        if cfg.dropless_buffer_factor is None:
            raise ValueError("bounded_forward: needs config.dropless_buffer_factor, got None")

        def twin(**fields):
            return MoEFlexTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                          dataclasses.replace(cfg, dropless_buffer_factor=None,
                                                              **fields), self.axis_name)
        bounded, worst = twin(ragged_buffer_factor=cfg.dropless_buffer_factor), twin()
        shape = jnp.shape(hidden_states)
        if len(shape) < 2:
            raise ValueError(f"hidden_states: expected [..., H] tokens, got shape {shape}")
        hidden_states = hidden_states.reshape(-1, shape[-1])  # [..., H] -> [T,H], as the
        num_tokens = hidden_states.shape[0]                   # plain path takes them
        # int32 first: the fallback pads the ids with -1, which an unsigned dtype would wrap
        token_indices = as_int32_ids(token_indices, cfg.num_moe_experts, "token_indices")
        chunks = self.fallback_chunks(num_tokens, token_indices.shape[1])
        axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)

        def path(dispatcher, hidden, probs, indices, params):
            rows, tokens_per_expert, rows_probs, state = dispatcher.token_permutation2(
                hidden, hidden.shape[0], probs, indices)
            y = dispatcher.token_unpermutation(
                experts(rows, tokens_per_expert, rows_probs, params), state)
            return y, state.num_dropped

        def fallback(hidden, probs, indices, params):
            """The worst-case path over `chunks` token chunks in turn -> (y [T,H], dropped)."""
            if chunks == 1:
                return path(worst, hidden, probs, indices, params)
            _, (ys, dropped) = jax.lax.scan(
                lambda _, chunk: (None, path(worst, *chunk, params)), None,
                _token_chunks(chunks, hidden, probs, indices))
            return ys.reshape(-1, ys.shape[-1])[:num_tokens], dropped.sum(dtype=jnp.int32)

        def fallback_vjp(hidden, probs, indices, params, dy):
            """(d_hidden, d_probs, d_params) of `fallback`, chunk by chunk."""
            def grads(h, p, i, d):  # one chunk's forward again, then its backward
                return jax.vjp(lambda h, p, w: path(worst, h, p, i, w)[0], h, p, params)[1](d)

            def chunk_vjp(d_params, chunk):
                d_h, d_p, d_w = grads(*chunk)
                return jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), d_params,
                                    d_w), (d_h, d_p)
            if chunks == 1:
                return grads(hidden, probs, indices, dy)
            # Weights the tokens vary over more axes than (replicated over the data axis) would
            # have their gradient summed over those axes inside each chunk's vjp (the transpose
            # of their implicit broadcast): typed as varying like the tokens here, the chunks
            # give per-device gradients, summed over the devices once after the loop.
            tokens_axes = _ffi.varying_axes(hidden)
            weights, tree = jax.tree.flatten(params)
            extra = [tuple(sorted(tokens_axes - _ffi.varying_axes(w))) for w in weights]
            params = tree.unflatten([_ffi.make_varying(w, tokens_axes) for w in weights])
            # the weights' gradients summed over the chunks in at least float32 (bf16 weights
            # would otherwise round the running sum once per chunk), then cast back
            d_params, (d_h, d_p) = jax.lax.scan(
                chunk_vjp, jax.tree.map(lambda w: jnp.zeros_like(
                    w, dtype=jnp.promote_types(w.dtype, jnp.float32)), params),
                _token_chunks(chunks, hidden, probs, indices, dy))
            d_params = tree.unflatten([jax.lax.psum(d, axes) if axes else d
                                       for d, axes in zip(tree.flatten_up_to(d_params), extra)])
            return (d_h.reshape(-1, d_h.shape[-1])[:num_tokens],
                    d_p.reshape(-1, d_p.shape[-1])[:num_tokens],
                    jax.tree.map(lambda d, w: d.astype(w.dtype), d_params, params))

        def choose(y, dropped, hidden, probs, indices, params):
            """The bounded path's y, or the fallback's where any device dropped. Two forms of
            the same choice, each the faster one of its backend on XLA:CPU (E = 8 step of 8
            devices on 2 cores, against the ragged_buffer_factor twin in one process, five
            runs, benchmarks/RESULTS.md session 32): HybridEP's cond takes the flag and the
            inputs only (its other branch gives zeros, a select picks y), so it runs once the
            flag is known (1.06-1.11x the twin, 1.09-1.13x with y through the cond); the
            deepep family's cond takes y and passes it on (0.93-0.98x, 0.99-1.04x the other
            way)."""
            # named as the counts are: a remat policy saving "ep_counts" keeps the branch taken
            overflow = checkpoint_name(jax.lax.psum(dropped, axes) > 0, transport.COUNTS_NAME)
            if self.backend != "hybridep":
                y, dropped = jax.lax.cond(overflow, fallback, lambda *_: (y, dropped),
                                          hidden, probs, indices, params)
            else:
                y_fallback, dropped_fallback = jax.lax.cond(
                    overflow, fallback, lambda *_: (jnp.zeros_like(y), jnp.zeros_like(dropped)),
                    hidden, probs, indices, params)
                y = jnp.where(overflow, y_fallback, y)
                dropped = jnp.where(overflow, dropped_fallback, dropped)
            return (y, overflow.astype(jnp.int32), dropped), overflow

        @jax.custom_vjp
        def run(hidden, probs, indices, params):
            y, dropped = path(bounded, hidden, probs, indices, params)
            return choose(y, dropped, hidden, probs, indices, params)[0]

        def run_fwd(hidden, probs, indices, params):
            y, vjp_bounded, dropped = jax.vjp(
                lambda h, p, w: path(bounded, h, p, indices, w), hidden, probs, params,
                has_aux=True)
            out, overflow = choose(y, dropped, hidden, probs, indices, params)
            return out, (vjp_bounded, overflow, hidden, probs, indices, params)

        def run_bwd(residuals, cotangents):
            vjp_bounded, overflow, hidden, probs, indices, params = residuals
            # The bounded path's backward runs outside the cond, the cond only picks: inside a
            # branch, XLA:CPU ran it 5-10% of the step slower (bench_moe E = 8, deepep and
            # hybridep @bounded vs their ragged_buffer_factor twins) and the program held 1.8
            # MiB/device more. A step that fell back computes it too, and discards it.
            bounded_grads = vjp_bounded(cotangents[0])
            d_hidden, d_probs, d_params = jax.lax.cond(
                overflow, lambda dy, _: fallback_vjp(hidden, probs, indices, params, dy),
                lambda _, grads: grads, cotangents[0], bounded_grads)
            return d_hidden, d_probs, None, d_params

        run.defvjp(run_fwd, run_bwd)
        y, overflow, dropped = run(hidden_states, token_probs, token_indices, params)
        return y.reshape(shape[:-1] + y.shape[-1:]), overflow, dropped

    def fallback_chunks(self, num_tokens, top_k):
        """Token chunks of bounded_forward's fallback for num_tokens T per device with top_k K:
        the fewest chunks whose no-drop worst case, P * T' * min(K, L) permuted rows per
        rank for T' tokens a chunk, fits in the bounded buffers' ceil(f * T * K) rows
        (f = config.dropless_buffer_factor). HybridEP sizes its buffers for the token count
        rounded up to a multiple of hybridep.TOKEN_ALIGNMENT (a, 4), so there T and T' count
        so rounded, T' a multiple of a. Where even chunks of one token (a for HybridEP) do not
        fit, chunks of that size (their worst case then exceeds the bounded buffers by less
        than P * min(K, L) * a rows). 1 for T = 0 or K = 0."""
        align = hybridep.TOKEN_ALIGNMENT if self.backend == "hybridep" else 1
        sized = -(-num_tokens // align) * align
        worst_per_token = self.ep_size * min(top_k, self.num_local_experts)
        if worst_per_token == 0:  # top_k 0: nothing is routed
            return 1
        bounded_rows = math.ceil(self.config.dropless_buffer_factor * sized * top_k)
        chunk_tokens = max(align, bounded_rows // worst_per_token // align * align)
        return max(1, -(-num_tokens // chunk_tokens))

    def overlapped_forward(self, hidden_states, token_probs, token_indices, local_kernel):
        """moe_deepep_async_dispatch: dispatch -> local_kernel -> combine over
        config.num_overlap_chunks token chunks (deepep family; see
        jax_ep.deepep.dispatch_chunked_forward). hidden [T,H] -> ([T,H], num_dropped i32[]:
        the (token, expert) pairs dropped to moe_expert_capacity_factor)."""
        if self.backend == "hybridep":
            raise ValueError("moe_deepep_async_dispatch: chunked overlap needs a deepep-family "
                             "backend, got 'hybridep'")
        self._check_axis_size()
        _, state = self.dispatch_preprocess2(hidden_states, hidden_states.shape[0], token_probs,
                                             token_indices)
        state, dropped = self._drop_to_expert_capacity(state, hidden_states.shape[0])
        y = deepep.dispatch_chunked_forward(
            hidden_states, state.token_indices, state.token_probs, local_kernel,
            num_local_experts=self.num_local_experts, axis_name=self.axis_name,
            chunks=self.config.num_overlap_chunks, backend=self.backend,
            transport=self.config.transport)
        return y, dropped


# NeMo's process-global HybridEP runtime (fused_a2a's signature and initialized capacity):
# one record per process, whatever the number of dispatchers; the lock makes each prepare's
# check-and-update one step when threads (e.g. pipeline stages) prepare at once.
_HYBRIDEP_RUNTIME = {"signature": None, "capacity": 0}
_HYBRIDEP_RUNTIME_LOCK = threading.Lock()


def reset_hybrid_ep_buffer() -> None:
    """NeMo's `fused_a2a.reset_hybrid_ep_buffer`: forget the process's HybridEP runtime (its
    signature and capacity), so an initializer of another configuration may prepare."""
    with _HYBRIDEP_RUNTIME_LOCK:
        _HYBRIDEP_RUNTIME.update(signature=None, capacity=0)


class HybridEPPipelineRuntimeInitializer:
    """NeMo's HybridEP pipeline initializer, for code that prepares one before a pipeline
    step. HybridEP keeps one process-global buffer sized by a token capacity and JIT-compiles
    its kernels for it; under XLA each compiled program sizes its own buffers, so there is
    nothing to allocate or compile ahead. What NeMo's keeps is kept: the process-global
    record of the configuration served (`signature`) and of the largest capacity prepared
    (`capacity`), shared by every initializer of the process, and the RuntimeError when an
    initializer of another configuration prepares (`reset_hybrid_ep_buffer()` clears it).

    manager: the MoEFlexTokenDispatcher (NeMo's _HybridEPManager's place); hidden_dim, dtype:
    the dispatched rows' width and dtype."""

    required_capacity = staticmethod(hybridep.required_capacity)

    def __init__(self, manager, hidden_dim, dtype):
        self.manager = manager
        self.hidden_dim = check_positive(hidden_dim, "hidden_dim")
        self.dtype = jnp.dtype(dtype)

    @property
    def resource_key(self):
        """(type, "hybridep"): NeMo's key of the one HybridEP buffer of a process."""
        return (type(self), "hybridep")

    @property
    def signature(self):
        """The configuration a HybridEP buffer would serve: experts, local experts, hidden
        size, dtype and the dispatcher's HybridEP settings (read when asked, so a dispatcher
        given another config after `prepare` no longer matches)."""
        cfg = self.manager.config
        return (cfg.num_moe_experts, self.manager.num_local_experts, self.hidden_dim,
                self.dtype.name, cfg.moe_hybridep_permute_fusion,
                cfg.moe_hybridep_compact_routing, cfg.moe_hybridep_num_sms,
                cfg.moe_hybridep_num_sms_preprocessing, cfg.moe_hybridep_num_blocks_permute,
                cfg.moe_hybridep_num_blocks_unpermute)

    @property
    def capacity(self) -> int:
        """The process's prepared capacity (0 before any `prepare`)."""
        return _HYBRIDEP_RUNTIME["capacity"]

    def _resolve_group_capacity(self, num_tokens, device=None) -> int:
        """NeMo's: the largest required capacity over the EP group. Every rank of the group
        runs the same compiled program with the same shapes, so it is this rank's."""
        del device
        return self.required_capacity(check_positive(num_tokens, "num_tokens"))

    def prepare(self, num_tokens, device=None):
        """num_tokens: the largest micro-batch's token count (a positive int; ValueError
        naming it otherwise); device: accepted, unused. Raises RuntimeError when the process
        already serves another signature (NeMo's process-global buffer); else records the
        signature and grows the process's capacity to this call's. Allocates nothing."""
        capacity = self._resolve_group_capacity(num_tokens, device)
        signature = self.signature
        with _HYBRIDEP_RUNTIME_LOCK:
            served = _HYBRIDEP_RUNTIME["signature"]
            if served is not None and served != signature:
                raise RuntimeError(
                    f"HybridEPPipelineRuntimeInitializer.prepare: the process-global buffer "
                    f"serves the HybridEP configuration {served}, this initializer's is "
                    f"{signature}; build every HybridEP dispatcher of the process alike, or "
                    f"call reset_hybrid_ep_buffer() first")
            _HYBRIDEP_RUNTIME.update(signature=signature,
                                     capacity=max(_HYBRIDEP_RUNTIME["capacity"], capacity))


_SHARED: dict = {}


def _current_trace():
    """The JAX trace nnx ties a module to (modules of another trace level cannot be used)."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


def shared_dispatcher(num_local_experts, config, ep_group=None):
    """One dispatcher per (config, L, axis) when config.moe_share_token_dispatcher is set
    (PyTorch's shared manager), else a new one. The shared one belongs to the JAX trace of its
    first call: a call under another trace (a layer built inside an nnx transform, e.g.
    stacked by nnx.vmap) gets a new one, since nnx refuses a module of another trace level."""
    def make():
        return MoEFlexTokenDispatcher(num_local_experts, range(num_local_experts), config,
                                      ep_group)
    if not config.moe_share_token_dispatcher:
        return make()
    key, trace = (config, num_local_experts, ep_group), _current_trace()
    if key not in _SHARED:
        _SHARED[key] = (trace, make())
    shared_trace, dispatcher = _SHARED[key]
    return dispatcher if shared_trace == trace else make()


def _token_chunks(chunks, hidden, probs, indices, *rest):
    """hidden [T,H], probs [T,K], indices [T,K] and any more [T,...] arrays split into `chunks`
    equal chunks along T ([chunks, ceil(T/chunks), ...] each), T padded with tokens that go
    nowhere (zero rows, probs 0, indices -1: dispatched to no rank, combined to zero)."""
    size = -(-hidden.shape[0] // chunks)

    def split(x, fill):
        pad = [(0, chunks * size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, pad, constant_values=fill).reshape((chunks, size) + x.shape[1:])
    return (split(hidden, 0), split(probs, 0), split(indices, -1),
            *(split(x, 0) for x in rest))

"""Flax NNX front end: the PyTorch flex dispatcher's method names and a ready MoE layer."""

from jax_ep.flax.dispatcher import DispatchState, MoEFlexTokenDispatcher, shared_dispatcher
from jax_ep.flax.moe import (
    MoELayer,
    dense_forward,
    expert_tile_rows,
    shard_params,
    swiglu_experts,
)
from jax_ep.flax.training import shard_state

__all__ = [
    "DispatchState",
    "MoEFlexTokenDispatcher",
    "MoELayer",
    "dense_forward",
    "expert_tile_rows",
    "shard_params",
    "shard_state",
    "shared_dispatcher",
    "swiglu_experts",
]

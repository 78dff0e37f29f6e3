"""Flax NNX front end: the PyTorch flex dispatcher's method names, Megatron-Core's MoE config
and router, and a ready MoE layer."""

from jax_ep.flax.dispatcher import DispatchState, MoEFlexTokenDispatcher, shared_dispatcher
from jax_ep.flax.moe import (
    ExpertBias,
    MoELayer,
    dense_forward,
    expert_tile_rows,
    shard_params,
    swiglu_experts,
)
from jax_ep.flax.moe_config import MoEConfig

__all__ = [
    "DispatchState",
    "ExpertBias",
    "MoEConfig",
    "MoEFlexTokenDispatcher",
    "MoELayer",
    "dense_forward",
    "expert_tile_rows",
    "shard_params",
    "shared_dispatcher",
    "swiglu_experts",
]

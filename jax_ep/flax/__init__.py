"""Flax NNX front end: the PyTorch flex dispatcher's method names, Megatron-Core's MoE config
and router, and a ready MoE layer."""

from jax_ep.flax.dispatcher import (DispatchState, HybridEPMetadataProcessor,
                                    HybridEPPipelineRuntimeInitializer, MoEFlexTokenDispatcher,
                                    reset_hybrid_ep_buffer, shared_dispatcher)
from jax_ep.flax.moe import (
    AuxLossTracker,
    ExpertBias,
    ForceBalanceStep,
    ForcedBias,
    InputJitterStep,
    MoEAuxLossAutoScaler,
    MoELayer,
    TokenCounts,
    TopKRouter,
    dense_forward,
    expert_tile_rows,
    gate_up_from_etp,
    gate_up_to_etp,
    pad_expert_blocks,
    shard_params,
    swiglu_expert_blocks,
    swiglu_experts,
    unpad_expert_blocks,
)
from jax_ep.flax.moe_config import MoEConfig
from jax_ep.flax.training import compilations, shard_state
from jax_ep.flax import moe_utils

__all__ = [
    "AuxLossTracker",
    "DispatchState",
    "ExpertBias",
    "ForceBalanceStep",
    "ForcedBias",
    "HybridEPMetadataProcessor",
    "HybridEPPipelineRuntimeInitializer",
    "InputJitterStep",
    "MoEAuxLossAutoScaler",
    "MoEConfig",
    "MoEFlexTokenDispatcher",
    "MoELayer",
    "TokenCounts",
    "TopKRouter",
    "compilations",
    "dense_forward",
    "expert_tile_rows",
    "moe_utils",
    "gate_up_from_etp",
    "gate_up_to_etp",
    "pad_expert_blocks",
    "reset_hybrid_ep_buffer",
    "shard_params",
    "shard_state",
    "shared_dispatcher",
    "swiglu_expert_blocks",
    "swiglu_experts",
    "unpad_expert_blocks",
]

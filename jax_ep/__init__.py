"""jax_ep: expert-parallel MoE token dispatch and combine for JAX/Flax.

DeepEP, HybridEP, UCCL-EP and plain all-to-all dispatch modes as XLA FFI custom calls (CPU and
CUDA handlers), differentiable with `custom_vjp`, run inside `jax.shard_map` over an expert
mesh axis. Layers: `jax_ep.ops` (local kernels) -> `jax_ep.transport` -> the modes
(`jax_ep.deepep`, ...) -> `jax_ep.flax`. See docs/contract.md for the contract.
"""

from jax_ep import ops, reference, transport
from jax_ep._ffi import WITH_CUDA
from jax_ep.all_to_all import all_to_all_single, all_to_all_single_equal
from jax_ep.buffer import Buffer, Config, EventHandle, EventOverlap, UCCLBuffer, topk_idx_t
from jax_ep.config import TokenDispatcherConfig
from jax_ep.deepep import (
    DispatchHandle,
    InternodeHandle,
    chunk_bounds,
    combine,
    dispatch,
    dispatch_chunked_forward,
)
from jax_ep.hybridep import (
    HybridEPHandle,
    hybridep_combine,
    hybridep_dispatch,
    required_capacity,
)
from jax_ep.low_latency import LowLatencyHandle, low_latency_combine, low_latency_dispatch
from jax_ep.ops import compute_send_counts

__all__ = [
    "WITH_CUDA",
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventHandle",
    "EventOverlap",
    "HybridEPHandle",
    "InternodeHandle",
    "LowLatencyHandle",
    "TokenDispatcherConfig",
    "UCCLBuffer",
    "all_to_all_single",
    "all_to_all_single_equal",
    "chunk_bounds",
    "combine",
    "compute_send_counts",
    "dispatch",
    "dispatch_chunked_forward",
    "hybridep_combine",
    "hybridep_dispatch",
    "low_latency_combine",
    "low_latency_dispatch",
    "ops",
    "reference",
    "required_capacity",
    "topk_idx_t",
    "transport",
]

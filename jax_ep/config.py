"""TokenDispatcherConfig: the PyTorch flex dispatcher's configuration, field for field, plus the
fields a JAX port needs (expert mesh axis, transport, static buffer sizes)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

import numpy as np

from jax_ep._checks import MAX_INT32
from jax_ep.ops import GROUPED_MATMUL_IMPLS
from jax_ep.transport import TRANSPORTS

__all__ = ["BACKENDS", "BUFFER_BOUNDS", "ROUTER_DTYPES", "TokenDispatcherConfig"]

BACKENDS = ("deepep", "hybridep", "uccl_ep", "alltoall")
ROUTER_DTYPES = ("fp32", "fp64", None)
# Fields that size the buffers below the no-drop worst case (or drop by design): each rules
# out dropless_buffer_factor, which bounds the buffers itself and keeps every token.
BUFFER_BOUNDS = ("ragged_buffer_factor", "num_worst_tokens", "num_permuted_tokens",
                 "moe_expert_capacity_factor")


def _require(ok: bool, field: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"TokenDispatcherConfig.{field}: expected {allowed}, got {value!r}")


def _is_int(value) -> bool:
    """Python or numpy integer, not bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _positive_int(value, allow_none=False) -> bool:
    if value is None:
        return allow_none
    return _is_int(value) and value > 0


@dataclasses.dataclass(frozen=True)
class TokenDispatcherConfig:
    """Configuration for MoE token dispatch and combine backends.

    PyTorch fields (same names, same defaults):
      moe_enable_deepep: use a DeepEP-family backend (informational here: the backend field
        decides).
      moe_permute_fusion: run the local permute/unpermute as fused FFI kernels (True) or as
        XLA ops (False); results are identical.
      moe_expert_capacity_factor: None (or a negative number, stored as None: Megatron's
        rule, as MoEConfig's) = no token dropped; else, as Megatron's router with
        its default "probs" drop policy, each expert keeps at most ceil(T*K/E * factor) of a
        rank's T tokens, those with the highest probabilities (every backend; the drops are
        counted in the dispatch state's num_dropped), and deepep-family buffers shrink to
        the L * that many rows per destination the drop leaves.
      moe_router_topk: experts per token (above num_moe_experts the config is accepted, as
        NeMo's, and the routing ops raise at trace time).
      moe_router_expert_pad_multiple: None or 0 (off, as NeMo reads 0), or pad every expert's
        block to a multiple of it (zero rows, prob 0, added on the receiving rank;
        tokens_per_expert reports padded sizes).
        This is what PyTorch's moe_router_padding_for_fp8 is for (blocks a multiple of 16,
        or 32 for MXFP8, for FP8 grouped GEMMs), set as a number: Megatron instead flips
        the first unrouted tokens of each expert's routing_map column to routed (real rows
        with prob 0 that cross the wire); here no filler row is sent and the outputs match.
      num_moe_experts: E.
      moe_router_dtype: "fp32", "fp64" (needs jax_enable_x64) or None (the input dtype) for
        the router softmax/top-k and the probabilities used to weight expert outputs.
      moe_flex_dispatcher_backend: "deepep", "hybridep", "uccl_ep", or (JAX only) "alltoall".
      moe_deepep_num_sms, moe_hybridep_num_sms, moe_hybridep_num_sms_preprocessing,
      moe_hybridep_num_blocks_permute, moe_hybridep_num_blocks_unpermute: SM / block budgets
        of the CUDA communication kernels. XLA schedules its own collectives, so these are
        validated and kept for config compatibility but do not change the program.
      moe_hybridep_permute_fusion: HybridEP always fuses the permutation into dispatch here.
      moe_hybridep_compact_routing: send top-k ids instead of the dense [T,E] routing map.
      moe_share_token_dispatcher: share one dispatcher across MoE layers.
      moe_deepep_async_dispatch: overlap dispatch with expert compute by splitting tokens
        into `num_overlap_chunks` chunks (deepep/uccl_ep/alltoall backends).
      moe_benchmark_static_routing: force balanced routing (benchmarks only).
    JAX-only fields:
      expert_axis_name: the mesh axis experts are sharded over, or a (node_axis, local_axis)
        pair (the dispatch then runs DeepEP's two hops, see jax_ep.deepep.dispatch).
      transport: "auto", "all_to_all", "ragged" or "peer" (see jax_ep.transport).
      num_worst_tokens: receive rows per rank for deepep modes (None: the no-drop worst case);
        not with moe_deepep_async_dispatch.
      num_permuted_tokens: permuted rows per rank for hybridep. None (default): the no-drop
        worst case P*T'*min(K, L) + L*(pad - 1) (T' the local token count equalised to a
        multiple of 4, L local experts, pad = moe_router_expert_pad_multiple or 1), or
        with ragged_buffer_factor f at most ceil(f*T'*K) + L*(pad - 1).
      num_overlap_chunks: token chunks used by moe_deepep_async_dispatch.
      ragged_buffer_factor: None (default) sizes the receive and permuted buffers for the
        no-drop worst case; a positive float f bounds them to f times the balanced load, as
        MaxText's option of that name (T local tokens, K top-k, P ranks): the deepep-family
        receive buffer to min(P*T, ceil(f*T*min(K, P))) rows (one row per (token, rank)),
        the permuted expert buffer (and hybridep's) to ceil(f*T*K) (token, expert) rows plus
        block padding. What does not fit is dropped and counted in num_dropped. An explicit
        num_worst_tokens (deepep family) / num_permuted_tokens (hybridep) wins over it.
        Memory per buffer: README.md, "Buffer sizes". Not with moe_deepep_async_dispatch.
      dropless_buffer_factor: None (default) or a positive float f: dropless, with the
        buffers of ragged_buffer_factor=f in the common step. The layer (jax_ep.flax.MoELayer,
        MoEFlexTokenDispatcher.bounded_forward) dispatches into the bounded buffers and, in
        a step where they would drop a row on any device, runs dispatch, experts and combine
        again over the tokens in chunks, one after another, each chunk small enough that its
        no-drop worst case fits in buffers of the bounded size (a lax.cond every device takes
        alike; its aux "buffer_overflow" is 1 then). No token is dropped; every step moves and
        permutes buffers of about f times the balanced load instead of the worst case, so the
        program's peak memory follows f (the two-hop mode's node-hop buffer stays at its
        worst case, as ragged_buffer_factor leaves it); a step that falls back runs both
        paths, the second in several rounds of exchanges. On GPUs each lax.cond (one in the
        forward, one in the backward) is a host sync: XLA:GPU reads its predicate on the
        host. Not with ragged_buffer_factor,
        num_worst_tokens, num_permuted_tokens, moe_expert_capacity_factor or
        moe_deepep_async_dispatch.
      grouped_gemm_impl: the experts' grouped GEMM, jax_ep.ops.grouped_matmul's impl:
        "auto" (the CPU handler "ffi" on CPU; jax.lax.ragged_dot on TPU, and on GPUs for at
        most 8 local experts, "tiled" beyond: see jax_ep.ops.grouped_matmul_impl), "ffi",
        "tiled", "blocks" or "ragged_dot".
      moe_fp8_dispatch: move the dispatched tokens as FP8 codes plus per-128-channel f32
        scales (jax_ep.dispatch / hybridep_dispatch use_fp8=True, fp8_output="cast_back":
        the experts get the rows cast back to the input dtype; gradients straight-through,
        moved back in the input dtype). Needs a hidden size (the rows' width on the wire:
        MoEConfig.moe_latent_size where set) that is a multiple of 128; not with
        moe_deepep_async_dispatch.
    """

    moe_enable_deepep: bool = True
    moe_permute_fusion: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_router_topk: int = 2
    moe_router_expert_pad_multiple: int | None = None
    num_moe_experts: int = 64
    moe_router_dtype: str | None = "fp32"
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep", "uccl_ep", "alltoall"] = "deepep"
    moe_deepep_num_sms: int = 20
    moe_hybridep_num_sms: int = 24
    moe_hybridep_permute_fusion: bool = False
    moe_hybridep_compact_routing: bool = False
    moe_hybridep_num_sms_preprocessing: int | None = None
    moe_hybridep_num_blocks_permute: int | None = None
    moe_hybridep_num_blocks_unpermute: int | None = None
    moe_share_token_dispatcher: bool = True
    moe_deepep_async_dispatch: bool = False
    moe_benchmark_static_routing: bool = False
    expert_axis_name: str | tuple = "expert"
    transport: str = "auto"
    num_worst_tokens: int | None = None
    num_permuted_tokens: int | None = None
    num_overlap_chunks: int = 2
    ragged_buffer_factor: float | None = None
    dropless_buffer_factor: float | None = None
    grouped_gemm_impl: str = "auto"
    moe_fp8_dispatch: bool = False

    def __post_init__(self):
        for name in ("moe_enable_deepep", "moe_permute_fusion", "moe_hybridep_permute_fusion",
                     "moe_hybridep_compact_routing", "moe_share_token_dispatcher",
                     "moe_deepep_async_dispatch", "moe_benchmark_static_routing",
                     "moe_fp8_dispatch"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, "a bool", value)
        _require(self.moe_flex_dispatcher_backend in BACKENDS, "moe_flex_dispatcher_backend",
                 f"one of {BACKENDS}", self.moe_flex_dispatcher_backend)
        _require(self.moe_router_dtype in ROUTER_DTYPES, "moe_router_dtype",
                 f"one of {ROUTER_DTYPES}", self.moe_router_dtype)
        _require(self.transport in TRANSPORTS, "transport", f"one of {TRANSPORTS}",
                 self.transport)
        _require(_positive_int(self.num_moe_experts) and self.num_moe_experts <= MAX_INT32,
                 "num_moe_experts", f"a positive int <= {MAX_INT32}", self.num_moe_experts)
        # K > E is accepted here, as NeMo's and Megatron's configs accept it; the routing ops
        # refuse it at trace time (topk_idx: top-k K exceeds num_experts E).
        _require(_positive_int(self.moe_router_topk) and self.moe_router_topk <= MAX_INT32,
                 "moe_router_topk", f"a positive int <= {MAX_INT32}", self.moe_router_topk)
        for name in ("moe_expert_capacity_factor", "ragged_buffer_factor",
                     "dropless_buffer_factor"):
            f = getattr(self, name)
            is_real = isinstance(f, numbers.Real) and not isinstance(f, (bool, np.bool_))
            if name == "moe_expert_capacity_factor" and is_real and f < 0 and f > -math.inf:
                object.__setattr__(self, name, f := None)  # Megatron's rule: dropless
            _require(f is None or (is_real and math.isfinite(f) and f > 0), name,
                     "None, a negative number (dropless) or a positive finite float"
                     if name == "moe_expert_capacity_factor" else
                     "None or a positive finite float", f)
        for name in ("ragged_buffer_factor", "dropless_buffer_factor", "num_worst_tokens"):
            _require(getattr(self, name) is None or not self.moe_deepep_async_dispatch, name,
                     "None with moe_deepep_async_dispatch=True (the chunked overlap sizes its "
                     "buffers per chunk for no drop)", getattr(self, name))
        for name in BUFFER_BOUNDS:
            _require(self.dropless_buffer_factor is None or getattr(self, name) is None,
                     "dropless_buffer_factor", f"None with {name} set (it bounds the buffers "
                     f"itself and keeps every token)", self.dropless_buffer_factor)
        _require(not self.moe_fp8_dispatch or not self.moe_deepep_async_dispatch,
                 "moe_fp8_dispatch", "False with moe_deepep_async_dispatch=True (the chunked "
                 "overlap moves rows in their own dtype)", self.moe_fp8_dispatch)
        _require(self.grouped_gemm_impl in GROUPED_MATMUL_IMPLS, "grouped_gemm_impl",
                 f"one of {GROUPED_MATMUL_IMPLS}", self.grouped_gemm_impl)
        for name in ("moe_deepep_num_sms", "moe_hybridep_num_sms", "num_overlap_chunks"):
            _require(_positive_int(getattr(self, name)), name, "a positive int",
                     getattr(self, name))
        pad = self.moe_router_expert_pad_multiple
        if _is_int(pad) and pad == 0:  # NeMo reads it as `if pad_multiple:`: 0 is off
            object.__setattr__(self, "moe_router_expert_pad_multiple", None)
        for name in ("moe_router_expert_pad_multiple", "moe_hybridep_num_sms_preprocessing",
                     "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
                     "num_worst_tokens", "num_permuted_tokens"):
            value = getattr(self, name)
            _require(_positive_int(value, allow_none=True) and (value is None or
                                                                 value <= MAX_INT32),
                     name, f"None or a positive int <= {MAX_INT32}", value)
        axis = self.expert_axis_name
        if isinstance(axis, list):
            axis = tuple(axis)
            object.__setattr__(self, "expert_axis_name", axis)
        _require((isinstance(axis, str) and axis) or (
            isinstance(axis, tuple) and len(axis) == 2
            and all(isinstance(a, str) and a for a in axis) and len(set(axis)) == 2),
            "expert_axis_name", "a mesh axis name or a (node_axis, local_axis) pair of names",
            axis)
        # numpy scalars (np.int64(8), np.float32(1.5)) are stored as Python numbers, so equal
        # configs hash alike (the shared dispatcher and jit's static arguments key on them).
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if _is_int(value) and not isinstance(value, int):
                object.__setattr__(self, field.name, int(value))
            elif isinstance(value, np.floating):
                object.__setattr__(self, field.name, float(value))

    @property
    def backend(self) -> str:
        return self.moe_flex_dispatcher_backend

"""Trace-time argument checks shared by every layer: each error names the argument and the
shape or value it got."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = [
    "FLOAT_DTYPES",
    "check_experts",
    "check_float",
    "check_positive",
    "check_rank",
    "check_routing",
    "check_shape",
    "expert_ids_as_int32",
]

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_rank(x, rank: int, name: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name}: expected a rank-{rank} array, got shape {tuple(jnp.shape(x))}")


def check_shape(x, shape: tuple, name: str) -> None:
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(jnp.shape(x))}")


def check_float(x, name: str) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {x.dtype}")


def check_positive(value, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")
    return int(value)


def check_experts(num_experts: int, num_ranks: int) -> int:
    """Returns L = num_experts // num_ranks after checking E % P == 0."""
    check_positive(num_experts, "num_experts")
    check_positive(num_ranks, "num_ranks")
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})"
        )
    return num_experts // num_ranks


def check_routing(topk_idx, topk_weights, num_experts: int):
    """Checks topk_idx [T,K] (int) and topk_weights [T,K] (float, may be None); returns the
    int32 indices and float32 weights."""
    check_rank(topk_idx, 2, "topk_idx")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"topk_idx: expected int32 or int64 expert ids, got {topk_idx.dtype}")
    num_tokens, top_k = topk_idx.shape
    if top_k > num_experts:
        raise ValueError(f"topk_idx: top-k {top_k} exceeds num_experts {num_experts}")
    if topk_weights is not None:
        check_shape(topk_weights, (num_tokens, top_k), "topk_weights")
        if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
            raise ValueError(f"topk_weights: expected a float array, got {topk_weights.dtype}")
        topk_weights = topk_weights.astype(jnp.float32)
    return expert_ids_as_int32(topk_idx, num_experts), topk_weights


def expert_ids_as_int32(topk_idx, num_experts: int):
    """topk_idx of any integer dtype -> int32. Ids of a wider dtype (int64, uint32, uint64) that
    lie outside [-1, num_experts) become -2, which is still outside, so the kernels reject or
    count them (never wrap an id like 2^32 + 3 into expert 3)."""
    ids = topk_idx.astype(jnp.int32)
    if jnp.iinfo(topk_idx.dtype).max <= jnp.iinfo(jnp.int32).max:
        return ids  # int8/16/32, uint8/16: every value fits
    bad = topk_idx >= num_experts
    if jnp.issubdtype(topk_idx.dtype, jnp.signedinteger):
        bad = bad | (topk_idx < -1)
    return jnp.where(bad, jnp.int32(-2), ids)

"""Trace-time argument checks shared by every layer: each error names the argument and the
shape or value it got."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.reference import FP8_BLOCK

__all__ = [
    "FLOAT_DTYPES",
    "FP8_OUTPUTS",
    "as_dtype",
    "as_int32_ids",
    "check_array",
    "check_axis_names",
    "check_bool",
    "check_coeff",
    "check_experts",
    "check_flag",
    "check_float",
    "check_float_weights",
    "check_fp8_dispatch",
    "check_map",
    "check_padding_mask",
    "check_positive",
    "check_rank",
    "check_real",
    "check_routing",
    "check_rows",
    "check_shape",
    "check_weights",
    "check_whole_bytes",
    "unroute_invalid_experts",
]

# The largest size, count or multiple the kernels take: their block arithmetic is int64, so
# products of two such values cannot overflow.
MAX_INT32 = 2**31 - 1

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
FP8_OUTPUTS = ("pair", "cast_back")


def check_rank(x, rank: int, name: str) -> None:
    if not hasattr(x, "shape"):  # a tuple of arrays would be stacked (and fail under jit)
        raise ValueError(f"{name}: expected a rank-{rank} array, got {type(x).__name__}")
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name}: expected a rank-{rank} array, got shape {tuple(jnp.shape(x))}")


def check_row_parts(parts, name: str) -> tuple:
    """A non-empty tuple of rank-2 row arrays of whole-byte dtypes with one row count (e.g.
    DeepEP's FP8 pair (x_fp8 [T,H], scales [T,G])), else a ValueError naming `name` (or
    `name`[i])."""
    parts = tuple(parts)
    if not parts:
        raise ValueError(f"{name}: expected an array or a non-empty tuple of row arrays, got ()")
    for i, part in enumerate(parts):
        check_rank(part, 2, f"{name}[{i}]")
        check_whole_bytes(part, f"{name}[{i}]")
        if part.shape[0] != parts[0].shape[0]:
            raise ValueError(f"{name}[{i}]: expected {parts[0].shape[0]} rows to match "
                             f"{name}[0] {parts[0].shape}, got shape {part.shape}")
    return parts


def check_rows(x, name: str) -> None:
    """ValueError naming `name` unless x is an array of at least one dimension (rows)."""
    if not hasattr(x, "shape"):
        raise ValueError(f"{name}: expected an array of rows, got {type(x).__name__}")
    if jnp.ndim(x) < 1:
        raise ValueError(f"{name}: expected at least one dimension, got shape {jnp.shape(x)}")


def check_array(x, name: str) -> None:
    """ValueError naming `name` unless x is an array (has a shape and a dtype: a jax or numpy
    array, a tracer): a Python list or scalar would pass jnp.shape and fail later."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name}: expected an array, got {type(x).__name__}")


def check_shape(x, shape: tuple, name: str) -> None:
    check_array(x, name)
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(jnp.shape(x))}")


def bit_width(dtype) -> int:
    """Bits per element of dtype (4 for int4 / uint4 / float4_e2m1fn, which XLA stores two to
    a byte although their numpy itemsize is 1)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return dtype.itemsize * 8


def check_whole_bytes(x, name: str) -> None:
    """ValueError naming `name` for a sub-byte dtype: the FFI handlers move whole bytes per
    element, and XLA packs these two to a byte (a row would be read at twice its size)."""
    if bit_width(x.dtype) < 8:
        raise ValueError(f"{name}: {x.dtype} packs two values per byte, which jax_ep's kernels do "
                         f"not move; cast to int8 / uint8 / float8 (or pack pairs into bytes) "
                         f"first")


def as_dtype(value, name: str):
    """jnp.dtype(value), or a ValueError naming `name` for what is no dtype."""
    try:
        return jnp.dtype(value)
    except TypeError:
        raise ValueError(f"{name}: expected a dtype, got {value!r}") from None


def check_float(x, name: str) -> None:
    check_array(x, name)
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {x.dtype}")


def check_float_weights(x, name: str) -> None:
    """Weights and probs: any float dtype (they are cast to float32)."""
    check_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a float array, got {x.dtype}")


def check_bool(value, name: str) -> bool:
    """value as a bool (a Python or numpy bool); anything else is a ValueError naming
    `name` (a string such as "no" would read as True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_flag(value, name: str) -> bool:
    """A kernel flag as a bool: a Python or numpy bool, an int 0 or 1, or a concrete 0-d bool
    or integer array of those; anything else (a string such as "no", None, a traced value) is
    a ValueError naming `name`. Looser than check_bool, which DeepEP's Buffer flags keep."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if (hasattr(value, "dtype") and jnp.ndim(value) == 0 and
            (jnp.issubdtype(value.dtype, jnp.bool_) or jnp.issubdtype(value.dtype, jnp.integer))):
        try:
            if int(value) in (0, 1):
                return bool(value)
        except jax.errors.ConcretizationTypeError:
            pass
    raise ValueError(f"{name}: expected a bool (a static one: it selects the kernel), got "
                     f"{value!r}")


def is_real(value) -> bool:
    """A Python or numpy real number (int, float; not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_real(value, name: str, *, positive: bool = False, allow_none: bool = False):
    """A static real parameter (part of what is traced, e.g. an activation's offset) as a
    float: a finite Python or numpy real, not a bool, > 0 with `positive`; None with
    allow_none. A string, a bool, NaN / inf, or a jax array (which may be traced) is a
    ValueError naming `name`."""
    if value is None and allow_none:
        return None
    expected = "None or " * allow_none + "a finite float" + " > 0" * positive
    if not is_real(value) or not np.isfinite(value) or (positive and value <= 0):
        got = "a jax array (this value is static)" if isinstance(value, jax.Array) else repr(value)
        raise ValueError(f"{name}: expected {expected}, got {got}")
    return float(value)


def check_coeff(value, name: str, *, allow_none: bool = False):
    """A coefficient that may be traced (a loss coefficient, an update rate, a token count):
    a 0-d jax / numpy array of a real dtype passes unread (no host sync); a Python value must
    be a finite real >= 0, not a bool; None with allow_none. Returned as given."""
    if value is None and allow_none:
        return None
    if is_real(value):
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        return value
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        if jnp.ndim(value) != 0 or not (jnp.issubdtype(value.dtype, jnp.floating)
                                        or jnp.issubdtype(value.dtype, jnp.integer)):
            raise ValueError(f"{name}: expected a scalar, got {value.dtype} of shape "
                             f"{tuple(jnp.shape(value))}")
        return value
    raise ValueError(f"{name}: expected {'None or ' * allow_none}a number >= 0 (or a 0-d "
                     f"array), got {value!r}")


def check_map(routing_map, name: str = "routing_map", rank: int = 2):
    """A routing map: a bool or integer array (nonzero = routed) of `rank`, as bool; a float
    map (NaN reads as routed) or anything else is a ValueError naming `name`."""
    check_rank(routing_map, rank, name)
    check_array(routing_map, name)
    dtype = routing_map.dtype
    if dtype == jnp.bool_:
        return routing_map
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name}: expected a bool or integer map, got {dtype}")
    return routing_map != 0


def check_padding_mask(padding_mask, shape, name: str = "padding_mask"):
    """None, or a bool / integer (nonzero = set) array of exactly `shape` (one flag per token:
    a [1] or [T, 1] mask would broadcast) -> None or the bool array."""
    if padding_mask is None:
        return None
    if not (hasattr(padding_mask, "dtype") and hasattr(padding_mask, "shape")) or (
            tuple(jnp.shape(padding_mask)) != tuple(shape)) or not (
            padding_mask.dtype == jnp.bool_ or jnp.issubdtype(padding_mask.dtype, jnp.integer)):
        got = (f"{padding_mask.dtype}{list(jnp.shape(padding_mask))}"
               if hasattr(padding_mask, "dtype") else repr(padding_mask))
        raise ValueError(f"{name}: expected None or bool{list(shape)} (one flag per token), "
                         f"got {got}")
    return jnp.asarray(padding_mask, bool)


def check_axis_names(value, name: str):
    """None, a mesh axis name or a tuple / list of them, each bound here (inside a shard_map
    over it) -> value (a list as a tuple); else a ValueError naming `name`."""
    if value is None:
        return None
    names = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{name}: expected None, a mesh axis name or a tuple of them, got "
                         f"{value!r}")
    for axis in names:
        try:
            jax.lax.axis_size(axis)
        except NameError:
            raise ValueError(f"{name}: mesh axis {axis!r} is not bound here (call inside a "
                             f"jax.shard_map over it, or pass None)") from None
    return names if isinstance(value, (tuple, list)) else value


def is_int(value, minimum: int = 1) -> bool:
    """Whether value is an integer (Python or numpy; not a bool) of at least `minimum`."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
            and value >= minimum)


def check_positive(value, name: str, *, allow_zero: bool = False, upper: int | None = None):
    """value as an int after checking it is one, > 0 (or >= 0 with allow_zero) and, with
    `upper`, at most that."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")
    if upper is not None and value > upper:
        raise ValueError(f"{name}: expected an int <= {upper}, got {value}")
    return int(value)


def check_experts(num_experts: int, num_ranks: int) -> int:
    """Returns L = num_experts // num_ranks after checking E % P == 0."""
    check_positive(num_experts, "num_experts", upper=MAX_INT32)
    check_positive(num_ranks, "num_ranks", upper=MAX_INT32)
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})"
        )
    return num_experts // num_ranks


def check_top_k(top_k: int, num_experts: int, name: str, experts_name: str = "num_experts"):
    """ValueError naming `name` when top_k experts per token exceed the num_experts (called
    `experts_name` in the message) a router can pick from."""
    if top_k > num_experts:
        raise ValueError(f"{name}: top-k {top_k} exceeds {experts_name} {num_experts}")


def check_routing(topk_idx, topk_weights, num_experts: int, *, any_top_k: bool = False,
                  weights_name: str = "topk_weights", weights_required: bool = False):
    """Checks num_experts (an int > 0), topk_idx [T,K] (int) and topk_weights [T,K] (float;
    None allowed unless weights_required; called `weights_name` in errors); returns the int32
    indices and float32 weights. K > num_experts is an error unless any_top_k (ids masked
    with -1, e.g. a received row's local ids: K slots, L < K local experts)."""
    check_positive(num_experts, "num_experts", upper=MAX_INT32)
    check_rank(topk_idx, 2, "topk_idx")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"topk_idx: expected integer expert ids, got {topk_idx.dtype}")
    num_tokens, top_k = topk_idx.shape
    if not any_top_k:
        check_top_k(top_k, num_experts, "topk_idx")
    return (as_int32_ids(topk_idx, num_experts, "topk_idx"),
            check_weights(topk_weights, (num_tokens, top_k), weights_name,
                          required=weights_required))


def check_weights(topk_weights, shape, name: str = "topk_weights", *, required: bool = False):
    """topk_weights [T,K] float checked against `shape` and returned as float32 (None: None
    unless required); ValueError naming `name` otherwise."""
    if topk_weights is None:
        if required:
            raise ValueError(f"{name}: expected a float array of shape {tuple(shape)}, got None")
        return None
    check_rank(topk_weights, len(shape), name)
    check_shape(topk_weights, shape, name)
    check_float_weights(topk_weights, name)
    return topk_weights.astype(jnp.float32)


def as_int32_ids(ids, upper: int, name: str):
    """Indices of any integer dtype -> int32. Values of a wider dtype (int64, uint32, uint64)
    outside [-1, upper) become -2, which is still outside, so the kernels reject or skip them
    as they would the original value (never wrap an id like 2^32 + 3 into 3)."""
    check_array(ids, name)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}: expected integer indices, got {ids.dtype}")
    ids32 = ids.astype(jnp.int32)
    if jnp.iinfo(ids.dtype).max <= jnp.iinfo(jnp.int32).max:
        return ids32  # int8/16/32, uint8/16: every value fits
    bad = ids >= upper
    if jnp.issubdtype(ids.dtype, jnp.signedinteger):
        bad = bad | (ids < -1)
    return jnp.where(bad, jnp.int32(-2), ids32)


def unroute_invalid_experts(topk_idx, num_experts: int):
    """int32 topk_idx [T,K] -> (topk_idx with ids outside [-1, E) set to -1, their count i32[]).
    The expert-parallel modes route this way on every platform (as the GPU kernels do): a
    layer-1 CPU kernel raises on such an id, and an error on one rank would leave the other
    ranks waiting in the next collective."""
    invalid = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(invalid, -1, topk_idx), invalid.sum(dtype=jnp.int32)


def check_fp8_dispatch(x, fp8_output, round_scale, use_ue8m0) -> None:
    """Arguments of a dispatch with use_fp8=True: x one [T,H] float array, H % 128 == 0."""
    if fp8_output not in FP8_OUTPUTS:
        raise ValueError(f"fp8_output: expected one of {FP8_OUTPUTS}, got {fp8_output!r}")
    if isinstance(x, (tuple, list)):
        raise ValueError("x: use_fp8=True casts x itself; expected one [T,H] float array, got a "
                         "tuple (an FP8 pair dispatches as it is, with use_fp8=False)")
    check_rank(x, 2, "x")
    check_float(x, "x")
    if x.shape[1] % FP8_BLOCK:
        raise ValueError(f"x: hidden size {x.shape[1]} must be a multiple of {FP8_BLOCK} with "
                         f"use_fp8=True, got shape {tuple(x.shape)}")
    round_scale = check_flag(round_scale, "round_scale")
    if check_flag(use_ue8m0, "use_ue8m0") and not round_scale:
        raise ValueError("use_ue8m0: requires round_scale=True (UE8M0 scales are powers of two)")

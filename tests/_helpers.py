"""Helpers shared by the layer-1 tests (imported as `_helpers`; tests/ is on sys.path)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jax_ep import _ffi


@functools.lru_cache(maxsize=None)
def _jitted(fn, static_items):
    return jax.jit(functools.partial(fn, **dict(static_items)))


def jit_op(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jax.jit: array keywords are traced, every other keyword is
    static. Compiling the reference once per shape is several times faster on CPU than running
    it op by op."""
    dynamic = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in dynamic))
    return _jitted(fn, static)(*args, **dynamic)


def ref(fn, *args, **static):
    """The pure-JAX reference (impl="xla") of op `fn`, jitted."""
    return jit_op(fn, *args, impl="xla", **static)


def cuda_contract() -> bool:
    """True when the FFI calls traced now run the CUDA handlers (under the CUDA emulator on this
    CPU: JAX_EP_USE_CUDA_EMU=1), whose contract differs from the CPU handlers' in two documented
    ways: expert ids outside [-1, E) (and unpermute indices outside [-1, T)) are unrouted and
    counted instead of an InvalidArgument error, and denormal floats are kept where XLA:CPU,
    which runs the CPU handlers and the reference, flushes them to zero."""
    return _ffi.handlers() == "cuda_emu"


def random_routing(rng: np.random.Generator, num_tokens: int, top_k: int, num_experts: int,
                   unrouted: float = 0.2) -> np.ndarray:
    """int32 [T,K] of global expert ids, distinct within a row, a fraction of slots -1."""
    assert top_k <= num_experts
    keys = rng.random((num_tokens, num_experts))
    idx = np.argsort(keys, axis=1)[:, :top_k].astype(np.int32)
    if unrouted:
        idx[rng.random(idx.shape) < unrouted] = -1
    return idx


def random_routing_map(rng: np.random.Generator, num_tokens: int, num_experts: int,
                       density: float = 0.3) -> np.ndarray:
    """bool [T,E] routing map with about `density` of the pairs routed."""
    return rng.random((num_tokens, num_experts)) < density


def random_tokens(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Normal values in `dtype` (ml_dtypes bfloat16 included), as a numpy array."""
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)

"""Loads the compiled extension and registers its XLA FFI targets (CPU always, CUDA if built)."""

from __future__ import annotations

import jax

from jax_ep import _jax_ep

__all__ = ["WITH_CUDA", "call"]

WITH_CUDA: bool = bool(_jax_ep.with_cuda)


def _register_all() -> None:
    for platform, targets in _jax_ep.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_all()


def call(target: str, results, *args, **attrs):
    """Runs FFI target `target` on `args` with static `attrs`; `results` are ShapeDtypeStructs.

    Batching under `vmap` runs the handler once per batch element.
    """
    return jax.ffi.ffi_call(target, results, vmap_method="sequential")(*args, **attrs)

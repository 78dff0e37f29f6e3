"""Loads the compiled extension and registers its XLA FFI targets (CPU always, CUDA if built)."""

from __future__ import annotations

import jax

from jax_ep import _jax_ep

__all__ = ["WITH_CUDA", "call", "make_varying", "trace_platform", "vary_like", "varying_axes"]

WITH_CUDA: bool = bool(_jax_ep.with_cuda)


def _register_all() -> None:
    for platform, targets in _jax_ep.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_all()


def trace_platform() -> str:
    """Platform the traced program runs on: the enclosing shard_map mesh's devices ("cpu",
    "gpu", "tpu"), or JAX's default backend where no mesh says (under vmap, outside a mesh)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def varying_axes(x) -> frozenset:
    """Manual mesh axes `x` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def make_varying(x, axes: frozenset):
    """x typed as varying over the manual mesh `axes` (inside shard_map)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def vary_like(x, *likes):
    """x typed as varying over (at least) the manual mesh axes any of `likes` varies over,
    inside shard_map, as an FFI call on `likes` would type its results; unchanged outside."""
    return make_varying(x, frozenset().union(*(varying_axes(a) for a in likes)))


def _varying_result(result, axes: frozenset, like):
    if not axes:
        return result
    aval = jax.typeof(like)
    if getattr(aval, "mat", None) is not None:  # jax >= 0.10: typed by mesh + manual axes
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(result.shape, result.dtype, sharding=sharding,
                                    manual_axis_type=aval.mat.update(varying=axes))
    return jax.ShapeDtypeStruct(result.shape, result.dtype, vma=axes)


def call(target: str, results, *args, **attrs):
    """Runs FFI target `target` on `args` with static `attrs`; `results` are ShapeDtypeStructs.

    Inside shard_map every argument is made to vary over the union of the arguments' manual
    axes and the results are typed the same way (an FFI call is per-device work). Batching
    under `vmap` runs the handler once per batch element.
    """
    axes = frozenset().union(*(varying_axes(a) for a in args))
    args = tuple(make_varying(a, axes) for a in args)
    single = not isinstance(results, (tuple, list))
    typed = [_varying_result(r, axes, args[0]) for r in ([results] if single else results)]
    fn = jax.ffi.ffi_call(target, typed[0] if single else typed, vmap_method="sequential")
    return fn(*args, **attrs)

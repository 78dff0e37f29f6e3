"""Training set-up: model and optimizer state placed on the mesh as a jitted step returns it.

A jitted train step returns every nnx.Variable it updates laid out by its sharding metadata
(an `out_sharding` / `sharding_names` entry, experts over the expert axis) or replicated over
the mesh where it has none. State made outside jit sits elsewhere: `nnx.Optimizer`'s step
counter and optax's `count` start on one device, so step 1 compiles for those inputs and
step 2, getting the mesh-wide outputs of step 1 back, compiles again. `shard_state` puts
everything there before step 1, so every step runs the first step's executable;
`compilations` counts them to show it.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["compilations", "shard_state"]

# What jax.monitoring reports once per executable a jit builds (fun_name="jit(<name>)").
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations(fun_name: str):
    """Collects the executables jit builds for functions named `fun_name` inside the block:
    yields a list that gets each one's build time in seconds (len = how many). Counted through
    the public jax.monitoring listeners, so every executable is seen, whether XLA compiles it
    or the persistent compilation cache hands it back.

        with compilations("train_step") as built:
            for batch in batches:
                train_step(model, optimizer, batch)
        assert len(built) == 1
    """
    seen = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT and kwargs.get("fun_name") == f"jit({fun_name})":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _on_host(value):
    """value as host memory for device_put (typed PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(value), jax.random.key_impl(value)
    return np.asarray(value), None


def _as_returned(sharding, ndim):
    """`sharding` spelled as a jitted step returns it, which jit's cache tells apart from
    other spellings of the same layout: per dimension (P(None, None)) under Explicit axes,
    where shardings are part of the types, and without trailing unsharded dimensions
    (P("expert",), P()) under Auto axes, XLA's partitioner's own spelling."""
    mesh, spec = sharding.mesh, tuple(sharding.spec)
    explicit = all(kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)
    if explicit:
        spec = spec + (None,) * (ndim - len(spec))
    else:
        while spec and spec[-1] is None:
            spec = spec[:-1]
    return NamedSharding(mesh, P(*spec))


def _place(value, sharding):
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        # Already global over processes (e.g. placed by shard_params): reshard on device.
        return jax.device_put(value, _as_returned(sharding, value.ndim))
    data, impl = _on_host(value)
    placed = jax.device_put(data, _as_returned(sharding, data.ndim - (impl is not None)))
    return placed if impl is None else jax.random.wrap_key_data(placed, impl=impl)


def _shard_module_state(module, mesh):
    state = nnx.state(module)
    try:  # jax's errors name a spec, not the mesh that does not fit it
        placed = jax.tree.map(_place, state, nnx.get_named_sharding(state, mesh))
    except ValueError as error:
        raise ValueError(f"mesh: the state's sharding does not fit the mesh "
                         f"{dict(mesh.shape)}: {error}") from None
    nnx.update(module, placed)


def _check_built_meshes(model, mesh):
    """ValueError naming mesh where a module of `model` was built with another jax Mesh (a
    MoELayer's `mesh`): its state would be placed on devices its calls do not run on."""
    for path, node in nnx.iter_graph(model):
        built = getattr(node, "mesh", None) if isinstance(node, nnx.Module) else None
        if isinstance(built, jax.sharding.Mesh) and built != mesh:
            where = "/".join(map(str, path)) or "the model"
            raise ValueError(f"mesh: {where} was built with the mesh {dict(built.shape)} of "
                             f"devices {[d.id for d in built.devices.flat]}, got "
                             f"{dict(mesh.shape)} of devices {[d.id for d in mesh.devices.flat]}")


def shard_state(model, optimizer, mesh):
    """Places all nnx state of `model` (parameters and non-trainable variables alike) and of
    `optimizer` (an nnx.Optimizer or None: its step counter and the optax state) on `mesh`:
    each variable by its sharding metadata, replicated (P()) where it has none. This is
    where a jitted step over the mesh returns them, so step 2 reuses step 1's executable.

    Works with Auto and Explicit mesh axes (each mesh all one type) and across processes:
    arrays local to a process go through host memory, so every process must hold the same
    values (same seed); arrays already global over the processes are resharded on device.
    Returns (model, optimizer), updated in place."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not nnx.graph.is_graph_node(model):  # a Module, Rngs, ...: what nnx.state reads
        raise ValueError(f"model: expected an nnx.Module, got {type(model).__name__}")
    _check_built_meshes(model, mesh)
    if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
        raise ValueError(f"optimizer: expected an nnx.Optimizer or None, got "
                         f"{type(optimizer).__name__}")
    _shard_module_state(model, mesh)
    if optimizer is not None:
        _shard_module_state(optimizer, mesh)
    return model, optimizer

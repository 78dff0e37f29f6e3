"""Loads the compiled extension and registers its XLA FFI targets (CPU always, CUDA if built,
and the emulated CUDA handlers on the CPU platform where the JAX_EP_CUDA_EMU build made them).

`JAX_EP_USE_CUDA_EMU=1` in the environment (read at import) routes every FFI call of a target
with a CUDA handler to the emulated CUDA handlers: the .cu kernels run on the CPU under the
CUDA emulator (xla_ffi/emu). CPU-only targets (the grouped GEMM) keep their CPU handler.
`use_handlers` switches that per trace, for tests that compare both on one machine.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading

import jax

from jax_ep import _jax_ep
from jax_ep._checks import check_whole_bytes

__all__ = ["EMULATED_CUDA_SUFFIX", "WITH_CUDA", "WITH_CUDA_EMU", "call",
           "emulated_cuda_launch_counts", "gpus_without_peer_access", "handlers",
           "make_varying", "register_stateful_targets", "trace_platform", "use_handlers",
           "vary_like", "vary_together", "varying_axes"]

WITH_CUDA: bool = bool(_jax_ep.with_cuda)
EMULATED_CUDA_SUFFIX = "_cuda_emu"


def _load_emulated_cuda():
    try:
        return importlib.import_module("jax_ep._jax_ep_cuda_emu")
    except ImportError:
        return None


_jax_ep_cuda_emu = _load_emulated_cuda()
WITH_CUDA_EMU: bool = _jax_ep_cuda_emu is not None


def _register_all() -> None:
    """Registers the targets whose handlers are one capsule. The targets with an instantiate
    stage ({stage: capsule}) wait for `register_stateful_targets`: XLA refuses a handler whose
    state type it does not know yet, and for a backend that has not started JAX (0.10) holds
    both and registers the targets before the types when it starts."""
    modules = [_jax_ep] + ([_jax_ep_cuda_emu] if WITH_CUDA_EMU else [])
    for module in modules:
        for platform, targets in module.registrations().items():
            for name, handler in targets.items():
                if isinstance(handler, dict):
                    _stateful.setdefault((module, platform), {})[name] = handler
                else:
                    jax.ffi.register_ffi_target(name, handler, platform=platform)


# {(module, platform): {target name: {stage: capsule}}} not registered yet
_stateful: dict = {}
_stateful_lock = threading.Lock()
_register_all()
_STATEFUL_TARGETS = frozenset(name for targets in _stateful.values() for name in targets)


def register_stateful_targets() -> None:
    """Registers the targets with an instantiate stage (the peer exchange), each platform's
    state types first. It starts JAX's backends if they have not started; `call` runs it when
    it first traces such a target, and importing jax_ep once they run. A process that runs a
    peer program it did not trace (a deserialized executable) calls it first."""
    with _stateful_lock:
        if not _stateful:
            return
        jax.devices()  # the backends run (they do already when a program is traced)
        for (module, platform), targets in list(_stateful.items()):
            for name, registration in module.state_types()[platform].items():
                jax.ffi.register_ffi_type(name, registration, platform=platform)
            for name, bundle in targets.items():
                jax.ffi.register_ffi_target(name, bundle, platform=platform)
            del _stateful[(module, platform)]


def _backends_started() -> bool:
    try:  # a private JAX helper; without it the registration waits for the first trace
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        return False
    return backends_are_initialized()


if _backends_started():
    register_stateful_targets()


def emulated_cuda_launch_counts(reset: bool = False) -> dict[str, int]:
    """{kernel instance: launches} the CUDA emulator ran in this process (since the start or the
    last reset), e.g. {"jax_ep::GatherRowsKernel<uint4>": 2}; `reset` zeroes the counts
    after reading them. Needs the JAX_EP_CUDA_EMU build."""
    if not WITH_CUDA_EMU:
        raise ValueError("this jax_ep build has no emulated CUDA handlers "
                         "(reinstall with JAX_EP_CUDA_EMU=ON)")
    return dict(_jax_ep_cuda_emu.launch_counts(reset))


def _handlers_from_env() -> str:
    value = os.environ.get("JAX_EP_USE_CUDA_EMU", "0")
    if value not in ("0", "1"):
        raise ValueError(f"JAX_EP_USE_CUDA_EMU must be 0 or 1, got {value!r}")
    if value == "1" and not WITH_CUDA_EMU:
        raise ImportError("JAX_EP_USE_CUDA_EMU=1, but this jax_ep build has no emulated CUDA "
                          "handlers: reinstall with JAX_EP_CUDA_EMU=ON pip install -e .")
    return "cuda_emu" if value == "1" else "native"


_DEFAULT_HANDLERS = _handlers_from_env()
_local = threading.local()


def handlers() -> str:
    """The handlers FFI calls traced now use: "native" (the platform's own: CPU or CUDA) or
    "cuda_emu" (the CUDA handlers under the emulator, on the CPU platform)."""
    return getattr(_local, "handlers", _DEFAULT_HANDLERS)


@contextlib.contextmanager
def use_handlers(kind: str):
    """Traces FFI calls inside the block with `kind` handlers ("native" or "cuda_emu"). It acts
    at trace time: a function jitted outside the block keeps the handlers it was traced with."""
    if kind not in ("native", "cuda_emu"):
        raise ValueError(f"kind must be 'native' or 'cuda_emu', got {kind!r}")
    if kind == "cuda_emu" and not WITH_CUDA_EMU:
        raise ValueError("this jax_ep build has no emulated CUDA handlers "
                         "(reinstall with JAX_EP_CUDA_EMU=ON)")
    previous = handlers()
    _local.handlers = kind
    try:
        yield
    finally:
        _local.handlers = previous


@functools.cache
def gpus_without_peer_access() -> tuple[tuple[int, int], ...]:
    """The pairs (a, b), a < b, of this process's CUDA GPUs (local hardware ids, the CUDA
    ordinals) that cannot read each other's memory (cudaDeviceCanAccessPeer, asked once per
    process), which the peer transport's CUDA handler needs between every two devices it
    serves. () without the CUDA handlers or GPUs; RuntimeError naming the CUDA call that
    failed (a driver older than the toolkit the handlers were built with, say)."""
    if not WITH_CUDA:
        return ()
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend in this process
        return ()
    ordinals = sorted(d.local_hardware_id for d in gpus)
    return tuple(tuple(pair) for pair in _jax_ep.cuda_peer_pairs_without_access(ordinals))


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


def vary_together(*arrays):
    """The arrays, each typed as varying over the union of the manual mesh axes any of them
    varies over (inside shard_map; unchanged outside): operands of one per-device op."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))
    return tuple(make_varying(a, axes) for a in arrays)


def _varying_result(result, axes: frozenset, like):
    if not axes:
        return result
    aval = jax.typeof(like)
    if getattr(aval, "mat", None) is not None:  # jax >= 0.10: typed by mesh + manual axes
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(result.shape, result.dtype, sharding=sharding,
                                    manual_axis_type=aval.mat.update(varying=axes))
    return jax.ShapeDtypeStruct(result.shape, result.dtype, vma=axes)


def call(target: str, results, *args, cuda_twin: bool = True, **attrs):
    """Runs FFI target `target` on `args` with static `attrs`; `results` are ShapeDtypeStructs.
    With the "cuda_emu" handlers (see `use_handlers`) it runs `target` + "_cuda_emu", unless
    `cuda_twin` is False (a CPU-only target, e.g. the grouped GEMM: its CPU handler runs).

    Inside shard_map every argument is made to vary over the union of the arguments' manual
    axes and the results are typed the same way (an FFI call is per-device work). Batching
    under `vmap` runs the handler once per batch element.
    """
    for i, arg in enumerate(args):  # the entry points name the argument; this is the backstop
        check_whole_bytes(arg, f"{target}: operand {i}")
    args = vary_together(*args)
    axes = varying_axes(args[0])  # every argument's now
    single = not isinstance(results, (tuple, list))
    typed = [_varying_result(r, axes, args[0]) for r in ([results] if single else results)]
    if handlers() == "cuda_emu" and cuda_twin:
        target += EMULATED_CUDA_SUFFIX
    if target in _STATEFUL_TARGETS:
        register_stateful_targets()
    fn = jax.ffi.ffi_call(target, typed[0] if single else typed, vmap_method="sequential")
    return fn(*args, **attrs)

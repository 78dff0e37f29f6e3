"""Shared test setup: 8 emulated CPU devices (for shard_map), a hypothesis profile and routing
generators.

XLA_FLAGS must be set before jax is imported anywhere, which is why it happens at the top of
this file (pytest imports conftest.py before any test module).
"""

from __future__ import annotations

import os
import subprocess
import sys

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()


def _cpu_only() -> bool:
    """Whether JAX will run on the CPU alone: JAX_PLATFORMS says "cpu", or names nothing and no
    GPU plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms == "cpu"
    from importlib import metadata
    return not any((dist.metadata["Name"] or "").lower().replace("_", "-").startswith(
        ("jax-cuda", "jax-rocm")) for dist in metadata.distributions())


# The CPU suite compiles thousands of small XLA:CPU programs (every eager op is one) and runs
# most once or twice, so most of its time is XLA compiling code that then runs for
# microseconds. Two flags make those compiles cheap: LLVM's optimisation level 0 for XLA's
# generated code, and XLA:CPU's elemental emitters in place of its MLIR fusion emitters
# (measured on the README stage's tests, summed over its workers: 2328 s -> 1316 s, their
# compiles 1337 s -> 561 s, against level 0 alone; at XLA's default level the emitters save
# nothing). XLA's HLO passes before fusion are the same; the fusion emitters fuse more (the
# layer's training step: 61 fusions against 45, more temp memory without them), with the same
# collectives and custom calls over the same axes. Float results may differ in the last bits
# (XLA:CPU's default contracts a*b+c into one FMA, level 0 does not).
# JAX_EP_TEST_XLA_OPT=default keeps XLA's default: .ci/run's Python 3.12 stage runs so, over
# the files that inspect compiled programs among others; GPU runs
# (tests/gpu/device_check.sh sets JAX_PLATFORMS) keep it too.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
ELEMENTAL_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA takes `flag` (jaxlib 0.10 has the elemental emitters, 0.12 has
    not). XLA aborts the process on an unknown flag, so a child process asks."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env=dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu"),
                           capture_output=True)
    return probe.returncode == 0


# (pytest-xdist's workers inherit the flags the controller process set here)
if os.environ.get("JAX_EP_TEST_XLA_OPT", "fast") == "fast" and _cpu_only() and \
        "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAGS
    if _xla_knows(ELEMENTAL_EMITTERS_FLAG):
        os.environ["XLA_FLAGS"] += " " + ELEMENTAL_EMITTERS_FLAG


import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from _helpers import random_routing, random_routing_map, random_tokens  # noqa: E402

settings.register_profile(
    "jax_ep",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("jax_ep_long", parent=settings.get_profile("jax_ep"),
                          max_examples=300)
# The emulated-CUDA run (.ci/emulated-cuda): every kernel runs under the CUDA emulator and the
# sanitizers, several times slower, so the properties draw fewer examples there.
settings.register_profile("jax_ep_emulated", parent=settings.get_profile("jax_ep"),
                          max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jax_ep"))

NUM_DEVICES = 8


@pytest.fixture
def padded_auto(monkeypatch):
    """transport="auto" resolves to the padded all_to_all instead of peer: for the tests whose
    subject is the program of XLA collectives (shapes, dtypes, groups, bytes on that wire)."""
    from jax_ep import transport

    real = transport.resolve_transport
    monkeypatch.setattr(transport, "resolve_transport",
                        lambda t, no_peer=None: real(t, no_peer or (
                            "padded_auto" if t == "auto" else None)))

# With JAX_EP_EMU_LAUNCH_LOG=PREFIX (and the emulated CUDA handlers built), each test's emulated
# kernel launches, by kernel instance, go to PREFIX.<xdist worker> as one JSON line per test;
# `.ci/emu_coverage.py launches PREFIX` sums them up (a coverage measure of the emulated stage).
_LAUNCH_LOG = os.environ.get("JAX_EP_EMU_LAUNCH_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _LAUNCH_LOG:
        yield
        return
    from jax_ep import _ffi

    _ffi.emulated_cuda_launch_counts(reset=True)
    yield
    launches = _ffi.emulated_cuda_launch_counts(reset=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{_LAUNCH_LOG}.{worker}", "a") as log:
        log.write(json.dumps({"test": item.nodeid, "launches": launches}) + "\n")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's node id: reproducible per test, distinct across tests."""
    seed = sum(request.node.nodeid.encode()) * 7919 % (2**31)
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def make_routing():
    return random_routing


@pytest.fixture(scope="session")
def make_routing_map():
    return random_routing_map


@pytest.fixture(scope="session")
def make_tokens():
    return random_tokens


@pytest.fixture(scope="session")
def ep_mesh():
    """A 1-D mesh of the 8 emulated CPU devices with axis "ep"."""
    devices = jax.devices("cpu")
    if len(devices) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} CPU devices, got {len(devices)} "
                    "(was jax imported before tests/conftest.py set XLA_FLAGS?)")
    return jax.sharding.Mesh(np.array(devices[:NUM_DEVICES]), ("ep",))

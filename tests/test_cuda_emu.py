"""The CUDA emulator (xla_ffi/emu) that runs jax_ep's .cu kernels on the CPU, and the switch
that routes FFI calls to it.

tests/cpp/cuda_emu_selftest.cc is built here with AddressSanitizer and UndefinedBehaviorSanitizer
and run: the execution model (barriers with exited threads, warp collectives, shared memory,
atomics, launch limits, denormals), the errors the emulator reports (deadlock, a shuffle naming
an exited lane, CUB temporary storage reused without a barrier), and the CUB stand-ins against
plain C++ references. Its deliberate-bug modes must be stopped by the sanitizers, so this
harness cannot silently stop checking. The jax_ep suites themselves run through the emulated
handlers with JAX_EP_USE_CUDA_EMU=1 (README, "Emulated CUDA").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jax_ep import _ffi, ops

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "xla_ffi" / "emu"


def _cuda_include_dir() -> Path | None:
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda_fp16.h").exists():
            return Path(base) / "include"
    return None


@pytest.fixture(scope="module")
def selftest(tmp_path_factory) -> str:
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    include = _cuda_include_dir()
    if compiler is None or include is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    exe = str(tmp_path_factory.mktemp("cuda_emu") / "cuda_emu_selftest")
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-ffp-contract=off", "-fno-strict-aliasing",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
         "-I" + str(EMU / "include"), "-isystem", str(include),
         str(ROOT / "tests" / "cpp" / "cuda_emu_selftest.cc"), str(EMU / "emulator.cc"),
         "-o", exe], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def _run(exe, *args):
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    env.pop("LD_PRELOAD", None)
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env=env)


def test_emulator_and_cub_stand_ins(selftest):
    done = _run(selftest)
    assert done.returncode == 0 and "failed 0" in done.stdout, done.stdout[-4000:] + done.stderr
    checks = int(done.stdout.split("checks ")[1].split()[0])
    assert checks >= 100


@pytest.mark.parametrize("mode,report", [
    ("oob", "AddressSanitizer: heap-buffer-overflow"),
    ("smem_oob", "AddressSanitizer: heap-buffer-overflow"),
    ("misaligned", "misaligned address"),
])
def test_sanitizers_stop_a_deliberate_bug_in_a_kernel(selftest, mode, report):
    done = _run(selftest, mode)
    assert done.returncode != 0 and report in done.stderr, done.stdout + done.stderr[-4000:]
    assert "no report" not in done.stdout


def _custom_call_targets(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.skipif(not _ffi.WITH_CUDA_EMU, reason="built without JAX_EP_CUDA_EMU")
def test_use_handlers_routes_ffi_calls_to_the_emulated_cuda_handlers():
    x, idx = jnp.ones((4, 128)), jnp.zeros((4,), jnp.int32)
    with _ffi.use_handlers("cuda_emu"):
        emulated = _custom_call_targets(lambda a, i: ops.gather_rows(a, i), x, idx)
        got = ops.gather_rows(x * 2, idx)
    with _ffi.use_handlers("native"):
        native = _custom_call_targets(lambda a, i: ops.gather_rows(a, i), x, idx)
    assert "jax_ep_gather_rows_cuda_emu" in emulated
    assert "jax_ep_gather_rows" in native and "_cuda_emu" not in native
    assert float(got.sum()) == 2 * 4 * 128


@pytest.mark.skipif(not _ffi.WITH_CUDA_EMU, reason="built without JAX_EP_CUDA_EMU")
def test_emulated_launch_counts_name_the_kernel_instances_that_ran():
    x, idx = jnp.ones((4, 128), jnp.float32), jnp.array([3, 0, 1, 1], jnp.int32)
    _ffi.emulated_cuda_launch_counts(reset=True)
    with _ffi.use_handlers("cuda_emu"):
        jax.block_until_ready(jax.jit(ops.gather_rows)(x, idx))
        jax.block_until_ready(jax.jit(ops.gather_rows)(x, idx))
    counts = _ffi.emulated_cuda_launch_counts(reset=True)
    assert counts == {"jax_ep::GatherRowsKernel<uint4>": 2}  # 512-byte rows: 16-byte vectors
    assert _ffi.emulated_cuda_launch_counts() == {}


@pytest.mark.skipif(_ffi.WITH_CUDA_EMU, reason="this build has the emulated handlers")
def test_emulation_requested_without_the_emulated_build_is_a_clear_error():
    with pytest.raises(ValueError, match="JAX_EP_CUDA_EMU=ON"):
        with _ffi.use_handlers("cuda_emu"):
            pass
    done = subprocess.run([sys.executable, "-c", "import jax_ep"], capture_output=True,
                          text=True, env=dict(os.environ, JAX_EP_USE_CUDA_EMU="1"))
    assert done.returncode != 0 and "JAX_EP_CUDA_EMU=ON" in done.stderr, done.stderr[-2000:]


def test_use_handlers_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="native"):
        with _ffi.use_handlers("cuda"):
            pass

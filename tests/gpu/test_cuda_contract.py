"""The CUDA handlers called directly with `jax.ffi.ffi_call`: result shapes that do not match
the operands are an InvalidArgument error naming the shapes (the checks are checks.h's, shared
with the CPU handlers), never an out-of-bounds write. The test of tests/test_ffi_contract.py,
collected here so that `pytest tests/gpu` (device_check.sh) runs it on the GPU, JAX's default
device, where its operands live. Skipped unless that device is a GPU."""

from __future__ import annotations

import jax
import pytest

if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a GPU as JAX's default device (under the CUDA emulator "
                "tests/test_ffi_contract.py runs the emulated handlers itself)",
                allow_module_level=True)

from test_ffi_contract import (  # noqa: E402,F401  (tests/ is on sys.path via its conftest)
    test_ffi_target_rejects_results_that_do_not_match_its_operands,
)

"""The CUDA handlers called directly with `jax.ffi.ffi_call`: result shapes that do not match
the operands are an InvalidArgument error naming the shapes (the checks are checks.h's, shared
with the CPU handlers), never an out-of-bounds write. Same cases as tests/test_ffi_contract.py,
each also run once with the right shapes. Skipped unless JAX's default device is a GPU."""

from __future__ import annotations

import jax
import pytest

if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a GPU as JAX's default device", allow_module_level=True)

from test_ffi_contract import CASES  # noqa: E402  (tests/ is on sys.path via its conftest)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_target_rejects_results_that_do_not_match_its_operands(case):
    _, target, operands, attrs, right, wrong, message = case
    operands = jax.device_put(operands, jax.devices()[0])
    if right is not None:
        jax.block_until_ready(jax.ffi.ffi_call(target, right)(*operands, **attrs))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.ffi.ffi_call(target, wrong)(*operands, **attrs))

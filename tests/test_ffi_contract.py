"""The FFI targets themselves, called directly with `jax.ffi.ffi_call`: a caller chooses the
result shapes, so every CPU handler checks them against its operands and answers a mismatch
with an InvalidArgument error naming the shapes, never an out-of-bounds write. Each case also
runs once with the right result shapes, so a failure to match is the handler's answer and not
a mistyped call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep  # noqa: F401  (registers the targets)

T, K, E, P, H, N = 6, 2, 8, 2, 256, 12
I32, F32, BOOL, BF16 = jnp.int32, jnp.float32, jnp.bool_, jnp.bfloat16
FP8 = jnp.float8_e4m3fn


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _operands():
    rng = np.random.default_rng(0)
    topk_idx = jnp.asarray(rng.integers(-1, E, (T, K)), I32)
    topk_w = jnp.asarray(rng.random((T, K)), F32)
    tokens = jnp.asarray(rng.standard_normal((T, H)), BF16)
    routing_map = jnp.zeros((T, E), BOOL).at[:, 0].set(True)
    rows = jnp.asarray(np.arange(N) % T, I32)
    return topk_idx, topk_w, tokens, routing_map, rows


def _cases():
    topk_idx, topk_w, tokens, routing_map, rows = _operands()
    x_fp8 = jnp.zeros((T, H), FP8)
    rows512 = jnp.zeros((T, 512), BF16)  # LogFMT needs H % 512 == 0
    # (id, target, operands, attributes, right results, wrong results, message)
    return [
        ("dispatch_layout", "jax_ep_dispatch_layout", (topk_idx,),
         dict(num_experts=np.int64(E), num_ranks=np.int64(P)),
         (sds((P,), I32), sds((T, P), BOOL), sds((E,), I32), sds((), I32)),
         (sds((P,), I32), sds((T, P), BOOL), sds((E // 2,), I32), sds((), I32)),
         "dispatch layout: result shapes"),
        ("send_layout", "jax_ep_send_layout", (topk_idx, topk_w),
         dict(num_ranks=np.int64(P), num_local_experts=np.int64(E // P)),
         (sds((T * P,), I32), sds((T * P,), I32), sds((T * P, K), I32), sds((T * P, K), F32),
          sds((P,), I32), sds((), I32)),
         (sds((T,), I32), sds((T * P,), I32), sds((T * P, K), I32), sds((T * P, K), F32),
          sds((P,), I32), sds((), I32)),
         "send layout: result shapes"),
        ("multihot", "jax_ep_indices_to_multihot", (topk_idx, topk_w),
         dict(num_experts=np.int64(E)),
         (sds((T, E), BOOL), sds((T, E), F32)),
         (sds((T, E), BOOL), sds((T, E // 2), F32)),
         "indices_to_multihot: results must be"),
        ("multihot_probs_operand", "jax_ep_indices_to_multihot", (topk_idx, topk_w[:, :1]),
         dict(num_experts=np.int64(E)),
         None,
         (sds((T, E), BOOL), sds((T, E), F32)),
         "topk_probs: expected shape"),
        ("permute", "jax_ep_permute", (tokens, routing_map, jnp.zeros((T, E), F32)),
         dict(pad_multiple=np.int64(0), drop_and_pad=False),
         (sds((N, H), BF16), sds((N,), F32), sds((N,), I32), sds((E,), I32), sds((), I32)),
         (sds((N // 2, H), BF16), sds((N,), F32), sds((N,), I32), sds((E,), I32),
          sds((), I32)),
         "permute: result shapes"),
        ("gather_rows", "jax_ep_gather_rows", (tokens, rows), {},
         sds((N, H), BF16),
         sds((N, H // 2), BF16),
         "gather_rows: out must hold"),
        ("unpermute_width", "jax_ep_unpermute", (tokens, rows[:T], jnp.ones((T,), F32)), {},
         sds((T, H), BF16),
         sds((T, H * 2), BF16),
         "unpermute: out"),
        ("unpermute_dtype", "jax_ep_unpermute", (tokens, rows[:T], jnp.ones((T,), F32)), {},
         None,
         sds((T, H), F32),
         "unpermute: out"),
        ("cast_to_fp8", "jax_ep_cast_to_fp8", (tokens,),
         dict(round_scale=False, use_ue8m0=False),
         (sds((T, H), FP8), sds((T, H // 128), F32)),
         (sds((T, H), FP8), sds((T, H // 256), F32)),
         "per_token_cast_to_fp8: results must be"),
        ("cast_to_fp8_ue8m0", "jax_ep_cast_to_fp8", (tokens,),
         dict(round_scale=True, use_ue8m0=True),
         (sds((T, H), FP8), sds((T, 1), I32)),
         (sds((T // 2, H), FP8), sds((T, 1), I32)),
         "per_token_cast_to_fp8: results must be"),
        ("cast_back", "jax_ep_cast_back", (x_fp8, jnp.ones((T, H // 128), F32)),
         dict(use_ue8m0=False),
         sds((T, H), BF16),
         sds((T, H // 2), BF16),
         "per_token_cast_back: out must have"),
        ("logfmt_encode", "jax_ep_logfmt_encode", (rows512,), {},
         sds((T, 2 * 512 + 16), jnp.uint8),
         sds((T, 2 * 512), jnp.uint8),
         "wire: expected uint8"),
        ("logfmt_decode", "jax_ep_logfmt_decode", (jnp.zeros((T, 2 * 512 + 16), jnp.uint8),), {},
         sds((T, 512), F32),
         sds((T, 256), F32),
         "out: expected float32 or bfloat16"),
        ("grouped_gemm", "jax_ep_grouped_gemm",
         (tokens.astype(F32), jnp.zeros((2, H, 3), F32), jnp.asarray([2, 4], I32)),
         dict(transpose_rhs=False), sds((T, 3), F32), sds((T, 4), F32),
         r"out: expected shape \[6, 3\], got \[6, 4\]"),
        ("grouped_gemm_dw", "jax_ep_grouped_gemm_dw",
         (tokens.astype(F32), jnp.zeros((T, 3), F32), jnp.asarray([2, 4], I32)), {},
         sds((2, H, 3), F32), sds((3, H, 3), F32),
         r"out: expected shape \[2, 256, 3\], got \[3, 256, 3\]"),
    ]


CASES = _cases()


# Targets with a CPU handler only (xla_ffi/cpu_only_targets.h): not run where the operands
# live on a GPU (tests/gpu/test_cuda_contract.py collects this test).
CPU_ONLY = ("jax_ep_grouped_gemm", "jax_ep_grouped_gemm_dw")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ffi_target_rejects_results_that_do_not_match_its_operands(case):
    _, target, operands, attrs, right, wrong, message = case
    if target in CPU_ONLY and jax.devices()[0].platform != "cpu":
        pytest.skip(f"{target} has a CPU handler only")
    if right is not None:
        jax.block_until_ready(jax.ffi.ffi_call(target, right)(*operands, **attrs))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.ffi.ffi_call(target, wrong)(*operands, **attrs))

"""Layer 1: per_token_cast_to_fp8 and per_token_cast_back (CPU).

FFI against the pure-JAX reference (codes and scales bitwise; on AVX-512 CPUs for both the
AVX-512 and the portable handler loops), hand-computed e4m3 codes, scales and UE8M0 words,
every rounding tie of the e4m3 grid, all 256 codes cast back, round trips within FP8 error,
DeepEP's utils conventions (H not a multiple of 128, int32 scales read as UE8M0, scales in any
shape), jit / vmap / shard_map, argument errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _helpers import cuda_contract, jit_op, ref
from jax_ep import _jax_ep, ops, reference

F32, BF16, F16 = np.float32, ml_dtypes.bfloat16, np.float16
E4M3 = ml_dtypes.float8_e4m3fn


def codes(x_fp8) -> np.ndarray:
    """The raw e4m3 bytes of a float8_e4m3fn array."""
    return np.asarray(x_fp8).view(np.uint8)


def _scaled_input(rng, T, H, dtype):
    """Normal values with a different magnitude per token and per 128-channel group, a zero
    group (amax floor 1e-4), tiny groups (FP8 subnormals) and exact powers of two."""
    G = H // 128
    mag = 10.0 ** rng.uniform(-6, 4, (T, G, 1))
    x = (rng.standard_normal((T, G, 128)) * mag).reshape(T, H)
    x[0, :128] = 0.0
    if T > 1:
        x[1, :5] = [448.0, -448.0, 1.0, 2.0**-9, -(2.0**-6)]
    return x.astype(np.float32).astype(dtype)


def _cast_model(x, round_scale=False):
    """numpy model of the cast's contract (common.h), with IEEE denormals (no flush to zero):
    per 128-channel block amax = max(1e-4, max|x|), scale = amax * fl(1/448) (the next power of
    two with round_scale), codes = e4m3(x * m) rounded to nearest even, where the multiplier
    m = 448 * fl(1/amax), or 1/scale (exact) with round_scale. Finite x only.
    Returns (codes u8[T,H], scales f32[T,H/128])."""
    T, H = x.shape
    xb = np.asarray(x, np.float32).reshape(T, H // 128, 128)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(1e-4))
    scale = (amax * (np.float32(1) / np.float32(448))).astype(np.float32)
    if round_scale:
        scale = np.float32(2.0) ** np.ceil(np.log2(scale.astype(np.float64))).astype(np.float32)
        mult = (np.float32(1) / scale).astype(np.float32)
    else:
        mult = (np.float32(448) * (np.float32(1) / amax)).astype(np.float32)
    q = (xb * mult[..., None]).astype(E4M3).view(np.uint8).reshape(T, H)
    return q, scale


def _cast_back_model(q, scales, dtype):
    """numpy model of the cast back with IEEE denormals: e4m3 code * scale in fp32, a NaN
    product as the canonical NaN 0x7fc00000, then rounded to `dtype` (nearest even)."""
    T, H = q.shape
    v = np.asarray(q).view(E4M3).astype(np.float32).reshape(T, H // 128, 128)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN scales, overflows: IEEE
        out = (v * np.asarray(scales, np.float32)[..., None]).reshape(T, H)
        out[np.isnan(out)] = np.uint32(0x7FC00000).view(np.float32)
        return out.astype(dtype)


def _cast_both(x, **kw):
    got = ops.per_token_cast_to_fp8(jnp.asarray(x), **kw)
    want = ref(ops.per_token_cast_to_fp8, jnp.asarray(x), **kw)
    return got, want


def _pad_blocks(a):
    """a [T,H] -> [T, 128*ceil(H/128)] with zero channels appended (DeepEP's utils pad)."""
    return np.pad(a, ((0, 0), (0, -a.shape[1] % 128)))


def _pack_ue8m0_model(scale):
    """Power-of-two scales f32[T,G] -> int32 [T, ceil(G/4)]: their exponent bytes, zero-padded
    to whole words, four per int32 little-endian."""
    exps = (scale.view(np.uint32) >> 23).astype(np.uint8)
    exps = np.pad(exps, ((0, 0), (0, -exps.shape[1] % 4)))
    return np.ascontiguousarray(exps).view("<i4")


def _deepep_cast_back_model(q, scales):
    """DeepEP's tests/utils.py per_token_cast_back in numpy, kept in f32: pad the codes to whole
    128-channel blocks, read int32 scales as UE8M0 bytes (byte << 23 as f32), view the scales
    as [T, -1, 1], multiply, slice back to H."""
    T, H = q.shape
    codes_f32 = _pad_blocks(np.asarray(q).view(E4M3).astype(np.float32))
    s = np.asarray(scales)
    if s.dtype == np.int32:
        s = (s.view(np.uint8).astype(np.int32) << 23).view(np.float32)
    return (codes_f32.reshape(T, -1, 128) * s.reshape(T, -1, 1)).reshape(T, -1)[:, :H]


# ----------------------------------------------------------------------------- FFI vs reference

CAST_CASES = [
    # T, H, dtype, round_scale, use_ue8m0
    (1, 128, F32, False, False),
    (4, 384, BF16, False, False),
    (9, 256, F16, False, False),
    (5, 512, F32, True, False),
    (3, 640, BF16, True, True),     # G=5: the second UE8M0 word holds one byte
    (8, 1024, F16, True, True),
    (6, 512, F32, True, True),
    (16, 128, BF16, True, False),
]


@pytest.mark.parametrize("T,H,dtype,round_scale,use_ue8m0", CAST_CASES,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_cast_to_fp8_ffi_matches_reference(rng, T, H, dtype, round_scale, use_ue8m0):
    x = _scaled_input(rng, T, H, dtype)
    (q, s), (q_ref, s_ref) = _cast_both(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert q.dtype == q_ref.dtype == jnp.float8_e4m3fn and q.shape == (T, H)
    np.testing.assert_array_equal(codes(q), codes(q_ref))
    G = H // 128
    if use_ue8m0:
        assert s.dtype == s_ref.dtype == jnp.int32 and s.shape == (T, -(-G // 4))
    else:
        assert s.dtype == s_ref.dtype == jnp.float32 and s.shape == (T, G)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), np.asarray(s_ref).view(np.uint32))
    # Independent numpy check of the scales: max(1e-4, amax) / 448, power of two if rounded.
    # "/ 448" is evaluated the way DeepEP's per_token_cast_to_fp8 (`x_amax / 448.0` on CUDA:
    # PyTorch multiplies by the fp32 reciprocal of a scalar divisor) and XLA (which rewrites a
    # division by a constant into the same product) both do: amax * fl(1/448). Exact IEEE
    # division differs from it by one ulp for about half of all amax values.
    want_codes, scale = _cast_model(x, round_scale)
    if use_ue8m0:
        exps = (scale.view(np.uint32) >> 23).astype(np.uint8)
        exps = np.pad(exps, ((0, 0), (0, -G % 4)))
        np.testing.assert_array_equal(np.asarray(s).view(np.uint8).reshape(T, -1), exps)
    else:
        np.testing.assert_array_equal(np.asarray(s), scale)
    # And of the codes: x times the contract's multiplier, rounded to nearest even by ml_dtypes
    # (not x * (1 / scale): scale is rounded already, and that moves a code now and then).
    np.testing.assert_array_equal(codes(q), want_codes)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["f32scales", "ue8m0"])
def test_cast_back_ffi_matches_reference(rng, dtype, use_ue8m0):
    T, H = 6, 640
    x = _scaled_input(rng, T, H, np.float32)
    q, s = ops.per_token_cast_to_fp8(jnp.asarray(x), round_scale=use_ue8m0, use_ue8m0=use_ue8m0)
    got = ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0, dtype=dtype)
    want = ref(ops.per_token_cast_back, q, s, use_ue8m0=use_ue8m0, dtype=dtype)
    assert got.dtype == want.dtype == np.dtype(dtype) and got.shape == (T, H)
    np.testing.assert_array_equal(codes(got.astype(jnp.float32)),
                                  codes(want.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_every_rounding_tie_matches_reference():
    """Scale 1 (a 448 in every row): the inputs are every e4m3 value, every midpoint between
    neighbours and the floats just either side of each midpoint, both signs; ties round to the
    even code, like XLA's convert and ml_dtypes, and the neighbours away from it."""
    grid = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)  # 0 .. 448
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(448))])
    vals = np.concatenate([grid, mids, near, -grid, -mids, -near]).astype(np.float32)
    vals = np.pad(vals, (0, -len(vals) % 128)).reshape(-1, 128)
    vals[:, -1] = 448.0
    (q, s), (q_ref, s_ref) = _cast_both(vals)
    np.testing.assert_array_equal(np.asarray(s), np.ones_like(s_ref))
    np.testing.assert_array_equal(codes(q), codes(q_ref))
    np.testing.assert_array_equal(codes(q), vals.astype(E4M3).view(np.uint8))
    # The exact grid values come back as themselves.
    back = np.asarray(ops.per_token_cast_back(q, s, dtype=jnp.float32)).reshape(-1)
    np.testing.assert_array_equal(back[:len(grid)], grid)


def test_every_finite_bit_pattern_range_matches_reference(rng):
    """Scale 1 again, inputs drawn uniformly over the fp32 bit patterns of [0, 448] of both
    signs: every binade from fp32 subnormals up, so every branch of the e4m3 rounding (FP8
    subnormal grid, normal mantissa rounding, the 448 cap) and the sign are hit many times."""
    bits = rng.integers(0, np.float32(448).view(np.uint32), (64, 128), dtype=np.uint32)
    bits |= rng.integers(0, 2, bits.shape, dtype=np.uint32) << 31
    vals = bits.view(np.float32)
    vals[:, -1] = 448.0
    (q, s), (q_ref, _) = _cast_both(vals)
    np.testing.assert_array_equal(np.asarray(s), 1.0)
    np.testing.assert_array_equal(codes(q), codes(q_ref))


def _finite_bf16_values():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = bits.view(BF16)
    return vals[np.isfinite(vals.astype(np.float32))]


def test_every_bf16_value_at_scale_one_matches_reference():
    """bfloat16 input (its own AVX-512 loop): every finite bf16 value up to 448, both signs,
    127 per row next to a 448, so the scale is 1 and the codes are the values' own e4m3
    roundings: every e4m3 tie that bf16 can hold, and its bf16 neighbours, are in there."""
    vals = _finite_bf16_values()
    vals = vals[np.abs(vals.astype(np.float32)) <= 448]
    rows = np.pad(vals, (0, -len(vals) % 127)).reshape(-1, 127)
    x = np.concatenate([rows, np.full((len(rows), 1), 448, BF16)], axis=1)
    (q, s), (q_ref, _) = _cast_both(x)
    np.testing.assert_array_equal(np.asarray(s), 1.0)
    np.testing.assert_array_equal(codes(q), codes(q_ref))
    np.testing.assert_array_equal(codes(q), x.astype(np.float32).astype(E4M3).view(np.uint8))


@pytest.mark.parametrize("round_scale", [False, True])
def test_every_bf16_value_in_random_blocks_matches_reference(rng, round_scale):
    """Every finite bf16 value, shuffled into 128-channel blocks: each block gets its own
    amax and scale (subnormal inputs, the 1e-4 amax floor and huge amaxes included)."""
    vals = rng.permutation(_finite_bf16_values())
    x = np.pad(vals, (0, -len(vals) % 512)).reshape(-1, 512)
    (q, s), (q_ref, s_ref) = _cast_both(x, round_scale=round_scale)
    q_model, s_model = _cast_model(x, round_scale)
    for scales in (s, s_ref):
        np.testing.assert_array_equal(np.asarray(scales).view(np.uint32), s_model.view(np.uint32))
    for q_fp8 in (q, q_ref):
        np.testing.assert_array_equal(codes(q_fp8), q_model)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_blocks_past_2_to_the_126_keep_their_codes(rng, dtype):
    """amax above 2^126 makes fl(1/amax) an fp32 subnormal, which XLA:CPU flushes to zero: the
    multiplier 448 * fl(1/amax) is rounded on the subnormal grid in integers instead, so the
    handler and the reference give IEEE arithmetic's codes (the numpy model), and the cast back
    is within e4m3's rounding of x. Before, every code of such a block was 0."""
    T, H = 64, 256
    top = np.float32(2.0**126).view(np.uint32) + 1
    most = np.float32(np.finfo(dtype).max).view(np.uint32)  # bf16's: f32's rounds to inf
    amax_bits = rng.integers(top, most, (T, 2), dtype=np.uint32, endpoint=True)
    amax = amax_bits.view(np.float32).astype(dtype).astype(np.float32)
    x = rng.uniform(-1, 1, (T, 2, 128)).astype(np.float32) * amax[..., None]
    x[:, :, 0] = amax  # the block's amax itself, and a sign
    x[::2, 1, 0] *= -1
    x = x.reshape(T, H).astype(dtype)
    (q, s), (q_ref, s_ref) = _cast_both(x)
    q_model, s_model = _cast_model(x)
    assert (q_model != 0).sum() > T * H // 2
    for q_fp8, scales in ((q, s), (q_ref, s_ref)):
        np.testing.assert_array_equal(codes(q_fp8), q_model)
        np.testing.assert_array_equal(np.asarray(scales), s_model)
        back = np.asarray(ops.per_token_cast_back(q_fp8, scales, dtype=jnp.float32))
        xf = x.astype(np.float32)
        block_amax = np.repeat(amax, 128, axis=1)  # e4m3 subnormals: steps of amax / 448 / 2^9
        np.testing.assert_array_less(np.abs(back - xf), 2.0**-4 * np.abs(xf) + 1e-5 * block_amax)


# Scales for the every-code cast back: ordinary, negative, products that are exact bf16 or
# float16 rounding ties between an odd and an even neighbour (code 1.0 times 1 + 3 * 2^-8 or
# 1 + 3 * 2^-11: the tie goes up to the even one), products that are fp32 subnormals
# (XLA:CPU flushes them), products that overflow (2^120 and up: scale * 2^8 overflows too,
# which the AVX-512 loop leaves to the portable one), zero, and the non-finite ones.
CAST_BACK_SCALES = [1.0, 3.0, -0.375, 1 + 3 * 2.0**-8, 1 + 3 * 2.0**-11, 1e-3, 2.0**-130, 1e-38,
                    2.0**119, 2.0**120, 3e37, 0.0, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_cast_back_every_code_matches_reference(dtype):
    """All 256 e4m3 codes (NaN codes included) under every scale in CAST_BACK_SCALES, bitwise."""
    S = len(CAST_BACK_SCALES)
    q = np.tile(np.arange(256, dtype=np.uint8), (S, 1)).view(E4M3)
    scales = np.repeat(np.asarray(CAST_BACK_SCALES, np.float32)[:, None], 2, axis=1)
    got = ops.per_token_cast_back(jnp.asarray(q), jnp.asarray(scales), dtype=dtype)
    want = ref(ops.per_token_cast_back, jnp.asarray(q), jnp.asarray(scales), dtype=dtype)
    if cuda_contract():  # fp32 denormal products (scales 2^-130, 1e-38) are kept, not flushed
        want = _cast_back_model(q, scales, dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def _cpu_has_avx512_loops() -> bool | None:
    """Whether this CPU has AVX-512 F, BW and VL (None where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return None
    return {"avx512f", "avx512bw", "avx512vl"} <= set(flags)


def test_cpu_fp8_loops_follow_cpu_flags():
    """The FP8 handlers run their AVX-512 loops exactly where the CPU has AVX-512 F/BW/VL,
    unless JAX_EP_CPU_SIMD=0 asks for the portable ones."""
    has_avx512 = _cpu_has_avx512_loops()
    if has_avx512 is None:
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    forced = os.environ.get("JAX_EP_CPU_SIMD") == "0"
    want = "avx512" if has_avx512 and not forced else "portable"
    assert _jax_ep.cpu_fp8_loops() == want


@pytest.mark.parametrize("arch", ["-march=native", "-march=x86-64"], ids=["native", "portable"])
def test_avx512_loops_match_portable_loops_under_every_mxcsr_mode(tmp_path, arch):
    """XLA runs handlers with round-to-nearest and FTZ/DAZ on, which is all the tests above can
    reach. tests/cpp/fp8_loop_parity.cc compares the AVX-512 and portable block loops directly
    (scales, codes and cast-back bits, f32 / bf16 / f16) under all 16 MXCSR settings, built
    with the handlers' flags for both build modes (JAX_EP_CPU_NATIVE on and off)."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    if _jax_ep.cpu_fp8_loops() != "avx512":
        pytest.skip("this CPU runs the portable loops only")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = str(tmp_path / "fp8_loop_parity")
    build = subprocess.run(
        [compiler, "-O3", arch, "-ffp-contract=off", "-std=c++17", "-w",
         "-I" + os.path.join(root, "xla_ffi"), "-I" + jax.ffi.include_dir(),
         os.path.join(root, "tests", "cpp", "fp8_loop_parity.cc"), "-o", exe],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "mismatches 0" in run.stdout, run.stdout[-4000:]


@pytest.mark.skipif(cuda_contract(), reason="tests the CPU handlers' loops")
def test_portable_cpu_path_matches_reference():
    """The CPU handlers pick AVX-512 loops at run time where the CPU has them; JAX_EP_CPU_SIMD=0
    selects the portable loops. Run this file's bitwise FFI-vs-reference tests, the poisoning
    tests and the loop check that way too."""
    tests = "(matches_reference or poisons or loops_follow) and not portable"
    env = dict(os.environ, JAX_EP_CPU_SIMD="0")
    done = subprocess.run([sys.executable, "-m", "pytest", __file__, "-k", tests, "-p",
                           "no:cacheprovider"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout


# ----------------------------------------------------------------------------- hand-computed


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_poisons_only_its_block(rng, dtype, round_scale, use_ue8m0, bad):
    # An inf or NaN poisons its block and nothing else: NaN scale (UE8M0 byte 0xff), every
    # code NaN (0x7f in the FFI handlers, a NaN of either sign in XLA's convert).
    x = _scaled_input(rng, 3, 768, dtype)
    x[1, 130] = bad
    kw = dict(round_scale=round_scale, use_ue8m0=use_ue8m0)
    (q, s), (q_ref, s_ref) = _cast_both(x, **kw)
    np.testing.assert_array_equal(codes(q)[1, 128:256], 0x7F)
    np.testing.assert_array_equal(codes(q_ref)[1, 128:256] & 0x7F, 0x7F)
    keep = np.ones(x.shape, bool)
    keep[1, 128:256] = False
    np.testing.assert_array_equal(codes(q)[keep], codes(q_ref)[keep])
    for scales in (np.asarray(s), np.asarray(s_ref)):
        if use_ue8m0:
            exps = scales.view(np.uint8).reshape(3, -1)
            assert exps[1, 1] == 0xFF and (np.delete(exps[:, :6].ravel(), 7) < 0xFF).all()
        else:
            assert np.isnan(scales[1, 1]) and np.isfinite(np.delete(scales.ravel(), 7)).all()
    back = ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0, dtype=dtype)
    assert np.isnan(np.asarray(back, np.float32)[1, 128:256]).all()
    assert np.isfinite(np.asarray(back, np.float32)[keep]).all()


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_cast_known_codes_scale_one(impl):
    # amax 448 -> scale_inv 448 / 448 = 1: the codes are the plain e4m3 encodings.
    row = np.zeros(128, np.float32)
    row[:15] = [448, 1, -1, 0.5, 2**-9, 0, -448, 0.0625, 3, 240, 2**-7, 2**-6, 1.0625, 1.1875,
                -3]
    want = [0x7E, 0x38, 0xB8, 0x30, 0x01, 0x00, 0xFE, 0x18, 0x44, 0x77, 0x04, 0x08,
            0x38,  # 1.0625 is the tie between 1 and 1.125: even code 0x38
            0x3A,  # 1.1875 is the tie between 1.125 and 1.25: even code 0x3A
            0xC4]
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(row[None]), impl=impl)
    np.testing.assert_array_equal(codes(q)[0, :15], want)
    assert not codes(q)[0, 15:].any()
    np.testing.assert_array_equal(s, [[1.0]])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_cast_known_scales(impl):
    # Token 0: groups with amax 896 (scale 2), 1e-5 (floored to 1e-4), 1.0 (scale 1/448).
    x = np.zeros((1, 384), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 896.0, 2.0, -6.0
    x[0, 128] = 1e-5
    x[0, 256], x[0, 257] = 1.0, -0.5
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), impl=impl)
    s = np.asarray(s)
    assert s[0, 0] == np.float32(2.0)
    assert s[0, 1] == np.float32(1e-4) / np.float32(448)   # the 1e-4 amax floor
    assert s[0, 2] == np.float32(1.0) / np.float32(448)
    c = codes(q)[0]
    np.testing.assert_array_equal(c[:3], [0x7E, 0x38, 0xC4])   # 448, 1, -3 after scaling
    assert c[128] == 0x63      # 1e-5 / (1e-4/448) = 44.8 -> 44 = 1.375 * 2^5
    np.testing.assert_array_equal(c[256:258], [0x7E, 0xF6])  # 448, -224


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_codes_and_scales_bitwise_equal_deepeps_formulas(rng, impl, dtype):
    # DeepEP's reference (tests/utils.py): codes = fp8(x * (448.0 / x_amax)), which PyTorch
    # evaluates as x * (x_amax.reciprocal() * 448); its kernels' scale_inv = amax * kFP8AmaxInv
    # (fl(1/448)). Not x / scale_inv, whose double rounding moves about one bf16 code in a
    # thousand by one step.
    x = (rng.standard_normal((512, 1024)) * np.exp(rng.uniform(-8, 8, (512, 1)))).astype(dtype)
    blocks = x.astype(F32).reshape(512, 8, 128)
    amax = np.maximum(np.abs(blocks).max(axis=-1), F32(1e-4))
    want_codes = (blocks * (F32(448) * (F32(1) / amax))[..., None]).astype(E4M3).view(np.uint8)
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), impl=impl)
    np.testing.assert_array_equal(codes(q), want_codes.reshape(512, 1024))
    np.testing.assert_array_equal(np.asarray(s), amax * F32(1 / 448))
    if dtype == BF16:  # short mantissas land on e4m3 ties: x / scale_inv gives other codes
        old = (blocks * (F32(1) / (amax * F32(1 / 448)))[..., None]).astype(E4M3)
        assert (old.view(np.uint8) != want_codes).sum() > 100


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_round_scale_is_next_power_of_two(impl):
    # amax 100: 100/448 = 0.2232 -> 0.25; amax 224: 0.5 exactly (already a power of two);
    # amax 448: 1; amax 449: 1.0022 -> 2; amax 1e-9: floor 1e-4 -> 2.23e-7 -> 2^-22.
    amaxes = [100.0, 224.0, 448.0, 449.0, 1e-9]
    x = np.zeros((1, 128 * len(amaxes)), np.float32)
    for g, a in enumerate(amaxes):
        x[0, 128 * g] = a
        x[0, 128 * g + 1] = 1.0 if a >= 1 else 0.0
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=True, impl=impl)
    np.testing.assert_array_equal(s, [[0.25, 0.5, 1.0, 2.0, 2.0**-22]])
    for g, a in enumerate(amaxes):
        scale = np.asarray(s)[0, g]
        assert scale >= max(a, 1e-4) / 448 and scale / 2 < max(a, 1e-4) / 448
    c = codes(q)[0]
    # 100 / 0.25 = 400: tie between 384 and 416 -> even code 0x7C (384); 1 / 0.25 = 4 -> 0x48.
    np.testing.assert_array_equal(c[0:2], [0x7C, 0x48])
    np.testing.assert_array_equal(c[128:130], [0x7E, 0x40])    # 448, 2
    np.testing.assert_array_equal(c[256:258], [0x7E, 0x38])    # 448, 1
    np.testing.assert_array_equal(c[384:386], [0x76, 0x30])    # 224.5 -> 224, 0.5


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_ue8m0_packing_little_endian(impl):
    # Token 0 group scales 1, 2, 0.25, 0.5 -> exponent bytes 0x7F, 0x80, 0x7D, 0x7E, packed
    # little-endian into one int32: 0x7E7D807F. Token 1: 2, 1, 1, 2 -> 0x807F7F80 (negative),
    # fifth group scale 4 -> byte 0x81 alone in the second word.
    x = np.zeros((2, 640), np.float32)
    for t, amaxes in enumerate([[448, 896, 100, 224, 1], [896, 448, 448, 896, 1792]]):
        for g, a in enumerate(amaxes):
            x[t, 128 * g + 3] = -a
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=True, use_ue8m0=True,
                  impl=impl)
    s = np.asarray(s)
    assert s.dtype == np.int32 and s.shape == (2, 2)
    assert s[0, 0] == 0x7E7D807F == 2122154111
    assert s[1, 0] == np.uint32(0x807F7F80).view(np.int32) == -2139127936
    assert s[0, 1] == 0x77                 # scale of amax 1 rounds to 2^-8: byte 0x77
    assert s[1, 1] == 0x81
    # Cast back with the packed scales reproduces the amax values exactly.
    back = np.asarray(jit_op(ops.per_token_cast_back, q, jnp.asarray(s), use_ue8m0=True,
                             dtype=jnp.float32, impl=impl))
    np.testing.assert_array_equal(back[:, 3::128], -np.array([[448, 896, 100 - 4, 224, 1],
                                                              [896, 448, 448, 896, 1792]]))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_cast_back_known_values(impl):
    q = np.zeros((1, 256), np.uint8)
    q[0, :4] = [0x7E, 0x38, 0x01, 0xC4]
    q[0, 128:130] = [0x7E, 0x08]
    scales = jnp.asarray([[2.0, 0.5]], jnp.float32)
    out = jit_op(ops.per_token_cast_back, jnp.asarray(q.view(E4M3)), scales, dtype=jnp.float32,
                 impl=impl)
    np.testing.assert_array_equal(np.asarray(out)[0, :4], [896, 2, 2.0**-8, -6])
    np.testing.assert_array_equal(np.asarray(out)[0, 128:130], [224, 2.0**-7])
    out = jit_op(ops.per_token_cast_back, jnp.asarray(q.view(E4M3)), scales, impl=impl)
    assert out.dtype == jnp.bfloat16   # the default dtype


# ------------------------------------------------------------------ DeepEP's utils conventions


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("H", [200, 1, 129, 500, 700])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_cast_pads_hidden_to_whole_blocks(rng, impl, H, round_scale, use_ue8m0):
    """Any H, as DeepEP's per_token_cast_to_fp8 (tests/utils.py): x zero-padded to whole
    128-channel blocks, cast, codes sliced back to H; scales [T, ceil(H/128)] (packed:
    [T, ceil(G/4)]). Codes and scales bitwise equal to the numpy model of the padded x."""
    T = 5
    x = _scaled_input(rng, T, 128 * -(-H // 128), np.float32)[:, :H]
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=round_scale,
                  use_ue8m0=use_ue8m0, impl=impl)
    want_codes, want_scale = _cast_model(_pad_blocks(x), round_scale)
    G = -(-H // 128)
    assert q.shape == (T, H) and q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(codes(q), want_codes[:, :H])
    if use_ue8m0:
        assert s.dtype == jnp.int32 and s.shape == (T, -(-G // 4))
        np.testing.assert_array_equal(np.asarray(s), _pack_ue8m0_model(want_scale))
    else:
        assert s.dtype == jnp.float32 and s.shape == (T, G)
        np.testing.assert_array_equal(np.asarray(s), want_scale)
    # The cast back of a partial last block: codes times their group's scale, sliced to H.
    back = jit_op(ops.per_token_cast_back, q, s, use_ue8m0=use_ue8m0, dtype=jnp.float32,
                  impl=impl)
    want_back = (_pad_blocks(codes(q)).view(E4M3).astype(np.float32).reshape(T, G, 128)
                 * want_scale[..., None]).reshape(T, -1)[:, :H]
    assert back.shape == (T, H)
    np.testing.assert_array_equal(np.asarray(back), want_back)


def test_deepep_cast_200_channels_known_values():
    """H = 200 by hand: group 0 holds channels 0..127 (amax 896 -> scale 2), group 1 the 72
    channels 128..199 (amax 1 -> scale 1/448; the 56 padding zeros change nothing)."""
    x = np.zeros((1, 200), np.float32)
    x[0, 0], x[0, 1] = 896.0, -6.0
    x[0, 128], x[0, 199] = 1.0, -0.5
    for impl in ("ffi", "xla"):
        q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), impl=impl)
        np.testing.assert_array_equal(np.asarray(s), [[2.0, np.float32(1.0) / np.float32(448)]])
        c = codes(q)[0]
        assert c.shape == (200,)
        # 448, -3 (scale 2); 448, -224 (scale 1/448)
        np.testing.assert_array_equal(c[[0, 1, 128, 199]], [0x7E, 0xC4, 0x7E, 0xF6])
        assert not np.delete(c, [0, 1, 128, 199]).any()
        back = jit_op(ops.per_token_cast_back, q, s, dtype=jnp.float32, impl=impl)
        np.testing.assert_array_equal(np.asarray(back)[0, [0, 1]], [896.0, -6.0])
        np.testing.assert_allclose(np.asarray(back)[0, [128, 199]], [1.0, -0.5], rtol=1e-6)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("H", [512, 500, 200])
def test_int32_scales_are_ue8m0_without_the_flag(rng, impl, H):
    """DeepEP's per_token_cast_back reads int32 scales as packed UE8M0 with no flag: so does
    ours (use_ue8m0 left False), bitwise equal to use_ue8m0=True and, where DeepEP's utils can
    take the shapes (G % 4 == 0: H = 512, 500), to its formula in numpy."""
    T = 6
    x = _scaled_input(rng, T, 128 * -(-H // 128), np.float32)[:, :H]
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=True, use_ue8m0=True,
                  impl=impl)
    implied = jit_op(ops.per_token_cast_back, q, s, dtype=jnp.float32, impl=impl)
    flagged = jit_op(ops.per_token_cast_back, q, s, use_ue8m0=True, dtype=jnp.float32, impl=impl)
    np.testing.assert_array_equal(np.asarray(implied), np.asarray(flagged))
    G = -(-H // 128)
    scale = np.asarray(s).view(np.uint8).reshape(T, -1)[:, :G].astype(np.uint32) << 23
    want = (_pad_blocks(codes(q)).view(E4M3).astype(np.float32).reshape(T, G, 128)
            * scale.view(np.float32)[..., None]).reshape(T, -1)[:, :H]
    np.testing.assert_array_equal(np.asarray(implied), want)
    if G % 4 == 0:
        np.testing.assert_array_equal(np.asarray(implied), _deepep_cast_back_model(q, s))
    bf16 = jit_op(ops.per_token_cast_back, q, s, impl=impl)   # the default dtype
    np.testing.assert_array_equal(np.asarray(bf16), want.astype(BF16))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_scales_in_any_shape_with_the_right_count(rng, impl):
    """DeepEP's utils view the scales as [T, -1]: the low-latency test passes the received
    scales [L, P*Tmax, H/512] viewed as (-1, H/128) for codes viewed as (-1, H). Any shape
    holding the T*W scales in row-major order gives the [T, W] result."""
    T, H = 8, 512
    x = _scaled_input(rng, T, H, np.float32)
    q, s = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), impl=impl)            # f32 [8, 4]
    qu, su = jit_op(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=True,
                    use_ue8m0=True, impl=impl)                                       # i32 [8, 1]
    want = np.asarray(jit_op(ops.per_token_cast_back, q, s, dtype=jnp.float32, impl=impl))
    want_u = np.asarray(jit_op(ops.per_token_cast_back, qu, su, dtype=jnp.float32, impl=impl))
    np.testing.assert_array_equal(want, _deepep_cast_back_model(q, s))
    np.testing.assert_array_equal(want_u, _deepep_cast_back_model(qu, su))
    for shape in [(32,), (16, 2), (2, 4, 4)]:
        got = jit_op(ops.per_token_cast_back, q, s.reshape(shape), dtype=jnp.float32, impl=impl)
        np.testing.assert_array_equal(np.asarray(got), want)
    for shape in [(8,), (2, H // 128), (2, 2, 2)]:   # (2, 4): DeepEP's view(-1, hidden // 128)
        got = jit_op(ops.per_token_cast_back, qu, su.reshape(shape), dtype=jnp.float32,
                     impl=impl)
        np.testing.assert_array_equal(np.asarray(got), want_u)
    with pytest.raises(ValueError, match=r"^scales: expected 32 float scales \(\[8, 4\] for "
                                         r"x_fp8 of shape \(8, 512\)\), got shape \(4, 4\)"):
        ops.per_token_cast_back(q, s[:4], impl=impl)
    with pytest.raises(ValueError, match=r"^scales: expected 8 packed UE8M0 int32 scales "
                                         r"\(\[8, 1\] .*got shape \(9,\)"):
        ops.per_token_cast_back(qu, jnp.zeros((9,), jnp.int32), impl=impl)


def test_reference_reads_deepeps_scales_too(rng):
    """jax_ep.reference.per_token_cast_back (the oracle, called directly) takes the same
    int32-means-UE8M0 rule and scale shapes as ops."""
    T, H = 4, 200
    x = _scaled_input(rng, T, 256, np.float32)[:, :H]
    q, s = reference.per_token_cast_to_fp8(jnp.asarray(x), round_scale=True, use_ue8m0=True)
    assert q.shape == (T, H) and s.shape == (T, 1)
    back = reference.per_token_cast_back(q, s.reshape(-1), dtype=jnp.float32)
    scale = np.asarray(s).view(np.uint8).reshape(T, 4)[:, :2].astype(np.uint32) << 23
    want = (_pad_blocks(codes(q)).view(E4M3).astype(np.float32).reshape(T, 2, 128)
            * scale.view(np.float32)[..., None]).reshape(T, -1)[:, :H]
    np.testing.assert_array_equal(np.asarray(back), want)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_round_trip_within_fp8_error(rng, dtype, round_scale, use_ue8m0):
    T, H = 8, 512
    x = _scaled_input(rng, T, H, dtype)
    q, s = ops.per_token_cast_to_fp8(jnp.asarray(x), round_scale=round_scale, use_ue8m0=use_ue8m0)
    back = np.asarray(ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0, dtype=jnp.float32))
    xf = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(xf).reshape(T, H // 128, 128).max(-1), 1e-4) / 448
    if round_scale:
        scale = 2.0 ** np.ceil(np.log2(scale))
    step = np.repeat(scale, 128, axis=1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; absolute error <= half the
    # subnormal spacing 2^-9 * scale below 2^-6 * scale.
    bound = np.maximum(np.abs(xf) * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)
    assert (np.abs(back - xf) <= bound).all()
    # The largest value of every group survives within 1/16 and never overflows.
    assert np.isfinite(back).all()
    back_dtype = ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0, dtype=dtype)
    assert back_dtype.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(back_dtype), back.astype(dtype))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_cast_no_tokens(impl):
    q, s = ops.per_token_cast_to_fp8(jnp.zeros((0, 256)), impl=impl)
    assert q.shape == (0, 256) and q.dtype == jnp.float8_e4m3fn and s.shape == (0, 2)
    q, s = ops.per_token_cast_to_fp8(jnp.zeros((0, 256)), round_scale=True, use_ue8m0=True,
                                     impl=impl)
    assert s.shape == (0, 1) and s.dtype == jnp.int32
    out = ops.per_token_cast_back(q, s, use_ue8m0=True, impl=impl)
    assert out.shape == (0, 256)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_cast_no_channels(impl):
    # H = 0 is a multiple of 128: empty codes and scales, no crash.
    q, s = ops.per_token_cast_to_fp8(jnp.zeros((4, 0), jnp.bfloat16), impl=impl)
    assert q.shape == (4, 0) and s.shape == (4, 0)
    assert ops.per_token_cast_back(q, s, impl=impl).shape == (4, 0)


# ------------------------------------------------------------------------ jit / vmap / shard_map


def test_fp8_under_jit_and_vmap(rng):
    B, T, H = 3, 4, 256
    x = jnp.asarray(np.stack([_scaled_input(rng, T, H, BF16) for _ in range(B)]))

    def f(x, impl):
        q, s = ops.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True, impl=impl)
        q2, s2 = ops.per_token_cast_to_fp8(x, impl=impl)
        return (q, s, q2, s2, ops.per_token_cast_back(q, s, use_ue8m0=True, impl=impl),
                ops.per_token_cast_back(q2, s2, dtype=jnp.float16, impl=impl))

    got = jax.vmap(partial(f, impl="ffi"))(x)
    got_jit = jax.jit(jax.vmap(partial(f, impl="ffi")))(x)
    ref_f = jax.jit(partial(f, impl="xla"))
    for b in range(B):
        for u, v in zip(got, ref_f(x[b])):
            np.testing.assert_array_equal(np.asarray(u)[b].view(np.uint8),
                                          np.asarray(v).view(np.uint8))
    for u, v in zip(got, got_jit):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def test_fp8_inside_shard_map(ep_mesh, rng):
    D = ep_mesh.shape["ep"]
    T, H = 3, 512
    x = _scaled_input(rng, D * T, H, BF16)
    xs = jax.device_put(x, NamedSharding(ep_mesh, P("ep")))

    def local(x):
        q, s = ops.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
        q2, s2 = ops.per_token_cast_to_fp8(x)
        return q, s, q2, s2, ops.per_token_cast_back(q, s, use_ue8m0=True)

    f = jax.jit(jax.shard_map(local, mesh=ep_mesh, in_specs=P("ep"), out_specs=P("ep")))
    got = f(xs)
    ref_q, ref_s = ref(ops.per_token_cast_to_fp8, jnp.asarray(x), round_scale=True,
                       use_ue8m0=True)
    ref_q2, ref_s2 = ref(ops.per_token_cast_to_fp8, jnp.asarray(x))
    ref_back = ref(ops.per_token_cast_back, ref_q, ref_s, use_ue8m0=True)
    for u, v in zip(got, (ref_q, ref_s, ref_q2, ref_s2, ref_back)):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_fp8_bad_arguments(impl):
    cast = partial(ops.per_token_cast_to_fp8, impl=impl)
    back = partial(ops.per_token_cast_back, impl=impl)
    with pytest.raises(ValueError, match="x"):
        cast(jnp.ones((256,)))
    with pytest.raises(ValueError, match="x"):
        cast(jnp.ones((1, 2, 256)))
    with pytest.raises(ValueError, match="x"):
        cast(jnp.ones((2, 256), jnp.int32))
    with pytest.raises(ValueError, match="use_ue8m0"):
        cast(jnp.ones((2, 256)), use_ue8m0=True)
    q = jnp.zeros((2, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_fp8"):
        back(jnp.zeros((2, 256)), jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="x_fp8"):
        back(jnp.zeros((256,), jnp.float8_e4m3fn), jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"^scales: expected 4 float scales \(\[2, 2\] for "
                                         r"x_fp8 of shape \(2, 256\)\), got shape \(2, 3\)"):
        back(q, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"^scales: expected 2 packed UE8M0 int32 scales "
                                         r"\(\[2, 1\] .*got shape \(2, 2\)"):
        back(q, jnp.ones((2, 2), jnp.int32), use_ue8m0=True)   # packed: [2, 1]
    with pytest.raises(ValueError, match=r"^scales: expected 4 float scales \(\[2, 2\] for "
                                         r"x_fp8 of shape \(2, 200\)\), got shape \(2, 1\)"):
        back(jnp.zeros((2, 200), jnp.float8_e4m3fn), jnp.ones((2, 1)))  # G = ceil(200/128)
    with pytest.raises(ValueError, match="^scales: use_ue8m0=True expects packed UE8M0 int32 "
                                         "scales, got float32"):
        back(q, jnp.ones((2, 1)), use_ue8m0=True)
    with pytest.raises(ValueError, match="^scales: expected float scales or packed UE8M0 int32 "
                                         "scales, got uint32"):
        back(q, jnp.ones((2, 2), jnp.uint32))
    with pytest.raises(ValueError, match="^scales: expected an array, got list"):
        back(q, [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="dtype"):
        back(q, jnp.ones((2, 2)), dtype=jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        ops.per_token_cast_to_fp8(jnp.ones((2, 256)), impl="numpy")


@pytest.mark.parametrize("H", [256, 200])
@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["f32scales", "ue8m0"])
def test_cast_back_gradients_are_the_scaled_cotangents(rng, use_ue8m0, H):
    """jax.grad through the FFI cast back (issue 22): d x_fp8 = g * scale rounded to e4m3,
    d scales = sum of g * code over each 128-channel group; UE8M0 scales get none. H = 200:
    the last group holds 72 channels (the padding gets no cotangent)."""
    T = 3
    x = _scaled_input(rng, T, 256, np.float32)[:, :H]
    q, s = ops.per_token_cast_to_fp8(jnp.asarray(x), round_scale=use_ue8m0, use_ue8m0=use_ue8m0)
    g = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))

    def loss(q, s, impl):
        out = ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0, dtype=jnp.float32, impl=impl)
        return jnp.sum(out * g)

    argnums = (0,) if use_ue8m0 else (0, 1)
    got = jax.jit(jax.grad(partial(loss, impl="ffi"), argnums=argnums))(q, s)
    want = jax.jit(jax.grad(partial(loss, impl="xla"), argnums=argnums))(q, s)
    scale = np.asarray(ops.per_token_cast_back(
        jnp.ones_like(q), s, use_ue8m0=use_ue8m0, dtype=jnp.float32))  # each channel's scale
    hand_q = (np.asarray(g) * scale).astype(ml_dtypes.float8_e4m3fn)
    assert got[0].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(codes(got[0]), codes(hand_q))
    np.testing.assert_array_equal(codes(got[0]), codes(want[0]))
    if not use_ue8m0:
        hand_s = _pad_blocks(np.asarray(g) * np.asarray(q).astype(np.float32)).reshape(T, -1, 128)
        np.testing.assert_allclose(np.asarray(got[1]), hand_s.sum(-1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, True)],
                         ids=["f32scales", "ue8m0"])
def test_cast_to_fp8_is_differentiable_straight_through(rng, impl, round_scale, use_ue8m0):
    """jax.grad through the cast to FP8 (issue: the FFI cast raised JAX's cannot-be-
    differentiated error while impl="xla" differentiated the reference's formula, NaN in
    places): both impls pass the cotangent straight through, the scales held constant. The
    cast alone: d x = d codes / scale per channel (H = 200 channels of 2 blocks), and forward
    mode the transposed rule; a block holding an inf gets NaN with either scale format. A
    cast and cast back: d x = e4m3(g * scale) / scale (the cast back's cotangent of the codes
    is FP8 itself: g up to that rounding). bf16 x gets a bf16 gradient."""
    T, H = 3, 200
    x = jnp.asarray(_scaled_input(rng, T, 256, np.float32)[:, :H])
    g = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))

    def round_trip(x):
        q, s = ops.per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                         impl=impl)
        return jnp.sum(g * ops.per_token_cast_back(q, s, use_ue8m0=use_ue8m0,
                                                   dtype=jnp.float32, impl=impl))

    q, s = ops.per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    scale = np.asarray(ops.per_token_cast_back(jnp.ones_like(q), s, use_ue8m0=use_ue8m0,
                                               dtype=jnp.float32))
    through = (np.asarray(g) * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(round_trip))(x)), through / scale,
                               rtol=1e-6)
    codes_only = jax.grad(lambda x: jnp.sum(g * ops.per_token_cast_to_fp8(
        x, round_scale=round_scale, use_ue8m0=use_ue8m0, impl=impl)[0].astype(jnp.float32)))
    d_codes = np.asarray(g.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(codes_only(x)), d_codes / scale, rtol=1e-6)
    assert jax.grad(lambda x: jnp.sum(ops.per_token_cast_to_fp8(
        x, impl=impl)[0].astype(jnp.float32)))(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    (_, _), (t_codes, _) = jax.jvp(lambda x: ops.per_token_cast_to_fp8(
        x, round_scale=round_scale, use_ue8m0=use_ue8m0, impl=impl), (x,), (g,))
    np.testing.assert_array_equal(codes(t_codes), codes(
        (np.asarray(g) / scale).astype(ml_dtypes.float8_e4m3fn)))
    poisoned = x.at[0, 5].set(jnp.inf)
    d = np.asarray(codes_only(poisoned))
    assert np.isnan(d[0, :128]).all() and np.isfinite(d[0, 128:]).all() and np.isfinite(d[1:]).all()

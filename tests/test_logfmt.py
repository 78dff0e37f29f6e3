"""Layer 1: DeepEP's LogFMT-10 combine format, ops.logfmt_encode / logfmt_decode (CPU).

The FFI cast against the numpy model of tests/logfmt_model.py bit for bit (random rows of the
three kinds DeepEP's test combines, H with 1024- and 512-channel chunks), hand-computed slots
(zeros, a constant division, signs, the amax >= 1 fallback, the amin clip, NaN / inf), the
round trip within the format's bound, argument errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import logfmt_model as model
from jax_ep import ops

BF16 = ml_dtypes.bfloat16


def bits(x):
    return np.asarray(x, BF16).view(np.uint16)


def encode(x):
    return np.asarray(jax.jit(ops.logfmt_encode)(jnp.asarray(np.asarray(x, BF16))))


def decode(wire, dtype=jnp.float32):
    return np.asarray(jax.jit(lambda w: ops.logfmt_decode(w, dtype=dtype))(jnp.asarray(wire)))


def deepep_rows(rng, n, h):
    """The kinds of rows DeepEP's LogFMT test combines: randn * 0.1 (packed), randn * 0.5 *
    U(0,1) per row (mixed), and rank - 128 constants with token ids (the bf16 fallback)."""
    kind = np.arange(n) % 3
    small = rng.standard_normal((n, h)) * 0.1
    mixed = rng.standard_normal((n, h)) * 0.5 * rng.uniform(0, 1, (n, 1))
    const = np.full((n, h), -125.0)
    const[:, -128:] = np.arange(n)[:, None]
    return np.where(kind[:, None] == 0, small, np.where(kind[:, None] == 1, mixed, const))


def chunk_codes(wire_row, at):
    """The 16 codes and sign bits of the packed group at byte `at` of a slot."""
    return model.unpack_group(wire_row[at:at + 20].copy().view("<u4"))


@pytest.mark.parametrize("hidden", [512, 1024, 1536, 2048])
def test_encode_and_decode_match_the_model_bitwise(hidden):
    rng = np.random.default_rng(hidden)
    x = deepep_rows(rng, 24, hidden)
    wire = encode(x)
    want = model.encode(bits(x))
    np.testing.assert_array_equal(wire, want)
    got = decode(wire)
    np.testing.assert_array_equal(got.view(np.uint32), model.decode(want, hidden).view(np.uint32))
    got_bf16 = decode(wire, jnp.bfloat16)
    np.testing.assert_array_equal(bits(got_bf16), bits(model.decode(want, hidden).astype(BF16)))
    # Both outcomes occur: some chunks packed, some raw.
    assert (wire[:, -1] == 0).any() and (wire[:, 4 * (hidden // 128)] != 0).any()


def test_all_zeros_is_a_raw_zero_slot():
    wire = encode(np.zeros((2, 1024)))
    assert wire.shape == (2, model.slot_bytes(1024)) and not wire.any()  # amin == amax: raw
    assert not decode(wire).any()


def test_constant_division_goes_raw_and_arrives_exactly():
    x = np.full((1, 512), 0.375)
    x[0, 128:] = np.linspace(-0.5, 0.5, 384)
    wire = encode(x)
    meta = wire[0, :16].view("<u2").reshape(4, 2)
    np.testing.assert_array_equal(meta[0], bits([0.375, 0.375]))  # amax == amin: no cast
    np.testing.assert_array_equal(wire[0, 16:16 + 1024].view("<u2"), bits(x[0]))
    np.testing.assert_array_equal(decode(wire), np.asarray(x, BF16).astype(np.float32))


def test_two_level_division_codes_and_signs():
    # amax = 0.5, amin = 0.25: la = -1, lb = -2, step = 1/510; |x| = amax -> 511, amin -> 1.
    x = np.where(np.arange(512) % 2 == 0, -0.5, 0.25)[None]
    wire = encode(x)
    assert not wire[0, 16 + 640:].any()  # one packed 512-channel chunk: 640 bytes
    codes, signs = chunk_codes(wire[0], 16)
    assert codes == [511, 1] * 8 and signs == 0x5555
    np.testing.assert_array_equal(decode(wire), x.astype(np.float32))


def test_amax_of_one_falls_back_per_chunk():
    h = 2048  # two 1024-channel chunks
    x = np.full((1, h), 0.01)
    x[0, ::7] = -0.02
    x[0, 5] = 1.0  # chunk 0: amax >= 1 -> raw bf16
    wire = encode(x)
    meta = 4 * (h // 128)
    np.testing.assert_array_equal(wire[0, meta:meta + 2048].view("<u2"), bits(x[0, :1024]))
    packed = wire[0, meta + 2048:meta + 2048 + 1280]
    assert packed.any() and not wire[0, meta + 2048 + 1280:].any()
    out = decode(wire)[0]
    np.testing.assert_array_equal(out[:1024], np.asarray(x[0, :1024], BF16).astype(np.float32))
    np.testing.assert_allclose(out[1024:], np.asarray(x[0, 1024:], BF16), rtol=2e-3)


def test_values_below_the_amin_clip_flush_to_zero():
    # amax = 0.5 (la = -1): lb is clipped to -33. 2^-33 -> code 1 -> 2^-33 exactly; 2^-34 and
    # 2^-40 (below the clip) -> code 0 -> 0.
    x = np.full((1, 512), 0.5)
    x[0, 128::2] = 0.25  # the other divisions are not constant: the chunk is packed
    x[0, 1:4] = [2.0 ** -33, -(2.0 ** -34), 2.0 ** -40]
    wire = encode(x)
    codes, signs = chunk_codes(wire[0], 16)
    assert codes[:4] == [511, 1, 0, 0] and signs & 0xF == 0b0100
    out = decode(wire)[0]
    np.testing.assert_array_equal(out[:4], [0.5, 2.0 ** -33, -0.0, 0.0])
    assert np.signbit(out[2])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_send_their_chunk_raw(bad):
    x = np.full((1, 1024), 0.01)
    x[0, 512:] = -0.03
    x[0, 700] = bad
    wire = encode(x)
    np.testing.assert_array_equal(wire, model.encode(bits(x)))
    np.testing.assert_array_equal(wire[0, 32:32 + 2048].view("<u2"), bits(x[0]))
    out = decode(wire)[0]
    np.testing.assert_array_equal(out, np.asarray(x[0], BF16).astype(np.float32))


def test_round_trip_within_the_format_bound():
    rng = np.random.default_rng(5)
    x = np.asarray(rng.standard_normal((32, 1024)) * 0.1 * rng.uniform(0, 1, (32, 1)), BF16)
    x = x.astype(np.float32)
    wire = encode(x)
    out = decode(wire)
    meta = wire[:, :32].copy().view("<u2").reshape(32, 8, 2).astype(np.float64)
    amax, amin = meta[..., 0], meta[..., 1]
    la = np.log2((amax.astype(np.uint32) << 16).view(np.float32))
    lo = (amin.astype(np.uint32) << 16).view(np.float32)
    lb = np.maximum(np.log2(np.where(lo > 0, lo, 2.0 ** -150)), la - 32)
    step = np.repeat((la - lb) / 510, 128, axis=1)
    # Nearest of the neighbouring codes in the linear domain: |err| <= |x| (2^step - 1) / 2,
    # plus the float32 rounding of the decoded value.
    bound = np.abs(x) * ((np.exp2(step) - 1) / 2 * (1 + 1e-6) + 2.0 ** -24)
    assert (np.abs(out - x) <= bound).all()
    assert (np.abs(out - x) > 0).mean() > 0.5  # lossy indeed


def test_empty_rows():
    assert encode(np.zeros((0, 512))).shape == (0, model.slot_bytes(512))
    assert decode(np.zeros((0, model.slot_bytes(512)), np.uint8)).shape == (0, 512)


def test_argument_errors():
    with pytest.raises(ValueError, match="x: hidden size 640 must be a positive multiple of 512"):
        ops.logfmt_encode(jnp.zeros((2, 640), jnp.bfloat16))
    with pytest.raises(ValueError, match="x: expected bfloat16"):
        ops.logfmt_encode(jnp.zeros((2, 512), jnp.float32))
    with pytest.raises(ValueError, match="wire: got shape"):
        ops.logfmt_decode(jnp.zeros((2, 1000), jnp.uint8))
    with pytest.raises(ValueError, match="wire: expected uint8"):
        ops.logfmt_decode(jnp.zeros((2, model.slot_bytes(512)), jnp.int8))
    with pytest.raises(ValueError, match="dtype: expected float32 or bfloat16"):
        ops.logfmt_decode(jnp.zeros((2, model.slot_bytes(512)), jnp.uint8), dtype=jnp.float16)

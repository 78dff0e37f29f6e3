"""A numpy model of DeepEP's LogFMT-10 combine format, written from DeepEP's formulas
(csrc/kernels/legacy/internode_ll.cu at dd758caf: logfmt_encode, logfmt_check_amaxmin,
decode_and_accumulate) in float64, with the C library's log2 / exp2 (Python's math module),
the functions jax_ep's CPU handler calls, so the two agree bit for bit.

encode(bits u16[N,H]) -> u8[N, 2H + H/32]; decode(wire) -> f32[N,H].
"""

from __future__ import annotations

import math

import numpy as np

DIVISION, GROUP, MIN_CLIP, STEPS = 128, 16, 32.0, 510.0
BF16_ONE = 0x3F80

# log2 of every finite positive bf16 magnitude pattern (NaN elsewhere).
_MAGS = [float(v) for v in (np.arange(1 << 15, dtype=np.uint32) << 16).view(np.float32)]
LOG2_BF16 = np.array([math.log2(v) if 0 < v < math.inf else math.nan for v in _MAGS])
_log2 = np.vectorize(math.log2, otypes=[np.float64])
_exp2 = np.vectorize(math.exp2, otypes=[np.float64])


def chunk_size(hidden):
    return 1024 if hidden % 1024 == 0 else 512


def slot_bytes(hidden):
    return 2 * hidden + 4 * (hidden // DIVISION)


def _scales(amax, amin):
    """Per division (15-bit patterns): (lb, step, inv, fused) float64 arrays, DeepEP's
    log_amin, step, step_inv and fused_rounding."""
    la = LOG2_BF16[amax]
    clip = la - MIN_CLIP
    lb = np.where(amin == 0, clip, np.fmax(LOG2_BF16[amin], clip))
    step = (la - lb) / STEPS
    inv = 1.0 / step
    rounding = 2.0 - _log2((1.0 + _exp2(step)) * 0.5) * inv
    return lb, step, inv, rounding - lb * inv


def _meta(mag):
    n, h = mag.shape
    div = mag.reshape(n, h // DIVISION, DIVISION)
    return div.max(-1), div.min(-1)


def _packed(amax, amin, hidden):
    """bool [N, chunks]: every division of the chunk has amax < 1 and amin < amax."""
    ok = (amax < BF16_ONE) & (amin < amax)
    return ok.reshape(ok.shape[0], hidden // chunk_size(hidden), -1).all(-1)


def codes(bits):
    """The 9-bit code of every value of u16[N,H] (as if every chunk were packed)."""
    mag = (bits & 0x7FFF).astype(np.int64)
    amax, amin = _meta(mag)
    with np.errstate(invalid="ignore", divide="ignore"):
        _, _, inv, fused = (np.repeat(a, DIVISION, axis=1) for a in _scales(amax, amin))
        t = LOG2_BF16[mag] * inv + fused
    return np.where((mag == 0) | ~(t > 0), 0, np.floor(np.nan_to_num(t))).astype(np.uint32)


def pack_group(c, signs):
    """16 codes + sign bits (bit j: value j) -> 5 little-endian u32 words (a 160-bit stream:
    code j at bit 9j, the signs at bits 144..159)."""
    stream = sum(int(v) << (9 * j) for j, v in enumerate(c)) | (int(signs) << 144)
    return [(stream >> (32 * i)) & 0xFFFFFFFF for i in range(5)]


def unpack_group(words):
    stream = sum(int(w) << (32 * i) for i, w in enumerate(words))
    return [(stream >> (9 * j)) & 0x1FF for j in range(16)], stream >> 144


def encode(bits):
    bits = np.asarray(bits, np.uint16)
    n, h = bits.shape
    mag = (bits & 0x7FFF).astype(np.int64)
    amax, amin = _meta(mag)
    packed = _packed(amax, amin, h)
    code = codes(bits)
    size = chunk_size(h)
    out = np.zeros((n, slot_bytes(h)), np.uint8)
    for r in range(n):
        row = [np.asarray(amax[r] | (amin[r] << 16), "<u4").tobytes()]
        for k in range(h // size):
            cols = slice(k * size, (k + 1) * size)
            if not packed[r, k]:
                row.append(bits[r, cols].astype("<u2").tobytes())
                continue
            for q in range(k * size, (k + 1) * size, GROUP):
                sgn = sum(int(bits[r, q + j] >> 15) << j for j in range(GROUP))
                row.append(np.asarray(pack_group(code[r, q:q + GROUP], sgn), "<u4").tobytes())
        payload = np.frombuffer(b"".join(row), np.uint8)
        out[r, :payload.size] = payload
    return out


def decode(wire, hidden):
    wire = np.asarray(wire, np.uint8)
    n, g = wire.shape[0], hidden // DIVISION
    meta = wire[:, :4 * g].copy().view("<u4").astype(np.int64)
    amax, amin = meta & 0xFFFF, meta >> 16
    packed = _packed(amax, amin, hidden)
    with np.errstate(invalid="ignore", divide="ignore"):
        lb, step, _, _ = _scales(amax, amin)
    size = chunk_size(hidden)
    out = np.zeros((n, hidden), np.float32)
    for r in range(n):
        at = 4 * g
        for k in range(hidden // size):
            if not packed[r, k]:
                raw = wire[r, at:at + 2 * size].copy().view("<u2").astype(np.uint32)
                out[r, k * size:(k + 1) * size] = (raw << 16).view(np.float32)
                at += 2 * size
                continue
            for q in range(k * size, (k + 1) * size, GROUP):
                c, signs = unpack_group(wire[r, at:at + 20].copy().view("<u4"))
                d = q // DIVISION
                c = np.asarray(c, np.float64)
                v = np.where(c == 0, 0.0, _exp2((c - 1) * step[r, d] + lb[r, d]))
                v = v.astype(np.float32)
                neg = np.array([(signs >> j) & 1 for j in range(GROUP)], bool)
                out[r, q:q + GROUP] = np.where(neg, -v, v)
                at += 20
    return out

"""The peer exchange's CUDA handler (xla_ffi/peer.cu) under the CUDA emulator, against its CPU
twin (xla_ffi/peer.cc): one rank per emulated device, 8 CPU devices (tests/conftest.py), every
participant reading its peers' buffers through the emulator's peer-access check.

Bitwise equal to the CPU handler: the op itself through `jax_ep.transport._peer` (random
blocks, row_map entries -1 and past the source, f32 / bf16 / int8 / bool rows, multi-dimensional
rows, receive buffers larger than what arrives, empty blocks, S = 0) on a 1-D mesh and on a
("data", "ep") = 2 x 4 mesh, deepep / hybridep dispatch + combine with transport="peer"
(values and gradients), and the MoE layer's chunked dropless fallback (peer exchanges inside
a lax.scan). A meeting that cannot fill times out with an error naming the transport
and the axis, and the process keeps working. Skipped without the emulated CUDA handlers (the
JAX_EP_CUDA_EMU build).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ep import _ffi

if not _ffi.WITH_CUDA_EMU:
    pytest.skip("needs the emulated CUDA handlers (the JAX_EP_CUDA_EMU build)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ep_utils import random_routing  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import hybridep  # noqa: E402
from jax_ep import transport as tp  # noqa: E402

NUM_DEVICES = 8
KERNEL = "PeerExchangeKernel"


def _devices():
    devices = jax.devices("cpu")
    if len(devices) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} CPU devices, got {len(devices)}")
    return devices[:NUM_DEVICES]


def _on_both(fn, mesh, args, in_specs, out_specs):
    """jit(shard_map(fn))(*args) traced with the CPU handlers and with the emulated CUDA ones:
    {"native": outputs, "cuda_emu": outputs} as numpy."""
    outs = {}
    for kind in ("native", "cuda_emu"):
        with _ffi.use_handlers(kind):
            mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            outs[kind] = jax.tree.map(np.asarray, jax.jit(mapped)(*args))
    return outs


def _bits(a):
    """The bytes of `a`, so that equality is bitwise (NaNs, bf16, bool alike)."""
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_bitwise(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(_bits(g), _bits(w))


# ----------------------------------------------------------------------------- the op itself


def _random_exchange(rng, groups, P_, M, S, R, row_shape, dtype):
    """Per-device operands of one exchange (devices ordered group-major, then rank) and the
    expected outputs. Every sender's block for each receiver lands at a random offset of the
    receiver's R rows, blocks disjoint, some empty; row_map holds -1 and entries past M."""
    n = groups * P_
    if dtype == np.bool_:
        src = rng.random((n, M) + row_shape) < 0.5
    elif np.issubdtype(dtype, np.integer):
        src = rng.integers(-128, 128, (n, M) + row_shape).astype(dtype)
    else:
        src = rng.standard_normal((n, M) + row_shape).astype(dtype)
    row_map = rng.integers(-2, M + 3, (n, S)).astype(np.int32)
    counts = np.zeros((n, P_), np.int32)
    send_offsets = np.zeros((n, P_), np.int32)
    dest_offsets = np.zeros((n, P_), np.int32)
    for g in range(groups):
        for q in range(P_):  # receiver q of group g: disjoint blocks with gaps in its R rows
            budget = R
            for p in range(P_):
                c = int(rng.integers(0, min(S // P_, budget) + 1)) if rng.random() > 0.2 else 0
                gap = int(rng.integers(0, budget - c + 1)) // 2
                dest_offsets[g * P_ + p, q] = R - budget + gap
                counts[g * P_ + p, q] = c
                budget -= gap + c
    for d in range(n):
        send_offsets[d] = np.concatenate([[0], np.cumsum(counts[d])[:-1]])
    out = np.zeros((n, R) + row_shape, dtype)
    recv = np.zeros((n, P_), np.int32)
    for g in range(groups):
        for q in range(P_):
            for p in range(P_):
                d, r = g * P_ + p, g * P_ + q
                c, o, at = counts[d, q], send_offsets[d, q], dest_offsets[d, q]
                for j in range(c):
                    s = row_map[d, o + j]
                    out[r, at + j] = src[d, s] if 0 <= s < M else 0
                recv[r, p] = c
    operands = (src, row_map, send_offsets, counts, dest_offsets)
    return [a.reshape((-1,) + a.shape[2:]) for a in operands], (out, recv)


def _exchange(R, axis):
    def fn(src, row_map, send_offsets, send_counts, dest_offsets):
        return tp._peer(src, row_map, send_offsets, send_counts, dest_offsets, out_rows=R,
                        axis_name=axis, name="test_peer")
    return fn


@pytest.mark.parametrize("dtype,row_shape,S", [
    (np.float32, (3,), 40),
    (jnp.bfloat16, (2, 4), 40),
    (np.int8, (16,), 40),
    (np.bool_, (5,), 40),
    (np.float32, (3,), 0),
])
def test_peer_op_equals_cpu_handler(rng, dtype, row_shape, S):
    # Reversed devices: rank r runs on device 7 - r (ranks are not device ordinals).
    mesh = jax.sharding.Mesh(np.array(_devices()[::-1]), ("ep",))
    M, R = 7, 48
    operands, (want_out, want_recv) = _random_exchange(rng, 1, NUM_DEVICES, M, S, R, row_shape,
                                                       np.dtype(dtype))
    _ffi.emulated_cuda_launch_counts(reset=True)
    got = _on_both(_exchange(R, "ep"), mesh, operands, (P("ep"),) * 5, P("ep"))
    launches = {k: v for k, v in _ffi.emulated_cuda_launch_counts().items() if KERNEL in k}
    # One launch per device; none when S = 0 (nobody can send: transport._peer makes no call).
    assert sum(launches.values()) == (NUM_DEVICES if S else 0), launches
    _assert_bitwise(got["cuda_emu"], got["native"])
    out, recv = got["native"]
    np.testing.assert_array_equal(_bits(out), _bits(want_out.reshape(out.shape)))
    np.testing.assert_array_equal(recv, want_recv.reshape(-1))


def test_peer_op_two_groups_equals_cpu_handler(rng):
    mesh = jax.sharding.Mesh(np.array(_devices()).reshape(2, 4), ("data", "ep"))
    M, S, R = 6, 16, 20
    operands, (want_out, want_recv) = _random_exchange(rng, 2, 4, M, S, R, (4,), np.float32)
    spec = P(("data", "ep"))
    got = _on_both(_exchange(R, "ep"), mesh, operands, (spec,) * 5, spec)
    _assert_bitwise(got["cuda_emu"], got["native"])
    out, recv = got["native"]
    np.testing.assert_array_equal(out, want_out.reshape(out.shape))
    np.testing.assert_array_equal(recv, want_recv.reshape(-1))


# ----------------------------------------------------------------------------- EP modes


def test_deepep_and_hybridep_over_peer_equal_cpu_handlers(rng):
    mesh = jax.sharding.Mesh(np.array(_devices()), ("ep",))
    T, H, K, E = 6, 8, 2, 2 * NUM_DEVICES
    x = rng.standard_normal((NUM_DEVICES * T, H)).astype(np.float32)
    idx, w = random_routing(rng, NUM_DEVICES * T, K, E)
    cot = rng.standard_normal(x.shape).astype(np.float32)

    def modes(x, i, w, cot):
        def deepep(x):
            rx, _, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep",
                                           transport="peer")
            y, _ = jax_ep.combine(rx * 2.0, h, topk_weights=rw)
            return rx, y

        def hybrid(x):
            px, pp, tpe, h = hybridep.hybridep_dispatch(
                x, topk_idx=i, probs=w, num_experts=E, axis_name="ep", transport="peer",
                num_permuted_tokens=NUM_DEVICES * T * K)
            return px, pp, tpe, hybridep.hybridep_combine(px * 3.0, h)

        values = (deepep(x), hybrid(x))
        grads = (jax.grad(lambda x: jnp.sum(deepep(x)[1] * cot))(x),
                 jax.grad(lambda x: jnp.sum(hybrid(x)[3] * cot))(x))
        return jax.tree.map(lambda a: a[None], (values, grads))

    got = _on_both(modes, mesh, (x, idx, w, cot), (P("ep"),) * 4, P("ep"))
    _assert_bitwise(got["cuda_emu"], got["native"])
    (deepep_values, _), (deepep_grad, _) = got["native"]
    assert np.abs(deepep_grad).sum() > 0 and np.abs(deepep_values[0]).sum() > 0


def test_bounded_fallback_chunks_over_peer_equal_cpu_handlers(rng):
    """The MoE layer's dropless fallback over the peer transport: bounded_forward with every
    token on experts 0 and 1 overflows the bounded buffers (15 rows for 6 tokens), so each
    rank runs 6 chunks of one token, each a dispatch and combine through the peer exchange
    inside a lax.scan, and the backward recomputes them chunk by chunk. Values, the overflow
    flag and gradients equal the CPU handlers' bit for bit."""
    from jax_ep.flax import MoEFlexTokenDispatcher
    mesh = jax.sharding.Mesh(np.array(_devices()), ("ep",))
    T, H, K, E = 6, 8, 2, 2 * NUM_DEVICES
    x = rng.standard_normal((NUM_DEVICES * T, H)).astype(np.float32)
    idx = np.tile(np.int32([[0, 1]]), (NUM_DEVICES * T, 1))
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)

    def body(x, i, w):
        d = MoEFlexTokenDispatcher(2, [0, 1], jax_ep.TokenDispatcherConfig(
            num_moe_experts=E, moe_router_topk=K, expert_axis_name="ep", transport="peer",
            dropless_buffer_factor=1.25))
        assert d.fallback_chunks(T, K) == 6

        def loss(x, w):
            y, overflow, _ = d.bounded_forward(
                x, w, i, lambda rows, tpe, probs, s: jnp.sin(rows * s) * probs[:, None],
                jnp.float32(0.5))
            return jnp.sum(jnp.cos(y)), (y, overflow)
        (_, (y, overflow)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return jax.tree.map(lambda a: a[None], (y, overflow, grads))

    got = _on_both(body, mesh, (x, idx, w), (P("ep"),) * 3, P("ep"))
    _assert_bitwise(got["cuda_emu"], got["native"])
    y, overflow, (dx, dw) = got["native"]
    assert (overflow == 1).all() and np.abs(y).sum() > 0 and np.abs(dx).sum() > 0


# ----------------------------------------------------------------------------- timeout


def test_peer_meeting_that_cannot_fill_times_out(rng, monkeypatch):
    """num_devices=8 on a 4-device mesh: meeting 1 never fills; every device gives up after
    JAX_EP_PEER_TIMEOUT_S and the next exchange works."""
    monkeypatch.setenv(tp.PEER_TIMEOUT_ENV, "1")
    mesh = jax.sharding.Mesh(np.array(_devices()[:4]), ("ep",))
    i32 = jnp.int32

    def short(src):
        rank = jax.lax.axis_index("ep")
        zeros = jnp.zeros((4,), i32)
        return _ffi.call(
            "jax_ep_peer_exchange",
            (jax.ShapeDtypeStruct((4, 2), src.dtype), jax.ShapeDtypeStruct((4,), i32)),
            src, zeros, zeros, zeros, zeros, jnp.stack([rank, 0]).astype(i32),
            jnp.zeros((0,), i32), num_ranks=4, num_devices=8,
            timeout_ms=round(tp.peer_timeout_s() * 1000), num_recv=4,
            gather=False, axis="ep")

    src = np.ones((16, 2), np.float32)
    with _ffi.use_handlers("cuda_emu"):
        mapped = jax.jit(jax.shard_map(short, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        with pytest.raises(jax.errors.JaxRuntimeError) as failure:
            jax.block_until_ready(mapped(src))
    message = str(failure.value)
    assert "peer transport" in message and "axis 'ep'" in message and "timed out" in message, \
        message

    operands, (want_out, _) = _random_exchange(rng, 1, 4, 3, 4, 8, (2,), np.float32)
    got = _on_both(_exchange(8, "ep"), mesh, operands, (P("ep"),) * 5, P("ep"))
    _assert_bitwise(got["cuda_emu"], got["native"])
    np.testing.assert_array_equal(got["cuda_emu"][0], want_out.reshape(got["cuda_emu"][0].shape))


# ----------------------------------------------------------------------------- peer access


def test_gpus_without_peer_access_are_found(monkeypatch):
    """GPUs without a P2P path (JAX_EP_CUDA_EMU_NO_PEER_ACCESS here): peer.cu's query, which
    the CUDA build's "auto" asks before it picks the peer transport (transport.peer_unavailable),
    names exactly those pairs, each once as (lower, higher), and a CUDA error names the call."""
    query = _ffi._jax_ep_cuda_emu.peer_pairs_without_access
    monkeypatch.delenv("JAX_EP_CUDA_EMU_NO_PEER_ACCESS", raising=False)
    assert query(list(range(NUM_DEVICES))) == []
    monkeypatch.setenv("JAX_EP_CUDA_EMU_NO_PEER_ACCESS", "2:1,0:3")
    assert query([3, 2, 1, 0]) == [(0, 3), (1, 2)]
    assert query(list(range(NUM_DEVICES))) == [(0, 3), (1, 2)]
    assert query([0, 1]) == [] and query([]) == [] and query([1, 1]) == []
    with pytest.raises(RuntimeError, match=r"cudaDeviceCanAccessPeer\(0, 99\) failed"):
        query([0, 99])

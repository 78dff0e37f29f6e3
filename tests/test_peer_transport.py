"""The "peer" transport (xla_ffi/peer.cc) on 8 CPU devices: the op against a numpy model, every
EP mode bitwise equal to the padded all_to_all transport (outputs and gradients), loops and
remat (occurrences of one op), two groups on a (data, ep) mesh, the programs it compiles to
(no XLA collective), where "auto" picks it, and the errors: a bad argument on one rank, an
axis whose ranks cannot all meet (a bounded wait, never a hang), what it refuses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import AXIS, ep_mesh, low_latency_round_trip, random_routing, run_ep, shard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _ffi, hybridep, transport
from jax_ep.transport import _peer

NUM_RANKS = 8
ROOT = Path(__file__).resolve().parents[1]


def _assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        u, v = np.asarray(u), np.asarray(v)
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(u.view(np.uint8) if u.dtype.itemsize == 1 else u, v.view(
            np.uint8) if v.dtype.itemsize == 1 else v)


# ----------------------------------------------------------------------------- the op itself

def _random_blocks(rng, P, S, R):
    """Per rank: send_offsets/counts over S compact rows, and dest_offsets that tile every
    receiver's R rows with gaps (source-major, as the transport lays them out)."""
    counts = rng.integers(0, 4, size=(P, P)).astype(np.int32)  # [src, dst]
    counts = np.minimum(counts, S // P)
    send_offsets = np.cumsum(counts, axis=1) - counts  # compact, destination-major
    gaps = rng.integers(0, 2, size=(P, P))  # a gap row before some blocks
    dest = np.cumsum(counts + gaps, axis=0) - counts  # [src, dst]: start in dst's output
    assert (dest + counts).max() <= R
    return counts, send_offsets.astype(np.int32), dest.astype(np.int32)


def _numpy_peer(src, row_map, counts, send_offsets, dest, R):
    P = counts.shape[0]
    out = np.zeros((P, R) + src.shape[2:], src.dtype)
    recv = np.zeros((P, P), np.int32)
    for q in range(P):
        for p in range(P):
            for j in range(counts[p, q]):
                s = row_map[p, send_offsets[p, q] + j]
                if 0 <= s < src.shape[1]:
                    out[q, dest[p, q] + j] = src[p, s]
            recv[q, p] = counts[p, q]
    return out, recv


@pytest.mark.parametrize("dtype,row_shape", [(np.float32, (5,)), (jnp.bfloat16, (3, 4)),
                                             (np.int8, (7,)), (np.bool_, (2,))])
def test_peer_exchange_matches_numpy_model(dtype, row_shape):
    P, M, S, R = NUM_RANKS, 6, 24, 40
    rng = np.random.default_rng(3)
    src = rng.standard_normal((P, M) + row_shape) * 4
    src = (src > 0) if dtype == np.bool_ else src.astype(dtype)
    row_map = rng.integers(-2, M + 2, size=(P, S)).astype(np.int32)  # -1, -2, M, M+1: zero rows
    counts, send_offsets, dest = _random_blocks(rng, P, S, R)

    def f(src, row_map, send_offsets, counts, dest):
        out, recv = _peer(src[0], row_map[0], send_offsets[0], counts[0], dest[0], out_rows=R,
                          axis_name=AXIS, name="t")
        return out[None], recv[None]

    out, recv = run_ep(f, ep_mesh(P), src, row_map, send_offsets, counts, dest)
    want_out, want_recv = _numpy_peer(np.asarray(src), row_map, counts, send_offsets, dest, R)
    _assert_same((out, recv), (want_out, want_recv))


def test_peer_exchange_gathers_its_receive_layout_in_the_copy():
    # recv_rows picks rows of the receive layout (repeats, -1, past R: zero rows); the layout
    # itself is never written: out [N] = layout[recv_rows] of the plain exchange.
    P, M, S, R, N = NUM_RANKS, 6, 24, 40, 50
    rng = np.random.default_rng(4)
    src = rng.standard_normal((P, M, 3)).astype(np.float32)
    row_map = rng.integers(-1, M, size=(P, S)).astype(np.int32)
    counts, send_offsets, dest = _random_blocks(rng, P, S, R)
    recv_rows = rng.integers(-2, R + 3, size=(P, N)).astype(np.int32)

    def f(src, row_map, send_offsets, counts, dest, recv_rows):
        out, recv = _peer(src[0], row_map[0], send_offsets[0], counts[0], dest[0], out_rows=R,
                          axis_name=AXIS, name="t", recv_rows=recv_rows[0])
        return out[None], recv[None]

    out, recv = run_ep(f, ep_mesh(P), src, row_map, send_offsets, counts, dest, recv_rows)
    layout, want_recv = _numpy_peer(src, row_map, counts, send_offsets, dest, R)
    padded = np.concatenate([layout, np.zeros((P, 1, 3), np.float32)], axis=1)
    picks = np.where((recv_rows >= 0) & (recv_rows < R), recv_rows, R)
    want = np.take_along_axis(padded, picks[:, :, None], axis=1)
    _assert_same((out, recv), (want, want_recv))


def test_peer_exchange_moves_nothing_when_nothing_is_sent():
    # S = 0 compact rows, R = 3 receive rows: zeros and zero counts everywhere; and R = 0.
    P = NUM_RANKS
    zeros = np.zeros((P, P), np.int32)

    def f(src, z):
        out, recv = _peer(src[0], jnp.zeros((0,), jnp.int32), z[0], z[0], z[0], out_rows=3,
                          axis_name=AXIS, name="t")
        empty, _ = _peer(src[0], jnp.zeros((0,), jnp.int32), z[0], z[0], z[0], out_rows=0,
                         axis_name=AXIS, name="t")
        return out[None], recv[None], empty[None]

    out, recv, empty = run_ep(f, ep_mesh(P), np.ones((P, 1, 2, 4), np.float32), zeros)
    assert np.asarray(out).shape == (P, 3, 2, 4) and not np.asarray(out).any()
    assert not np.asarray(recv).any() and np.asarray(empty).shape == (P, 0, 2, 4)


# ----------------------------------------------------------------------------- every mode

def _routing(P, T, K, E, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((P * T, 16)).astype(np.float32)
    idx, w = random_routing(rng, P * T, K, E)
    return x, idx, w


def _peer_equals_all_to_all(make_loss, x, idx, w):
    """make_loss(transport, idx) -> loss(x, w) returning (scalar, aux tuple): on P = 8 ranks the
    aux outputs and both gradients on "peer" are bitwise those on "all_to_all"; returns the
    peer run's outputs (aux..., d_x, d_w)."""
    def body(t):
        def f(x, i, w):
            (_, aux), grads = jax.value_and_grad(make_loss(t, i), argnums=(0, 1),
                                                 has_aux=True)(x, w)
            return tuple(aux) + grads
        return f

    mesh = ep_mesh(NUM_RANKS)
    got = run_ep(body("peer"), mesh, x, idx, w)
    _assert_same(got, run_ep(body("all_to_all"), mesh, x, idx, w))
    return got


@pytest.mark.parametrize("capacity,num_worst", [(None, None), (3, None), (None, 9)])
def test_deepep_peer_equals_all_to_all(capacity, num_worst):
    T, K, E = 6, 3, 16

    def make_loss(t, i):
        def loss(x, w):
            rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, transport=t,
                                            capacity=capacity, num_worst_tokens=num_worst)
            y, cw = jax_ep.combine(jnp.tanh(rx) * 2, h, topk_weights=rw)
            return jnp.sum(y ** 2) + jnp.sum(cw), (rx, ri, rw, y, cw, h.num_dropped[None],
                                                   h.num_recv_tokens_per_expert)
        return loss

    got = _peer_equals_all_to_all(make_loss, *_routing(NUM_RANKS, T, K, E, 1))
    if capacity or num_worst:  # the bounded cases really drop rows
        assert np.asarray(got[5]).sum() > 0


def test_deepep_chunked_overlap_peer_equals_all_to_all():
    T, K, E = 8, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 2)

    def body(t):
        def f(x, i, w):
            return jax_ep.deepep.dispatch_chunked_forward(
                x, i, w, lambda rx, ri, rw: rx * (ri.max(axis=1) + 2)[:, None],
                num_local_experts=E // NUM_RANKS, axis_name=AXIS, chunks=3, backend="deepep",
                transport=t)
        return f

    mesh = ep_mesh(NUM_RANKS)
    _assert_same([run_ep(body("peer"), mesh, x, idx, w)],
                 [run_ep(body("all_to_all"), mesh, x, idx, w)])


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_hybridep_peer_equals_all_to_all(compact, use_fp8):
    T, K, E, N = 5, 2, 16, 24
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, 128)), jnp.bfloat16)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)
    if not compact:
        dense = np.zeros((NUM_RANKS * T, E), np.float32)
        np.put_along_axis(dense, np.where(idx >= 0, idx, 0), np.where(idx >= 0, w, 0), axis=1)
        idx, w = dense > 0, dense
    fp8 = dict(use_fp8=True, fp8_output="cast_back") if use_fp8 else {}

    def make_loss(t, i):
        routing = dict(topk_idx=i) if compact else dict(routing_map=i)

        def loss(x, w):
            px, pp, tpe, h = hybridep.hybridep_dispatch(
                x, probs=w, num_experts=E, axis_name=AXIS, num_permuted_tokens=N, transport=t,
                **routing, **fp8)
            y = hybridep.hybridep_combine(px * 3, h)
            return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(pp), (px, pp, tpe, y)
        return loss

    _peer_equals_all_to_all(make_loss, x, idx, w)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_peer_equals_all_to_all(use_fp8):
    T, tmax, K, E, H = 5, 6, 3, 16, 128
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)
    kw = dict(use_fp8=True, fp8_output="cast_back") if use_fp8 else {}
    _peer_equals_all_to_all(
        lambda t, i: low_latency_round_trip(i, tmax=tmax, num_experts=E, transport=t, **kw),
        x, idx, w)


@pytest.mark.parametrize("mode", ["deepep", "hybridep"])
def test_two_hop_local_hop_on_peer(mode):
    # (node, local) = (2, 4): transport="peer" serves the local hop, the node hop stays on
    # all_to_all; the result and the gradient equal the all-XLA two-hop bitwise.
    T, K, E = 6, 3, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 4)
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axes = ("node", "local")

    def body(t):
        def f(x, i, w):
            def loss(x):
                if mode == "deepep":
                    rx, _, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=axes,
                                                   transport=t)
                    y = jax_ep.combine(rx * 2, h)[0]
                    return jnp.sum(y ** 2), (rx, rw, y)
                px, pp, tpe, h = hybridep.hybridep_dispatch(
                    x, probs=w, topk_idx=i, num_experts=E, axis_name=axes,
                    num_permuted_tokens=4 * T * K, transport=t)
                y = hybridep.hybridep_combine(px * 2, h)
                return jnp.sum(y ** 2), (px, pp, tpe, y)
            (_, aux), g = jax.value_and_grad(loss, has_aux=True)(x)
            return aux + (g,)
        return f

    spec = P(axes)
    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(a, sharding) for a in (x, idx, w)]

    def run(t):
        mapped = jax.shard_map(body(t), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jax.jit(mapped)(*args)

    _assert_same(run("peer"), run("all_to_all"))
    _assert_same(run(("all_to_all", "peer")), run("all_to_all"))
    with pytest.raises(ValueError, match="node hop"):
        run(("peer", "all_to_all"))


def test_all_to_all_single_runs_on_peer():
    # all_to_all_single takes "auto", which is "peer" on CPU: against a numpy model, and its
    # gradient is the exchange back.
    P_, S = NUM_RANKS, 5
    rng = np.random.default_rng(6)
    splits = rng.multinomial(S, np.ones(P_) / P_, size=P_).astype(np.int32)  # [src, dst]
    x = rng.standard_normal((P_ * S, 3)).astype(np.float32)

    def f(x, splits, out_splits):
        y = jax_ep.all_to_all_single(x, out_splits[0], splits[0], axis_name=AXIS)
        g = jax.grad(lambda x: jnp.sum(jax_ep.all_to_all_single(
            x, out_splits[0], splits[0], axis_name=AXIS) * jnp.arange(P_ * S)[:, None]))(x)
        return y, g

    y, g = run_ep(f, ep_mesh(P_), x, splits, np.ascontiguousarray(splits.T))
    y, xs = np.asarray(y).reshape(P_, P_ * S, 3), x.reshape(P_, S, 3)
    want_g = np.zeros_like(x)  # x's row -> the index of the output row it landed in
    for q in range(P_):
        got = [xs[p][splits[p, :q].sum():splits[p, :q + 1].sum()] for p in range(P_)]
        want = np.concatenate(got)
        np.testing.assert_array_equal(y[q][:len(want)], want)
        assert not y[q][len(want):].any()
        row = 0  # the local output row (the weights are arange over one rank's rows)
        for p in range(P_):
            for i in range(splits[p, :q].sum(), splits[p, :q + 1].sum()):
                want_g[p * S + i] = row
                row += 1
    np.testing.assert_array_equal(np.asarray(g), want_g)


def test_the_program_after_an_exchange_flushes_denormals_as_xla_does():
    # XLA:CPU runs programs with denormals flushed to zero; the peer handler completes other
    # devices' calls on threads of its own, where the rest of their program then runs: it must
    # compute there as on XLA's threads. (It does because those threads are started by XLA's
    # threads, and a new thread inherits its creator's floating-point environment.) 1e-39
    # (subnormal in f32) times the received rows is 0 under flush-to-zero, on both transports.
    T, K, E = 4, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 13)
    tiny = np.full((NUM_RANKS, 1), 1e-39, np.float32)

    def body(t):
        def f(x, i, w, tiny):
            rx = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, transport=t)[0]
            return rx * tiny[0, 0] + rx * 0
        return f

    mesh = ep_mesh(NUM_RANKS)
    got = run_ep(body("peer"), mesh, x, idx, w, tiny)
    _assert_same([got], [run_ep(body("all_to_all"), mesh, x, idx, w, tiny)])
    assert not np.asarray(got).any()


# ----------------------------------------------------------------------------- occurrences

def test_scan_and_remat_meet_by_occurrence():
    # One traced exchange runs 3 times per step under lax.scan, and again in the backward
    # under jax.checkpoint: every occurrence meets its own peers (a mixed-up meeting would
    # swap layers' rows). Compared bitwise with all_to_all.
    T, K, E = 4, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 7)
    scales = jnp.asarray([1.0, -2.0, 0.5], jnp.float32)

    def body(t):
        def f(x, i, w):
            @jax.checkpoint
            def layer(h, s):
                rx, _, rw, handle = jax_ep.dispatch(h, i, w, num_experts=E, axis_name=AXIS,
                                                    transport=t)
                return jax_ep.combine(jnp.sin(rx * s), handle)[0] + h

            def loss(x):
                out, _ = jax.lax.scan(lambda h, s: (layer(h, s), None), x, scales)
                return jnp.sum(out ** 2), out
            (_, out), g = jax.value_and_grad(loss, has_aux=True)(x)
            return out, g
        return f

    mesh = ep_mesh(NUM_RANKS)
    _assert_same(run_ep(body("peer"), mesh, x, idx, w),
                 run_ep(body("all_to_all"), mesh, x, idx, w))


def test_a_python_loop_over_a_checkpointed_layer_meets_per_instruction():
    # One jax.checkpoint-ed layer called from a Python loop is traced once and lowered once
    # (JAX caches both), so its exchanges are alike in every layer: the same attributes, and in
    # the backward recomputes that depend only on their saved inputs, which XLA may run in any
    # order. The devices meet per instruction (the FFI instantiate state), never per
    # attribute. Compared bitwise with all_to_all, several runs. (XLA:CPU has not been seen to
    # reorder them, so this guards the result; the cond test below guards the key.)
    T, K, E, L = 8, 2, 16, 4
    x, idx, w = _routing(NUM_RANKS, T, K, E, 12)
    x = np.tile(x, (1, 4))  # H = 16
    scales = np.linspace(-1.5, 1.5, L * NUM_RANKS).astype(np.float32).reshape(L * NUM_RANKS, 1)

    def body(t):
        def f(x, i, w, s):
            @jax.checkpoint
            def layer(h, scale):
                rx, _, _, handle = jax_ep.dispatch(h, i, w, num_experts=E, axis_name=AXIS,
                                                   transport=t)
                return jnp.tanh(jax_ep.combine(rx * scale, handle)[0])

            def loss(x, s):
                for l in range(L):
                    x = layer(x, s[l])
                return jax.lax.psum(jnp.sum(x ** 2), AXIS), x
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, s)
            return out, *grads
        return f

    mesh = ep_mesh(NUM_RANKS)
    text = _hlo(body("peer"), mesh, x, idx, w, scales)
    calls = re.findall(r"custom-call\(.*custom_call_target=\"jax_ep_peer_exchange\"", text)
    # per layer: the dispatch's counts and rows, the combine, and in the backward the
    # recompute's dispatch and the combine's and dispatch's transposes
    assert len(calls) >= 5 * L, len(calls)
    for _ in range(3):
        _assert_same(run_ep(body("peer"), mesh, x, idx, w, scales),
                     run_ep(body("all_to_all"), mesh, x, idx, w, scales))


def test_two_groups_on_a_data_ep_mesh():
    # A (data, ep) = (2, 4) mesh: each data group exchanges among its own 4 ranks.
    T, K, E = 5, 2, 8
    x, idx, w = _routing(NUM_RANKS, T, K, E, 8)
    mesh = jax.make_mesh((2, 4), ("data", AXIS))
    spec = P(("data", AXIS))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, w)]

    def run(t):
        def f(x, i, w):
            rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                            transport=t)
            return rx, ri, jax_ep.combine(rx * 3, h)[0]
        mapped = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jax.jit(mapped)(*args)

    _assert_same(run("peer"), run("all_to_all"))


# ----------------------------------------------------------------------------- programs

def _hlo(fn, mesh, *arrays):
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * len(arrays), out_specs=P(AXIS))
    return jax.jit(mapped).lower(*shard(mesh, *arrays)).compile().as_text()


def test_peer_programs_hold_the_custom_call_and_no_collective():
    T, K, E = 6, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 9)

    def f(x, i, w):
        def loss(x):
            rx, _, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                           transport="peer")
            return jnp.sum(jax_ep.combine(rx, h)[0] ** 2)
        return jax.grad(loss)(x)

    text = _hlo(f, ep_mesh(NUM_RANKS), x, idx, w)
    calls = re.findall(r'custom_call_target="jax_ep_peer_exchange"', text)
    # counts; ids, rows, weights; combine rows - and the backward's combine and dispatch.
    assert len(calls) >= 5, len(calls)
    for collective in ("all-to-all", "all-gather", "all-reduce", "collective-permute",
                       "ragged-all-to-all", "reduce-scatter"):
        assert collective not in text, collective


def _peer_calls(text):
    """(first operand type, first result type) of every peer call in a lowered program."""
    calls = re.findall(r"custom_call @jax_ep_peer_exchange\(.*\} : \((tensor<[^>]*>),.*"
                       r"-> \((tensor<[^>]*>),", text)
    return [tuple(c) for c in calls]


def test_peer_wire_reads_fp8_rows_in_place_and_moves_bf16_back():
    # use_fp8 on peer: the receivers read the FP8 codes straight from the senders' [T, H]
    # cast (no packed [S, H] send buffer), R rows arrive; the combine and the backward
    # exchanges move bf16 rows.
    num_ranks, T, H, K, E = 4, 6, 128, 2, 8
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    mesh = ep_mesh(num_ranks)
    R = num_ranks * T

    def body(x, i, w):
        rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, use_fp8=True,
                                      fp8_output="cast_back", transport="peer")
        return jax_ep.combine(rx, h)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
    args = shard(mesh, x, idx, w)
    wide = [c for c in _peer_calls(jax.jit(f).lower(*args).as_text()) if f"x{H}x" in c[0]]
    # the combine returns into one row per send row: T*min(K, P), not T*P
    assert wide == [(f"tensor<{T}x{H}xf8E4M3FN>", f"tensor<{R}x{H}xf8E4M3FN>"),
                    (f"tensor<{R}x{H}xbf16>", f"tensor<{T * min(K, num_ranks)}x{H}xbf16>")], wide
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32))))
    # Under grad of this linear map both forward exchanges are dead code: the two cotangent
    # exchanges (combine's backward dispatch of d_out, dispatch's backward combine) move bf16.
    wide = [c[0] for c in _peer_calls(grad.lower(*args).as_text()) if f"x{H}x" in c[0]]
    assert wide == [f"tensor<{T}x{H}xbf16>", f"tensor<{R}x{H}xbf16>"], wide


def test_auto_is_peer_in_one_process_and_all_to_all_where_peer_cannot_run(monkeypatch):
    seen = []

    def f(x):
        seen.append(transport.resolve_transport("auto"))
        return x

    run_ep(f, ep_mesh(4), np.zeros((8, 2), np.float32))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    run_ep(f, ep_mesh(4), np.ones((8, 2), np.float32))
    assert seen == ["peer", "all_to_all"]

    def g(x):
        transport.resolve_transport("peer")
        return x

    with pytest.raises(ValueError, match="processes"):
        run_ep(g, ep_mesh(4), np.ones((8, 2), np.float32))


def _custom_calls(fn, *arrays):
    mesh = ep_mesh(4)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * len(arrays), out_specs=P(AXIS))
    text = jax.jit(mapped).lower(*shard(mesh, *arrays)).as_text()
    return sorted(set(re.findall(r"custom_call @(\w+)\(", text)))


def test_alltoall_backend_is_xla_only_and_auto_takes_xla_collectives():
    # the contract: backend "alltoall" is built only from XLA ops, so "auto" is XLA's
    # collective for it (peer for the FFI backends) and an explicit "peer" is refused
    rng = np.random.default_rng(3)
    T, H, K, E = 8, 128, 2, 8
    x = jnp.asarray(rng.standard_normal((4 * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, 4 * T, K, E)

    def normal(backend):
        def f(x, i, w):
            rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                          backend=backend)
            return jax_ep.combine(rx, h)[0]
        return f

    def chunked(x, i, w):
        return jax_ep.dispatch_chunked_forward(x, i, w, lambda r, _, __: r * 2,
                                               num_local_experts=E // 4, axis_name=AXIS,
                                               chunks=2, backend="alltoall")

    def hybrid(x, i, w):
        px, _, _, h = hybridep.hybridep_dispatch(x, topk_idx=i, probs=w, num_experts=E,
                                                 axis_name=AXIS, backend="alltoall")
        return hybridep.hybridep_combine(px, h)

    def low_latency(x, i, w):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=T,
                                                 num_experts=E, axis_name=AXIS,
                                                 backend="alltoall")
        return jax_ep.low_latency_combine(recv, i, w, h)

    for fn in (normal("alltoall"), chunked, hybrid, low_latency):
        assert _custom_calls(fn, x, idx, w) == [], fn
    assert "jax_ep_peer_exchange" in _custom_calls(normal("deepep"), x, idx, w)
    with pytest.raises(ValueError, match="'peer' cannot serve this exchange.*alltoall"):
        run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                               backend="alltoall", transport="peer")[0],
               ep_mesh(4), x, idx, w)


def test_peer_refuses_a_mesh_axis_that_is_not_manual():
    mesh = jax.make_mesh((2, 4), ("data", AXIS))
    x = jax.device_put(np.zeros((2, 8), np.float32), NamedSharding(mesh, P(None, AXIS)))
    seen = []

    def f(x):
        seen.append(transport.resolve_transport("auto"))
        transport.resolve_transport("peer")
        return x

    with pytest.raises(ValueError, match="not manual"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, AXIS), out_specs=P(None, AXIS),
                              axis_names={AXIS}))(x)
    assert seen == ["all_to_all"]


# ----------------------------------------------------------------------------- errors

def test_a_bad_argument_on_one_rank_fails_every_rank_without_writing_out_of_bounds():
    # Every rank sends one row to every rank, landing at row (sender's rank) of the receivers'
    # 8 rows; rank 5 claims row 8 instead: every device fails with one message naming the
    # transport, the axis and the rank (no device copies anything).
    P_ = NUM_RANKS
    dest = np.repeat(np.arange(P_, dtype=np.int32), P_).reshape(P_, P_)
    dest[5] = P_

    def f(src, dest):
        out, _ = _peer(src[0], jnp.zeros((P_,), jnp.int32), jnp.arange(P_),
                       jnp.ones((P_,), jnp.int32), dest[0], out_rows=P_, axis_name=AXIS,
                       name="t")
        return out[None]

    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"peer transport \(axis 'ep'.*rank 5 sends rows 8 \+ 1"):
        jax.block_until_ready(run_ep(f, ep_mesh(P_), np.ones((P_, 1, 1, 2), np.float32), dest))


@pytest.mark.parametrize("other_branch", ["identity", "the same exchange"])
def test_ranks_that_cannot_all_meet_fail_within_the_bound(monkeypatch, other_branch):
    # Ranks 0-3 take the branch with the exchange, ranks 4-7 the other: they wait for each
    # other, never meet, and fail after the bound (1 s) with the missing ranks named. No hang;
    # the process keeps working. With the same exchange code in the other branch (the same
    # attributes) the branches are still two instructions that never meet: meetings keyed by
    # anything the two share would pair them and return rows of the other branch.
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, "1")
    T, K, E = 4, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 10)

    def f(x, i, w):
        def exchange(x):
            rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                          transport="peer")
            return jax_ep.combine(rx, h)[0]
        other = (lambda x: x) if other_branch == "identity" else (lambda x: exchange(x * 2))
        return jax.lax.cond(jax.lax.axis_index(AXIS) < 4, exchange, other, x)

    start = time.monotonic()
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"peer transport \(axis 'ep'.*(missing rank\(s\) (4,5,6,7|0,1,2,3)"
                             r" of group 0 \(a rank that took another branch|gave up)"):
        jax.block_until_ready(run_ep(f, ep_mesh(NUM_RANKS), x, idx, w))
    assert time.monotonic() - start < 30
    # Still usable: the same exchange on every rank.
    run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                           transport="peer")[0],
           ep_mesh(NUM_RANKS), x, idx, w).block_until_ready()


def test_many_executions_in_flight_meet_by_run_or_fail_within_the_bound(monkeypatch):
    # 64 calls of a one-exchange program dispatched before any is waited for: each execution's
    # devices meet by its run id, so every result is its own input's exchange. XLA:CPU may not
    # run every device's part of an execution while the others hold its threads (measured: 32
    # in flight always complete; of 64, 2-3 meetings often never fill; XLA's own psum stalls
    # the same way): such a meeting fails after the bound, naming that cause. Never a hang,
    # never crossed rows.
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, "1")
    mesh = ep_mesh(NUM_RANKS)

    def f(x):
        rows = jnp.arange(NUM_RANKS, dtype=jnp.int32)
        counts = jnp.ones((NUM_RANKS,), jnp.int32)
        dest = jnp.full((NUM_RANKS,), jax.lax.axis_index(AXIS), jnp.int32)
        return _peer(x[0], rows, rows, counts, dest, out_rows=NUM_RANKS, axis_name=AXIS,
                     name="t")[0][None]

    call = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    inputs = [shard(mesh, np.arange(NUM_RANKS ** 2 * 2, dtype=np.float32).reshape(
        NUM_RANKS, NUM_RANKS, 2) + 1000 * n)[0] for n in range(64)]
    jax.block_until_ready(call(inputs[0]))
    start = time.monotonic()
    outs = [call(x) for x in inputs]
    for n, out in enumerate(outs):
        try:
            got = np.asarray(out)
        except jax.errors.JaxRuntimeError as err:
            assert re.search(r"timed out after 1000 ms with \d/8 devices arrived.*too many "
                             r"executions of peer-exchange programs in flight", str(err)), err
            continue
        # receiver q's row p is sender p's row q
        np.testing.assert_array_equal(got, np.asarray(inputs[n]).transpose(1, 0, 2))
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e7", "soon"])
def test_a_bad_peer_timeout_is_refused_naming_the_variable(monkeypatch, value):
    # JAX_EP_PEER_TIMEOUT_S outside (0, 1e6] seconds (or not a number) would overflow the
    # handlers' int64-nanosecond deadlines or fail every meeting at once: refused at trace time
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, value)
    T, K, E = 4, 2, 16
    x, idx, w = _routing(NUM_RANKS, T, K, E, 10)
    with pytest.raises(ValueError, match=r"JAX_EP_PEER_TIMEOUT_S: expected seconds in \(0, "
                                         r"1e\+06\], got '" + value):
        run_ep(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                               transport="peer")[0], ep_mesh(NUM_RANKS), x, idx, w)
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, "1e6")  # the largest bound is taken
    assert transport.peer_timeout_s() == 1e6


@pytest.mark.parametrize("platform,default_ms", [("cpu", 60000), ("gpu", 5000)])
def test_the_peer_bound_defaults_per_platform(monkeypatch, platform, default_ms):
    # 60 s on XLA:CPU; 5 s on GPUs, under the 10 s after which XLA's GPU client ends the
    # process when one device failed alone; JAX_EP_PEER_TIMEOUT_S sets both. The traced call
    # carries the bound of the platform it is traced for.
    monkeypatch.delenv(transport.PEER_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(_ffi, "trace_platform", lambda: platform)
    monkeypatch.setattr(_ffi, "gpus_without_peer_access", lambda: ())

    def timeout_ms_attributes():
        def f(x):
            rows = jnp.arange(x.shape[0], dtype=jnp.int32)
            counts = jnp.full((NUM_RANKS,), 1, jnp.int32)
            return _peer(x, rows, jnp.arange(NUM_RANKS, dtype=jnp.int32), counts,
                         jnp.full((NUM_RANKS,), jax.lax.axis_index(AXIS), jnp.int32),
                         out_rows=NUM_RANKS, axis_name=AXIS, name="t")[0]
        mesh = ep_mesh(NUM_RANKS)
        mapped = jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        x = shard(mesh, np.zeros((NUM_RANKS * NUM_RANKS, 2), np.float32))[0]
        text = jax.jit(mapped).trace(x).jaxpr.pretty_print()
        return re.findall(r"'timeout_ms', (\d+)", text)

    assert transport.peer_timeout_s(platform) * 1000 == default_ms
    assert timeout_ms_attributes() == [str(default_ms)]
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, "2.5")
    assert transport.peer_timeout_s(platform) == 2.5
    assert timeout_ms_attributes() == ["2500"]


@pytest.mark.parametrize("answer", ["pairs", "none", "cuda error"])
def test_auto_leaves_gpus_without_peer_access_to_ragged(monkeypatch, answer):
    # On GPUs "auto" asks CUDA whether every two GPUs of the process reach each other's memory
    # (no P2P path on some PCIe machines and VMs) and takes "ragged" where any pair cannot;
    # "peer" is refused there naming the GPUs, or the CUDA error that left it unknown.
    def gpus_without_peer_access():
        if answer == "cuda error":
            raise RuntimeError("cudaDeviceCanAccessPeer(0, 1) failed: driver too old")
        return ((0, 1), (2, 5)) if answer == "pairs" else ()

    monkeypatch.setattr(_ffi, "trace_platform", lambda: "gpu")
    monkeypatch.setattr(_ffi, "gpus_without_peer_access", gpus_without_peer_access)
    chosen = {}

    def f(x):
        chosen["auto"] = transport.resolve_transport("auto")
        if answer != "none":
            why = ("GPUs 0 and 1, 2 and 5 cannot read each other's memory" if answer == "pairs"
                   else "CUDA cannot say whether .* driver too old")
            with pytest.raises(ValueError, match="transport: 'peer' cannot run here: " + why):
                transport.resolve_transport("peer")
        return x

    mesh = ep_mesh(NUM_RANKS)
    jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(
        shard(mesh, np.zeros((NUM_RANKS,), np.float32))[0])
    assert chosen["auto"] == ("peer" if answer == "none" and _ffi.WITH_CUDA else "ragged")


def test_gpu_peer_access_query_on_a_host_without_gpus():
    # No GPU backend in this process: nothing to ask. The CUDA build's binding itself, asked
    # about two GPUs here, raises naming the call (no driver) instead of crashing.
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a host with GPUs")
    assert _ffi.gpus_without_peer_access() == ()
    if _ffi.WITH_CUDA:
        assert _ffi._jax_ep.cuda_peer_pairs_without_access([0]) == []
        with pytest.raises(RuntimeError, match=r"cudaDeviceCanAccessPeer\(0, 1\) failed"):
            _ffi._jax_ep.cuda_peer_pairs_without_access([0, 1])


def test_a_program_that_expects_more_devices_fails_with_who_arrived(monkeypatch):
    # The op called with num_devices=8 on a 4-device mesh: 4/8 arrive, the bound expires.
    monkeypatch.setenv(transport.PEER_TIMEOUT_ENV, "1")

    def f(src):
        z = jnp.zeros((4,), jnp.int32)
        coords = jnp.stack([jax.lax.axis_index(AXIS), 0]).astype(jnp.int32)
        out, _ = _ffi.call("jax_ep_peer_exchange",
                           (jax.ShapeDtypeStruct((2, 2), jnp.float32),
                            jax.ShapeDtypeStruct((4,), jnp.int32)),
                           src, z, z, z, z, coords, jnp.zeros((0,), jnp.int32),
                           num_ranks=4, num_devices=8, timeout_ms=1000, num_recv=2,
                           gather=False, axis="ep")
        return out

    with pytest.raises(jax.errors.JaxRuntimeError, match=r"4/8 devices arrived"):
        jax.block_until_ready(run_ep(f, ep_mesh(4), np.zeros((8, 2), np.float32)))


def test_a_cuda_meeting_that_fails_waits_for_enqueues_under_way_and_refuses_later_ones(
        tmp_path):
    # The CUDA handler's blocking rendezvous (xla_ffi/peer_meeting.h) on host threads, under
    # ThreadSanitizer (tests/cpp/peer_meeting_test.cc): a device that gives up at the second
    # meeting fails it only once another device's enqueue under way is done (it can then wait
    # for that kernel), and no device enqueues its reads after the failure (its kernel would
    # read buffers whose owners returned). Without the enqueue lock both checks fail and
    # ThreadSanitizer reports races on the meeting's failure.
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    exe = tmp_path / "peer_meeting_test"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-pthread",
         "-I" + str(ROOT / "xla_ffi"), "-isystem", jax.ffi.include_dir(),
         str(ROOT / "tests" / "cpp" / "peer_meeting_test.cc"), "-o", str(exe)],
        capture_output=True, text=True)
    if build.returncode != 0 and "tsan" in build.stderr.lower():
        pytest.skip(f"this compiler cannot link ThreadSanitizer: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    if "FATAL: ThreadSanitizer" in done.stderr:  # e.g. an unexpected memory mapping
        pytest.skip(f"ThreadSanitizer cannot run here: {done.stderr[-300:]}")
    assert done.returncode == 0 and "failed 0" in done.stdout, done.stdout + done.stderr[-4000:]

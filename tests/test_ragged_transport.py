"""The ragged transport's offsets, checked on CPU.

XLA:CPU has no ragged-all-to-all, so these tests swap in an emulation of
`jax.lax.ragged_all_to_all` built from `all_gather` that follows the documented semantics
(`output_offsets` index the *receiver's* output), and require the "ragged" transport to give
exactly the padded all_to_all transport's results. The real collective runs in tests/gpu
only on a machine with two or more GPUs (one GPU is one rank, where no transport collects).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import AXIS, ep_mesh, low_latency_round_trip, random_routing, run_ep

import jax_ep
from jax_ep import hybridep, transport


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    del recv_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    ops_all = jax.lax.all_gather(operand, axis_name)  # [P, S, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    rows = jnp.arange(output.shape[0])
    result = output
    for q in range(ops_all.shape[0]):
        inside = (rows >= out_off[q]) & (rows < out_off[q] + sizes[q])
        src = jnp.clip(in_off[q] + rows - out_off[q], 0, operand.shape[0] - 1)
        mask = inside.reshape((-1,) + (1,) * (operand.ndim - 1))
        result = jnp.where(mask, ops_all[q][src], result)
    return result


@pytest.fixture
def ragged(monkeypatch):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    real = transport.resolve_transport
    monkeypatch.setattr(transport, "resolve_transport",
                        lambda t, no_peer=None: "ragged" if t == "ragged" else real(t, no_peer))


@pytest.mark.parametrize("num_ranks,capacity,num_worst", [(4, None, None), (8, None, None),
                                                          (4, 3, None), (4, None, 9)])
def test_deepep_ragged_equals_all_to_all(ragged, num_ranks, capacity, num_worst):
    T, H, K, E = 6, 8, 3, 16
    rng = np.random.default_rng(num_ranks)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)

    def body(t):
        def f(x, i, w):
            rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                            transport=t, capacity=capacity,
                                            num_worst_tokens=num_worst)
            y, cw = jax_ep.combine(rx * 2, h, topk_weights=rw)
            grad = jax.grad(lambda x: jnp.sum(jax_ep.combine(
                jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, transport=t,
                                capacity=capacity, num_worst_tokens=num_worst)[0] ** 2,
                h)[0]))(x)
            return rx, ri, rw, y, cw, grad, h.num_dropped[None]
        return f

    mesh = ep_mesh(num_ranks)
    a = run_ep(body("ragged"), mesh, x, idx, w)
    b = run_ep(body("all_to_all"), mesh, x, idx, w)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    if capacity or num_worst:  # the bounded cases really drop rows
        assert np.asarray(a[-1]).sum() > 0


@pytest.mark.parametrize("compact", [False, True])
def test_hybridep_ragged_equals_all_to_all(ragged, compact):
    num_ranks, T, H, K, E, N = 4, 5, 8, 2, 8, 32
    rng = np.random.default_rng(11)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    if not compact:
        dense = np.zeros((num_ranks * T, E), np.float32)
        np.put_along_axis(dense, np.where(idx >= 0, idx, 0), np.where(idx >= 0, w, 0), axis=1)
        idx, w = dense > 0, dense

    def body(t):
        def f(x, i, w):
            routing = dict(topk_idx=i) if compact else dict(routing_map=i)
            px, pp, tpe, h = hybridep.hybridep_dispatch(
                x, probs=w, num_experts=E, axis_name=AXIS, num_permuted_tokens=N, transport=t,
                **routing)
            return px, pp, tpe, hybridep.hybridep_combine(px * 3, h)
        return f

    mesh = ep_mesh(num_ranks)
    for u, v in zip(run_ep(body("ragged"), mesh, x, idx, w),
                    run_ep(body("all_to_all"), mesh, x, idx, w)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_ragged_is_refused_on_cpu():
    with pytest.raises(ValueError, match="ragged"):
        transport.resolve_transport("ragged")


def test_auto_follows_the_mesh_devices_not_the_default_backend(monkeypatch):
    # On a GPU host (default backend patched to "gpu"), "auto" inside shard_map over CPU
    # devices must still pick a CPU transport (peer: every device is in this process; never
    # ragged, which XLA:CPU lacks); where no mesh says (vmap, outside shard_map) it follows
    # the default backend.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    seen = {}

    def f(x):
        seen["shard_map"] = transport.resolve_transport("auto")
        with pytest.raises(ValueError, match="ragged"):
            transport.resolve_transport("ragged")
        return x

    run_ep(f, ep_mesh(4), np.zeros((8, 2), np.float32))

    def g(x):
        seen["vmap"] = transport.resolve_transport("auto")
        return x

    jax.vmap(g, axis_name=AXIS)(jnp.zeros((4, 2)))
    assert seen == {"shard_map": "peer", "vmap": "ragged"}


@pytest.mark.parametrize("num_ranks,T,tmax,K,E,fp8", [(4, 5, 6, 3, 16, False),
                                                       (4, 6, 6, 2, 8, True)])
def test_low_latency_ragged_equals_all_to_all(ragged, num_ranks, T, tmax, K, E, fp8):
    # The ragged wire sends only the used rows of each block into the same receive slots.
    H = 128
    rng = np.random.default_rng(num_ranks + T)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    kw = dict(use_fp8=True, fp8_output="cast_back") if fp8 else {}

    def body(t):
        def f(x, i, w):
            loss = low_latency_round_trip(i, tmax=tmax, num_experts=E, transport=t, **kw)
            (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            return aux + grads
        return f

    mesh = ep_mesh(num_ranks)
    a = run_ep(body("ragged"), mesh, x, idx, w)
    b = run_ep(body("all_to_all"), mesh, x, idx, w)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    assert np.abs(np.asarray(a[-2], np.float32)).sum() > 0

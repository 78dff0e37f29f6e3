"""The EP modes and the MoE layer on the GPU (CUDA handlers end to end), one rank per GPU.

With one GPU the expert axis has P = 1 (collective-free); with more, the "auto" transport is
"peer" (every rank in this process: xla_ffi/peer.cu), checked against the padded all_to_all
transport bit for bit. On one GPU,
P = 4 and 8 ranks are also emulated with jax.vmap over the expert axis (all_to_all only:
ragged_all_to_all has no batching rule) and checked against the CPU handlers. The experts'
grouped GEMM: impl="tiled", "blocks" and XLA:GPU's ragged_dot (what impl="auto" picks there for
at most 8 groups; "tiled" beyond) against a float64 model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import _ffi  # noqa: E402

# Under the CUDA emulator (JAX_EP_USE_CUDA_EMU=1) the CUDA handlers run on the CPU devices,
# one rank per device; the CPU handlers they are compared with are traced with the native ones.
EMULATED = _ffi.handlers() == "cuda_emu"
if jax.devices()[0].platform != "gpu" and not EMULATED:
    pytest.skip("needs a GPU, or the emulated CUDA handlers (JAX_EP_USE_CUDA_EMU=1)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ep_utils import (  # noqa: E402
    AXIS,
    assert_param_grads_close,
    dense_moe,
    ep_mesh,
    layer_vs_dense,
    local_experts,
    owner_count,
    random_routing,
    run_ep,
)

import jax_ep  # noqa: E402
from jax_ep import hybridep, ops  # noqa: E402
from jax_ep import transport as tp  # noqa: E402

NUM_RANKS = len(jax.devices())


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """fp32 matmuls in full fp32: by default XLA:GPU runs them in TF32 on Hopper (10-bit
    mantissas), far outside the 2e-4 the dense comparisons below allow."""
    with jax.default_matmul_precision("highest"):
        yield


def test_deepep_ffi_equals_alltoall_and_dense_on_gpu():
    T, H, F, K, E = 64, 128, 64, 4, 8 * NUM_RANKS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_RANKS * T, H)).astype(np.float32)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)
    w_in = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    w_out = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)

    def body(backend, transport):
        def f(x, i, w, a, b):
            rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                            backend=backend, transport=transport)
            return rx, ri, jax_ep.combine(local_experts(rx, ri, rw, a, b), h)[0]
        return f

    mesh = ep_mesh(NUM_RANKS)
    auto = run_ep(body("deepep", "auto"), mesh, x, idx, w, w_in, w_out)
    padded = run_ep(body("alltoall", "all_to_all"), mesh, x, idx, w, w_in, w_out)
    for a, b in zip(auto[:2], padded[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(auto[2]), dense_moe(x, idx, w, w_in, w_out),
                               rtol=2e-4, atol=2e-4)


def test_auto_transport_picks_peer_in_one_process():
    """transport="auto" resolves, when the dispatch is traced, to "peer" (every rank in this
    process, on the GPUs or on the CPU devices of the emulated run); the step runs and equals
    the resolved transport's, bit for bit."""
    T, H, K, E = 32, 128, 2, 4 * NUM_RANKS
    rng = np.random.default_rng(5)
    x = rng.standard_normal((NUM_RANKS * T, H)).astype(np.float32)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)
    resolved = []

    def body(transport):
        def f(x, i, w):
            resolved.append(tp.resolve_transport(transport))
            rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                          transport=transport)
            return rx, jax_ep.combine(rx, h)[0]
        return f

    mesh = ep_mesh(NUM_RANKS)
    auto = run_ep(body("auto"), mesh, x, idx, w)
    want = "peer"
    assert resolved == [want]
    for a, b in zip(auto, run_ep(body(want), mesh, x, idx, w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_small_receive_budget_on_gpu():
    # num_worst_tokens below the worst case: the FFI backend drops and counts exactly like the
    # XLA-only one (sources fill the budget in rank order, highest token indices dropped).
    T, H, K, E, R = 64, 128, 2, 4 * NUM_RANKS, 40
    rng = np.random.default_rng(2)
    x = rng.standard_normal((NUM_RANKS * T, H)).astype(np.float32)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E, unrouted=0.0)

    def body(backend):
        def f(x, i, w):
            rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                            backend=backend, num_worst_tokens=R)
            return rx, ri, rw, jax_ep.combine(rx, h)[0], h.num_dropped[None]
        return f

    mesh = ep_mesh(NUM_RANKS)
    ffi = run_ep(body("deepep"), mesh, x, idx, w)
    xla = run_ep(body("alltoall"), mesh, x, idx, w)
    for a, b in zip(ffi, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(ffi[-1]).sum() > 0


def test_combine_of_dispatch_bf16_on_gpu():
    T, H, K, E = 128, 256, 8, 16 * NUM_RANKS
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E)

    def f(x, i, w):
        rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS)
        return jax_ep.combine(rx, h)[0]

    y = np.asarray(run_ep(f, ep_mesh(NUM_RANKS), x, idx, w), np.float32)
    want = np.asarray(x, np.float32) * owner_count(idx, E // NUM_RANKS)[:, None]
    np.testing.assert_allclose(y, want, rtol=1e-2, atol=1e-2)


def test_hybridep_and_low_latency_on_gpu():
    T, H, K, E = 32, 256, 4, 8 * NUM_RANKS
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E, unrouted=0.0)

    def f(x, i, w):
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, topk_idx=i, probs=w, num_experts=E,
                                                    axis_name=AXIS,
                                                    num_permuted_tokens=NUM_RANKS * T * K)
        (q, s), count, lh = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=T, num_experts=E, axis_name=AXIS,
            use_fp8=True, round_scale=True, use_ue8m0=True)
        deq = ops.per_token_cast_back(q.reshape(-1, H), s.reshape(q.shape[0] * q.shape[1], -1),
                                      use_ue8m0=True).reshape(q.shape)
        return hybridep.hybridep_combine(px, h), jax_ep.low_latency_combine(deq, i, w, lh)

    copies, weighted = run_ep(f, ep_mesh(NUM_RANKS), x, idx, w)
    x32 = np.asarray(x, np.float32)
    np.testing.assert_allclose(np.asarray(copies, np.float32), x32 * K, rtol=1e-2, atol=1e-2)
    want = x32 * w.sum(1)[:, None]
    got = np.asarray(weighted, np.float32)
    diff = 1 - 2 * (got * want).sum() / ((got * got).sum() + (want * want).sum())
    assert diff < 9e-4


def test_low_latency_logfmt_combine_on_gpu():
    """use_logfmt=True through the CUDA LogFMT handlers and this platform's transport: equal to
    the combine of the rows' LogFMT round trip, and within DeepEP's calc_diff < 1e-5."""
    T, H, K, E = 16, 1024, 4, 8 * NUM_RANKS
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((NUM_RANKS * T, H)) * 0.1, jnp.bfloat16)
    idx, w = random_routing(rng, NUM_RANKS * T, K, E, unrouted=0.0)

    def f(x, i, w):
        recv, _, h = jax_ep.low_latency_dispatch(x, i, num_max_dispatch_tokens_per_rank=T,
                                                 num_experts=E, axis_name=AXIS)
        trip = ops.logfmt_decode(ops.logfmt_encode(recv.reshape(-1, H))).reshape(recv.shape)
        return (jax_ep.low_latency_combine(recv, i, w, h, use_logfmt=True),
                jax_ep.low_latency_combine(trip, i, w, h).astype(jnp.bfloat16))

    got, want = (np.asarray(a, np.float32) for a in run_ep(f, ep_mesh(NUM_RANKS), x, idx, w))
    np.testing.assert_array_equal(got, want)
    ref = np.asarray(x, np.float32) * w.sum(1)[:, None] + 1
    diff = 1 - 2 * ((got + 1) * ref).sum() / (((got + 1) ** 2).sum() + (ref * ref).sum())
    assert 0 < diff < 1e-5

def test_moe_layer_trains_on_gpu():
    """The MoE layer on the device's handlers: its loss sum(y * cot) + aux and every parameter
    gradient against the dense single-device forward, then one SGD step lowers the loss."""
    from flax import nnx

    from jax_ep.flax import MoELayer, shard_params

    mesh = jax.make_mesh((1, NUM_RANKS), ("data", "expert"))
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8 * NUM_RANKS, moe_router_topk=2,
                                       moe_permute_fusion=True)
    layer = MoELayer(cfg, 128, 256, rngs=nnx.Rngs(0), mesh=mesh)
    twin = MoELayer(cfg, 128, 256, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(0), (4 * NUM_RANKS, 32, 128))
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x,
                                                       ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=2e-4)
    assert int(aux["num_dropped"]) == 0
    assert_param_grads_close(grads, want_grads, rtol=1e-3, atol=1e-4)
    params = nnx.state(layer, nnx.Param)
    nnx.update(layer, jax.tree.map(lambda p, g: p - 1e-3 * g, params,
                                   nnx.state(grads, nnx.Param)))
    stepped = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))[0]
    assert stepped < got - 1e-4 * abs(got), (got, stepped)


@pytest.mark.skipif(EMULATED, reason="no CUDA code: on the CPU devices this is "
                    "tests/test_grouped_matmul.py")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_sizes", [[130, 0, 257, 64, 0, 1, 300, 200],
                                         [120, 0, 125, 110, 0, 1, 124, 100]])
def test_grouped_matmul_tiled_blocks_and_ragged_dot_on_gpu(group_sizes, dtype):
    """impl="tiled" (a while loop over row tiles), "blocks" and XLA:GPU's ragged_dot against a
    float64 numpy model from the same rounded inputs: y = x_g w_g, dx = dy_g w_g^T, dw[g] =
    x_g^T dy_g for a fixed cotangent dy, with empty groups, a one-row group and rows past the
    groups (zero in y and dx). "blocks" over N = 1000 rows in G = 8 groups has blocks of up to
    125 rows: the second sizes run as [8, 125, H] blocks, the first (a group of 300) take its
    tiled fallback. The tolerance is the output dtype's rounding, relative to the output's
    scale; impl="auto" is ragged_dot for these 8 groups and the tiled loop for 16 (XLA:GPU
    expands ragged_dot to a dense dot over every group)."""
    N, H, F = 1000, 256, 128
    end = sum(group_sizes)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((N, H)), dtype)
    w = jnp.asarray(rng.standard_normal((sizes.shape[0], H, F)) / np.sqrt(H), dtype)
    dy = jnp.asarray(rng.standard_normal((N, F)), dtype)

    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    want = [np.zeros((N, F)), np.zeros((N, H)), np.zeros_like(w64)]
    start = 0
    for g, n in enumerate(group_sizes):
        rows = slice(start, start + n)
        want[0][rows] = x64[rows] @ w64[g]
        want[1][rows] = dy64[rows] @ w64[g].T
        want[2][g] = x64[rows].T @ dy64[rows]
        start += n

    # fp32 accumulation, then the output dtype's rounding; fp32 dots at full precision (XLA:GPU
    # may use TF32 for them by default).
    rel = 1e-5 if dtype == jnp.float32 else 1e-2
    for impl in ("tiled", "blocks", "ragged_dot"):
        def value_and_vjp(x, w, impl=impl):
            y, pullback = jax.vjp(lambda x, w: ops.grouped_matmul(x, w, sizes, impl=impl), x, w)
            return (y, *pullback(dy))
        with jax.default_matmul_precision("highest"):
            got = jax.jit(value_and_vjp)(x, w)
        for name, g, ref in zip(("y", "dx", "dw"), got, want):
            err = np.abs(np.asarray(g, np.float64) - ref).max() / np.abs(ref).max()
            assert err <= rel, f"{impl} {name}: max error {err:.2e} of max |ref|, over {rel}"
        assert not np.asarray(got[0][end:], np.float32).any(), impl
    auto = str(jax.make_jaxpr(lambda x, w: ops.grouped_matmul(x, w, sizes))(x, w))
    assert "ragged_dot_general" in auto and "while" not in auto
    sizes16 = jnp.concatenate([sizes, jnp.zeros_like(sizes)])
    auto16 = str(jax.make_jaxpr(lambda x, w: ops.grouped_matmul(x, w, sizes16))(
        x, jnp.concatenate([w, w])))
    assert "ragged_dot_general" not in auto16 and "while" in auto16


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_multi_rank_modes_emulated_by_vmap_on_one_gpu(num_ranks):
    # One GPU cannot hold P > 1 JAX devices, so P ranks are emulated by jax.vmap over the
    # expert axis (all_to_all batches; ragged_all_to_all does not): the CUDA handlers then run
    # real multi-rank layouts, and must equal shard_map over P CPU devices (the CPU handlers)
    # bit for bit where the contract is bitwise, and to fp32 rounding in the sums.
    T, H, K, E = 32, 128, 4, 4 * num_ranks
    rng = np.random.default_rng(num_ranks)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)

    def f(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS,
                                        transport="all_to_all")
        y, yw = jax_ep.combine(rx, h, topk_weights=rw)
        px, pp, tpe, hh = hybridep.hybridep_dispatch(
            x, topk_idx=i, probs=w, num_experts=E, axis_name=AXIS,
            num_permuted_tokens=num_ranks * T * K, transport="all_to_all")
        (q, s), count, lh = jax_ep.low_latency_dispatch(
            x, i, num_max_dispatch_tokens_per_rank=T, num_experts=E, axis_name=AXIS,
            use_fp8=True, transport="all_to_all")
        deq = ops.per_token_cast_back(q.reshape(-1, H), s.reshape(q.shape[0] * q.shape[1], -1),
                                      dtype=jnp.float32).reshape(q.shape)
        ll = jax_ep.low_latency_combine(deq, i, w, lh)
        exact = (rx, ri, rw, h.num_recv_tokens[None], px, pp, tpe, q, s, count)
        summed = (y, yw, hybridep.hybridep_combine(px, hh), ll)
        return exact, summed

    def ranks(a):
        return jnp.reshape(a, (num_ranks, -1) + a.shape[1:])

    gpu = jax.jit(jax.vmap(f, axis_name=AXIS))(*jax.device_put(
        (ranks(x), ranks(jnp.asarray(idx)), ranks(jnp.asarray(w))), jax.devices()[0]))
    cpu_mesh = jax.make_mesh((num_ranks,), (AXIS,), devices=jax.devices("cpu")[:num_ranks])
    with _ffi.use_handlers("native"):
        cpu = run_ep(f, cpu_mesh, x, idx, w)
    gpu_exact, gpu_summed = jax.tree.map(
        lambda a: np.asarray(a).reshape((-1,) + a.shape[2:]), gpu)
    for got, want in zip(gpu_exact, cpu[0]):
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))
    for got, want in zip(gpu_summed, cpu[1]):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-5, atol=1e-6)

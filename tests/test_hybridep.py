"""HybridEP mode: dispatch fused with the expert permutation, on emulated CPU ranks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import (AXIS, dense_moe, dense_routing, ep_mesh, hybridep_oracle, random_routing,
                      run_ep, shard)
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import hybridep, reference


def _run(mesh, x, idx, w, num_experts, num_permuted, pad_multiple, compact, backend="deepep"):
    rm, pr = dense_routing(idx, w, num_experts)

    def body(x, a, b):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)
        px, pp, tpe, h = hybridep.hybridep_dispatch(
            x, probs=b, num_experts=num_experts, axis_name=AXIS,
            num_permuted_tokens=num_permuted, pad_multiple=pad_multiple, backend=backend, **kw)
        return px, pp, tpe, h.num_dropped[None], hybridep.hybridep_combine(px, h)

    args = (x, idx, w) if compact else (x, rm, pr)
    return [np.asarray(a) for a in run_ep(body, mesh, *args)]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("num_ranks,T,num_permuted,pad", [
    (4, 6, 40, None), (4, 6, 40, 4), (8, 3, 24, 2), (1, 5, 16, None), (4, 6, 7, 2)])
def test_matches_allgather_oracle(num_ranks, T, num_permuted, pad, compact):
    K, H, E = 3, 8, 16
    rng = np.random.default_rng(T * num_ranks + (pad or 0))
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rm, pr = dense_routing(idx, w, E)
    px, pp, tpe, dropped, _ = _run(ep_mesh(num_ranks), x, idx, w, E, num_permuted, pad, compact)
    want = hybridep_oracle(x, rm, pr, num_ranks, num_permuted, pad)
    L = E // num_ranks
    for d, (wx, wp, wt, wd) in enumerate(want):
        np.testing.assert_array_equal(px[d * num_permuted:(d + 1) * num_permuted], wx)
        np.testing.assert_array_equal(pp[d * num_permuted:(d + 1) * num_permuted], wp)
        np.testing.assert_array_equal(tpe[d * L:(d + 1) * L], wt)
        assert dropped[d] == wd


@pytest.mark.parametrize("num_permuted", [40, None])
def test_pad_multiple_zero_is_no_padding_as_hybridep(num_permuted):
    num_ranks, T, K, H, E = 4, 6, 3, 8, 16
    rng = np.random.default_rng(11)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    mesh = ep_mesh(num_ranks)
    for got, want in zip(_run(mesh, x, idx, w, E, num_permuted, 0, compact=True),
                         _run(mesh, x, idx, w, E, num_permuted, None, compact=True)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="pad_multiple: expected an int >= 0, got -1"):
        _run(mesh, x, idx, w, E, num_permuted, -1, compact=True)


@pytest.mark.parametrize("compact", [False, True])
def test_a_pre_cast_fp8_pair_travels_as_the_fp8_wire_does(compact):
    """HybridEP's FP8 hidden with its scaling_factor: x = (x_fp8, scales) cast beforehand
    gives the pair use_fp8=True gives from x, bitwise, and the same probs and counts."""
    num_ranks, T, K, H, E, N = 4, 6, 3, 256, 16, 48
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rm, pr = dense_routing(idx, w, E)
    route = (idx, w) if compact else (rm, pr)

    def body(x, a, b):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)
        common = dict(probs=b, num_experts=E, axis_name=AXIS, num_permuted_tokens=N,
                      pad_multiple=4, **kw)
        wire, wp, wt, _ = hybridep.hybridep_dispatch(x, use_fp8=True, **common)
        pair, pp, pt, _ = hybridep.hybridep_dispatch(jax_ep.ops.per_token_cast_to_fp8(x),
                                                     **common)
        return (*wire, wp, wt, *pair, pp, pt)

    out = [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, *route)]
    assert out[0].dtype == jnp.float8_e4m3fn and out[1].shape == (num_ranks * N, H // 128)
    for got, want in zip(out[4:], out[:4]):
        np.testing.assert_array_equal(got.view(np.uint8) if got.dtype == jnp.float8_e4m3fn
                                      else got, want.view(np.uint8)
                                      if want.dtype == jnp.float8_e4m3fn else want)
    # gradients through every array of the tuple (T = 6 is padded to 8 rows inside): those of
    # each array dispatched alone
    x2 = jnp.asarray(rng.standard_normal((num_ranks * T, 3)), jnp.float32)

    def grads(x, x2, a, b):
        def loss(x, x2, together):
            kw = dict(topk_idx=a, probs=b, num_experts=E, axis_name=AXIS)
            if together:
                (px, px2), *_ = hybridep.hybridep_dispatch((x, x2), **kw)
            else:
                px, px2 = (hybridep.hybridep_dispatch(v, **kw)[0] for v in (x, x2))
            return jnp.sum(jnp.sin(px)) + jnp.sum(px2 * px2)
        return (*jax.grad(loss, (0, 1))(x, x2, True), *jax.grad(loss, (0, 1))(x, x2, False))

    together_x, together_x2, alone_x, alone_x2 = run_ep(
        grads, ep_mesh(num_ranks), x.astype(jnp.float32), x2, idx, w)
    np.testing.assert_array_equal(np.asarray(together_x), np.asarray(alone_x))
    np.testing.assert_array_equal(np.asarray(together_x2), np.asarray(alone_x2))
    np.testing.assert_allclose(np.asarray(together_x2), 2 * np.asarray(x2) * (
        np.asarray(idx) >= 0).sum(1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="^use_fp8: x is a tuple"):
        run_ep(lambda x, a, b: hybridep.hybridep_dispatch(
            (x, x), topk_idx=a, probs=b, num_experts=E, axis_name=AXIS, use_fp8=True)[1],
            ep_mesh(num_ranks), x, idx, w)
    with pytest.raises(ValueError, match=r"^x\[1\]: expected 6 rows"):
        run_ep(lambda x, a, b: hybridep.hybridep_dispatch(
            (x, x[:3]), topk_idx=a, probs=b, num_experts=E, axis_name=AXIS)[1],
            ep_mesh(num_ranks), x, idx, w)


def test_dense_and_compact_routing_agree_and_backends_agree():
    num_ranks, T, K, H, E, N = 8, 5, 4, 16, 32, 48
    rng = np.random.default_rng(3)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    mesh = ep_mesh(num_ranks)
    dense = _run(mesh, x, idx, w, E, N, 4, compact=False)
    compact = _run(mesh, x, idx, w, E, N, 4, compact=True)
    xla = _run(mesh, x, idx, w, E, N, 4, compact=True, backend="alltoall")
    for a, b, c in zip(dense[:4], compact[:4], xla[:4]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(dense[4], compact[4], rtol=1e-6)


@pytest.mark.parametrize("compact", [False, True])
def test_without_probs_rows_and_gradients_are_those_with_probs(compact):
    """probs=None (HybridEP accepts it): the same permuted rows, block sizes and drops as with
    probs, permuted_probs None, and the round trip differentiable in x."""
    num_ranks, T, K, H, E, N = 4, 6, 3, 8, 16, 4 * 6 * 3
    rng = np.random.default_rng(9)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rm, _ = dense_routing(idx, w, E)
    routing = idx if compact else rm

    def body(x, a):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, num_experts=E, axis_name=AXIS,
                                                    num_permuted_tokens=N, **kw)
        assert pp is None
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(hybridep.hybridep_combine(
            hybridep.hybridep_dispatch(x, num_experts=E, axis_name=AXIS,
                                       num_permuted_tokens=N, **kw)[0], h))))(x)
        return px, tpe, h.num_dropped[None], hybridep.hybridep_combine(px, h), grad

    px, tpe, dropped, out, grad = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, routing))
    want = _run(ep_mesh(num_ranks), x, idx, w, E, N, None, compact)
    np.testing.assert_array_equal(px, want[0])
    np.testing.assert_array_equal(tpe, want[2])
    np.testing.assert_array_equal(dropped, want[3])
    np.testing.assert_array_equal(out, want[4])
    # Nothing dropped (N is the worst case): each token comes back once per routed expert, c
    # times, so the gradient of sum(sin(c x)) is c cos(c x).
    assert not dropped.any()
    c = (idx >= 0).sum(1, keepdims=True).astype(np.float32)
    np.testing.assert_allclose(out, c * x, rtol=1e-6)
    np.testing.assert_allclose(grad, c * np.cos(c * x), rtol=1e-5, atol=1e-6)


def test_identity_experts_combine_scales_by_copy_count():
    num_ranks, T, K, H, E = 4, 6, 4, 8, 16
    rng = np.random.default_rng(4)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    out = _run(ep_mesh(num_ranks), x, idx, w, E, 4 * T * K, None, compact=True)[4]
    np.testing.assert_allclose(out / K, x, rtol=1e-6)


@pytest.mark.parametrize("compact", [False, True])
def test_gradients_match_dense_reference(compact):
    num_ranks, T, K, H, E = 4, 5, 2, 8, 8  # T=5 is equalised to 8 rows
    rng = np.random.default_rng(5)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rm, pr = dense_routing(idx, w, E)
    scale = rng.standard_normal((E, H)).astype(np.float32)  # expert e: y = x * scale[e]
    cot = rng.standard_normal(x.shape).astype(np.float32)
    mesh = ep_mesh(num_ranks)
    L = E // num_ranks
    N = 4 * T * K

    def body(x, a, b, scale):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, probs=b, num_experts=E, axis_name=AXIS,
                                                    num_permuted_tokens=N, **kw)
        row_scale = jnp.take(scale, jnp.clip(h.row_expert, 0, L - 1), axis=0)
        return hybridep.hybridep_combine(px * row_scale * pp[:, None], h)

    moe = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=P(AXIS))
    route = (idx, w) if compact else (rm, pr)

    def ep_loss(x, probs, scale, routing):
        return jnp.sum(moe(x, routing, probs, scale) * cot)

    def dense_loss(x, probs, scale):
        if compact:
            dense_p = reference.indices_to_multihot(jnp.asarray(idx), probs, num_experts=E)[1]
        else:
            dense_p = probs * rm  # unrouted (token, expert) pairs carry no probability
        return jnp.sum(jnp.einsum("te,eh,th->th", dense_p, scale, x) * cot)

    args = shard(mesh, x, route[1], scale, route[0])
    got = jax.jit(jax.grad(ep_loss, argnums=(0, 1, 2)))(*args)
    want = jax.grad(dense_loss, argnums=(0, 1, 2))(x, route[1], scale)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5)


def test_padding_rows_keep_routing_and_gradients():
    """hidden.grad == weights and probs.grad == (hidden * weights).sum(-1) broadcast, with
    T=3 equalised to 4 rows (padding rows must not leak into either)."""
    num_ranks, T, H, E = 2, 3, 4, 4
    hidden = np.random.default_rng(6).standard_normal((num_ranks * T, H)).astype(np.float32)
    weights = np.random.default_rng(7).standard_normal((num_ranks * T, H)).astype(np.float32)
    routing_map = np.zeros((num_ranks * T, E), bool)
    routing_map[:, 1] = True  # every token to expert 1 (rank 0)
    probs = np.where(routing_map, 0.5, 0.0).astype(np.float32)
    mesh = ep_mesh(num_ranks)

    def body(h, p, rm, wt):
        px, pp, _, hd = hybridep.hybridep_dispatch(h, routing_map=rm, probs=p, num_experts=E,
                                                   axis_name=AXIS, num_permuted_tokens=16)
        return hybridep.hybridep_combine(px * pp[:, None], hd) * wt

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 4, out_specs=P(AXIS))
    args = shard(mesh, hidden, probs, routing_map, weights)
    g_h, g_p = jax.jit(jax.grad(lambda h, p, rm, wt: f(h, p, rm, wt).sum(), argnums=(0, 1)))(
        *args)
    np.testing.assert_allclose(np.asarray(g_h), weights * 0.5, rtol=1e-6)
    want_p = np.zeros_like(probs)
    want_p[:, 1] = (hidden * weights).sum(-1)
    np.testing.assert_allclose(np.asarray(g_p), want_p, rtol=1e-5)


@pytest.mark.parametrize("local,group_max,want", [(3, 5, 8), (6, None, 8), (4, None, 4),
                                                  (1, 1, 4), (8, 3, 8)])
def test_equalized_token_counts(local, group_max, want):
    assert hybridep.equalized_num_tokens(local, group_max) == want


@pytest.mark.parametrize("n,chunk,want", [(1, 64, 512), (512, 64, 512), (513, 64, 576),
                                          (513, 128, 640), (0, 64, 512)])
def test_required_capacity(n, chunk, want):
    assert hybridep.required_capacity(n, chunk) == want
    assert jax_ep.required_capacity(n, chunk) == want  # contract: available at the top level


@pytest.fixture
def hybridep_runtime():
    """NeMo's tests reset the process-global HybridEP runtime around each test."""
    from jax_ep.flax import reset_hybrid_ep_buffer
    reset_hybrid_ep_buffer()
    yield
    reset_hybrid_ep_buffer()


def test_pipeline_runtime_initializer_keeps_nemos_calls(monkeypatch, hybridep_runtime):
    """NeMo's HybridEPPipelineRuntimeInitializer: HybridEP's capacity rule (the combine chunk
    from HybridEP's environment variable), prepare() checking its argument and recording the
    largest capacity, resource_key shared and signature by configuration; the dispatcher
    returns one for hybridep only."""
    from jax_ep.flax import HybridEPPipelineRuntimeInitializer, MoEFlexTokenDispatcher
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_flex_dispatcher_backend="hybridep")
    dispatcher = MoEFlexTokenDispatcher(2, [0, 1], cfg)
    (initializer,) = dispatcher.get_pipeline_runtime_initializers(16, jnp.bfloat16)
    assert isinstance(initializer, HybridEPPipelineRuntimeInitializer)
    assert [initializer.required_capacity(n) for n in (1, 512, 513)] == [512, 512, 576]
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "128")
    assert initializer.required_capacity(513) == 640
    assert initializer._resolve_group_capacity(513, None) == 640
    for bad in ("64k", "0"):  # int("64k") named nothing before
        monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", bad)
        with pytest.raises(ValueError, match="^NUM_OF_TOKENS_PER_CHUNK_COMBINE_API: expected"):
            initializer.required_capacity(513)
    monkeypatch.delenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API")
    assert initializer.capacity == 0
    initializer.prepare(num_tokens=513)
    initializer.prepare(num_tokens=32)
    assert initializer.capacity == 576
    with pytest.raises(ValueError, match="num_tokens"):
        initializer.prepare(num_tokens=0)
    other = HybridEPPipelineRuntimeInitializer(
        MoEFlexTokenDispatcher(2, [0, 1], dataclasses.replace(cfg, num_moe_experts=16)), 16,
        jnp.bfloat16)
    assert other.resource_key == initializer.resource_key
    assert other.signature != initializer.signature
    assert HybridEPPipelineRuntimeInitializer(dispatcher, 16, jnp.bfloat16).signature == \
        initializer.signature
    deepep = MoEFlexTokenDispatcher(2, [0, 1], dataclasses.replace(
        cfg, moe_flex_dispatcher_backend="deepep"))
    assert deepep.get_pipeline_runtime_initializers(16, jnp.bfloat16) == ()


def test_pipeline_runtime_is_process_global(hybridep_runtime):
    """NeMo's runtime tests: the capacity is the process's, grown by any initializer of the
    same signature; another signature (other experts, or a dispatcher whose HybridEP settings
    changed after a prepare) raises RuntimeError until reset_hybrid_ep_buffer()."""
    from jax_ep.flax import (HybridEPPipelineRuntimeInitializer, MoEFlexTokenDispatcher,
                             reset_hybrid_ep_buffer)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_flex_dispatcher_backend="hybridep")

    def initializer(config):
        return HybridEPPipelineRuntimeInitializer(
            MoEFlexTokenDispatcher(2, [0, 1], config), 16, jnp.bfloat16)

    first, second = initializer(cfg), initializer(cfg)
    assert first.signature == second.signature
    for who, tokens, want in [(first, 160, 512), (second, 320, 512), (second, 513, 576),
                              (first, 32, 576)]:
        who.prepare(num_tokens=tokens)
        assert first.capacity == second.capacity == want
    incompatible = initializer(dataclasses.replace(cfg, num_moe_experts=16))
    with pytest.raises(RuntimeError, match="process-global buffer"):
        incompatible.prepare(num_tokens=160)
    assert first.capacity == 576  # the failed prepare changed nothing
    for setting, value in [("moe_hybridep_permute_fusion", True),
                           ("moe_hybridep_compact_routing", True),
                           ("moe_hybridep_num_sms_preprocessing", 12),
                           ("moe_hybridep_num_blocks_permute", 16),
                           ("moe_hybridep_num_blocks_unpermute", 16)]:
        changed = initializer(cfg)
        changed.manager.config = dataclasses.replace(cfg, **{setting: value})
        with pytest.raises(RuntimeError, match="process-global buffer"):
            changed.prepare(num_tokens=160)
    reset_hybrid_ep_buffer()
    assert first.capacity == 0
    incompatible.prepare(num_tokens=32)
    assert incompatible.capacity == 512
    with pytest.raises(RuntimeError, match="reset_hybrid_ep_buffer"):
        first.prepare(num_tokens=32)


def test_pipeline_runtime_prepares_atomically(hybridep_runtime, monkeypatch):
    """Two threads preparing different signatures at once (pipeline stages): exactly one is
    served, the other raises. The record's read is slowed so that, without the lock, both
    would read "nothing served" and both succeed."""
    import threading
    import time
    from jax_ep.flax import HybridEPPipelineRuntimeInitializer, MoEFlexTokenDispatcher
    from jax_ep.flax import dispatcher as dispatcher_module

    class SlowRecord(dict):
        def __getitem__(self, key):
            value = super().__getitem__(key)
            time.sleep(0.05)
            return value
    record = SlowRecord(dispatcher_module._HYBRIDEP_RUNTIME)
    monkeypatch.setattr(dispatcher_module, "_HYBRIDEP_RUNTIME", record)
    initializers = [HybridEPPipelineRuntimeInitializer(MoEFlexTokenDispatcher(
        2, [0, 1], jax_ep.TokenDispatcherConfig(num_moe_experts=experts,
                                                moe_flex_dispatcher_backend="hybridep")),
        16, jnp.bfloat16) for experts in (8, 16)]
    start, outcomes = threading.Barrier(2), {}

    def prepare(i):
        start.wait()
        try:
            initializers[i].prepare(num_tokens=160)
            outcomes[i] = "served"
        except RuntimeError as err:
            outcomes[i] = str(err)
    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [i for i in range(2) if outcomes[i] == "served"]
    assert len(served) == 1, outcomes
    assert "process-global buffer" in outcomes[1 - served[0]]
    assert dict.__getitem__(record, "signature") == initializers[served[0]].signature


def test_bad_inputs():
    mesh = ep_mesh(2)
    x = np.zeros((8, 8), np.float32)
    idx = np.zeros((8, 2), np.int32)
    w = np.ones((8, 2), np.float32)
    with pytest.raises(ValueError, match="routing_map / topk_idx"):
        run_ep(lambda x, w: hybridep.hybridep_dispatch(
            x, probs=w, num_experts=4, axis_name=AXIS, num_permuted_tokens=8)[0], mesh, x, w)
    with pytest.raises(ValueError, match="routing_map / topk_idx"):
        run_ep(lambda x, i, w: hybridep.hybridep_dispatch(
            x, topk_idx=i, routing_map=i, probs=w, num_experts=4, axis_name=AXIS,
            num_permuted_tokens=8)[0], mesh, x, idx, w)
    with pytest.raises(ValueError, match="probs"):
        run_ep(lambda x, i, w: hybridep.hybridep_dispatch(
            x, topk_idx=i, probs=w[:, :1], num_experts=4, axis_name=AXIS,
            num_permuted_tokens=8)[0], mesh, x, idx, w)
    with pytest.raises(ValueError, match="divisible"):
        run_ep(lambda x, i, w: hybridep.hybridep_dispatch(
            x, topk_idx=i, probs=w, num_experts=5, axis_name=AXIS,
            num_permuted_tokens=8)[0], mesh, x, idx, w)


def test_hybridep_moe_forward_matches_dense():
    """A full MoE through hybridep: per-row expert FFN via the row's expert, gate by probs."""
    num_ranks, T, K, H, F, E = 4, 6, 2, 8, 8, 8
    rng = np.random.default_rng(8)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    w_in = rng.standard_normal((E, H, F)).astype(np.float32) / 3
    w_out = rng.standard_normal((E, F, H)).astype(np.float32) / 3

    def body(x, i, w, w_in, w_out):
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, topk_idx=i, probs=w, num_experts=E,
                                                    axis_name=AXIS, num_permuted_tokens=64)
        y = jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(px, w_in, tpe)), w_out, tpe)
        return hybridep.hybridep_combine(y * pp[:, None], h)

    out = np.asarray(run_ep(body, ep_mesh(num_ranks), x, idx, w, w_in, w_out))
    np.testing.assert_allclose(out, dense_moe(x, idx, w, w_in, w_out), rtol=1e-5, atol=1e-5)
    assert jax_ep.hybridep_dispatch is hybridep.hybridep_dispatch


@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
@pytest.mark.parametrize("bad", [-7, 8, 99])
def test_invalid_expert_id_on_one_rank_is_unrouted_and_counted(bad, backend):
    # ids outside [-1, E) on one rank: routed nowhere (a layer-1 kernel's error would stop that
    # rank only) and counted in that rank's handle.num_invalid
    num_ranks, T, H, K, E = 4, 4, 8, 2, 8
    rng = np.random.default_rng(6)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    bad_idx, clean_idx = idx.copy(), idx.copy()
    bad_idx[3, 0], clean_idx[3, 0] = bad, -1  # rank 0's fourth token

    def body(x, i, w):
        px, pp, tpe, h = hybridep.hybridep_dispatch(x, topk_idx=i, probs=w, num_experts=E,
                                                    axis_name=AXIS, num_permuted_tokens=32,
                                                    backend=backend)
        return px, pp, tpe, h.num_invalid[None], hybridep.hybridep_combine(px, h)

    mesh = ep_mesh(num_ranks)
    got = [np.asarray(a) for a in run_ep(body, mesh, x, bad_idx, w)]
    want = [np.asarray(a) for a in run_ep(body, mesh, x, clean_idx, w)]
    np.testing.assert_array_equal(got[3], [1, 0, 0, 0])
    np.testing.assert_array_equal(want[3], [0, 0, 0, 0])
    for g, c in zip(got[:3] + got[4:], want[:3] + want[4:]):
        np.testing.assert_array_equal(g, c)


@pytest.mark.parametrize("num_ranks", [1, 4])
@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
@pytest.mark.parametrize("compact", [False, True])
def test_zero_tokens_dispatch_combine_and_gradients(compact, backend, num_ranks):
    H, K, E, N = 8, 2, 8, 8
    x = np.zeros((0, H), np.float32)
    idx = np.zeros((0, K), np.int32)
    w = np.zeros((0, K), np.float32)
    rm, pr = dense_routing(idx, w, E)

    def body(x, a, b):
        kw = dict(topk_idx=a) if compact else dict(routing_map=a)

        def loss(x, b):
            px, pp, tpe, h = hybridep.hybridep_dispatch(x, probs=b, num_experts=E,
                                                        axis_name=AXIS, num_permuted_tokens=N,
                                                        pad_multiple=4, backend=backend, **kw)
            out = hybridep.hybridep_combine(px * pp[:, None], h)
            return out.sum(), (out, px, pp, tpe, h.num_dropped[None])
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, b)
        # A cotangent that varies over the axis, as a shard_map input does: the combined
        # output must be typed varying too (at P = 1 no collective makes it so).
        _, pull = jax.vjp(lambda x: loss(x, b)[1][0], x)
        return *aux, *grads, pull(x)[0]

    args = (x, idx, w) if compact else (x, rm, pr)
    out, px, pp, tpe, dropped, d_x, d_p, d_x_vjp = run_ep(body, ep_mesh(num_ranks), *args)
    assert out.shape == (0, H) and d_x.shape == (0, H) and d_p.shape == args[2].shape
    assert d_x_vjp.shape == (0, H)
    # Non-empty results from empty inputs: N zero rows per rank, empty blocks, nothing dropped.
    np.testing.assert_array_equal(px, np.zeros((num_ranks * N, H), np.float32))
    np.testing.assert_array_equal(pp, np.zeros((num_ranks * N,), np.float32))
    np.testing.assert_array_equal(tpe, np.zeros((E,), np.int32))
    np.testing.assert_array_equal(dropped, np.zeros((num_ranks,), np.int32))


@pytest.mark.parametrize("compact,pad", [(True, None), (True, 4), (False, None), (False, 2)])
def test_default_num_permuted_tokens_is_the_no_drop_worst_case(compact, pad):
    """num_permuted_tokens=None (issue 22): P*T' rows of min(K, L) slots (compact) or L slots
    (dense map) plus L*(pad-1). Every token routed to rank 0's experts: nothing is dropped and
    the rows equal the oracle's for that N."""
    num_ranks, T, K, H, E = 4, 5, 3, 8, 16  # T' = 8 (T equalised to a multiple of 4), L = 4
    L, padded = E // num_ranks, 8
    rng = np.random.default_rng(21)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(L)[:K] for _ in range(num_ranks * T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    px, pp, tpe, dropped, y = _run(ep_mesh(num_ranks), x, idx, w, E, None, pad, compact)
    n = num_ranks * padded * (min(K, L) if compact else L) + L * ((pad or 1) - 1)
    assert px.shape == (num_ranks * n, H) and not dropped.any()
    rm, pr = dense_routing(idx, w, E)
    for d, (wx, wp, wt, wd) in enumerate(hybridep_oracle(x, rm, pr, num_ranks, n, pad)):
        np.testing.assert_array_equal(px[d * n:(d + 1) * n], wx)
        np.testing.assert_array_equal(pp[d * n:(d + 1) * n], wp)
        np.testing.assert_array_equal(tpe[d * L:(d + 1) * L], wt)
    assert tpe[:L].sum() >= num_ranks * T * K  # rank 0 got every slot
    np.testing.assert_allclose(y, x * K, rtol=1e-6)  # combine: one copy per routed expert


def test_dispatcher_default_num_permuted_tokens():
    """The flex dispatcher's hybridep buffer without num_permuted_tokens: P*T'*min(K, L) +
    L*(pad-1) rows (TokenDispatcherConfig.num_permuted_tokens documents it); a set value wins."""
    from jax_ep.flax import MoEFlexTokenDispatcher
    num_ranks, T, K, H, E, pad = 4, 5, 3, 8, 8, 4  # T' = 8, L = 2
    rng = np.random.default_rng(22)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    for n, want in ((None, num_ranks * 8 * 2 + 2 * (pad - 1)), (12, 12)):
        cfg = jax_ep.TokenDispatcherConfig(
            num_moe_experts=E, moe_router_topk=K, moe_flex_dispatcher_backend="hybridep",
            moe_router_expert_pad_multiple=pad, expert_axis_name=AXIS, num_permuted_tokens=n)
        d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)
        out = run_ep(lambda x, i, w: d.token_permutation2(x, x.shape[0], w, i)[0],
                     ep_mesh(num_ranks), x, idx, w)
        assert out.shape == (num_ranks * want, H), n


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("transport", ["all_to_all", "peer"])
def test_num_worst_tokens_bounds_the_receive_rows_by_source_rank(compact, transport):
    # Every token goes to rank 0 (expert 0). R = 10 receive rows: all 8 tokens of source 0,
    # the first 2 of source 1, none of sources 2 and 3 (as jax_ep.dispatch's num_worst_tokens);
    # the senders count the 6 + 8 + 8 rows they dropped, the combine returns the kept tokens
    # and zero rows for the dropped ones, and rank 0's expert block holds exactly R rows.
    num_ranks, T, H, E, R = 4, 8, 4, 4, 10
    x = np.arange(num_ranks * T, dtype=np.float32)[:, None].repeat(H, 1) + 1
    idx = np.zeros((num_ranks * T, 1), np.int32)
    probs = np.full(idx.shape, 0.5, np.float32)
    routing = dict(topk_idx=idx, probs=probs) if compact else dict(
        routing_map=np.eye(E, dtype=bool)[idx[:, 0]],
        probs=np.eye(E, dtype=np.float32)[idx[:, 0]] * 0.5)
    names = list(routing)

    def body(x, a, b):
        px, _, tpe, h = jax_ep.hybridep_dispatch(
            x, **{names[0]: a, names[1]: b}, num_experts=E, axis_name=AXIS,
            num_worst_tokens=R, transport=transport)
        return (jax_ep.hybridep_combine(px, h), tpe.reshape(1, -1),
                h.num_dropped.reshape(1), h.routing.num_recv_tokens.reshape(1))

    out, tpe, dropped, received = map(np.asarray, run_ep(
        body, ep_mesh(num_ranks), x, routing[names[0]], routing[names[1]]))
    kept = np.zeros(num_ranks * T, bool)
    kept[:T + 2] = True
    np.testing.assert_array_equal(np.asarray(out), np.where(kept[:, None], x, 0))
    np.testing.assert_array_equal(dropped, [0, 6, 8, 8])
    np.testing.assert_array_equal(received, [R, 0, 0, 0])
    np.testing.assert_array_equal(tpe[0], [R])


def _dense_dispatch_and_grads(mesh, x, rm, pr, E, N, top_k, transport):
    """hybridep_dispatch of a dense map then combine: (permuted x, permuted probs, tokens per
    expert, dropped, send rows, combine, d loss / d x, d loss / d probs) per rank."""
    def body(x, rm, pr):
        def loss(x, pr):
            px, pp, tpe, h = hybridep.hybridep_dispatch(
                x, routing_map=rm, probs=pr, num_experts=E, axis_name=AXIS,
                num_permuted_tokens=N, transport=transport, top_k=top_k)
            y = hybridep.hybridep_combine(px * pp[:, None], h)
            aux = (px, pp, tpe, h.num_dropped[None],
                   jnp.full((1,), h.routing.send_token_idx.shape[0]), y)
            return jnp.sum(y * jnp.cos(y)), aux
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, pr)
        return aux + grads
    return [np.asarray(a) for a in run_ep(body, mesh, x, rm, pr)]


@pytest.mark.parametrize("transport", ["all_to_all", "peer"])
def test_top_k_bounds_a_dense_maps_send_rows_and_changes_nothing_within_it(transport):
    """top_k = K on a dense map of top-K routing: the send layout (and with it the combine's
    return buffer) holds T'*K rows instead of T'*P; rows, probs, counts, combine and both
    gradients are bitwise those of top_k=None, the default N uses min(K, L) slots."""
    num_ranks, T, K, H, E = 8, 6, 3, 8, 32  # T' = 8, L = 4
    rng = np.random.default_rng(31)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    rm, pr = dense_routing(idx, w, E)
    mesh = ep_mesh(num_ranks)
    bounded = _dense_dispatch_and_grads(mesh, x, rm, pr, E, 64, K, transport)
    unbounded = _dense_dispatch_and_grads(mesh, x, rm, pr, E, 64, None, transport)
    np.testing.assert_array_equal(bounded[4], [8 * K] * num_ranks)
    np.testing.assert_array_equal(unbounded[4], [8 * num_ranks] * num_ranks)
    for i, (a, b) in enumerate(zip(bounded, unbounded)):
        if i != 4:
            np.testing.assert_array_equal(a, b, err_msg=str(i))
    assert not bounded[3].any()
    # the default N: P*T' rows of min(top_k, L) slots
    px = _dense_dispatch_and_grads(mesh, x, rm, pr, E, None, K, transport)[0]
    assert px.shape == (num_ranks * num_ranks * 8 * K, H)


def test_top_k_keeps_a_tokens_first_owning_ranks_and_counts_the_rest():
    """A token of a dense map owning more than top_k ranks keeps its first top_k in rank
    order: the result is top_k=None's on the map without the later ranks' experts, and the
    sender counts one dropped row per cut (token, rank)."""
    num_ranks, T, H, E, top_k = 4, 4, 8, 8, 2  # L = 2
    rng = np.random.default_rng(32)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    rm = rng.random((num_ranks * T, E)) < 0.5
    rm[0] = True  # every expert: 4 owning ranks, 2 cut
    pr = np.where(rm, rng.uniform(0.1, 1.0, rm.shape), 0).astype(np.float32)
    owning = rm.reshape(-1, num_ranks, E // num_ranks).any(-1)
    first = np.cumsum(owning, axis=1) <= top_k
    kept_rm = rm & np.repeat(first & owning, E // num_ranks, axis=1)
    mesh = ep_mesh(num_ranks)
    got = _dense_dispatch_and_grads(mesh, x, rm, pr, E, 32, top_k, "peer")
    want = _dense_dispatch_and_grads(mesh, x, kept_rm, np.where(kept_rm, pr, 0), E, 32, None,
                                     "peer")
    for i in (0, 1, 2, 5, 6):
        np.testing.assert_array_equal(got[i], want[i], err_msg=str(i))
    cut = np.maximum(owning.sum(1) - top_k, 0).reshape(num_ranks, T).sum(1)
    assert cut[0] >= 2
    np.testing.assert_array_equal(got[3], want[3] + cut)
    # probs of the cut ranks' experts get no gradient: the rows never left the rank
    np.testing.assert_array_equal(got[7][rm & ~kept_rm], 0)


def test_top_k_bad_inputs():
    mesh = ep_mesh(2)
    x = np.zeros((8, 8), np.float32)
    idx = np.zeros((8, 2), np.int32)
    w = np.ones((8, 2), np.float32)
    rm, pr = dense_routing(idx, w, 4)
    with pytest.raises(ValueError, match="top_k: bounds a dense routing_map"):
        run_ep(lambda x, i, w: hybridep.hybridep_dispatch(
            x, topk_idx=i, probs=w, num_experts=4, axis_name=AXIS, top_k=2)[0], mesh, x, idx, w)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="top_k: expected an int"):
            run_ep(lambda x, m, p: hybridep.hybridep_dispatch(
                x, routing_map=m, probs=p, num_experts=4, axis_name=AXIS, top_k=bad)[0],
                mesh, x, rm, pr)


def test_dispatcher_bounds_the_dense_send_rows_by_moe_router_topk():
    """The flex dispatcher's dense HybridEP path passes moe_router_topk as top_k: T'*K send
    rows at P = 8, K = 2 (T'*P before)."""
    from jax_ep.flax import MoEFlexTokenDispatcher
    num_ranks, T, K, H, E = 8, 8, 2, 8, 16
    rng = np.random.default_rng(33)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_flex_dispatcher_backend="hybridep",
                                       expert_axis_name=AXIS)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)

    def body(x, i, w):
        hidden, state = d.dispatch_preprocess2(x, x.shape[0], w, i)
        _, state = d.dispatch_all_to_all(hidden, state)
        return jnp.full((1,), state.handle.routing.send_token_idx.shape[0])

    np.testing.assert_array_equal(run_ep(body, ep_mesh(num_ranks), x, idx, w), [T * K] * 8)


@pytest.mark.parametrize("fields, want_dropped", [
    # TokenDispatcherConfig.num_worst_tokens is the deepep family's: hybridep never reads it
    (dict(num_worst_tokens=4), [0, 0]),
    # Megatron's moe_expert_rank_capacity_factor 1 with FP8 padding (16): its budget is
    # int(T*K*f) = 8 rounded up to 16, so rank 0 keeps all 16 rows sent to expert 0. The
    # receive rows are bounded by the permuted buffer (min(P*T', N), N = 8 + 15), not by
    # ceil(f*T'*min(K, P)) = 8, which dropped 8 rows that N holds
    (dict(ragged_buffer_factor=1.0, moe_router_expert_pad_multiple=16), [0, 0]),
    # a permuted buffer below the rows: only what N cannot hold drops (12 of 16 rows fit;
    # counted by their sender, rank 1)
    (dict(num_permuted_tokens=12), [0, 4]),
])
def test_dispatcher_bounds_hybridep_receive_rows_by_its_permuted_buffer(fields, want_dropped):
    from jax_ep.flax import MoEFlexTokenDispatcher
    num_ranks, T, K, H, E = 2, 8, 1, 8, 2
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_flex_dispatcher_backend="hybridep",
                                       expert_axis_name=AXIS, **fields)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)
    x = np.random.default_rng(34).standard_normal((num_ranks * T, H)).astype(np.float32)
    idx = np.zeros((num_ranks * T, K), np.int32)  # every token to expert 0 (rank 0)
    w = np.full((num_ranks * T, K), 0.5, np.float32)

    def body(x, i, w):
        px, _, pp, state = d.token_permutation2(x, x.shape[0], w, i)
        return d.token_unpermutation(px * pp[:, None], state), state.num_dropped[None]

    y, dropped = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    np.testing.assert_array_equal(dropped, want_dropped)
    kept = np.abs(y).sum(1) > 0
    assert kept.sum() == num_ranks * T - sum(want_dropped)
    np.testing.assert_allclose(y[kept], 0.5 * x[kept], rtol=1e-6)


def test_dispatcher_sends_a_callers_dense_map_whole():
    """A routing_map given to dispatch_preprocess (Megatron's form) may route a token to more
    than moe_router_topk experts, e.g. the drop-and-pad capacity mask: every row is sent (no
    top-k bound on its send layout) and the combine sums every expert's copy. A map the
    dispatcher builds from top-k keeps the T'*min(K, P) bound."""
    from jax_ep.flax import MoEFlexTokenDispatcher
    num_ranks, T, H, E, K = 4, 4, 8, 4, 1
    rng = np.random.default_rng(35)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    owned = np.zeros((num_ranks * T, E), bool)
    owned[np.arange(num_ranks * T), rng.integers(0, E, num_ranks * T)] = True
    owned[0::T] = True  # each rank's first token on every expert: 4 ranks, K = 1
    probs = np.where(owned, 0.5, 0.0).astype(np.float32)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_flex_dispatcher_backend="hybridep",
                                       expert_axis_name=AXIS)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)

    def body(x, rm, pr):
        hidden, state = d.dispatch_preprocess(x, rm, pr)
        out, _, _, state = d.dispatch_postprocess(*d.dispatch_all_to_all(hidden, state))
        sent = state.handle.routing.send_token_idx.shape[0]
        return (d.token_unpermutation(out, state), state.num_dropped[None],
                jnp.full((1,), sent))

    y, dropped, sent = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, owned, probs))
    assert not dropped.any()
    np.testing.assert_array_equal(sent, [T * num_ranks] * num_ranks)  # T' = T: T*P rows
    np.testing.assert_allclose(y, owned.sum(1, keepdims=True) * x, rtol=1e-6)
    assert owned[0].sum() == E and np.allclose(y[0], E * x[0])

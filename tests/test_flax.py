"""TokenDispatcherConfig, the Flax NNX dispatcher and MoELayer on an emulated ("data", "expert")
mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ep_utils import (AXIS, assert_param_grads_close, ep_mesh, layer_vs_dense, nested_eqns,
                      random_routing, randomize_biases, run_ep)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ops
from jax_ep.flax import MoEConfig, MoEFlexTokenDispatcher, MoELayer, dense_forward, shard_params

BACKENDS = ("deepep", "uccl_ep", "alltoall", "hybridep")

PYTORCH_DEFAULTS = dict(
    moe_enable_deepep=True, moe_permute_fusion=False, moe_expert_capacity_factor=None,
    moe_router_topk=2, moe_router_expert_pad_multiple=None, num_moe_experts=64,
    moe_router_dtype="fp32", moe_flex_dispatcher_backend="deepep", moe_deepep_num_sms=20,
    moe_hybridep_num_sms=24, moe_hybridep_permute_fusion=False,
    moe_hybridep_compact_routing=False, moe_hybridep_num_sms_preprocessing=None,
    moe_hybridep_num_blocks_permute=None, moe_hybridep_num_blocks_unpermute=None,
    moe_share_token_dispatcher=True, moe_deepep_async_dispatch=False,
    moe_benchmark_static_routing=False)


def test_config_has_every_pytorch_field_with_its_default():
    cfg = jax_ep.TokenDispatcherConfig()
    fields = [f.name for f in dataclasses.fields(cfg)]
    assert fields[:len(PYTORCH_DEFAULTS)] == list(PYTORCH_DEFAULTS)
    for name, value in PYTORCH_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    # frozen: jit keys compiled programs on configs (static arguments, nnx graphdefs), and a
    # config changed in place would match programs compiled for its old values
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.moe_router_topk = 4


def test_megatron_dispatcher_type_reads_from_the_backend():
    """MoEConfig.moe_token_dispatcher_type, Megatron's field, read from token_dispatcher
    ("alltoall" for that backend, else "flex"); from_dict reads it into the backend."""
    moe = MoEConfig(num_moe_experts=8, moe_router_topk=2)
    assert moe.moe_token_dispatcher_type == "flex"
    for kind, backend, reads in [("alltoall", "alltoall", "alltoall"),
                                 ("allgather", "alltoall", "alltoall"),
                                 ("flex", "deepep", "flex")]:
        cfg = MoEConfig.from_dict(dict(num_moe_experts=8, moe_router_topk=2,
                                       moe_token_dispatcher_type=kind))
        assert cfg.token_dispatcher.moe_flex_dispatcher_backend == backend
        assert cfg.moe_token_dispatcher_type == reads
    hybrid = dataclasses.replace(moe, token_dispatcher=jax_ep.TokenDispatcherConfig(
        moe_flex_dispatcher_backend="hybridep"))
    assert hybrid.moe_token_dispatcher_type == "flex"
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.moe_token_dispatcher_type = "alltoall"


@pytest.mark.parametrize("module", ["router", "layer"])
def test_megatron_router_methods(module):
    """Megatron's get_aux_loss_coeff(type) (0 for a type not configured) and
    set_layer_number, on TopKRouter and MoELayer."""
    cfg = MoEConfig(num_moe_experts=8, moe_router_topk=2,
                    moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                    moe_aux_loss_coeff=[0.5, 2.0])
    m = (jax_ep.flax.TopKRouter(cfg, 16, rngs=nnx.Rngs(0)) if module == "router"
         else MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), expert_parallel_size=4))
    assert [m.get_aux_loss_coeff(k) for k in ("aux_loss", "seq_aux_loss", "global_aux_loss")] \
        == [0.5, 2.0, 0.0]
    assert m.layer_number is None
    m.set_layer_number(3)
    assert m.layer_number == 3
    with pytest.raises(ValueError, match="layer_number"):
        m.set_layer_number(0)


@pytest.mark.parametrize("field,value", [
    ("moe_flex_dispatcher_backend", "nccl"), ("moe_router_dtype", "bf16"),
    ("moe_router_topk", 0), ("num_moe_experts", -1),
    ("moe_expert_capacity_factor", 0.0), ("moe_router_expert_pad_multiple", -4),
    ("transport", "nvlink"), ("moe_deepep_num_sms", 0), ("moe_permute_fusion", 1),
    ("num_worst_tokens", -5), ("expert_axis_name", ""),
    ("moe_expert_capacity_factor", float("inf")), ("moe_expert_capacity_factor", float("nan")),
    ("moe_expert_capacity_factor", float("-inf")), ("moe_expert_capacity_factor", "1.5"),
    ("moe_router_topk", 2.0), ("num_moe_experts", np.bool_(True)),
    ("ragged_buffer_factor", 0.0), ("ragged_buffer_factor", float("inf")),
    ("dropless_buffer_factor", 0.0), ("dropless_buffer_factor", -1.0),
    ("grouped_gemm_impl", "cublas")])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        jax_ep.TokenDispatcherConfig(**{field: value})


def test_config_accepts_what_nemos_dataclass_accepts():
    # pad multiple 0 is off (NeMo: `if pad_multiple:`); top-k above E builds (NeMo's config is
    # a plain dataclass) and the routing refuses it when traced
    assert jax_ep.TokenDispatcherConfig(moe_router_expert_pad_multiple=0) \
        .moe_router_expert_pad_multiple is None
    # a negative capacity factor is dropless (Megatron's rule, as MoEConfig's)
    for f in (-1.0, -1, np.float32(-0.5)):
        assert jax_ep.TokenDispatcherConfig(moe_expert_capacity_factor=f) == \
            jax_ep.TokenDispatcherConfig()
        assert MoEConfig(num_moe_experts=8, moe_expert_capacity_factor=f) == \
            MoEConfig(num_moe_experts=8)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=2, moe_router_topk=4)
    d = MoEFlexTokenDispatcher(2, [0, 1], cfg)
    with pytest.raises(ValueError, match="token_indices: top-k 4 exceeds num_moe_experts 2"):
        d.dispatch_preprocess2(jnp.zeros((3, 8)), 3, jnp.ones((3, 4)),
                               jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="TokenDispatcherConfig.moe_router_topk: top-k 4 "
                                         "exceeds num_moe_experts 2"):
        d.dispatch_preprocess(jnp.zeros((3, 8)), 3, jnp.ones((3, 2)))


@pytest.mark.parametrize("field, value", [("ragged_buffer_factor", 1.5),
                                          ("num_worst_tokens", 64)])
def test_buffer_bounds_refuse_the_chunked_overlap(field, value):
    """The chunked overlap sizes its own buffers: a bound it would not apply is an error."""
    with pytest.raises(ValueError, match=field):
        jax_ep.TokenDispatcherConfig(**{field: value, "moe_deepep_async_dispatch": True})
    jax_ep.TokenDispatcherConfig(**{field: value})  # alone it is fine


def test_config_takes_numpy_scalars_as_python_numbers():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=np.int64(8), moe_router_topk=np.int32(2),
                                       moe_expert_capacity_factor=np.float32(1.5))
    plain = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                         moe_expert_capacity_factor=1.5)
    assert type(cfg.num_moe_experts) is int and type(cfg.moe_expert_capacity_factor) is float
    assert cfg == plain and hash(cfg) == hash(plain)


def test_dispatcher_buffer_sizes_are_the_documented_formulas():
    """rank_capacity / num_recv_rows: the capacity and num_worst_tokens the dispatcher passes
    to jax_ep.dispatch, by hand: T = 64, K = 2, E = 16 over P = 8 ranks (L = 2)."""
    def sizes(**fields):
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=16, moe_router_topk=2, **fields)
        d = MoEFlexTokenDispatcher(2, range(2), cfg)
        return d.rank_capacity(64), d.num_recv_rows(64)

    assert sizes() == (None, None)  # no bound: the no-drop worst case
    # each expert keeps ceil(64 * 2 / 16 * 1.5) = 12 tokens, a rank's 2 experts 24
    assert sizes(moe_expert_capacity_factor=1.5) == (24, None)
    # ceil(1.25 * T * min(K, P)) = 160 rows, below P * C = 192 and P * T = 512
    assert sizes(moe_expert_capacity_factor=1.5, ragged_buffer_factor=1.25) == (24, 160)
    assert sizes(ragged_buffer_factor=1.25) == (None, 160)
    assert sizes(moe_expert_capacity_factor=0.5, ragged_buffer_factor=4.0) == (8, 64)
    assert sizes(num_worst_tokens=100) == (None, 100)


def test_dispatcher_and_layer_errors_name_the_argument():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, expert_axis_name=AXIS)
    with pytest.raises(ValueError, match="num_local_experts"):
        MoEFlexTokenDispatcher(0, [], cfg)
    d = MoEFlexTokenDispatcher(2, range(2), cfg)
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="probs"):
        d.dispatch_preprocess(x, 4, jnp.zeros((4, 6)))
    with pytest.raises(ValueError, match="token_probs"):
        d.dispatch_preprocess2(x, 4, jnp.zeros((4, 1)), jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="token_indices"):
        d.dispatch_preprocess2(x, 4, jnp.zeros((6, 1)), jnp.zeros((6, 1), jnp.int32))
    hybrid = MoEFlexTokenDispatcher(2, range(2), dataclasses.replace(
        cfg, moe_flex_dispatcher_backend="hybridep"))
    with pytest.raises(ValueError, match="^token_indices: HybridEP's dense routing sizes its "
                                         "buffers for moe_router_topk=2 experts a token, got 3"):
        hybrid.dispatch_preprocess2(x, 4, jnp.zeros((4, 3)), jnp.zeros((4, 3), jnp.int32))
    hybrid.dispatch_preprocess2(x, 4, jnp.zeros((4, 1)), jnp.zeros((4, 1), jnp.int32))
    compact = MoEFlexTokenDispatcher(2, range(2), dataclasses.replace(
        hybrid.config, moe_hybridep_compact_routing=True))
    compact.dispatch_preprocess2(x, 4, jnp.zeros((4, 3)), jnp.zeros((4, 3), jnp.int32))
    mesh = _mesh()
    layer = MoELayer(jax_ep.TokenDispatcherConfig(num_moe_experts=8), 16, 32, rngs=nnx.Rngs(0),
                     mesh=mesh)
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., hidden_size=16\]"):
        layer(jnp.zeros((8, 4, 12)))
    with pytest.raises(ValueError, match="x: expected .*divisible by the 8 devices"):
        layer(jnp.zeros((6, 4, 16)))


def _routed_tokens(seed, num_tokens, H, K, E, unrouted=0.1):
    """x f32[T,H] and a random routing (idx i32[T,K], w f32[T,K])."""
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, num_tokens, K, E, unrouted=unrouted)
    return rng.standard_normal((num_tokens, H)).astype(np.float32), idx, w


def _dispatcher(num_ranks, E, K, **config):
    """A dispatcher for E experts over num_ranks ranks of the test axis."""
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       expert_axis_name=AXIS, **config)
    return MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)


def test_dispatcher_checks_local_experts_against_the_config_and_the_mesh():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       expert_axis_name=AXIS)
    for bad in ([0, 1, 2], [3, 1], [1, 2], [8, 9], []):
        with pytest.raises(ValueError, match=r"local_expert_indices: expected the 2 "):
            MoEFlexTokenDispatcher(2, bad, cfg)
    assert MoEFlexTokenDispatcher(2, [6, 7], cfg).local_expert_indices == (6, 7)
    # 4 local experts of 8 is an expert axis of 2 devices, not 4: an error, not a wrong split.
    x, idx, w = _routed_tokens(5, 8, 16, 2, 8)
    for backend in BACKENDS:
        d = MoEFlexTokenDispatcher(4, range(4), dataclasses.replace(
            cfg, moe_flex_dispatcher_backend=backend))
        with pytest.raises(ValueError, match="num_local_experts: 4 local experts of "
                           "num_moe_experts=8 need an expert axis of 2 devices, but axis "
                           f"'{AXIS}' has 4"):
            run_ep(lambda x, i, w: d.token_permutation2(x, x.shape[0], w, i)[0],
                   ep_mesh(4), x, idx, w)


def test_dispatcher_takes_pytorch_keywords_and_rejects_probs_in_place_of_the_state():
    num_ranks, T, H, K, E = 2, 4, 8, 2, 4
    x, idx, w = _routed_tokens(6, num_ranks * T, H, K, E)
    d = _dispatcher(num_ranks, E, K)

    def staged(x, i, w):
        hidden, state = d.dispatch_preprocess2(x, x.shape[0], w, i)
        received, state = d.dispatch_all_to_all(hidden, state, async_finish=False,
                                                allocate_on_comm_stream=False)
        tokens, _, pp, state = d.dispatch_postprocess(received, state)
        rows = d.combine_preprocess(tokens * pp[:, None], state)
        out = d.combine_all_to_all(rows, state, async_finish=False,
                                   allocate_on_comm_stream=False)
        return d.combine_postprocess(out, state)

    out = np.asarray(run_ep(staged, ep_mesh(num_ranks), x, idx, w))
    np.testing.assert_allclose(out, x * np.where(idx >= 0, w, 0).sum(1, keepdims=True),
                               rtol=1e-5)

    def probs_as_state(x, i, w):
        hidden, _ = d.dispatch_preprocess2(x, x.shape[0], w, i)
        return d.dispatch_all_to_all(hidden, w)[0][0]
    with pytest.raises(ValueError, match="dispatch_all_to_all: state: expected the "
                       "DispatchState returned by the dispatch side, got"):
        run_ep(probs_as_state, ep_mesh(num_ranks), x, idx, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuted_probs_follow_an_fp64_router_dtype(backend):
    """NeMo's DeepEP manager casts permuted_probs to float64 when moe_router_dtype is "fp64";
    its HybridEP manager returns HybridEP's float32 probs whatever the router dtype."""
    num_ranks, T, H, K, E = 2, 4, 8, 2, 4
    x, idx, w = _routed_tokens(7, num_ranks * T, H, K, E)
    got = {}
    for dtype in ("fp32", "fp64"):
        d = _dispatcher(num_ranks, E, K, moe_router_dtype=dtype,
                        moe_flex_dispatcher_backend=backend)

        def body(x, i, w):
            tokens, _, pp, state = d.token_permutation2(x, x.shape[0], w, i)
            return pp, d.token_unpermutation(tokens * pp[:, None].astype(tokens.dtype), state)
        with jax.enable_x64(True):
            got[dtype] = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    fp64 = jnp.float32 if backend == "hybridep" else jnp.float64
    assert got["fp32"][0].dtype == jnp.float32 and got["fp64"][0].dtype == fp64
    np.testing.assert_array_equal(np.asarray(got["fp64"][0]), np.asarray(got["fp32"][0]))
    np.testing.assert_array_equal(np.asarray(got["fp64"][1]), np.asarray(got["fp32"][1]))


def test_token_unpermutation_checks_the_rows_it_gets():
    num_ranks, T, H, K, E = 4, 6, 8, 2, 8
    x, idx, w = _routed_tokens(3, num_ranks * T, H, K, E)
    d = _dispatcher(num_ranks, E, K)

    def body(x, i, w):
        tokens, _, _, state = d.token_permutation2(x, x.shape[0], w, i)
        return d.token_unpermutation(tokens[:-1], state)
    with pytest.raises(ValueError, match="hidden_states: expected the"):
        run_ep(body, ep_mesh(num_ranks), x, idx, w)


def test_config_accepts_alltoall_backend_and_fp64_needs_x64():
    cfg = jax_ep.TokenDispatcherConfig(moe_flex_dispatcher_backend="alltoall",
                                       moe_router_dtype="fp64")
    layer_cfg = dict(num_local_experts=8, local_expert_indices=range(8), config=cfg)
    dispatcher = MoEFlexTokenDispatcher(**layer_cfg)
    with pytest.raises(ValueError, match="moe_router_dtype"):
        dispatcher.dispatch_preprocess(jnp.zeros((4, 8)), 4, jnp.zeros((4, 64)))


def _moe(cfg, **fields):
    """A MoEConfig around the TokenDispatcherConfig cfg, with Megatron fields `fields`."""
    return MoEConfig(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                     moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
                     moe_router_dtype=cfg.moe_router_dtype, token_dispatcher=cfg, **fields)


def _layer_pair(cfg, mesh, **kw):
    """A sharded layer and its unsharded twin with identical parameters."""
    make = lambda: MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh, **kw)  # noqa: E731
    layer = make()
    shard_params(layer, mesh)
    return layer, make()


def _mesh():
    return jax.make_mesh((2, 4), ("data", "expert"))


def _path_config(extra, backend="deepep", top_k=2):
    """An expert-path case's TokenDispatcherConfig (E = 8, fused permutation): `extra` holds
    TokenDispatcherConfig fields, or pad_to_capacity=True for drop-and-pad at capacity factor
    1.5. Returns (config, pad), pad for MoEConfig.moe_pad_expert_input_to_capacity."""
    extra = dict(extra)
    pad = extra.pop("pad_to_capacity", False)
    if pad:
        extra["moe_expert_capacity_factor"] = 1.5
    extra.setdefault("moe_flex_dispatcher_backend", backend)
    return jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=top_k,
                                        moe_permute_fusion=True, **extra), pad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", [dict(), dict(moe_router_expert_pad_multiple=4),
                                   dict(moe_deepep_async_dispatch=True, num_overlap_chunks=3),
                                   dict(moe_hybridep_compact_routing=True),
                                   # top-k 3 above the L = 2 experts of each of 4 ranks
                                   dict(moe_router_topk=3),
                                   dict(moe_router_topk=3, moe_deepep_async_dispatch=True,
                                        num_overlap_chunks=2),
                                   dict(grouped_gemm_impl="ragged_dot"),
                                   dict(grouped_gemm_impl="blocks"),
                                   dict(grouped_gemm_impl="tiled")])
def test_moe_layer_forward_and_grad_match_dense(backend, extra):
    if extra.get("moe_deepep_async_dispatch") and backend == "hybridep":
        pytest.skip("chunked overlap is a deepep-family feature")
    if "grouped_gemm_impl" in extra and backend != "deepep":
        pytest.skip("the experts' GEMM is the same code under every backend")
    cfg = jax_ep.TokenDispatcherConfig(**dict(dict(num_moe_experts=8, moe_router_topk=2,
                                                   moe_flex_dispatcher_backend=backend,
                                                   moe_permute_fusion=True), **extra))
    mesh = _mesh()
    layer, twin = _layer_pair(_moe(cfg, moe_shared_expert_intermediate_size=8,
                                   moe_aux_loss_coeff=1e-2), mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(aux["num_dropped"]) == 0
    assert int(aux["tokens_per_expert"].sum()) == 8 * 6 * cfg.moe_router_topk
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)


ACTIVATIONS = [dict(activation_func="gelu_tanh"),  # Gemma's GEGLU
               dict(activation_func="quick_gelu", glu_linear_offset=1.0,  # gpt-oss's
                    activation_func_clamp_value=1.5),
               # Megatron's MLP experts (Nemotron's squared ReLU); offset and clamp unused
               dict(gated_linear_unit=False, activation_func="squared_relu",
                    glu_linear_offset=1.0, activation_func_clamp_value=0.5)]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=["geglu", "quick_geglu", "mlp_relu2"])
@pytest.mark.parametrize("extra", [dict(), dict(grouped_gemm_impl="blocks"),
                                   dict(dropless_buffer_factor=1.25),
                                   dict(pad_to_capacity=True)],
                         ids=["ffi", "blocks", "bounded", "drop_and_pad"])
def test_moe_layer_activation_matches_dense(activation, extra):
    """The experts' and the shared expert's activation (MoEConfig.activation_func, ...)
    through every expert path: the grouped GEMM handler, the blocks, bounded buffers and
    drop-and-pad's equal blocks, against the dense forward; and the result is not that of
    SwiGLU (gated) or ReLU (not gated) with the same parameters."""
    cfg, pad = _path_config(extra)
    fields = dict(moe_shared_expert_intermediate_size=8, moe_aux_loss_coeff=1e-2,
                  moe_pad_expert_input_to_capacity=pad)
    mesh = _mesh()
    layer, twin = _layer_pair(_moe(cfg, **fields, **activation), mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16)) * 2
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # inputs of scale 2: f32 sums of larger terms (a wrong activation is off by O(1))
    assert_param_grads_close(grads, want_grads, rtol=5e-4, atol=5e-5)
    gated = activation.get("gated_linear_unit", True)
    assert layer.w_gate_up.shape == (8, 16, 32 * (2 if gated else 1))
    assert layer.shared_gate_up.shape == (16, 8 * (2 if gated else 1))
    other = {} if gated else dict(gated_linear_unit=False, activation_func="relu")
    other_twin = _layer_pair(_moe(cfg, **fields, **other), mesh)[1]  # the same parameters
    y, y_other = (np.asarray(dense_forward(m, x)[0]) for m in (twin, other_twin))
    assert np.abs(y - y_other).max() > 0.02 * np.abs(y_other).max()


@pytest.mark.parametrize("backend,extra", [("deepep", {}),
                                           ("deepep", dict(grouped_gemm_impl="blocks")),
                                           ("deepep", dict(dropless_buffer_factor=1.25)),
                                           ("deepep", dict(pad_to_capacity=True)),
                                           ("hybridep", {}),
                                           ("deepep", dict(moe_deepep_async_dispatch=True,
                                                           num_overlap_chunks=2))],
                         ids=["ffi", "blocks", "bounded", "drop_and_pad", "hybridep", "overlap"])
def test_moe_layer_add_bias_linear_matches_dense(backend, extra):
    """Megatron's add_bias_linear (gpt-oss's experts): the router's bias and each expert's fc1
    and fc2 biases, through every expert path, against the dense forward (values and the
    gradients of all six parameters, biases included); zero-initialised, so a fresh layer
    equals the layer without biases."""
    cfg, pad = _path_config(extra, backend)
    fields = dict(moe_aux_loss_coeff=1e-2, moe_pad_expert_input_to_capacity=pad,
                  activation_func="quick_gelu", glu_linear_offset=1.0,
                  activation_func_clamp_value=1.5)
    mesh = _mesh()
    biased = _moe(cfg, add_bias_linear=True, **fields)
    layer, twin = (MoELayer(biased, 16, 32, rngs=nnx.Rngs(0), mesh=mesh) for _ in range(2))
    plain = _layer_pair(_moe(cfg, **fields), mesh)[1]
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    assert (layer.router_bias.shape, layer.b_gate_up.shape, layer.b_down.shape) == (
        (8,), (8, 64), (8, 16))
    assert plain.router_bias is None and plain.b_gate_up is None and plain.b_down is None
    np.testing.assert_array_equal(dense_forward(twin, x)[0], dense_forward(plain, x)[0])
    randomize_biases(layer, twin)
    shard_params(layer, mesh)
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-5)
    assert {"router_bias", "b_gate_up", "b_down"} <= set(grads)
    y, y_plain = (np.asarray(dense_forward(m, x)[0]) for m in (twin, plain))
    assert np.abs(y - y_plain).max() > 0.05 * np.abs(y_plain).max()


def test_shared_expert_gate_scales_the_shared_expert_by_its_sigmoid():
    """Megatron's moe_shared_expert_gate (Qwen2-MoE's shared_expert_gate): the layer against
    the dense forward, and the dense forward against the hand-computed difference from the
    ungated layer with the same weights: (1 - sigmoid(x @ gate)) * shared(x)."""
    from jax_ep.flax.activations import swiglu
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_permute_fusion=True)
    fields = dict(moe_shared_expert_intermediate_size=8, moe_aux_loss_coeff=1e-2)
    mesh = _mesh()
    layer, twin = _layer_pair(_moe(cfg, moe_shared_expert_gate=True, **fields), mesh)
    plain = _layer_pair(_moe(cfg, **fields), mesh)[1]
    assert layer.shared_gate.shape == (16, 1) and plain.shared_gate is None
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    got, _, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)
    assert float(jnp.abs(grads["shared_gate"][...]).max()) > 0
    tokens = np.asarray(x, np.float64).reshape(-1, 16)
    shared = (np.asarray(swiglu(jnp.asarray(tokens @ np.asarray(twin.shared_gate_up[...]))),
                         np.float64) @ np.asarray(twin.shared_down[...]))
    gate = 1 / (1 + np.exp(-tokens @ np.asarray(twin.shared_gate[...], np.float64)))
    y_gated, y_plain = (np.asarray(dense_forward(m, x)[0]).reshape(-1, 16) for m in (twin, plain))
    np.testing.assert_allclose(y_plain - y_gated, (1 - gate) * shared, rtol=1e-4, atol=1e-5)
    # without a shared expert the field does nothing (Megatron)
    assert MoELayer(_moe(cfg, moe_shared_expert_gate=True), 16, 32, rngs=nnx.Rngs(0),
                    mesh=mesh).shared_gate is None


@pytest.mark.parametrize("extra", [dict(), dict(grouped_gemm_impl="blocks"),
                                   dict(dropless_buffer_factor=1.25),
                                   dict(pad_to_capacity=True),
                                   dict(moe_flex_dispatcher_backend="hybridep",
                                        moe_router_expert_pad_multiple=4)],
                         ids=["ffi", "blocks", "bounded", "drop_and_pad", "hybridep_pad4"])
def test_apply_probs_on_input_scales_the_expert_input(extra):
    """Megatron's moe_apply_probs_on_input (K = 1, Llama 4's experts): each expert computes
    f(p * x) (its fc2 bias unweighted), against the dense forward on every expert path, and
    differs from p * f(x)."""
    cfg, pad = _path_config(extra, top_k=1)
    fields = dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=1e-2,
                  moe_pad_expert_input_to_capacity=pad, add_bias_linear=True)
    mesh = _mesh()
    layer, twin, after = (MoELayer(_moe(cfg, moe_apply_probs_on_input=on, **fields), 16, 32,
                                   rngs=nnx.Rngs(0), mesh=mesh) for on in (True, True, False))
    randomize_biases(layer, twin, after)
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    got, _, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-5)
    y_in, y_out = (np.asarray(dense_forward(m, x)[0]) for m in (twin, after))
    assert np.abs(y_in - y_out).max() > 0.05 * np.abs(y_out).max()
    with pytest.raises(ValueError, match="MoEConfig.moe_apply_probs_on_input"):
        MoEConfig(num_moe_experts=8, moe_router_topk=2, moe_apply_probs_on_input=True)


@pytest.mark.parametrize("backend,extra", [("deepep", {}),
                                           ("deepep", dict(dropless_buffer_factor=1.25)),
                                           ("deepep", dict(pad_to_capacity=True)),
                                           ("hybridep", {}),
                                           ("deepep", dict(add_bias_linear=True)),
                                           ("deepep", dict(add_bias_linear=True,
                                                           moe_deepep_async_dispatch=True,
                                                           num_overlap_chunks=2))],
                         ids=["ffi", "bounded", "drop_and_pad", "hybridep", "biases",
                              "biases_overlap"])
def test_latent_moe_matches_dense(backend, extra):
    """Megatron's moe_latent_size D (Nemotron 3 Super's latent MoE): tokens projected H -> D
    before the dispatch, the experts in D, the combined rows projected D -> H; the router and
    the shared expert on the full H. Values and gradients (both projections included)
    against the dense forward."""
    extra = dict(extra)
    biases = extra.pop("add_bias_linear", False)
    cfg, pad = _path_config(extra, backend)
    moe_cfg = _moe(cfg, moe_latent_size=8, moe_aux_loss_coeff=1e-2, add_bias_linear=biases,
                   moe_pad_expert_input_to_capacity=pad,
                   moe_shared_expert_intermediate_size=None if biases else 8)
    mesh = _mesh()
    layer, twin = (MoELayer(moe_cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh) for _ in range(2))
    assert (layer.w_gate_up.shape, layer.w_down.shape) == ((8, 8, 64), (8, 32, 8))
    assert (layer.fc1_latent_proj.shape, layer.fc2_latent_proj.shape) == ((16, 8), (8, 16))
    if biases:
        assert (layer.fc1_latent_proj_bias.shape, layer.fc2_latent_proj_bias.shape) == ((8,),
                                                                                        (16,))
        randomize_biases(layer, twin)
        for m in (layer, twin):
            m.fc1_latent_proj_bias[...] = jnp.linspace(-1.0, 1.0, 8)
            m.fc2_latent_proj_bias[...] = jnp.linspace(1.0, -1.0, 16)
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    got, _, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data", "expert"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(grads["fc1_latent_proj"][...]).max()) > 0


def test_latent_projections_wrap_the_routed_experts_only():
    """With D = H, fc1_latent_proj = I and fc2_latent_proj = 2I the latent layer is the plain
    layer with its routed part doubled (same router, experts and shared expert): y_latent =
    y_plain + routed, routed the output of the same layer without a shared expert."""
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2)
    fields = dict(moe_aux_loss_coeff=1e-2)
    make = lambda **f: MoELayer(_moe(cfg, **fields, **f), 16, 32,  # noqa: E731
                                rngs=nnx.Rngs(0), mesh=_mesh())
    latent, plain, routed_only = (make(moe_latent_size=16, moe_shared_expert_intermediate_size=8),
                                  make(moe_shared_expert_intermediate_size=8), make())
    latent.fc1_latent_proj[...] = jnp.eye(16)
    latent.fc2_latent_proj[...] = 2 * jnp.eye(16)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    y_latent, y_plain, routed = (np.asarray(dense_forward(m, x)[0])
                                 for m in (latent, plain, routed_only))
    np.testing.assert_allclose(y_latent, y_plain + routed, rtol=1e-5, atol=1e-6)
    assert np.abs(routed).max() > 0.1


def test_add_bias_linear_router_and_config_rules():
    """TopKRouter's bias shifts the logits (Megatron's router_gating_linear); add_bias_linear
    with a shared expert is refused (Megatron: the shared expert has no bias)."""
    from jax_ep.flax import TopKRouter
    cfg = MoEConfig(num_moe_experts=8, moe_router_topk=2, add_bias_linear=True)
    router = TopKRouter(cfg, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 16))
    np.testing.assert_allclose(router.gating(x), x @ router.weight[...].T, rtol=1e-6)
    router.bias[...] = jnp.arange(8.0)
    np.testing.assert_allclose(router.gating(x), x @ router.weight[...].T + jnp.arange(8.0),
                               rtol=1e-6)
    assert TopKRouter(MoEConfig(num_moe_experts=8), 16, rngs=nnx.Rngs(0)).bias is None
    with pytest.raises(ValueError, match="MoEConfig.add_bias_linear"):
        MoEConfig(num_moe_experts=8, add_bias_linear=True, moe_shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="MoEConfig.add_bias_linear"):
        MoEConfig(num_moe_experts=8, add_bias_linear=1)


@pytest.mark.parametrize("backend,extra", [("deepep", {}), ("hybridep", {}),
                                           ("deepep", dict(dropless_buffer_factor=1.25))])
def test_gradient_penalty_through_the_layer_matches_dense(backend, extra):
    """Second order: the gradient of the squared norm of the parameters' gradient (a gradient
    penalty), through the layer with its default FFI ops and peer transport (every VJP on the
    path is itself differentiable), equals the dense single-device forward's."""
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_flex_dispatcher_backend=backend,
                                       moe_permute_fusion=True, **extra)
    mesh = _mesh()
    layer, twin = _layer_pair(_moe(cfg, moe_shared_expert_intermediate_size=8,
                                   moe_aux_loss_coeff=1e-2), mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    cot = jax.random.normal(jax.random.key(2), x.shape)

    def penalty_grad(forward, module, x):
        graphdef, params = nnx.split(module)

        def loss(params):
            y, aux_loss = forward(nnx.merge(graphdef, params), x)
            return jnp.sum(y * cot) + aux_loss

        def penalty(params):
            return sum(jnp.sum(g ** 2) for g in jax.tree.leaves(jax.grad(loss)(params)))
        return jax.jit(jax.grad(penalty))(params)

    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    with jax.set_mesh(mesh):
        got = penalty_grad(lambda m, x: (lambda y, a: (y, a["aux_loss"]))(*m(x)), layer, xs)
    want = penalty_grad(lambda m, x: dense_forward(m, x)[:2], twin, x)
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                 jax.tree_util.tree_flatten_with_path(want)[0]):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0, path
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                                   err_msg=str(path))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1)])
@pytest.mark.parametrize("backend", BACKENDS + ("latent",))
def test_empty_batch_gives_empty_output_and_zero_gradients(backend, mesh_shape):
    # No token on any device: the counts psum'd over (data, expert) are constants there, and
    # the balance loss is 0 (not 0/0). (With jax 0.11, hybridep's empty stand-ins cast to vary
    # over the data axis crashed XLA's compile of this gradient. With moe_latent_size the
    # D -> H projection's weight gradient failed to compile, on jax 0.10 too.)
    latent = backend == "latent"
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_flex_dispatcher_backend="deepep" if latent else backend)
    if latent:
        cfg = _moe(cfg, moe_latent_size=8, add_bias_linear=True)
    mesh = jax.make_mesh(mesh_shape, ("data", "expert"))
    layer, _ = _layer_pair(cfg, mesh)
    x = jnp.zeros((0, 6, 16))

    def loss(layer, x):
        y, aux = layer(x)
        return y.sum() + aux["aux_loss"], (y, aux)

    with jax.set_mesh(mesh):
        (value, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
    assert y.shape == x.shape and float(value) == 0.0
    assert int(aux["num_dropped"]) == 0 and not np.asarray(aux["tokens_per_expert"]).any()
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):
        assert not np.asarray(g[...]).any(), path


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_layer_takes_batches_in_any_layout(axis_type):
    # With Explicit mesh axes shard_map only takes inputs laid out as its in_specs say; the
    # layer reshards a batch that is unsharded, split over "data" only, or made inside jit.
    # dense_forward takes the same sharded layer and batches.
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind, kind))
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8)
    layer, twin = _layer_pair(cfg, mesh)
    x = jax.random.normal(jax.random.key(4), (8, 3, 16))
    want = np.asarray(dense_forward(twin, x)[0])
    run = nnx.jit(lambda l, x: l(x)[0])
    with jax.set_mesh(mesh):
        layouts = {
            "unsharded": x,
            "data only": jax.device_put(x, NamedSharding(mesh, P("data"))),
            "both axes": jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))),
        }
        for name, batch in layouts.items():
            np.testing.assert_allclose(np.asarray(run(layer, batch)), want, rtol=1e-5,
                                       atol=1e-6, err_msg=name)
            # the reference takes the sharded layer and batch as they are (Explicit axes:
            # gathered first), eagerly and under jit
            for reference in (dense_forward, nnx.jit(dense_forward)):
                np.testing.assert_allclose(np.asarray(reference(layer, batch)[0]), want,
                                           rtol=1e-5, atol=1e-6, err_msg=name)
        made_inside = nnx.jit(lambda l: l(jax.random.normal(jax.random.key(4), (8, 3, 16)))[0])
        np.testing.assert_allclose(np.asarray(made_inside(layer)), want, rtol=1e-5, atol=1e-6)


def test_capacity_factor_drops_and_reports():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_expert_capacity_factor=0.25,
                                       moe_benchmark_static_routing=False)
    mesh = _mesh()
    layer = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh)
    # Every token routes to the same experts: the per-destination capacity must overflow.
    layer.router[...] = jnp.zeros_like(layer.router[...]).at[:, :2].set(1.0)
    shard_params(layer, mesh)
    x = jnp.abs(jax.random.normal(jax.random.key(3), (8, 8, 16)))
    with jax.set_mesh(mesh):
        y, aux = nnx.jit(lambda l, x: l(x))(layer, jax.device_put(
            x, NamedSharding(mesh, P(("data", "expert")))))
    assert int(aux["num_dropped"]) > 0
    assert np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_ragged_buffer_factor_bounds_buffers_and_reports_drops(backend):
    # Every token picks experts 0 and 1, both on expert rank 0 (L = 2): T = 8 tokens per
    # device, so with factor 1 rank 0's buffers hold the balanced load, not the 4x it gets.
    mesh = _mesh()
    x = jax.device_put(jnp.abs(jax.random.normal(jax.random.key(3), (8, 8, 16))),
                       NamedSharding(mesh, P(("data", "expert"))))

    def run(**extra):
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                           moe_flex_dispatcher_backend=backend,
                                           moe_permute_fusion=True, **extra)
        layer = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh)
        layer.router[...] = jnp.zeros_like(layer.router[...]).at[:, :2].set(1.0)
        shard_params(layer, mesh)
        with jax.set_mesh(mesh):
            return nnx.jit(lambda l, x: l(x))(layer, x)

    y_worst, aux_worst = run()
    y_large, aux_large = run(ragged_buffer_factor=8.0)  # at least the worst case: no change
    y_bound, aux_bound = run(ragged_buffer_factor=1.0)
    assert int(aux_worst["num_dropped"]) == int(aux_large["num_dropped"]) == 0
    np.testing.assert_array_equal(np.asarray(y_large), np.asarray(y_worst))
    # Per data slice rank 0 gets 32 (token, rank) rows = 64 (token, expert) pairs. Both
    # backends: R = ceil(1 * T * min(K, P)) = 16 rows (16 dropped), then ceil(1 * T * K) = 16
    # pairs of the 32 those rows hold (16 more).
    assert int(aux_bound["num_dropped"]) == 2 * 32
    assert np.isfinite(np.asarray(y_bound)).all()


@pytest.mark.parametrize("other", [dict(ragged_buffer_factor=2.0), dict(num_worst_tokens=8),
                                   dict(num_permuted_tokens=8),
                                   dict(moe_expert_capacity_factor=1.0),
                                   dict(moe_deepep_async_dispatch=True)])
def test_dropless_buffer_factor_refuses_what_bounds_or_splits_the_buffers(other):
    with pytest.raises(ValueError, match="dropless_buffer_factor.*" + next(iter(other))):
        jax_ep.TokenDispatcherConfig(dropless_buffer_factor=1.5, **other)
    jax_ep.TokenDispatcherConfig(**other)  # each is fine alone


def test_dropless_buffer_factor_refuses_the_layers_capacity_factor():
    dispatcher = jax_ep.TokenDispatcherConfig(dropless_buffer_factor=1.5)
    with pytest.raises(ValueError, match="dropless_buffer_factor.*moe_expert_capacity_factor"):
        MoEConfig(num_moe_experts=8, moe_expert_capacity_factor=1.0,
                  token_dispatcher=dispatcher)
    with pytest.raises(ValueError, match="dropless_buffer_factor.*moe_expert_capacity_factor"):
        MoEConfig.from_dict(dict(num_moe_experts=8, moe_expert_capacity_factor=1.0,
                                 dropless_buffer_factor=1.5))


def _expert_pair_inputs(pairs):
    """Tokens [16, 8, 16] whose router (see _pin_router) picks experts pairs[t] (t over the
    128 tokens in order; H dims 0..7 are the experts' logits, 10 on the pair, noise below)."""
    noise = 0.01 * jax.random.normal(jax.random.key(6), (128, 16))
    rows = jnp.arange(128)
    x = noise.at[rows, pairs[:, 0]].set(10.0).at[rows, pairs[:, 1]].set(10.0)
    return x.reshape(16, 8, 16)


def _pin_router(layer):
    """Router [16, 8] = identity on H dims 0..7: a token's logit for expert e is x[e]."""
    layer.router[...] = jnp.eye(16, 8)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_dropless_buffer_factor_drops_nothing_and_falls_back_when_routing_overflows(
        backend, monkeypatch):
    # T = 16 tokens per device, E = 8, K = 2, P = 4 (L = 2): the balanced load is 32 slots
    # per rank. Factor 2 bounds the permuted buffer to 64 slots, half the worst case (deepep:
    # 64 received rows x 2 local experts; hybridep: P*T*min(K, L)). The random router fits
    # in it. With every token on experts 0 and 1 (rank 0 gets 128 slots) it does not, and
    # the layer runs the worst-case buffers instead. With the first data slice's tokens on
    # experts 0 and 1 and the second's spread evenly (32 slots per rank) one expert group
    # overflows and the other fits: every device must still take the same branch, or the
    # peer transport's exchanges (which meet all 8 devices) would wait for ever. The
    # fallback runs the tokens in two chunks of 8, whose worst case fits in 64 slots.
    from jax_ep.flax import moe
    mesh = _mesh()
    t = jnp.arange(128)
    on_rank0 = jnp.stack([jnp.zeros_like(t), jnp.ones_like(t)], axis=1)
    spread = jnp.stack([2 * t % 8, (2 * t + 1) % 8], axis=1)
    inputs = {"random": jax.random.normal(jax.random.key(3), (16, 8, 16)),
              "skewed": _expert_pair_inputs(on_rank0),
              "one data slice skewed": _expert_pair_inputs(
                  jnp.where((t < 64)[:, None], on_rank0, spread))}
    cot = jax.random.normal(jax.random.key(4), (16, 8, 16))
    expert_rows = []
    real_experts = moe.swiglu_experts

    def recording_experts(tokens, *args, **kwargs):
        expert_rows.append(tokens.shape[0])
        return real_experts(tokens, *args, **kwargs)
    monkeypatch.setattr(moe, "swiglu_experts", recording_experts)

    def run(routing, **extra):
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                           moe_flex_dispatcher_backend=backend,
                                           moe_permute_fusion=True, **extra)
        layer = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh)
        if routing != "random":
            _pin_router(layer)
        shard_params(layer, mesh)

        def loss(layer, x):
            y, aux = layer(x)
            return jnp.sum(y * cot), aux

        expert_rows.clear()
        xs = jax.device_put(inputs[routing], NamedSharding(mesh, P(("data", "expert"))))
        with jax.set_mesh(mesh):
            (value, aux), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1),
                                                             has_aux=True))(layer, xs)
        return value, aux, grads, sorted(set(expert_rows))

    # The bounded buffers alone (ragged_buffer_factor) drop rank 0's 64 slots past 64 in
    # each overflowing data slice, and nothing in the even one.
    for routing, drops in (("random", 0), ("skewed", 128), ("one data slice skewed", 64)):
        assert int(run(routing, ragged_buffer_factor=2.0)[1]["num_dropped"]) == drops
    worst_rows = 128
    for routing, fell_back in (("random", 0), ("skewed", 1), ("one data slice skewed", 1)):
        want, want_aux, want_grads, rows = run(routing)
        assert rows == [worst_rows]
        got, aux, grads, rows = run(routing, dropless_buffer_factor=2.0)
        # both branches' expert buffers are 64 rows: the bounded one, and the fallback's two
        # chunks of 8 tokens in their worst case (4 ranks x 8 tokens x 2 local experts)
        assert rows == [64]
        assert int(aux["buffer_overflow"]) == fell_back, routing
        assert int(aux["num_dropped"]) == int(want_aux["num_dropped"]) == 0
        np.testing.assert_array_equal(aux["tokens_per_expert"], want_aux["tokens_per_expert"])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(grads[1], want_grads[1], rtol=1e-5, atol=1e-6)
        # (the fallback sums the weights' gradients chunk by chunk: fp32 rounding of sums
        # over 128 rows in another order)
        assert_param_grads_close(grads[0], want_grads[0], rtol=1e-5,
                                 atol=5e-5 if fell_back else 1e-6)
    assert "buffer_overflow" not in want_aux


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep", "hybridep"])
def test_bounded_forward_cond_takes_what_its_backend_was_measured_fastest_with(backend):
    # The fallback's cond is the forward's only one. HybridEP's takes the inputs of
    # bounded_forward's step (tokens, probs, ids, the two expert weights) and nothing computed
    # in it, and a select picks y; the deepep family's also takes the bounded path's y and
    # dropped count and passes them on. Each form was the faster one of its backend on
    # XLA:CPU, by 2-5% of the E = 8 step (benchmarks/RESULTS.md, session 32).
    mesh = _mesh()
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_flex_dispatcher_backend=backend,
                                       moe_permute_fusion=True, dropless_buffer_factor=2.0)
    layer = shard_params(MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(0), (16, 8, 16))
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x)
    (outer, eqn), = [(j, e) for j, e in nested_eqns(closed.jaxpr) if e.primitive.name == "cond"]
    produced = {v for e in outer.eqns for v in e.outvars}
    inputs = [v for v in eqn.invars[1:] if v in outer.invars and v not in produced]
    computed = [v.aval.shape for v in eqn.invars[1:] if v in produced]
    assert [v.aval.shape for v in inputs] == [(16, 16), (16, 2), (16, 2), (2, 16, 64),
                                               (2, 32, 16)]
    assert computed == ([] if backend == "hybridep" else [(16, 16), ()])


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_worst_case_buffers_far_above_the_routed_rows_warn_once_bounded_ones_do_not(
        backend, monkeypatch):
    # E = 64, K = 8 on 8 expert ranks (L = 8): the no-drop worst case is P*T*min(K, L) = 8x
    # the T*K routed rows, which at model scale is an unrunnable buffer (DeepSeek-V3, EP 64:
    # ~157 GiB a device); E = 8, K = 2 on 4 ranks is 4x and stays quiet. The byte threshold
    # is lowered so that a small layer shows it.
    import warnings

    from jax_ep.flax import moe
    monkeypatch.setattr(moe, "UNBOUNDED_BUFFER_WARN_BYTES", 0)

    def messages(num_experts, top_k, mesh_shape, **extra):
        mesh = jax.make_mesh(mesh_shape, ("data", "expert"))
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=num_experts, moe_router_topk=top_k,
                                           moe_flex_dispatcher_backend=backend,
                                           moe_share_token_dispatcher=False, **extra)
        layer = MoELayer(cfg, 16, 16, rngs=nnx.Rngs(0), mesh=mesh)
        x = jax.ShapeDtypeStruct((8 * 16, 16), jnp.float32,
                                 sharding=NamedSharding(mesh, P(("data", "expert"))))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with jax.set_mesh(mesh):
                nnx.eval_shape(lambda layer, x: layer(x), layer, x)
        return [str(w.message) for w in seen if "worst-case buffers" in str(w.message)]

    (message,) = messages(64, 8, (1, 8))
    assert "for 128 routed on average (T*K)" in message, message
    assert "dropless_buffer_factor=1.25" in message
    assert messages(64, 8, (1, 8), dropless_buffer_factor=1.25) == []
    assert messages(64, 8, (1, 8), ragged_buffer_factor=2.0) == []
    # a capacity factor drops by design (and refuses dropless_buffer_factor): no advice
    assert messages(64, 8, (1, 8), moe_expert_capacity_factor=4.0) == []
    assert messages(8, 2, (2, 4)) == []
    # the backend's own bound quiets it; the other family's field bounds nothing here
    own, other = (("num_permuted_tokens", "num_worst_tokens") if backend == "hybridep"
                  else ("num_worst_tokens", "num_permuted_tokens"))
    assert messages(64, 8, (1, 8), **{own: 256}) == []
    assert len(messages(64, 8, (1, 8), **{other: 256})) == 1


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
@pytest.mark.parametrize("routing", ["skewed", "random"])
@pytest.mark.parametrize("fp8", [False, True])
def test_bounded_fallback_in_uneven_chunks_matches_the_unbounded_path(backend, routing, fp8):
    _bounded_fallback_vs_unbounded(backend, routing, fp8)


def test_bounded_fallback_under_x64():
    """With jax_enable_x64 (moe_router_dtype="fp64" needs it) the fallback's drop count is
    still int32, as the bounded branch's: the lax.cond's branches agree."""
    with jax.enable_x64(True):
        _bounded_fallback_vs_unbounded("deepep", "skewed", False)


def test_bounded_forward_takes_any_token_shape_and_top_k_zero():
    """bounded_forward takes [..., H] tokens as token_permutation2 does (it counted the batch
    dimension as the tokens), and a routing of width K = 0 (its fallback's chunk count divided
    by zero): both give the plain path's result."""
    num_ranks, E, K, H = 4, 8, 2, 8
    L = E // num_ranks
    rng = np.random.default_rng(6)
    x = rng.standard_normal((num_ranks * 2, 2, H)).astype(np.float32)  # [B=2, S=2, H] a rank
    idx, w = random_routing(rng, num_ranks * 4, K, E)

    def dispatcher(**extra):
        return MoEFlexTokenDispatcher(L, list(range(L)), jax_ep.TokenDispatcherConfig(
            num_moe_experts=E, moe_router_topk=K, expert_axis_name=AXIS, **extra))

    def experts(rows, counts, probs, s):
        return jnp.sin(rows) * probs[:, None]

    def body(x, idx, w):
        bounded, plain = dispatcher(dropless_buffer_factor=1.0), dispatcher()
        out = []
        for i, p in ((idx, w), (idx[:, :0], w[:, :0])):
            y, _, dropped = bounded.bounded_forward(x, p, i, experts, ())
            rows, tpe, probs, state = plain.token_permutation2(x, 4, p, i)
            want = plain.token_unpermutation(experts(rows, tpe, probs, ()), state)
            out += [y, want.reshape(x.shape), dropped.reshape(1)]
        return tuple(out)
    y, want, dropped, y0, want0, dropped0 = (
        np.asarray(v) for v in run_ep(body, ep_mesh(num_ranks), x, idx, w))
    assert y.shape == x.shape and np.abs(want).max() > 0
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert not y0.any() and not want0.any() and not dropped.any() and not dropped0.any()
    assert dispatcher(dropless_buffer_factor=1.0).fallback_chunks(4, 0) == 1


def _bounded_fallback_vs_unbounded(backend, routing, fp8):
    """bounded_forward's fallback over chunks that do not divide the tokens: T = 10 per rank,
    P = 4, E = 8, K = 2, f = 1.25 (25 bounded slots, 8 worst-case slots a token) runs 4
    chunks of 3 tokens, 2 of them padding (HybridEP, whose buffers count tokens in fours:
    30 slots for 12 tokens, 3 chunks of 4). Skewed routing (every token on experts 0 and 1)
    overflows and takes it; values and gradients (tokens, weights, the experts' parameter)
    equal those of the unbounded dispatcher's path, with FP8 on the dispatch wire too (the
    padding tokens' zero rows cast as well), and nothing is dropped."""
    num_ranks, T, H, K, E = 4, 10, 128, 2, 8
    L = E // num_ranks
    rng = np.random.default_rng(5)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    if routing == "skewed":
        idx = np.tile(np.int32([[0, 1]]), (num_ranks * T, 1))
    scale = np.full((num_ranks,), 0.7, np.float32)

    def dispatcher(**extra):
        return MoEFlexTokenDispatcher(L, list(range(L)), jax_ep.TokenDispatcherConfig(
            num_moe_experts=E, moe_router_topk=K, moe_flex_dispatcher_backend=backend,
            expert_axis_name=AXIS, moe_fp8_dispatch=fp8, **extra))

    def experts(rows, counts, probs, s):
        return jnp.sin(rows * s[0]) * probs[:, None]

    def body(x, idx, w, s):
        bounded, plain = dispatcher(dropless_buffer_factor=1.25), dispatcher()
        assert bounded.fallback_chunks(T, K) == (3 if backend == "hybridep" else 4)

        def via_bounded(x, w, s):
            y, overflow, dropped = bounded.bounded_forward(x, w, idx, experts, s)
            return jnp.sum(jnp.cos(y)), (overflow, dropped)

        def via_plain(x, w, s):
            rows, tpe, probs, state = plain.token_permutation2(x, x.shape[0], w, idx)
            y = plain.token_unpermutation(experts(rows, tpe, probs, s), state)
            return jnp.sum(jnp.cos(y)), (jnp.int32(0), state.num_dropped)

        got = jax.value_and_grad(via_bounded, argnums=(0, 1, 2), has_aux=True)(x, w, s)
        want = jax.value_and_grad(via_plain, argnums=(0, 1, 2), has_aux=True)(x, w, s)
        return tuple(jnp.reshape(v, (1, -1)) for v in jax.tree.leaves((got, want)))

    out = [np.asarray(v) for v in run_ep(body, ep_mesh(num_ranks), x, idx, w, scale)]
    (value, overflow, dropped, *grads), (want_value, _, want_dropped, *want_grads) = (
        out[:6], out[6:])
    if routing == "skewed":
        assert overflow.tolist() == [[1]] * num_ranks
    assert not dropped.any() and not want_dropped.any()
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, want in zip(grads, want_grads):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_dispatcher_methods_match_functional_ops():
    num_ranks, T, H, K, E = 4, 6, 8, 2, 8
    x, idx, w = _routed_tokens(0, num_ranks * T, H, K, E, unrouted=0.0)
    d = _dispatcher(num_ranks, E, K, moe_permute_fusion=True)

    def body(x, i, w):
        hidden, state = d.dispatch_preprocess2(x, x.shape[0], w, i)
        received, state = d.dispatch_all_to_all(hidden, state)
        tokens, tpe, pp, state = d.dispatch_postprocess(received, state)
        # functional twin
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS)
        rm, rp = ops.indices_to_multihot(ri, rw, num_experts=E // num_ranks)
        want = ops.permute(rx, rm, rp, num_out_tokens=tokens.shape[0])
        back = d.token_unpermutation(tokens * pp[:, None], state)
        return tokens, want[0], pp, want[1], tpe, want[3], back

    tokens, want_tokens, pp, want_pp, tpe, want_tpe, back = map(
        np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(pp, want_pp)
    np.testing.assert_array_equal(tpe, want_tpe)
    np.testing.assert_allclose(back, x * w.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_token_permutation_from_dense_probs(backend):
    """PyTorch calling convention: hidden [..., H] flattened to num_local_tokens rows, dense
    probs [T,E] (zero where not routed); combine restores the input shape."""
    num_ranks, T, H, K, E = 2, 4, 8, 2, 4
    rng = np.random.default_rng(1)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    dense = np.zeros((num_ranks * T, E), np.float32)
    np.put_along_axis(dense, idx, w, axis=1)
    x = rng.standard_normal((num_ranks * T // 2, 2, H)).astype(np.float32)  # [S, B, H]
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_flex_dispatcher_backend=backend,
                                       expert_axis_name=AXIS)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)

    def body(x, probs):
        tokens, tpe, pp, state = d.token_permutation(x, probs.shape[0], probs)
        return d.token_unpermutation(tokens * pp[:, None], state)

    out = np.asarray(run_ep(body, ep_mesh(num_ranks), x, dense))
    assert out.shape == x.shape
    np.testing.assert_allclose(out.reshape(-1, H), x.reshape(-1, H) * w.sum(1)[:, None],
                               rtol=1e-5)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_megatron_call_form_with_a_routing_map(backend):
    """Megatron's dispatcher calls: dispatch_preprocess(hidden, routing_map, probs) (the map in
    NeMo's num_local_tokens place), token_dispatch / token_combine for the exchanges. HybridEP
    routes by the map itself, here one that leaves some tokens with a single expert though
    probs has K non-zeros; the deepep family by the top-k of probs, as Megatron's DeepEP
    manager (which ignores the map)."""
    num_ranks, T, H, K, E = 4, 4, 8, 2, 8
    rng = np.random.default_rng(8)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    dense = np.zeros((num_ranks * T, E), np.float32)
    np.put_along_axis(dense, idx, w, axis=1)
    routing_map = dense > 0
    routing_map[::3, idx[::3, 1]] = False  # every third token keeps its first expert only
    d = _dispatcher(num_ranks, E, K, moe_flex_dispatcher_backend=backend)

    def body(x, routing_map, probs):
        hidden, state = d.dispatch_preprocess(x, routing_map, probs)
        received, state = d.token_dispatch(hidden, state)
        tokens, tpe, pp, state = d.dispatch_postprocess(received, state)
        back = d.combine_preprocess(tokens * pp[:, None].astype(tokens.dtype), state)
        return d.combine_postprocess(d.token_combine(back, state), state)

    out = np.asarray(run_ep(body, ep_mesh(num_ranks), x, routing_map, dense))
    used = routing_map if backend == "hybridep" else dense > 0
    np.testing.assert_allclose(out, x * np.where(used, dense, 0).sum(1, keepdims=True),
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"routing_map: expected bool\[T, num_moe_experts=8\]"):
        run_ep(body, ep_mesh(num_ranks), x, dense, dense)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_dense_probs_route_only_the_top_k(backend):
    """Megatron's dropless dispatcher test passes probs = 1/K for every expert: each token goes
    to its K highest-prob experts (ties to the lowest ids, as torch.topk), never to all E, so
    the round trip gives x back and nothing is dropped. A row with more than K distinct
    non-zero probs routes its top K only."""
    num_ranks, T, H, K, E = 4, 4, 8, 2, 8
    rng = np.random.default_rng(3)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    d = _dispatcher(num_ranks, E, K, moe_flex_dispatcher_backend=backend)

    def body(x, probs):
        tokens, tpe, pp, state = d.token_permutation(x, x.shape[0], probs)
        return (d.token_unpermutation(tokens * pp[:, None], state), tpe[None],
                state.num_dropped[None])

    uniform = np.full((num_ranks * T, E), 1.0 / K, np.float32)
    out, tpe, dropped = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, uniform))
    np.testing.assert_allclose(out, x, rtol=1e-6)
    assert not dropped.any()
    # experts 0 and 1 (rank 0) take every token; the others none
    np.testing.assert_array_equal(tpe.reshape(-1), [num_ranks * T] * K + [0] * (E - K))

    graded = rng.uniform(0.1, 1.0, (num_ranks * T, E)).astype(np.float32)  # all non-zero
    top = np.argsort(-graded, axis=1)[:, :K]
    out = np.asarray(run_ep(body, ep_mesh(num_ranks), x, graded)[0])
    np.testing.assert_allclose(out, x * np.take_along_axis(graded, top, 1).sum(1)[:, None],
                               rtol=1e-5)


def test_training_loss_equal_across_backends_and_sharding_kept():
    mesh = _mesh()
    losses = {}
    for backend in BACKENDS:
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                           moe_flex_dispatcher_backend=backend,
                                           moe_permute_fusion=backend != "alltoall")
        layer, _ = _layer_pair(cfg, mesh)
        opt = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
        x = jax.device_put(jax.random.normal(jax.random.key(4), (8, 4, 16)),
                           NamedSharding(mesh, P(("data", "expert"))))
        target = jnp.roll(x, 1, axis=-1)

        @nnx.jit
        def step(layer, opt, x):
            def loss(layer):
                y, aux = layer(x)
                return jnp.mean((y - target) ** 2) + aux["aux_loss"]
            value, grads = nnx.value_and_grad(loss)(layer)
            opt.update(layer, grads)
            return value

        with jax.set_mesh(mesh):
            losses[backend] = [float(step(layer, opt, x)) for _ in range(20)]
        assert layer.w_gate_up[...].sharding.spec[0] == "expert"
        assert losses[backend][-1] < losses[backend][0]
    for backend in BACKENDS[1:]:
        np.testing.assert_allclose(losses[backend], losses["deepep"], rtol=1e-4)


def test_remat_gives_the_same_gradients():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2)
    mesh = _mesh()
    layer, _ = _layer_pair(cfg, mesh)
    x = jax.device_put(jax.random.normal(jax.random.key(5), (8, 4, 16)),
                       NamedSharding(mesh, P(("data", "expert"))))

    def loss(layer, x):
        return jnp.sum(layer(x)[0] ** 2)

    def remat_loss(layer, x):
        return jnp.sum(nnx.remat(lambda l, x: l(x)[0])(layer, x) ** 2)

    with jax.set_mesh(mesh):
        g1 = nnx.jit(nnx.grad(loss))(layer, x)
        g2 = nnx.jit(nnx.grad(remat_loss))(layer, x)
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(g1, nnx.Param)),
                              nnx.to_flat_state(nnx.state(g2, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scalar_state", [False, True])
def test_scanned_layers_match_the_unrolled_stack(scalar_state):
    """Flax's scanned-layers pattern: 3 layers made by nnx.vmap (a leading layer axis on every
    param) and applied by nnx.scan give the loss and the stacked gradients of the same layers
    applied one by one in a Python loop. A layer of the same config built first, outside the
    transform, holds the shared dispatcher (moe_share_token_dispatcher): the vmapped layers
    must not take it (nnx refuses a module of another trace level). scalar_state: a router
    with scalar state variables (global_aux_loss's step count, force balancing's draw
    counter), stacked and scanned with Flax's transform_metadata (the layer axis added to
    every variable's sharding): the scan failed in Flax's remove_axis (IndexError) while the
    scalars carried an empty sharding."""
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2)
    metadata = {}
    if scalar_state:
        cfg = MoEConfig(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                        moe_router_load_balancing_type="global_aux_loss",
                        moe_router_force_load_balancing=True)
        metadata = dict(transform_metadata={nnx.PARTITION_NAME: None})
    mesh, num_layers = _mesh(), 3

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, **metadata)
    def make(rngs):
        return MoELayer(cfg, 16, 32, rngs=rngs, mesh=mesh)

    def scanned(layers, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, **metadata)
        def body(layer, h):
            return h + layer(h)[0]
        return jnp.mean(body(layers, x) ** 2)

    def unrolled(layers, x):
        graphdef, state = nnx.split(layers)
        h = x
        for i in range(num_layers):
            h = h + nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))(h)[0]
        return jnp.mean(h ** 2)

    with jax.set_mesh(mesh):
        outside = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(1), mesh=mesh)
        layers = make(nnx.Rngs(0))
        assert outside.dispatcher is MoELayer(cfg, 16, 32, rngs=nnx.Rngs(2),
                                              mesh=mesh).dispatcher
        if scalar_state:
            assert layers.ga_steps.shape == layers.force_balance_step.shape == (num_layers,)
            assert layers.w_gate_up.get_metadata()["out_sharding"][0] is None
        x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 4, 16)),
                           NamedSharding(mesh, P(("data", "expert"))))
        # each on a copy: a call moves the layers' state (force balancing's draw counters)
        runs = {f: nnx.clone(layers) for f in (scanned, unrolled)}
        (got, g1), (want, g2) = (nnx.jit(nnx.value_and_grad(f))(m, x) for f, m in runs.items())
        if scalar_state:  # the scan wrote each layer's advanced counter back
            np.testing.assert_array_equal(np.asarray(runs[scanned].force_balance_step[...]),
                                          np.asarray(layers.force_balance_step[...]) + 1)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(g1, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(g2, nnx.Param))):
        assert a[...].shape[0] == num_layers, path
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5,
                                   atol=1e-7, err_msg=str(path))


def test_shared_dispatcher_and_inside_user_shard_map():
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       expert_axis_name=AXIS)
    a = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(0), expert_parallel_size=4)
    b = MoELayer(cfg, 16, 32, rngs=nnx.Rngs(1), expert_parallel_size=4)
    assert a.dispatcher is b.dispatcher
    own = dataclasses.replace(cfg, moe_share_token_dispatcher=False)
    assert MoELayer(own, 16, 32, rngs=nnx.Rngs(0), expert_parallel_size=4).dispatcher \
        is not a.dispatcher
    mesh = ep_mesh(4)
    x = jax.random.normal(jax.random.key(6), (16, 16))
    want, _ = dense_forward(a, x)
    shard_params(a, mesh)
    graphdef, state = nnx.split(a)
    specs = nnx.get_partition_spec(state)

    def body(x, state):
        return nnx.merge(graphdef, state)(x)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=P(AXIS))
    out = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P(AXIS))), state)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


def _numpy_expert_drop(routing_map, probs, capacity, policy):
    """Oracle: per expert, the `capacity` routed tokens with the highest probs (ties: lower
    token first) or the first `capacity` routed tokens."""
    keep = np.zeros_like(routing_map)
    for e in range(routing_map.shape[1]):
        tokens = np.flatnonzero(routing_map[:, e])
        if policy == "probs":
            tokens = sorted(tokens, key=lambda t: (-probs[t, e], t))
        keep[list(tokens[:capacity]), e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 40])
def test_drop_to_expert_capacity_matches_oracle(policy, capacity):
    rng = np.random.default_rng(capacity)
    T, E = 24, 6
    routing_map = rng.random((T, E)) < 0.5
    probs = np.where(routing_map, rng.integers(1, 5, (T, E)) / 4, 0).astype(np.float32)  # ties
    keep, kept_probs, dropped = jax.jit(
        lambda m, p: jax_ep.deepep.drop_to_expert_capacity(m, p, capacity=capacity,
                                                           drop_policy=policy))(routing_map, probs)
    want = _numpy_expert_drop(routing_map, probs, capacity, policy)
    np.testing.assert_array_equal(keep, want)
    np.testing.assert_array_equal(kept_probs, np.where(want, probs, 0))
    assert int(dropped) == routing_map.sum() - want.sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_factor_is_megatrons_per_expert_capacity(backend):
    # Megatron's dispatcher capacity test: every expert ends up with at most
    # get_capacity(T*K, E, factor) * EP tokens. Here every token picks experts 0 and 1 (rank 0),
    # so each keeps its ceil(16*2/8) = 4 highest-probability tokens per source rank.
    num_ranks, T, H, K, E = 4, 16, 8, 2, 8
    rng = np.random.default_rng(5)
    idx = np.tile(np.array([[0, 1]], np.int32), (num_ranks * T, 1))
    w = rng.permutation(num_ranks * T * K).reshape(-1, K).astype(np.float32) / 200 + 0.1
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_expert_capacity_factor=1.0,
                                       moe_flex_dispatcher_backend=backend,
                                       expert_axis_name=AXIS)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)

    def body(x, i, w):
        tokens, tpe, pp, state = d.token_permutation2(x, x.shape[0], w, i)
        back = d.token_unpermutation(tokens * pp[:, None], state)
        return tpe, state.num_dropped[None], back

    tpe, dropped, back = map(np.asarray, run_ep(body, ep_mesh(num_ranks), x, idx, w))
    c = 4
    np.testing.assert_array_equal(tpe.reshape(num_ranks, -1)[0], [c * num_ranks] * 2)
    assert not tpe.reshape(num_ranks, -1)[1:].any()
    np.testing.assert_array_equal(dropped, [(T - c) * K] * num_ranks)
    # Which tokens survive: per rank and expert, the c highest weights.
    want = np.zeros_like(x)
    for r in range(num_ranks):
        rows = slice(r * T, (r + 1) * T)
        for k in range(K):
            top = np.argsort(-w[rows, k], kind="stable")[:c] + r * T
            want[top] += x[top] * w[top, k:k + 1]
    np.testing.assert_allclose(back, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, extra", [
    ("deepep", {}), ("alltoall", {}), ("hybridep", {}),
    ("hybridep", dict(moe_hybridep_compact_routing=True))],
    ids=["deepep", "alltoall", "hybridep-dense", "hybridep-compact"])
@pytest.mark.parametrize("bad", [99, -5])
def test_capacity_drop_keeps_invalid_ids_for_dispatch_to_count(bad, backend, extra):
    # The capacity drop clears only routed pairs it drops; an invalid id still reaches
    # dispatch, which routes it nowhere and counts it (HybridEP's dense routing counts it when
    # dispatch_preprocess2 builds the map, and its handle reports it the same way).
    num_ranks, T, H, K, E = 4, 6, 8, 2, 8
    rng = np.random.default_rng(8)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.0)
    idx[2, 0] = bad  # rank 0 only
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=E, moe_router_topk=K,
                                       moe_expert_capacity_factor=4.0, expert_axis_name=AXIS,
                                       moe_flex_dispatcher_backend=backend, **extra)
    d = MoEFlexTokenDispatcher(E // num_ranks, range(E // num_ranks), cfg)

    def body(x, i, w):
        tokens, _, pp, state = d.token_permutation2(x, x.shape[0], w, i)
        back = d.token_unpermutation(tokens * pp[:, None], state)
        return state.handle.num_invalid[None], state.num_dropped[None], back

    invalid, dropped, back = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    np.testing.assert_array_equal(invalid, [1, 0, 0, 0])
    assert not np.asarray(dropped).any()  # capacity 4*T*K/E = 6 = T: nothing to drop
    routed = (idx >= 0) & (idx < E)
    want = x * np.where(routed, w, 0.0).sum(axis=1, keepdims=True)  # the bad slot adds nothing
    np.testing.assert_allclose(back, want, rtol=1e-5, atol=1e-5)


def test_initialize_metadata_views_probs_per_destination_rank():
    """NeMo's MoEFlexTokenDispatcher._initialize_metadata: [T, E] probs as [T, tp*ep, L]."""
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8)
    d = MoEFlexTokenDispatcher(2, [0, 1], cfg)
    probs = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    got = np.asarray(d._initialize_metadata(3, probs))
    assert got.shape == (3, 4, 2)
    for t in range(3):
        for p in range(4):  # rank p's experts 2p, 2p + 1
            np.testing.assert_array_equal(got[t, p], probs[t, 2 * p:2 * p + 2])
    np.testing.assert_array_equal(np.asarray(d._initialize_metadata(3, probs.ravel())), got)
    with pytest.raises(ValueError, match="probs: expected num_local_tokens"):
        d._initialize_metadata(4, probs)


@pytest.mark.parametrize("fusion", [False, True])
def test_hybridep_metadata_processor_is_nemos(fusion):
    """NeMo's hybridep_metadata_processor: (token_indices, token_probs) -> (routing_map,
    multihot_probs) by hand (NeMo's test case), on the hybridep dispatcher only."""
    from jax_ep.flax import HybridEPMetadataProcessor
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_permute_fusion=fusion)
    assert MoEFlexTokenDispatcher(2, [0, 1], cfg).hybridep_metadata_processor is None
    d = MoEFlexTokenDispatcher(2, [0, 1], dataclasses.replace(
        cfg, moe_flex_dispatcher_backend="hybridep"))
    processor = d.hybridep_metadata_processor
    assert isinstance(processor, HybridEPMetadataProcessor)
    assert (processor.num_experts, processor.permute_fusion) == (8, fusion)
    # a record of the config: equal dispatchers stay equal to nnx (no retrace per instance)
    twin = MoEFlexTokenDispatcher(2, [0, 1], d.config)
    assert twin.hybridep_metadata_processor == processor
    assert nnx.graphdef(twin) == nnx.graphdef(d)
    routing_map, probs = processor(jnp.array([[0, 3], [1, -1]]),
                                   jnp.array([[0.6, 0.4], [0.7, 0.0]], jnp.bfloat16))
    want_map = np.zeros((2, 8), bool)
    want_map[0, [0, 3]] = want_map[1, 1] = True
    want_probs = np.zeros((2, 8), np.float32)
    want_probs[0, [0, 3]] = np.asarray(jnp.array([0.6, 0.4], jnp.bfloat16), np.float32)
    want_probs[1, 1] = np.asarray(jnp.array(0.7, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(routing_map), want_map)
    assert probs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(probs), want_probs)
    with pytest.raises(ValueError, match="num_experts"):
        HybridEPMetadataProcessor(num_experts=0, permute_fusion=False)
    # NeMo's compact_routing (third field, default False) and forward(): the metadata is the
    # indices themselves, the probs still dense; the compact dispatcher's processor has it
    assert processor.compact_routing is False
    indices = jnp.array([[0, 3], [1, -1]])
    compact = HybridEPMetadataProcessor(num_experts=8, permute_fusion=fusion,
                                        compact_routing=True)
    metadata, dense = compact.forward(indices, jnp.array([[0.6, 0.4], [0.7, 0.0]],
                                                         jnp.bfloat16))
    assert metadata is indices
    np.testing.assert_array_equal(np.asarray(dense), want_probs)
    compact_d = MoEFlexTokenDispatcher(2, [0, 1], dataclasses.replace(
        d.config, moe_hybridep_compact_routing=True))
    assert compact_d.hybridep_metadata_processor == compact
    with pytest.raises(ValueError, match="compact_routing: expected a bool"):
        HybridEPMetadataProcessor(num_experts=8, permute_fusion=False, compact_routing="no")


@pytest.mark.parametrize("backend, tokens, top_k, ep, experts, factor, want", [
    ("deepep", 10, 2, 4, 8, 1.25, 4),  # 25 bounded rows, 8 a token: chunks of 3
    ("hybridep", 10, 2, 4, 8, 1.25, 3),  # 12 tokens' 30 rows: chunks of 4 (aligned)
    ("deepep", 4096, 8, 8, 256, 1.25, 7),  # DeepSeek-V3-like EP 8: 40960 rows, 64 a token
    ("deepep", 1, 8, 8, 256, 1.25, 1),  # one token: one chunk (10 rows < its worst 64)
    ("hybridep", 6, 8, 8, 256, 1.25, 2),  # chunks of 4 (their worst 256 > 80 bounded rows)
    ("deepep", 0, 2, 4, 8, 1.25, 1),  # no tokens
    ("deepep", 16, 2, 4, 8, 8.0, 1),  # bounded buffers above the worst case
])
def test_fallback_chunks_fit_the_bounded_buffers(backend, tokens, top_k, ep, experts, factor,
                                                 want):
    L = experts // ep
    d = MoEFlexTokenDispatcher(L, list(range(L)), jax_ep.TokenDispatcherConfig(
        num_moe_experts=experts, moe_router_topk=top_k, moe_flex_dispatcher_backend=backend,
        dropless_buffer_factor=factor))
    assert d.fallback_chunks(tokens, top_k) == want


def test_dense_probs_route_zero_prob_slots_nowhere_only_with_a_capacity_factor():
    """dispatch_preprocess's top-k of dense probs (NeMo's DeepEP manager): a token with fewer
    than K non-zero probs dispatches its zero slots with weight 0 (ties to the lower id), and
    with moe_expert_capacity_factor set routes them nowhere (-1): the router's drops."""
    probs = jnp.array([[0.0, 0.7, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0],   # two routed
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],   # one routed, one dropped
                       [0.0] * 8])                                   # all dropped
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       expert_axis_name=AXIS)
    for factor, want in ((None, [[1, 4], [6, 0], [0, 1]]),
                         (1.0, [[1, 4], [6, -1], [-1, -1]])):
        d = MoEFlexTokenDispatcher(2, range(2), dataclasses.replace(
            cfg, moe_expert_capacity_factor=factor))
        _, state = d.dispatch_preprocess(jnp.ones((3, 4)), 3, probs)
        np.testing.assert_array_equal(state.token_indices, want)
        np.testing.assert_array_equal(state.token_probs, np.float32(
            [[0.7, 0.3], [1.0, 0.0], [0.0, 0.0]]))

"""Expert tensor parallelism (MoEConfig.expert_tensor_parallel_size) of MoELayer on emulated
("data", "expert", "tensor") meshes: values and gradients against the dense reference, the
weight layout, the compiled program's collectives and their device groups, training, errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ep_utils import AXIS, assert_param_grads_close, randomize_biases
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.flax import (MoEConfig, MoELayer, dense_forward, gate_up_from_etp, gate_up_to_etp,
                         shard_params, shard_state)
from jax_ep.flax.activations import remove_glu_interleaving
from jax_ep.flax.experts import _expert_major_order

AXES = ("data", "expert", "tensor")
H, F = 16, 32


def _config(etp, backend="deepep", capacity=None, activation=None, **dispatcher):
    """activation: more MoEConfig fields (the experts' activation, latent size, ...)."""
    return MoEConfig(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                     moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=8,
                     moe_expert_capacity_factor=capacity, expert_tensor_parallel_size=etp,
                     token_dispatcher=jax_ep.TokenDispatcherConfig(
                         moe_flex_dispatcher_backend=backend, **dispatcher), **(activation or {}))


def _layer_pair(cfg, mesh):
    """A layer placed on mesh and its twin with identical parameters (for dense_forward)."""
    make = lambda: MoELayer(cfg, H, F, rngs=nnx.Rngs(0), mesh=mesh)  # noqa: E731
    return shard_params(make(), mesh), make()


def _vs_dense(layer, twin, mesh, x):
    """loss = sum(y * cot) + aux_loss of the layer (jit, x split over AXES) and of
    dense_forward(twin): (got, aux, (param grads, x grad), want, (param grads, x grad))."""
    cot = jax.random.normal(jax.random.key(2), x.shape)

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y * cot) + aux["aux_loss"], aux

    def dense_loss(layer, x):
        y, aux_loss = dense_forward(layer, x)
        return jnp.sum(y * cot) + aux_loss

    xs = jax.device_put(x, NamedSharding(mesh, P(AXES)))
    with jax.set_mesh(mesh):
        (got, aux), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            layer, xs)
    want, want_grads = nnx.value_and_grad(dense_loss, argnums=(0, 1))(twin, x)
    return got, aux, grads, want, want_grads


CASES = [((1, 4, 2), None), ((2, 2, 2), None), ((2, 2, 2), 0.5), ((1, 2, 4), 0.5)]


@pytest.mark.parametrize("backend", ["deepep", "alltoall", "hybridep"])
@pytest.mark.parametrize("shape, capacity", CASES)
def test_values_and_gradients_match_dense(backend, shape, capacity):
    mesh = jax.make_mesh(shape, AXES)
    layer, twin = _layer_pair(_config(shape[2], backend, capacity), mesh)
    for w, spec in ((layer.w_gate_up, P("expert", None, "tensor")),
                    (layer.w_down, P("expert", "tensor", None))):
        assert w[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 3)
    x = jax.random.normal(jax.random.key(1), (8, 6, H))
    got, aux, (grads, dx), want, (want_grads, want_dx) = _vs_dense(layer, twin, mesh, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)
    # every token counted once over (data, expert, tensor): kept slots + dropped = B*S*K
    kept, dropped = int(aux["tokens_per_expert"].sum()), int(aux["num_dropped"])
    assert kept + dropped == 8 * 6 * 2
    assert (dropped > 0) == (capacity is not None)


@pytest.mark.parametrize("extra", [dict(activation=dict(activation_func="quick_gelu",
                                                        glu_linear_offset=1.0,
                                                        activation_func_clamp_value=1.5)),
                                   # Megatron's MLP experts: fc1 [E,H,F], plain column shards
                                   dict(activation=dict(gated_linear_unit=False,
                                                        activation_func="squared_relu")),
                                   # latent MoE: the experts (and their shards) in D = 8
                                   dict(activation=dict(moe_latent_size=8)),
                                   dict(moe_deepep_async_dispatch=True, num_overlap_chunks=2),
                                   dict(moe_router_expert_pad_multiple=4),
                                   dict(grouped_gemm_impl="ragged_dot"),
                                   dict(grouped_gemm_impl="blocks"),
                                   dict(grouped_gemm_impl="tiled")])
def test_overlap_padded_blocks_and_ragged_dot_match_dense(extra):
    mesh = jax.make_mesh((2, 2, 2), AXES)
    layer, twin = _layer_pair(_config(2, **extra), mesh)
    x = jax.random.normal(jax.random.key(3), (8, 6, H))
    got, _, (grads, dx), want, (want_grads, want_dx) = _vs_dense(layer, twin, mesh, x)
    # the loss sums 768 products of O(1) (squared ReLU's: O(10)) that nearly cancel
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    # The latent projection's gradient entries reach 19; one that cancels to 0.09 keeps its
    # terms' rounding, a few ulp of 19 (4e-6 under conftest's FAST_COMPILE_FLAGS).
    latent = "moe_latent_size" in extra.get("activation", {})
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=1e-5 if latent else 2e-6)


@pytest.mark.parametrize("gated", [True, False])
def test_add_bias_linear_under_expert_tensor_parallelism(gated):
    """add_bias_linear with ETP = 2: b_gate_up split over the tensor axis in fc1's column
    layout, b_down added once after the reduce-scatter; values and gradients (biases
    included) against the dense reference."""
    activation = dict(activation_func="quick_gelu", glu_linear_offset=1.0,
                      gated_linear_unit=gated)
    cfg = dataclasses.replace(_config(2, activation=activation),
                              moe_shared_expert_intermediate_size=None, add_bias_linear=True)
    mesh = jax.make_mesh((2, 2, 2), AXES)
    layer, twin = (MoELayer(cfg, H, F, rngs=nnx.Rngs(0), mesh=mesh) for _ in range(2))
    randomize_biases(layer, twin)
    shard_params(layer, mesh)
    for b, spec in ((layer.b_gate_up, P("expert", "tensor")), (layer.b_down, P("expert", None))):
        assert b[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    x = jax.random.normal(jax.random.key(3), (8, 6, H))
    got, _, (grads, dx), want, (want_grads, want_dx) = _vs_dense(layer, twin, mesh, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-5)
    assert {"b_gate_up", "b_down", "router_bias"} <= set(grads)


@pytest.mark.parametrize("factor, fell_back", [(8.0, 0), (0.25, 1)])
def test_dropless_buffer_factor_matches_dense_on_both_branches(factor, fell_back):
    # The tensor axis's all-gathers run inside the branches: 0.25 of the balanced load always
    # overflows, 8x never does.
    mesh = jax.make_mesh((2, 2, 2), AXES)
    layer, twin = _layer_pair(_config(2, dropless_buffer_factor=factor), mesh)
    x = jax.random.normal(jax.random.key(3), (8, 6, H))
    got, aux, (grads, dx), want, (want_grads, want_dx) = _vs_dense(layer, twin, mesh, x)
    assert int(aux["buffer_overflow"]) == fell_back
    assert int(aux["num_dropped"]) == 0
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_empty_batch_gives_empty_output_and_zero_gradients(backend):
    mesh = jax.make_mesh((2, 2, 2), AXES)
    layer, _ = _layer_pair(_config(2, backend), mesh)

    def loss(layer, x):
        y, aux = layer(x)
        return y.sum() + aux["aux_loss"], (y, aux)

    x = jnp.zeros((0, 6, H))
    with jax.set_mesh(mesh):
        (value, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
    assert y.shape == x.shape and float(value) == 0.0
    assert not np.asarray(aux["tokens_per_expert"]).any()
    for path, g in nnx.to_flat_state(nnx.state(grads, nnx.Param)):
        assert not np.asarray(g[...]).any(), path


def test_gate_up_layout():
    # F = 4, ETP = 2: [g0 g1 g2 g3 | u0 u1 u2 u3] -> shard 0 [g0 g1 u0 u1], 1 [g2 g3 u2 u3]
    w = np.array([10, 11, 12, 13, 20, 21, 22, 23])
    np.testing.assert_array_equal(gate_up_to_etp(w, 2), [10, 11, 20, 21, 12, 13, 22, 23])
    np.testing.assert_array_equal(gate_up_to_etp(w, 4), [10, 20, 11, 21, 12, 22, 13, 23])
    np.testing.assert_array_equal(gate_up_to_etp(w, 1), w)
    full = np.random.default_rng(0).standard_normal((3, 5, 24)).astype(np.float32)
    for etp in (1, 2, 3, 4, 6, 12):
        np.testing.assert_array_equal(gate_up_from_etp(gate_up_to_etp(full, etp), etp), full)
    # etp not a positive int, F not divisible by etp, an odd width: named, not a reshape error
    for convert in (gate_up_to_etp, gate_up_from_etp):
        for weight, etp, name in ((w, 0, "etp"), (w, 2.0, "etp"), (w, 3, "w_gate_up"),
                                  (np.zeros((4, 10)), 4, "w_gate_up"),
                                  (np.zeros(5), 1, "w_gate_up")):
            with pytest.raises(ValueError, match=f"^{name}:"):
                convert(weight, etp)


def _np_interleave(w, s):
    """[..., 2F] = [gate | up] -> Megatron's moe_mlp_glu_interleave_size layout, in numpy:
    gate's columns b*s ... b*s + s - 1, then up's, for b = 0, 1, ..."""
    F = w.shape[-1] // 2
    blocks = [w[..., half * F + b * s:half * F + (b + 1) * s]
              for b in range(F // s) for half in (0, 1)]
    return np.concatenate(blocks, axis=-1)


def test_glu_interleave_layout():
    # F = 4, s = 2: [g0 g1 g2 g3 | u0 u1 u2 u3] -> [g0 g1 u0 u1 g2 g3 u2 u3]
    w = np.array([10, 11, 12, 13, 20, 21, 22, 23])
    np.testing.assert_array_equal(_np_interleave(w, 2), [10, 11, 20, 21, 12, 13, 22, 23])
    for s in (1, 2, 4):
        x = np.random.default_rng(s).standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_array_equal(remove_glu_interleaving(_np_interleave(x, s), s), x)
        act = jax_ep.flax.activations.GatedActivation("quick_gelu", 1.0, 7.0,
                                                      glu_interleave_size=s)
        np.testing.assert_array_equal(act(_np_interleave(x, s)),
                                      dataclasses.replace(act, glu_interleave_size=None)(x))
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):
        remove_glu_interleaving(jnp.zeros((2, 12)), 4)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):
            MoEConfig(num_moe_experts=8, moe_mlp_glu_interleave_size=bad)
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):
        MoEConfig(num_moe_experts=8, moe_ffn_hidden_size=32, moe_mlp_glu_interleave_size=5)
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):  # 32 // 2 units a rank
        MoELayer(dataclasses.replace(_config(2), moe_mlp_glu_interleave_size=32), H, F,
                 rngs=nnx.Rngs(0), mesh=jax.make_mesh((2, 2, 2), AXES))


@pytest.mark.parametrize("shape, fields", [
    ((2, 4, 1), {}),  # with the shared expert (it stays [gate | up])
    ((2, 2, 2), {}),
    ((2, 2, 2), dict(moe_shared_expert_intermediate_size=None, add_bias_linear=True)),
])
def test_glu_interleaved_fc1_equals_the_plain_layout(shape, fields):
    # Megatron's moe_mlp_glu_interleave_size s: a layer whose w_gate_up (and b_gate_up) is
    # interleave(W) gives the values of the plain layer with W (under ETP S: with
    # gate_up_to_etp(W, S), the interleaved weight needing no reordering), its gradients are
    # the plain ones in its layout, and it matches the dense reference
    etp, s = shape[2], 4
    mesh = jax.make_mesh(shape, AXES)
    plain_cfg = dataclasses.replace(_config(etp), **fields)
    inter_cfg = dataclasses.replace(plain_cfg, moe_mlp_glu_interleave_size=s)
    make = lambda cfg: MoELayer(cfg, H, F, rngs=nnx.Rngs(0), mesh=mesh)  # noqa: E731
    plain, plain_twin, inter, inter_twin = (make(c) for c in (plain_cfg,) * 2 + (inter_cfg,) * 2)
    if plain_cfg.add_bias_linear:
        randomize_biases(plain, plain_twin, inter, inter_twin)
    names = ("w_gate_up", "b_gate_up") if plain_cfg.add_bias_linear else ("w_gate_up",)
    for name in names:
        full = np.asarray(getattr(plain, name)[...])  # read as [gate | up]
        for m in (plain, plain_twin):
            getattr(m, name)[...] = gate_up_to_etp(jnp.asarray(full), etp)
        for m in (inter, inter_twin):
            getattr(m, name)[...] = jnp.asarray(_np_interleave(full, s))
    shard_params(plain, mesh)
    shard_params(inter, mesh)
    x = jax.random.normal(jax.random.key(1), (8, 6, H))
    got, _, (grads, dx), want, (want_grads, want_dx) = _vs_dense(inter, inter_twin, mesh, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)
    plain_got, _, (plain_grads, plain_dx), _, _ = _vs_dense(plain, plain_twin, mesh, x)
    np.testing.assert_allclose(got, plain_got, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, plain_dx, rtol=2e-5, atol=2e-6)
    got_grads = dict(nnx.to_flat_state(nnx.state(grads, nnx.Param)))
    for path, g in nnx.to_flat_state(nnx.state(plain_grads, nnx.Param)):
        g = np.asarray(g[...])
        if path[-1] in names:
            g = _np_interleave(np.asarray(gate_up_from_etp(jnp.asarray(g), etp)), s)
        np.testing.assert_allclose(np.asarray(got_grads[path][...]), g, rtol=2e-5, atol=2e-6,
                                   err_msg=str(path))


def test_expert_major_order_matches_a_loop():
    rng = np.random.default_rng(0)
    S, L, N = 3, 4, 10
    counts = rng.integers(0, 4, (S, L))
    counts[1] = [0, 5, 0, 5]  # a block without padding
    order = np.asarray(_expert_major_order(jnp.asarray(counts, jnp.int32), N))
    rows = []  # (block, row) in the expert-major order, then the padding rows
    for e in range(L):
        for s in range(S):
            start = counts[s, :e].sum()
            rows += [(s, r) for r in range(start, start + counts[s, e])]
    rows += [(s, r) for s in range(S) for r in range(counts[s].sum(), N)]
    want = np.empty(S * N, np.int64)
    for dst, (s, r) in enumerate(rows):
        want[s * N + r] = dst
    np.testing.assert_array_equal(order, want)


def test_etp1_with_a_size1_tensor_axis_is_bitwise_the_two_axis_layer():
    x = jax.random.normal(jax.random.key(4), (8, 6, H))
    outs = []
    for mesh in (jax.make_mesh((2, 4), ("data", "expert")), jax.make_mesh((2, 4, 1), AXES)):
        layer, _ = _layer_pair(_config(1), mesh)
        assert layer.tensor_axis is None and layer._token_axes() == ("data", "expert")
        with jax.set_mesh(mesh):
            y, aux = nnx.jit(lambda m, x: m(x))(layer, x)
        outs.append((np.asarray(y), float(aux["aux_loss"])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1]


def _replica_groups(line):
    """A compiled HLO collective's replica groups as a set of frozensets of device ids, from
    XLA's three spellings: explicit {{0,1},{2,3}}, iota [G,S]<=[dims]T(perm), or mesh axes
    mesh['a'=2,'b'=4] {'b'} (ids laid out over the named dims, a group varies the listed)."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return {frozenset(int(d) for d in g.split(",") if d)
                for g in re.findall(r"\{([\d,]*)\}", m.group(1))}
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(np.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return {frozenset(g.tolist()) for g in ids.reshape(int(m.group(1)), int(m.group(2)))}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    assert m, f"unknown replica_groups spelling: {line}"
    names, sizes = zip(*[(n, int(v)) for n, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))])
    varied = [names.index(n) for n in re.findall(r"'(\w+)'", m.group(2))]
    ids = np.moveaxis(np.arange(np.prod(sizes)).reshape(sizes), varied,
                      list(range(-len(varied), 0)))
    return {frozenset(g.tolist()) for g in ids.reshape(-1, int(np.prod(
        [sizes[i] for i in varied])))}


def _axis_groups(mesh, axis):
    """The device groups (logical ids = positions in the mesh) a collective over `axis` uses."""
    ids = np.moveaxis(np.arange(mesh.size).reshape(mesh.devices.shape),
                      mesh.axis_names.index(axis), -1)
    return {frozenset(g.tolist()) for g in ids.reshape(-1, mesh.shape[axis])}


def _compiled_collectives(layer, mesh, x):
    """(kind, result type, replica groups) of each collective of the compiled forward and
    backward program of sum(y^2) + aux_loss."""
    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y * y) + aux["aux_loss"]

    xs = jax.device_put(x, NamedSharding(mesh, P(layer._token_axes())))
    with jax.set_mesh(mesh):
        text = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1))).lower(layer, xs).compile()
        text = text.as_text()
    found = []
    for line in text.splitlines():
        m = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                      r"collective-permute)(?:-start)?\(", line)
        if m:
            found.append((m.group(2), m.group(1), _replica_groups(line)))
    return found


@pytest.mark.parametrize("backend", ["deepep", "alltoall"])
def test_compiled_collectives_run_over_their_axes(backend):
    """The ETP all-gathers and reduce-scatters run over the tensor axis's device groups, the
    EP exchange over the expert axis's; no all-reduce over the tensor axis alone (the one
    ETP reduction is the reduce-scatter). Transport pinned to XLA's all_to_all (the default
    CPU transport is jax_ep's own FFI call, not an XLA collective)."""
    mesh = jax.make_mesh((2, 2, 2), AXES)
    layer, _ = _layer_pair(_config(2, backend, transport="all_to_all"), mesh)
    B, S = 8, 6
    found = _compiled_collectives(layer, mesh, jax.random.normal(jax.random.key(5), (B, S, H)))
    tensor, expert, data = (_axis_groups(mesh, a) for a in ("tensor", "expert", "data"))
    everyone = {frozenset(range(mesh.size))}
    assert tensor == {frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}),
                      frozenset({6, 7})}  # the mesh's ids in (data, expert, tensor) order
    by_kind = {}
    for kind, result, groups in found:
        by_kind.setdefault(kind, []).append((result, groups))
    assert by_kind["all-to-all"] and all(g == expert for _, g in by_kind["all-to-all"]), found
    # forward: the rows (f32[2,N,H]) and their counts (s32[2,L]) gathered over the tensor
    # axis; backward: the rows' cotangents (the reduce-scatter's transpose); plus the
    # dispatcher's count exchange over the expert axis
    gathers = by_kind["all-gather"]
    rows = [r for r, g in gathers if g == tensor and r.startswith("f32[2,")]
    assert len(rows) == 2 and all(r.endswith(f",{H}]{{2,1,0}}") for r in rows), gathers
    assert any(g == tensor and r.startswith("s32[2,4]") for r, g in gathers), gathers
    assert {frozenset(g) for _, g in gathers} <= {frozenset(tensor), frozenset(expert)}
    # the one reduction: the partial outputs reduce-scattered over the tensor axis, forward
    # and (as the all-gather's transpose) backward, f32[1,N,H] each
    scatters = by_kind["reduce-scatter"]
    assert len(scatters) == 2 and all(g == tensor and r.startswith("f32[1,")
                                      for r, g in scatters), scatters
    # all-reduces: expert weight gradients over "data", replicated params and aux over all
    assert all(g in (data, everyone) for _, g in by_kind["all-reduce"]), by_kind["all-reduce"]
    assert any(g == data for _, g in by_kind["all-reduce"])
    assert "collective-permute" not in by_kind


def test_etp1_program_gathers_no_rows_and_scatters_nothing():
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    layer, _ = _layer_pair(_config(1, transport="all_to_all"), mesh)
    found = _compiled_collectives(layer, mesh, jnp.ones((8, 6, H)))
    kinds = {k for k, _, _ in found}
    assert "all-to-all" in kinds and "reduce-scatter" not in kinds, found
    # the only all-gather: the dispatcher's i32 count exchange over the expert axis
    gathers = [(r, g) for k, r, g in found if k == "all-gather"]
    assert gathers and all(r.startswith("s32[") and g == _axis_groups(mesh, "expert")
                           for r, g in gathers), gathers


def _tiny_model(etp, mesh):
    cfg = _config(etp)
    model = MoELayer(cfg, H, F, rngs=nnx.Rngs(0), mesh=mesh)
    if etp > 1:  # the ETP=1 model's weights in the ETP layout
        plain = MoELayer(_config(1), H, F, rngs=nnx.Rngs(0), expert_parallel_size=2)
        model.w_gate_up[...] = gate_up_to_etp(plain.w_gate_up[...], etp)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    shard_state(model, optimizer, mesh)
    return model, optimizer


def test_training_with_etp2_gives_the_etp1_losses():
    x = jax.random.normal(jax.random.key(6), (8, 4, H))
    target = jnp.roll(x, 1, axis=-1)

    @nnx.jit
    def step(model, optimizer, x):
        def loss(model):
            y, aux = model(x)
            return jnp.mean((y - target) ** 2) + aux["aux_loss"]
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    losses, weights = {}, {}
    # the same 8 token blocks either way: (data, expert) and (data, expert, tensor) in order
    for etp, mesh in ((1, jax.make_mesh((2, 4), ("data", "expert"))),
                      (2, jax.make_mesh((2, 2, 2), AXES))):
        model, optimizer = _tiny_model(etp, mesh)
        with jax.set_mesh(mesh):
            losses[etp] = [float(step(model, optimizer, x)) for _ in range(4)]
        weights[etp] = gate_up_from_etp(np.asarray(model.w_gate_up[...]), etp)
    assert losses[1][-1] < losses[1][0]
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)
    np.testing.assert_allclose(weights[2], weights[1], rtol=1e-4, atol=1e-6)


def test_inside_user_shard_map():
    cfg = _config(2, expert_axis_name=AXIS)
    layer = MoELayer(cfg, H, F, rngs=nnx.Rngs(0), expert_parallel_size=4)
    x = jax.random.normal(jax.random.key(7), (16, H))
    want = dense_forward(layer, x, num_devices=8)[0]
    mesh = jax.make_mesh((4, 2), (AXIS, "tensor"))
    shard_params(layer, mesh)
    graphdef, state = nnx.split(layer)
    tokens = P((AXIS, "tensor"))

    def body(x, state):
        return nnx.merge(graphdef, state)(x)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tokens, nnx.get_partition_spec(state)),
                       out_specs=tokens)
    out = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, tokens)), state)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    only_expert = jax.make_mesh((4,), (AXIS,), devices=jax.devices()[:4])
    graphdef, state = nnx.split(MoELayer(cfg, H, F, rngs=nnx.Rngs(0), expert_parallel_size=4))
    fn = jax.shard_map(body, mesh=only_expert, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
    with pytest.raises(ValueError, match="tensor_axis: .*bind 'tensor' with 2 devices"):
        jax.jit(fn)(jax.device_put(x, NamedSharding(only_expert, P(AXIS))), state)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, 3, 64])
def test_config_rejects_bad_sizes(value):
    with pytest.raises(ValueError, match="MoEConfig.expert_tensor_parallel_size"):
        MoEConfig(num_moe_experts=8, moe_ffn_hidden_size=32, expert_tensor_parallel_size=value)


def test_layer_checks_the_mesh_and_the_axis():
    mesh = jax.make_mesh((2, 2, 2), AXES)
    two_axes = jax.make_mesh((2, 4), ("data", "expert"))
    with pytest.raises(ValueError, match=r"mesh: .*expert_tensor_parallel_size=4 .* has 2"):
        MoELayer(_config(4), H, F, rngs=nnx.Rngs(0), mesh=jax.make_mesh((1, 4, 2), AXES))
    with pytest.raises(ValueError, match=r"mesh: .*=2 needs a tensor axis 'tensor'.* none"):
        MoELayer(_config(2), H, F, rngs=nnx.Rngs(0), mesh=two_axes)
    with pytest.raises(ValueError, match=r"mesh: .*expert_tensor_parallel_size=1 .* has 2"):
        MoELayer(_config(1), H, F, rngs=nnx.Rngs(0), mesh=mesh)
    MoELayer(_config(1), H, F, rngs=nnx.Rngs(0), mesh=mesh, tensor_axis=None)  # opted out
    with pytest.raises(ValueError, match="tensor_axis: .*got None"):
        MoELayer(_config(2), H, F, rngs=nnx.Rngs(0), mesh=mesh, tensor_axis=None)
    with pytest.raises(ValueError, match="tensor_axis: 'expert' is the layer's"):
        MoELayer(_config(2), H, F, rngs=nnx.Rngs(0), mesh=mesh, tensor_axis="expert")
    with pytest.raises(ValueError, match="expert_tensor_parallel_size: 4 must divide "
                                         "ffn_hidden_size=30"):
        MoELayer(_config(4), H, 30, rngs=nnx.Rngs(0), expert_parallel_size=2)


def test_with_drop_and_pad_and_a_list_of_losses_matches_dense():
    # Issue 29's other options on the tensor-parallel path: the padded grouped-GEMM blocks
    # gathered over the tensor axis, and the loss list with global_aux_loss's tracker.
    mesh = jax.make_mesh((2, 2, 2), AXES)
    cfg = MoEConfig(num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=0.5,
                    moe_pad_expert_input_to_capacity=True, expert_tensor_parallel_size=2,
                    moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                    moe_aux_loss_coeff=[1e-2, 0.1])
    layer, twin = _layer_pair(cfg, mesh)
    x = jax.random.normal(jax.random.key(5), (8, 6, H))
    got, aux, (grads, dx), want, (want_grads, want_dx) = _vs_dense(layer, twin, mesh, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=2e-5, atol=2e-6)
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)
    assert sorted(aux["load_balancing_losses"]) == ["aux_loss", "global_aux_loss"]
    assert int(aux["num_dropped"]) > 0 and float(layer.ga_steps[...]) == 1

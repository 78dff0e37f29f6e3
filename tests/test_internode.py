"""DeepEP's internode (two-hop) dispatch/combine over a (node, local) axis pair, on 8 emulated
CPU devices as meshes (2,4), (4,2) and the degenerate (1,8), (8,1)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import (assert_param_grads_close, dense_moe, deepep_layout, layer_vs_dense,
                      local_experts, random_routing)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep

AXES = ("node", "local")
SPEC = P(AXES)
MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]


def pair_mesh(nodes, local):
    return jax.make_mesh((nodes, local), AXES, devices=jax.devices()[:nodes * local])


def run_pair(fn, mesh, *arrays, repeat=1):
    """jit(shard_map(fn)) over the pair, arrays split along their first dim by global rank;
    with repeat > 1 a list of the outputs of that many calls of the one compiled program."""
    sharded = [jax.device_put(a, NamedSharding(mesh, SPEC)) for a in arrays]
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SPEC,) * len(arrays),
                                   out_specs=SPEC))
    runs = [[np.asarray(a) for a in mapped(*sharded)] for _ in range(repeat)]
    return runs if repeat > 1 else runs[0]


def _dispatch_combine(mesh, x, idx, w, E, *, backend="deepep", hierarchical=None, **kwargs):
    def body(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES,
                                        backend=backend, hierarchical=hierarchical, **kwargs)
        c, cw = jax_ep.combine(rx, h, topk_weights=rw)
        rdma = getattr(h, "num_tokens_per_rdma_rank", jnp.zeros((mesh.shape["node"],),
                                                                jnp.int32))
        rdma_recv = getattr(h, "num_rdma_recv_tokens", jnp.zeros((), jnp.int32))
        return (rx, ri, rw, c, cw, h.num_recv_tokens[None], h.num_recv_tokens_per_expert,
                h.num_dropped[None], rdma, rdma_recv[None])
    return dict(zip("rx ri rw c cw n per_expert dropped rdma rdma_recv".split(),
                    run_pair(body, mesh, x, idx, w)))


def _two_hop_equals_flat(mesh, x, idx, w, E, backend):
    """The two-hop dispatch + combine's outputs, checked against the flat exchange's."""
    two = _dispatch_combine(mesh, x, idx, w, E, backend=backend, hierarchical=True)
    flat = _dispatch_combine(mesh, x, idx, w, E, backend=backend, hierarchical=False)
    for key in ("rx", "ri", "rw", "n", "per_expert", "dropped"):
        np.testing.assert_array_equal(two[key], flat[key], err_msg=key)
    np.testing.assert_allclose(two["c"], flat["c"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(two["cw"], flat["cw"], rtol=1e-6, atol=1e-6)
    return two


def _case(seed, P_, T, H, K, E, unrouted=0.1):
    rng = np.random.default_rng(seed)
    # rank-valued rows: column 0 holds the global source rank, column 1 the token index
    x = rng.standard_normal((P_ * T, H)).astype(np.float32)
    x[:, 0] = np.repeat(np.arange(P_), T)
    x[:, 1] = np.tile(np.arange(T), P_)
    idx, w = random_routing(rng, P_ * T, K, E, unrouted=unrouted)
    return x, idx, w


def _numpy_rdma_counts(idx, nodes, experts_per_node):
    """[P*T] tokens -> per source rank the tokens going to each node (once per node)."""
    node_of = np.where(idx >= 0, idx // experts_per_node, -1)
    return np.stack([[(node_of[t] == n).any() for n in range(nodes)]
                     for t in range(idx.shape[0])]).astype(np.int32)


@pytest.mark.parametrize("shape, backend", [(m, "deepep") for m in MESHES]
                         + [((2, 4), "alltoall")])
def test_two_hop_equals_flat_and_the_deepep_layout(shape, backend):
    N, G = shape
    P_, T, H, K, E = N * G, 5, 8, 3, 32
    x, idx, w = _case(sum(shape), P_, T, H, K, E)
    mesh = pair_mesh(N, G)
    two = _two_hop_equals_flat(mesh, x, idx, w, E, backend)
    # The flat contract: rows grouped by global source rank, token ascending inside.
    want = deepep_layout(x, idx, w, P_, E)
    R = P_ * T
    for d in range(P_):
        m = len(want[d]["src"])
        rows = slice(d * R, (d + 1) * R)
        assert two["n"][d] == m
        np.testing.assert_array_equal(two["rx"][rows][:m], want[d]["x"])
        np.testing.assert_array_equal(two["rx"][rows][:m, 0], [p for p, _ in want[d]["src"]])
        np.testing.assert_array_equal(two["ri"][rows][:m], want[d]["idx"])
        assert not two["rx"][rows][m:].any() and (two["ri"][rows][m:] == -1).all()
    # num_tokens_per_rdma_rank against numpy; hop 1 moves exactly the (token, node) pairs.
    per_token = _numpy_rdma_counts(idx, N, E // N)
    want_rdma = per_token.reshape(P_, T, N).sum(axis=1)
    np.testing.assert_array_equal(two["rdma"].reshape(P_, N), want_rdma)
    assert two["rdma_recv"].sum() == per_token.sum()
    # Each forwarder (n_d, g) received the tokens of sources (n_s, g) bound for node n_d.
    for n_d in range(N):
        for g in range(G):
            assert two["rdma_recv"][n_d * G + g] == want_rdma.reshape(N, G, N)[:, g, n_d].sum()


def test_default_is_two_hop_on_a_pair_and_flat_on_degenerate_pairs():
    for shape in [(2, 4), (1, 8)]:
        mesh = pair_mesh(*shape)

        def body(x, idx, w):
            h = jax_ep.dispatch(x, idx, w, num_experts=16, axis_name=AXES)[3]
            return jnp.full((1,), isinstance(h, jax_ep.InternodeHandle))
        x, idx, w = _case(0, 8, 2, 4, 2, 16)
        two_hop = run_pair(body, mesh, x, idx, w)[0]
        assert two_hop.all() == (shape == (2, 4))


def test_bf16_combine_rounding_and_fp32_combine_dtype():
    N, G = 4, 2
    P_, T, H, K, E = N * G, 6, 16, 4, 16
    x, idx, w = _case(3, P_, T, H, K, E, unrouted=0.0)
    xb = jnp.asarray(x, jnp.bfloat16)
    mesh = pair_mesh(N, G)

    def body(x, idx, w):
        # each rank scales its copies differently, so a node's partial sum of two copies is
        # not exact in bf16 (identical copies would double exactly)
        rank = jax.lax.axis_index(AXES[0]) * G + jax.lax.axis_index(AXES[1])
        scale = 1.37 + 0.1173 * rank.astype(jnp.float32)
        outs = []
        for hier, dtype in [(False, None), (True, None), (True, jnp.float32)]:
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES,
                                           hierarchical=hier)
            y = (rx.astype(jnp.float32) * scale).astype(jnp.bfloat16)
            outs.append(jax_ep.combine(y, h, combine_dtype=dtype)[0].astype(jnp.float32))
        return tuple(outs)
    (flat, two, two_f32), again = run_pair(body, mesh, xb, idx, w, repeat=2)
    np.testing.assert_array_equal(two, again[1])  # bitwise run to run
    np.testing.assert_array_equal(two_f32, again[2])
    # fp32 partial sums: the flat sum up to the order of fp32 additions before the one cast
    np.testing.assert_allclose(two_f32, flat, rtol=2 ** -8, atol=0)
    assert np.mean(two_f32 == flat) > 0.95
    # bf16 partial sums: rounded once more on the forwarders, so they differ from the flat
    # sum in some elements (8% here), by about a bf16 ulp
    assert np.mean(two != flat) > 0.03
    assert np.mean(two != two_f32) > 0.03
    np.testing.assert_allclose(two, flat, rtol=2 ** -6, atol=0)


def _collectives(fn, mesh, *arrays):
    """(kind, operand type, replica group size) of every collective of the lowered program."""
    sharded = [jax.device_put(a, NamedSharding(mesh, SPEC)) for a in arrays]
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(SPEC,) * len(arrays), out_specs=SPEC)
    found = []
    for line in jax.jit(mapped).lower(*sharded).as_text().splitlines():
        m = re.search(r'"stablehlo\.(all_to_all|all_gather|all_reduce|ragged_all_to_all|'
                      r'collective_permute|reduce_scatter)"', line)
        if m:
            operand = re.search(r":\s*\((tensor<[^>]*>)", line)
            found.append((m.group(1), operand.group(1), _group_size(line, mesh)))
    return found


def _group_size(line, mesh):
    """Replica group size of a collective's StableHLO line: `dense<...> : tensor<GxSxi64>`
    (jax <= 0.11) or `replica_group_mesh_axes<... axes = [axis_ref<name = "a">, ...]>`
    (jax 0.12: the product of the named mesh axes' sizes); None if neither is there."""
    dense = re.search(r"replica_groups = dense<[^>]*> : tensor<(\d+)x(\d+)xi64>", line)
    if dense:
        return int(dense.group(2))
    axes = re.search(r"replica_groups = #stablehlo\.replica_group_mesh_axes<(.*?)\]>", line)
    if axes:
        names = re.findall(r'axis_ref<name = "([^"]+)"', axes.group(1))
        return int(np.prod([mesh.shape[n] for n in names]))
    return None


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_compiled_collectives_run_over_node_or_local_groups(shape, padded_auto):
    N, G = shape
    P_, T, H, K, E = N * G, 4, 8, 2, 16
    x, idx, w = _case(5, P_, T, H, K, E)

    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES)
        return jax_ep.combine(rx, h)[0], rw

    found = _collectives(f, pair_mesh(N, G), x, idx, w)
    moves = [(t, s) for kind, t, s in found if kind == "all_to_all"]
    assert {kind for kind, _, _ in found} == {"all_to_all", "all_gather"}, found
    assert all(s in (N, G) and s != P_ for _, _, s in found), found
    # tokens: hop 1 [N, T, H] over node-sized groups, hop 2 [G, N*T, H] over local groups,
    # each once forward and once back (combine)
    assert moves.count((f"tensor<{N}x{T}x{H}xf32>", N)) == 2, moves
    assert moves.count((f"tensor<{G}x{N * T}x{H}xf32>", G)) == 2, moves
    # one count exchange per hop
    assert sorted(s for k, _, s in found if k == "all_gather") == sorted([N, G]), found


def _moe_loss(mesh, x, idx, w, w_in, w_out, **kwargs):
    L = w_in.shape[0] // (mesh.shape["node"] * mesh.shape["local"])

    def body(x, idx, w, w_in, w_out):
        rank = jax.lax.axis_index(AXES)
        mine = jax.lax.dynamic_slice_in_dim(w_in, rank * L, L)
        mine_out = jax.lax.dynamic_slice_in_dim(w_out, rank * L, L)
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=w_in.shape[0], axis_name=AXES,
                                        **kwargs)
        y = local_experts(rx, ri, rw, mine, mine_out)
        return jax_ep.combine(y, h)[0]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 3 + (P(), P()),
                           out_specs=SPEC)
    return lambda *a: jnp.sum(jnp.sin(mapped(*a)))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_forward_and_grad_equal_the_dense_reference(shape):
    N, G = shape
    P_, T, H, F, K, E = N * G, 3, 8, 6, 3, 16
    rng = np.random.default_rng(7)
    x = rng.standard_normal((P_ * T, H)).astype(np.float32)
    idx, w = random_routing(rng, P_ * T, K, E)
    w_in = (rng.standard_normal((E, H, F)) / 3).astype(np.float32)
    w_out = (rng.standard_normal((E, F, H)) / 3).astype(np.float32)
    mesh = pair_mesh(N, G)
    args = [jax.device_put(a, NamedSharding(mesh, SPEC)) for a in (x, idx, w)] + [
        jax.device_put(a, NamedSharding(mesh, P())) for a in (w_in, w_out)]
    loss = _moe_loss(mesh, *args[:3], *args[3:])
    dense = lambda x, i, w, a, b: jnp.sum(jnp.sin(dense_moe(x, i, w, a, b)))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4)))(*args)
    want = jax.value_and_grad(dense, argnums=(0, 2, 3, 4))(x, idx, w, w_in, w_out)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, r in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_gradients_of_gradients_equal_the_dense_reference():
    # Second order through both hops (the gradient of a gradient penalty): each hop's VJP is
    # the other direction's exchange, itself differentiable.
    N, G, T, H, F, K, E = 2, 4, 3, 8, 6, 3, 16
    rng = np.random.default_rng(8)
    x = rng.standard_normal((N * G * T, H)).astype(np.float32)
    idx, w = random_routing(rng, N * G * T, K, E)
    w_in = (rng.standard_normal((E, H, F)) / 3).astype(np.float32)
    w_out = (rng.standard_normal((E, F, H)) / 3).astype(np.float32)
    mesh = pair_mesh(N, G)
    args = [jax.device_put(a, NamedSharding(mesh, SPEC)) for a in (x, idx, w)] + [
        jax.device_put(a, NamedSharding(mesh, P())) for a in (w_in, w_out)]
    loss = _moe_loss(mesh, *args)
    dense = lambda x, i, w, a, b: jnp.sum(jnp.sin(dense_moe(x, i, w, a, b)))  # noqa: E731

    def penalty(f):
        argnums = (0, 2, 3, 4)
        return lambda *a: sum(jnp.sum(g ** 2) for g in jax.grad(f, argnums=argnums)(*a))

    got = jax.jit(jax.grad(penalty(loss), argnums=(0, 2, 3, 4)))(*args)
    want = jax.grad(penalty(dense), argnums=(0, 2, 3, 4))(x, idx, w, w_in, w_out)
    for g, r in zip(got, want):  # entries up to ~10: f32 sums in another order
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


def test_cached_dispatch_replays_both_hops_and_its_gradient():
    N, G, T, H, K, E = 2, 4, 4, 8, 2, 16
    x, idx, w = _case(9, N * G, T, H, K, E)
    mesh = pair_mesh(N, G)

    def body(x, idx, w):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES)
        again, _, rw2, _ = jax_ep.dispatch(2 * x, topk_weights=w, axis_name=AXES, handle=h)
        # d/dx of sum(dispatch(x) * c) = combine(c): every copy's cotangent summed back
        grad = jax.grad(lambda v: jnp.sum(jax_ep.dispatch(v, axis_name=AXES, handle=h)[0]))(x)
        return rx, again, rw, rw2, grad, jax_ep.combine(jnp.ones_like(rx), h)[0]
    rx, again, rw, rw2, grad, ones = run_pair(body, mesh, x, idx, w)
    np.testing.assert_array_equal(again, 2 * rx)
    np.testing.assert_array_equal(rw2, rw)
    np.testing.assert_array_equal(grad, ones)
    owners = np.array([len({int(e) // (E // (N * G)) for e in row if e >= 0}) for row in idx])
    np.testing.assert_array_equal(grad[:, 0], owners)


@pytest.mark.parametrize("case", ["unrouted", "hot_node", "k_gt_l"])
def test_edge_cases_match_flat(case):
    N, G, T, H = 2, 4, 4, 8
    rng = np.random.default_rng(11)
    if case == "k_gt_l":  # L = 1 local expert, K = 3
        E, K = 8, 3
        x, idx, w = _case(11, N * G, T, H, K, E, unrouted=0.0)
    else:
        E, K = 16, 2
        x, idx, w = _case(11, N * G, T, H, K, E)
        if case == "unrouted":
            idx[:] = -1
        else:  # every token to node 0's experts: node 1 receives nothing
            idx = np.stack([rng.permutation(E // N)[:K] for _ in range(N * G * T)]).astype(
                np.int32)
    mesh = pair_mesh(N, G)
    # transport as a (node hop, local hop) pair: the local hop's "auto" is peer here
    two = _dispatch_combine(mesh, x, idx, w, E, transport=("all_to_all", "auto"))
    flat = _dispatch_combine(mesh, x, idx, w, E, hierarchical=False)
    for key in ("rx", "ri", "rw", "n", "per_expert"):
        np.testing.assert_array_equal(two[key], flat[key], err_msg=key)
    np.testing.assert_allclose(two["c"], flat["c"], rtol=1e-6, atol=1e-6)
    if case == "unrouted":
        assert not two["rx"].any() and not two["c"].any() and not two["rdma_recv"].any()
    if case == "hot_node":
        assert not two["n"][N * G // 2:].any()
        np.testing.assert_array_equal(two["rdma"].reshape(-1, N), [[T, 0]] * (N * G))


@pytest.mark.parametrize("shape, K, backend", [((2, 4), 5, "deepep"), ((4, 2), 3, "deepep"),
                                               ((4, 2), 8, "deepep"), ((4, 2), 3, "uccl_ep"),
                                               ((4, 2), 3, "alltoall")])
def test_top_k_above_a_nodes_experts_matches_flat(shape, K, backend):
    """K > E / N: a forwarder's received rows hold K node-local slots over fewer experts
    (the hop-2 layout refused them as 'top-k K exceeds num_experts E / N' before)."""
    N, G = shape
    E, T, H = 8, 3, 8
    x, idx, w = _case(K, N * G, T, H, K, E, unrouted=0.1)
    mesh = pair_mesh(N, G)
    two = _two_hop_equals_flat(mesh, x, idx, w, E, backend)
    # every (token, destination rank) pair arrives once
    assert two["n"].sum() == sum(len(set(row[row >= 0] // (E // (N * G)))) for row in idx)


def test_zero_tokens():
    mesh = pair_mesh(2, 4)
    x = np.zeros((0, 8), np.float32)
    idx = np.zeros((0, 2), np.int32)
    out = _dispatch_combine(mesh, x, idx, idx.astype(np.float32), 16,
                            num_worst_tokens=4)
    assert out["rx"].shape == (8 * 4, 8) and not out["rx"].any() and out["c"].shape == (0, 8)


@pytest.mark.parametrize("bound", [dict(capacity=2), dict(num_worst_tokens=5)])
def test_final_hop_overflow_drops_as_the_flat_exchange(bound):
    N, G, T, H, K, E = 2, 4, 6, 8, 3, 16
    x, idx, w = _case(13, N * G, T, H, K, E, unrouted=0.0)
    mesh = pair_mesh(N, G)
    two = _dispatch_combine(mesh, x, idx, w, E, **bound)
    flat = _dispatch_combine(mesh, x, idx, w, E, hierarchical=False, **bound)
    for key in ("rx", "ri", "rw", "n", "per_expert"):
        np.testing.assert_array_equal(two[key], flat[key], err_msg=key)
    np.testing.assert_allclose(two["c"], flat["c"], rtol=1e-6, atol=1e-6)
    assert flat["dropped"].sum() > 0 and two["dropped"].sum() == flat["dropped"].sum()


def test_node_hop_overflow_drops_are_counted_without_corruption():
    N, G, T, H, K, E = 2, 4, 6, 8, 3, 16
    x, idx, w = _case(17, N * G, T, H, K, E, unrouted=0.0)
    mesh = pair_mesh(N, G)
    r1 = 7
    two = _dispatch_combine(mesh, x, idx, w, E, num_worst_rdma_tokens=r1)
    full = _dispatch_combine(mesh, x, idx, w, E)
    pairs = _numpy_rdma_counts(idx, N, E // N).reshape(N, G, T, N)
    # forwarder (n_d, g) keeps its sources' blocks in node order, up to r1 rows
    want_kept = 0
    for n_d in range(N):
        for g in range(G):
            blocks = pairs[:, g, :, n_d].sum(axis=1)
            want_kept += min(blocks.sum(), r1)
            assert two["rdma_recv"][n_d * G + g] == min(blocks.sum(), r1)
    assert two["dropped"].sum() == pairs.sum() - want_kept > 0
    # every received row is a whole source row with its own ids (a subset of the full run)
    R = N * G * T
    for d in range(N * G):
        got = {tuple(r) for r in np.concatenate(
            [two["rx"][d * R:(d + 1) * R], two["ri"][d * R:(d + 1) * R]], 1)[:two["n"][d]]}
        ref = {tuple(r) for r in np.concatenate(
            [full["rx"][d * R:(d + 1) * R], full["ri"][d * R:(d + 1) * R]], 1)[:full["n"][d]]}
        assert got <= ref
        assert not two["rx"][d * R + two["n"][d]:(d + 1) * R].any()


@pytest.mark.parametrize("kwargs, arg", [
    (dict(num_experts=12), "num_experts"),           # 2*4 does not divide 12
    (dict(axis_name=("node", "nope")), "axis_name"),
    (dict(num_worst_rdma_tokens=0), "num_worst_rdma_tokens"),
    (dict(num_worst_rdma_tokens=4, hierarchical=False), "num_worst_rdma_tokens"),
    (dict(axis_name="node", hierarchical=True), "hierarchical"),
    (dict(transport=("all_to_all",)), "transport"),
])
def test_bad_input_raises(kwargs, arg):
    mesh = pair_mesh(2, 4)
    x, idx, w = _case(0, 8, 2, 8, 2, 16)
    call = dict(num_experts=16, axis_name=AXES) | kwargs

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, **call)[0]
    with pytest.raises(ValueError, match=arg):
        run_pair(body, mesh, x, idx, w)


@pytest.mark.parametrize("cls,N,G", [(jax_ep.Buffer, 2, 4), (jax_ep.Buffer, 4, 2),
                                     (jax_ep.UCCLBuffer, 2, 4)])
def test_buffer_over_a_pair_runs_two_hops(cls, N, G):
    T, H, K, E = 4, 8, 2, 16
    x, idx, w = _case(19, N * G, T, H, K, E)
    mesh = pair_mesh(N, G)
    buf = cls(AXES)

    def body(x, idx, w):
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, ri, rw, counts, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank,
                                                num_tokens_per_rdma_rank=per_node,
                                                is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert,
                                                topk_idx=idx, topk_weights=w)
        combined = buf.combine(rx, h)[0]
        # The tests of each system read recv_gbl_rank_prefix_sum from the end of its tuple:
        # DeepEP's 10 entries (handle[-4]), UCCL-EP's 12 (handle[-6]; num_recv_tokens and
        # num_rdma_recv_tokens at [7] and [8]).
        if cls is jax_ep.UCCLBuffer:
            assert len(h) == 12
            gbl, n, n_rdma = h[-6], h[7], h[8]
            with pytest.raises(ValueError, match=r"handle\[1\]: UCCL-EP's rdma_channel_pre"):
                h[1]
        else:
            assert len(h) == 10
            gbl, n, n_rdma = h[-4], h.num_recv_tokens, h.num_rdma_recv_tokens
            with pytest.raises(ValueError, match=r"handle\[1\]: DeepEP's rdma_channel_prefix"):
                h[1]
        # handle[0], as in both systems: the is_token_in_rank the dispatch was given
        same = jnp.all(h[0] == in_rank) & (h[0].shape == in_rank.shape)
        return (rx, ri, combined, per_node, h.num_tokens_per_rdma_rank, gbl, h[4], n[None],
                n_rdma[None], same[None], h[0])
    rx, ri, combined, per_node, rdma, gbl_prefix, rdma_prefix, n, n_rdma, same, in_rank = \
        run_pair(body, mesh, x, idx, w)
    assert same.all()
    # ... token t of rank s has an expert on rank d (experts in blocks of E / (N*G))
    owner = np.asarray(idx).reshape(N * G, T, K) // (E // (N * G))
    want = (owner[..., None] == np.arange(N * G)).any(2)  # -1 (unrouted) owns nothing
    np.testing.assert_array_equal(np.asarray(in_rank).reshape(N * G, T, N * G), want)
    flat = _dispatch_combine(mesh, x, idx, w, E, hierarchical=False)
    # DeepEP's test_internode check_data: rows [S[i-1], S[i]) of rank d came from rank i
    # (x[:, 0] holds the source rank), S = handle[-4], recv_gbl_rank_prefix_sum.
    R = rx.shape[0] // (N * G)
    for d in range(N * G):
        prefix = gbl_prefix[d * N * G:(d + 1) * N * G]
        assert prefix[-1] == n[d]
        sources = np.repeat(np.arange(N * G), np.diff(prefix, prepend=0))
        np.testing.assert_array_equal(rx[d * R:d * R + n[d], 0], sources)
    np.testing.assert_array_equal(rx, flat["rx"])
    # handle[4], recv_rdma_rank_prefix_sum: rank (m, g) gets on hop 1, from each node n, the
    # tokens of rank (n, g) bound for node m, once each.
    to_node = per_node.reshape(N * G, N)  # [source rank, node]
    for d in range(N * G):
        m, g = divmod(d, G)
        want = np.cumsum([to_node[n * G + g, m] for n in range(N)])
        np.testing.assert_array_equal(rdma_prefix[d * N:(d + 1) * N], want)
        assert want[-1] == n_rdma[d]
    np.testing.assert_array_equal(ri, flat["ri"])
    np.testing.assert_allclose(combined, flat["c"], rtol=1e-6, atol=1e-6)
    want = _numpy_rdma_counts(idx, N, E // N).reshape(N * G, T, N).sum(axis=1)
    np.testing.assert_array_equal(per_node.reshape(-1, N), want)
    np.testing.assert_array_equal(rdma, per_node)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("N, G, E", [(2, 4, 16), (4, 2, 8)])
def test_hybridep_over_a_pair_equals_the_flat_exchange(compact, N, G, E):
    """hierarchical=None (two hops) and False (the flat exchange over the pair): the same bits,
    outputs and gradients (K = 2: every sum has at most two terms, so its order is moot).
    At E = 8 over 4 nodes a node has 2 experts: fewer than a dense map's P = 8 slots a row
    (refused as 'top-k 8 exceeds num_experts 2' before). A dense map bounded by top_k = K
    gives the same bits over both exchanges."""
    T, H, K, NP = 4, 8, 2, 40
    x, idx, w = _case(23, N * G, T, H, K, E)
    routing = dict(topk_idx=idx, probs=w) if compact else dict(
        routing_map=np.zeros((N * G * T, E), bool), probs=np.zeros((N * G * T, E), np.float32))
    if not compact:
        rows = np.arange(N * G * T)[:, None]
        routing["routing_map"][rows, np.clip(idx, 0, None)] = idx >= 0
        routing["probs"][rows, np.clip(idx, 0, None)] = np.where(idx >= 0, w, 0)
    names = list(routing)
    kinds = []

    def run(hierarchical, top_k=None):
        def body(x, a, b):
            def loss(x, b):
                px, pp, tpe, h = jax_ep.hybridep_dispatch(
                    x, **{names[0]: a, names[1]: b}, num_experts=E, axis_name=AXES,
                    num_permuted_tokens=NP, pad_multiple=2, hierarchical=hierarchical,
                    top_k=top_k)
                kinds.append(type(h.routing))
                out = jax_ep.hybridep_combine(px * (1.0 + pp[:, None]), h)
                return jnp.sum(out ** 2), (px, pp, tpe, out)
            (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, b)
            return outs + grads
        return run_pair(body, pair_mesh(N, G), x, routing[names[0]], routing[names[1]])

    two, flat = run(None), run(False)
    assert kinds == [jax_ep.InternodeHandle, jax_ep.DispatchHandle]
    bounded = () if compact else (run(None, top_k=K), run(False, top_k=K))
    for other in (two,) + bounded:  # px, pp, tokens_per_expert, out, d_x, d_probs
        for i, (a, b) in enumerate(zip(other, flat)):
            np.testing.assert_array_equal(a, b, err_msg=str(i))
    assert two[0].any() and two[4].any() and two[5].any()


@pytest.mark.parametrize("kwargs", [dict(axis_name="node", hierarchical=True),
                                    dict(hierarchical="yes")])
def test_hybridep_bad_hierarchical_raises(kwargs):
    mesh = pair_mesh(2, 4)
    x, idx, w = _case(0, 8, 2, 8, 2, 16)
    call = dict(num_experts=16, axis_name=AXES) | kwargs

    def body(x, idx, w):
        return jax_ep.hybridep_dispatch(x, topk_idx=idx, probs=w, **call)[0]
    with pytest.raises(ValueError, match="hierarchical"):
        run_pair(body, mesh, x, idx, w)


@pytest.mark.parametrize("backend, shape", [("deepep", (2, 2, 2)), ("hybridep", (1, 4, 2))])
def test_moe_layer_over_a_node_local_pair_matches_dense(backend, shape):
    # hybridep on 4 nodes of 2 experts: its dense map's 8 slots a row exceed a node's experts
    from flax import nnx

    from jax_ep.flax import MoELayer, shard_params
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=3,
                                       moe_flex_dispatcher_backend=backend,
                                       moe_permute_fusion=True, expert_axis_name=AXES)
    mesh = jax.make_mesh(shape, ("data",) + AXES)
    layer = MoELayer(cfg, 16, 8, rngs=nnx.Rngs(0), mesh=mesh)
    twin = MoELayer(cfg, 16, 8, rngs=nnx.Rngs(0), mesh=mesh)
    shard_params(layer, mesh)
    x = jax.random.normal(jax.random.key(1), (8, 3, 16))
    got, aux, grads, want, want_grads = layer_vs_dense(layer, twin, mesh, x, ("data",) + AXES)
    # got = sum(y * cot) over 384 O(1) terms cancels to ~0.09: an absolute bound at fp32
    # rounding of the terms (jax 0.12's fp32 matmuls differ from 0.10's by ~5e-6 here)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert int(aux["num_dropped"]) == 0
    assert_param_grads_close(grads, want_grads, rtol=2e-5, atol=2e-6)


def test_node_limited_routing_crosses_to_at_most_group_topk_nodes():
    """MoEConfig moe_router_num_groups = N = 4 (groups = nodes), group_topk = 1: each token's
    K experts sit on one node, so hop 1 sends at most one row per token to another node (at
    most T rows cross the node axis); without the limit, K = 4 of 16 experts on 4 nodes reach
    two or more other nodes for most tokens (more than T rows cross)."""
    from flax import nnx

    from jax_ep.flax import MoEConfig, MoELayer, shard_params
    mesh = jax.make_mesh((4, 2), AXES)
    x = jax.random.normal(jax.random.key(3), (8, 16, 16))
    xs = jax.device_put(x, NamedSharding(mesh, P(AXES)))
    crossed = {}
    for groups in (None, 4):
        cfg = MoEConfig(num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=8,
                        moe_router_num_groups=groups, moe_router_group_topk=groups and 1,
                        token_dispatcher=jax_ep.TokenDispatcherConfig(
                            moe_flex_dispatcher_backend="deepep", moe_permute_fusion=True,
                            expert_axis_name=AXES))
        layer = MoELayer(cfg, 16, rngs=nnx.Rngs(0), mesh=mesh)
        shard_params(layer, mesh)
        with jax.set_mesh(mesh):
            _, aux = nnx.jit(lambda l, x: l(x))(layer, xs)
        crossed[groups] = int(aux["rows_across_nodes"]), int(aux["flat_rows_across_nodes"])
    tokens = x.shape[0] * x.shape[1]
    assert 0 < crossed[4][0] <= tokens < crossed[None][0], crossed
    assert crossed[4][0] <= crossed[4][1], crossed


def test_fp8_cast_back_over_two_hops_equals_flat():
    N, G, T, H, K, E = 2, 4, 4, 128, 2, 16
    x, idx, w = _case(29, N * G, T, H, K, E)
    mesh = pair_mesh(N, G)

    def body(x, idx, w):
        outs = []
        for hier in (True, False):
            def loss(x):
                rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES,
                                               hierarchical=hier, use_fp8=True,
                                               fp8_output="cast_back")
                return jnp.sum(rx * rx[:, :1]), rx
            (_, rx), grad = jax.value_and_grad(loss, has_aux=True)(x)
            outs += [rx, grad]
        return tuple(outs)
    two_rx, two_g, flat_rx, flat_g = run_pair(body, mesh, jnp.asarray(x, jnp.bfloat16), idx, w)
    np.testing.assert_array_equal(two_rx, flat_rx)
    np.testing.assert_allclose(two_g.astype(np.float32), flat_g.astype(np.float32),
                               rtol=2 ** -7, atol=1e-2)
    assert two_rx.any()


def test_low_latency_over_a_pair_is_the_flat_exchange():
    x, idx, w = _case(31, 8, 4, 8, 2, 16)

    def run(mesh, axis, spec):
        def body(x, i, w):
            recv, count, h = jax_ep.low_latency_dispatch(
                x, i, num_max_dispatch_tokens_per_rank=4, num_experts=16, axis_name=axis)
            return recv, count, jax_ep.low_latency_combine(recv, i, w, h)
        args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, w)]
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return [np.asarray(a) for a in jax.jit(mapped)(*args)]
    pair = run(pair_mesh(2, 4), AXES, SPEC)
    flat = run(jax.make_mesh((8,), ("ep",), devices=jax.devices()[:8]), "ep", P("ep"))
    for a, b in zip(pair, flat):
        np.testing.assert_array_equal(a, b)
    assert pair[1].sum() > 0


def test_combine_dtype_must_be_float32_or_the_rows_dtype():
    x, idx, w = _case(0, 8, 2, 8, 2, 16)

    def body(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=16, axis_name=AXES)
        return jax_ep.combine(rx, h, combine_dtype=jnp.int32)[0]
    with pytest.raises(ValueError, match="combine_dtype"):
        run_pair(body, pair_mesh(2, 4), x, idx, w)


def test_remat_by_checkpoint_name_through_two_hops():
    N, G, T, H, K, E = 2, 4, 3, 8, 2, 16
    x, idx, w = _case(37, N * G, T, H, K, E)
    policy = jax.checkpoint_policies.save_only_these_names("ep_dispatch", "ep_combine")

    def body(x, idx, w):
        def f(x, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXES)
            y = jnp.sin(rx) * rw.sum(axis=1, keepdims=True)
            return jnp.sum(jax_ep.combine(y, h)[0] ** 2)
        plain = jax.grad(f, argnums=(0, 1))(x, w)
        remat = jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1))(x, w)
        return plain + remat
    gx, gw, rx, rw = run_pair(body, pair_mesh(N, G), x, idx, w)
    np.testing.assert_allclose(rx, gx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rw, gw, rtol=1e-6, atol=1e-6)
    assert np.abs(gx).sum() > 0

"""Helpers for the expert-parallel tests: meshes, routings, numpy oracles of the layouts and a
dense single-device MoE reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import reference

AXIS = "ep"


def ep_mesh(num_ranks):
    return jax.make_mesh((num_ranks,), (AXIS,), devices=jax.devices()[:num_ranks])


def shard(mesh, *arrays):
    """device_put each array split along its first axis over the expert axis."""
    sharding = NamedSharding(mesh, P(AXIS))
    return tuple(jax.device_put(a, sharding) for a in arrays)


def run_ep(fn, mesh, *arrays, replicated=()):
    """jit(shard_map(fn)) with every array split over the expert axis (first dim) and the
    `replicated` arrays passed whole to every rank; outputs are concatenated per rank."""
    sharded = shard(mesh, *arrays)
    rep = tuple(jax.device_put(a, NamedSharding(mesh, P())) for a in replicated)
    specs = (P(AXIS),) * len(arrays) + (P(),) * len(rep)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(AXIS))
    return jax.jit(mapped)(*sharded, *rep)


def random_routing(rng, num_tokens, top_k, num_experts, unrouted=0.1):
    """topk_idx i32[T,K] with distinct experts per token and a fraction of -1 slots, and
    positive f32 weights."""
    idx = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
    idx = np.where(rng.random(idx.shape) < unrouted, -1, idx).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    return idx, weights


def deepep_layout(x, idx, w, num_ranks, num_experts):
    """Numpy oracle of DeepEP's normal-mode receive layout for every destination rank.

    x [P*T,H], idx/w [P*T,K] global (rank p holds rows p*T..). Returns per destination a dict
    of rows (source-rank-major, token-ascending): x, local ids, weights, (src rank, token)."""
    num_local = num_experts // num_ranks
    num_tokens = x.shape[0] // num_ranks
    out = []
    for dest in range(num_ranks):
        rows, ids, ws, src = [], [], [], []
        for p in range(num_ranks):
            for t in range(num_tokens):
                g = p * num_tokens + t
                owned = (idx[g] >= 0) & (idx[g] // num_local == dest)
                if owned.any():
                    rows.append(x[g])
                    ids.append(np.where(owned, idx[g] - dest * num_local, -1))
                    ws.append(np.where(owned, w[g], 0.0))
                    src.append((p, t))
        out.append(dict(x=np.array(rows).reshape(-1, x.shape[1]),
                        idx=np.array(ids, np.int32).reshape(-1, idx.shape[1]),
                        w=np.array(ws, np.float32).reshape(-1, idx.shape[1]), src=src))
    return out


def hybridep_oracle(x, routing_map, probs, num_ranks, num_permuted, pad_multiple):
    """Numpy oracle from an all-gather of every rank's tokens: per destination rank, per local
    expert, rows ordered by (source rank, source token), blocks padded, clamped to N."""
    num_tokens = x.shape[0] // num_ranks
    num_experts = routing_map.shape[1]
    L = num_experts // num_ranks
    m = pad_multiple or 1
    out = []
    for d in range(num_ranks):
        px = np.zeros((num_permuted, x.shape[1]), x.dtype)
        pp = np.zeros((num_permuted,), np.float32)
        tpe, row, dropped = [], 0, 0
        for l in range(L):
            e = d * L + l
            members = [p * num_tokens + t for p in range(num_ranks) for t in range(num_tokens)
                       if routing_map[p * num_tokens + t, e]]
            block = -(-len(members) // m) * m
            # a block cut by the buffer end keeps a whole multiple of m rows
            kept = max(0, min(block, (num_permuted - row) // m * m))
            for j, g in enumerate(members):
                if j < kept:
                    px[row + j] = x[g]
                    pp[row + j] = probs[g, e]
                else:
                    dropped += 1
            tpe.append(kept)
            row += block
        out.append((px, pp, np.array(tpe), dropped))
    return out


def owner_count(idx, num_local):
    """Number of distinct ranks owning each token's experts, [T]."""
    return np.array([len({int(e) // num_local for e in row if e >= 0}) for row in idx])


def expert_ffn(x, w_in, w_out):
    """A small expert MLP: x [..,H] @ w_in [H,F] -> gelu -> @ w_out [F,H]."""
    return jax.nn.gelu(x @ w_in) @ w_out


@jax.jit  # one program per shape (run eagerly, each of its ops compiles on its own)
def dense_moe(x, idx, w, w_in, w_out):
    """Single-device reference: out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t])."""
    all_out = jax.vmap(lambda a, b: expert_ffn(x, a, b))(w_in, w_out)  # [E,T,H]
    valid = idx >= 0
    picked = all_out[jnp.where(valid, idx, 0), jnp.arange(x.shape[0])[:, None]]  # [T,K,H]
    return jnp.sum(jnp.where(valid[..., None], picked * w[..., None], 0.0), axis=1)


_multihot = jax.jit(reference.indices_to_multihot, static_argnames="num_experts")


def dense_routing(idx, w, num_experts):
    """The oracles' dense routing: topk_idx [T,K], weights [T,K] -> numpy (routing_map
    bool[T,E], probs f32[T,E]) of reference.indices_to_multihot, one compiled program per
    shape (run eagerly, each of its ops would compile on its own)."""
    return tuple(np.asarray(a) for a in _multihot(jnp.asarray(idx), jnp.asarray(w),
                                                  num_experts=num_experts))


def local_experts(recv_x, recv_idx, recv_w, w_in, w_out):
    """Applies local experts (w_in [L,H,F], w_out [L,F,H]) to received rows, weighting each
    slot by its routing weight: y[r] = sum_k recv_w[r,k] * expert_{recv_idx[r,k]}(recv_x[r])."""
    return dense_moe(recv_x, recv_idx, recv_w, w_in, w_out)


def layer_vs_dense(layer, twin, mesh, x, token_axes, *, seed=2):
    """The loss sum(y * cot) + aux_loss of an MoELayer on `mesh` (x [B,S,H] sharded over
    token_axes, under jit) and of its twin's dense single-device forward
    (jax_ep.flax.dense_forward) -> (got, aux, grads, want, want_grads); cot is a fixed
    random cotangent like x."""
    from flax import nnx

    from jax_ep.flax import dense_forward
    xs = jax.device_put(x, NamedSharding(mesh, P(token_axes)))
    cot = jax.random.normal(jax.random.key(seed), x.shape)

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y * cot) + aux["aux_loss"], aux

    with jax.set_mesh(mesh):
        (got, aux), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, xs)
    want, want_grads = nnx.jit(nnx.value_and_grad(
        lambda m, x: (lambda y, a: jnp.sum(y * cot) + a)(*dense_forward(m, x))))(twin, x)
    return got, aux, grads, want, want_grads


def assert_param_grads_close(grads, want_grads, rtol, atol):
    """Every nnx.Param leaf of two gradient states equal within rtol/atol."""
    from flax import nnx
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(grads, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(want_grads, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=rtol,
                                   atol=atol, err_msg=str(path))


def low_latency_round_trip(topk_idx, *, tmax, num_experts, transport, **kwargs):
    """loss(x, w) of a low-latency dispatch -> tanh(rows) * 2 -> combine with weights w,
    returning (sum of squares, (recv rows, counts, src_info, layout_range, combined))."""
    import jax_ep

    def loss(x, w):
        recv, count, h = jax_ep.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank=tmax, num_experts=num_experts,
            axis_name=AXIS, transport=transport, **kwargs)
        out = jax_ep.low_latency_combine(jnp.tanh(recv) * 2, topk_idx, w, h)
        return jnp.sum(out.astype(jnp.float32) ** 2), (recv, count, h.src_info,
                                                       h.layout_range, out)
    return loss


def randomize_biases(*layers, scale=0.5):
    """Gives add_bias_linear's zero-initialised biases (router_bias, b_gate_up, b_down) the
    same random values in each layer, so a misplaced bias shows."""
    for layer in layers:
        for seed, name in enumerate(("router_bias", "b_gate_up", "b_down")):
            v = getattr(layer, name)
            v[...] = jax.random.normal(jax.random.key(40 + seed), v.shape) * scale


def nested_eqns(jaxpr):
    """(enclosing jaxpr, eqn) for every equation of jaxpr and of the jaxprs inside its
    equations (cond branches, scan / while bodies, custom_vjp and shard_map bodies), outermost
    first."""
    for eqn in jaxpr.eqns:
        yield jaxpr, eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from nested_eqns(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from nested_eqns(sub)

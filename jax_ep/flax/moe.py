"""MoELayer (Flax NNX): router top-k, SwiGLU experts as grouped GEMMs (`jax_ep.ops.grouped_matmul`:
tiled on CPU, `jax.lax.ragged_dot` on GPU/TPU, chosen by `TokenDispatcherConfig.grouped_gemm_impl`)
sharded over the expert mesh axis, the flex dispatcher, an optional shared expert and the
load-balancing auxiliary loss.

Use it under `jax.jit` with inputs sharded over a `Mesh(("data", "expert"))` (the layer runs
its body in `jax.shard_map`, tokens split over both axes, experts over "expert"), or call it
inside your own `jax.shard_map` that binds the expert axis.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import flax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep.config import TokenDispatcherConfig
from jax_ep.flax.dispatcher import MoEFlexTokenDispatcher, router_dtype, shared_dispatcher
from jax_ep import _ffi, ops, transport

__all__ = ["MoELayer", "dense_forward", "expert_tile_rows", "shard_params", "swiglu_experts"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# The nnx.Param metadata key nnx.get_named_sharding reads (renamed in flax 0.12).
_SHARDING_KEY = ("out_sharding" if tuple(int(v) for v in flax.__version__.split(".")[:2])
                 >= (0, 12) else "sharding_names")


def swiglu_experts(tokens, tokens_per_expert, w_gate_up, w_down, *, impl="auto",
                   tile_rows=None):
    """Grouped SwiGLU: tokens [N,H] in expert-major blocks of tokens_per_expert i32[L] rows,
    w_gate_up [L,H,2F], w_down [L,F,H] -> [N,H] (rows past the blocks give zeros). impl and
    tile_rows: the grouped GEMM's (`jax_ep.ops.grouped_matmul`: "auto", "tiled" or
    "ragged_dot")."""
    gmm = partial(ops.grouped_matmul, group_sizes=tokens_per_expert, impl=impl,
                  tile_rows=tile_rows)
    gate, up = jnp.split(gmm(tokens, w_gate_up), 2, axis=-1)
    return gmm(jax.nn.silu(gate) * up, w_down)


def expert_tile_rows(num_tokens, top_k, num_local_experts):
    """Rows per tile of the experts' tiled grouped GEMM: the balanced load of one local expert,
    T*K/L rows, as the nearest power of two in [32, 128]. Measured on XLA:CPU (bench_moe
    --tile-rows, 8 emulated devices): at 32, 64 and 128 balanced rows per expert the tile of
    that size was the fastest of 32, 64 and 128, by 8-12% over the next best; a tile much
    larger than a group computes masked rows, a much smaller one pays more loop steps."""
    balanced = max(num_tokens * top_k / num_local_experts, 1.0)
    return int(min(128, max(32, 2 ** round(math.log2(balanced)))))


def _weighted(expert_out, probs):
    """Expert outputs [..., H] times their probs [...]: the product in the probs' (router)
    dtype, cast back to the outputs' dtype, as PyTorch MoE experts weight bf16 activations."""
    return (expert_out * probs[..., None]).astype(expert_out.dtype)


def _swiglu(x, w_gate_up, w_down):
    gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_down


def _route(tokens, router, config, score_function):
    """tokens [T,H] -> (scores [T,E] router dtype, top-k probs f32[T,K], ids i32[T,K])."""
    dtype = router_dtype(config, tokens.dtype)
    logits = tokens.astype(dtype) @ router.astype(dtype)
    k = config.moe_router_topk
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs, ids = jax.lax.top_k(scores, k)
    else:
        scores = jax.nn.sigmoid(logits)
        probs, ids = jax.lax.top_k(scores, k)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    if config.moe_benchmark_static_routing:  # forced balance: token t takes (t*K + k) mod E
        t = jnp.arange(tokens.shape[0])[:, None]
        ids = (t * k + jnp.arange(k)) % config.num_moe_experts
        probs = jnp.full(ids.shape, 1.0 / k, dtype)
    return scores, probs.astype(jnp.float32), ids.astype(jnp.int32)


def _sum_over(axes, *values):
    """psum of per-device values over the mesh `axes` (inside shard_map). A value that does not
    vary over one of them (a constant, e.g. a count of an empty batch) still counts once per
    device."""
    return jax.lax.psum(tuple(_ffi.make_varying(v, frozenset(axes)) for v in values), axes)


def _aux_loss(scores, ids, num_experts, coeff, axes):
    """Switch-style balance loss coeff * E * sum_e f_e * P_e over every token of `axes`, plus
    the global routed-slot count per expert i32[E]."""
    counts = jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(1)
    score_sum = scores.astype(jnp.float32).sum(axis=0)
    num_tokens = jnp.asarray(scores.shape[0], jnp.float32)
    if axes:
        counts, score_sum, num_tokens = _sum_over(axes, counts, score_sum, num_tokens)
    num_tokens = jnp.maximum(num_tokens, 1.0)  # an empty batch has no loss (not 0/0)
    fraction = counts / (num_tokens * ids.shape[1])
    mean_score = score_sum / num_tokens
    return coeff * num_experts * jnp.sum(fraction * mean_score), counts


class MoELayer(nnx.Module):
    """Mixture-of-experts feed-forward layer with expert parallelism.

      config: TokenDispatcherConfig (experts, top-k, backend, router dtype, ...).
      hidden_size H, ffn_hidden_size F: each expert is SwiGLU H -> 2F -> H.
      mesh: a Mesh with config.expert_axis_name (and optionally data_axis) for pjit-style
        calls; or expert_parallel_size P when the layer is called inside your shard_map.
      shared_expert_size: hidden size of an always-on shared SwiGLU expert (None: none).
      score_function: "softmax" (then top-k) or "sigmoid" (top-k renormalised).
    __call__(x [..., H]) -> (y [..., H], aux) with aux = {"aux_loss": f32[],
    "tokens_per_expert": i32[E] (global routed slots), "num_dropped": i32[] (global)}; with
    a (node, local) expert axis also "rows_across_nodes" i32[] (rows the two-hop dispatch
    sends over the node axis, global, before drops) and "flat_rows_across_nodes" i32[]
    (what the flat exchange would send).
    """

    def __init__(self, config: TokenDispatcherConfig, hidden_size: int, ffn_hidden_size: int, *,
                 rngs: nnx.Rngs, mesh=None, expert_parallel_size=None, data_axis="data",
                 shared_expert_size=None, score_function="softmax", aux_loss_coeff=1e-2,
                 dtype=jnp.float32, dispatcher: MoEFlexTokenDispatcher | None = None):
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function: expected one of {SCORE_FUNCTIONS}, got "
                             f"{score_function!r}")
        axis = config.expert_axis_name
        if mesh is not None:
            if not set(_names(axis)) <= set(mesh.axis_names):
                raise ValueError(f"mesh: has axes {mesh.axis_names}, missing the expert axis "
                                 f"{axis!r} (TokenDispatcherConfig.expert_axis_name)")
            expert_parallel_size = math.prod(mesh.shape[a] for a in _names(axis))
        if expert_parallel_size is None:
            raise ValueError("mesh / expert_parallel_size: pass one so the layer knows P")
        num_experts = config.num_moe_experts
        if num_experts % expert_parallel_size:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by the expert "
                             f"parallel size ({expert_parallel_size})")
        self.config = config
        self.mesh = mesh
        self.data_axis = data_axis if mesh is not None and data_axis in mesh.axis_names else None
        self.score_function = score_function
        self.aux_loss_coeff = float(aux_loss_coeff)
        H, F = hidden_size, ffn_hidden_size
        init = jax.nn.initializers.normal

        def param(key, shape, scale, names):
            return nnx.Param(init(scale)(key, shape, dtype), eager_sharding=False,
                             **{_SHARDING_KEY: names})

        self.router = param(rngs.params(), (H, num_experts), H ** -0.5, (None, None))
        self.w_gate_up = param(rngs.params(), (num_experts, H, 2 * F), H ** -0.5,
                               (axis, None, None))
        self.w_down = param(rngs.params(), (num_experts, F, H), F ** -0.5, (axis, None, None))
        if shared_expert_size:
            S = shared_expert_size
            self.shared_gate_up = param(rngs.params(), (H, 2 * S), H ** -0.5, (None, None))
            self.shared_down = param(rngs.params(), (S, H), S ** -0.5, (None, None))
        else:
            self.shared_gate_up = self.shared_down = None
        num_local = num_experts // expert_parallel_size
        self.dispatcher = dispatcher or shared_dispatcher(num_local, config, axis)

    def _token_axes(self):
        axes = _names(self.config.expert_axis_name)
        return (self.data_axis,) + axes if self.data_axis else axes

    def _local(self, x, router, w_gate_up, w_down, shared):
        """The per-device body (inside shard_map): x [..., H] local tokens."""
        cfg = self.config
        tokens = x.reshape(-1, x.shape[-1])
        scores, probs, ids = _route(tokens, router, cfg, self.score_function)
        aux_loss, counts = _aux_loss(scores, ids, cfg.num_moe_experts, self.aux_loss_coeff,
                                     self._token_axes())
        d = self.dispatcher
        experts = partial(swiglu_experts, impl=cfg.grouped_gemm_impl, tile_rows=expert_tile_rows(
            tokens.shape[0], cfg.moe_router_topk, d.num_local_experts))
        if cfg.moe_deepep_async_dispatch and d.backend != "hybridep":
            def local_kernel(recv_x, recv_idx, recv_w):
                routing_map, rprobs = d.local_multihot(recv_idx, recv_w)
                n = d._num_permuted(recv_x.shape[0], recv_idx.shape[1])
                px, pp, rows, tpe = ops.permute(recv_x, routing_map, rprobs, num_out_tokens=n,
                                                pad_multiple=cfg.moe_router_expert_pad_multiple,
                                                impl=d._local_impl)
                out = _weighted(experts(px, tpe, w_gate_up, w_down), pp)
                return ops.unpermute(out, rows, num_tokens=recv_x.shape[0], impl=d._local_impl)
            y, dropped = d.overlapped_forward(tokens, probs, ids, local_kernel)
        else:
            permuted, tpe, pp, state = d.token_permutation2(tokens, tokens.shape[0], probs, ids)
            out = experts(permuted, tpe, w_gate_up, w_down)
            y = d.token_unpermutation(_weighted(out, pp), state)
            dropped = state.num_dropped
        if shared is not None:
            y = y + _swiglu(tokens, *shared)
        (dropped,) = _sum_over(self._token_axes(), dropped)
        aux = {"aux_loss": aux_loss, "tokens_per_expert": counts, "num_dropped": dropped}
        if not isinstance(cfg.expert_axis_name, str):
            aux.update(zip(("rows_across_nodes", "flat_rows_across_nodes"), _sum_over(
                self._token_axes(), *_rows_across_nodes(ids, cfg.num_moe_experts,
                                                        cfg.expert_axis_name))))
        return y.reshape(x.shape).astype(x.dtype), aux

    def __call__(self, x):
        hidden = self.router.shape[0]
        if jnp.ndim(x) < 1 or x.shape[-1] != hidden:
            raise ValueError(f"x: expected [..., hidden_size={hidden}], got shape {jnp.shape(x)}")
        shared = (None if self.shared_gate_up is None
                  else (self.shared_gate_up[...], self.shared_down[...]))
        params = (self.router[...], self.w_gate_up[...], self.w_down[...], shared)
        axis = self.config.expert_axis_name
        try:
            jax.lax.axis_size(axis)
            inside_shard_map = True
        except NameError:
            inside_shard_map = False
        if inside_shard_map:
            return self._local(x, *params)
        if self.mesh is None:
            raise ValueError(f"mesh: the layer was built without a mesh, so call it inside a "
                             f"jax.shard_map that binds {axis!r}")
        token_axes = self._token_axes()
        devices = math.prod(self.mesh.shape[a] for a in token_axes)
        if x.ndim < 2 or x.shape[0] % devices:
            raise ValueError(f"x: expected [batch, ..., hidden_size] with batch divisible by the "
                             f"{devices} devices of mesh axes {token_axes}, got shape {x.shape}")
        tokens_spec = P(token_axes)
        shared_spec = None if shared is None else (P(), P())
        in_specs = (tokens_spec, P(), P(axis), P(axis), shared_spec)
        fn = jax.shard_map(self._local, mesh=self.mesh, in_specs=in_specs,
                           out_specs=(tokens_spec, P()))
        return fn(*_laid_out(self.mesh, (x, *params), in_specs))


def _rows_across_nodes(ids, num_experts, axes):
    """Rows this rank's tokens (ids i32[T,K]) send over the node axis of axes=(node, local)
    before drops: the two-hop dispatch's (token, other node) pairs and the flat exchange's
    (token, rank on another node) pairs, i32[] each."""
    node, num_nodes = transport.axis_rank_and_size(axes[0])
    num_ranks = num_nodes * transport.axis_rank_and_size(axes[1])[1]
    per_node = ops.get_dispatch_layout(ids, num_experts=num_experts, num_ranks=num_nodes)[0]
    per_rank = ops.get_dispatch_layout(ids, num_experts=num_experts, num_ranks=num_ranks)[0]
    own_ranks = num_ranks // num_nodes
    on_own_node = jax.lax.dynamic_slice_in_dim(per_rank, node * own_ranks, own_ranks).sum()
    return per_node.sum() - per_node[node], per_rank.sum() - on_own_node


def _names(axis):
    """The mesh axis names of an expert axis (a name or a (node, local) pair) as a tuple."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _laid_out(mesh, args, specs):
    """args resharded to their shard_map in_specs where the mesh axes are Explicit: there
    shard_map takes only inputs already laid out as it says (not a batch split over "data"
    alone, nor one made inside jit), while with Auto axes it reshards them itself. An arg may
    be None or a tuple of arrays (with a tuple of specs)."""
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit}

    def place(a, spec):
        if a is None:
            return None
        if isinstance(a, tuple):
            return tuple(place(u, v) for u, v in zip(a, spec))
        named = {n for part in spec if part is not None
                 for n in ((part,) if isinstance(part, str) else part)}
        if explicit and named <= explicit:
            return jax.sharding.reshard(a, NamedSharding(mesh, spec))
        return a

    return tuple(place(a, spec) for a, spec in zip(args, specs))


def dense_forward(layer: MoELayer, x):
    """Single-device reference of `layer` (no expert parallelism, no capacity): the oracle
    the layer is tested against. Returns (y [..., H], aux_loss)."""
    cfg = layer.config
    tokens = x.reshape(-1, x.shape[-1])
    scores, probs, ids = _route(tokens, layer.router[...], cfg, layer.score_function)
    aux_loss, _ = _aux_loss(scores, ids, cfg.num_moe_experts, layer.aux_loss_coeff, ())
    every = jax.vmap(lambda a, b: _swiglu(tokens, a, b))(layer.w_gate_up[...],
                                                         layer.w_down[...])  # [E,T,H]
    picked = every[ids, jnp.arange(tokens.shape[0])[:, None]]  # [T,K,H]
    y = jnp.sum(_weighted(picked, probs), axis=1)
    if layer.shared_gate_up is not None:
        y = y + _swiglu(tokens, layer.shared_gate_up[...], layer.shared_down[...])
    return y.reshape(x.shape).astype(x.dtype), aux_loss


def shard_params(model, mesh):
    """Places every nnx.Param of `model` by its sharding_names on `mesh` (experts over the
    expert axis, the rest replicated). Works across processes: values go through host memory,
    so every process must hold the same values (same seed)."""
    state = nnx.state(model)
    shardings = nnx.get_named_sharding(state, mesh)
    host = jax.tree.map(np.asarray, state)
    nnx.update(model, jax.device_put(host, shardings))
    return model

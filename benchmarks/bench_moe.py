"""Training step of jax_ep.flax.MoELayer (forward + backward under jax.jit) on the (2, 4)
("data", "expert") mesh of 8 emulated CPU devices, per dispatcher backend, vs a GShard-style
one-hot einsum MoE with the same parameters.

    python -m benchmarks.bench_moe [--tokens 64 --hidden 128 --ffn 128 --experts 64
                                    --topk 8 --out benchmarks/out]

Every variant computes loss = mean(y^2) of the layer output y (softmax router, top-k, SwiGLU
experts, weighted sum) and its gradient with respect to all parameters; the jax_ep backends
give the same loss (no token is dropped), GShard drops the slots past its capacity (with none
dropped, its loss is the layer's up to rounding: it renormalises the top-k probabilities as the
router does).
"hybridep" is the config default (dense [T,E] routing map); "hybridep-compact" sets
moe_hybridep_compact_routing=True (top-k ids on the wire). A ":impl" suffix picks the experts'
grouped GEMM (TokenDispatcherConfig.grouped_gemm_impl): "deepep:ragged_dot" is the layer with
jax.lax.ragged_dot, which XLA:CPU lowers to one dense matmul over every local expert; plain
names use "auto" ("ffi" on CPU: jax_ep.ops.grouped_matmul's CPU handler), "deepep:blocks"
is the expert blocks and "deepep:tiled" the tiled loop. An "@cap" suffix sets the layer's
moe_expert_capacity_factor to --capacity-factor (drops, as MaxText's capacity path does);
"@cap+pad" also sets moe_pad_expert_input_to_capacity (Megatron's drop-and-pad: every local
expert's block padded to its capacity, the equal blocks one batched GEMM per weight), e.g.
--backends deepep,deepep@cap,deepep@cap+pad. "@bounded" sets the dispatcher's
dropless_buffer_factor to --buffer-factor: dropless, with buffers of --buffer-factor times
the balanced load in a step whose routing fits them, otherwise again in token chunks whose
worst case fits buffers of that size.

More rows time the layer's expert GEMMs alone (jax_ep.flax.swiglu_experts, forward +
backward) on the permuted buffer the deepep backend feeds them (N = P*T*min(K, L) rows per
device, the no-drop worst case, with the T*K balanced slots routed), once with ragged_dot,
once with the CPU handler, once with the expert blocks and once per --tile-rows with the tiled
grouped GEMM, to separate expert compute from dispatch.

--peer maxtext adds MaxText's RoutedMoE (benchmarks/peer_maxtext.py) built from its pyconfig
with the same shapes, mesh, dtype and loss, timed by the same code in the same process: its
dense dropless path and its capacity path (--capacity-factor, which drops). It needs Python
>= 3.12 and `pip install --no-deps maxtext` plus its layers' imports (see
benchmarks/RESULTS.md); without it the rows are skipped with a message.
--routers adds rows of the deepep layer per Megatron router option (jax_ep.flax.MoEConfig),
"router plain" (softmax top-k, no loss) being the one the "vs router plain" column divides by:
aux (aux_loss, coeff 1e-2), seq_aux (seq_aux_loss over sequences of --seq-len tokens), global_aux,
z_loss (coeff 1e-3), bias (sigmoid scores + expert bias, updated in the step), groups
(node-limited routing: 8 groups, 4 eligible). The loss of those rows adds aux["aux_loss"].
Every timed step computes what MaxText's does, the loss and its gradients (the @bounded rows
also return their fallback flag, which the step computes anyway); the "dropped slots" column
comes from one more, untimed, call of the forward after the timed rounds (a count summed over
every device, which MaxText's step has no counterpart of: inside the timed step it cost the E
= 8 row 4-5%, benchmarks/RESULTS.md session 33).
--baseline names the row the speedup column divides by. Every row is timed round-robin
(one call of each per round, after each compiled and warmed up), so the ratios hold on a
shared machine whose speed drifts.
The "peak MiB/dev" column is the compiled step's memory per device from XLA's memory analysis
(`jax.jit(step).lower(*args).compile().memory_analysis()`): argument + output + temp - alias
bytes of one device's program ("temp MiB/dev": its temporaries alone); "n/a" where the row's
step cannot be lowered (nnx.jit rows) or the backend reports nothing.
--parts times the deepep layer's step cut after each of its parts (router; + routing plan:
count exchange and send layout; + dispatch exchange of the rows and weights; + local permute;
+ expert GEMMs; + unpermute; + combine exchange = the whole layer), each prefix's forward +
backward (in the router weights, and from the expert GEMMs on in the expert weights too)
round-robin with the rest; the differences of consecutive prefixes are the parts' costs,
printed as a second table with their shares of the whole step. `--parts deepep@bounded` cuts
the bounded path instead (the layer with ragged_buffer_factor = --buffer-factor: the buffers
of dropless_buffer_factor without its overflow check and fallback); with the deepep@bounded
row in --backends, a last row gives what that row adds (the overflow check and the cond).
"""

from __future__ import annotations

import argparse
import math
import os
from functools import partial

from benchmarks import common

BACKENDS = ("deepep", "deepep:ragged_dot", "alltoall", "hybridep", "hybridep-compact")
BACKENDS_NAMES = ("deepep", "uccl_ep", "alltoall", "hybridep", "hybridep-compact", "gshard")
# Router options (MoEConfig fields) timed as "router NAME" rows on the deepep backend.
ROUTERS = {
    "plain": dict(moe_router_load_balancing_type="none"),
    "aux": dict(moe_aux_loss_coeff=1e-2),
    "seq_aux": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "global_aux": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
    "z_loss": dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=1e-3),
    "bias": dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True),
    "groups": dict(moe_router_load_balancing_type="none", moe_router_num_groups=8,
                   moe_router_group_topk=4),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=common.positive_int, default=64, help="tokens per device")
    p.add_argument("--glibc-heap-defaults", action="store_true",
                   help="leave glibc malloc as it is (default: keep freed host memory mapped, "
                        "see common.keep_host_heap)")
    p.add_argument("--hidden", type=common.positive_int, default=128)
    p.add_argument("--ffn", type=common.positive_int, default=128, help="expert FFN hidden size F")
    p.add_argument("--experts", type=common.positive_int, default=64)
    p.add_argument("--topk", type=common.positive_int, default=8)
    p.add_argument("--data", type=common.positive_int, default=2,
                   help="size of the data mesh axis")
    p.add_argument("--expert-parallel", type=common.positive_int, default=4,
                   help="size of the expert axis")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--capacity-factor", type=common.positive_float, default=1.25,
                   help="gshard capacity")
    p.add_argument("--buffer-factor", type=common.positive_float, default=1.25,
                   help="dropless_buffer_factor of the @bounded rows")
    p.add_argument("--backends", default=",".join(BACKENDS) + ",gshard",
                   type=common.comma_list(_backend),
                   help="comma list of rows: gshard, or a backend (deepep, uccl_ep, alltoall, "
                        "hybridep, hybridep-compact) with an optional @cap, @cap+pad or "
                        "@bounded and an optional :IMPL grouped GEMM (deepep@bounded:tiled)")
    p.add_argument("--tile-rows", default="64", type=common.comma_list(common.positive_int),
                   help="comma-separated tile sizes of the experts-only tiled GEMM rows")
    p.add_argument("--no-experts-only", action="store_true",
                   help="skip the experts-only rows (ragged_dot's is slow at large E)")
    p.add_argument("--peer", default="", choices=["", "maxtext"],
                   help="also time this peer's MoE layer side by side")
    p.add_argument("--routers", default="", type=common.comma_list(choices=ROUTERS),
                   help=f"comma-separated router options to time, of {', '.join(ROUTERS)}")
    p.add_argument("--seq-len", type=common.positive_int, default=16,
                   help="tokens per sequence (the seq_aux router's sequences)")
    p.add_argument("--parts", nargs="?", const="deepep", default=None,
                   choices=("deepep", "deepep@bounded"),
                   help="also time the deepep step's parts (prefixes of the step, see above); "
                        "deepep@bounded: the bounded path's")
    p.add_argument("--baseline", default=None,
                   help="row the speedup column divides by (default gshard; where the run has "
                        "no gshard row the column reads n/a)")
    p.add_argument("--cpu-pool-helpers", default="auto", choices=("auto", "always", "never"),
                   help="whether jax_ep's CPU handlers hand loop chunks to XLA's intra-op pool "
                        "(jax_ep._jax_ep.set_cpu_pool_helpers; auto: while fewer devices than "
                        "the pool's threads)")
    p.add_argument("--iters", type=common.positive_int, default=7)
    p.add_argument("--warmup", type=common.non_negative_int, default=2)
    p.add_argument("--out", default="benchmarks/out")
    a = p.parse_args(argv)
    if a.topk > a.experts:
        p.error(f"--topk: expected at most --experts {a.experts}, got {a.topk}")
    if a.experts % a.expert_parallel:
        p.error(f"--experts: expected a multiple of --expert-parallel {a.expert_parallel}, "
                f"got {a.experts}")
    if not (a.backends or a.peer or a.routers or not a.no_experts_only):
        p.error("--backends: expected at least one row (or --peer / --routers)")
    return a


def _backend(text):
    """argparse type of one --backends entry: NAME[@VARIANT][:IMPL], checked."""
    name, _, impl = text.partition(":")
    name, _, variant = name.partition("@")
    if name not in BACKENDS_NAMES or variant not in ("", "cap", "cap+pad", "bounded") or (
            impl not in ("", "auto", "ffi", "tiled", "blocks", "ragged_dot")) or (
            name == "gshard" and (variant or impl)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected gshard or NAME[@cap|@cap+pad|@bounded][:IMPL] with NAME one "
            f"of {BACKENDS_NAMES[:-1]} and IMPL one of auto, ffi, tiled, blocks, ragged_dot")
    return text


def gshard_layer(a, num_ranks):
    """Per-device body of a GShard MoE layer (softmax router, top-k probabilities renormalised as
    the layer's softmax over the top-k logits, one-hot dispatch mask [T,E,C], all_to_all of
    [E,C,H] over "expert", batched SwiGLU per local expert, all_to_all back, combine einsum).
    Returns (body(x, router, w_gate_up, w_down) -> (y, dropped slots), capacity)."""
    import jax
    import jax.numpy as jnp

    E, K = a.experts, a.topk
    L = E // num_ranks
    cap = max(1, math.ceil(a.tokens * K / E * a.capacity_factor))
    f32 = jnp.float32

    def body(x, router, w_gate_up, w_down):
        tokens = x.reshape(-1, x.shape[-1])
        T, H = tokens.shape
        scores = jax.nn.softmax(tokens.astype(f32) @ router.astype(f32), axis=-1)
        probs, ids = jax.lax.top_k(scores, K)
        probs = probs / probs.sum(axis=-1, keepdims=True)  # MoEConfig's default: softmax of top-k
        onehot = jax.nn.one_hot(ids.T, E, dtype=jnp.int32)  # [K,T,E], top-1 slots first
        pos = ((jnp.cumsum(onehot.reshape(K * T, E), axis=0).reshape(K, T, E) - 1)
               * onehot).sum(axis=-1)
        keep = pos < cap
        pos_oh = jax.nn.one_hot(jnp.where(keep, pos, cap), cap, dtype=f32)  # [K,T,C]
        dispatch = jnp.einsum("kte,ktc->tec", onehot.astype(f32), pos_oh)
        combine = jnp.einsum("kte,ktc,tk->tec", onehot.astype(f32), pos_oh, probs)
        buf = jnp.einsum("tec,th->ech", dispatch.astype(x.dtype), tokens)
        recv = jax.lax.all_to_all(buf.reshape(num_ranks, L, cap, H), "expert", 0, 0)
        xin = recv.transpose(1, 0, 2, 3).reshape(L, num_ranks * cap, H)
        gate, up = jnp.split(jnp.einsum("lnh,lhf->lnf", xin, w_gate_up), 2, axis=-1)
        out = jnp.einsum("lnf,lfh->lnh", jax.nn.silu(gate) * up, w_down)
        out = out.reshape(L, num_ranks, cap, H).transpose(1, 0, 2, 3)
        back = jax.lax.all_to_all(out, "expert", 0, 0).reshape(E, cap, H)
        y = jnp.einsum("tec,ech->th", combine.astype(x.dtype), back)
        dropped = jax.lax.psum((~keep).sum(), ("data", "expert"))
        return y.reshape(x.shape), dropped

    return body, cap


def memory_per_device(step, args, context):
    """XLA's memory analysis of the compiled step (one device's program): {"argument",
    "output", "temp", "alias", "generated_code", "peak" (argument + output + temp - alias),
    and "xla_peak" where the backend reports peak_memory_in_bytes: on XLA:CPU (jax 0.11.2) that
    is arguments + outputs only, the same for every row) in bytes, or None where
    the step cannot be lowered (e.g. an nnx.jit) or the backend reports nothing. The lowering
    and compilation hit jax's caches when the step ran before with the same arguments."""
    try:
        with context():
            stats = step.lower(*args).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 -- a missing analysis leaves the cell "n/a"
        print(f"  memory analysis unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None
    if stats is None:
        return None
    get = lambda name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0)  # noqa: E731
    mem = {k: get(k) for k in ("argument", "output", "temp", "alias", "generated_code")}
    mem["peak"] = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if xla_peak:
        mem["xla_peak"] = xla_peak
    return mem


PARTS = ("router", "routing plan", "dispatch exchange", "permute", "expert GEMMs", "unpermute",
         "combine exchange")


def part_calls(a, mesh, layer, x):
    """The deepep layer's step cut after each of PARTS: name -> (jitted forward + backward of
    the prefix's loss with respect to the router weights, and from the expert GEMMs on also the
    expert weights, args, mesh context). The prefixes before the GEMMs leave the expert
    weights out of the gradient: their gradients would be zeros written by those prefixes,
    so the router's part would carry the cost of writing the expert weights' gradients that
    belongs to the GEMMs' part. Each prefix runs the layer's own code (its router's functions
    in jax_ep.flax.router, the dispatcher's methods, swiglu_experts with the layer's tiles)
    up to its part; its loss is mean(out^2) of the part's output (the routing plan: a
    vanishing multiple of its received ids, to keep it)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_ep import internode
    from jax_ep import transport as tp
    from jax_ep.flax import moe
    from jax_ep.flax import router as routing
    from jax_ep.flax.dispatcher import router_dtype

    cfg, d = layer.config, layer.dispatcher
    dcfg = layer.dispatch_config
    axes = ("data", "expert")

    def sq(v):
        return jnp.mean(v.astype(jnp.float32) ** 2)

    def body(x, router, w_gate_up, w_down, stop):
        tokens = x.reshape(-1, x.shape[-1])
        T = tokens.shape[0]
        logits = routing.router_gating_linear(
            tokens, router.T, None, router_dtype(dcfg, tokens.dtype))
        probs, ids = routing.route(logits, cfg)
        probs = probs.astype(jnp.float32)
        if stop == "router":
            return jax.lax.pmean(sq(probs), axes)
        hidden, state = d.dispatch_preprocess2(tokens, T, probs, ids)
        if stop == "routing plan":
            impl = tp.check_backend(d.backend)
            handle = internode.routing_plan(
                state.token_indices, cfg.num_moe_experts, d.axis_name,
                transport=tp.resolve_transport(dcfg.transport, tp.xla_only(impl)), impl=impl,
                capacity=d.rank_capacity(T), num_worst_tokens=d.num_recv_rows(T))
            return jax.lax.pmean(sq(probs) + 1e-9 * handle.recv_topk_idx.sum(), axes)
        received, state = d.dispatch_all_to_all(hidden, state)
        if stop == "dispatch exchange":
            return jax.lax.pmean(sq(received[0]) + sq(received[2]), axes)
        permuted, tpe, pp, state = d.dispatch_postprocess(received, state)
        if stop == "permute":
            return jax.lax.pmean(sq(permuted) + sq(pp), axes)
        out = moe.swiglu_experts(permuted, tpe, w_gate_up, w_down, impl=dcfg.grouped_gemm_impl,
                                 tile_rows=moe.expert_tile_rows(T, cfg.moe_router_topk,
                                                                d.num_local_experts))
        out = (out * pp[:, None]).astype(out.dtype)
        if stop == "expert GEMMs":
            return jax.lax.pmean(sq(out), axes)
        out = d.combine_preprocess(out, state)
        if stop == "unpermute":
            return jax.lax.pmean(sq(out), axes)
        return jax.lax.pmean(sq(d.combine_all_to_all(out, state)), axes)

    spec = P(axes)
    params = (layer.router[...], layer.w_gate_up[...], layer.w_down[...])
    calls = {}
    for stop in PARTS:
        fn = jax.shard_map(partial(body, stop=stop), mesh=mesh,
                           in_specs=(spec, P(), P("expert"), P("expert")), out_specs=P())

        def loss(router, experts, x, fn=fn):
            return fn(x, router, *experts)

        uses_experts = PARTS.index(stop) >= PARTS.index("expert GEMMs")
        grad = jax.value_and_grad(loss, argnums=(0, 1) if uses_experts else 0)
        calls[f"to {stop}"] = (jax.jit(grad), (params[0], params[1:], x),
                               partial(jax.set_mesh, mesh))
    return calls


def main(argv=None):
    a = parse_args(argv)
    common.force_cpu_devices(a.data * a.expert_parallel)
    print(f"host heap: {common.keep_host_heap(not a.glibc_heap_defaults)}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep import _jax_ep
    from jax_ep.flax import MoEConfig, MoELayer, shard_params

    _jax_ep.set_cpu_pool_helpers(a.cpu_pool_helpers)

    mesh = common.cpu_mesh((a.data, a.expert_parallel), ("data", "expert"))
    dtype = jnp.dtype(a.dtype)
    devices = a.data * a.expert_parallel
    num_tokens = devices * a.tokens
    seq = math.gcd(a.seq_len, a.tokens)  # whole sequences per device
    x = jax.random.normal(jax.random.key(1), (devices * a.tokens // seq, seq, a.hidden), dtype)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    print(f"jax {jax.__version__}, mesh {dict(mesh.shape)} of {jax.devices()[0].device_kind} "
          f"devices on {os.cpu_count()} cores; {num_tokens} tokens ({a.tokens}/device), "
          f"H={a.hidden} F={a.ffn} E={a.experts} K={a.topk} {a.dtype}")

    def make_layer(backend, router=None, bounded_path=False):
        """backend's layer; bounded_path: its buffers of ragged_buffer_factor = --buffer-factor
        (the bounded path of dropless_buffer_factor, without its fallback)."""
        name, _, impl = backend.partition(":")
        name, _, variant = name.partition("@")  # "@cap": --capacity-factor, "@cap+pad": padded
        bounded = variant == "bounded"  # dropless, --buffer-factor buffers where they fit
        cfg = jax_ep.TokenDispatcherConfig(
            num_moe_experts=a.experts, moe_router_topk=a.topk,
            moe_flex_dispatcher_backend=name.split("-")[0],
            moe_hybridep_compact_routing=name.endswith("-compact"),
            moe_permute_fusion=name != "alltoall", moe_share_token_dispatcher=False,
            grouped_gemm_impl=impl or "auto",
            dropless_buffer_factor=a.buffer_factor if bounded else None,
            ragged_buffer_factor=a.buffer_factor if bounded_path else None)
        if router is not None:
            cfg = MoEConfig(num_moe_experts=a.experts, moe_router_topk=a.topk,
                            moe_router_dtype="fp32", token_dispatcher=cfg, **ROUTERS[router])
        elif variant and not bounded:  # --backends' type checked the variant
            cfg = MoEConfig(num_moe_experts=a.experts, moe_router_topk=a.topk,
                            token_dispatcher=cfg, moe_expert_capacity_factor=a.capacity_factor,
                            moe_pad_expert_input_to_capacity=variant == "cap+pad")
        layer = MoELayer(cfg, a.hidden, a.ffn, rngs=nnx.Rngs(0), mesh=mesh, dtype=dtype,
                         param_dtype=dtype)
        return shard_params(layer, mesh)

    results = {"config": vars(a), "num_tokens": num_tokens, "runs": {}}
    wanted = list(a.backends)
    if a.peer == "maxtext":
        from benchmarks import peer_maxtext
        missing = peer_maxtext.missing()
        if missing:
            print(f"--peer maxtext: skipped, {missing}")
        else:
            wanted += ["maxtext dense dropless", f"maxtext capacity {a.capacity_factor:g}"]
    wanted += [f"router {r}" for r in a.routers]
    if a.baseline is None:
        a.baseline = "gshard"
    elif a.peer and a.baseline.startswith(a.peer) and a.baseline not in wanted:
        print(f"--baseline {a.baseline!r}: the peer was skipped, the speedup column reads n/a")
    elif a.baseline not in wanted and not a.baseline.startswith("experts only"):
        raise SystemExit(f"--baseline {a.baseline!r}: not a row of this run, expected one of "
                         f"{wanted} (or an experts-only row)")
    calls, extras = {}, {}
    counts = {}  # row -> (jitted forward giving its dropped slots, args, context): untimed
    for backend in wanted:
        mesh_context = partial(jax.set_mesh, mesh)  # (jax.set_mesh(m) alone sets it for good)
        extras[backend] = {}
        if backend.startswith("maxtext"):
            params, x_peer, fn, peer_mesh = peer_maxtext.layer(
                a, mesh, dtype, capacity_factor=(None if "dropless" in backend
                                                 else a.capacity_factor))
            step = jax.jit(jax.value_and_grad(fn, has_aux=True))
            args = (params, x_peer)
            mesh_context = partial(jax.set_mesh, peer_mesh)
        elif backend == "gshard":
            layer = make_layer("deepep")  # same parameters (same seed)
            body, cap = gshard_layer(a, a.expert_parallel)
            spec = P(("data", "expert"))
            fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P("expert"), P("expert")),
                               out_specs=(spec, P()))
            params = (layer.router[...], layer.w_gate_up[...], layer.w_down[...])

            def loss(params, x, fn=fn):
                return jnp.mean(fn(x, *params)[0].astype(jnp.float32) ** 2), None

            step = jax.jit(jax.value_and_grad(loss, has_aux=True))
            args = (params, x)
            extras[backend] = {"capacity": cap}
            counts[backend] = (jax.jit(lambda params, x, fn=fn: fn(x, *params)[1]), args,
                               mesh_context)
        elif backend.startswith("router "):
            layer = make_layer("deepep", backend.split()[1])

            def train(layer, x):
                def loss(layer):
                    y, aux = layer(x)
                    return jnp.mean(y.astype(jnp.float32) ** 2) + aux["aux_loss"], aux
                (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
                if layer.expert_bias is not None:
                    layer.update_expert_bias(aux["tokens_per_expert"])
                return (value, None), grads

            step = nnx.jit(train)
            args = (layer, x)
            counts[backend] = (nnx.jit(lambda layer, x: layer(x)[1]["num_dropped"]), args,
                               mesh_context)
        else:
            layer = make_layer(backend)
            graphdef, state = nnx.split(layer)

            def loss(state, x, graphdef=graphdef):
                y, aux = nnx.merge(graphdef, state)(x)
                # @bounded rows: whether the step fell back (the chunked worst case); -1 else
                return jnp.mean(y.astype(jnp.float32) ** 2), aux.get("buffer_overflow", -1)

            step = jax.jit(jax.value_and_grad(loss, has_aux=True))
            args = (state, x)
            counts[backend] = (jax.jit(lambda state, x, graphdef=graphdef: nnx.merge(
                graphdef, state)(x)[1]["num_dropped"]), args, mesh_context)
        calls[backend] = (step, args, mesh_context)

    # The expert GEMMs alone at the deepep backend's permuted-buffer size.
    from jax_ep.flax import swiglu_experts
    P_ = a.expert_parallel
    L = a.experts // P_
    n_rows = P_ * a.tokens * min(a.topk, L)
    per_expert = a.tokens * a.topk // P_ // L * P_  # balanced routing: T*K slots per rank
    layer = make_layer("deepep")
    spec = P(("data", "expert"))

    def experts_loss(w_gate_up, w_down, rows, impl, tile_rows):
        tpe = jnp.full((L,), per_expert, jnp.int32)
        y = swiglu_experts(rows, tpe, w_gate_up, w_down, impl=impl, tile_rows=tile_rows)
        return jax.lax.pmean(jnp.mean(y.astype(jnp.float32) ** 2), ("data", "expert"))

    rows = jax.device_put(jax.random.normal(jax.random.key(2), (devices * n_rows, a.hidden),
                                            dtype), NamedSharding(mesh, spec))
    gemms = [] if a.no_experts_only else (
        [("ragged_dot", None), ("ffi", None), ("blocks", None)]
        + [("tiled", t) for t in a.tile_rows])
    experts_only = []
    for impl, tile_rows in gemms:
        experts_fn = jax.shard_map(partial(experts_loss, impl=impl, tile_rows=tile_rows),
                                   mesh=mesh, in_specs=(P("expert"), P("expert"), spec),
                                   out_specs=P())
        name = (f"experts only ({impl}{f' {tile_rows}-row tiles' if tile_rows else ''}, "
                f"N={n_rows}, {L * per_expert} routed)")
        experts_only.append(name)
        calls[name] = (jax.jit(jax.value_and_grad(experts_fn, argnums=(0, 1))),
                       (layer.w_gate_up[...], layer.w_down[...], rows),
                       partial(jax.set_mesh, mesh))

    parts = {}
    if a.parts:
        parts = part_calls(a, mesh, make_layer("deepep", bounded_path=a.parts != "deepep"), x)
        calls.update(parts)

    timed = common.time_round_robin(calls, warmup=a.warmup, iters=a.iters)
    for name, (t, out) in timed.items():
        t["memory"] = memory_per_device(*calls[name])
        if name in parts:
            t.update(loss=float(out[0]), dropped_fraction=float("nan"),
                     tokens_per_s=num_tokens / t["median_s"])
            results["runs"][name] = t
            print(f"  {name:22s} {t['median_s'] * 1e3:9.1f} ms", flush=True)
            continue
        if name in experts_only:
            t.update(rows_per_device=n_rows, loss=float("nan"), dropped_fraction=float("nan"),
                     tokens_per_s=num_tokens / t["median_s"])
            results["runs"][name] = t
            print(f"  {name} {t['median_s'] * 1e3:9.1f} ms", flush=True)
            continue
        (value, overflow), _ = out
        if overflow is not None and int(overflow) >= 0:  # the @bounded rows
            t["buffer_overflow"] = int(overflow)
        if name in counts:  # MaxText's step: no count
            fn, args, context = counts[name]
            with context():
                dropped = int(fn(*args))
        else:
            dropped = float("nan")
        t.update(extras[name], loss=float(value), dropped_slots=dropped,
                 dropped_fraction=dropped / (num_tokens * a.topk),
                 tokens_per_s=num_tokens / t["median_s"])
        results["runs"][name] = t
        print(f"  {name:22s} {t['median_s'] * 1e3:9.1f} ms/step  {t['tokens_per_s']:9.0f} "
              f"tokens/s  loss {t['loss']:.6f}  dropped {t['dropped_fraction']:.1%}  "
              f"(first call {t['compile_s']:.1f} s)"
              + (f"  fell back: {'yes' if t['buffer_overflow'] else 'no'}"
                 if "buffer_overflow" in t else ""), flush=True)

    runs = results["runs"]
    ref = runs.get(a.baseline, {}).get("median_s")
    def mib(t, key):
        mem = t.get("memory")
        return "n/a" if not mem else f"{mem[key] / 2**20:.2f}"

    rows = [[name, t["median_s"] * 1e3, t["min_s"] * 1e3, t["tokens_per_s"],
             ref / t["median_s"] if ref else "n/a",
             "" if math.isnan(t["loss"]) else f"{t['loss']:.6f}",
             "" if math.isnan(t["dropped_fraction"]) else f"{100 * t['dropped_fraction']:.1f}%",
             mib(t, "peak"), mib(t, "temp")]
            for name, t in runs.items() if name not in parts]
    md = common.print_table(
        f"MoELayer forward + backward under jax.jit, mesh (data={a.data}, "
        f"expert={a.expert_parallel}), {num_tokens} tokens, median of {a.iters}",
        ["backend", "step ms", "min ms", "tokens/s", f"speedup vs {a.baseline}", "loss",
         "dropped slots", "peak MiB/dev", "temp MiB/dev"], rows)
    if parts:
        whole = runs[f"to {PARTS[-1]}"]["median_s"]
        prev, prows = 0.0, []
        for stop in PARTS:
            t = runs[f"to {stop}"]["median_s"]
            prows.append([stop, t * 1e3, (t - prev) * 1e3, f"{100 * (t - prev) / whole:.1f}%",
                          mib(runs[f"to {stop}"], "peak")])
            prev = t
        if a.parts in runs:
            t = runs[a.parts]["median_s"]
            adds = "overflow check, cond, " if a.parts != "deepep" else ""
            prows.append([f"(whole {a.parts} row: + {adds}counts, nnx)", t * 1e3,
                          (t - prev) * 1e3, f"{100 * (t - prev) / whole:.1f}%",
                          mib(runs[a.parts], "peak")])
        md += "\n" + common.print_table(
            f"Parts of the {a.parts} step (forward + backward of the step cut after each part; "
            f"median of {a.iters}, round-robin)",
            ["up to and including", "prefix ms", "part ms", "share of the step",
             "peak MiB/dev"], prows)
    plain = runs.get("router plain", {}).get("median_s")
    if a.routers and plain:
        rrows = [[n, runs[n]["median_s"] * 1e3, runs[n]["median_s"] / plain]
                 for n in runs if n.startswith("router ")]
        md += "\n" + common.print_table(
            "Router options (deepep layer, forward + backward + expert-bias update)",
            ["router", "step ms", "time vs router plain"], rrows)
    jax_ep_losses = [runs[n]["loss"] for n in BACKENDS if n in runs]
    if len(jax_ep_losses) > 1:
        spread = float(np.ptp(jax_ep_losses) / abs(np.mean(jax_ep_losses)))
        results["jax_ep_loss_rel_spread"] = spread
        print(f"relative spread of the jax_ep backends' losses: {spread:.2e}")
    os.makedirs(a.out, exist_ok=True)
    path = common.write_json(os.path.join(a.out, "bench_moe.json"), results)
    with open(os.path.join(a.out, "bench_moe.md"), "w") as f:
        f.write(md)
    names = [n for n in runs if n not in parts]
    common.bar_plot(os.path.join(a.out, "bench_moe.png"), names,
                    {"step ms (median)": [runs[n]["median_s"] * 1e3 for n in names]},
                    ylabel="ms per forward + backward step (log)", log=True,
                    title=f"MoELayer train step, {num_tokens} tokens, E={a.experts} K={a.topk} "
                          f"on {devices} {jax.devices()[0].platform} devices")
    common.bar_plot(os.path.join(a.out, "bench_moe_memory.png"), names,
                    {key: [runs[n]["memory"][key] / 2**20 if runs[n].get("memory") else None
                           for n in names] for key in ("peak", "temp")},
                    ylabel="MiB per device (XLA memory analysis, log)", log=True,
                    title=f"MoELayer train step memory, {num_tokens} tokens, E={a.experts} "
                          f"K={a.topk}, per device of {devices}")
    print(f"wrote {path}, bench_moe.md, bench_moe.png, bench_moe_memory.png under {a.out}")
    return results


if __name__ == "__main__":
    main()

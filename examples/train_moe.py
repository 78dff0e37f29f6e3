"""Train a small MoE transformer language model with expert parallelism (the main job).

A byte-level transformer whose feed-forward layers are jax_ep MoE layers trains on the
docstrings of Python's own standard library (real English text, shipped with every Python)
over a Mesh(("data", "expert")) of emulated CPU devices, under jax.jit. It shows a progress
bar, the loss falling, tokens/s, per-expert load and dropped-token counts, and writes a PNG
plot and a JSON log.

  python examples/train_moe.py                       # 8 CPU devices, deepep backend
  python examples/train_moe.py --backend hybridep    # deepep | uccl_ep | alltoall | hybridep
  python examples/train_moe.py --grouped-gemm ragged_dot  # the experts on jax.lax.ragged_dot
  # DeepSeek-V3 style router: sigmoid scores, aux-loss-free expert bias, node-limited groups
  python examples/train_moe.py --score-function sigmoid --expert-bias --load-balancing none \
      --router-num-groups 4 --router-group-topk 2
  # the routing shape of the real recipes at a hidden size 8 CPU devices train in minutes:
  python examples/train_moe.py --preset deepseek-v3-tiny   # E=256 K=8, 8 groups top-4,
                                         # sigmoid + expert bias, shared expert, 8 nodes
  python examples/train_moe.py --preset qwen3-moe-tiny     # E=128 K=8, softmax, global aux
  python examples/train_moe.py --preset gpt-oss-tiny       # E=32 K=4, clamped Quick-GEGLU,
                                                           # router and expert biases
  python examples/train_moe.py --preset llama4-scout-tiny  # E=16 K=1, probs on the input
  python examples/train_moe.py --no-gated-linear-unit --activation squared_relu  # MLP experts
  python examples/train_moe.py --grad-accum 4       # 4 micro-batches per optimizer step
  python examples/train_moe.py --gpu                 # every local GPU on the expert axis
  # checkpoint every 50 steps with orbax; a later run with --resume continues up to --steps:
  python examples/train_moe.py --checkpoint-dir /tmp/moe_ckpt --save-every 50 --steps 100
  python examples/train_moe.py --checkpoint-dir /tmp/moe_ckpt --resume --steps 150
  python examples/train_moe.py --nodes 2             # Mesh(("data", "node", "local")):
                                                     # two-hop dispatch, node crossings
  python examples/train_moe.py --etp 2               # Mesh(("data", "expert", "tensor")):
                                                     # each expert's FFN over 2 devices
  # multi-process (e.g. 2 hosts x 4 devices), one command per process:
  python examples/train_moe.py --num-processes 2 --process-id 0 --coordinator HOST:PORT ...
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path


# The routing shape of the real models' Megatron recipes at a small hidden size: DeepSeek-V3
# (E=256, K=8, 8 groups of which 4 per token, sigmoid scores renormalised and scaled by 2.5, the
# aux-loss-free expert bias with a 1e-4 sequence-wise aux loss, one shared expert, routing
# limited to groups placed on nodes: one group per node of 8, as DeepSeek-V3's EP 64 over 8
# nodes, so a token reaches at most 4 nodes; here 8 nodes of 2 emulated devices, two-hop) and
# Qwen3-30B-A3B (E=128, K=8, softmax over the K chosen, no shared expert, the Qwen3 report's
# global-batch load-balancing loss at the recipes' coefficient 1e-3: Megatron-Bridge's Qwen3
# MoE bridge sets the per-micro-batch aux_loss, its Qwen3-Next one global_aux_loss), and
# gpt-oss-20b's MoE (E=32, K=4, softmax over the K chosen, no shared expert, the experts'
# Quick-GEGLU with linear offset 1 and clamp 7, router and expert biases: add_bias_linear), and
# Llama-4-Scout's (E=16, K=1, sigmoid scores scaling the experts' input, a shared expert). The
# bias update rate is DeepSeek-V3's 1e-3 times 10, so the expert bias balances the load within
# a run of 120 steps instead of thousands. The FFN sizes are not the recipes' ratios to the
# hidden size, and every layer is an MoE layer (DeepSeek-V3's first 3 are dense). Flags given on
# the command line win.
PRESETS = {
    "deepseek-v3-tiny": dict(experts=256, topk=8, router_num_groups=8, router_group_topk=4,
                             score_function="sigmoid", expert_bias=True,
                             topk_scaling_factor=2.5, load_balancing="seq_aux_loss",
                             aux_loss_coeff=1e-4, bias_update_rate=1e-2, d_model=64, ffn=32,
                             shared_ffn=32, devices=16, data_parallel=1, nodes=8, steps=120,
                             lr=3e-3),
    "qwen3-moe-tiny": dict(experts=128, topk=8, score_function="softmax",
                           load_balancing="global_aux_loss", aux_loss_coeff=1e-3, d_model=64,
                           ffn=32, shared_ffn=0, steps=120, lr=3e-3),
    "gpt-oss-tiny": dict(experts=32, topk=4, score_function="softmax", activation="quick_gelu",
                         glu_linear_offset=1.0, activation_clamp=7.0, add_bias_linear=True,
                         d_model=64, ffn=64, shared_ffn=0, steps=120, lr=3e-3),
    "llama4-scout-tiny": dict(experts=16, topk=1, score_function="sigmoid",
                              apply_probs_on_input=True, d_model=64, ffn=64, shared_ffn=64,
                              steps=120, lr=3e-3),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a real model's routing shape at a small size (PRESETS); explicit "
                        "flags override it")
    p.add_argument("--backend", default="deepep",
                   choices=["deepep", "uccl_ep", "alltoall", "hybridep"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128, help="expert FFN hidden size")
    p.add_argument("--shared-ffn", type=int, default=None,
                   help="shared expert's FFN hidden size (0: none; default ffn // 2)")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--dropless-buffer-factor", type=float, default=None,
                   help="TokenDispatcherConfig.dropless_buffer_factor: no drops, buffers of this "
                        "times the balanced load in the steps whose routing fits them")
    p.add_argument("--pad-to-capacity", action="store_true",
                   help="moe_pad_expert_input_to_capacity (Megatron's drop-and-pad; needs "
                        "--capacity-factor): every expert computes its capacity's rows, as "
                        "one batched GEMM per weight")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="FP8 tokens on the dispatch wire (moe_fp8_dispatch; --d-model a "
                        "multiple of 128)")
    p.add_argument("--grouped-gemm", default="auto",
                   choices=["auto", "ffi", "tiled", "blocks", "ragged_dot"],
                   help="the experts' grouped GEMM (auto: jax_ep's CPU handler, ffi, on CPU; "
                        "on GPUs ragged_dot for at most 8 local experts, tiled beyond)")
    p.add_argument("--transport", default="auto", choices=["auto", "all_to_all", "ragged", "peer"],
                   help="the expert exchange (auto: peer in one process, docs/peer_transport.md; "
                        "XLA's collective for --backend alltoall)")
    p.add_argument("--score-function", default="softmax",
                   choices=["softmax", "sigmoid", "sqrtsoftplus"], help="moe_router_score_function")
    p.add_argument("--load-balancing", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                            "quantile_balancing", "none"],
                   help="moe_router_load_balancing_type (sinkhorn, quantile_balancing: set "
                        "--aux-loss-coeff 0)")
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2, help="moe_aux_loss_coeff")
    p.add_argument("--z-loss-coeff", type=float, default=None, help="moe_z_loss_coeff")
    p.add_argument("--apply-probs-on-input", default=False,
                   action=argparse.BooleanOptionalAction,
                   help="moe_apply_probs_on_input: the probs scale the experts' input (--topk 1)")
    p.add_argument("--shared-expert-gate", action="store_true",
                   help="moe_shared_expert_gate: the shared expert's output times a sigmoid gate")
    p.add_argument("--latent-size", type=int, default=None,
                   help="moe_latent_size: the experts (and the wire) in this width")
    p.add_argument("--input-jitter-eps", type=float, default=None,
                   help="moe_input_jitter_eps: the router's input times uniform [1-eps, 1+eps]")
    p.add_argument("--expert-bias", default=False, action=argparse.BooleanOptionalAction,
                   help="aux-loss-free balancing (moe_router_enable_expert_bias; needs "
                        "--score-function sigmoid), updated once per step")
    p.add_argument("--bias-update-rate", type=float, default=1e-3,
                   help="moe_router_bias_update_rate")
    p.add_argument("--router-num-groups", type=int, default=None,
                   help="moe_router_num_groups: node-limited routing over that many expert "
                        "groups")
    p.add_argument("--router-group-topk", type=int, default=None,
                   help="moe_router_group_topk: groups each token may use")
    p.add_argument("--topk-scaling-factor", type=float, default=None,
                   help="moe_router_topk_scaling_factor")
    p.add_argument("--activation", default=None,
                   choices=["silu", "gelu", "gelu_tanh", "quick_gelu", "relu", "squared_relu"],
                   help="the experts' activation (activation_func; default silu, SwiGLU, for "
                        "gated experts and gelu for MLP experts, as Megatron)")
    p.add_argument("--add-bias-linear", default=False, action=argparse.BooleanOptionalAction,
                   help="add_bias_linear: router and expert biases (gpt-oss; needs "
                        "--shared-ffn 0)")
    p.add_argument("--gated-linear-unit", default=True, action=argparse.BooleanOptionalAction,
                   help="gated experts (act(gate) * up); --no-gated-linear-unit: Megatron's "
                        "MLP experts, act(fc1)")
    p.add_argument("--glu-linear-offset", type=float, default=0.0, help="glu_linear_offset")
    p.add_argument("--activation-clamp", type=float, default=None,
                   help="activation_func_clamp_value")
    p.add_argument("--glu-interleave-size", type=int, default=None,
                   help="moe_mlp_glu_interleave_size: fc1's columns in Megatron's blocks of "
                        "this many, alternating gate and up")
    p.add_argument("--force-load-balancing", action="store_true",
                   help="moe_router_force_load_balancing (Megatron's benchmark switch): route "
                        "by random logits, the gradient straight through to the router")
    p.add_argument("--force-biased", type=float, default=None, metavar="STD",
                   help="moe_router_force_biased (Megatron's skewed benchmark routing): random "
                        "logits plus a normal(0, |STD|) bias per expert shared by the devices, "
                        "new per step for STD > 0, fixed per layer for STD < 0")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (--batch split in equal parts; "
                        "global_aux_loss keeps its running mean over them)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    p.add_argument("--data-parallel", type=int, default=None,
                   help="size of the 'data' axis (default 2 where it divides the devices, "
                        "else 1)")
    p.add_argument("--gpu", action="store_true", help="run on the local GPUs")
    p.add_argument("--nodes", type=int, default=None,
                   help="split the expert axis into ('node', 'local') with this many nodes "
                        "(DeepEP's two-hop internode dispatch); prints the rows that cross "
                        "the node axis per step")
    p.add_argument("--etp", type=int, default=1,
                   help="expert_tensor_parallel_size: each expert's FFN split over a 'tensor' "
                        "mesh axis of this many devices (the expert axis gets the rest)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT for jax.distributed")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=None,
                   help="emulated CPU devices per process (multi-process CPU runs)")
    p.add_argument("--out", default="examples/out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--checkpoint-dir", default=None,
                   help="orbax checkpoints (model and optimizer state, data position) here")
    p.add_argument("--save-every", type=int, default=0,
                   help="save every N steps (0: only after the last step); needs "
                        "--checkpoint-dir")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir up to --steps")
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    for flag in ("steps", "batch", "seq", "d_model", "layers", "heads", "experts", "topk",
                 "ffn", "devices", "local_devices", "data_parallel"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an int >= 1, got {value}")
    if args.d_model % args.heads:
        p.error(f"--heads: expected a divisor of --d-model {args.d_model}, got {args.heads}")
    if args.grad_accum < 1 or args.batch % args.grad_accum:
        p.error(f"--grad-accum: expected a divisor of --batch {args.batch}, got "
                f"{args.grad_accum}")
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        p.error("--resume / --save-every: need --checkpoint-dir")
    if args.pad_to_capacity and args.capacity_factor is None:
        p.error("--pad-to-capacity: needs --capacity-factor")
    if args.dropless_buffer_factor is not None and args.capacity_factor is not None:
        p.error("--dropless-buffer-factor: drops nothing, so not with --capacity-factor")
    if args.etp < 1 or (args.etp > 1 and args.nodes):
        p.error(f"--etp: expected 1, or an int > 1 without --nodes, got {args.etp}")
    if args.save_every < 0:
        p.error(f"--save-every: expected a step count >= 0, got {args.save_every}")
    if args.nodes is not None and args.nodes < 0:
        p.error(f"--nodes: expected an int >= 0 (0: one node), got {args.nodes}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr: expected a finite float > 0, got {args.lr}")
    if args.topk > args.experts:
        p.error(f"--topk: expected at most --experts {args.experts}, got {args.topk}")
    wire = args.latent_size or args.d_model  # the width of the rows on the wire
    if args.fp8_dispatch and wire % 128:
        p.error(f"--fp8-dispatch: needs --d-model (or --latent-size) a multiple of 128, got "
                f"{wire}")
    if args.transport == "ragged" and not args.gpu:
        p.error("--transport ragged: XLA's ragged_all_to_all runs on GPUs only (add --gpu, or "
                "use auto / all_to_all / peer)")
    if args.transport == "peer" and args.backend == "alltoall":
        p.error("--transport peer: --backend alltoall is built from XLA collectives only")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        p.error(f"--num-processes / --process-id: expected N >= 1 and an id in [0, N), got "
                f"{args.num_processes} / {args.process_id}")
    for flag in ("checkpoint_dir", "out"):
        path = getattr(args, flag)
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            p.error(f"--{flag.replace('_', '-')}: expected a directory, {path} is a file")
    return args


def setup_jax(args):
    """XLA flags and the distributed runtime, before anything touches a device."""
    if not args.gpu:
        count = args.local_devices or args.devices
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={count}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    if args.num_processes > 1:
        if not args.gpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    return jax


def stdlib_corpus(max_bytes=2_000_000):
    """The docstrings of the Python standard library, joined: a few MB of real English."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    pieces.append(doc)
                    total += len(doc)
        if total > max_bytes:
            break
    return "\n\n".join(pieces).encode("utf-8", "ignore")


EXPERT_AXES = ("node", "local")


def build_model(args, mesh, jax):
    """The example's model on `mesh`; what the config or the layers refuse (flags that do not
    go together, --experts not a multiple of the expert axis) ends the run in one line."""
    try:
        return _build_model(args, mesh, jax)
    except ValueError as error:
        raise SystemExit(f"train_moe.py: {error}") from None


def _build_model(args, mesh, jax):
    import jax.numpy as jnp
    from flax import nnx

    import jax_ep
    from jax_ep.flax import MoEConfig, MoELayer

    config = MoEConfig(
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        moe_shared_expert_intermediate_size=(args.ffn // 2 if args.shared_ffn is None
                                             else args.shared_ffn or None),
        moe_expert_capacity_factor=args.capacity_factor,
        moe_pad_expert_input_to_capacity=args.pad_to_capacity, moe_router_dtype="fp32",
        moe_router_score_function=args.score_function,
        moe_router_load_balancing_type=args.load_balancing,
        moe_aux_loss_coeff=args.aux_loss_coeff, moe_z_loss_coeff=args.z_loss_coeff,
        moe_router_enable_expert_bias=args.expert_bias,
        moe_router_bias_update_rate=args.bias_update_rate,
        moe_router_num_groups=args.router_num_groups,
        moe_router_group_topk=args.router_group_topk,
        moe_router_topk_scaling_factor=args.topk_scaling_factor,
        moe_router_force_load_balancing=args.force_load_balancing,
        moe_router_force_biased=args.force_biased,
        expert_tensor_parallel_size=args.etp, activation_func=args.activation,
        gated_linear_unit=args.gated_linear_unit, add_bias_linear=args.add_bias_linear,
        moe_apply_probs_on_input=args.apply_probs_on_input,
        moe_shared_expert_gate=args.shared_expert_gate,
        moe_input_jitter_eps=args.input_jitter_eps, moe_latent_size=args.latent_size,
        glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_clamp,
        moe_mlp_glu_interleave_size=args.glu_interleave_size,
        token_dispatcher=jax_ep.TokenDispatcherConfig(
            moe_flex_dispatcher_backend=args.backend, moe_permute_fusion=True,
            grouped_gemm_impl=args.grouped_gemm, moe_fp8_dispatch=args.fp8_dispatch,
            transport=args.transport, dropless_buffer_factor=args.dropless_buffer_factor,
            expert_axis_name=EXPERT_AXES if args.nodes else "expert"))

    class Block(nnx.Module):
        def __init__(self, rngs):
            d = args.d_model
            self.norm1 = nnx.RMSNorm(d, rngs=rngs)
            self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
            self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
            self.norm2 = nnx.RMSNorm(d, rngs=rngs)
            self.moe = MoELayer(config, d, rngs=rngs, mesh=mesh)

        def __call__(self, x):
            b, s, d = x.shape
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
            shape = (b, s, args.heads, d // args.heads)
            attn = jax.nn.dot_product_attention(q.reshape(shape), k.reshape(shape),
                                                v.reshape(shape), is_causal=True)
            x = x + self.proj(attn.reshape(b, s, d))
            y, aux = self.moe(self.norm2(x))
            return x + y, aux

    class MoETransformer(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(256, args.d_model, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (args.seq, args.d_model))
                                 * 0.02)
            self.blocks = nnx.List([Block(rngs) for _ in range(args.layers)])
            self.norm = nnx.RMSNorm(args.d_model, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids) + self.pos[...][: ids.shape[1]]
            auxes = []
            for block in self.blocks:
                x, aux = block(x)
                auxes.append(aux)
            return self.embed.attend(self.norm(x)), auxes

    return MoETransformer(nnx.Rngs(args.seed))


def _step_aux(micro_auxes):
    """One layer's aux dicts of a step's micro-batches -> the step's: counts and drops summed,
    the load ratio of the summed counts, the balancing loss averaged."""
    from jax_ep.flax.moe import load_ratio
    counts = sum(a["tokens_per_expert"] for a in micro_auxes)
    return dict(micro_auxes[0], tokens_per_expert=counts,
                num_dropped=sum(a["num_dropped"] for a in micro_auxes),
                load_ratio=load_ratio(counts),
                load_balancing_loss=sum(a["load_balancing_loss"] for a in micro_auxes)
                / len(micro_auxes),
                **{k: sum(a[k] for a in micro_auxes) for k in (
                    "rows_across_nodes", "flat_rows_across_nodes", "buffer_overflow")
                   if k in micro_auxes[0]})


def train(args):
    """Runs the training loop; returns the list of per-step records (loss, load, ...)."""
    jax = setup_jax(args)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from jax_ep.flax import shard_state

    devices = jax.devices()
    if args.gpu:
        data = 1
    elif args.data_parallel is None:
        data = 2 if len(devices) % 2 == 0 else 1
    elif len(devices) % args.data_parallel:
        raise SystemExit(f"--data-parallel {args.data_parallel} does not divide the "
                         f"{len(devices)} devices")
    else:
        data = args.data_parallel
    # Auto axes: pjit style, XLA propagates the batch sharding through the dense layers.
    experts = len(devices) // data
    if args.nodes:
        if experts % args.nodes:
            raise SystemExit(f"--nodes {args.nodes} does not divide the {experts} devices of "
                             f"the expert axis")
        # Node n is the n-th contiguous run of devices ordered by process: with one
        # process per node (jax.distributed), the node axis is the process boundary.
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = np.array(ordered, dtype=object).reshape(args.nodes, data, -1).transpose(1, 0, 2)
        mesh = jax.sharding.Mesh(grid, ("data",) + EXPERT_AXES,
                                 axis_types=(jax.sharding.AxisType.Auto,) * 3)
    elif args.etp > 1:
        if experts % args.etp:
            raise SystemExit(f"--etp {args.etp} does not divide the {experts} devices left "
                             f"after the data axis")
        mesh = jax.make_mesh((data, experts // args.etp, args.etp),
                             ("data", "expert", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)
    else:
        mesh = jax.make_mesh((data, experts), ("data", "expert"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    token_axes = tuple(mesh.axis_names)
    if (args.batch // args.grad_accum) % len(devices):
        raise SystemExit(f"--batch {args.batch} / --grad-accum {args.grad_accum}: each "
                         f"micro-batch must split evenly over the {len(devices)} devices")
    is_main = jax.process_index() == 0
    if is_main:
        print(f"mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} devices, "
              f"{jax.process_count()} process(es); backend={args.backend}, transport "
              f"{args.transport}, grouped GEMM {args.grouped_gemm}"
              + (f", preset {args.preset}" if args.preset else "")
              + (f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""))

    corpus = np.frombuffer(stdlib_corpus(), np.uint8)
    if args.seq + 1 >= len(corpus):
        raise SystemExit(f"--seq {args.seq}: the corpus has {len(corpus)} bytes, a sequence "
                         f"needs at most {len(corpus) - 2}")
    rng = np.random.default_rng(args.seed)
    if is_main:  # before training: a path that cannot be made would lose the run's results
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"--out {args.out}: {error}") from None
    model = build_model(args, mesh, jax)
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)
    # Parameters and optimizer state where train_step returns them: one compile for all steps.
    shard_state(model, optimizer, mesh)
    checkpoints = (Checkpoints(args.checkpoint_dir, resume=args.resume,
                               model_flags={flag: getattr(args, flag) for flag in MODEL_FLAGS})
                   if args.checkpoint_dir else None)
    first_step = checkpoints.restore(model, optimizer, rng) if args.resume else 0
    if first_step >= args.steps:
        raise SystemExit(f"--steps {args.steps}: the checkpoint in {args.checkpoint_dir} is at "
                         f"step {first_step} already")
    if is_main and args.resume:
        print(f"resumed from {args.checkpoint_dir} at step {first_step}")
    batch_sharding = NamedSharding(mesh, P(token_axes))

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model, micro):
            logits, auxes = model(micro[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, micro[:, 1:]).mean()
            return ce + sum(a["aux_loss"] for a in auxes), (ce, auxes)
        # Gradient accumulation: the mean of the micro-batches' gradients (equal sizes), one
        # optimizer update; the MoE layers' global_aux_loss trackers run over the micro-batches.
        micros = jnp.split(batch, args.grad_accum)
        ces, steps_auxes, grads = [], [], None
        for micro in micros:
            (_, (ce, auxes)), g = nnx.value_and_grad(loss_fn, has_aux=True)(model, micro)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            ces.append(ce)
            steps_auxes.append(auxes)
        grads = jax.tree.map(lambda g: g / len(micros), grads)
        optimizer.update(model, grads)
        auxes = [_step_aux(per_layer) for per_layer in zip(*steps_auxes)]
        for block, aux in zip(model.blocks, auxes):
            if args.expert_bias:  # once per step, no autodiff: the global counts the layer
                block.moe.update_expert_bias()  # gathered over the step's micro-batches
            block.moe.reset_global_aux_loss_tracker()  # once per optimizer step, as Megatron
            if args.load_balancing == "quantile_balancing":  # its bias, from the step's
                block.moe.update_quantile_balancing()      # micro-batches' quantiles
        stats = {name: jnp.stack([a[name] for a in auxes]) for name in (
            "tokens_per_expert", "load_ratio", "num_dropped", "load_balancing_loss")}
        stats["crossed"] = jnp.stack([sum(a.get(k, 0) for a in auxes)
                                      for k in ("rows_across_nodes", "flat_rows_across_nodes")])
        # --dropless-buffer-factor: per layer, micro-batches that ran the chunked fallback
        stats["fell_back"] = jnp.stack([a.get("buffer_overflow", 0) for a in auxes])
        return sum(ces) / len(ces), stats

    records = []
    tokens_per_step = args.batch * args.seq
    bar = tqdm(range(first_step, args.steps), disable=args.no_progress or not is_main,
               desc="train", initial=first_step, total=args.steps)
    start = None
    try:  # a failed save must not leave orbax's threads holding the process at exit
        with jax.set_mesh(mesh):
            for step in bar:
                offsets = rng.integers(0, len(corpus) - args.seq - 1, args.batch)
                host = np.stack([corpus[o:o + args.seq + 1] for o in offsets]).astype(np.int32)
                batch = jax.make_array_from_callback(host.shape, batch_sharding,
                                                     lambda index: host[index])
                t0 = time.perf_counter()
                ce, stats = train_step(model, optimizer, batch)
                ce = float(ce)  # the step's host reads, after the step
                elapsed = time.perf_counter() - t0
                if step == first_step:
                    start = time.perf_counter()
                stats = {k: np.asarray(v).tolist() for k, v in jax.device_get(stats).items()}
                dropped = sum(stats["num_dropped"])
                # per layer: load [E] (global slots per expert), load_ratio (max/mean),
                # dropped slots, the unscaled load-balancing loss
                records.append(dict(step=step, loss=ce, seconds=elapsed,
                                    load=stats["tokens_per_expert"],
                                    load_ratio=stats["load_ratio"],
                                    dropped_per_layer=stats["num_dropped"], dropped=dropped,
                                    fell_back_per_layer=stats["fell_back"],
                                    balance_loss=stats["load_balancing_loss"]))
                if args.nodes:
                    two_hop, flat = stats["crossed"]
                    records[-1].update(rows_across_nodes=two_hop, flat_rows_across_nodes=flat)
                    if is_main and (step < 3 or step % 25 == 0 or step == args.steps - 1):
                        tqdm.write(f"step {step}: {two_hop} rows crossed the node axis (two-hop; "
                                   f"the flat exchange would send {flat})")
                if step > first_step:
                    rate = tokens_per_step * (step - first_step) / (time.perf_counter() - start)
                    bar.set_postfix(loss=f"{ce:.3f}", tok_s=f"{rate:,.0f}", dropped=int(dropped))
                done = step + 1
                if checkpoints and (done == args.steps
                                    or (args.save_every and done % args.save_every == 0)):
                    checkpoints.save(done, model, optimizer, rng)
    finally:
        if checkpoints:
            checkpoints.close()
    if is_main and records:
        report(records, args, tokens_per_step)
    return records


# The flags the model's parameters (their shapes, their layout, what they mean) and its routing
# depend on: a checkpoint records them, and --resume refuses a run that changes one. It also
# records every state array's path, shape and dtype (Checkpoints._layout), which catches what
# no flag names (an aux-loss tracker that --aux-loss-coeff 0 leaves out).
MODEL_FLAGS = ("experts", "topk", "d_model", "ffn", "shared_ffn", "layers", "heads", "seq",
               "etp", "latent_size", "gated_linear_unit", "glu_interleave_size",
               "add_bias_linear", "activation", "glu_linear_offset", "activation_clamp",
               "score_function", "expert_bias", "router_num_groups", "router_group_topk",
               "topk_scaling_factor", "apply_probs_on_input", "shared_expert_gate",
               "load_balancing", "force_load_balancing", "force_biased", "input_jitter_eps")


class Checkpoints:
    """Orbax checkpoints of a training run in `directory`, one per saved step: all nnx state of
    the model (parameters and non-trainable variables such as an expert bias) and of the
    optimizer, sharded as they are on the mesh, plus as JSON the data position (the batch
    sampler's RNG state and the number of steps done), `model_flags` (the MODEL_FLAGS' values)
    and the state's layout: restore refuses a checkpoint whose flags or layout differ from
    this run's, naming them, before reading an array (a checkpoint written before they were
    recorded is restored unchecked). Without `resume` the directory must hold no checkpoint
    (orbax would skip every step up to its latest)."""

    def __init__(self, directory, *, resume=False, model_flags=None):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        directory = Path(directory).absolute()
        if resume and not directory.is_dir():
            raise SystemExit(f"--resume: no checkpoint directory {directory}")
        self.model_flags = dict(model_flags or {})
        self.manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
        latest = self.manager.latest_step()
        if not resume and latest is not None:
            raise SystemExit(f"--checkpoint-dir {directory}: holds an earlier run's checkpoints "
                             f"(up to step {latest}); --resume continues it, or use an empty "
                             f"directory")

    def save(self, steps_done, model, optimizer, rng):
        from flax import nnx
        ocp = self._ocp
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        data = {"steps_done": steps_done, "sampler": rng.bit_generator.state,
                "model_flags": self.model_flags, "state_layout": self._layout(state)}
        if not self.manager.save(steps_done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data))):
            raise RuntimeError(f"orbax saved no checkpoint at step {steps_done} in "
                               f"{self.manager.directory}")

    def restore(self, model, optimizer, rng):
        """Loads the latest checkpoint into model, optimizer and rng (each array with the
        sharding it has now); returns the number of steps done. A run whose MODEL_FLAGS differ
        from the checkpoint's is refused, naming them."""
        import jax
        from flax import nnx
        ocp = self._ocp
        latest = self.manager.latest_step()
        if latest is None:
            raise SystemExit(f"--resume: no checkpoint in {self.manager.directory}")
        data = self.manager.restore(latest, args=ocp.args.Composite(
            data=ocp.args.JsonRestore())).data
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        if "model_flags" in data:
            self._check_same_model(latest, data, target)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self.manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
        nnx.update(model, restored.state["model"])
        nnx.update(optimizer, restored.state["optimizer"])
        rng.bit_generator.state = data["sampler"]
        return int(data["steps_done"])

    def _check_same_model(self, step, data, target):
        """SystemExit naming the MODEL_FLAGS, or else the state arrays, in which the checkpoint
        of `step` (its JSON `data`) differs from this run (its state `target`)."""
        saved = data["model_flags"]
        changed = [flag for flag in sorted(set(saved) | set(self.model_flags))
                   if saved.get(flag) != self.model_flags.get(flag)]
        if changed:
            def flags(values):
                return " ".join(f"--{flag.replace('_', '-')} {values.get(flag)}"
                                for flag in changed)
            raise SystemExit(f"--resume: the checkpoint at step {step} was saved with "
                             f"{flags(saved)}; this run has {flags(self.model_flags)}")
        old, new = data["state_layout"], self._layout(target)
        differ = sorted(path for path in set(old) | set(new) if old.get(path) != new.get(path))
        if differ:
            shown = "; ".join(f"{path}: {old.get(path, 'absent')} saved, "
                              f"{new.get(path, 'absent')} now" for path in differ[:3])
            raise SystemExit(f"--resume: the checkpoint at step {step} holds other state "
                             f"arrays than this run's model ({len(differ)} differ: {shown}); "
                             f"resume with the flags it was saved with")

    @staticmethod
    def _layout(state):
        """{path: "dtype[shape]"} of every array of a state pytree."""
        import jax
        return {jax.tree_util.keystr(path): f"{leaf.dtype}{list(leaf.shape)}"
                for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def report(records, args, tokens_per_step):
    import numpy as np

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = np.mean([r["loss"] for r in records[:5]])
    last = np.mean([r["loss"] for r in records[-5:]])
    steady = [r["seconds"] for r in records[1:]] or [records[0]["seconds"]]
    load = np.array(records[-1]["load"])  # [layers, E]
    ratio = np.array([r["load_ratio"] for r in records])  # [steps, layers]
    print(f"loss {first:.3f} -> {last:.3f} over {len(records)} steps; "
          f"{tokens_per_step / np.median(steady):,.0f} tokens/s (median step "
          f"{np.median(steady) * 1e3:.1f} ms); dropped tokens in the last step: "
          f"{records[-1]['dropped']}")
    if args.dropless_buffer_factor is not None:
        fell_back = np.array([r["fell_back_per_layer"] for r in records]) > 0  # [steps, layers]
        print(f"steps whose routing overflowed the {args.dropless_buffer_factor:g}x buffers "
              f"(the chunked fallback ran) per layer: "
              f"{fell_back.sum(axis=0).tolist()} of {len(records)}")
    for layer, row in enumerate(load):
        share = row / max(row.sum(), 1)
        shares = (" ".join(f"{s:.2f}" for s in share) if len(share) <= 16 else
                  f"{len(share)} experts, shares {share.min():.4f}..{share.max():.4f}, "
                  f"{int((row == 0).sum())} idle")
        print(f"layer {layer} expert load: {shares}; max/mean load ratio first 5 -> last 5 "
              f"steps {ratio[:5, layer].mean():.2f} -> {ratio[-5:, layer].mean():.2f}")
    (out / "train_moe.json").write_text(json.dumps(dict(args=vars(args), records=records)))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    ax1.plot([r["loss"] for r in records])
    ax1.set(xlabel="step", ylabel="cross-entropy (nats/byte)",
            title=f"MoE LM on stdlib docstrings ({args.backend})")
    loads = np.array([r["load"][0] for r in records], float)
    loads /= np.maximum(loads.sum(axis=1, keepdims=True), 1)
    if loads.shape[1] <= 16:
        for e in range(loads.shape[1]):
            ax2.plot(loads[:, e], label=f"expert {e}")
        ax2.set(xlabel="step", ylabel="share of routed slots", title="layer 0 expert load")
        ax2.legend(fontsize=7, ncol=2)
    else:  # many experts: each one's share per step as a heat map
        image = ax2.imshow(loads.T * loads.shape[1], aspect="auto", origin="lower",
                           cmap="viridis", vmin=0, vmax=4, interpolation="nearest")
        fig.colorbar(image, ax=ax2, label="load / balanced load")
        ax2.set(xlabel="step", ylabel="expert", title="layer 0 expert load")
    for layer in range(ratio.shape[1]):
        ax3.plot(ratio[:, layer], label=f"layer {layer}")
    ax3.set(xlabel="step", ylabel="max / mean tokens per expert",
            title=f"load ratio ({'expert bias' if args.expert_bias else args.load_balancing})")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "train_moe.png", dpi=100)
    plt.close(fig)  # callers that train in-process (the tests) would keep every figure open
    print(f"wrote {out / 'train_moe.png'} and {out / 'train_moe.json'}")


if __name__ == "__main__":
    train(parse_args())
    sys.exit(0)

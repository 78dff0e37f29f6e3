"""MaxText's RoutedMoE as a peer for bench_moe --peer maxtext (not a test dependency).

MaxText needs Python >= 3.12. Install it without its training stack:
`pip install --no-deps maxtext` plus the packages `maxtext.layers.moe` imports (the list is in
benchmarks/RESULTS.md); no TensorFlow is needed. `missing()` says what is absent.
"""

from __future__ import annotations

import sys


def missing() -> str:
    """'' when MaxText's MoE layer imports here, else why not (one line)."""
    if sys.version_info < (3, 12):
        return (f"maxtext needs Python >= 3.12, this is {sys.version.split()[0]} "
                "(see benchmarks/RESULTS.md for the install)")
    try:
        import maxtext.layers.moe  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any failed import of a peer skips it
        return f"maxtext.layers.moe does not import: {type(e).__name__}: {e}"
    return ""


def layer(a, mesh, dtype, *, capacity_factor=None):
    """MaxText's RoutedMoE for bench_moe's shapes: E = a.experts, K = a.topk, H = a.hidden,
    F = a.ffn, dtype, over the devices of `mesh` with the same ("data", "expert") sizes
    (MaxText's other mesh axes 1), its dense (non-megablox, sparse_matmul=False) path:
    dropless with capacity_factor None, else MaxText's token-dropping capacity path.
    The weights are placed by MaxText's logical axis rules (expert dim over "expert").
    Returns (params, x [B, S, H] with B*S the benchmark's tokens, loss(params, x) ->
    (mean(y^2), None), MaxText's mesh to call it under); MaxText reports no drop count."""
    import os

    import flax.linen
    import jax
    import jax.numpy as jnp
    import maxtext
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from maxtext.configs import pyconfig
    from maxtext.layers import moe
    from maxtext.utils import maxtext_utils

    devices = mesh.devices.size
    batch, seq = 2 * devices, a.tokens // 2  # the benchmark's devices * a.tokens tokens
    name = jnp.dtype(dtype).name
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    cfg = pyconfig.initialize(
        ["bench_moe", base], run_name="bench_moe_peer", hardware="cpu",
        skip_jax_distributed_system=True, enable_checkpointing=False,
        num_experts=a.experts, num_experts_per_tok=a.topk, base_emb_dim=a.hidden,
        base_moe_mlp_dim=a.ffn, base_mlp_dim=a.ffn, base_num_decoder_layers=1,
        dtype=name, weight_dtype=name, sparse_matmul=False, megablox=False,
        capacity_factor=-1.0 if capacity_factor is None else float(capacity_factor),
        ici_data_parallelism=mesh.shape["data"], ici_expert_parallelism=mesh.shape["expert"],
        per_device_batch_size=batch // devices, max_target_length=seq,
        mlp_activations=["silu", "linear"])
    mt_mesh = maxtext_utils.get_mesh_from_config(cfg, devices=list(mesh.devices.flat))
    with mt_mesh, nn_partitioning.axis_rules(cfg.logical_axis_rules):
        routed = moe.RoutedMoE(
            config=cfg, num_experts=a.experts, num_experts_per_tok=a.topk, mesh=mt_mesh,
            kernel_init=moe.nd_dense_init(1.0, "fan_in", "truncated_normal"),
            kernel_axes=("embed", None), intermediate_dim=a.ffn, dtype=dtype,
            weight_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(routed, nnx.Param, ...)
    # Place the weights as MaxText's logical axis rules shard them (experts over "expert"), as
    # its trainer does; left on one device, jit would pick their layout per program (the
    # dense dropless step took them replicated) and copy them over at every call.
    params = jax.device_put(params, flax.linen.logical_to_mesh_sharding(
        nnx.get_partition_spec(params), mt_mesh, cfg.logical_axis_rules))
    x = jax.random.normal(jax.random.key(1), (batch, seq, a.hidden), dtype)
    x = jax.device_put(x, NamedSharding(mt_mesh, P(("data", "expert"))))

    def loss(params, x):
        with nn_partitioning.axis_rules(cfg.logical_axis_rules):
            y = nnx.merge(graphdef, params, rest)(x)[0]
        return jnp.mean(y.astype(jnp.float32) ** 2), None

    return params, x, loss, mt_mesh

"""A DeepEP-style MoE forward ported to JAX with `jax_ep.Buffer`, on 8 emulated CPU ranks,
checked against a dense single-device reference.

The body reads like DeepEP code - get_dispatch_layout, dispatch, local experts, combine -
and then the same experts run through the low-latency pair (FP8 dispatch by default, as in
DeepEP; the FP8 round trip makes that result close, not equal).

  python examples/port_deepep.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import ops  # noqa: E402

AXIS = "ep"
NUM_RANKS, TOKENS, HIDDEN, FFN, TOP_K, NUM_EXPERTS = 8, 16, 128, 64, 4, 32
LOCAL = NUM_EXPERTS // NUM_RANKS


def expert(x, w_in, w_out):
    """One expert MLP: x [N,H] -> [N,H]."""
    return jax.nn.gelu(x @ w_in) @ w_out


def normal_mode(buffer, x, topk_idx, topk_weights, w_in, w_out):
    """DeepEP normal mode: x [T,H] f32 -> [T,H]; w_in [L,H,F], w_out [L,F,H] this rank's."""
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights,
        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert)
    event.current_stream_wait()
    # Each received row: sum over its local slots of weight * expert(row).
    y = jnp.zeros_like(recv_x)
    for e in range(LOCAL):
        w = jnp.where(recv_topk_idx == e, recv_topk_weights, 0.0).sum(axis=1)
        y = y + w[:, None] * expert(recv_x, w_in[e], w_out[e])
    combined_x, _, _ = buffer.combine(y, handle)
    return combined_x


def low_latency_mode(buffer, x, topk_idx, topk_weights, w_in, w_out):
    """DeepEP low-latency mode (FP8 dispatch): x [T,H] bf16 -> [T,H] bf16."""
    (x_fp8, scales), _, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, TOKENS, NUM_EXPERTS, return_recv_hook=True)
    hook()
    rows = ops.per_token_cast_back(x_fp8.reshape(-1, HIDDEN), scales.reshape(-1, HIDDEN // 128),
                                   dtype=jnp.float32).reshape(x_fp8.shape)
    y = jax.vmap(expert)(rows, w_in, w_out).astype(jnp.bfloat16)  # [L, P*Tmax, H]
    combined_x, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    return combined_x


def dense_reference(x, topk_idx, topk_weights, w_in, w_out):
    """Single device: out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]); x [P*T,H]."""
    every = jax.vmap(lambda a, b: expert(x, a, b))(w_in, w_out)  # [E, P*T, H]
    routed = topk_idx >= 0
    picked = every[jnp.where(routed, topk_idx, 0), jnp.arange(x.shape[0])[:, None]]
    return jnp.sum(jnp.where(routed[..., None], picked * topk_weights[..., None], 0.0), axis=1)


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_RANKS * TOKENS, HIDDEN)).astype(np.float32)
    topk_idx = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K]
                         for _ in range(NUM_RANKS * TOKENS)]).astype(np.int32)
    topk_idx[rng.random(topk_idx.shape) < 0.1] = -1
    topk_weights = rng.uniform(0.1, 1.0, topk_idx.shape).astype(np.float32)
    w_in = (rng.standard_normal((NUM_EXPERTS, HIDDEN, FFN)) / np.sqrt(HIDDEN)).astype(np.float32)
    w_out = (rng.standard_normal((NUM_EXPERTS, FFN, HIDDEN)) / np.sqrt(FFN)).astype(np.float32)

    mesh = jax.make_mesh((NUM_RANKS,), (AXIS,), devices=jax.devices()[:NUM_RANKS])
    buffer = jax_ep.Buffer(AXIS, num_nvl_bytes=int(1e9), low_latency_mode=True,
                           num_qps_per_rank=LOCAL)  # byte sizes and QPs: no effect under XLA

    def body(x, topk_idx, topk_weights, w_in, w_out):
        normal = normal_mode(buffer, x, topk_idx, topk_weights, w_in, w_out)
        low_latency = low_latency_mode(buffer, x.astype(jnp.bfloat16), topk_idx, topk_weights,
                                       w_in, w_out)
        return normal, low_latency

    sharded = [jax.device_put(a, NamedSharding(mesh, P(AXIS)))
               for a in (x, topk_idx, topk_weights, w_in, w_out)]
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    normal, low_latency = (np.asarray(a, np.float32) for a in run(*sharded))
    want = np.asarray(dense_reference(x, topk_idx, topk_weights, w_in, w_out))

    normal_err = np.abs(normal - want).max()
    low_latency_err = np.abs(low_latency - want).max() / np.abs(want).max()
    print(f"{NUM_RANKS} ranks, {TOKENS} tokens each, E={NUM_EXPERTS}, top-{TOP_K}")
    print(f"normal mode vs dense reference:       max |diff| = {normal_err:.2e}")
    print(f"low-latency (FP8) vs dense reference: max |diff| / max |ref| = {low_latency_err:.2e}")
    assert normal_err < 1e-4, normal_err
    assert low_latency_err < 5e-2, low_latency_err
    print("ok")


if __name__ == "__main__":
    main()

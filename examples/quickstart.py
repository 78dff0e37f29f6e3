"""Route one small batch through every layer-1 op, FFI kernel and XLA reference side by side,
then through an expert-parallel dispatch/combine on 4 emulated CPU ranks, and print the
layouts.

  python examples/quickstart.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import ops  # noqa: E402


def show(title, ffi, xla):
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(ffi), jax.tree.leaves(xla)))
    print(f"\n== {title}   (ffi == xla: {same})")
    for leaf in jax.tree.leaves(ffi):
        print(np.asarray(leaf))


def main():
    np.set_printoptions(precision=3, suppress=True, linewidth=120)
    num_experts, num_ranks = 8, 2
    topk_idx = jnp.array([[0, 1], [2, 5], [7, -1], [-1, -1]], jnp.int32)
    topk_weights = jnp.array([[0.6, 0.4], [0.7, 0.3], [1.0, 0.0], [0.0, 0.0]], jnp.float32)
    tokens = jnp.arange(4 * 4, dtype=jnp.float32).reshape(4, 4)
    print(f"topk_idx (E={num_experts}, P={num_ranks}, L=4):\n{np.asarray(topk_idx)}")

    def both(fn, **kw):
        return fn(impl="ffi", **kw), fn(impl="xla", **kw)

    show("get_dispatch_layout -> tokens per rank, token in rank, tokens per expert",
         *both(lambda impl: ops.get_dispatch_layout(topk_idx, num_experts=num_experts,
                                                    num_ranks=num_ranks, impl=impl)))
    show("build_send_layout -> token_idx, rank, local_idx, weights, send_counts, num_send",
         *both(lambda impl: ops.build_send_layout(topk_idx, topk_weights, num_ranks=num_ranks,
                                                  num_local_experts=4, impl=impl)))
    routing_map, probs = ops.indices_to_multihot(topk_idx, topk_weights, num_experts=num_experts)
    show("indices_to_multihot -> routing_map, probs",
         *both(lambda impl: ops.indices_to_multihot(topk_idx, topk_weights,
                                                    num_experts=num_experts, impl=impl)))
    show("permute (pad_multiple=2) -> permuted, probs, sorted_indices, tokens_per_expert",
         *both(lambda impl: ops.permute(tokens, routing_map, probs, num_out_tokens=12,
                                        pad_multiple=2, impl=impl)))
    permuted, pprobs, order, _ = ops.permute(tokens, routing_map, probs, num_out_tokens=12)
    show("unpermute(permuted, probs) -> sum_k w_k * token",
         *both(lambda impl: ops.unpermute(permuted, order, num_tokens=4, probs=pprobs,
                                          impl=impl)))
    x = jax.random.normal(jax.random.key(0), (2, 256), jnp.bfloat16)
    show("per_token_cast_to_fp8(round_scale, use_ue8m0) -> scales (packed exponents)",
         *both(lambda impl: ops.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True,
                                                      impl=impl)[1]))

    # Expert parallelism: 4 ranks, 4 tokens each, 8 experts (2 per rank).
    mesh = jax.make_mesh((4,), ("ep",))
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(8)[:2] for _ in range(16)]).astype(np.int32)
    w = rng.uniform(0.1, 1, idx.shape).astype(np.float32)
    xs = np.repeat(np.arange(4, dtype=np.float32), 4)[:, None] * np.ones((1, 4), np.float32)

    def ep(x, i, w):
        recv_x, recv_idx, recv_w, handle = jax_ep.dispatch(x, i, w, num_experts=8,
                                                           axis_name="ep")
        combined, _ = jax_ep.combine(recv_x, handle)
        return recv_x[:, :1], recv_idx, handle.num_recv_tokens[None], combined[:, :1]

    sharding = NamedSharding(mesh, P("ep"))
    args = [jax.device_put(a, sharding) for a in (xs, idx, w)]
    recv_x, recv_idx, n, combined = map(np.asarray, jax.jit(jax.shard_map(
        ep, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args))
    print("\n== dispatch on 4 ranks: rows received per rank", n)
    for r in range(4):
        rows = slice(r * 16, r * 16 + int(n[r]))
        print(f"rank {r}: source ranks {recv_x[rows, 0].astype(int)}, "
              f"local ids {recv_idx[rows].tolist()}")
    print("combine(dispatch(x)) / x = owning ranks per token (rank 0's x is 0):",
          (combined[:, 0] / np.maximum(xs[:, 0], 1)).astype(int))


if __name__ == "__main__":
    main()

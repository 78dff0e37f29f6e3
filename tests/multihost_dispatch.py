"""One two-hop dispatch + combine over a ("node", "local") = (2, 4) expert axis, run either in
one process with 8 CPU devices or as one of 2 processes x 4 devices (jax.distributed + gloo,
each process one node); process 0 writes every rank's results to OUT (an .npz) so that
tests/test_multihost.py can compare the two runs bitwise.

  python tests/multihost_dispatch.py --out OUT                      # 1 process, 8 devices
  python tests/multihost_dispatch.py --out OUT --num-processes 2 --process-id I \
      --coordinator 127.0.0.1:PORT                                  # 2 processes, 4 each
"""

from __future__ import annotations

import argparse
import os

NODES, LOCAL = 2, 4
TOKENS, HIDDEN, EXPERTS, TOPK = 12, 8, 16, 3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default=None)
    args = parser.parse_args()
    local_devices = NODES * LOCAL // args.num_processes
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={local_devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    # Node n = the n-th run of devices ordered by process: the node axis is the process
    # boundary when each process is one node.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(NODES, LOCAL),
                             ("node", "local"))
    axes = ("node", "local")
    ranks = NODES * LOCAL
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ranks * TOKENS, HIDDEN)).astype(np.float32)
    idx = np.stack([rng.choice(EXPERTS, TOPK, replace=False)
                    for _ in range(ranks * TOKENS)]).astype(np.int32)
    idx[::5, 1] = -1  # some unrouted slots
    weights = rng.random((ranks * TOKENS, TOPK)).astype(np.float32)
    sharding = NamedSharding(mesh, P(axes))
    x, idx, weights = (jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
                       for a in (x, idx, weights))

    def step(x, idx, weights):
        recv_x, recv_idx, recv_w, handle = jax_ep.dispatch(
            x, idx, weights, num_experts=EXPERTS, axis_name=axes)
        # An "expert": scale each row by its received weights' sum, so combine sums values
        # that differ per copy.
        y = recv_x * (1.0 + recv_w.sum(axis=1, keepdims=True))
        combined, _ = jax_ep.combine(y, handle)
        return (recv_x, recv_idx, recv_w, handle.num_recv_tokens[None],
                handle.num_tokens_per_rdma_rank[None], handle.num_rdma_recv_tokens[None],
                combined)

    spec = P(axes)
    if args.num_processes > 1:  # the peer transport is refused by name across processes
        try:
            jax.jit(jax.shard_map(lambda x, i, w: jax_ep.dispatch(
                x, i, w, num_experts=EXPERTS, axis_name="local", transport="peer")[0],
                mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)).trace(x, idx, weights)
        except ValueError as error:
            print(f"peer refused: {error}", flush=True)
    outs = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 3,
                                 out_specs=(spec,) * 7))(x, idx, weights)
    names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens",
             "num_tokens_per_rdma_rank", "num_rdma_recv_tokens", "combined")
    host = {name: np.asarray(multihost_utils.process_allgather(out, tiled=True))
            for name, out in zip(names, outs)}
    if jax.process_index() == 0:
        np.savez(args.out, **host)


if __name__ == "__main__":
    main()

"""What placing the training state costs and saves: examples/train_moe.py's default model
(2 MoE transformer blocks, d_model 64, 8 experts, top-2) trained for --steps steps on the
(2, 4) ("data", "expert") mesh of 8 emulated CPU devices, once per set-up:

  shard_params  the natural flow: jax_ep.flax.shard_params(model, mesh), then nnx.Optimizer
                (its step counter and optax's count start on one device);
  shard_state   jax_ep.flax.shard_state(model, optimizer, mesh) after building both.

    python -m benchmarks.bench_setup [--steps 4 --out benchmarks/out]

Per set-up: the wall time of each step (from the call to the loss on the host; step 1
includes tracing and compiling) and the number of executables the jitted step compiled
(jax_ep.flax.compilations).
The ratio column divides each step by the same step of shard_state.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(setup, steps, train_moe, jax):
    """Per-step seconds and the compile count of one set-up."""
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ep.flax import compilations, shard_params, shard_state

    args = train_moe.parse_args([])
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = train_moe.build_model(args, mesh, jax)
    if setup == "shard_params":
        shard_params(model, mesh)
        optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    else:
        optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
        shard_state(model, optimizer, mesh)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            logits, auxes = model(batch[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
            return ce + sum(a["aux_loss"] for a in auxes)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    seconds = []
    with jax.set_mesh(mesh), compilations("step") as compiled:
        for _ in range(steps):
            host = rng.integers(0, 256, (args.batch, args.seq + 1)).astype(np.int32)
            batch = jax.device_put(host, NamedSharding(mesh, P(("data", "expert"))))
            t0 = time.perf_counter()
            float(step(model, optimizer, batch))
            seconds.append(time.perf_counter() - t0)
    return seconds, len(compiled)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join("benchmarks", "out"))
    a = p.parse_args(argv)
    common.force_cpu_devices(8)
    import jax
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_moe

    results = {setup: run(setup, a.steps, train_moe, jax)
               for setup in ("shard_state", "shard_params")}
    base = results["shard_state"][0]
    rows = [[setup, compiles, *[f"{s:.3f} s ({s / b:.2f}x)" for s, b in zip(secs, base)]]
            for setup, (secs, compiles) in results.items()]
    columns = ["set-up", "compiles", *[f"step {i + 1}" for i in range(a.steps)]]
    md = common.print_table(f"train_moe.py default model, {a.steps} steps, 8 CPU devices",
                            columns, rows)
    common.write_json(os.path.join(a.out, "bench_setup.json"), {
        "steps": a.steps, "table_md": md,
        "results": {k: {"seconds": v[0], "compiles": v[1]} for k, v in results.items()}})
    png = common.bar_plot(os.path.join(a.out, "bench_setup.png"),
                          [f"step {i + 1}" for i in range(a.steps)],
                          {k: v[0] for k, v in results.items()}, ylabel="seconds (log)",
                          title="step wall time: shard_params + nnx.Optimizer vs shard_state",
                          log=True)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()

"""The grouped GEMM's CPU handler (jax_ep.ops.grouped_matmul, impl="ffi") against XLA's dense
batched dot of the same rows, one CPU device, per pass of a training step.

    python -m benchmarks.bench_gemm [--groups 8x256,16x64,64x16 --hidden 256 --width 512
                                     --iters 30 --out benchmarks/out]

Each shape G x R is G groups of R rows each (x [G*R, H], w [G, H, W]): the per-device shapes
of bench_moe's layer at E = 8, 64 and 256 by default. Three passes, each jitted alone:
  forward  y = grouped_matmul(x, w, sizes)                   [G*R, W]
  dx       the VJP's x cotangent alone: dy @ w[g]^T per group  [G*R, H]
  dw       the VJP's w cotangent alone: x_g^T @ dy_g per group [G, H, W]
(jax.vjp of grouped_matmul with one cotangent kept: XLA drops the other pass and the forward,
so each row times one custom call; the script checks the lowered program for that). The
baseline is XLA's own dot of the same work with every group the same size (an einsum over
[G, R, .] blocks), the case XLA needs no grouping for. Both are timed round-robin (one call of
each per round), medians of --iters rounds; GFLOP/s counts 2*G*R*H*W per pass. Float32; the
glibc heap is kept mapped (common.keep_host_heap), as in every benchmark here.

Writes <out>/bench_gemm.json, bench_gemm.md (the table) and bench_gemm.png (GFLOP/s per shape
and pass, handler vs XLA).
"""

from __future__ import annotations

import argparse
import contextlib
import os

from benchmarks import common

PASSES = ("forward", "dx", "dw")
# einsum of the baseline per pass: x [G,R,H], w [G,H,W], dy [G,R,W]
DENSE = {"forward": ("grh,ghw->grw", "x", "w"), "dx": ("grw,ghw->grh", "dy", "w"),
         "dw": ("grh,grw->ghw", "x", "dy")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="8x256,16x64,64x16",
                   help="comma-separated GxR shapes: G groups of R rows")
    p.add_argument("--hidden", type=int, default=256, help="H, the rows' width")
    p.add_argument("--width", type=int, default=512, help="W, the weights' output width")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/out")
    a = p.parse_args(argv)
    try:
        a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.groups.split(",")]
    except ValueError:
        raise SystemExit(f"--groups: expected GxR shapes like 8x256,16x64, got {a.groups!r}")
    if any(len(s) != 2 or min(s) < 1 for s in a.shapes):
        raise SystemExit(f"--groups: expected positive GxR shapes, got {a.groups!r}")
    return a


def handler_pass(name, sizes):
    """The jitted pass of grouped_matmul(impl="ffi"): (x, w, dy) -> its output."""
    import jax

    from jax_ep import ops

    def matmul(x, w):
        return ops.grouped_matmul(x, w, sizes, impl="ffi")

    if name == "forward":
        return jax.jit(lambda x, w, dy: matmul(x, w))
    keep = 0 if name == "dx" else 1
    return jax.jit(lambda x, w, dy: jax.vjp(matmul, x, w)[1](dy)[keep])


def dense_pass(name, G, R):
    """XLA's batched dot of the same pass over [G, R, .] blocks: (x, w, dy) -> its output in
    the handler's layout."""
    import jax
    import jax.numpy as jnp

    spec, left, right = DENSE[name]

    def run(x, w, dy):
        blocks = {"x": x.reshape(G, R, -1), "w": w, "dy": dy.reshape(G, R, -1)}
        out = jnp.einsum(spec, blocks[left], blocks[right])
        return out if name == "dw" else out.reshape(G * R, -1)
    return jax.jit(run)


def custom_calls(fn, *args) -> int:
    """The grouped-GEMM custom calls in fn's compiled program."""
    text = fn.lower(*args).compile().as_text()
    return text.count('custom_call_target="jax_ep_grouped_gemm')


def main(argv=None):
    a = parse_args(argv)
    common.force_cpu_devices(1)
    print(f"host heap: {common.keep_host_heap(True)}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    H, W = a.hidden, a.width
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores; "
          f"H={H} W={W} float32")
    calls, meta = {}, {}
    for G, R in a.shapes:
        keys = jax.random.split(jax.random.key(G * 1000 + R), 3)
        x = jax.random.normal(keys[0], (G * R, H), jnp.float32)
        w = jax.random.normal(keys[1], (G, H, W), jnp.float32)
        dy = jax.random.normal(keys[2], (G * R, W), jnp.float32)
        sizes = jnp.full((G,), R, jnp.int32)
        for name in PASSES:
            handler, dense = handler_pass(name, sizes), dense_pass(name, G, R)
            found = custom_calls(handler, x, w, dy)
            if found != 1:
                raise SystemExit(f"{name} at {G}x{R}: expected one grouped-GEMM custom call in "
                                 f"the program, found {found}")
            got, want = np.asarray(handler(x, w, dy)), np.asarray(dense(x, w, dy))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.sqrt(max(H, R)))
            label = f"{G}x{R} {name}"
            calls[label + " handler"] = (handler, (x, w, dy), contextlib.nullcontext)
            calls[label + " xla"] = (dense, (x, w, dy), contextlib.nullcontext)
            meta[label] = dict(groups=G, rows=R, flops=2 * G * R * H * W)
    timed = common.time_round_robin(calls, warmup=a.warmup, iters=a.iters)

    rows, results = [], {}
    for label, m in meta.items():
        t_ffi = timed[label + " handler"][0]
        t_xla = timed[label + " xla"][0]
        gflops = {k: m["flops"] / t["median_s"] / 1e9 for k, t in (("ffi", t_ffi),
                                                                    ("xla", t_xla))}
        results[label] = dict(m, handler=t_ffi, xla=t_xla, handler_gflops=gflops["ffi"],
                              xla_gflops=gflops["xla"])
        rows.append([label, t_ffi["median_s"] * 1e3, gflops["ffi"], t_xla["median_s"] * 1e3,
                     gflops["xla"], t_xla["median_s"] / t_ffi["median_s"]])
    md = common.print_table(
        f"grouped GEMM handler vs XLA's batched dot, one CPU device, H={H} W={W}, f32, "
        f"median of {a.iters} (round-robin)",
        ["shape, pass", "handler ms", "handler GFLOP/s", "XLA ms", "XLA GFLOP/s",
         "handler speedup"], rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_gemm.md"), "w") as f:
        f.write(md)
    common.write_json(os.path.join(a.out, "bench_gemm.json"),
                      {"config": {k: v for k, v in vars(a).items() if k != "shapes"},
                       "runs": results})
    common.bar_plot(os.path.join(a.out, "bench_gemm.png"), list(meta),
                    {"handler (impl='ffi')": [r["handler_gflops"] for r in results.values()],
                     "XLA batched dot": [r["xla_gflops"] for r in results.values()]},
                    ylabel="GFLOP/s", title=f"grouped GEMM passes, H={H} W={W}, f32, 1 device")
    print(f"wrote bench_gemm.json, bench_gemm.md, bench_gemm.png under {a.out}")


if __name__ == "__main__":
    main()

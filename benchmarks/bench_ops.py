"""Layer-1 op benchmark: every jax_ep.ops kernel, FFI handler against the pure-JAX reference,
in one process, next to a plain device copy of the same number of bytes.

    python -m benchmarks.bench_ops               # T=4096, H=2048 and 7168, K=8, E=64, bf16
    python -m benchmarks.bench_ops --hidden 2048 7168 --tokens 4096 --iters 20
    python -m benchmarks.bench_ops --sweep       # data-moving ops vs T and vs H

For each op and hidden size: the jitted FFI call (impl="ffi"), the jitted reference
(impl="xla") and the copy below are each timed as the median of at least --iters calls after
--warmup calls, each call closed by jax.block_until_ready; fast ops get more calls, until the
slowest of the three has had --min-time seconds of timed calls. The three are timed round-robin
(one call of each per round), so the shared machine's slow stretches fall on all of them alike.

Effective bandwidth. Every op is counted by its compulsory memory traffic:

    bytes(op) = sum(nbytes of every input array) + sum(nbytes of every output array)

i.e. each input read once and each output written once (outputs from jax.eval_shape of the
call, so padding rows and count outputs are included; tokens that are gathered K times are
counted once). GB/s = bytes / median time / 1e9.

Bandwidth floor. For each op a buffer of bytes(op) / 2 is copied with a jitted `x ^ c` on
uint32 words, where c is a runtime argument (0), so XLA can neither fold the op away nor alias
the output to the input: the copy reads bytes/2 and writes bytes/2, the same traffic as the op.
"% copy" = copy time / op time = op GB/s / copy GB/s (100 % = the op runs at memory speed).
"ffi/ref" = reference time / FFI time (> 1: the FFI kernel is faster).

Writes <out>/bench_ops.json (all numbers and the environment), <out>/bench_ops.png (GB/s per op)
and <out>/bench_ops.md (the tables as Markdown). With --sweep, the data-moving ops instead run
over --sweep-tokens (at H = the first --hidden) and over --sweep-hidden (at T = --tokens) and
the results go to <out>/bench_ops_sweep.{json,md} and four line plots,
bench_ops_{gbs,time}_vs_{tokens,hidden}.png (FFI solid vs reference, plus the copy).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (bar_plot, env_info, keep_host_heap, line_plot, print_table,
                               write_json)
from jax_ep import ops

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
DATA_OPS = ("permute", "unpermute", "gather_rows", "per_token_cast_to_fp8", "per_token_cast_back")
COLUMNS = ["op", "T", "H", "MB moved", "ffi ms", "ref ms", "ffi/ref", "copy ms", "ffi GB/s",
           "ref GB/s", "copy GB/s", "ffi % copy", "ref % copy"]


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _median_times(calls, warmup: int, iters: int, min_time: float):
    """(median seconds, minor page faults per call, calls timed) of each (fn, args) in
    `calls`, timed round-robin (one call of each per round) so that a slow stretch of this
    shared machine weighs on every candidate alike. Runs at least `iters` rounds, and more for
    fast ops (up to 5000), until the slowest candidate has had about `min_time` seconds of
    timed calls: a median of 20 calls of a 0.2 ms op spans 4 ms of a noisy machine. The faults
    (getrusage, outside the timed span) show whether a candidate writes into freshly mapped
    pages (see common.keep_host_heap)."""
    slowest = 0.0
    for fn, args in calls:
        jax.block_until_ready(fn(*args))  # compiles
        for _ in range(max(warmup, 1)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            slowest = max(slowest, time.perf_counter() - t0)
    rounds = max(iters, min(5000, math.ceil(min_time / max(slowest, 1e-9))))
    times = [[] for _ in calls]
    faults = [0] * len(calls)
    for _ in range(rounds):
        for i, (fn, args) in enumerate(calls):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
            faults[i] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return [(statistics.median(samples), n / rounds, rounds)
            for samples, n in zip(times, faults)]


def _unpermute_weighted(permuted, sorted_indices, probs, *, num_tokens, impl):
    return ops.unpermute(permuted, sorted_indices, num_tokens=num_tokens, probs=probs, impl=impl)


@jax.jit
def _copy(words, c):
    return words ^ c


def _routing(rng, T, K, E):
    """topk_idx i32[T,K] (K distinct experts per token, uniform) and softmax-like weights."""
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    return jnp.asarray(idx), jnp.asarray(w / w.sum(axis=1, keepdims=True))


def build_cases(T, H, K, E, P, dtype, seed=0):
    """[(name, fn(impl) -> jitted callable, args)] for every layer-1 op at one shape."""
    rng = np.random.default_rng(seed)
    topk_idx, topk_w = _routing(rng, T, K, E)
    tokens = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32)).astype(dtype)
    routing_map, probs = ops.indices_to_multihot(topk_idx, topk_w, num_experts=E)
    n = T * K  # every (token, expert) pair; no drops
    permuted, permuted_probs, sorted_indices, _ = ops.permute(tokens, routing_map, probs,
                                                              num_out_tokens=n)
    send = ops.build_send_layout(topk_idx, topk_w, num_ranks=P, num_local_experts=E // P)
    x_fp8, scales = ops.per_token_cast_to_fp8(tokens)

    def jitted(op, **static):
        return lambda impl: jax.jit(partial(op, impl=impl, **static))

    return [
        ("get_dispatch_layout", jitted(ops.get_dispatch_layout, num_experts=E, num_ranks=P),
         (topk_idx,)),
        ("build_send_layout", jitted(ops.build_send_layout, num_ranks=P,
                                     num_local_experts=E // P), (topk_idx, topk_w)),
        ("indices_to_multihot", jitted(ops.indices_to_multihot, num_experts=E),
         (topk_idx, topk_w)),
        ("permute", jitted(ops.permute, num_out_tokens=n), (tokens, routing_map, probs)),
        ("unpermute(probs)", jitted(_unpermute_weighted, num_tokens=T),
         (permuted, sorted_indices, permuted_probs)),
        ("gather_rows(send pack)", jitted(ops.gather_rows), (tokens, send.token_idx)),
        ("per_token_cast_to_fp8", jitted(ops.per_token_cast_to_fp8), (tokens,)),
        ("per_token_cast_back", jitted(ops.per_token_cast_back, dtype=dtype), (x_fp8, scales)),
    ]


def bench_shape(T, H, K, E, P, dtype, warmup, iters, min_time, only=None):
    rows = []
    for name, make, args in build_cases(T, H, K, E, P, dtype):
        if only and not any(o in name for o in only):
            continue
        ffi, ref = make("ffi"), make("xla")
        nbytes = _nbytes(args) + _nbytes(jax.eval_shape(ffi, *args))
        words = jnp.zeros((max(1, nbytes // 8),), jnp.uint32)  # nbytes / 2 bytes, copied once
        zero = jnp.uint32(0)
        (t_ffi, f_ffi, calls), (t_ref, f_ref, _), (t_copy, f_copy, _) = _median_times(
            [(ffi, args), (ref, args), (_copy, (words, zero))], warmup, iters, min_time)
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        rows.append(dict(op=name, tokens=T, hidden=H, bytes=nbytes, ffi_ms=t_ffi * 1e3,
                         ref_ms=t_ref * 1e3, copy_ms=t_copy * 1e3, ffi_gbs=gbs(t_ffi),
                         ref_gbs=gbs(t_ref), copy_gbs=gbs(t_copy), ffi_over_ref=t_ref / t_ffi,
                         ffi_pct_copy=100 * t_copy / t_ffi, ref_pct_copy=100 * t_copy / t_ref,
                         calls_timed=calls,
                         page_faults_per_call=dict(ffi=f_ffi, ref=f_ref, copy=f_copy)))
        print(f"  {name:24s} T={T} H={H}: ffi {t_ffi * 1e3:9.3f} ms  ref {t_ref * 1e3:9.3f} ms  "
              f"copy {t_copy * 1e3:8.3f} ms  (median of {calls}; page faults/call "
              f"{f_ffi:.0f} / {f_ref:.0f} / {f_copy:.0f})", flush=True)
    return rows


def _table_rows(rows):
    return [[r["op"], r["tokens"], r["hidden"], r["bytes"] / 1e6, r["ffi_ms"], r["ref_ms"],
             r["ffi_over_ref"], r["copy_ms"], r["ffi_gbs"], r["ref_gbs"], r["copy_gbs"],
             r["ffi_pct_copy"], r["ref_pct_copy"]] for r in rows]


def sweep(a, dtype, out):
    """Data-moving ops over a token sweep and a hidden sweep -> JSON, Markdown, 4 line plots."""
    H0 = a.hidden[0]
    runs = {"tokens": [(T, H0) for T in a.sweep_tokens],
            "hidden": [(a.tokens, H) for H in a.sweep_hidden]}
    results, md = {}, ""
    only = [o for o in DATA_OPS if not a.ops or any(f in o for f in a.ops)]
    for axis, shapes in runs.items():
        rows = []
        for T, H in shapes:
            rows += bench_shape(T, H, a.topk, a.experts, a.ranks, dtype, a.warmup, a.iters,
                                a.min_time, only)
        results[axis] = rows
        fixed = f"H={H0}" if axis == "tokens" else f"T={a.tokens}"
        title = (f"data-moving ops vs {axis}, {jax.default_backend()}: {fixed} K={a.topk} "
                 f"E={a.experts} {a.dtype} (median of >= {a.iters})")
        md += print_table(title, COLUMNS, _table_rows(rows)) + "\n"
        xs = [T if axis == "tokens" else H for T, H in shapes]
        ops_run = list(dict.fromkeys(r["op"] for r in rows))
        styles = {"copy": dict(color="black", linestyle=":")}
        for i, op in enumerate(ops_run):  # one colour per op: FFI solid, reference dashed
            styles[f"{op} ffi"] = dict(color=f"C{i}")
            styles[f"{op} ref"] = dict(color=f"C{i}", linestyle="--")
        for metric, unit in (("gbs", "effective GB/s"), ("ms", "ms")):
            series = {}
            for op in ops_run:
                mine = [r for r in rows if r["op"] == op]
                series[f"{op} ffi"] = [r[f"ffi_{metric}"] for r in mine]
                series[f"{op} ref"] = [r[f"ref_{metric}"] for r in mine]
            # one copy line: the copy of the first op's bytes
            series["copy"] = [r[f"copy_{metric}"] for r in rows if r["op"] == ops_run[0]]
            line_plot(os.path.join(out, f"bench_ops_{'time' if metric == 'ms' else 'gbs'}"
                                        f"_vs_{axis}.png"), xs, series,
                      xlabel="tokens T" if axis == "tokens" else "hidden H",
                      ylabel=unit, title=title, logx=True, styles=styles)
    write_json(os.path.join(out, "bench_ops_sweep.json"), {"config": vars(a), "results": results})
    with open(os.path.join(out, "bench_ops_sweep.md"), "w") as f:
        f.write(md)
    print(f"wrote {out}/bench_ops_sweep.json, bench_ops_sweep.md and "
          "bench_ops_{gbs,time}_vs_{tokens,hidden}.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--glibc-heap-defaults", action="store_true",
                   help="leave glibc malloc as it is (default: keep freed host memory mapped, "
                        "see common.keep_host_heap)")
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8, help="P for the dispatch/send layouts")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="timed rounds, at least")
    p.add_argument("--min-time", type=float, default=0.25,
                   help="seconds of timed calls the slowest candidate of an op gets, at least "
                        "(fast ops run more than --iters rounds)")
    p.add_argument("--ops", nargs="*", help="only ops whose name contains one of these")
    p.add_argument("--out", default=os.path.join("benchmarks", "out"))
    p.add_argument("--sweep", action="store_true",
                   help="data-moving ops over --sweep-tokens and --sweep-hidden, line plots")
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--sweep-hidden", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    a = p.parse_args(argv)
    heap = keep_host_heap(not a.glibc_heap_defaults)
    dtype = DTYPES[a.dtype]
    env = env_info()
    print(f"jax {jax.__version__} on {jax.default_backend()} ({env.get('device_kind')}), "
          f"{os.cpu_count()} CPUs; T={a.tokens} K={a.topk} E={a.experts} P={a.ranks} "
          f"{a.dtype}; median of >= {a.iters} rounds and >= {a.min_time} s after {a.warmup} "
          f"warm-up; {heap}", flush=True)

    os.makedirs(a.out, exist_ok=True)
    if a.sweep:
        return sweep(a, dtype, a.out)
    rows = []
    for H in a.hidden:
        rows += bench_shape(a.tokens, H, a.topk, a.experts, a.ranks, dtype, a.warmup, a.iters,
                            a.min_time, a.ops)

    title = (f"jax_ep layer-1 ops, {jax.default_backend()}: T={a.tokens} K={a.topk} "
             f"E={a.experts} P={a.ranks} {a.dtype} (median of >= {a.iters})")
    md = print_table(title, COLUMNS, _table_rows(rows))

    config = dict(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts,
                  ranks=a.ranks, dtype=a.dtype, warmup=a.warmup, iters=a.iters,
                  min_time=a.min_time,
                  bytes_formula="sum(input nbytes) + sum(output nbytes)",
                  copy_baseline="jit(x ^ c) on uint32[bytes/8], c a runtime 0")
    json_path = write_json(os.path.join(a.out, "bench_ops.json"),
                           {"config": config, "results": rows})
    with open(os.path.join(a.out, "bench_ops.md"), "w") as f:
        f.write(md)
    multi = len(a.hidden) > 1
    labels = [f"{r['op']} H={r['hidden']}" if multi else r["op"] for r in rows]
    png = bar_plot(os.path.join(a.out, "bench_ops.png"), labels,
                   {"FFI": [r["ffi_gbs"] for r in rows],
                    "reference (XLA)": [r["ref_gbs"] for r in rows],
                    "copy, same bytes": [r["copy_gbs"] for r in rows]},
                   ylabel="effective GB/s (log)", title=title, log=True)
    print(f"wrote {json_path}" + (f", {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()

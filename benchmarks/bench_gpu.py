"""Bandwidth of jax_ep's CUDA kernels at realistic MoE shapes, against a device-to-device copy
of the same bytes, the XLA reference (impl="xla") and the unfused PyTorch path.

    python benchmarks/bench_gpu.py --out DIR      # on a GPU (run by tests/gpu/device_check.sh)
    python benchmarks/bench_gpu.py --dry-run      # tiny shapes on CPU: checks the code paths

Kernels (bf16 data, K=8, P=8 ranks for the send side, C = T rows per rank):
  permute        tokens [T,H] -> [T*K,H] expert-major (+ probs, sorted indices)
  unpermute      [T*K,H] -> [T,H], weighted fp32 sum per token
  gather_rows    send packing: [T,H] -> padded [P*C,H] send buffer (zero rows where -1)
  combine        the combine reduction: unpermute of a [P*C,H] receive buffer by token index
  fp8_cast       per_token_cast_to_fp8: [T,H] bf16 -> e4m3 codes + f32 scale per 128 channels
and, first, the experts' grouped GEMM (ops.grouped_matmul, bf16, [N,H] rows of which 7/8 are
routed, uniformly at random over G groups, as in the layer's receive buffer, whose worst-case
rows exceed the routed ones; [G,H,F] weights): impl="tiled" (jax_ep's loop over row tiles, at
its default 64 rows a tile and at 512) and
"blocks" (every group gathered into a block of the ladder's size, one batched GEMM) vs
"ragged_dot" (XLA's jax.lax.ragged_dot, which XLA:GPU expands to a dense dot over every group;
impl="auto" picks it on a GPU for at most 8 groups, "tiled" beyond), forward
and forward + backward (dx, dw), in TFLOP/s of the 2*R*H*F FLOPs per pass over the R routed
rows (three passes with the backward).
Effective bandwidth = the bytes an op must touch (rows read + rows written + index/prob/scale
arrays; padding rows are not read) / median time per call over >= 20 samples after warm-up,
each sample a batch of back-to-back calls (about 2 ms of them) closed by one
jax.block_until_ready (torch: torch.cuda.synchronize). "copy" is a jitted `x ^ c`
over uint32 words holding half those bytes (c a runtime 0: read + write = the same bytes, and
XLA can neither fold it away nor alias the output), timed the same way. The PyTorch column is
what MoE dispatchers fall back to without fused kernels: argsort + index_select to permute,
index_add_ to unpermute/reduce (bf16 accumulation), index_select + masked_fill_ to pack, and
DeepEP's reference per_token_cast_to_fp8; skipped when torch (or its CUDA) is missing.

Without a GPU the script prints a message and exits 0 (unless --dry-run). JSON, Markdown and
PNG go to --out (the grouped GEMM: a second table in the Markdown, bench_gpu_gmm.png); the JSON
is rewritten after every shape, so a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from functools import partial

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, _ROOT)

from benchmarks import common  # noqa: E402  (imports neither jax nor torch)

DEFAULT_SHAPES = "4096x7168x256,16384x7168x256,4096x2048x64,16384x2048x64"
DRY_SHAPES = "64x256x16,96x384x32"
KERNELS = ("permute", "unpermute", "gather_rows", "combine", "fp8_cast")
# NxGxHxF: DeepSeek-V3's experts at EP8 (T=4096 tokens x K=8 rows, 32 local experts), and a
# smaller model's (8 local experts, H=2048)
DEFAULT_GMM_SHAPES = "32768x32x7168x2048,8192x8x2048x1408,16384x64x2048x1408"
DRY_GMM_SHAPES = "256x4x128x64"
# impl[:tile_rows]: the tiled loop at its default 64-row tiles and at 512 (fewer loop steps: on
# a GPU each is a kernel launch and a loop-condition check)
GMM_IMPLS = ("tiled", "tiled:512", "blocks", "ragged_dot")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of TxHxE (default {DEFAULT_SHAPES}; '' skips the "
                        f"kernels: the grouped GEMM alone)")
    p.add_argument("--gmm-shapes", default=None,
                   help=f"comma list of NxGxHxF for the grouped GEMM (default "
                        f"{DEFAULT_GMM_SHAPES}; '' skips it)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ranks", type=int, default=8, help="P of the send/combine buffers")
    p.add_argument("--iters", type=int, default=30,
                   help="timed samples (batches of calls) per measurement (>= 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=75.0,
                   help="start no new kernel shape after this many seconds (device_check.sh "
                        "passes 85 and stops the script at 120 s)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch column")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on CPU (no GPU needed): exercises every code path")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- timing


# A timed sample is a batch of back-to-back calls closed by one synchronisation, so the
# host's synchronisation (tens of microseconds) is spread over the batch. Each call's own
# launch cost on the host (several microseconds per jitted call) still bounds kernels shorter
# than that: such rows measure the launch rate, not the kernel.
SAMPLE_S = 2e-3


def _median_of_batches(call, sync, warmup, iters):
    """Median seconds per call of `call()` (which returns its output), over `iters` samples of
    n calls each, n chosen from the warm-up so that a sample lasts about SAMPLE_S."""
    out = call()  # compiles
    sync(out)
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):
        out = call()
    sync(out)
    single = (time.perf_counter() - t0) / max(warmup, 1)
    n = max(1, min(1000, round(SAMPLE_S / max(single, 1e-7))))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        sync(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times), out


def _median_jax(fn, args, warmup, iters):
    import jax
    return _median_of_batches(lambda: fn(*args), jax.block_until_ready, warmup, iters)


def _median_torch(fn, sync, warmup, iters):
    return _median_of_batches(fn, lambda _: sync(), warmup, iters)


# ----------------------------------------------------------------------------- torch path


def load_torch(dry_run, disabled):
    """(torch module, device string, sync fn) or (None, reason, None)."""
    if disabled:
        return None, "disabled (--no-torch)", None
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - any import failure means "no torch column"
        return None, f"torch not importable ({type(err).__name__}: {err})", None
    if dry_run:
        return torch, "cpu", lambda: None
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device", None
    return torch, "cuda", torch.cuda.synchronize


def torch_kernels(torch, device):
    """The unfused PyTorch implementations, as closures over prepared tensors."""

    def permute(tokens, topk_idx, topk_probs):
        # argsort of the flattened slots' expert ids (stable: token-ascending per expert)
        k = topk_idx.shape[1]
        order = torch.argsort(topk_idx.reshape(-1), stable=True)
        permuted = tokens.index_select(0, order // k)
        return permuted, topk_probs.reshape(-1).index_select(0, order), order // k

    def unpermute(permuted, token, probs, num_tokens):
        out = torch.zeros(num_tokens, permuted.shape[1], dtype=permuted.dtype, device=device)
        out.index_add_(0, token, permuted * probs.unsqueeze(-1).to(permuted.dtype))
        return out

    def gather_rows(x, row_idx):
        out = x.index_select(0, row_idx.clamp(min=0))
        return out.masked_fill_((row_idx < 0).unsqueeze(-1), 0)

    def combine(buf, owner, num_tokens):
        # padding rows (-1) go to a spare row T that is dropped
        out = torch.zeros(num_tokens + 1, buf.shape[1], dtype=buf.dtype, device=device)
        out.index_add_(0, torch.where(owner >= 0, owner, num_tokens), buf)
        return out[:num_tokens]

    def fp8_cast(x):  # DeepEP's reference per_token_cast_to_fp8
        t, h = x.shape
        view = x.view(t, h // 128, 128).float()
        amax = view.abs().amax(dim=2).clamp(min=1e-4)
        codes = (view * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
        return codes, amax / 448.0

    return dict(permute=permute, unpermute=unpermute, gather_rows=gather_rows,
                combine=combine, fp8_cast=fp8_cast)


# ----------------------------------------------------------------------------- one shape


def bench_shape(T, H, E, a, tk):
    """Times every kernel at one shape; returns a list of row dicts."""
    import jax
    import jax.numpy as jnp

    from jax_ep import ops

    K, P = a.topk, a.ranks
    bf16, item = jnp.bfloat16, 2
    N = T * K
    key = jax.random.key(T * 31 + H * 7 + E)
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (T, H), bf16)
    topk_probs, topk_idx = jax.lax.top_k(jax.random.uniform(k2, (T, E)), K)  # distinct ids
    topk_idx = topk_idx.astype(jnp.int32)
    topk_probs = (topk_probs / topk_probs.sum(axis=1, keepdims=True)).astype(jnp.float32)
    routing_map, probs = jax.jit(partial(ops.indices_to_multihot, num_experts=E))(
        topk_idx, topk_probs)

    @jax.jit
    def send_slots(idx):
        # padded send buffer of C = T rows per rank: slot p*T + j holds the j-th token of
        # rank p (rank-major, token-ascending, as the deepep transport packs it), -1 after.
        _, in_rank, _ = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=P)
        pos = jnp.cumsum(in_rank, axis=0, dtype=jnp.int32) - 1
        slot = jnp.where(in_rank, jnp.arange(P)[None, :] * T + pos, P * T)
        token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], slot.shape)
        return jnp.full((P * T + 1,), -1, jnp.int32).at[slot].set(token)[:P * T]

    row_idx = send_slots(topk_idx)
    valid_rows = int((row_idx >= 0).sum())
    permuted, permuted_probs, sorted_indices, _ = jax.jit(
        partial(ops.permute, num_out_tokens=N))(x, routing_map, probs)
    recv_buf = jax.jit(ops.gather_rows)(x, row_idx)  # stands in for the received rows
    jax.block_until_ready((row_idx, permuted, recv_buf))

    specs = {
        # name: (fn(impl) -> jitted callable, args, bytes touched)
        "permute": (lambda impl: jax.jit(partial(ops.permute, num_out_tokens=N, impl=impl)),
                    (x, routing_map, probs),
                    2 * N * H * item + T * E * (1 + 4) + N * (4 + 4)),
        "unpermute": (lambda impl: jax.jit(lambda rows, idx, w: ops.unpermute(
                          rows, idx, num_tokens=T, probs=w, impl=impl)),
                      (permuted, sorted_indices, permuted_probs),
                      N * H * item + T * H * item + N * (4 + 4)),
        "gather_rows": (lambda impl: jax.jit(partial(ops.gather_rows, impl=impl)),
                        (x, row_idx), valid_rows * H * item + P * T * H * item + P * T * 4),
        "combine": (lambda impl: jax.jit(partial(ops.unpermute, num_tokens=T, impl=impl)),
                    (recv_buf, row_idx),
                    valid_rows * H * item + T * H * item + P * T * 4),
        "fp8_cast": (lambda impl: jax.jit(partial(ops.per_token_cast_to_fp8, impl=impl)),
                     (x,), T * H * item + T * H + T * (H // 128) * 4),
    }
    torch, device, sync = tk
    torch_calls, torch_setup_error = None, None
    if torch is not None:
        try:
            tt = torch_kernels(torch, device)
            t_x = torch.from_dlpack(x)
            t_idx = torch.from_dlpack(topk_idx).long()
            t_probs = torch.from_dlpack(topk_probs)
            t_perm, t_pprobs, t_token = tt["permute"](t_x, t_idx, t_probs)
            t_rows = torch.from_dlpack(row_idx).long()
            t_buf = torch.from_dlpack(recv_buf)
            torch_calls = {
                "permute": lambda: tt["permute"](t_x, t_idx, t_probs),
                "unpermute": lambda: tt["unpermute"](t_perm, t_token, t_pprobs, T),
                "gather_rows": lambda: tt["gather_rows"](t_x, t_rows),
                "combine": lambda: tt["combine"](t_buf, t_rows, T),
                "fp8_cast": lambda: tt["fp8_cast"](t_x),
            }
        except Exception as err:  # noqa: BLE001 - a torch failure must not end the run
            torch_setup_error = f"{type(err).__name__}: {err}"
            print(f"  torch setup failed, no torch column for this shape: {torch_setup_error}",
                  flush=True)
    # the copy: x ^ c with c a runtime 0, so XLA can neither fold it nor alias its output
    copy = jax.jit(lambda words, c: words ^ c)
    zero = jnp.uint32(0)
    rows = []
    for name in KERNELS:
        make, args, nbytes = specs[name]
        row = dict(kernel=name, T=T, H=H, E=E, K=K, P=P, bytes=nbytes)
        if torch_setup_error:
            row["torch_error"] = torch_setup_error
        row["ffi_s"], out_ffi = _median_jax(make("ffi"), args, a.warmup, a.iters)
        row["xla_s"], out_xla = _median_jax(make("xla"), args, a.warmup, a.iters)
        row["check_ffi_vs_xla"] = _max_rel_diff(jax, jnp, out_ffi, out_xla)
        del out_xla
        src = jnp.zeros((nbytes // 2 // 4,), jnp.uint32)  # read + write = nbytes
        row["copy_s"], _ = _median_jax(copy, (src, zero), a.warmup, a.iters)
        del src
        if torch_calls is not None:
            try:
                row["torch_s"], out_t = _median_torch(torch_calls[name], sync, a.warmup,
                                                      a.iters)
                row["check_torch_vs_ffi"] = _torch_diff(torch, jax, jnp, name, out_t, out_ffi)
                del out_t
            except Exception as err:  # noqa: BLE001 - a torch failure must not end the run
                row["torch_error"] = f"{type(err).__name__}: {err}"
                print(f"  torch {name} failed: {row['torch_error']}", flush=True)
        del out_ffi
        for impl in ("ffi", "xla", "copy", "torch"):
            if f"{impl}_s" in row:
                row[f"{impl}_gbps"] = nbytes / row[f"{impl}_s"] / 1e9
        rows.append(row)
        print(f"  T={T:6d} H={H:5d} E={E:4d} {name:12s} ffi {row['ffi_gbps']:8.1f} GB/s  "
              f"xla {row['xla_gbps']:8.1f}  copy {row['copy_gbps']:8.1f}  torch "
              f"{row.get('torch_gbps', float('nan')):8.1f}", flush=True)
        gc.collect()
    torch_calls = None
    if torch is not None and device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _max_rel_diff(jax, jnp, got, want):
    """max |got - want| / max |want| over the first output (data rows; FP8 codes by value)."""
    g, w = _first(got).astype(jnp.float32), _first(want).astype(jnp.float32)
    return float(jnp.abs(g - w).max() / jnp.maximum(jnp.abs(w).max(), 1e-30))


def _torch_diff(torch, jax, jnp, name, out_t, out_ffi):
    """Relative difference of the torch data output against jax_ep's (FP8: dequantized)."""
    ref = _first(out_ffi)
    if name == "fp8_cast":
        codes, scales = out_ffi
        ref = (codes.astype(jnp.float32).reshape(codes.shape[0], -1, 128)
               * scales[:, :, None]).reshape(codes.shape)
        t_codes, t_scales = out_t
        t_val = (t_codes.float().view(t_codes.shape[0], -1, 128)
                 * t_scales.unsqueeze(-1)).view(t_codes.shape)
    else:
        t_val = _first(out_t).float()
    ref_t = torch.from_dlpack(jax.block_until_ready(ref.astype(jnp.float32)))
    ref_t = ref_t.to(t_val.device)
    return float((t_val - ref_t).abs().max() / ref_t.abs().max().clamp(min=1e-30))


# ----------------------------------------------------------------------------- grouped GEMM


def bench_grouped_matmul(N, G, H, F, a):
    """Times ops.grouped_matmul, each impl of GMM_IMPLS, forward and forward + backward, at one
    shape; returns a row dict per impl (check: the forward's max relative difference from
    ragged_dot's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_ep import ops

    rng = np.random.default_rng(N + G + H + F)
    routed = N * 7 // 8
    sizes = jnp.asarray(np.bincount(rng.integers(0, G, routed), minlength=G), jnp.int32)
    kx, kw = jax.random.split(jax.random.key(G))
    x = jax.random.normal(kx, (N, H), jnp.bfloat16)
    w = (jax.random.normal(kw, (G, H, F), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
    flops = 2 * routed * H * F
    rows, outs = [], {}
    for variant in GMM_IMPLS:
        impl, _, tile = variant.partition(":")

        def forward(x, w, impl=impl, tile=int(tile) if tile else None):
            return ops.grouped_matmul(x, w, sizes, impl=impl, tile_rows=tile)

        backward = jax.grad(lambda x, w, f=forward: f(x, w).astype(jnp.float32).sum(),
                            argnums=(0, 1))
        fwd_s, outs[variant] = _median_jax(jax.jit(forward), (x, w), a.warmup, a.iters)
        bwd_s, _ = _median_jax(jax.jit(backward), (x, w), a.warmup, a.iters)
        rows.append(dict(kernel="grouped_matmul", impl=variant, N=N, G=G, H=H, F=F,
                         fwd_s=fwd_s, fwd_tflops=flops / fwd_s / 1e12, fwd_bwd_s=bwd_s,
                         fwd_bwd_tflops=3 * flops / bwd_s / 1e12))
        print(f"  grouped_matmul {N}x{G}x{H}x{F} {variant:10s} forward {fwd_s * 1e3:8.3f} ms "
              f"({rows[-1]['fwd_tflops']:6.1f} TFLOP/s), forward + backward "
              f"{bwd_s * 1e3:8.3f} ms ({rows[-1]['fwd_bwd_tflops']:6.1f})", flush=True)
    for row in rows:
        row["check_vs_ragged_dot"] = _max_rel_diff(jax, jnp, outs[row["impl"]],
                                                   outs["ragged_dot"])
    return rows


def _gmm_shape(row):
    return f"{row['N']}x{row['G']}x{row['H']}x{row['F']}"


def _gmm_report(rows, a):
    """The grouped GEMM's Markdown table, and its bar plot's labels and series (TFLOP/s per
    shape and pass, one series per impl)."""
    ragged_s = {_gmm_shape(r): r["fwd_s"] for r in rows if r["impl"] == "ragged_dot"}
    table = [[_gmm_shape(r), r["impl"], r["fwd_s"] * 1e3, r["fwd_tflops"], r["fwd_bwd_s"] * 1e3,
              r["fwd_bwd_tflops"], r["fwd_s"] / ragged_s[_gmm_shape(r)],
              f"{r['check_vs_ragged_dot']:.1e}"] for r in rows]
    md = common.print_table(
        f"grouped GEMM (ops.grouped_matmul, bf16, median of {a.iters}): tiled, blocks vs "
        "ragged_dot",
        ["shape NxGxHxF", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
         "fwd time vs ragged_dot", "max rel diff"], table)
    labels = [f"{shape} {p}" for shape in dict.fromkeys(map(_gmm_shape, rows))
              for p in ("fwd", "fwd+bwd")]
    series = {impl: [r[k] for r in rows if r["impl"] == impl
                     for k in ("fwd_tflops", "fwd_bwd_tflops")] for impl in GMM_IMPLS}
    return md, labels, series


# ----------------------------------------------------------------------------- main


def _report(rows, a, torch_note):
    cols = ["shape TxHxE", "kernel", "MB", "ffi GB/s", "% of copy", "xla GB/s", "vs xla",
            "torch GB/s", "vs torch", "ffi-xla diff", "torch diff"]
    table = []
    for r in rows:
        table.append([f"{r['T']}x{r['H']}x{r['E']}", r["kernel"], r["bytes"] / 1e6,
                      r["ffi_gbps"], 100 * r["ffi_gbps"] / r["copy_gbps"], r["xla_gbps"],
                      r["xla_s"] / r["ffi_s"], r.get("torch_gbps", "-"),
                      r["torch_s"] / r["ffi_s"] if "torch_s" in r else "-",
                      f"{r['check_ffi_vs_xla']:.1e}",
                      f"{r['check_torch_vs_ffi']:.1e}" if "check_torch_vs_ffi" in r else "-"])
    return common.print_table(
        f"jax_ep kernels: effective bandwidth (median of {a.iters}); vs = speedup of ffi; "
        f"torch: {torch_note}", cols, table)


def main(argv=None):
    a = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
    if a.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        a.iters, a.warmup = min(a.iters, 3), 1
    try:
        import jax
    except Exception as err:  # noqa: BLE001
        print(f"bench_gpu: jax is not importable ({err}); nothing to measure")
        return 0
    if not a.dry_run and jax.default_backend() != "gpu":
        print(f"bench_gpu: no GPU (JAX backend is {jax.default_backend()!r}); skipping. Use "
              "--dry-run to exercise the code on CPU.")
        return 0
    import jax_ep
    if not a.dry_run and not jax_ep.WITH_CUDA:
        print("bench_gpu: jax_ep was built without CUDA handlers (WITH_CUDA is False); "
              "rebuild with JAX_EP_CUDA=ON")
        return 1
    if a.iters < 20 and not a.dry_run:
        print("bench_gpu: --iters below 20 raised to 20")
        a.iters = 20
    shape_spec = a.shapes if a.shapes is not None else (DRY_SHAPES if a.dry_run
                                                         else DEFAULT_SHAPES)
    shapes = [tuple(int(v) for v in s.split("x")) for s in filter(None, shape_spec.split(","))]
    if a.dry_run:
        a.topk, a.ranks = min(a.topk, 4), min(a.ranks, 4)
    tk = load_torch(a.dry_run, a.no_torch)
    torch_note = tk[1] if tk[0] is None else f"torch {tk[0].__version__} on {tk[1]}"
    print(f"bench_gpu: jax {jax.__version__} on {jax.devices()[0].device_kind}, jax_ep CUDA "
          f"handlers {jax_ep.WITH_CUDA}, torch: {torch_note}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = "bench_gpu_dry" if a.dry_run else "bench_gpu"
    json_path = os.path.join(a.out, f"{name}.json")
    t_start = time.perf_counter()
    gmm_shapes = a.gmm_shapes if a.gmm_shapes is not None else (
        DRY_GMM_SHAPES if a.dry_run else DEFAULT_GMM_SHAPES)
    gmm_rows = []
    for s in filter(None, gmm_shapes.split(",")):
        gmm_rows += bench_grouped_matmul(*(int(v) for v in s.split("x")), a)
        gc.collect()
    rows, skipped = [], []
    for T, H, E in shapes:
        if time.perf_counter() - t_start > a.budget_s:
            skipped.append(f"{T}x{H}x{E}")
            print(f"  budget of {a.budget_s:.0f} s spent: shape {T}x{H}x{E} skipped")
            continue
        if H % 128 or E % a.ranks:
            raise SystemExit(f"shape {T}x{H}x{E}: H must be a multiple of 128 and E of P")
        rows += bench_shape(T, H, E, a, tk)
        common.write_json(json_path, dict(config=vars(a), torch=torch_note, rows=rows,
                                          grouped_matmul=gmm_rows, skipped=skipped,
                                          elapsed_s=time.perf_counter() - t_start))
        gc.collect()
    common.write_json(json_path, dict(config=vars(a), torch=torch_note, rows=rows,
                                      grouped_matmul=gmm_rows, skipped=skipped,
                                      elapsed_s=time.perf_counter() - t_start))
    if not rows and not gmm_rows:
        print("bench_gpu: no shape measured")
        return 1
    md = _report(rows, a, torch_note) if rows else ""
    gmm_png = png = None
    if gmm_rows:
        gmm_md, gmm_labels, gmm_series = _gmm_report(gmm_rows, a)
        md += "\n" + gmm_md
        gmm_png = common.bar_plot(os.path.join(a.out, f"{name}_gmm.png"), gmm_labels,
                                  gmm_series, ylabel="TFLOP/s",
                                  title=f"grouped GEMM on {jax.devices()[0].device_kind}: "
                                        "tiled, blocks vs ragged_dot (bf16)")
    with open(os.path.join(a.out, f"{name}.md"), "w") as f:
        f.write(md)
    if rows:
        labels = [f"{r['kernel']} {r['T']}x{r['H']}x{r['E']}" for r in rows]
        series = {impl: [r.get(f"{impl}_gbps") for r in rows]
                  for impl in ("ffi", "xla", "torch", "copy")}
        if all(v is None for v in series["torch"]):
            del series["torch"]
        png = common.bar_plot(os.path.join(a.out, f"{name}.png"), labels, series,
                              ylabel="effective GB/s", title=f"jax_ep kernels on "
                              f"{jax.devices()[0].device_kind} (bf16, K={a.topk}, P={a.ranks})")
    print(f"bench_gpu: {len(rows)} rows in {time.perf_counter() - t_start:.0f} s; wrote "
          f"{json_path}, {name}.md" + (f", {name}.png" if png else "")
          + (f", {name}_gmm.png" if gmm_png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

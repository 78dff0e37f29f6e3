"""Shared helpers of the jax_ep benchmarks: emulated CPU devices, the expert-parallel problem
options and routings, timing, tables, JSON, plots.

jax is imported inside the functions, so a benchmark can call `force_cpu_devices` before its
first `import jax`. rich and matplotlib are optional (the GPU machine may lack them): tables
fall back to plain text and plots are skipped with a message.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import statistics
import time

__all__ = ["keep_host_heap", "force_cpu_devices", "cpu_mesh", "add_ep_args", "make_routing",
           "time_fn", "time_round_robin", "print_table",
           "write_json", "env_info", "bar_plot", "line_plot", "fmt_bytes"]


# glibc mallopt parameters (malloc.h) and the values keep_host_heap sets
_HEAP_SETTINGS = {"M_ARENA_MAX": (-8, 1), "M_TRIM_THRESHOLD": (-1, 2**31 - 1),
                  "M_MMAP_MAX": (-4, 0)}
_host_heap = "glibc defaults"  # what keep_host_heap set; env_info reports it


def keep_host_heap(enabled: bool = True) -> str:
    """Makes glibc malloc keep freed memory mapped: one arena, no heap trimming and no mmap
    per large buffer, so each jitted call's output buffers land in pages already mapped (the
    process keeps its peak memory). Call it once, before the benchmark allocates its arrays
    and before jax starts its threads. Returns what the benchmark runs with.

    Why: with glibc's defaults, whether a call's output buffers were just unmapped depends
    on where the buffers before them happened to sit in the heap. Here a lone FFI call
    (indices_to_multihot, T=4096) took 26-125 minor page faults per call, varying from process
    to process, 0.10-0.49 ms, while the reference next to it took none; the same-bytes copy
    baseline next to permute took 18.6k faults per call. Every candidate (FFI, reference,
    copy) runs under the same allocator settings, so the ratios compare kernels, not the
    kernel's page zeroing. `enabled=False` (the benchmarks' --glibc-heap-defaults) changes
    nothing."""
    global _host_heap
    if not enabled:
        return _host_heap
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no libc to load (TypeError: Windows)
        _host_heap = "platform default (no glibc mallopt)"
        return _host_heap
    refused = [name for name, (param, value) in _HEAP_SETTINGS.items()
               if mallopt(param, value) != 1]
    kept = ", ".join(f"{name}={value}" for name, (_, value) in _HEAP_SETTINGS.items()
                     if name not in refused)
    _host_heap = f"glibc heap kept ({kept})" + (f"; refused: {', '.join(refused)}"
                                                if refused else "")
    return _host_heap


def force_cpu_devices(count: int = 8) -> None:
    """Make XLA:CPU expose `count` devices; call before jax is imported."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cpu_mesh(shape=(8,), axes=("ep",)):
    """A jax Mesh over the first prod(shape) devices (emulated CPU devices by default)."""
    import math

    import jax
    n = math.prod(shape)
    if len(jax.devices()) < n:
        raise RuntimeError(f"need {n} devices, have {len(jax.devices())}: call "
                           "force_cpu_devices() before importing jax")
    return jax.make_mesh(tuple(shape), tuple(axes), devices=jax.devices()[:n])


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag when it is not)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (argparse names the flag when it is not)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite float > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def comma_list(item=str, choices=None):
    """argparse type of a comma-separated list ('' gives []): each entry converted by `item`
    (itself an argparse type) and, with `choices`, one of them."""
    def parse(text: str) -> list:
        values = [item(v.strip()) for v in text.split(",") if v.strip()]
        wrong = [v for v in values if choices is not None and v not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"unknown {wrong}, expected some of "
                                             f"{list(choices)}")
        return values
    parse.__name__ = f"comma-separated {getattr(item, '__name__', 'value')}"
    return parse


def check_ep_args(p, a) -> None:
    """argparse errors (p.error) for add_ep_args' options that do not fit together: K above E,
    E not a multiple of P."""
    if a.topk > a.experts:
        p.error(f"--topk: expected at most --experts {a.experts}, got {a.topk}")
    if a.experts % a.ranks:
        p.error(f"--experts: expected a multiple of --ranks {a.ranks}, got {a.experts}")


def add_ep_args(p) -> None:
    """Adds to argparse parser p the options bench_dispatch and bench_internode share: the
    problem (T per rank, H, E, K, P ranks, dtype, Zipf exponent of the skewed routing), the
    timing (iters, warmup), the seed, the output folder and the host-heap switch."""
    p.add_argument("--tokens", type=positive_int, default=256, help="tokens per rank (T)")
    p.add_argument("--glibc-heap-defaults", action="store_true",
                   help="leave glibc malloc as it is (default: keep freed host memory mapped, "
                        "see common.keep_host_heap)")
    p.add_argument("--hidden", type=positive_int, default=512,
                   help="hidden size H (multiple of 128)")
    p.add_argument("--experts", type=positive_int, default=256, help="global experts E")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token K")
    p.add_argument("--ranks", type=positive_int, default=8,
                   help="expert-parallel ranks P (CPU devices)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the skewed routing")
    p.add_argument("--iters", type=positive_int, default=7)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out")


def make_routing(rng, num_tokens, top_k, num_experts, kind, zipf=1.0):
    """(topk_idx i32[N,K] distinct experts per token, topk_weights f32[N,K] summing to 1).
    uniform: every expert equally likely; skewed: popularity of expert e ~ 1/(e+1)^zipf, so
    the hottest experts sit on rank 0. Gumbel top-k = sampling K experts without replacement."""
    import numpy as np
    logp = np.zeros(num_experts)
    if kind == "skewed":
        logp = -zipf * np.log(np.arange(1, num_experts + 1))
    elif kind != "uniform":
        raise ValueError(f"routing: expected uniform or skewed, got {kind!r}")
    scores = logp[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    idx = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    w = rng.uniform(0.1, 1.0, idx.shape)
    return idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


# What jax.monitoring reports once per executable a jit builds (fun_name="jit(<name>)").
def time_fn(fn, *args, warmup: int = 2, iters: int = 10, jit: bool = True,
            keep_output: bool = False):
    """Median wall time of fn(*args) in seconds (jitted unless jit=False), after `warmup`
    calls (the first compiles); every call is closed by jax.block_until_ready. Returns
    {"median_s", "min_s", "max_s", "iters", "compile_s"} (compile_s: the first call,
    compilation included), or (that dict, the last output) with keep_output=True."""
    import jax
    f = jax.jit(fn) if jit else fn
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        out = jax.block_until_ready(f(*args))
    times = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    stats = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
             "iters": len(times), "compile_s": compile_s}
    return (stats, out) if keep_output else stats


def time_round_robin(calls: dict, *, warmup: int = 2, iters: int = 10):
    """Times several candidates one call of each per round, so a slow stretch of a shared
    machine weighs on all alike. calls: name -> (fn, args, context) with fn jitted and
    context a callable returning the context manager each call runs under (e.g. a mesh).
    Returns name -> (time_fn's stats dict, the last output)."""
    import jax

    def call(name):
        fn, args, context = calls[name]
        with context():
            return jax.block_until_ready(fn(*args))

    stats, outs = {}, {}
    for name in calls:  # compile (and warm) each candidate before any timed round
        t0 = time.perf_counter()
        outs[name] = call(name)
        stats[name] = {"compile_s": time.perf_counter() - t0}
        for _ in range(max(0, warmup - 1)):
            call(name)
    times = {name: [] for name in calls}
    for _ in range(max(1, iters)):
        for name in calls:
            t0 = time.perf_counter()
            outs[name] = call(name)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        stats[name].update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts),
                           iters=len(ts))
    return {name: (stats[name], outs[name]) for name in calls}


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def print_table(title: str, columns, rows) -> str:
    """Prints a table (rich when installed, plain text otherwise) and returns it as Markdown
    (for RESULTS.md). Floats are shown with 3 significant digits."""
    cells = [[_cell(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(title=title)
        for c in columns:
            table.add_column(str(c), justify="left" if c == columns[0] else "right")
        for row in cells:
            table.add_row(*row)
        Console(width=max(100, sum(len(str(c)) + 5 for c in columns))).print(table)
    except ImportError:
        widths = [max(len(str(c)), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(str(c).rjust(w) for c, w in zip(columns, widths)))
        for row in cells:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    md = [f"**{title}**", "", "| " + " | ".join(map(str, columns)) + " |",
          "|" + "|".join(" --- " for _ in columns) + "|"]
    md += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(md) + "\n"


def env_info() -> dict:
    """Where and when a benchmark ran."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "host_heap": _host_heap}
    try:
        import jax
        info.update(jax=jax.__version__, backend=jax.default_backend(),
                    devices=[str(d) for d in jax.devices()][:16],
                    device_kind=jax.devices()[0].device_kind)
    except Exception as err:  # noqa: BLE001 - informational only
        info["jax_error"] = repr(err)
    return info


def write_json(path: str, payload: dict) -> str:
    """Writes payload plus env_info() under "env" to path (folders created); returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": env_info(), **payload}, f, indent=2, default=str)
    return path


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib not installed: plot skipped")
        return None


def bar_plot(path: str, labels, series: dict, *, ylabel: str, title: str, log: bool = False):
    """Grouped bars: one group per label, one bar per series {name: [value per label]}.
    Returns path, or None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    n = len(series)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.4 * len(labels) * max(n, 1) + 3), 4.5))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [float("nan") if v is None else v for v in values], width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    if n > 1:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(path: str, xs, series: dict, *, xlabel: str, ylabel: str, title: str,
              logx: bool = False, styles: dict | None = None):
    """One line per series {name: [y per x]}; styles {name: matplotlib line kwargs} (color,
    linestyle, ...). Returns path, or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name, **(styles or {}).get(name, {}))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"

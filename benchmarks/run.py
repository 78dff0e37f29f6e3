"""Runs the CPU benchmarks one after the other with their defaults and merges their JSON.

    python -m benchmarks.run [--out benchmarks/out] [--only bench_dispatch,bench_moe]

Each benchmark runs in its own process (so its XLA_FLAGS device count takes effect before jax
starts) with its defaults: bench_ops, bench_ops_sweep (`bench_ops --sweep`), bench_dispatch,
bench_gemm, bench_moe, each as `python -m benchmarks.<module> [args]` (plus `--out OUT` when
OUT is not the default).
A benchmark that fails is recorded and the others still run. Every *.json a
benchmark wrote under OUT during the run is merged into OUT/results.json, keyed by file name.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

# name -> (module under benchmarks/, extra arguments)
BENCHMARKS = {"bench_ops": ("bench_ops", []), "bench_ops_sweep": ("bench_ops", ["--sweep"]),
              "bench_dispatch": ("bench_dispatch", []), "bench_gemm": ("bench_gemm", []),
              "bench_moe": ("bench_moe", [])}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.path.join("benchmarks", "out")
    p.add_argument("--out", default=default_out)
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help=f"comma list of the benchmarks to run, of {', '.join(BENCHMARKS)}")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        p.error(f"--only: expected some of {list(BENCHMARKS)}, got {unknown or a.only!r}")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split()
         if not f.startswith("--xla_force_host_platform_device_count")]
        + ["--xla_force_host_platform_device_count=8"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [v for v in [env.get("PYTHONPATH")] if v])
    runs = {}
    for name in names:
        module, extra = BENCHMARKS[name]
        print(f"== {name}", flush=True)
        before = {f: os.path.getmtime(f) for f in glob.glob(os.path.join(out, "*.json"))}
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", f"benchmarks.{module}", *extra]
        if out != os.path.join(ROOT, default_out):
            cmd += ["--out", out]
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
        wrote = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, "*.json"))
                       if os.path.getmtime(f) != before.get(f)
                       and os.path.basename(f) != "results.json")
        runs[name] = {"status": "ok" if proc.returncode == 0 else "failed",
                      "returncode": proc.returncode,
                      "seconds": round(time.perf_counter() - t0, 1), "json": wrote}
        print(f"== {name}: rc={proc.returncode} in {runs[name]['seconds']} s, wrote {wrote}",
              flush=True)
    combined = {"runs": runs, "results": {}}
    for info in runs.values():
        for fname in info.get("json", []):
            with open(os.path.join(out, fname)) as f:
                combined["results"][fname[:-len(".json")]] = json.load(f)
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:
        json.dump(combined, f, indent=2)
    print(f"wrote {path}: {', '.join(combined['results']) or 'no results'}")
    return 0 if all(r["status"] == "ok" for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

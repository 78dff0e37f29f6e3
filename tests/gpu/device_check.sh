#!/usr/bin/env bash
# Device check of the CUDA handlers, for a lent GPU machine (no network; Python, JAX with CUDA,
# nvcc, CMake, ninja, scikit-build-core and nanobind already installed there).
#
#   bash tests/gpu/device_check.sh            # from anywhere; OUT defaults to ./out
#
# Steps, each under its own timeout and all within DEADLINE (480 s; steps 1-3 typically took 3
# to 4 minutes, so 3b and 3c get what is left, in that order):
#   1. pip install -e . with JAX_EP_CUDA=ON, sm_90 only          -> $OUT/build.log
#   2. pytest: the layer-1 handlers (contract, ops: every target of xla_ffi/targets.h), then the
#      EP modes, transport="auto" (ragged on the GPU), grouped_matmul tiled / blocks vs
#      ragged_dot and the MoE layer, then a few op tests with XLA's minimum CUDA-graph size at
#      1, so the handlers marked graph-compatible (all but unpermute) run inside graphs
#                                                                 -> $OUT/pytest_gpu.log
#   3. benchmarks/bench_gpu.py --out $OUT: grouped GEMM tiled / blocks vs ragged_dot, then the
#      kernels' bandwidth; the figures for benchmarks/RESULTS.md  -> $OUT/bench_gpu.log, and
#      $OUT/bench_gpu.{json,md,png}, $OUT/bench_gpu_gmm.png (a missing figure fails the step)
#   3b. benchmarks/bench_moe.py on the GPU: the MoE layer's training step (T = 8192, H = F =
#      1024, K = 8, bf16) at E = 8 and 256, deepep / bounded / hybridep vs the GShard baseline,
#      step time and XLA's memory analysis                       -> appended to bench_gpu.log
#   3c. the grouped GEMM again with XLA's cuDNN ragged-dot fusion on (does ragged_dot stop
#      expanding to a dense dot over every group?)                -> appended to bench_gpu.log
#   4. opt-in (SANITIZE=1): a small GPU test subset under compute-sanitizer memcheck
#                                                                 -> $OUT/sanitizer.log
# Prints a short summary; exits non-zero if the build or any test step failed. $OUT ends with at
# most 8 files (what the device tool brings back).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 ))s; }
# Every step runs under `limit SECONDS cmd...`: at most SECONDS, and never past DEADLINE
# seconds from the start (a step with under 10 s left is skipped, rc 124). SIGINT first, so
# that pytest still prints its failures and summary; SIGKILL 15 s later for a process stuck in
# the driver.
DEADLINE="${DEADLINE:-480}"
limit() {
  local s=$1 left=$(( DEADLINE - ($(date +%s) - T0) )); shift
  [ "$left" -lt "$s" ] && s=$left
  [ "$s" -lt 10 ] && { echo "skipped (deadline): $*"; return 124; }
  timeout -s INT -k 15 "$s" "$@"
}

export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=cuda,cpu           # a CUDA start-up failure is an error, not a CPU fallback
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH" CUDACXX=/usr/local/cuda/bin/nvcc
fi

build_rc=0 import_rc=0 test_rc=0 bench_rc=skipped san_rc=skipped layer_rcs="" cudnn_rc=skipped

# 1. Build and install (editable) with the CUDA handlers for sm_90.
{
  echo "== $(date -u +%FT%TZ) $(uname -n)"
  limit 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  command -v nvcc && nvcc --version | tail -n 2
  limit 60 "$PY" -c "
import sys, sysconfig, os, jax, cmake, nanobind, scikit_build_core as s
inc = sysconfig.get_paths()['include']
print('python', sys.version.split()[0], sys.executable, 'Python.h', os.path.exists(inc + '/Python.h'))
print('jax', jax.__version__, 'cmake', cmake.__version__, 'nanobind', nanobind.__version__,
      'scikit-build-core', s.__version__)
print(jax.devices())"
  echo "== pip install"
} > "$OUT/build.log" 2>&1
JAX_EP_CUDA=ON limit 180 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 >> "$OUT/build.log" 2>&1 \
  || build_rc=$?
echo "[$(elapsed)] build rc=$build_rc"
if [ "$build_rc" = 0 ]; then
  limit 60 "$PY" -c "
import jax, jax_ep, jax_ep._ffi as f
from jax_ep import _jax_ep
assert jax.default_backend() == 'gpu', f'JAX runs on {jax.default_backend()}, not the GPU'
assert f.WITH_CUDA, 'built without CUDA handlers'
print('jax_ep CUDA targets:', sorted(_jax_ep.registrations()['CUDA']))
" >> "$OUT/build.log" 2>&1 || import_rc=$?
  echo "[$(elapsed)] import rc=$import_rc"
fi

# 2. The GPU tests, one pytest process per group (a crash or timeout in one group leaves the
#    others' results), the layer-1 handlers first. pytest rc 5 means nothing ran (all skipped).
PYTEST=(-m pytest -o addopts= -q -rfEsx -p no:cacheprovider -o faulthandler_timeout=60
        --durations=8)
SUMMARY_RE='^===== [a-z-]+$|^(FAILED|ERROR) |^[0-9]+ (passed|failed|errors?|skipped|deselected)'
run_group() {  # run_group NAME SECONDS [pytest args...]
  local name=$1 secs=$2 rc=0 start; shift 2
  start=$(wc -l < "$OUT/pytest_gpu.log")
  echo "===== $name" >> "$OUT/pytest_gpu.log"
  limit "$secs" "$PY" "${PYTEST[@]}" "$@" >> "$OUT/pytest_gpu.log" 2>&1 || rc=$?
  echo "[$(elapsed)] pytest $name rc=$rc: $(tail -n +$((start + 1)) "$OUT/pytest_gpu.log" \
    | grep -E '^[0-9]+ (passed|failed|errors?|skipped)' | tail -n 1)"
  [ "$rc" = 0 ] || test_rc=$rc
}
: > "$OUT/pytest_gpu.log"
if [ "$build_rc" = 0 ] && [ "$import_rc" = 0 ]; then
  run_group ops 150 tests/gpu/test_cuda_contract.py tests/gpu/test_cuda_ops.py
  run_group modes 120 tests/gpu/test_cuda_modes.py
  XLA_FLAGS="--xla_gpu_graph_min_graph_size=1" run_group cuda-graphs 45 \
    tests/gpu/test_cuda_ops.py -k "spec_send or (test_permute_cases and drop) or unpermute_deterministic or fp8_cast_back or logfmt"
else
  echo "build failed: tests not run" >> "$OUT/pytest_gpu.log"
  test_rc=1
fi

# 3. The benchmark.
if [ "$build_rc" = 0 ] && [ "$import_rc" = 0 ]; then
  bench_rc=0
  limit 120 "$PY" benchmarks/bench_gpu.py --out "$OUT" --budget-s 85 > "$OUT/bench_gpu.log" 2>&1 \
    || bench_rc=$?
  for figure in bench_gpu.md bench_gpu.png bench_gpu_gmm.png; do
    if [ ! -s "$OUT/$figure" ]; then
      echo "figure missing: $OUT/$figure"
      [ "$bench_rc" = 0 ] && bench_rc=1
    fi
  done
  echo "[$(elapsed)] bench rc=$bench_rc"
fi

# 3b. The MoE layer's step on the GPU, one process per E (a failed E leaves the other's table).
#     Its files go to a scratch folder: $OUT keeps at most 8 files; the tables go to the log.
if [ "$build_rc" = 0 ] && [ "$import_rc" = 0 ]; then
  for experts in 8 256; do
    layer_rc=0
    echo "== bench_moe E=$experts" >> "$OUT/bench_gpu.log"
    limit 75 "$PY" benchmarks/bench_moe.py --data 1 --expert-parallel 1 --tokens 8192 \
      --hidden 1024 --ffn 1024 --experts "$experts" --topk 8 --dtype bfloat16 \
      --backends deepep,deepep@bounded,hybridep,gshard --no-experts-only --iters 10 \
      --warmup 2 --out "$(mktemp -d)" >> "$OUT/bench_gpu.log" 2>&1 || layer_rc=$?
    echo "[$(elapsed)] bench_moe E=$experts rc=$layer_rc"
    layer_rcs="$layer_rcs E=$experts:$layer_rc"
  done
fi

# 3c. XLA:GPU expands ragged_dot to a dense dot over every group (G times the work), unless its
#     cuDNN ragged-dot fusion is on (a process-wide flag, so a process of its own; an XLA
#     without the flag fails this step only).
if [ "$build_rc" = 0 ] && [ "$import_rc" = 0 ]; then
  echo "== bench_gpu grouped GEMM, --xla_gpu_experimental_use_ragged_dot_fusion=true" \
    >> "$OUT/bench_gpu.log"
  cudnn_rc=0
  XLA_FLAGS="--xla_gpu_experimental_use_ragged_dot_fusion=true" limit 60 "$PY" \
    benchmarks/bench_gpu.py --shapes '' --iters 20 --out "$(mktemp -d)" \
    >> "$OUT/bench_gpu.log" 2>&1 || cudnn_rc=$?
  echo "[$(elapsed)] grouped GEMM with the cuDNN fusion rc=$cudnn_rc"
fi

# 4. Opt-in memory check of the handlers (one allocation per buffer so that an out-of-bounds
#    access cannot hide inside XLA's memory pool). Needs the Firecracker runtime (KINDS.md).
if [ "${SANITIZE:-0}" = 1 ] && [ "$build_rc" = 0 ] && command -v compute-sanitizer > /dev/null; then
  san_rc=0
  XLA_PYTHON_CLIENT_ALLOCATOR=platform limit 90 compute-sanitizer --tool memcheck \
    --error-exitcode 86 "$PY" "${PYTEST[@]}" tests/gpu/test_cuda_ops.py -x \
    -k "invalid or edge_cases or spec_send or (test_permute_cases and drop_and_pad)" \
    > "$OUT/sanitizer.log" 2>&1 || san_rc=$?
  echo "[$(elapsed)] compute-sanitizer rc=$san_rc"
fi

echo "== summary ($(elapsed))"
echo "build:   rc=$build_rc (import rc=$import_rc)  $OUT/build.log"
echo "pytest:  rc=$test_rc"
grep -E "$SUMMARY_RE" "$OUT/pytest_gpu.log" | head -n 60
echo "bench:   rc=$bench_rc"
[ -f "$OUT/bench_gpu.log" ] && tail -n 15 "$OUT/bench_gpu.log"
ls -l "$OUT"/bench_gpu*.md "$OUT"/bench_gpu*.png 2> /dev/null
echo "layer (bench_moe) rc:${layer_rcs:- skipped}  cuDNN ragged-dot GEMM rc=$cudnn_rc (124: out of time)"
echo "sanitizer: rc=$san_rc"
[ -f "$OUT/sanitizer.log" ] && grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/sanitizer.log" | tail -n 5
[ "$build_rc" = 0 ] && [ "$import_rc" = 0 ] && [ "$test_rc" = 0 ]

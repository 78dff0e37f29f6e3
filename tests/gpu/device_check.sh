#!/usr/bin/env bash
# Device check of the CUDA handlers, for a lent GPU machine (no network; Python, JAX with CUDA,
# nvcc, CMake, ninja, scikit-build-core and nanobind already installed there).
#
#   bash tests/gpu/device_check.sh            # from anywhere; OUT defaults to ./out
#
# Steps, each under its own timeout (worst case about 7.5 minutes, typically 3 to 4):
#   1. pip install -e . with JAX_EP_CUDA=ON, sm_90 only        -> $OUT/build.log
#   2. python -m pytest tests/gpu -q                            -> $OUT/pytest_gpu.log
#   3. benchmarks/bench_gpu.py --out $OUT, if that file exists  -> $OUT/bench_gpu.log
#   4. opt-in (SANITIZE=1): a small GPU test subset under compute-sanitizer memcheck
#                                                               -> $OUT/sanitizer.log
# Prints a short summary; exits non-zero if the build or the tests failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 ))s; }

build_rc=0 import_rc=0 test_rc=0 bench_rc=skipped san_rc=skipped

# 1. Build and install (editable) with the CUDA handlers for sm_90.
{
  echo "== $(date -u +%FT%TZ) $(uname -n)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 2 || true
  "$PY" -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" || true
  echo "== pip install"
} > "$OUT/build.log" 2>&1
JAX_EP_CUDA=ON timeout 180 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 >> "$OUT/build.log" 2>&1 \
  || build_rc=$?
echo "[$(elapsed)] build rc=$build_rc"
if [ "$build_rc" = 0 ]; then
  timeout 60 "$PY" -c "
import jax_ep, jax_ep._ffi as f
from jax_ep import _jax_ep
assert f.WITH_CUDA, 'built without CUDA handlers'
print('jax_ep CUDA targets:', sorted(_jax_ep.registrations()['CUDA']))
" >> "$OUT/build.log" 2>&1 || import_rc=$?
  echo "[$(elapsed)] import rc=$import_rc"
fi

# 2. The GPU tests.
if [ "$build_rc" = 0 ] && [ "$import_rc" = 0 ]; then
  timeout 150 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -rfEsx \
    > "$OUT/pytest_gpu.log" 2>&1 || test_rc=$?
else
  echo "build failed: tests not run" > "$OUT/pytest_gpu.log"
  test_rc=1
fi
echo "[$(elapsed)] pytest rc=$test_rc: $(tail -n 1 "$OUT/pytest_gpu.log")"

# 3. The benchmark (written separately), when present.
if [ -f benchmarks/bench_gpu.py ] && [ "$build_rc" = 0 ]; then
  bench_rc=0
  timeout 120 "$PY" benchmarks/bench_gpu.py --out "$OUT" > "$OUT/bench_gpu.log" 2>&1 \
    || bench_rc=$?
  echo "[$(elapsed)] bench rc=$bench_rc"
fi

# 4. Opt-in memory check of the handlers (one allocation per buffer so that an out-of-bounds
#    access cannot hide inside XLA's memory pool).
if [ "${SANITIZE:-0}" = 1 ] && [ "$build_rc" = 0 ] && command -v compute-sanitizer > /dev/null; then
  san_rc=0
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 120 compute-sanitizer --tool memcheck \
    --error-exitcode 86 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -x \
    -k "invalid or edge_cases or spec_send or (test_permute_cases and drop_and_pad)" \
    > "$OUT/sanitizer.log" 2>&1 || san_rc=$?
  echo "[$(elapsed)] compute-sanitizer rc=$san_rc"
fi

echo "== summary ($(elapsed))"
echo "build:   rc=$build_rc (import rc=$import_rc)  $OUT/build.log"
echo "pytest:  rc=$test_rc  $(grep -E '(passed|failed|error)' "$OUT/pytest_gpu.log" | tail -n 1 || true)"
grep -E '^(FAILED|ERROR|XFAIL)' "$OUT/pytest_gpu.log" | head -n 20 || true
echo "bench:   rc=$bench_rc"
[ -f "$OUT/bench_gpu.log" ] && tail -n 15 "$OUT/bench_gpu.log" || true
echo "sanitizer: rc=$san_rc"
[ -f "$OUT/sanitizer.log" ] && grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/sanitizer.log" | tail -n 5 || true
[ "$build_rc" = 0 ] && [ "$import_rc" = 0 ] && [ "$test_rc" = 0 ]

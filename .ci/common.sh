# Sourced by .ci/run and .ci/emulated-cuda: stage timing, the shared XLA compilation cache and
# the test-file lists of the stages.

# One persistent compilation cache for the run (XLA keys its entries by the program, the JAX
# and jaxlib versions and the flags, so the Python 3.12 stage's entries never mix with 3.11's).
# Every program is kept, however fast it compiled: the next stage or worker loads it.
export JAX_COMPILATION_CACHE_DIR="$PWD/.ci/cache/jax"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

# The layer-1 suites: the FFI ops against the reference, on every set of handlers.
LAYER1="tests/test_layout.py tests/test_permute.py tests/test_fp8.py tests/test_logfmt.py
  tests/test_ffi_contract.py"
# The Python 3.12 stage: the files whose code path differs by JAX version (see .ci/run).
PY312_FILES="tests/test_ffi_contract.py tests/test_cuda_emu.py tests/test_ragged_transport.py
  tests/test_compiled_program.py tests/test_internode.py tests/test_flax.py tests/test_training.py
  tests/test_buffer.py tests/test_checkpoint.py tests/test_peer_transport.py
  tests/test_expert_tensor_parallel.py::test_compiled_collectives_run_over_their_axes
  tests/test_expert_tensor_parallel.py::test_etp1_program_gathers_no_rows_and_scatters_nothing"

STAGES_LOG="$PWD/ci-stages.log"
[ -n "${CI_STAGES_STARTED:-}" ] || { : > "$STAGES_LOG"; export CI_STAGES_STARTED=1; }

stage_start() { STAGE_T0=$(date +%s); }
stage_end() {  # stage_end NAME: prints and logs the wall time since stage_start
  local line="stage $1: $(( $(date +%s) - STAGE_T0 )) s"
  echo "$line"
  echo "$line" >> "$STAGES_LOG"
}
stage_summary() {
  echo "== wall time per stage"
  cat "$STAGES_LOG"
  awk '{ total += $(NF - 1) } END { print "total: " total " s (" int(total / 60) " min)" }' \
    "$STAGES_LOG"
}

# Sourced by .ci/run and .ci/emulated-cuda: stage timing, the shared XLA compilation cache and
# the test-file lists of the stages.

# One persistent compilation cache for the run (XLA keys its entries by the program, the JAX
# and jaxlib versions and the flags, so the Python 3.12 stage's entries never mix with 3.11's).
# Every program is kept, however fast it compiled: the next stage or worker loads it.
export JAX_COMPILATION_CACHE_DIR="$PWD/.ci/cache/jax"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

# The layer-1 suites: the FFI ops against the reference, on every set of handlers; and the
# grouped GEMM's CPU handler (no CUDA twin: it runs under the emulated stage's routing too).
LAYER1="tests/test_layout.py tests/test_permute.py tests/test_fp8.py tests/test_logfmt.py
  tests/test_ffi_contract.py
  tests/test_grouped_matmul.py::test_ffi_handlers_against_a_float64_model
  tests/test_grouped_matmul.py::test_ffi_handler_refuses_mismatched_operands
  tests/test_grouped_matmul.py::test_ffi_grouped_matmul_runs_its_cpu_handler_under_emulated_cuda
  tests/test_grouped_matmul.py::test_ffi_swiglu_matches_the_tiled_grouped_swiglu"
# The Python 3.12 stage: the files whose code path differs by JAX version (see .ci/run).
PY312_FILES="tests/test_ffi_contract.py tests/test_cuda_emu.py tests/test_ragged_transport.py
  tests/test_compiled_program.py tests/test_internode.py tests/test_flax.py tests/test_training.py
  tests/test_buffer.py tests/test_checkpoint.py tests/test_peer_transport.py
  tests/test_remat_names.py tests/test_replicated_inputs.py tests/test_cpu_pool.py
  tests/test_grouped_matmul.py::test_grouped_matmul_inside_shard_map_with_replicated_weights
  tests/test_grouped_matmul.py::test_grouped_matmul_gradients_under_vmap_with_batched_group_sizes
  tests/test_grouped_matmul.py::test_swiglu_per_device_groups_in_shard_map_and_under_vmap
  tests/test_grouped_matmul.py::test_grouped_matmul_auto_on_cpu_and_argument_checks
  tests/test_expert_tensor_parallel.py::test_compiled_collectives_run_over_their_axes
  tests/test_expert_tensor_parallel.py::test_etp1_program_gathers_no_rows_and_scatters_nothing"

STAGES_LOG="$PWD/ci-stages.log"
if [ -z "${CI_STAGES_STARTED:-}" ]; then
  : > "$STAGES_LOG"
  export CI_STAGES_STARTED=1 CI_T0=$(date +%s)
fi

stage_start() { STAGE_T0=$(date +%s); }
stage_end() {  # stage_end NAME: prints and logs the wall time since stage_start
  local line="stage $1: $(( $(date +%s) - STAGE_T0 )) s"
  echo "$line"
  echo "$line" >> "$STAGES_LOG"
}
stage_summary() {  # the stages (background ones overlap others), then the run's wall time
  echo "== wall time per stage"
  cat "$STAGES_LOG"
  local total=$(( $(date +%s) - CI_T0 ))
  echo "total: $total s ($(( total / 60 )) min, wall clock from the first stage)"
}

# in_background NAME LOG COMMAND...: runs COMMAND (a program or a shell function) niced (the
# foreground stage keeps the cores it needs; the background one takes what they leave idle)
# as a stage named "NAME (background)", its output in LOG; its pid in BG_PID.
# finish_background PID LOG: waits for it, failing the run with the end of LOG if it failed.
in_background() {
  local name="$1" log="$2"
  shift 2
  ( renice -n 10 -p "$BASHPID" > /dev/null; stage_start; "$@" > "$log" 2>&1
    stage_end "$name (background)" ) > /dev/null &
  BG_PID=$!
}
finish_background() {
  wait "$1" || { echo "background stage failed (log: $2):"; tail -n 80 "$2"; exit 1; }
}

// The FFI targets with a CPU handler only, as targets.h lists the others: X(target name,
// handler symbol stem, ...); each .cc file defines <stem>Cpu. Their GPU side is XLA's own: the
// grouped GEMM is jax.lax.ragged_dot on GPUs. Only the CPU module (bindings.cc) registers
// them; jax_ep._ffi.call runs them with cuda_twin=False.
#pragma once

#define JAX_EP_CPU_ONLY_TARGETS(X, ...)                            \
  X("jax_ep_grouped_gemm", JaxEpGroupedGemm, __VA_ARGS__)          \
  X("jax_ep_grouped_gemm_dw", JaxEpGroupedGemmDw, __VA_ARGS__)

// The emulated CUDA runtime: what jax_ep's .cu files get for <cuda_runtime.h> when they are
// compiled as host C++ (the JAX_EP_CUDA_EMU build). It shadows the toolkit's header (this
// folder comes first on the include path); the toolkit's cuda_fp16.h / vector_types.h are still
// the real ones.
#pragma once

#include "cuda_emu/emulator.h"

// The FFI targets of jax_ep: X(target name, handler symbol stem). Each .cc / .cu file defines
// the symbols <stem>Cpu / <stem>Cuda with XLA_FFI_DEFINE_HANDLER_SYMBOL (extern "C").
#pragma once

#define JAX_EP_TARGETS(X)                                 \
  X("jax_ep_dispatch_layout", JaxEpDispatchLayout)        \
  X("jax_ep_send_layout", JaxEpSendLayout)                \
  X("jax_ep_indices_to_multihot", JaxEpIndicesToMultihot) \
  X("jax_ep_permute", JaxEpPermute)                       \
  X("jax_ep_gather_rows", JaxEpGatherRows)                \
  X("jax_ep_unpermute", JaxEpUnpermute)                   \
  X("jax_ep_cast_to_fp8", JaxEpCastToFp8)                 \
  X("jax_ep_cast_back", JaxEpCastBack)

// The FFI targets of jax_ep with a CPU and a CUDA handler (the CPU-only ones are in
// cpu_only_targets.h): X(target name, handler symbol stem, ...), the arguments after
// JAX_EP_TARGETS's first passed on to X (registrations.h passes a symbol suffix and a
// wrapper). Each .cc / .cu file defines the symbols <stem>Cpu / <stem>Cuda with
// XLA_FFI_DEFINE_HANDLER_SYMBOL (extern "C").
#pragma once

#define JAX_EP_TARGETS(X, ...)                                         \
  X("jax_ep_dispatch_layout", JaxEpDispatchLayout, __VA_ARGS__)        \
  X("jax_ep_send_layout", JaxEpSendLayout, __VA_ARGS__)                \
  X("jax_ep_indices_to_multihot", JaxEpIndicesToMultihot, __VA_ARGS__) \
  X("jax_ep_permute", JaxEpPermute, __VA_ARGS__)                       \
  X("jax_ep_gather_rows", JaxEpGatherRows, __VA_ARGS__)                \
  X("jax_ep_unpermute", JaxEpUnpermute, __VA_ARGS__)                   \
  X("jax_ep_cast_to_fp8", JaxEpCastToFp8, __VA_ARGS__)                 \
  X("jax_ep_cast_back", JaxEpCastBack, __VA_ARGS__)                    \
  X("jax_ep_logfmt_encode", JaxEpLogfmtEncode, __VA_ARGS__)            \
  X("jax_ep_logfmt_decode", JaxEpLogfmtDecode, __VA_ARGS__)            \
  X("jax_ep_peer_exchange", JaxEpPeerExchange, __VA_ARGS__)

// The targets among those whose handlers also have an FFI instantiate stage, which makes a
// state per instruction (peer_meeting.h's Site): X(target name, handler symbol stem, ...).
// Each such file also defines <stem>Instantiate<suffix> (the stage's handler) and
// <stem>State<suffix> (a jax_ep::FfiStateType, ffi_state.h).
#define JAX_EP_STATEFUL_TARGETS(X, ...) \
  X("jax_ep_peer_exchange", JaxEpPeerExchange, __VA_ARGS__)

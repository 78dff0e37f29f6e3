// The handlers of targets.h as nanobind registrations, for the modules jax_ep._jax_ep
// (bindings.cc) and jax_ep._jax_ep_cuda_emu (emu/bindings_emu.cc):
//
//   JAX_EP_DECLARE_HANDLERS(Cpu)                  extern "C" declarations of every <stem>Cpu;
//   JAX_EP_HANDLER_ROWS(Cuda, JAX_EP_AS_IS)       {target name, handler} rows, each handler
//                                                 <stem>Cuda passed through a wrapper macro;
//   JAX_EP_CPU_HANDLER_ROWS                       the CPU module's rows, CPU-only targets too;
//   jax_ep::TargetDict(rows, "_cuda_emu")         {target name + suffix: handler capsule}.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <string>

#include "cpu_only_targets.h"
#include "targets.h"
#include "xla/ffi/api/c_api.h"

#define JAX_EP_DECLARE_HANDLER(name, stem, suffix) extern "C" XLA_FFI_Handler stem##suffix;
#define JAX_EP_DECLARE_HANDLERS(suffix) JAX_EP_TARGETS(JAX_EP_DECLARE_HANDLER, suffix)

#define JAX_EP_HANDLER_ROW(name, stem, suffix, wrap) {name, wrap(stem##suffix)},
#define JAX_EP_HANDLER_ROWS(suffix, wrap) {JAX_EP_TARGETS(JAX_EP_HANDLER_ROW, suffix, wrap)}
// The CPU module's rows: JAX_EP_TARGETS' and the CPU-only ones (cpu_only_targets.h).
#define JAX_EP_CPU_HANDLER_ROWS                                 \
  {JAX_EP_TARGETS(JAX_EP_HANDLER_ROW, Cpu, JAX_EP_AS_IS)        \
       JAX_EP_CPU_ONLY_TARGETS(JAX_EP_HANDLER_ROW, Cpu, JAX_EP_AS_IS)}
// The wrapper of JAX_EP_HANDLER_ROWS that registers the handler symbol itself.
#define JAX_EP_AS_IS(handler) handler

namespace jax_ep {

// One registration: an FFI target name and its handler.
struct FfiTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};

// {name + name_suffix: capsule of the handler} for jax.ffi.register_ffi_target.
inline nanobind::dict TargetDict(std::initializer_list<FfiTarget> rows,
                                 const char* name_suffix = "") {
  nanobind::dict out;
  for (const FfiTarget& row : rows) {
    out[(std::string(row.name) + name_suffix).c_str()] =
        nanobind::capsule(reinterpret_cast<void*>(row.handler));
  }
  return out;
}

}  // namespace jax_ep

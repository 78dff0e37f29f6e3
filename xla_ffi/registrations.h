// The handlers of targets.h as nanobind registrations, for the modules jax_ep._jax_ep
// (bindings.cc) and jax_ep._jax_ep_cuda_emu (emu/bindings_emu.cc):
//
//   JAX_EP_DECLARE_HANDLERS(Cpu)                  extern "C" declarations of every <stem>Cpu;
//   JAX_EP_HANDLER_ROWS(Cuda, JAX_EP_AS_IS)       {target name, handler} rows, each handler
//                                                 <stem>Cuda passed through a wrapper macro;
//   JAX_EP_CPU_HANDLER_ROWS                       the CPU module's rows, CPU-only targets too;
//   JAX_EP_STATEFUL_ROWS(Cpu)                     {target name, instantiate handler, state
//                                                 type} rows of the stateful targets;
//   jax_ep::TargetDict(rows, stateful, "_cuda_emu")  {target name + suffix: handler capsule, or
//                                                 for a stateful target {"instantiate":
//                                                 capsule, "execute": capsule}};
//   jax_ep::StateTypeDict(stateful, "_cuda_emu")  {state type name: {"type_id": capsule,
//                                                 "type_info": capsule}}.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <string>

#include "cpu_only_targets.h"
#include "ffi_state.h"
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

#define JAX_EP_DECLARE_STATEFUL_ONE(name, stem, suffix)      \
  extern "C" XLA_FFI_Handler stem##Instantiate##suffix; \
  extern "C" const jax_ep::FfiStateType stem##State##suffix;
#define JAX_EP_DECLARE_STATEFUL(suffix) JAX_EP_STATEFUL_TARGETS(JAX_EP_DECLARE_STATEFUL_ONE, suffix)
#define JAX_EP_STATEFUL_ROW(name, stem, suffix) \
  {name, stem##Instantiate##suffix, &stem##State##suffix},
#define JAX_EP_STATEFUL_ROWS(suffix) {JAX_EP_STATEFUL_TARGETS(JAX_EP_STATEFUL_ROW, suffix)}

namespace jax_ep {

// One registration: an FFI target name and its handler.
struct FfiTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};

// A target whose handler has an instantiate stage, and the type of the state it makes.
struct FfiStatefulTarget {
  const char* name;
  XLA_FFI_Handler* instantiate;
  const FfiStateType* state;
};

inline nanobind::capsule Capsule(const void* pointer) {
  return nanobind::capsule(const_cast<void*>(pointer));
}

// {name + name_suffix: capsule of the handler, or {"instantiate": capsule, "execute":
// capsule} for a target of `stateful`} for jax.ffi.register_ffi_target.
inline nanobind::dict TargetDict(std::initializer_list<FfiTarget> rows,
                                 std::initializer_list<FfiStatefulTarget> stateful,
                                 const char* name_suffix = "") {
  nanobind::dict out;
  for (const FfiTarget& row : rows) {
    out[(std::string(row.name) + name_suffix).c_str()] =
        Capsule(reinterpret_cast<void*>(row.handler));
  }
  for (const FfiStatefulTarget& row : stateful) {
    const std::string name = std::string(row.name) + name_suffix;
    nanobind::dict bundle;
    bundle["instantiate"] = Capsule(reinterpret_cast<void*>(row.instantiate));
    bundle["execute"] = out[name.c_str()];
    out[name.c_str()] = bundle;
  }
  return out;
}

// {name + name_suffix + "_state": {"type_id": capsule, "type_info": capsule}} of the state
// types of `stateful`, for jax.ffi.register_ffi_type (before the targets: XLA refuses a
// handler whose state type it does not know).
inline nanobind::dict StateTypeDict(std::initializer_list<FfiStatefulTarget> stateful,
                                    const char* name_suffix) {
  nanobind::dict out;
  for (const FfiStatefulTarget& row : stateful) {
    nanobind::dict type;
    type["type_id"] = Capsule(row.state->type_id);
    type["type_info"] = Capsule(row.state->type_info);
    out[(std::string(row.name) + name_suffix + "_state").c_str()] = type;
  }
  return out;
}

}  // namespace jax_ep

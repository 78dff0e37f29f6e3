// A state type of an FFI handler with an instantiate stage: XLA's type id of the state (set
// when jax.ffi.register_ffi_type registers it) and its type info (the deleter XLA calls when
// the instruction's state goes). Exported by each handler file as <stem>State<suffix> and
// registered by registrations.h before the handler.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_ep {

struct FfiStateType {
  XLA_FFI_TypeId* type_id;
  const XLA_FFI_TypeInfo* type_info;
};

}  // namespace jax_ep

// CPU dtype dispatch: float32, bfloat16 (as raw bits) and float16 (_Float16) storage types
// with fp32 load/store, so each arithmetic handler is written once over a template type.
#pragma once

#include "common.h"

namespace jax_ep {

template <typename T>
struct Fp32Io;
template <>
struct Fp32Io<float> {
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
template <>
struct Fp32Io<uint16_t> {  // bfloat16 bits
  static float Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBf16(v); }
};
template <>
struct Fp32Io<_Float16> {
  static float Load(_Float16 v) { return float(v); }
  static _Float16 Store(float v) { return _Float16(v); }
};

// Calls fn(T{}) with the storage type of a float32 / bfloat16 / float16 buffer.
template <typename Fn>
inline ffi::Error DispatchFloat(ffi::DataType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::BF16:
      return fn(uint16_t{});
    case ffi::DataType::F16:
      return fn(_Float16{});
    default:
      return UnsupportedDtype(name, dtype);
  }
}

}  // namespace jax_ep

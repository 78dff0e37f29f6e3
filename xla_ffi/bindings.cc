// The nanobind module jax_ep._jax_ep: registrations() returns {platform: {target: capsule}}
// with the CPU handlers always and the CUDA handlers when the build found nvcc.
#include <nanobind/nanobind.h>

#include "targets.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#define JAX_EP_DECLARE(name, symbol) extern "C" XLA_FFI_Error* symbol##Cpu(XLA_FFI_CallFrame*);
JAX_EP_TARGETS(JAX_EP_DECLARE)
#ifdef JAX_EP_WITH_CUDA
#define JAX_EP_DECLARE_CUDA(name, symbol) \
  extern "C" XLA_FFI_Error* symbol##Cuda(XLA_FFI_CallFrame*);
JAX_EP_TARGETS(JAX_EP_DECLARE_CUDA)
#endif

namespace jax_ep {
const char* CpuFp8Loops();  // fp8.cc
}  // namespace jax_ep

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict cpu, cuda, out;
#define JAX_EP_ADD_CPU(name, symbol) cpu[name] = Capsule(symbol##Cpu);
  JAX_EP_TARGETS(JAX_EP_ADD_CPU)
#ifdef JAX_EP_WITH_CUDA
#define JAX_EP_ADD_CUDA(name, symbol) cuda[name] = Capsule(symbol##Cuda);
  JAX_EP_TARGETS(JAX_EP_ADD_CUDA)
#endif
  out["cpu"] = cpu;
  out["CUDA"] = cuda;
  return out;
}

}  // namespace

NB_MODULE(_jax_ep, m) {
  m.doc() = "jax_ep XLA FFI handlers (CPU and, when built, CUDA)";
  m.def("registrations", &Registrations,
        "{platform: {target name: FFI handler capsule}} for jax.ffi.register_ffi_target");
  m.def("cpu_fp8_loops", &jax_ep::CpuFp8Loops,
        "Which loops the CPU FP8 cast handlers run: 'avx512' or 'portable' (JAX_EP_CPU_SIMD=0)");
#ifdef JAX_EP_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

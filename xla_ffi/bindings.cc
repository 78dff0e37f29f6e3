// The nanobind module jax_ep._jax_ep: registrations() returns {platform: {target: capsule}}
// with the CPU handlers always and the CUDA handlers when the build found nvcc, and
// state_types() the state types of the targets with an instantiate stage.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "cpu_util.h"
#include "registrations.h"

namespace nb = nanobind;

JAX_EP_DECLARE_HANDLERS(Cpu)
JAX_EP_DECLARE_STATEFUL(Cpu)
JAX_EP_CPU_ONLY_TARGETS(JAX_EP_DECLARE_HANDLER, Cpu)
#ifdef JAX_EP_WITH_CUDA
JAX_EP_DECLARE_HANDLERS(Cuda)
JAX_EP_DECLARE_STATEFUL(Cuda)
#endif

namespace jax_ep {
const char* CpuFp8Loops();  // fp8.cc
#ifdef JAX_EP_WITH_CUDA
std::vector<std::pair<int, int>> PeerPairsWithoutAccess(
    const std::vector<int>& devices);  // peer.cu
#endif
}  // namespace jax_ep

namespace {

nb::dict Registrations() {
  nb::dict out;
  out["cpu"] = jax_ep::TargetDict(JAX_EP_CPU_HANDLER_ROWS, JAX_EP_STATEFUL_ROWS(Cpu));
#ifdef JAX_EP_WITH_CUDA
  out["CUDA"] =
      jax_ep::TargetDict(JAX_EP_HANDLER_ROWS(Cuda, JAX_EP_AS_IS), JAX_EP_STATEFUL_ROWS(Cuda));
#else
  out["CUDA"] = nb::dict();
#endif
  return out;
}

nb::dict StateTypes() {
  nb::dict out;
  out["cpu"] = jax_ep::StateTypeDict(JAX_EP_STATEFUL_ROWS(Cpu), "_cpu");
#ifdef JAX_EP_WITH_CUDA
  out["CUDA"] = jax_ep::StateTypeDict(JAX_EP_STATEFUL_ROWS(Cuda), "_cuda");
#else
  out["CUDA"] = nb::dict();
#endif
  return out;
}

constexpr const char* kPoolHelperModes[] = {"auto", "always", "never"};

void SetCpuPoolHelpers(const std::string& mode) {
  for (int i = 0; i < 3; ++i) {
    if (mode == kPoolHelperModes[i]) {
      jax_ep::PoolHelpers().mode.store(i);
      return;
    }
  }
  throw nb::value_error(("mode: expected 'auto', 'always' or 'never', got '" + mode + "'").c_str());
}

nb::dict CpuPoolStats() {
  const jax_ep::PoolHelperState& state = jax_ep::PoolHelpers();
  nb::dict out;
  out["mode"] = kPoolHelperModes[state.mode.load()];
  out["devices_seen"] = state.devices_seen.load();
  out["pool_threads"] = state.pool_threads.load();
  out["shared_calls"] = state.shared_calls.load();
  out["inline_calls"] = state.inline_calls.load();
  return out;
}

}  // namespace

NB_MODULE(_jax_ep, m) {
  m.doc() = "jax_ep XLA FFI handlers (CPU and, when built, CUDA)";
  m.def("registrations", &Registrations,
        "{platform: {target name: FFI handler capsule, or {stage: capsule} for a target with "
        "an instantiate stage}} for jax.ffi.register_ffi_target");
  m.def("state_types", &StateTypes,
        "{platform: {state type name: {'type_id': capsule, 'type_info': capsule}}} for "
        "jax.ffi.register_ffi_type, registered before the targets");
  m.def("set_cpu_pool_helpers", &SetCpuPoolHelpers, nb::arg("mode"),
        "How the CPU handlers' loops use XLA's intra-op pool: 'auto' (default: shared while "
        "the handlers have seen fewer devices than the pool has threads), 'always' or 'never'");
  m.def("cpu_pool_stats", &CpuPoolStats,
        "{'mode', 'devices_seen', 'pool_threads', 'shared_calls', 'inline_calls'}: the CPU "
        "handlers' pool use so far (calls: loops of several chunks)");
  m.def("cpu_fp8_loops", &jax_ep::CpuFp8Loops,
        "Which loops the CPU FP8 cast handlers run: 'avx512' or 'portable' (JAX_EP_CPU_SIMD=0)");
#ifdef JAX_EP_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("cuda_peer_pairs_without_access", &jax_ep::PeerPairsWithoutAccess, nb::arg("devices"),
        "[(a, b)]: the pairs a < b of these CUDA device ordinals that cannot read each "
        "other's memory (cudaDeviceCanAccessPeer); RuntimeError naming the call on a CUDA error");
#else
  m.attr("with_cuda") = false;
#endif
}

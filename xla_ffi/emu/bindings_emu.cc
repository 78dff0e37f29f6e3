// The nanobind module jax_ep._jax_ep_cuda_emu (the JAX_EP_CUDA_EMU build): the CUDA handlers of
// layout.cu, permute.cu and fp8.cu compiled as host C++ against the CUDA emulator, registered on
// the CPU platform as "<CUDA target name>_cuda_emu".
//
// The CPU platform has no CUDA stream and no device scratch memory, so each call runs the
// handler on a copy of its call frame whose XLA FFI API table has host stand-ins for exactly
// those entries: XLA_FFI_Stream_Get returns the emulator's stream, and
// XLA_FFI_DeviceMemory_Allocate / _Free allocate host memory with the rules of XLA's GPU scratch
// allocator (alignments above 16 bytes are refused with "Unsupported alignment", as
// xla/ffi/ffi_api.cc does). Everything else is the real API.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda_runtime.h"  // the emulator's
#include "registrations.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

JAX_EP_DECLARE_HANDLERS(Cuda)

namespace {

constexpr size_t kXlaMaxScratchAlignment = 16;

const XLA_FFI_Api* g_real_api = nullptr;
alignas(XLA_FFI_Api) unsigned char g_host_api[4096];

XLA_FFI_Error* MakeError(XLA_FFI_Error_Code code, const std::string& message,
                         const XLA_FFI_Api* api = g_real_api) {
  XLA_FFI_Error_Create_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message.c_str();
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

cudaStream_t HostStream() {
  static cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    cudaStreamCreate(&s);
    return s;
  }();
  return stream;
}

XLA_FFI_Error* HostStreamGet(XLA_FFI_Stream_Get_Args* args) {
  args->stream = HostStream();
  return nullptr;
}

XLA_FFI_Error* HostAllocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  const size_t a = args->alignment;
  if (a > kXlaMaxScratchAlignment || (a & (a - 1)) != 0) {
    return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "Unsupported alignment: " + std::to_string(a));
  }
  // Exactly `size` bytes, so AddressSanitizer reports any access past the request.
  void* p = nullptr;
  if (posix_memalign(&p, kXlaMaxScratchAlignment, args->size) != 0) {
    return MakeError(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                     "could not allocate " + std::to_string(args->size) + " bytes");
  }
  args->data = p;
  return nullptr;
}

XLA_FFI_Error* HostFree(XLA_FFI_DeviceMemory_Free_Args* args) {
  std::free(args->data);
  return nullptr;
}

// The real API table with the three host stand-ins (built once; XLA has one API table).
const XLA_FFI_Api* HostApi(const XLA_FFI_Api* real) {
  static std::once_flag once;
  std::call_once(once, [real] {
    g_real_api = real;
    std::memcpy(g_host_api, real, std::min(real->struct_size, sizeof(g_host_api)));
    auto* api = reinterpret_cast<XLA_FFI_Api*>(g_host_api);
    api->XLA_FFI_Stream_Get = HostStreamGet;
    api->XLA_FFI_DeviceMemory_Allocate = HostAllocate;
    api->XLA_FFI_DeviceMemory_Free = HostFree;
  });
  return real == g_real_api && real->struct_size <= sizeof(g_host_api)
             ? reinterpret_cast<const XLA_FFI_Api*>(g_host_api)
             : nullptr;
}

template <XLA_FFI_Error* (*Handler)(XLA_FFI_CallFrame*)>
XLA_FFI_Error* OnHost(XLA_FFI_CallFrame* frame) {
  alignas(XLA_FFI_CallFrame) unsigned char copy[1024];
  const XLA_FFI_Api* api = HostApi(frame->api);
  if (api == nullptr || frame->struct_size > sizeof(copy)) {
    return MakeError(XLA_FFI_Error_Code_INTERNAL,
                     "jax_ep CUDA emulator: unexpected XLA FFI API table or call frame size",
                     frame->api);
  }
  std::memcpy(copy, frame, frame->struct_size);
  auto* host_frame = reinterpret_cast<XLA_FFI_CallFrame*>(copy);
  host_frame->api = api;
  return Handler(host_frame);
}

// The wrapper of JAX_EP_HANDLER_ROWS that runs the CUDA handler on the host call frame.
#define JAX_EP_ON_HOST(handler) OnHost<handler>

nb::dict Registrations() {
  nb::dict out;
  out["cpu"] = jax_ep::TargetDict(JAX_EP_HANDLER_ROWS(Cuda, JAX_EP_ON_HOST), "_cuda_emu");
  return out;
}

nb::dict LaunchCounts(bool reset) {
  nb::dict out;
  for (const auto& [instance, launches] : cuda_emu::LaunchCounts(reset)) {
    out[instance.c_str()] = launches;
  }
  return out;
}

}  // namespace

NB_MODULE(_jax_ep_cuda_emu, m) {
  m.doc() = "jax_ep's CUDA handlers compiled for the CUDA emulator, on the CPU platform";
  m.def("registrations", &Registrations,
        "{'cpu': {'<CUDA target>_cuda_emu': FFI handler capsule}} for jax.ffi.register_ffi_target");
  m.def("launch_counts", &LaunchCounts, nb::arg("reset") = false,
        "{kernel instance: launches} the emulator ran since the start or the last reset; "
        "reset=True zeroes them after reading");
#if defined(__SANITIZE_ADDRESS__)
  m.attr("sanitized") = true;
#else
  m.attr("sanitized") = false;
#endif
}

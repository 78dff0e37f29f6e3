// The nanobind module jax_ep._jax_ep_cuda_emu (the JAX_EP_CUDA_EMU build): the CUDA handlers of
// layout.cu, permute.cu, fp8.cu and peer.cu compiled as host C++ against the CUDA emulator,
// registered on the CPU platform as "<CUDA target name>_cuda_emu".
//
// The CPU platform has no CUDA stream and no device scratch memory, so each call runs the
// handler on a copy of its call frame whose XLA FFI API table has host stand-ins for exactly
// those entries: XLA_FFI_Stream_Get returns the emulator's stream of the call's device, and
// XLA_FFI_DeviceMemory_Allocate / _Free allocate host memory with the rules of XLA's GPU scratch
// allocator (alignments above 16 bytes are refused with "Unsupported alignment", as
// xla/ffi/ffi_api.cc does). Everything else is the real API.
//
// Each call runs as XLA:GPU runs a device's call: on its host thread with the emulated device
// of the call's device ordinal current (cudaSetDevice), and with its operands and results
// claimed as that device's memory for the length of the call (cuda_emu::ClaimMemory), so that
// a kernel of another device reading them without peer access is refused.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime.h"  // the emulator's
#include "registrations.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_ep {
std::vector<std::pair<int, int>> PeerPairsWithoutAccess(
    const std::vector<int>& devices);  // peer.cu
}  // namespace jax_ep

JAX_EP_DECLARE_HANDLERS(Cuda)
JAX_EP_DECLARE_STATEFUL(Cuda)

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

// The stream of the current emulated device (one per device, made on first use).
cudaStream_t HostStream() {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaGetDeviceCount(&count);
  std::lock_guard<std::mutex> lock(mutex);
  streams.resize(size_t(count), nullptr);
  if (streams[size_t(device)] == nullptr) cudaStreamCreate(&streams[size_t(device)]);
  return streams[size_t(device)];
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

// The call's device ordinal (XLA:CPU's device id), or an error.
XLA_FFI_Error* DeviceOrdinal(const XLA_FFI_CallFrame* frame, int32_t* ordinal) {
  XLA_FFI_DeviceOrdinal_Get_Args args;
  std::memset(&args, 0, sizeof(args));
  args.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
  args.ctx = frame->ctx;
  if (XLA_FFI_Error* error = frame->api->XLA_FFI_DeviceOrdinal_Get(&args)) return error;
  int count = 0;
  cudaGetDeviceCount(&count);
  if (args.device_ordinal < 0 || args.device_ordinal >= count) {
    return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "jax_ep CUDA emulator: device ordinal " +
                         std::to_string(args.device_ordinal) + " outside the " +
                         std::to_string(count) + " emulated devices (JAX_EP_CUDA_EMU_DEVICES)",
                     frame->api);
  }
  *ordinal = args.device_ordinal;
  return nullptr;
}

// For the length of a call: its device current on this thread, and its operands and results
// claimed as that device's memory.
class OnDevice {
 public:
  OnDevice(int device, const XLA_FFI_CallFrame& frame) {
    cudaGetDevice(&previous_);
    cudaSetDevice(device);
    for (int64_t i = 0; i < frame.args.size; ++i) Claim(device, frame.args.args[i]);
    for (int64_t i = 0; i < frame.rets.size; ++i) Claim(device, frame.rets.rets[i]);
  }
  ~OnDevice() {
    for (uint64_t claim : claims_) cuda_emu::ReleaseMemory(claim);
    cudaSetDevice(previous_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  // Operands and results are XLA_FFI_Buffer (XLA_FFI_ArgType_BUFFER / _RetType_BUFFER: the
  // only kinds there are).
  void Claim(int device, const void* arg) {
    const auto* buffer = static_cast<const XLA_FFI_Buffer*>(arg);
    size_t bytes = xla::ffi::ByteWidth(static_cast<xla::ffi::DataType>(buffer->dtype));
    for (int64_t d = 0; d < buffer->rank; ++d) bytes *= size_t(buffer->dims[d]);
    if (bytes > 0) claims_.push_back(cuda_emu::ClaimMemory(device, buffer->data, bytes));
  }

  int previous_ = 0;
  std::vector<uint64_t> claims_;
};

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
  // XLA's metadata query at registration (an extension, no execution context) and the stages
  // before execution run no kernel.
  if (frame->extension_start != nullptr || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) {
    return Handler(host_frame);
  }
  int32_t device = 0;
  if (XLA_FFI_Error* error = DeviceOrdinal(frame, &device)) return error;
  OnDevice on_device(device, *frame);
  return Handler(host_frame);
}

// The wrapper of JAX_EP_HANDLER_ROWS that runs the CUDA handler on the host call frame.
#define JAX_EP_ON_HOST(handler) OnHost<handler>

nb::dict Registrations() {
  nb::dict out;
  out["cpu"] = jax_ep::TargetDict(JAX_EP_HANDLER_ROWS(Cuda, JAX_EP_ON_HOST),
                                  JAX_EP_STATEFUL_ROWS(Cuda), "_cuda_emu");
  return out;
}

nb::dict StateTypes() {
  nb::dict out;
  out["cpu"] = jax_ep::StateTypeDict(JAX_EP_STATEFUL_ROWS(Cuda), "_cuda_emu");
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
  m.def("state_types", &StateTypes,
        "{'cpu': {state type name: {'type_id': capsule, 'type_info': capsule}}} for "
        "jax.ffi.register_ffi_type, registered before the targets");
  m.def("peer_pairs_without_access", &jax_ep::PeerPairsWithoutAccess, nb::arg("devices"),
        "peer.cu's PeerPairsWithoutAccess on the emulated devices (the CUDA build's "
        "cuda_peer_pairs_without_access)");
  m.def("launch_counts", &LaunchCounts, nb::arg("reset") = false,
        "{kernel instance: launches} the emulator ran since the start or the last reset; "
        "reset=True zeroes them after reading");
#if defined(__SANITIZE_ADDRESS__)
  m.attr("sanitized") = true;
#else
  m.attr("sanitized") = false;
#endif
}

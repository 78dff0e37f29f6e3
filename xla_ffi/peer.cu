// The peer exchange, CUDA handler: the twin of peer.cc (same operands, attributes and results;
// bitwise-identical outputs for every call the CPU handler accepts) for the GPUs of one process,
// as XLA:GPU runs them: each device's call on its own host thread, with that device's stream.
// Its receivers read the senders' buffers over peer access (NVLink / PCIe), as DeepEP's
// intranode kernels do, but pull instead of push.
//
// On the host (no device synchronisation, no copy of counts or coords to the host):
//   1. check this device's shapes and attributes (peer_checks.h, as the CPU handler);
//      record this device's `ready` event on its stream (its operands are ready);
//   2. meeting 1 (peer_meeting.h): every device of the program (num_devices; the host cannot
//      tell ranks or groups apart, coords live on the device) publishes its operands' device
//      pointers, row counts, dtype and events;
//   3. enable peer access to every other participant (once per pair and process); the stream
//      waits on every participant's `ready` event; one kernel (below) fills out and
//      recv_counts; record this device's `done` event on the stream;
//   4. meeting 2: every device has enqueued its reads; the stream waits on every participant's
//      `done` event, so later work on this stream (which may free or overwrite this device's
//      operands) waits for every peer's kernel that reads them.
// The handler blocks on the host in both meetings, so it is not command-buffer compatible (a
// CUDA graph replay would skip the meetings).
//
// The kernel (PeerExchangeKernel, one launch): each block reads every participant's coords,
// finds the P senders of its own group (rank p, the participant with coords (p, group)), and
// reads each one's send_offsets[rank] / send_counts[rank] / dest_offsets[rank]; then a group of
// lanes per output row r copies the row of the receive layout it holds (layout row v = r, or
// v = recv_rows[r] with gather): src_p[row_map_p[j]] when v = dest_offsets_p[rank] + j (zero
// where the entry is outside [0, M_p)), a zero row where no sender writes v; block 0 writes
// recv_counts.
//
// Errors. Host-side checks (shapes, attributes, the senders' dtype and row width, at most
// kMaxPeerDevices devices) fail the call on every device with the CPU handler's messages. What
// the CPU handler finds in the values (coords outside the mesh, a rank missing from or
// duplicated in a group, a send block outside row_map, destination rows outside out,
// overlapping blocks) the CUDA handler does not report: reporting would need a device-to-host
// copy and a synchronisation per call. The kernel stays in bounds instead: with invalid coords
// this device receives nothing (out zero, recv_counts zero); a rank that no device or several
// devices of the group claim sends nothing; a block outside row_map or out is skipped (its
// recv_counts entry 0); where blocks overlap the lowest rank's row wins. Every checked-in
// caller (jax_ep/transport.py) builds its blocks from one plan, so none of these arise there.
#include "cuda_common.cuh"
#include "ffi_state.h"
#include "peer_checks.h"
#include "peer_meeting.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace jax_ep {
namespace {

struct CudaHandler {};
using CudaSite = peer::Site<CudaHandler>;

constexpr int kThreads = 256;
// The most devices one exchange holds: every participant's pointers travel in one kernel
// parameter (PeerTable, 2 KiB of CUDA's 4 KiB parameter space). One process drives at most 8
// or 16 GPUs.
constexpr int kMaxPeerDevices = 32;

// ----------------------------------------------------------------------------- kernel

// One participant's operands, as device pointers its peers read.
struct PeerOperands {
  const void* src;               // [M, ...], rows of the exchange's row width
  const int32_t* row_map;        // i32[S]
  const int32_t* send_offsets;   // i32[P]
  const int32_t* send_counts;    // i32[P]
  const int32_t* dest_offsets;   // i32[P]
  const int32_t* coords;         // i32[2]: rank, group
  int64_t src_rows;              // M
  int64_t row_map_rows;          // S
};

// Every participant of one exchange, in the meeting's order.
struct PeerTable {
  PeerOperands at[kMaxPeerDevices];
  int32_t size;
};

// What sender p sends this device: compact rows rows[0 .. count) land at out rows begin onward;
// count 0 when it sends nothing (or its block is out of bounds).
struct SenderBlock {
  const void* src;
  const int32_t* rows;
  int64_t src_rows;
  int64_t begin;
  int64_t count;
};

// Sender p of this device (participant `me`, coords (rank, group)), from every participant's
// coords[i][0..1].
__device__ SenderBlock FindSender(const PeerTable& table, const int32_t (*coords)[2], int me,
                                  int32_t p, int32_t P, int32_t groups, int64_t num_recv) {
  SenderBlock none{nullptr, nullptr, 0, 0, 0};
  const int32_t rank = coords[me][0], group = coords[me][1];
  if (rank < 0 || rank >= P || group < 0 || group >= groups) return none;
  int found = -1, matches = 0;
  for (int i = 0; i < table.size; ++i) {
    if (coords[i][0] == p && coords[i][1] == group) {
      found = i;
      ++matches;
    }
  }
  if (matches != 1) return none;
  const PeerOperands& s = table.at[found];
  const int64_t offset = *FromPeer(s.send_offsets + rank, 1);
  const int64_t count = *FromPeer(s.send_counts + rank, 1);
  const int64_t begin = *FromPeer(s.dest_offsets + rank, 1);
  if (offset < 0 || count < 0 || offset + count > s.row_map_rows || begin < 0 ||
      begin + count > num_recv) {
    return none;
  }
  return SenderBlock{s.src, s.row_map + offset, s.src_rows, begin, count};
}

// out [out_rows, nvec units of V] and recv_counts i32[P] of participant `me` (see the header
// comment): the receive layout of num_recv rows, or its rows recv_rows[0 .. out_rows) when
// recv_rows is not null. lanes_per_row is a power of two <= 32 dividing the block size.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    PeerExchangeKernel(PeerTable table, int me, int32_t P, int32_t groups, int64_t nvec,
                       V* __restrict__ out, int64_t out_rows, int64_t num_recv,
                       const int32_t* __restrict__ recv_rows, int32_t* __restrict__ recv_counts,
                       int lanes_per_row) {
  __shared__ int32_t coords[kMaxPeerDevices][2];
  __shared__ SenderBlock senders[kMaxPeerDevices];
  for (int i = threadIdx.x; i < table.size; i += blockDim.x) {
    const int32_t* c = FromPeer(table.at[i].coords, 2);
    coords[i][0] = c[0];
    coords[i][1] = c[1];
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    senders[p] = FindSender(table, coords, me, p, P, groups, num_recv);
    if (blockIdx.x == 0) recv_counts[p] = int32_t(senders[p].count);
  }
  __syncthreads();

  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = int(tid & (lanes_per_row - 1));
  const int64_t row_groups = int64_t(gridDim.x) * blockDim.x / lanes_per_row;
  for (int64_t r = tid / lanes_per_row; r < out_rows; r += row_groups) {
    const int64_t v = recv_rows ? recv_rows[r] : r;  // the receive layout's row
    const V* from = nullptr;  // the source row; null: a zero row
    for (int32_t p = 0; p < P; ++p) {
      const SenderBlock& b = senders[p];
      if (v < b.begin || v >= b.begin + b.count) continue;
      const int64_t s = *FromPeer(b.rows + (v - b.begin), 1);
      if (s >= 0 && s < b.src_rows) from = FromPeer(static_cast<const V*>(b.src) + s * nvec, nvec);
      break;
    }
    V* dst = out + r * nvec;
    for (int64_t v = lane; v < nvec; v += lanes_per_row) dst[v] = from ? from[v] : ZeroUnit<V>();
  }
}

// ----------------------------------------------------------------------------- events

// A device's two events of one exchange: `ready` (recorded on its stream once its operands are
// ready) and `done` (recorded once its kernel has read its peers). Made with
// cudaEventDisableTiming (no timestamps: the cheapest events).
struct ExchangeEvents {
  int32_t device = 0;
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
  int waiters = 0;  // devices still to issue their waits on these events (under the pool mutex)
};

// Each device's events, made once and reused. Reuse is safe because a pair returns to the pool
// only once every device of its exchange has issued all its waits on it: peers wait on `ready`
// between the meetings and on `done` after the second meeting, then release the pair; the
// owner records it again only after it has been released, and cudaStreamWaitEvent waits for the
// record current at its call, so a new record can never stand in for the one a peer waits on.
// In the steady state each device has one pair; a second is made only while a device runs two
// exchanges at once (XLA may run independent calls concurrently). After a failed second meeting
// every participant still issues its waits and releases, so a pair whose exchange failed
// returns once the last of them (a late one too) has; a participant that never returns keeps it.
class EventPool {
 public:
  static EventPool& Global() {
    static EventPool* pool = new EventPool();  // never destroyed: handlers may run late
    return *pool;
  }

  // A free pair of the current device `device`, to be waited on by `waiters` devices.
  ffi::Error Acquire(int32_t device, int waiters, ExchangeEvents** events) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<ExchangeEvents*>& free = free_[device];
    if (free.empty()) {
      auto* made = new ExchangeEvents();
      made->device = device;
      for (cudaEvent_t* e : {&made->ready, &made->done}) {
        if (auto err = CheckCuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                                 "cudaEventCreateWithFlags");
            err.failure()) {
          return err;  // `made` is dropped (an event it holds stays with the device)
        }
      }
      free.push_back(made);
    }
    *events = free.back();
    free.pop_back();
    (*events)->waiters = waiters;
    return ffi::Error::Success();
  }

  // One device has issued its last wait on `events`; the last one returns them to the pool.
  void Release(ExchangeEvents* events) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--events->waiters == 0) free_[events->device].push_back(events);
  }

  // Events no peer has seen (the first meeting failed): back to the pool at once.
  void Return(ExchangeEvents* events) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[events->device].push_back(events);
  }

 private:
  EventPool() = default;

  std::mutex mutex_;
  std::map<int32_t, std::vector<ExchangeEvents*>> free_;
};

// ----------------------------------------------------------------------------- peer access

// Lets kernels on `device` (the current device) read `peer`'s memory: cudaDeviceEnablePeerAccess
// once per (device, peer) pair in the process; an error naming both if they cannot.
ffi::Error EnablePeerAccess(int32_t device, int32_t peer) {
  static std::mutex mutex;
  static auto* enabled = new std::set<std::pair<int32_t, int32_t>>();
  std::lock_guard<std::mutex> lock(mutex);
  if (enabled->count({device, peer})) return ffi::Error::Success();
  int can_access = 0;
  if (auto err = CheckCuda(cudaDeviceCanAccessPeer(&can_access, device, peer),
                           "cudaDeviceCanAccessPeer");
      err.failure())
    return err;
  if (!can_access) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "GPUs " + std::to_string(device) + " and " + std::to_string(peer) +
                          " cannot access each other's memory (cudaDeviceCanAccessPeer): the "
                          "peer transport needs peer access between every pair of devices of "
                          "the mesh; use transport='ragged' on this machine");
  }
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // enabled by another library in this process: fine
  } else if (err != cudaSuccess) {
    return CheckCuda(err, "cudaDeviceEnablePeerAccess");
  }
  enabled->insert({device, peer});
  return ffi::Error::Success();
}

// For the length of a call: `device` current on this thread (XLA:GPU does not promise it), the
// previous one restored after.
class CurrentDevice {
 public:
  explicit CurrentDevice(int32_t device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CurrentDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ffi::Error error() const { return error_; }

 private:
  int previous_ = -1;
  ffi::Error error_;
};

// ----------------------------------------------------------------------------- the handler

// What one device shows its peers for the length of an exchange (host memory owned by the
// meeting: read by peers between the two meetings, kept until the last of them lets go).
struct CudaSide {
  int32_t device = 0;
  PeerOperands operands{};
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t row_bytes = 0;
  ExchangeEvents* events = nullptr;
  std::string error;  // a check that failed on this device
};

std::string Where(const PeerAttrs& a, int32_t device) {
  return "peer transport (axis '" + std::string(a.axis) + "', site " + std::to_string(a.site) +
         ", device " + std::to_string(device) + "): ";
}

// The devices that did arrive at a meeting that timed out (the host knows no ranks).
std::string DescribeArrived(const peer::Meeting& meeting) {
  std::string arrived;
  for (int32_t d : meeting.devices) arrived += (arrived.empty() ? "" : ",") + std::to_string(d);
  return "those that did: device(s) " + arrived + " (a rank of the axis did not reach this "
         "exchange)";
}

const CudaSide& SideAt(const peer::Meeting& meeting, size_t i) {
  return *static_cast<const CudaSide*>(meeting.published[i].get());
}

// "" when every side's checks held and all send rows of one dtype and width; else what is wrong.
std::string CheckSides(const peer::Meeting& meeting, const CudaSide& me) {
  for (size_t i = 0; i < meeting.published.size(); ++i) {
    const CudaSide& side = SideAt(meeting, i);
    if (!side.error.empty()) return "device " + std::to_string(side.device) + ": " + side.error;
  }
  for (size_t i = 0; i < meeting.published.size(); ++i) {
    const CudaSide& side = SideAt(meeting, i);
    if (side.dtype != me.dtype || side.row_bytes != me.row_bytes) {
      return "device " + std::to_string(side.device) + " sends rows of another dtype or width";
    }
  }
  return "";
}

// Steps 3 of the header comment up to the kernel: out and recv_counts of participant `me_index`.
ffi::Error ReadFromPeers(const peer::Meeting& meeting, size_t me_index, const PeerAttrs& a,
                         cudaStream_t stream, void* out, int64_t out_rows,
                         const int32_t* recv_rows, int32_t* recv_counts) {
  const CudaSide& me = SideAt(meeting, me_index);
  PeerTable table{};
  table.size = int32_t(meeting.published.size());
  int unit = 16;
  for (size_t i = 0; i < meeting.published.size(); ++i) {
    const CudaSide& side = SideAt(meeting, i);
    table.at[i] = side.operands;
    unit = std::min(unit, CopyUnitBytes(me.row_bytes, side.operands.src, out));
    if (side.device == me.device) continue;
    if (auto err = EnablePeerAccess(me.device, side.device); err.failure()) return err;
    if (auto err = CheckCuda(cudaStreamWaitEvent(stream, side.events->ready, 0),
                             "cudaStreamWaitEvent (a peer's operands ready)");
        err.failure())
      return err;
  }
  return DispatchCopyUnit(unit, [&](auto unit_c) {
    constexpr int kUnit = decltype(unit_c)::value;
    using V = typename CopyUnit<kUnit>::Type;
    const int64_t nvec = me.row_bytes / kUnit;
    int lanes = 1;
    while (lanes < 32 && lanes < nvec) lanes *= 2;
    const unsigned grid = GridFor(out_rows * lanes, kThreads, int64_t(1) << 20);
    JAX_EP_LAUNCH(grid, kThreads, 0, stream, PeerExchangeKernel<V>)(
        table, int(me_index), int32_t(a.num_ranks), int32_t(a.num_devices / a.num_ranks), nvec,
        static_cast<V*>(out), out_rows, a.num_recv, a.gather ? recv_rows : nullptr,
        recv_counts, lanes);
    return CheckLaunch("PeerExchangeKernel");
  });
}

// Step 4: this stream waits until every participant's kernel has read its peers; releases
// every participant's events.
ffi::Error WaitForReaders(const std::vector<ExchangeEvents*>& events, int32_t device,
                          cudaStream_t stream) {
  ffi::Error result = ffi::Error::Success();
  for (ExchangeEvents* e : events) {
    if (e->device != device && result.success()) {
      result = CheckCuda(cudaStreamWaitEvent(stream, e->done, 0),
                         "cudaStreamWaitEvent (a peer done reading)");
    }
    EventPool::Global().Release(e);
  }
  return result;
}

ffi::Error PeerExchangeCuda(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                            CudaSite* site, Any src, I32 row_map, I32 send_offsets,
                            I32 send_counts, I32 dest_offsets, I32 coords, I32 recv_rows,
                            int64_t num_ranks, int64_t num_devices, int64_t timeout_ms,
                            int64_t num_recv, bool gather, std::string_view axis, AnyOut out,
                            I32Out recv_counts) {
  const PeerAttrs a{site->number, num_ranks, num_devices, timeout_ms, num_recv, gather, axis};
  auto side = std::make_shared<CudaSide>();
  CudaSide& me = *side;
  me.device = device;
  me.error = PeerShapeError(a, src, row_map, send_offsets, send_counts, dest_offsets, coords,
                            recv_rows, out, recv_counts);
  if (num_devices < 1 || timeout_ms <= 0) {  // no meeting can be held
    return ffi::Error::InvalidArgument(Where(a, device) + me.error);
  }
  if (num_devices > kMaxPeerDevices) {  // the same attribute on every device: all fail here
    return ffi::Error::InvalidArgument(Where(a, device) + "num_devices " +
                                       std::to_string(num_devices) + " exceeds the CUDA "
                                       "handler's " + std::to_string(kMaxPeerDevices));
  }
  int64_t out_rows = 0, width = 0;
  RowsAndWidth(*out, &out_rows, &width);
  RowsAndWidth(src, &me.operands.src_rows, &width);
  me.operands.src = src.untyped_data();
  me.operands.row_map = row_map.typed_data();
  me.operands.row_map_rows = row_map.dimensions().size() == 1 ? row_map.dimensions()[0] : 0;
  me.operands.send_offsets = send_offsets.typed_data();
  me.operands.send_counts = send_counts.typed_data();
  me.operands.dest_offsets = dest_offsets.typed_data();
  me.operands.coords = coords.typed_data();
  me.dtype = src.element_type();
  me.row_bytes = width * int64_t(ffi::ByteWidth(src.element_type()));

  CurrentDevice current(device);
  if (auto err = current.error(); err.failure()) return err;
  auto& pool = EventPool::Global();
  if (auto err = pool.Acquire(device, int(num_devices), &me.events); err.failure()) return err;
  if (auto err = CheckCuda(cudaEventRecord(me.events->ready, stream), "cudaEventRecord (ready)");
      err.failure()) {
    pool.Return(me.events);
    return err;
  }

  const auto bound = std::chrono::milliseconds(timeout_ms);
  const peer::Rendezvous::Key key{run_id.run_id, site->number};
  auto& rendezvous = peer::Rendezvous::Global();
  std::string error;
  auto meeting = rendezvous.Arrive(
      key, device, int(num_devices), side, bound,
      [](const peer::Meeting& m) { return DescribeArrived(m); }, &error);
  if (!meeting) {
    pool.Return(me.events);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, Where(a, device) + error);
  }

  // Between the meetings every side is alive: take what is needed after the second one.
  std::vector<ExchangeEvents*> events;
  size_t me_index = 0;
  for (size_t i = 0; i < meeting->published.size(); ++i) {
    events.push_back(SideAt(*meeting, i).events);
    if (meeting->published[i] == side) me_index = i;
  }
  const std::string wrong = CheckSides(*meeting, me);
  ffi::Error read = ffi::Error::Success();
  ffi::Error recorded = ffi::Error::Success();
  // Nothing is enqueued once the meeting has failed (a device gave up at the second meeting:
  // its buffers may be gone by the time a late kernel would read them); the failure then
  // reaches this device at the second meeting.
  rendezvous.EnqueueUnlessFailed(*meeting, [&] {
    if (wrong.empty()) {
      read = ReadFromPeers(*meeting, me_index, a, stream, out->untyped_data(), out_rows,
                           recv_rows.typed_data(), recv_counts->typed_data());
    }
    // Recorded whether or not this device reads: the peers wait on it after the second meeting.
    recorded = CheckCuda(cudaEventRecord(me.events->done, stream), "cudaEventRecord (done)");
  }, &error);
  // The second meeting waits only for the other host threads to enqueue their reads (the
  // copies run on the streams), so it has the first one's bound: on XLA's GPU client a wait
  // past 10 s after one device failed alone would end the process (transport.py).
  const bool departed = rendezvous.Depart(key, meeting, bound, &error);
  // Even when the second meeting failed, this stream waits for the peers' kernels enqueued
  // before the failure (none is enqueued after it), and releases the events: a pair returns to
  // its pool only once every participant has.
  ffi::Error waited = WaitForReaders(events, device, stream);
  if (!departed) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, Where(a, device) + error);
  }
  if (!wrong.empty()) return ffi::Error::InvalidArgument(Where(a, device) + wrong);
  for (ffi::Error* err : {&read, &recorded, &waited}) {
    if (err->failure()) return std::move(*err);
  }
  return ffi::Error::Success();
}

XLA_FFI_TypeInfo cuda_site_type_info = xla::ffi::MakeTypeInfo<CudaSite>();

}  // namespace

// The pairs (a, b), a < b, of the CUDA devices `devices` (ordinals) where a kernel on one
// cannot read the other's memory (cudaDeviceCanAccessPeer, asked both ways): the peer
// transport needs none. A runtime error (no driver, no such device) is a std::runtime_error
// naming the call (the bindings expose this to Python, not to XLA: "auto" asks it up front).
std::vector<std::pair<int, int>> PeerPairsWithoutAccess(const std::vector<int>& devices) {
  std::vector<std::pair<int, int>> missing;
  for (size_t i = 0; i < devices.size(); ++i) {
    for (size_t j = i + 1; j < devices.size(); ++j) {
      const int a = std::min(devices[i], devices[j]), b = std::max(devices[i], devices[j]);
      if (a == b) continue;
      for (const auto& [reader, owner] : {std::pair<int, int>{a, b}, std::pair<int, int>{b, a}}) {
        int can_access = 0;
        const cudaError_t err = cudaDeviceCanAccessPeer(&can_access, reader, owner);
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          throw std::runtime_error("cudaDeviceCanAccessPeer(" + std::to_string(reader) + ", " +
                                   std::to_string(owner) + ") failed: " +
                                   cudaGetErrorString(err));
        }
        if (!can_access) {
          missing.emplace_back(a, b);
          break;
        }
      }
    }
  }
  return missing;
}
}  // namespace jax_ep

extern "C" const jax_ep::FfiStateType JaxEpPeerExchangeStateCuda{&jax_ep::CudaSite::id,
                                                                  &jax_ep::cuda_site_type_info};

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerExchangeInstantiateCuda,
                              jax_ep::peer::InstantiateSite<jax_ep::CudaHandler>,
                              xla::ffi::Ffi::BindInstantiate());

// Not command-buffer compatible (no ffi::Traits::kCmdBufferCompatible): it blocks on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerExchangeCuda, jax_ep::PeerExchangeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::RunId>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jax_ep::CudaSite>>()
                                  .Arg<jax_ep::Any>()        // src [M, ...]
                                  .Arg<jax_ep::I32>()        // row_map [S]
                                  .Arg<jax_ep::I32>()        // send_offsets [P]
                                  .Arg<jax_ep::I32>()        // send_counts [P]
                                  .Arg<jax_ep::I32>()        // dest_offsets [P]
                                  .Arg<jax_ep::I32>()        // coords [2]: rank, group
                                  .Arg<jax_ep::I32>()        // recv_rows [N]
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_devices")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<int64_t>("num_recv")
                                  .Attr<bool>("gather")
                                  .Attr<std::string_view>("axis")
                                  .Ret<jax_ep::Any>()        // out [R or N, ...]
                                  .Ret<jax_ep::I32>());      // recv_counts [P]

// The peer exchange, CPU handler: the ranks of an expert axis that live in this process move
// routed rows by reading each other's buffers, as DeepEP's intranode kernels do over NVLink.
//
// peer_exchange: src [M, ...] any dtype, row_map i32[S], send_offsets i32[P],
//   send_counts i32[P], dest_offsets i32[P], coords i32[2], recv_rows i32[N] -> out [R, ...]
//   or [N, ...] (src's dtype and row shape), recv_counts i32[P].
//   Rank r's rows for rank q are its compact send rows send_offsets[q] .. + send_counts[q];
//   compact row j holds src[row_map[j]] (a zero row when row_map[j] is outside [0, M)), so the
//   sender never packs them. They land in q's receive layout of R = num_recv rows at rows
//   dest_offsets[q] onward; rows no sender writes are zero. out is that layout, or with
//   gather=true its rows recv_rows (out[n] = layout row recv_rows[n], a zero row outside
//   [0, R)): the receiver's own permutation fused into the copy, the layout never written.
//   recv_counts[p] = the rows that came from rank p (the counts travel in the same call).
//   coords = (rank on the axis, index of the group along the other mesh axes). Attributes:
//   num_ranks (P), num_devices (every device running the program), timeout_ms (the bound of the
//   wait for the peers), num_recv (R), gather, axis (its name, for messages). The calls that
//   meet are the same instruction's on every device (its instantiate stage's peer::Site,
//   peer_meeting.h).
//
// Never blocking: XLA:CPU runs the thunks of every device's program on one thread pool shared
// by all devices (as many threads as cores), so a handler that waited for its peers could hold
// every pool thread while the peers' calls sit in the pool's queue (seen: 2 of 8 devices
// arrived, on 2 cores, in a training step). So each device publishes its arguments and
// returns an ffi::Future at once; the device that completes the meeting checks every side,
// copies every receiver's rows straight from the senders' src into the receiver's out (one
// task per receiver on XLA's pool, the caller taking part), and only then completes every
// device's future: no src is released, and no out read, while a peer still copies. A watchdog
// thread fails a meeting that has not filled within timeout_ms: every device that arrived gets
// an error naming who did not, and a device that arrives later fails at once. A bad argument
// on any device fails the call on every device with the same message, before any copy.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu_util.h"
#include "ffi_state.h"
#include "peer_checks.h"
#include "peer_meeting.h"

namespace jax_ep {
namespace {

struct CpuHandler {};
using CpuSite = peer::Site<CpuHandler>;

// What one device shows its peers for the length of an exchange.
struct CpuSide {
  int32_t device = 0;
  int32_t rank = -1;
  int32_t group = -1;
  const uint8_t* src = nullptr;
  int64_t src_rows = 0;
  int64_t row_bytes = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
  const int32_t* row_map = nullptr;
  const int32_t* send_offsets = nullptr;
  const int32_t* send_counts = nullptr;
  const int32_t* dest_offsets = nullptr;
  uint8_t* out = nullptr;
  int64_t out_rows = 0;  // N with gather, else R
  int64_t num_recv = 0;  // R
  const int32_t* recv_rows = nullptr;  // i32[N] with gather, else null
  int64_t num_ranks = 0;
  int32_t* recv_counts = nullptr;
  std::string where;  // "peer transport (axis ..., rank ...): ", the prefix of its errors
  std::string error;  // a check that failed on this device
  ffi::Promise done;  // completes this device's call
};

using Attrs = PeerAttrs;

std::string Where(const Attrs& a, const CpuSide& side) {
  return "peer transport (axis '" + std::string(a.axis) + "', site " + std::to_string(a.site) +
         ", rank " + std::to_string(side.rank) + " of group " + std::to_string(side.group) +
         " on device " + std::to_string(side.device) + "): ";
}

// The checks of one device's own arguments: shapes and attributes (peer_checks.h), then the
// values of coords and the send blocks; "" when they hold.
std::string CheckSide(const Attrs& a, Any src, I32 row_map, I32 send_offsets, I32 send_counts,
                      I32 dest_offsets, I32 coords, I32 recv_rows, AnyOut& out,
                      I32Out& recv_counts) {
  std::string shape_error = PeerShapeError(a, src, row_map, send_offsets, send_counts,
                                           dest_offsets, coords, recv_rows, out, recv_counts);
  if (!shape_error.empty()) return shape_error;
  const int64_t P = a.num_ranks;
  const int64_t groups = a.num_devices / P;
  const int32_t rank = coords.typed_data()[0], group = coords.typed_data()[1];
  if (rank < 0 || rank >= P || group < 0 || group >= groups) {
    return "coords: (rank " + std::to_string(rank) + ", group " + std::to_string(group) +
           ") outside [0, " + std::to_string(P) + ") x [0, " + std::to_string(groups) + ")";
  }
  const int64_t S = row_map.dimensions()[0];
  for (int64_t q = 0; q < P; ++q) {
    const int64_t begin = send_offsets.typed_data()[q], count = send_counts.typed_data()[q];
    if (begin < 0 || count < 0 || begin + count > S) {
      return "send block for rank " + std::to_string(q) + " (rows " + std::to_string(begin) +
             " + " + std::to_string(count) + ") outside row_map's " + std::to_string(S) +
             " rows";
    }
  }
  return "";
}

using Sides = std::vector<std::unique_ptr<CpuSide>>;

// Rank p of `group` among the sides, null if none; *duplicate if several.
const CpuSide* FindPeer(const Sides& sides, int32_t group, int32_t p, bool* duplicate) {
  const CpuSide* found = nullptr;
  for (const auto& side : sides) {
    if (side->group != group || side->rank != p) continue;
    if (found) *duplicate = true;
    found = side.get();
  }
  return found;
}

// Who of `me`'s group did not arrive at a meeting that timed out.
std::string DescribeMissing(const Sides& sides, const CpuSide& me, int64_t P) {
  std::string missing;
  for (int32_t p = 0; p < P; ++p) {
    bool duplicate = false;
    if (!FindPeer(sides, me.group, p, &duplicate)) {
      missing += (missing.empty() ? "" : ",") + std::to_string(p);
    }
  }
  return missing.empty() ? "every rank of group " + std::to_string(me.group) +
                               " arrived; another group did not"
                         : "missing rank(s) " + missing + " of group " +
                               std::to_string(me.group);
}

// The first check that failed on any side, as "rank r of group g (device d): why"; "" if none.
std::string FirstSideError(const Sides& sides) {
  for (const auto& side : sides) {
    if (!side->error.empty()) {
      return "rank " + std::to_string(side->rank) + " of group " + std::to_string(side->group) +
             " (device " + std::to_string(side->device) + "): " + side->error;
    }
  }
  return "";
}

// The senders of `me`, by rank; "" or what is wrong with them.
std::string Senders(const Sides& sides, const CpuSide& me, int64_t P,
                    std::vector<const CpuSide*>* senders) {
  const int64_t num_recv = me.num_recv;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [begin, end) of each sender's rows in out
  for (int32_t p = 0; p < P; ++p) {
    bool duplicate = false;
    const CpuSide* side = FindPeer(sides, me.group, p, &duplicate);
    if (!side || duplicate) {
      return "rank " + std::to_string(p) + " of group " + std::to_string(me.group) +
             (duplicate ? " is claimed by several devices" : " is not among the devices") +
             ": every mesh axis must be manual in the enclosing shard_map";
    }
    if (side->num_ranks != P) {
      return "rank " + std::to_string(p) + " runs the exchange over " +
             std::to_string(side->num_ranks) + " ranks, this rank over " + std::to_string(P);
    }
    if (side->dtype != me.dtype || side->row_bytes != me.row_bytes) {
      return "rank " + std::to_string(p) + " sends rows of another dtype or width";
    }
    const int64_t begin = side->dest_offsets[me.rank], count = side->send_counts[me.rank];
    if (begin < 0 || begin + count > num_recv) {
      return "rank " + std::to_string(p) + " sends rows " + std::to_string(begin) + " + " +
             std::to_string(count) + ", outside this rank's " + std::to_string(num_recv) +
             " receive rows";
    }
    if (count > 0) blocks.emplace_back(begin, begin + count);
    senders->push_back(side);
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t i = 1; i < blocks.size(); ++i) {
    if (blocks[i].first < blocks[i - 1].second) {
      return "two senders' blocks overlap at receive row " + std::to_string(blocks[i].first);
    }
  }
  return "";
}

// The source row of each row of `me`'s receive layout (R rows): a sender's src row, or null
// for a zero row (row_map outside src, or no sender writes it); recv_counts filled on the way.
std::vector<const uint8_t*> ReceiveLayout(const std::vector<const CpuSide*>& senders,
                                          const CpuSide& me) {
  std::vector<const uint8_t*> layout(me.num_recv, nullptr);
  for (size_t p = 0; p < senders.size(); ++p) {
    const CpuSide& from = *senders[p];
    const int64_t begin = from.dest_offsets[me.rank], count = from.send_counts[me.rank];
    const int32_t* rows = from.row_map + from.send_offsets[me.rank];
    for (int64_t j = 0; j < count; ++j) {
      const int64_t s = rows[j];
      if (s >= 0 && s < from.src_rows) layout[begin + j] = from.src + s * me.row_bytes;
    }
    me.recv_counts[p] = int32_t(count);
  }
  return layout;
}

// me.out = the receive layout, or its rows me.recv_rows (gather), copied from the senders.
void CopyFromSenders(const std::vector<const CpuSide*>& senders, const CpuSide& me) {
  const int64_t row_bytes = me.row_bytes, out_rows = me.out_rows;
  const std::vector<const uint8_t*> layout = ReceiveLayout(senders, me);
  uint8_t* out = me.out;
  AdviseHugePages(out, out_rows * row_bytes);
  const bool streaming = out_rows * row_bytes >= kStreamingStoreBytes;
  for (int64_t r = 0; r < out_rows; ++r) {
    const int64_t v = me.recv_rows ? me.recv_rows[r] : r;
    const uint8_t* row = v >= 0 && v < me.num_recv ? layout[v] : nullptr;
    if (streaming) {
      StreamRow(out + r * row_bytes, row, row_bytes);
    } else {
      CopyOrZeroRow(out + r * row_bytes, row, row_bytes);
    }
  }
  if (streaming) StreamingFence();
}

// ----------------------------------------------------------------------------- meetings

using peer::Clock;
using peer::kFailedMeetingLifetime;

// Why a device can miss a meeting, appended to the timeout's message: a program whose ranks
// take different exchanges (a branch on the rank), or XLA:CPU not running every device's part
// of one execution in time while many executions are in flight (measured: 64 independent calls
// of a one-exchange program, nothing waited for, on 8 devices; XLA's own all-reduce and
// all-to-all stall the same way: docs/peer_transport.md).
constexpr char kMissingDeviceCauses[] =
    " (a rank that took another branch, or, on XLA:CPU, too many executions of peer-exchange "
    "programs in flight at once: wait for some before dispatching more; "
    "docs/peer_transport.md)";

// The devices of one exchange.
struct Meeting {
  Meeting(int size, Clock::duration bound)
      : size(size), bound(bound), deadline(Clock::now() + bound) {}

  const int size;
  const Clock::duration bound;
  const Clock::time_point deadline;
  Sides sides;
  bool failed = false;
  std::string failure;
  Clock::time_point failed_at;

  bool Has(int32_t device) const {
    return std::any_of(sides.begin(), sides.end(), [&](const auto& s) { return s->device == device; });
  }
};

// A device's future to complete with `error` (success when empty); never under the table's
// lock (completing it runs the device's next thunks, which may call this handler again).
struct Completion {
  ffi::Promise promise;
  std::string error;
  ffi::ErrorCode code = ffi::ErrorCode::kInvalidArgument;

  void Run() {
    if (error.empty()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ffi::Error(code, error));
    }
  }

  // Runs on a thread of CompletionThreads.
  void RunOnItsOwnThread() const;
};

// Threads that complete the devices' futures. Completing a future runs that device's next
// thunks on the completing thread, up to its next asynchronous step, and those may block (an
// XLA:CPU all-reduce waits for every device's thread): so every device's future completes on
// a thread of its own, never on XLA's pool nor on the thread completing another's. The pool
// grows by a thread whenever the queued tasks outnumber the waiting threads, so no task ever
// waits for a thread that is busy (a busy one may be blocked until this very task has run).
class CompletionThreads {
 public:
  static CompletionThreads& Global() {
    static CompletionThreads* threads = new CompletionThreads();  // never destroyed
    return *threads;
  }

  void Run(Completion task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (tasks_.size() < waiting_) {
        tasks_.push_back(std::move(task));
        ready_.notify_one();
        return;
      }
      try {
        std::thread([this] { Work(); }).detach();
        tasks_.push_back(std::move(task));
        return;
      } catch (const std::system_error& e) {
        // The process cannot start a thread: fail this device's call here (an error runs none
        // of its successor thunks, so nothing waits on this thread) rather than run them.
        task.code = ffi::ErrorCode::kResourceExhausted;
        task.error = "peer transport: no thread to complete the exchange on (" +
                     std::string(e.what()) + ")" + (task.error.empty() ? "" : "; " + task.error);
      }
    }
    task.Run();
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      ++waiting_;
      ready_.wait(lock, [&] { return !tasks_.empty(); });
      --waiting_;
      Completion task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task.Run();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Completion> tasks_;
  size_t waiting_ = 0;  // threads inside ready_.wait
};

void Completion::RunOnItsOwnThread() const { CompletionThreads::Global().Run(*this); }

// The open meetings of the process, keyed by (run id, site): peer_meeting.h says why.
class Rendezvous {
 public:
  using Key = peer::MeetingQueues<Meeting>::Key;  // (run id, site number)

  static Rendezvous& Global() {
    static Rendezvous* rendezvous = new Rendezvous();  // never destroyed: calls may run late
    return *rendezvous;
  }

  // Adds `side` to its device's next meeting of `key` (`size` devices, filled within
  // `bound`). Returns the meeting if this side filled it: the caller runs the exchange. Else
  // null, the side's future completing later (by the exchange or the watchdog), or at once
  // with an error (a failed meeting, a size mismatch) through *late.
  std::shared_ptr<Meeting> Join(Key key, std::unique_ptr<CpuSide> side, int size,
                                Clock::duration bound, Completion* late) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<Meeting> meeting = open_.Next(key, side->device, [&] {
      deadlines_changed_.notify_one();
      return std::make_shared<Meeting>(size, bound);
    });
    if (meeting->failed || meeting->size != size) {
      late->promise = side->done;
      late->code = ffi::ErrorCode::kDeadlineExceeded;
      late->error = side->where + (meeting->failed
          ? "an earlier device gave up on this exchange: " + meeting->failure +
                kMissingDeviceCauses
          : "this device expects " + std::to_string(size) + " devices, another " +
                std::to_string(meeting->size) + " (the same program on every device?)");
      return nullptr;
    }
    meeting->sides.push_back(std::move(side));
    if (int(meeting->sides.size()) < size) return nullptr;
    open_.Remove(key, meeting);  // full: no device looks for it again
    return meeting;
  }

 private:
  Rendezvous() : watchdog_([this] { Watch(); }) { watchdog_.detach(); }

  // The watchdog: fails every meeting past its deadline, and forgets failed meetings after
  // kFailedMeetingLifetime.
  void Watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      Clock::time_point next = Clock::time_point::max();
      std::vector<Completion> expired;
      const Clock::time_point now = Clock::now();
      open_.Sweep(
          [&](Meeting& meeting) {
            if (!meeting.failed && now >= meeting.deadline) Fail(meeting, now, &expired);
            next = std::min(next, meeting.failed ? meeting.failed_at + kFailedMeetingLifetime
                                                 : meeting.deadline);
          },
          [&](const Meeting& m) { return m.failed && now - m.failed_at > kFailedMeetingLifetime; });
      if (!expired.empty()) {  // completed outside the lock, then the table swept again
        lock.unlock();
        for (const Completion& c : expired) c.RunOnItsOwnThread();
        lock.lock();
        continue;
      }
      if (next == Clock::time_point::max()) {
        deadlines_changed_.wait(lock);
      } else {
        deadlines_changed_.wait_until(lock, next);
      }
    }
  }

  static void Fail(Meeting& meeting, Clock::time_point now, std::vector<Completion>* expired) {
    meeting.failed = true;
    meeting.failed_at = now;
    const std::string ms = std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(meeting.bound).count());
    meeting.failure = "the meeting timed out after " + ms + " ms with " +
                      std::to_string(meeting.sides.size()) + "/" +
                      std::to_string(meeting.size) + " devices arrived";
    for (const auto& side : meeting.sides) {
      expired->push_back({side->done,
                          side->where + meeting.failure + "; " +
                              DescribeMissing(meeting.sides, *side, side->num_ranks) +
                              kMissingDeviceCauses,
                          ffi::ErrorCode::kDeadlineExceeded});
    }
  }

  std::mutex mutex_;
  std::condition_variable deadlines_changed_;
  peer::MeetingQueues<Meeting> open_;
  std::thread watchdog_;
};

// Checks every side and copies every receiver's rows (receivers in tasks of XLA's pool, this
// thread taking part, once there are kParallelGrainBytes of rows per task; small exchanges on
// this thread alone); then completes every device's future: the calling device's here, the
// others' each on its own thread.
void RunExchange(const CpuWorkers& workers, Meeting& meeting, int64_t P) {
  const int32_t caller = workers.device;
  const Sides& sides = meeting.sides;
  std::vector<Completion> done(sides.size());
  const std::string first_error = FirstSideError(sides);
  int64_t bytes = 0;
  for (const auto& side : sides) bytes += side->out_rows * side->row_bytes;
  const int64_t n = int64_t(sides.size());
  const int64_t grain = std::max<int64_t>(1, kParallelGrainBytes * n / std::max<int64_t>(bytes, 1));
  ParallelFor(workers, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const CpuSide& me = *sides[i];
      done[i].promise = me.done;
      std::vector<const CpuSide*> senders;
      std::string wrong = first_error.empty() ? Senders(sides, me, P, &senders) : first_error;
      if (wrong.empty()) {
        CopyFromSenders(senders, me);
      } else {
        done[i].error = me.where + wrong;
      }
    }
  });
  for (size_t i = 0; i < sides.size(); ++i) {
    if (sides[i]->device != caller) done[i].RunOnItsOwnThread();
  }
  for (size_t i = 0; i < sides.size(); ++i) {
    if (sides[i]->device == caller) done[i].Run();
  }
}

ffi::Future PeerExchangeCpu(ffi::ThreadPool pool, ffi::RunId run_id, int32_t device,
                            CpuSite* site, Any src, I32 row_map, I32 send_offsets,
                            I32 send_counts, I32 dest_offsets, I32 coords, I32 recv_rows,
                            int64_t num_ranks, int64_t num_devices, int64_t timeout_ms,
                            int64_t num_recv, bool gather, std::string_view axis, AnyOut out,
                            I32Out recv_counts) {
  const Attrs a{site->number, num_ranks, num_devices, timeout_ms, num_recv, gather, axis};
  auto me = std::make_unique<CpuSide>();
  me->device = device;
  me->error = CheckSide(a, src, row_map, send_offsets, send_counts, dest_offsets, coords,
                        recv_rows, out, recv_counts);
  me->num_recv = num_recv;
  me->recv_rows = gather ? recv_rows.typed_data() : nullptr;
  if (coords.element_count() == 2) {
    me->rank = coords.typed_data()[0];
    me->group = coords.typed_data()[1];
  }
  int64_t width = 0;
  RowsAndWidth(*out, &me->out_rows, &width);
  RowsAndWidth(src, &me->src_rows, &width);
  me->src = static_cast<const uint8_t*>(src.untyped_data());
  me->row_bytes = width * int64_t(ffi::ByteWidth(src.element_type()));
  me->dtype = src.element_type();
  me->row_map = row_map.typed_data();
  me->send_offsets = send_offsets.typed_data();
  me->send_counts = send_counts.typed_data();
  me->dest_offsets = dest_offsets.typed_data();
  me->out = static_cast<uint8_t*>(out->untyped_data());
  me->recv_counts = recv_counts->typed_data();
  me->num_ranks = num_ranks;
  me->where = Where(a, *me);
  ffi::Future future(me->done);
  if (num_devices < 1 || timeout_ms <= 0) {  // no meeting can be held
    Completion{me->done, me->where + me->error}.Run();
    return future;
  }
  Completion late;
  auto meeting = Rendezvous::Global().Join({run_id.run_id, site->number}, std::move(me),
                                           int(num_devices), std::chrono::milliseconds(timeout_ms),
                                           &late);
  if (!late.error.empty()) late.Run();
  if (meeting) RunExchange({pool, device}, *meeting, num_ranks);
  return future;
}

XLA_FFI_TypeInfo cpu_site_type_info = xla::ffi::MakeTypeInfo<CpuSite>();

}  // namespace
}  // namespace jax_ep

extern "C" const jax_ep::FfiStateType JaxEpPeerExchangeStateCpu{&jax_ep::CpuSite::id,
                                                                 &jax_ep::cpu_site_type_info};

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerExchangeInstantiateCpu,
                              jax_ep::peer::InstantiateSite<jax_ep::CpuHandler>,
                              xla::ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerExchangeCpu, jax_ep::PeerExchangeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::RunId>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jax_ep::CpuSite>>()
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

// The host-side meetings of the peer exchange: the devices of one process that run one SPMD
// program meet at each exchange. Site is the per-instruction state both handlers key their
// meetings by; MeetingQueues is the occurrence rule both follow; Rendezvous is the blocking
// meeting of the CUDA handler (peer.cu: publish its side, wait for everyone, meet again once
// every receiver has read its peers). The CPU handler's meeting never blocks (peer.cc says why)
// and keeps its own table on MeetingQueues.
//
// Which calls meet: XLA's FFI gives a handler the run id (one per execution, the same on every
// device) and the device ordinal, and a state per instruction made by the handler's instantiate
// stage. XLA instantiates a custom call once per instruction of a compiled program, and every
// device that runs the program executes the instruction with that one state (checked on
// XLA:CPU, tests/test_peer_transport.py; XLA:GPU keeps it in the instruction's thunk, which
// the devices share). So the Site made there names the instruction alike on every device and
// apart from every other instruction of the process: a layer traced once but placed several
// times in the program (a Python loop over one jax.checkpoint-ed function, the call sites of
// one nested jit) is several instructions, several sites, whatever order XLA runs them in. A
// meeting is keyed by (run id, site), and an instruction that runs several times in one
// execution (a loop body: scan over layers) runs once per iteration on every device, in order,
// so each device joins the oldest meeting of that key it has not joined yet: the n-th
// occurrence on one device meets the n-th on the others.
//
// Nothing waits forever: a meeting that does not fill within its bound fails, every waiting
// device returns an error naming who did not arrive, and a device that arrives later fails
// at once (the failed meeting is kept for kFailedMeetingLifetime).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_ep::peer {

using Clock = std::chrono::steady_clock;

// How long a failed meeting stays to fail its late arrivals at once.
constexpr std::chrono::seconds kFailedMeetingLifetime{120};

// The FFI state of one peer-exchange instruction (see the header comment): `number` is unique
// in the process. Tag gives each handler (CPU, CUDA, emulated CUDA) its own state type, since
// XLA registers a state type once per type id.
template <typename Tag>
struct Site {
  static xla::ffi::TypeId id;  // set by XLA's type registry (jax.ffi.register_ffi_type)
  int64_t number = 0;
};

template <typename Tag>
xla::ffi::TypeId Site<Tag>::id = {};

// The instantiate stage of a handler keyed by Site<Tag>: a site with the next number.
template <typename Tag>
xla::ffi::ErrorOr<std::unique_ptr<Site<Tag>>> InstantiateSite() {
  static std::atomic<int64_t> next{1};
  auto site = std::make_unique<Site<Tag>>();
  site->number = next.fetch_add(1);
  xla::ffi::ErrorOr<std::unique_ptr<Site<Tag>>> made(std::move(site));
  return made;
}

// The open meetings of each key (run id, site number), oldest first. M has
// `bool Has(int32_t device)`.
// Not thread-safe: the owner holds its lock around every call.
template <typename M>
class MeetingQueues {
 public:
  using Key = std::pair<int64_t, int64_t>;

  // The oldest meeting of `key` that `device` has not joined; make() appended if there is none.
  template <typename Make>
  std::shared_ptr<M> Next(Key key, int32_t device, Make make) {
    auto& queue = open_[key];
    for (const auto& meeting : queue) {
      if (!meeting->Has(device)) return meeting;
    }
    queue.push_back(make());
    return queue.back();
  }

  void Remove(Key key, const std::shared_ptr<M>& meeting) {
    auto it = open_.find(key);
    if (it == open_.end()) return;
    auto& queue = it->second;
    queue.erase(std::remove(queue.begin(), queue.end(), meeting), queue.end());
    if (queue.empty()) open_.erase(it);
  }

  // visit(meeting) for every open meeting, then those drop(meeting) holds for are forgotten.
  template <typename Visit, typename Drop>
  void Sweep(Visit visit, Drop drop) {
    for (auto it = open_.begin(); it != open_.end();) {
      auto& queue = it->second;
      for (const auto& meeting : queue) visit(*meeting);
      queue.erase(std::remove_if(queue.begin(), queue.end(),
                                 [&](const std::shared_ptr<M>& m) { return drop(*m); }),
                  queue.end());
      it = queue.empty() ? open_.erase(it) : std::next(it);
    }
  }

 private:
  std::map<Key, std::deque<std::shared_ptr<M>>> open_;
};

// One exchange of the blocking rendezvous: `size` devices, each publishing its side. The
// meeting owns the sides, so a side stays alive while any device still holds the meeting (a
// device that gives up at the second meeting returns while a slower peer may still read it).
struct Meeting {
  explicit Meeting(int size) : size(size) {}

  const int size;
  std::vector<int32_t> devices;       // device ordinals, in arrival order
  std::vector<std::shared_ptr<const void>> published;  // what each of them published
  int done = 0;                        // devices that finished reading their peers
  int left = 0;                        // devices that passed the second meeting
  bool failed = false;
  std::string failure;
  Clock::time_point failed_at;
  // Held shared while a device enqueues its reads of the others (EnqueueUnlessFailed), and
  // exclusively to fail the meeting: a failure waits for the enqueues under way, and no device
  // enqueues after it (its kernel would read buffers whose owners gave up and returned).
  std::shared_mutex enqueueing;

  bool Has(int32_t device) const {
    return std::find(devices.begin(), devices.end(), device) != devices.end();
  }
};

// The process-wide table of open meetings of the blocking rendezvous.
class Rendezvous {
 public:
  using Key = MeetingQueues<Meeting>::Key;  // (run id, site number)

  static Rendezvous& Global() {
    static Rendezvous* rendezvous = new Rendezvous();  // never destroyed: handlers may run late
    return *rendezvous;
  }

  // Joins this device's next meeting of `key`, publishes `mine` and waits until `size`
  // devices have arrived. Returns the meeting, or null with *error set (timed out: the
  // arrived devices are listed by `describe_missing`, given them; or the meeting had failed).
  template <typename DescribeMissing>
  std::shared_ptr<Meeting> Arrive(Key key, int32_t device, int size,
                                  std::shared_ptr<const void> mine,
                                  Clock::duration bound, DescribeMissing describe_missing,
                                  std::string* error) {
    std::unique_lock<std::mutex> lock(mutex_);
    const Clock::time_point now = Clock::now();
    open_.Sweep([](const Meeting&) {}, [&](const Meeting& m) {
      return m.failed && now - m.failed_at > kFailedMeetingLifetime;
    });
    std::shared_ptr<Meeting> meeting =
        open_.Next(key, device, [&] { return std::make_shared<Meeting>(size); });
    if (meeting->failed) {
      *error = "an earlier device gave up on this exchange: " + meeting->failure;
      return nullptr;
    }
    if (meeting->size != size) {
      *error = "this device expects " + std::to_string(size) + " devices, another " +
               std::to_string(meeting->size) + " (the same program on every device?)";
      return nullptr;
    }
    meeting->devices.push_back(device);
    meeting->published.push_back(std::move(mine));
    if (int(meeting->devices.size()) == size) changed_.notify_all();
    const Clock::time_point deadline = Clock::now() + bound;
    const bool full = changed_.wait_until(lock, deadline, [&] {
      return meeting->failed || int(meeting->devices.size()) == size;
    });
    if (meeting->failed) {
      *error = meeting->failure;
      return nullptr;
    }
    if (!full) {
      Fail(*meeting, "timed out after " + Seconds(bound) + " s: " +
                         std::to_string(meeting->devices.size()) + "/" + std::to_string(size) +
                         " devices arrived; " + describe_missing(*meeting));
      *error = meeting->failure;
      return nullptr;
    }
    return meeting;
  }

  // Between the meetings: runs `enqueue` (this device's reads of its peers, then the record
  // its peers wait on) unless the meeting has failed, and returns whether it ran (else *error
  // holds the failure). A device that gives up later (Depart's bound) fails the meeting only
  // once the enqueues under way are done, so it can wait for each of them; a device that comes
  // after that enqueues nothing, so no kernel reads buffers whose owners have returned.
  template <typename Enqueue>
  bool EnqueueUnlessFailed(Meeting& meeting, Enqueue enqueue, std::string* error) {
    std::shared_lock<std::shared_mutex> lock(meeting.enqueueing);
    if (meeting.failed) {
      *error = meeting.failure;
      return false;
    }
    enqueue();
    return true;
  }

  // The second meeting: this device has read its peers; waits until every device has, so
  // that no buffer is released while a peer still reads it. False with *error on a timeout.
  bool Depart(Key key, const std::shared_ptr<Meeting>& meeting, Clock::duration bound,
              std::string* error) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (++meeting->done == meeting->size) changed_.notify_all();
    const bool all = changed_.wait_until(lock, Clock::now() + bound, [&] {
      return meeting->failed || meeting->done == meeting->size;
    });
    if (!all && !meeting->failed) {
      Fail(*meeting, "timed out after " + Seconds(bound) + " s waiting for " +
                         std::to_string(meeting->size - meeting->done) +
                         " device(s) to finish reading");
    }
    if (meeting->failed) {
      *error = meeting->failure;
      return false;
    }
    if (++meeting->left == meeting->size) open_.Remove(key, meeting);
    return true;
  }

 private:
  Rendezvous() = default;

  static std::string Seconds(Clock::duration d) {
    const double s = std::chrono::duration<double>(d).count();
    std::string text = std::to_string(s);
    return text.substr(0, text.find('.') + 2);
  }

  // Called with mutex_ held; waits for the meeting's enqueues under way (they never take
  // mutex_).
  void Fail(Meeting& meeting, std::string why) {
    std::unique_lock<std::shared_mutex> no_enqueues(meeting.enqueueing);
    meeting.failed = true;
    meeting.failure = std::move(why);
    meeting.failed_at = Clock::now();
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  MeetingQueues<Meeting> open_;
};

}  // namespace jax_ep::peer

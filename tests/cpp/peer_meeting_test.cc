// The blocking rendezvous of the CUDA peer handler (xla_ffi/peer_meeting.h), on host threads:
// two devices meet; one stays inside its enqueue (EnqueueUnlessFailed) while the other gives up
// at the second meeting. The failure must wait until that enqueue is done (so the device that
// gave up can wait for its kernel), and no enqueue may start after it (a late kernel would read
// buffers whose owners returned). Built with ThreadSanitizer by tests/test_peer_transport.py;
// prints "failed N" and exits non-zero where a check fails.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "peer_meeting.h"

namespace {

using jax_ep::peer::Clock;
using jax_ep::peer::Meeting;
using jax_ep::peer::Rendezvous;
using std::chrono::milliseconds;

std::atomic<int> failures{0};  // Check runs on both threads

void Check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Devices 0 and 1 meet at key (run, 1). Device 1 enqueues for 400 ms; device 0 departs at once
// with a bound of 50 ms, so it gives up while device 1 is still enqueueing.
void FailureWaitsForTheEnqueueUnderWay(int64_t run) {
  auto& rendezvous = Rendezvous::Global();
  const Rendezvous::Key key{run, 1};
  const auto bound = milliseconds(2000);
  std::shared_ptr<Meeting> meetings[2];
  std::string errors[2];
  std::thread arrive1([&] {
    meetings[1] = rendezvous.Arrive(key, 1, 2, nullptr, bound,
                                    [](const Meeting&) { return std::string(); }, &errors[1]);
  });
  meetings[0] = rendezvous.Arrive(key, 0, 2, nullptr, bound,
                                  [](const Meeting&) { return std::string(); }, &errors[0]);
  arrive1.join();
  Check(meetings[0] && meetings[1] && meetings[0] == meetings[1], "both devices meet");
  if (!meetings[0] || meetings[0] != meetings[1]) return;

  std::atomic<bool> inside{false}, enqueued{false};
  std::thread device1([&] {
    std::string error;
    const bool ran = rendezvous.EnqueueUnlessFailed(*meetings[1], [&] {
      inside = true;
      std::this_thread::sleep_for(milliseconds(400));
      enqueued = true;
    }, &error);
    Check(ran, "an enqueue before any failure runs");
    // The meeting failed meanwhile: a second enqueue must not run.
    bool ran_late = false;
    const bool again = rendezvous.EnqueueUnlessFailed(*meetings[1], [&] { ran_late = true; },
                                                      &error);
    Check(!again && !ran_late, "no enqueue runs after the meeting failed");
    Check(error.find("timed out") != std::string::npos, "a late enqueue gets the failure");
    Check(!rendezvous.Depart(key, meetings[1], bound, &error), "the late device fails too");
  });
  while (!inside) std::this_thread::yield();
  const Clock::time_point start = Clock::now();
  std::string error;
  const bool departed = rendezvous.Depart(key, meetings[0], milliseconds(50), &error);
  Check(!departed, "device 0 gives up at the second meeting");
  Check(enqueued, "the failure waited for device 1's enqueue under way");
  Check(Seconds(start) > 0.2, "device 0 returned only after that enqueue (about 0.35 s)");
  device1.join();
}

// Without a failure both enqueue and both depart.
void BothEnqueueAndDepart(int64_t run) {
  auto& rendezvous = Rendezvous::Global();
  const Rendezvous::Key key{run, 1};
  const auto bound = milliseconds(5000);
  std::atomic<int> ran{0}, departed{0};
  auto device = [&](int32_t id) {
    std::string error;
    auto meeting = rendezvous.Arrive(key, id, 2, nullptr, bound,
                                     [](const Meeting&) { return std::string(); }, &error);
    if (!meeting) return;
    if (rendezvous.EnqueueUnlessFailed(*meeting, [&] { ++ran; }, &error)) {
      departed += rendezvous.Depart(key, meeting, bound, &error);
    }
  };
  std::thread other(device, 1);
  device(0);
  other.join();
  Check(ran == 2 && departed == 2, "without a failure both devices enqueue and depart");
}

}  // namespace

int main() {
  FailureWaitsForTheEnqueueUnderWay(1);
  BothEnqueueAndDepart(2);
  std::printf("failed %d\n", failures.load());
  return failures == 0 ? 0 : 1;
}

// The CUDA emulator's runtime: fibers, the block scheduler, warp collectives, launch checks,
// the sticky error state, memory, streams, devices, events and peer access (see
// include/cuda_emu/emulator.h for the model).
#include "cuda_emu/emulator.h"

#include <sys/mman.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

// The runtime's handles (cudaStream_t, cudaEvent_t point to them): the device current when
// they were made.
struct CUstream_st {
  uint64_t id;
  int device;
};

struct CUevent_st {
  int device;
};

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace cuda_emu {
struct Fiber;
}

// cuda_emu_switch(save, load): saves the callee-saved registers and the stack pointer in *save,
// then continues the context whose stack pointer is `load`. A new fiber's stack is laid out so
// that its first switch "returns" into cuda_emu_fiber_start with the Fiber* in r12.
extern "C" {
__attribute__((visibility("hidden"))) void cuda_emu_switch(void** save, void* load);
__attribute__((visibility("hidden"))) void cuda_emu_fiber_start();
__attribute__((visibility("hidden"), noreturn)) void cuda_emu_fiber_main(cuda_emu::Fiber* f);
}

asm(R"(
  .text
  .p2align 4
  .globl cuda_emu_switch
  .hidden cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch, .-cuda_emu_switch

  .p2align 4
  .globl cuda_emu_fiber_start
  .hidden cuda_emu_fiber_start
  .type cuda_emu_fiber_start, @function
cuda_emu_fiber_start:
  movq %r12, %rdi
  andq $-16, %rsp
  call cuda_emu_fiber_main
  ud2
  .size cuda_emu_fiber_start, .-cuda_emu_fiber_start
)");

namespace cuda_emu {

enum class State : uint8_t { kReady, kAtBarrier, kAtWarpCollective, kDone };

struct Fiber {
  void* sp = nullptr;
  uint3 tid{};
  int linear = 0;
  State state = State::kReady;
  void* asan_fake_stack = nullptr;
};

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;  // PROT_NONE below each stack: an overflow faults
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxDynamicSharedBytes = 48 * 1024;  // without cudaFuncSetAttribute opt-in
constexpr unsigned kMxcsrFlushToZero = 0x8000, kMxcsrDenormalsAreZero = 0x0040;
constexpr int kDefaultDevices = 8, kMaxDevices = 64;

const char* WarpOpName(WarpOp op) {
  switch (op) {
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kShfl: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
  }
  return "?";
}

struct Warp {
  uint32_t lanes = 0;    // lanes that exist in the block
  uint32_t exited = 0;   // lanes whose thread returned
  uint32_t arrived = 0;  // lanes waiting in the current collective
  uint32_t mask = 0;
  WarpOp op = WarpOp::kSync;
  uint64_t value[32];
  int arg[32];
  int width[32];
  uint64_t result[32];
};

// Fiber stacks, mapped once and reused by every block (launches are serialised).
class StackPool {
 public:
  ~StackPool() {
    for (char* base : bases_) munmap(base - kGuardBytes, kStackBytes + kGuardBytes);
  }
  char* Get(size_t i) {
    while (bases_.size() <= i) {
      void* m = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) {
        std::fprintf(stderr, "cuda_emu: cannot map a %zu-byte fiber stack\n", kStackBytes);
        std::abort();
      }
      mprotect(m, kGuardBytes, PROT_NONE);
      bases_.push_back(static_cast<char*>(m) + kGuardBytes);
    }
    return bases_[i];
  }
  void UnpoisonAll() {
#if CUDA_EMU_ASAN
    for (char* base : bases_) ASAN_UNPOISON_MEMORY_REGION(base, kStackBytes);
#endif
  }

 private:
  std::vector<char*> bases_;
};

enum class Schedule { kAlternate, kForward, kReverse };

Schedule ScheduleFromEnv() {
  const char* s = std::getenv("JAX_EP_CUDA_EMU_SCHEDULE");
  if (s == nullptr || std::strcmp(s, "alternate") == 0) return Schedule::kAlternate;
  if (std::strcmp(s, "forward") == 0) return Schedule::kForward;
  if (std::strcmp(s, "reverse") == 0) return Schedule::kReverse;
  std::fprintf(stderr, "cuda_emu: JAX_EP_CUDA_EMU_SCHEDULE=%s: expected alternate, forward or "
               "reverse\n", s);
  std::abort();
}

// The block being run (one at a time, under g_launch_mutex).
struct BlockRun {
  void (*thread_main)(void*) = nullptr;
  void* context = nullptr;
  int threads = 0;
  int live = 0;
  int arrived = 0;  // threads waiting at the block barrier
  int barrier_predicates = 0;
  int barrier_result = 0;
  int64_t barriers_completed = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::unordered_map<const void*, int64_t> temp_storage_uses;
  Fiber* current = nullptr;
  int device = 0;  // the device of the launch's stream
  void* scheduler_sp = nullptr;
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  bool failed = false;
  std::string error;
};

std::mutex g_launch_mutex;
std::unordered_map<std::string, uint64_t> g_launch_counts;  // under g_launch_mutex
BlockRun g_run;
StackPool g_stacks;
void* g_dynamic_shared = nullptr;

thread_local int t_device = 0;  // cudaSetDevice
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaError_t t_detail_error = cudaSuccess;
thread_local std::string t_detail;

const char* ErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between devices";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t SetError(cudaError_t e, std::string detail) {
  t_last_error = e;
  t_detail_error = e;
  t_detail = std::string(ErrorName(e)) + " (cuda_emu: " + detail + ")";
  return e;
}

// ----------------------------------------------------------------------------- switching

void Resume(Fiber& f, const char* stack_base) {
  BlockRun& r = g_run;
  r.current = &f;
  threadIdx = f.tid;
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&r.scheduler_fake_stack, stack_base, kStackBytes);
#else
  (void)stack_base;
#endif
  cuda_emu_switch(&r.scheduler_sp, f.sp);
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(r.scheduler_fake_stack, nullptr, nullptr);
#endif
  r.current = nullptr;
}

// Back to the scheduler from the running fiber; returns when the scheduler resumes it.
void Yield() {
  BlockRun& r = g_run;
  Fiber& f = *r.current;
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&f.asan_fake_stack, r.scheduler_stack_bottom,
                                 r.scheduler_stack_size);
#endif
  cuda_emu_switch(&f.sp, r.scheduler_sp);
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, &r.scheduler_stack_bottom,
                                  &r.scheduler_stack_size);
#endif
}

void* g_exited_sp;  // where a leaving fiber's switch saves a stack pointer nobody resumes

// Leaves the running fiber for good. No locals of its own: ASan would leave their redzones
// poisoned on a stack the next block reuses (callers' frames are cleared by the
// __asan_handle_no_return the compiler puts before this noreturn call).
[[noreturn]] void ExitFiber() {
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, g_run.scheduler_stack_bottom,
                                 g_run.scheduler_stack_size);
#endif
  cuda_emu_switch(&g_exited_sp, g_run.scheduler_sp);
  __builtin_unreachable();
}

void ReleaseBarrier() {
  BlockRun& r = g_run;
  for (Fiber& f : r.fibers) {
    if (f.state == State::kAtBarrier) f.state = State::kReady;
  }
  r.barrier_result = r.barrier_predicates;
  r.barrier_predicates = 0;
  r.arrived = 0;
  ++r.barriers_completed;
}

void ThreadExited(Fiber& f) {
  BlockRun& r = g_run;
  Warp& w = r.warps[f.linear / 32];
  const uint32_t bit = 1u << (f.linear % 32);
  if (w.arrived != 0 && (w.mask & bit)) {
    KernelError("thread %d exited while lanes 0x%08x of its warp wait for it in %s(mask "
                "0x%08x)", f.linear, w.arrived, WarpOpName(w.op), w.mask);
  }
  f.state = State::kDone;
  w.exited |= bit;
  --r.live;
  if (r.arrived > 0 && r.arrived == r.live) ReleaseBarrier();
}

std::string DeadlockReport() {
  const BlockRun& r = g_run;
  int at_barrier = 0, at_warp = 0, first_barrier = -1, first_warp = -1;
  for (const Fiber& f : r.fibers) {
    if (f.state == State::kAtBarrier) {
      if (first_barrier < 0) first_barrier = f.linear;
      ++at_barrier;
    } else if (f.state == State::kAtWarpCollective) {
      if (first_warp < 0) first_warp = f.linear;
      ++at_warp;
    }
  }
  std::string s = "deadlock: " + std::to_string(at_barrier) +
                  " threads wait at __syncthreads (first: thread " +
                  std::to_string(first_barrier) + "), " + std::to_string(at_warp) +
                  " in warp collectives (first: thread " + std::to_string(first_warp) + ")";
  if (first_warp >= 0) {
    const Warp& w = r.warps[first_warp / 32];
    char buf[128];
    std::snprintf(buf, sizeof(buf), "; that warp waits in %s(mask 0x%08x), arrived 0x%08x",
                  WarpOpName(w.op), w.mask, w.arrived);
    s += buf;
  }
  return s;
}

// Runs every thread of the current block to completion (or to the first error).
void RunBlock(const dim3& block, uint64_t block_index, Schedule schedule) {
  BlockRun& r = g_run;
  const int n = int(block.x * block.y * block.z);
  r.threads = r.live = n;
  r.arrived = r.barrier_predicates = r.barrier_result = 0;
  r.barriers_completed = 0;
  r.temp_storage_uses.clear();
  r.fibers.assign(size_t(n), Fiber{});
  r.warps.assign(size_t((n + 31) / 32), Warp{});
  for (int i = 0; i < n; ++i) {
    Fiber& f = r.fibers[size_t(i)];
    f.linear = i;
    f.tid = uint3{unsigned(i) % block.x, unsigned(i) / block.x % block.y,
                  unsigned(i) / (block.x * block.y)};
    r.warps[size_t(i / 32)].lanes |= 1u << (i % 32);
    char* top = g_stacks.Get(size_t(i)) + kStackBytes;
    void** sp = reinterpret_cast<void**>(top) - 8;
    for (int k = 0; k < 8; ++k) sp[k] = nullptr;
    sp[3] = &f;                                            // r12
    sp[6] = reinterpret_cast<void*>(&cuda_emu_fiber_start);  // the first switch's return
    f.sp = sp;
  }
  for (int pass = 0; r.live > 0; ++pass) {
    // Alternating: each block starts the other way round from the one before it.
    const bool reverse = schedule == Schedule::kReverse ||
                         (schedule == Schedule::kAlternate && (pass + block_index) % 2 == 1);
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      const int i = reverse ? n - 1 - k : k;
      Fiber& f = r.fibers[size_t(i)];
      if (f.state != State::kReady) continue;
      Resume(f, g_stacks.Get(size_t(i)));
      ran = true;
      if (r.failed) return;
    }
    if (!ran) {
      r.failed = true;
      r.error = DeadlockReport();
      return;
    }
  }
}

bool ConfigError(const LaunchConfig& c, std::string* why) {
  const dim3 &g = c.grid, &b = c.block;
  char buf[256];
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) {
    std::snprintf(buf, sizeof(buf), "empty grid (%u, %u, %u) or block (%u, %u, %u)", g.x, g.y,
                  g.z, b.x, b.y, b.z);
  } else if (b.x > 1024 || b.y > 1024 || b.z > 64 ||
             uint64_t(b.x) * b.y * b.z > kMaxThreadsPerBlock) {
    std::snprintf(buf, sizeof(buf), "block (%u, %u, %u) exceeds 1024 threads or (1024, 1024, 64)",
                  b.x, b.y, b.z);
  } else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    std::snprintf(buf, sizeof(buf), "grid (%u, %u, %u) exceeds (2^31 - 1, 65535, 65535)", g.x,
                  g.y, g.z);
  } else {
    return false;
  }
  *why = std::string(c.kernel_name) + ": " + buf;
  return true;
}

std::mutex g_streams_mutex;
std::unordered_set<cudaStream_t> g_streams;
std::mutex g_allocations_mutex;
std::unordered_map<void*, uint64_t> g_allocations;  // cudaMalloc'd pointer -> its claim
std::mutex g_events_mutex;
std::unordered_set<cudaEvent_t> g_events;

// ----------------------------------------------------------------------------- devices

int DeviceCount() {
  static const int count = [] {
    const char* s = std::getenv("JAX_EP_CUDA_EMU_DEVICES");
    if (s == nullptr) return kDefaultDevices;
    const int n = std::atoi(s);
    if (n < 1 || n > kMaxDevices) {
      std::fprintf(stderr, "cuda_emu: JAX_EP_CUDA_EMU_DEVICES=%s: expected 1 to %d\n", s,
                   kMaxDevices);
      std::abort();
    }
    return n;
  }();
  return count;
}

bool IsDevice(int device) { return device >= 0 && device < DeviceCount(); }

// The device of a valid stream (the default stream is the current device's).
int StreamDevice(cudaStream_t stream) { return stream ? stream->device : t_device; }

// Whether JAX_EP_CUDA_EMU_NO_PEER_ACCESS ("a:b,c:d", pairs in either order; read at every
// call, so a test can set it) names the pair of devices {a, b}: those cannot reach each other,
// as GPUs without a P2P path (PCIe through some root complexes, many virtual machines).
bool NoPeerAccess(int a, int b) {
  const char* s = std::getenv("JAX_EP_CUDA_EMU_NO_PEER_ACCESS");
  for (const char* pair = s; pair != nullptr && *pair != '\0';) {
    int x = -1, y = -1;
    if (std::sscanf(pair, "%d:%d", &x, &y) == 2 &&
        ((x == a && y == b) || (x == b && y == a))) {
      return true;
    }
    pair = std::strchr(pair, ',');
    if (pair != nullptr) ++pair;
  }
  return false;
}

// peer_enabled[reader * kMaxDevices + owner]: cudaDeviceEnablePeerAccess(owner) ran on reader.
std::mutex g_peer_mutex;
bool g_peer_enabled[kMaxDevices * kMaxDevices];

bool PeerEnabled(int reader, int owner) {
  std::lock_guard<std::mutex> lock(g_peer_mutex);
  return g_peer_enabled[reader * kMaxDevices + owner];
}

// ----------------------------------------------------------------------------- claims

struct Claim {
  int device;
  uintptr_t begin, end;
};

std::mutex g_claims_mutex;
std::unordered_map<uint64_t, Claim> g_claims;
uint64_t g_next_claim = 1;

bool IsValidEvent(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  return g_events.count(event) != 0;
}

}  // namespace

// ----------------------------------------------------------------------------- device side

[[noreturn]] void KernelError(const char* format, ...) {
  char buf[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof(buf), format, args);
  va_end(args);
  BlockRun& r = g_run;
  if (r.current == nullptr) {
    std::fprintf(stderr, "cuda_emu: %s (outside a kernel)\n", buf);
    std::abort();
  }
  r.error = buf;
  r.failed = true;
  r.current->state = State::kDone;
  ExitFiber();
}

int BlockBarrier(int predicate) {
  BlockRun& r = g_run;
  if (r.current == nullptr) KernelError("__syncthreads outside a kernel");
  r.current->state = State::kAtBarrier;
  r.barrier_predicates += predicate;
  if (++r.arrived == r.live) ReleaseBarrier();
  Yield();
  return r.barrier_result;
}

int LinearThreadId() { return g_run.current->linear; }
int BlockThreads() { return g_run.threads; }

void CheckTempStorageReuse(const void* storage, const char* what) {
  const auto it = g_run.temp_storage_uses.find(storage);
  if (it != g_run.temp_storage_uses.end() && it->second == g_run.barriers_completed) {
    KernelError("%s: thread %d reuses the temporary storage at %p with no __syncthreads() "
                "since its previous use (CUB requires one)", what, LinearThreadId(), storage);
  }
}

void RecordTempStorageUse(const void* storage) {
  g_run.temp_storage_uses[storage] = g_run.barriers_completed;
}

uint64_t WarpCollective(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  BlockRun& r = g_run;
  if (r.current == nullptr) KernelError("%s outside a kernel", WarpOpName(op));
  Fiber& f = *r.current;
  Warp& w = r.warps[size_t(f.linear / 32)];
  const int lane = f.linear % 32;
  const uint32_t bit = 1u << lane;
  const char* name = WarpOpName(op);
  if (!(mask & bit)) {
    KernelError("%s: thread %d (lane %d) is not in its own mask 0x%08x", name, f.linear, lane,
                mask);
  }
  if (mask & ~w.lanes) {
    KernelError("%s: mask 0x%08x names lanes 0x%08x that do not exist in a block of %d threads",
                name, mask, mask & ~w.lanes, r.threads);
  }
  if (mask & w.exited) {
    KernelError("%s: mask 0x%08x names lanes 0x%08x whose threads have exited", name, mask,
                mask & w.exited);
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    KernelError("%s: width %d is not a power of two in [1, 32]", name, width);
  }
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
  } else if (w.mask != mask || w.op != op) {
    KernelError("divergent warp collectives: thread %d calls %s(mask 0x%08x) while lanes 0x%08x "
                "of its warp wait in %s(mask 0x%08x)", f.linear, name, mask, w.arrived,
                WarpOpName(w.op), w.mask);
  }
  w.value[lane] = value;
  w.arg[lane] = arg;
  w.width[lane] = width;
  w.arrived |= bit;
  f.state = State::kAtWarpCollective;
  if (w.arrived == mask) {
    uint64_t votes = 0;
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) && w.value[l]) votes |= uint64_t(1) << l;
    }
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      const int seg = l & ~(w.width[l] - 1);
      int src = l;
      switch (op) {
        case WarpOp::kSync: w.result[l] = 0; continue;
        case WarpOp::kBallot: w.result[l] = votes; continue;
        case WarpOp::kAll: w.result[l] = votes == mask; continue;
        case WarpOp::kAny: w.result[l] = votes != 0; continue;
        case WarpOp::kShfl: src = seg + (w.arg[l] & (w.width[l] - 1)); break;
        case WarpOp::kShflUp: src = l - w.arg[l]; break;
        case WarpOp::kShflDown: src = l + w.arg[l]; break;
        case WarpOp::kShflXor: src = l ^ w.arg[l]; break;
      }
      if (src < seg || src >= seg + w.width[l]) src = l;  // outside the segment: own value
      if (!(mask >> src & 1u)) {
        KernelError("%s: lane %d reads lane %d, which is not in the mask 0x%08x (undefined on "
                    "the device)", name, l, src, mask);
      }
      w.result[l] = w.value[src];
    }
    const int base = f.linear - lane;
    for (int l = 0; l < 32; ++l) {
      if (mask >> l & 1u) r.fibers[size_t(base + l)].state = State::kReady;
    }
    w.arrived = 0;
  }
  Yield();
  return w.result[lane];
}

void* DynamicSharedMemory() { return g_dynamic_shared; }

uint64_t ClaimMemory(int device, const void* data, size_t bytes) {
  if (!IsDevice(device)) {
    std::fprintf(stderr, "cuda_emu: ClaimMemory for device %d of %d\n", device, DeviceCount());
    std::abort();
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_claims_mutex);
  const uint64_t id = g_next_claim++;
  g_claims[id] = Claim{device, begin, begin + bytes};
  return id;
}

void ReleaseMemory(uint64_t claim) {
  std::lock_guard<std::mutex> lock(g_claims_mutex);
  g_claims.erase(claim);
}

void CheckPeerRead(const void* data, size_t bytes) {
  const int reader = g_run.device;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  int refused = -1;  // a device that claims the range and whose memory the reader may not read
  {
    std::lock_guard<std::mutex> lock(g_claims_mutex);
    for (const auto& [id, claim] : g_claims) {
      if (claim.end <= begin || end <= claim.begin) continue;
      if (claim.device == reader || PeerEnabled(reader, claim.device)) return;
      refused = claim.device;
    }
  }
  if (refused >= 0) {
    KernelError("thread %d on device %d reads %zu bytes at %p, memory of device %d, without "
                "peer access: device %d never called cudaDeviceEnablePeerAccess(%d)",
                LinearThreadId(), reader, bytes, data, refused, reader, refused);
  }
}

std::vector<std::pair<std::string, uint64_t>> LaunchCounts(bool reset) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  std::vector<std::pair<std::string, uint64_t>> counts(g_launch_counts.begin(),
                                                       g_launch_counts.end());
  if (reset) g_launch_counts.clear();
  std::sort(counts.begin(), counts.end());
  return counts;
}

std::string KernelFromPrettyFunction(const char* pretty_function) {
  std::string s = pretty_function;
  const size_t with = s.find("Kernel = ");
  if (with != std::string::npos) s = s.substr(with + 9);
  if (!s.empty() && s.back() == ']') s.pop_back();
  for (const char* drop : {"{anonymous}::", "(anonymous namespace)::"}) {
    for (size_t at; (at = s.find(drop)) != std::string::npos;) s.erase(at, std::strlen(drop));
  }
  if (s.size() > 3 && s.compare(0, 2, "(&") == 0 && s.back() == ')') s = s.substr(2, s.size() - 3);
  while (!s.empty() && (s.front() == '&' || s.front() == ' ')) s.erase(0, 1);
  return s;
}


bool IsValidStream(cudaStream_t stream) {
  if (stream == nullptr) return true;
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  return g_streams.count(stream) != 0;
}

void Launch(const LaunchConfig& config, void (*thread_main)(void*), void* context) {
  std::string why;
  if (!IsValidStream(config.stream)) {
    SetError(cudaErrorInvalidResourceHandle, std::string(config.kernel_name) +
                                                 ": launched on a stream this runtime did not make");
    return;
  }
  if (StreamDevice(config.stream) != t_device) {
    SetError(cudaErrorInvalidResourceHandle,
             std::string(config.kernel_name) + ": launched on a stream of device " +
                 std::to_string(StreamDevice(config.stream)) + " while device " +
                 std::to_string(t_device) + " is current");
    return;
  }
  if (ConfigError(config, &why)) {
    SetError(cudaErrorInvalidConfiguration, why);
    return;
  }
  if (config.dynamic_shared_bytes > kMaxDynamicSharedBytes) {
    SetError(cudaErrorInvalidValue,
             std::string(config.kernel_name) + ": " +
                 std::to_string(config.dynamic_shared_bytes) +
                 " bytes of dynamic shared memory exceed the 48 KiB default limit");
    return;
  }
  static const Schedule schedule = ScheduleFromEnv();
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  ++g_launch_counts[config.instance];
  BlockRun& r = g_run;
  r.thread_main = thread_main;
  r.context = context;
  r.device = t_device;
  r.failed = false;
  // Exactly the launch's bytes, so an access past them is a heap overflow for ASan.
  g_dynamic_shared = std::malloc(config.dynamic_shared_bytes);
  const unsigned mxcsr = _mm_getcsr();
  _mm_setcsr(mxcsr & ~(kMxcsrFlushToZero | kMxcsrDenormalsAreZero));
  gridDim = config.grid;
  blockDim = config.block;
  for (unsigned z = 0; z < config.grid.z && !r.failed; ++z) {
    for (unsigned y = 0; y < config.grid.y && !r.failed; ++y) {
      for (unsigned x = 0; x < config.grid.x && !r.failed; ++x) {
        blockIdx = uint3{x, y, z};
        if (g_dynamic_shared) std::memset(g_dynamic_shared, 0xcd, config.dynamic_shared_bytes);
        RunBlock(config.block, (uint64_t(z) * config.grid.y + y) * config.grid.x + x, schedule);
      }
    }
  }
  _mm_setcsr(mxcsr);
  std::free(g_dynamic_shared);
  g_dynamic_shared = nullptr;
  if (r.failed) {
    g_stacks.UnpoisonAll();  // abandoned fibers leave their frames' redzones behind
    char where[96];
    std::snprintf(where, sizeof(where), " in block (%u, %u, %u): ", blockIdx.x, blockIdx.y,
                  blockIdx.z);
    SetError(cudaErrorLaunchFailure, std::string(config.kernel_name) + where + r.error);
  }
}

}  // namespace cuda_emu

extern "C" void cuda_emu_fiber_main(cuda_emu::Fiber* f) {
  cuda_emu::BlockRun& r = cuda_emu::g_run;
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r.scheduler_stack_bottom, &r.scheduler_stack_size);
#endif
  r.thread_main(r.context);
  cuda_emu::ThreadExited(*f);
  cuda_emu::ExitFiber();
}

unsigned __activemask() {
  const cuda_emu::BlockRun& r = cuda_emu::g_run;
  const cuda_emu::Warp& w = r.warps[size_t(r.current->linear / 32)];
  return w.lanes & ~w.exited;
}

// ----------------------------------------------------------------------------- runtime API

extern "C" {

cudaError_t cudaGetLastError() {
  const cudaError_t e = cuda_emu::t_last_error;
  cuda_emu::t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return cuda_emu::t_last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  if (error != cudaSuccess && error == cuda_emu::t_detail_error) {
    return cuda_emu::t_detail.c_str();
  }
  return cuda_emu::ErrorName(error);
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return cuda_emu::SetError(cudaErrorInvalidValue, "cudaMalloc(nullptr)");
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (posix_memalign(ptr, 256, bytes) != 0) {
    return cuda_emu::SetError(cudaErrorMemoryAllocation,
                              "cudaMalloc of " + std::to_string(bytes) + " bytes");
  }
  const uint64_t claim = cuda_emu::ClaimMemory(cuda_emu::t_device, *ptr, bytes);
  std::lock_guard<std::mutex> lock(cuda_emu::g_allocations_mutex);
  cuda_emu::g_allocations[*ptr] = claim;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  uint64_t claim = 0;
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_allocations_mutex);
    const auto found = cuda_emu::g_allocations.find(ptr);
    if (found == cuda_emu::g_allocations.end()) {
      return cuda_emu::SetError(cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc did not "
                                                       "return");
    }
    claim = found->second;
    cuda_emu::g_allocations.erase(found);
  }
  cuda_emu::ReleaseMemory(claim);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (!cuda_emu::IsValidStream(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: bad stream");
  }
  if (unsigned(kind) > cudaMemcpyDefault || (bytes && (dst == nullptr || src == nullptr))) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaMemcpyAsync: bad pointer or kind");
  }
  if (bytes) std::memcpy(dst, src, bytes);  // ASan reports overlapping ranges, as CUDA forbids
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  if (!cuda_emu::IsValidStream(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: bad stream");
  }
  if (bytes && ptr == nullptr) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaMemsetAsync(nullptr)");
  }
  if (bytes) std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  if (stream == nullptr) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaStreamCreate(nullptr)");
  }
  static uint64_t next_id = 1;
  std::lock_guard<std::mutex> lock(cuda_emu::g_streams_mutex);
  *stream = new CUstream_st{next_id++, cuda_emu::t_device};
  cuda_emu::g_streams.insert(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(cuda_emu::g_streams_mutex);
  if (stream == nullptr || cuda_emu::g_streams.erase(stream) == 0) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: bad stream");
  }
  delete stream;
  return cudaSuccess;
}

// Every operation ran when it was issued: synchronising only checks the handle.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!cuda_emu::IsValidStream(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: bad "
                                                              "stream");
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// ----------------------------------------------------------------------------- devices

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaGetDeviceCount(nullptr)");
  }
  *count = cuda_emu::DeviceCount();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (!cuda_emu::IsDevice(device)) {
    return cuda_emu::SetError(cudaErrorInvalidDevice,
                              "cudaSetDevice(" + std::to_string(device) + ") of " +
                                  std::to_string(cuda_emu::DeviceCount()) + " devices");
  }
  cuda_emu::t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cuda_emu::SetError(cudaErrorInvalidValue, "cudaGetDevice(nullptr)");
  *device = cuda_emu::t_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* can_access, int device, int peer) {
  if (can_access == nullptr) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaDeviceCanAccessPeer(nullptr, ...)");
  }
  if (!cuda_emu::IsDevice(device) || !cuda_emu::IsDevice(peer)) {
    return cuda_emu::SetError(cudaErrorInvalidDevice,
                              "cudaDeviceCanAccessPeer(" + std::to_string(device) + ", " +
                                  std::to_string(peer) + ")");
  }
  // as CUDA: a device is not its own peer
  *can_access = device != peer && !cuda_emu::NoPeerAccess(device, peer);
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  const int device = cuda_emu::t_device;
  const std::string call = "cudaDeviceEnablePeerAccess(" + std::to_string(peer) + ") on device " +
                           std::to_string(device);
  if (flags != 0) return cuda_emu::SetError(cudaErrorInvalidValue, call + ": flags must be 0");
  if (!cuda_emu::IsDevice(peer) || peer == device) {
    return cuda_emu::SetError(cudaErrorInvalidDevice, call);
  }
  if (cuda_emu::NoPeerAccess(device, peer)) {
    return cuda_emu::SetError(cudaErrorPeerAccessUnsupported, call);
  }
  std::lock_guard<std::mutex> lock(cuda_emu::g_peer_mutex);
  bool& enabled = cuda_emu::g_peer_enabled[device * cuda_emu::kMaxDevices + peer];
  if (enabled) return cuda_emu::SetError(cudaErrorPeerAccessAlreadyEnabled, call);
  enabled = true;
  return cudaSuccess;
}

// ----------------------------------------------------------------------------- events

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  constexpr unsigned kKnown =
      cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (event == nullptr || (flags & ~kKnown) ||
      ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaEventCreateWithFlags: bad pointer or "
                                                     "flags " + std::to_string(flags));
  }
  *event = new CUevent_st{cuda_emu::t_device};
  std::lock_guard<std::mutex> lock(cuda_emu::g_events_mutex);
  cuda_emu::g_events.insert(*event);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  {
    std::lock_guard<std::mutex> lock(cuda_emu::g_events_mutex);
    if (cuda_emu::g_events.erase(event) == 0) {
      return cuda_emu::SetError(cudaErrorInvalidResourceHandle,
                                "cudaEventDestroy: an event this runtime did not make or "
                                "already destroyed");
    }
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!cuda_emu::IsValidEvent(event) || !cuda_emu::IsValidStream(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle,
                              "cudaEventRecord: an unknown or destroyed event, or a bad stream");
  }
  if (event->device != cuda_emu::StreamDevice(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle,
                              "cudaEventRecord: the event is device " +
                                  std::to_string(event->device) + "'s, the stream device " +
                                  std::to_string(cuda_emu::StreamDevice(stream)) + "'s");
  }
  return cudaSuccess;  // the stream's work has run: the event completes at once
}

// Legal for an event of another device than the stream's (CUDA's rule).
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags) {
  if (!cuda_emu::IsValidEvent(event) || !cuda_emu::IsValidStream(stream)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle,
                              "cudaStreamWaitEvent: an unknown or destroyed event, or a bad "
                              "stream");
  }
  if (flags != 0) {
    return cuda_emu::SetError(cudaErrorInvalidValue, "cudaStreamWaitEvent: flags must be 0");
  }
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!cuda_emu::IsValidEvent(event)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaEventQuery: bad event");
  }
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!cuda_emu::IsValidEvent(event)) {
    return cuda_emu::SetError(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: bad event");
  }
  return cudaSuccess;
}

}  // extern "C"

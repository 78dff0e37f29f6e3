// The peer exchange, CPU handler: the ranks of an expert axis that live in this process move
// routed rows by reading each other's buffers, as DeepEP's intranode kernels do over NVLink.
//
// peer_exchange: src [M, ...] any dtype, row_map i32[S], send_offsets i32[P],
//   send_counts i32[P], dest_offsets i32[P], coords i32[2] -> out [R, ...] (src's dtype and row
//   shape), recv_counts i32[P].
//   Rank r's rows for rank q are its compact send rows send_offsets[q] .. + send_counts[q];
//   compact row j holds src[row_map[j]] (a zero row when row_map[j] is outside [0, M)), so the
//   sender never packs them. They land in q's out at rows dest_offsets[q] onward. Rows of out
//   that no sender writes are zero; recv_counts[p] = the rows that came from rank p (the
//   counts travel in the same call). coords = (rank on the axis, index of the group along the
//   other mesh axes). Attributes: op_id (the call's id in its program), num_ranks (P),
//   num_devices (every device running the program), axis (its name, for messages),
//   timeout_ms (the bound of each wait).
//
// Each device's call runs on its own thread of XLA:CPU's pool. The devices meet
// (peer_meeting.h) and publish their arguments; each receiver copies exactly its rows
// straight from the senders' src into its out, on its own thread; they meet again before any
// returns, so no src is released while a peer reads it. Every check runs before the copy: a
// bad argument on any device fails the call on every device with the same message.
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"
#include "cpu_util.h"
#include "peer_checks.h"
#include "peer_meeting.h"

namespace jax_ep {
namespace {

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
  std::string error;  // a check that failed on this device
};

using Attrs = PeerAttrs;

std::string Where(const Attrs& a, const CpuSide& side) {
  return "peer transport (axis '" + std::string(a.axis) + "', op " + std::to_string(a.op_id) +
         ", rank " + std::to_string(side.rank) + " of group " + std::to_string(side.group) +
         " on device " + std::to_string(side.device) + "): ";
}

// The checks of one device's own arguments: shapes and attributes (peer_checks.h), then the
// values of coords and the send blocks; "" when they hold.
std::string CheckSide(const Attrs& a, Any src, I32 row_map, I32 send_offsets, I32 send_counts,
                      I32 dest_offsets, I32 coords, AnyOut& out, I32Out& recv_counts) {
  std::string shape_error = PeerShapeError(a, src, row_map, send_offsets, send_counts,
                                           dest_offsets, coords, out, recv_counts);
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

// Rank p of `group` among the meeting's sides, null if none; *duplicate if several.
const CpuSide* FindPeer(const peer::Meeting& meeting, int32_t group, int32_t p, bool* duplicate) {
  const CpuSide* found = nullptr;
  for (const void* published : meeting.published) {
    const auto* side = static_cast<const CpuSide*>(published);
    if (side->group != group || side->rank != p) continue;
    if (found) *duplicate = true;
    found = side;
  }
  return found;
}

// Who of `me`'s group did not arrive at a meeting that timed out.
std::string DescribeMissing(const peer::Meeting& meeting, const CpuSide& me, int64_t P) {
  std::string missing;
  for (int32_t p = 0; p < P; ++p) {
    bool duplicate = false;
    if (!FindPeer(meeting, me.group, p, &duplicate)) {
      missing += (missing.empty() ? "" : ",") + std::to_string(p);
    }
  }
  return missing.empty() ? "every rank of group " + std::to_string(me.group) +
                               " arrived; another group did not"
                         : "missing rank(s) " + missing + " of group " +
                               std::to_string(me.group);
}

// The senders of `me`, by rank, once every side's checks held; "" or what is wrong.
std::string Senders(const peer::Meeting& meeting, const CpuSide& me, int64_t P, int64_t out_rows,
                    std::vector<const CpuSide*>* senders) {
  for (const void* published : meeting.published) {
    const auto* side = static_cast<const CpuSide*>(published);
    if (!side->error.empty()) {
      return "rank " + std::to_string(side->rank) + " of group " + std::to_string(side->group) +
             " (device " + std::to_string(side->device) + "): " + side->error;
    }
  }
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [begin, end) of each sender's rows in out
  for (int32_t p = 0; p < P; ++p) {
    bool duplicate = false;
    const CpuSide* side = FindPeer(meeting, me.group, p, &duplicate);
    if (!side || duplicate) {
      return "rank " + std::to_string(p) + " of group " + std::to_string(me.group) +
             (duplicate ? " is claimed by several devices" : " is not among the devices") +
             ": every mesh axis must be manual in the enclosing shard_map";
    }
    if (side->dtype != me.dtype || side->row_bytes != me.row_bytes) {
      return "rank " + std::to_string(p) + " sends rows of another dtype or width";
    }
    const int64_t begin = side->dest_offsets[me.rank], count = side->send_counts[me.rank];
    if (begin < 0 || begin + count > out_rows) {
      return "rank " + std::to_string(p) + " sends rows " + std::to_string(begin) + " + " +
             std::to_string(count) + ", outside this rank's " + std::to_string(out_rows) +
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

// out = every sender's rows for `me` at their destination rows, zero elsewhere.
void CopyFromSenders(const std::vector<const CpuSide*>& senders, const CpuSide& me,
                     int64_t out_rows, uint8_t* out, int32_t* recv_counts) {
  const int64_t row_bytes = me.row_bytes;
  AdviseHugePages(out, out_rows * row_bytes);
  const bool streaming = out_rows * row_bytes >= kStreamingStoreBytes;
  auto write = [&](int64_t r, const uint8_t* row) {
    if (streaming) {
      StreamRow(out + r * row_bytes, row, row_bytes);
    } else {
      CopyOrZeroRow(out + r * row_bytes, row, row_bytes);
    }
  };
  std::vector<bool> written(out_rows, false);
  for (size_t p = 0; p < senders.size(); ++p) {
    const CpuSide& from = *senders[p];
    const int64_t begin = from.dest_offsets[me.rank], count = from.send_counts[me.rank];
    const int32_t* rows = from.row_map + from.send_offsets[me.rank];
    for (int64_t j = 0; j < count; ++j) {
      const int64_t s = rows[j];
      write(begin + j, s >= 0 && s < from.src_rows ? from.src + s * row_bytes : nullptr);
      written[begin + j] = true;
    }
    recv_counts[p] = int32_t(count);
  }
  for (int64_t r = 0; r < out_rows; ++r) {
    if (!written[r]) write(r, nullptr);
  }
  if (streaming) StreamingFence();
}

ffi::Error PeerExchangeCpu(ffi::RunId run_id, int32_t device, Any src, I32 row_map,
                           I32 send_offsets, I32 send_counts, I32 dest_offsets, I32 coords,
                           int64_t op_id, int64_t num_ranks, int64_t num_devices,
                           int64_t timeout_ms, std::string_view axis, AnyOut out,
                           I32Out recv_counts) {
  const Attrs a{op_id, num_ranks, num_devices, timeout_ms, axis};
  CpuSide me;
  me.device = device;
  me.error = CheckSide(a, src, row_map, send_offsets, send_counts, dest_offsets, coords, out,
                       recv_counts);
  if (coords.element_count() == 2) {
    me.rank = coords.typed_data()[0];
    me.group = coords.typed_data()[1];
  }
  int64_t out_rows = 0, width = 0;
  RowsAndWidth(*out, &out_rows, &width);
  RowsAndWidth(src, &me.src_rows, &width);
  me.src = static_cast<const uint8_t*>(src.untyped_data());
  me.row_bytes = width * int64_t(ffi::ByteWidth(src.element_type()));
  me.dtype = src.element_type();
  me.row_map = row_map.typed_data();
  me.send_offsets = send_offsets.typed_data();
  me.send_counts = send_counts.typed_data();
  me.dest_offsets = dest_offsets.typed_data();
  if (num_devices < 1 || timeout_ms <= 0) {  // no meeting can be held
    return ffi::Error::InvalidArgument(Where(a, me) + me.error);
  }

  const auto bound = std::chrono::milliseconds(timeout_ms);
  const peer::Rendezvous::Key key{run_id.run_id, op_id};
  auto& rendezvous = peer::Rendezvous::Global();
  std::string error;
  auto meeting = rendezvous.Arrive(
      key, device, int(num_devices), &me, bound,
      [&](const peer::Meeting& m) { return DescribeMissing(m, me, num_ranks); }, &error);
  if (!meeting) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, Where(a, me) + error);

  std::vector<const CpuSide*> senders;
  std::string wrong = Senders(*meeting, me, num_ranks, out_rows, &senders);
  if (wrong.empty()) {
    CopyFromSenders(senders, me, out_rows, static_cast<uint8_t*>(out->untyped_data()),
                    recv_counts->typed_data());
  }
  // The second meeting also follows a failed check: every device leaves the meeting together.
  if (!rendezvous.Depart(key, meeting, 10 * bound, &error)) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, Where(a, me) + error);
  }
  if (!wrong.empty()) return ffi::Error::InvalidArgument(Where(a, me) + wrong);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpPeerExchangeCpu, jax_ep::PeerExchangeCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::Any>()        // src [M, ...]
                                  .Arg<jax_ep::I32>()        // row_map [S]
                                  .Arg<jax_ep::I32>()        // send_offsets [P]
                                  .Arg<jax_ep::I32>()        // send_counts [P]
                                  .Arg<jax_ep::I32>()        // dest_offsets [P]
                                  .Arg<jax_ep::I32>()        // coords [2]: rank, group
                                  .Attr<int64_t>("op_id")
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_devices")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<std::string_view>("axis")
                                  .Ret<jax_ep::Any>()        // out [R, ...]
                                  .Ret<jax_ep::I32>());      // recv_counts [P]

// The peer exchange's attributes and the checks of one device's own arguments that need no
// look at their values (shapes, dtypes, attributes): shared by the CPU handler (peer.cc) and
// the CUDA handler (peer.cu), so both refuse the same calls with the same message. The CPU
// handler also checks the values (coords, send blocks); the CUDA handler cannot read them on
// the host (peer.cu says what its kernel does instead).
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "common.h"

namespace jax_ep {

struct PeerAttrs {
  int64_t site, num_ranks, num_devices, timeout_ms;  // site: the instruction's Site number
  int64_t num_recv;  // R, rows of the receive layout the senders' dest_offsets index
  bool gather;       // out = rows recv_rows of that layout, instead of the layout itself
  std::string_view axis;
};

// What is wrong with the shapes and attributes of one device's call; "" when they hold.
// src [M, ...], row_map i32[S], send_offsets / send_counts / dest_offsets i32[P], coords i32[2],
// recv_rows i32[N], out [R or N, ...] (src's dtype and row shape), recv_counts i32[P].
inline std::string PeerShapeError(const PeerAttrs& a, const Any& src, const I32& row_map,
                                  const I32& send_offsets, const I32& send_counts,
                                  const I32& dest_offsets, const I32& coords,
                                  const I32& recv_rows, AnyOut& out, I32Out& recv_counts) {
  if (IsSubByte(src.element_type())) return SubByteError("src");
  const int64_t P = a.num_ranks;
  if (P < 1 || a.num_devices < P || a.num_devices % P != 0) {
    return "num_ranks " + std::to_string(P) + " must divide num_devices " +
           std::to_string(a.num_devices);
  }
  if (a.timeout_ms <= 0) return "timeout_ms must be positive";
  for (auto [buf, name] : {std::pair{&send_offsets, "send_offsets"},
                           std::pair{&send_counts, "send_counts"},
                           std::pair{&dest_offsets, "dest_offsets"}}) {
    if (buf->dimensions().size() != 1 || buf->dimensions()[0] != P) {
      return std::string(name) + ": expected shape [" + std::to_string(P) + "], got " +
             ShapeString(buf->dimensions());
    }
  }
  if (recv_counts->element_count() != size_t(P)) return "recv_counts: expected P elements";
  if (row_map.dimensions().size() != 1) {
    return "row_map: expected rank 1, got shape " + ShapeString(row_map.dimensions());
  }
  if (coords.element_count() != 2) {
    return "coords: expected shape [2], got " + ShapeString(coords.dimensions());
  }
  if (recv_rows.dimensions().size() != 1) {
    return "recv_rows: expected rank 1, got shape " + ShapeString(recv_rows.dimensions());
  }
  if (a.num_recv < 0) return "num_recv must be >= 0, got " + std::to_string(a.num_recv);
  int64_t src_rows, src_width, out_rows, out_width;
  RowsAndWidth(src, &src_rows, &src_width);
  RowsAndWidth(*out, &out_rows, &out_width);
  if (src.dimensions().size() == 0 || out->element_type() != src.element_type() ||
      out_width != src_width) {
    return "out: expected rows shaped and typed like src " + ShapeString(src.dimensions()) +
           ", got " + ShapeString(out->dimensions());
  }
  const int64_t want = a.gather ? recv_rows.dimensions()[0] : a.num_recv;
  if (out_rows != want) {
    return "out: expected " + std::to_string(want) + " rows (" +
           (a.gather ? "recv_rows" : "num_recv") + "), got shape " +
           ShapeString(out->dimensions());
  }
  return "";
}

}  // namespace jax_ep

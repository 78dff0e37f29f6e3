// Grouped GEMM, CPU handlers: the rows of lhs in consecutive groups, each group times its own
// matrix, float32 in and out, float32 accumulation. On GPUs the family is XLA's own
// (jax.lax.ragged_dot, cuBLAS), so there is no CUDA twin.
//
// grouped_gemm: lhs f32[M,K], rhs f32[G,K,N] (transpose_rhs: f32[G,N,K], each used as its
//   transpose), group_sizes s32[G] -> out f32[M,N], out[r] = lhs[r] @ rhs[g] for the rows r of
//   group g; rows past the groups are 0.
// grouped_gemm_dw: lhs f32[M,K], rhs f32[M,N], group_sizes s32[G] -> out f32[G,K,N],
//   out[g] = lhs_g^T @ rhs_g over the rows of group g (0 for an empty group).
// Groups are consecutive from row 0; a negative size counts as 0 and a sum above M is cut at M.
//
// Each (group, column panel of kPanel columns) is one task on XLA's intra-op pool. A task runs
// a register tile of kRows x kPanel outputs down the group's rows: kRows x kPanelVectors SIMD
// accumulators; per step of the depth (in blocks of kDepth), kPanelVectors loads of the
// right-hand panel and one broadcast of a left-hand value per row. A row-major right-hand
// panel is read where it lies; a transposed one (in squares of kLanes x kLanes, transposed in
// registers), or the last (narrower) panel, is first packed contiguously (zero columns past
// N). dw streams an output of kStreamingStoreBytes or more past the caches. Compiled with the
// build's SIMD width (AVX-512, AVX or 4 lanes) and contraction on: fused multiply-adds where
// the ISA has them (-march=native).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu_util.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jax_ep {
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16, kPanelVectors = 4;  // 24 of the 32 zmm registers accumulate
#elif defined(__AVX__)
constexpr int kLanes = 8, kPanelVectors = 2;  // 12 of the 16 ymm registers accumulate
#else
constexpr int kLanes = 4, kPanelVectors = 2;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int kRows = 6;
constexpr int64_t kPanel = kLanes * kPanelVectors;
constexpr int64_t kDepth = 256;

// A strided matrix view: element (i, j) at data[i * row_stride + j * col_stride].
struct View {
  const float* data;
  int64_t row_stride, col_stride;
  const float* At(int64_t i, int64_t j) const { return data + i * row_stride + j * col_stride; }
};

Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One stage of a kLanes x kLanes transpose held in rows r[0..kLanes): within every 2D x 2D
// block, the upper-right and lower-left D x D blocks change places (rows i and i + D, i's bit
// D clear: row i takes row i + D's lanes j - D for the lanes j with bit D set, and gives its
// lanes j + D for the lanes j with bit D clear). The stages D = kLanes/2, ..., 1 together
// swap the row and column index bits: the transpose. J...: the lane indices 0..kLanes-1, so
// each mask is a constant.
template <int D, size_t... J>
void TransposeStage(Vec (&r)[kLanes], std::index_sequence<J...>) {
  for (int i = 0; i < kLanes; ++i) {
    if (i & D) continue;
    const Vec upper = __builtin_shufflevector(r[i], r[i + D], ((J & D) ? kLanes + J - D : J)...);
    r[i + D] = __builtin_shufflevector(r[i], r[i + D], ((J & D) ? kLanes + J : J + D)...);
    r[i] = upper;
  }
}

template <int D>
void TransposeStages(Vec (&r)[kLanes]) {
  TransposeStage<D>(r, std::make_index_sequence<kLanes>{});
  if constexpr (D > 1) TransposeStages<D / 2>(r);
}

// packed[p * kPanel + j] = b(p0 + p, j0 + j) for p < depth, j < cols; 0 for cols <= j < kPanel.
// A transposed b (row_stride 1) is read along its contiguous columns kLanes x kLanes at a
// time, each square transposed in registers and stored as whole rows of the panel.
void PackPanel(View b, int64_t p0, int64_t depth, int64_t j0, int64_t cols, float* packed) {
  if (b.row_stride == 1) {
    const int64_t whole_depth = depth - depth % kLanes, whole_cols = cols - cols % kLanes;
    for (int64_t q = 0; q < whole_depth; q += kLanes) {
      for (int64_t j = 0; j < whole_cols; j += kLanes) {
        Vec square[kLanes];  // square[i][t] = b(p0 + q + t, j0 + j + i)
        for (int i = 0; i < kLanes; ++i) square[i] = LoadVec(b.At(p0 + q, j0 + j + i));
        TransposeStages<kLanes / 2>(square);  // now square[t][i]
        for (int t = 0; t < kLanes; ++t) {
          std::memcpy(packed + (q + t) * kPanel + j, &square[t], sizeof(Vec));
        }
      }
    }
    for (int64_t j = 0; j < cols; ++j) {  // the columns and depth the squares left
      const float* src = b.At(p0, j0 + j);
      for (int64_t p = j < whole_cols ? whole_depth : 0; p < depth; ++p) {
        packed[p * kPanel + j] = src[p];
      }
    }
  }
  for (int64_t p = 0; p < depth; ++p) {
    float* dst = packed + p * kPanel;
    if (b.row_stride != 1) std::memcpy(dst, b.At(p0 + p, j0), cols * sizeof(float));
    std::fill(dst + cols, dst + kPanel, 0.0f);
  }
}

// How a tile's sums reach c: overwriting it, added to it, or overwriting it with streaming
// (non-temporal) stores, which skip reading c's lines first (an output larger than the caches
// is then written once instead of read and written).
enum class Store { kOverwrite, kAccumulate, kStream };

// *dst = v, streamed where dst is aligned to a whole vector (x86-64 only, as StreamingFence;
// a plain store elsewhere). Call StreamingFence() before the bytes are handed to another
// thread.
void StoreVec(float* dst, Vec v, Store store) {
#if defined(__x86_64__)
  if (store == Store::kStream && reinterpret_cast<uintptr_t>(dst) % sizeof(Vec) == 0) {
#if defined(__AVX512F__)
    __m512 x;
#elif defined(__AVX__)
    __m256 x;
#else
    __m128 x;
#endif
    static_assert(sizeof(x) == sizeof(Vec), "one register per vector");
    std::memcpy(&x, &v, sizeof(x));
#if defined(__AVX512F__)
    _mm512_stream_ps(dst, x);
#elif defined(__AVX__)
    _mm256_stream_ps(dst, x);
#else
    _mm_stream_ps(dst, x);
#endif
    return;
  }
#endif
  std::memcpy(dst, &v, sizeof(v));
}

// c[r, j] (+)= sum_p a(r, p) * b[p * ldb + j] for r < R, j < cols (c row stride ldc; b holds
// kPanel readable columns per row), stored as `store` says. The accumulators and the loaded
// vectors are only ever copied by value, so they stay in registers.
template <int R>
void Tile(View a, const float* b_panel, int64_t ldb, int64_t depth, float* c, int64_t ldc,
          int64_t cols, Store store) {
  Vec acc[R][kPanelVectors] = {};
  for (int64_t p = 0; p < depth; ++p) {
    Vec b[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) b[v] = LoadVec(b_panel + p * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float s = *a.At(r, p);
      for (int v = 0; v < kPanelVectors; ++v) acc[r][v] += s * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    for (int v = 0; v < kPanelVectors; ++v) {
      const int64_t j0 = v * kLanes, n = std::min<int64_t>(kLanes, cols - j0);
      if (n <= 0) break;
      Vec sums = acc[r][v];
      const bool accumulate = store == Store::kAccumulate;
      if (n == kLanes) {
        if (accumulate) sums += LoadVec(row + j0);
        StoreVec(row + j0, sums, store);
      } else {
        for (int64_t j = 0; j < n; ++j) row[j0 + j] = accumulate ? row[j0 + j] + sums[j] : sums[j];
      }
    }
  }
}

using TileFn = void (*)(View, const float*, int64_t, int64_t, float*, int64_t, int64_t, Store);
constexpr TileFn kTiles[kRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>,
                                      Tile<4>, Tile<5>, Tile<6>};

// Columns [j0, j0 + cols) of c[rows, .] (row stride ldc) = a[rows, depth] @ b[depth, .],
// cols <= kPanel; `packed` holds kDepth x kPanel floats. A whole panel of a row-major b is
// read where it lies; a transposed b, or the last columns, are packed first. `stream`: c is
// written with streaming stores where the whole depth is one block (c is never read back).
void PanelProduct(View a, View b, int64_t rows, int64_t depth, int64_t j0, int64_t cols,
                  float* c, int64_t ldc, float* packed, bool stream) {
  if (depth == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(c + r * ldc + j0, c + r * ldc + j0 + cols, 0.f);
    return;
  }
  const bool in_place = b.col_stride == 1 && cols == kPanel;
  for (int64_t p0 = 0; p0 < depth; p0 += kDepth) {
    const int64_t block = std::min(kDepth, depth - p0);
    if (!in_place) PackPanel(b, p0, block, j0, cols, packed);
    const float* b_panel = in_place ? b.At(p0, j0) : packed;
    const int64_t ldb = in_place ? b.row_stride : kPanel;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t r = std::min<int64_t>(kRows, rows - r0);
      const View a_tile{a.At(r0, p0), a.row_stride, a.col_stride};
      const Store store = p0 > 0 ? Store::kAccumulate
                          : stream && depth <= kDepth ? Store::kStream : Store::kOverwrite;
      kTiles[r](a_tile, b_panel, ldb, block, c + r0 * ldc + j0, ldc, cols, store);
    }
  }
}

// Consecutive row groups from row 0: group g holds rows [starts[g], ends[g]), group_sizes
// with negative sizes as 0, cut at num_rows; rows() = the rows in any group.
struct Groups {
  std::vector<int64_t> starts, ends;
  int64_t size() const { return int64_t(starts.size()); }
  int64_t rows() const { return ends.empty() ? 0 : ends.back(); }
};

Groups MakeGroups(const int32_t* sizes, int64_t G, int64_t num_rows) {
  Groups groups{std::vector<int64_t>(G), std::vector<int64_t>(G)};
  int64_t end = 0;
  for (int64_t g = 0; g < G; ++g) {
    groups.starts[g] = end;
    end = std::min(num_rows, end + std::max<int64_t>(sizes[g], 0));
    groups.ends[g] = end;
  }
  return groups;
}

// This thread's kDepth x kPanel floats for packed panels, cache-line aligned: allocated once
// per thread, never initialised (every panel is written before it is read). One chunk at a
// time uses it: a chunk's task only packs and multiplies, and ParallelFor's caller waits
// without running other tasks.
float* PackedPanelScratch() {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local const std::unique_ptr<float, Free> scratch(static_cast<float*>(
      std::aligned_alloc(64, kDepth * kPanel * sizeof(float))));
  return scratch.get();
}

// Runs task(group, j0, cols, packed) for every (group, column panel) pair on the pool; each
// chunk fences its streaming stores before ParallelFor counts it done.
template <typename Task>
void ForEachPanel(const CpuWorkers& workers, int64_t G, int64_t width, const Task& task) {
  const int64_t panels = (width + kPanel - 1) / kPanel;
  ParallelFor(workers, G * panels, 1, [&](int64_t begin, int64_t end) {
    float* packed = PackedPanelScratch();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = (t % panels) * kPanel;
      task(t / panels, j0, std::min(kPanel, width - j0), packed);
    }
    StreamingFence();
  });
}

// c[r, :width] = a[r, :depth] @ b_of(g) for the rows r of each group g (a and c row-major with
// row strides depth and width; b_of(g): group g's [depth, width] matrix as a View). Rows
// outside the groups are not written.
template <typename MatrixOf>
void GroupedProduct(const CpuWorkers& workers, const Groups& groups, const float* a,
                    int64_t depth, const MatrixOf& b_of, int64_t width, float* c) {
  ForEachPanel(workers, groups.size(), width, [&](int64_t g, int64_t j0, int64_t cols,
                                               float* packed) {
    const int64_t rows = groups.ends[g] - groups.starts[g];
    if (rows == 0) return;
    PanelProduct(View{a + groups.starts[g] * depth, depth, 1}, b_of(g), rows, depth, j0, cols,
                 c + groups.starts[g] * width, width, packed, false);
  });
}

// c[g] [depth, width] = a_g^T @ b_g over the rows of each group g (a [., depth] and b
// [., width] row-major); 0 for an empty group. An output of kStreamingStoreBytes or more
// (the weights' gradient of many experts) is streamed where a group's rows are one block.
void GroupedWeightGrad(const CpuWorkers& workers, const Groups& groups, const float* a,
                       int64_t depth, const float* b, int64_t width, float* c) {
  const bool stream =
      groups.size() * depth * width * int64_t(sizeof(float)) >= kStreamingStoreBytes;
  ForEachPanel(workers, groups.size(), width, [&](int64_t g, int64_t j0, int64_t cols,
                                               float* packed) {
    const int64_t s = groups.starts[g];
    PanelProduct(View{a + s * depth, 1, depth}, View{b + s * width, width, 1}, depth,
                 groups.ends[g] - s, j0, cols, c + g * depth * width, width, packed, stream);
  });
}

// Group g's [rows, cols] matrix of a [G, rows, cols] buffer, or its transpose.
View GroupMatrix(const float* w, int64_t rows, int64_t cols, int64_t g, bool transpose) {
  const float* data = w + g * rows * cols;
  return transpose ? View{data, 1, cols} : View{data, cols, 1};
}

ffi::Error ShapeError(const char* name, const std::string& expected, const F32& got) {
  return ffi::Error::InvalidArgument(std::string(name) + ": expected " + expected + ", got " +
                                     ShapeString(got.dimensions()));
}

// The buffer `name` with dimensions `dims` has exactly the shape `want`.
template <typename Dims>
ffi::Error CheckShape(const char* name, const Dims& dims, std::initializer_list<int64_t> want) {
  if (!std::equal(dims.begin(), dims.end(), want.begin(), want.end())) {
    std::string expected = "[";
    for (int64_t d : want) expected += (expected.size() > 1 ? ", " : "") + std::to_string(d);
    return ffi::Error::InvalidArgument(std::string(name) + ": expected shape " + expected +
                                       "], got " + ShapeString(dims));
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmCpu(ffi::ThreadPool pool, int32_t device, F32 lhs, F32 rhs,
                          I32 group_sizes, bool transpose_rhs, F32Out out) {
  if (auto err = CheckRank(lhs, 2, "lhs"); err.failure()) return err;
  if (auto err = CheckRank(rhs, 3, "rhs"); err.failure()) return err;
  const int64_t M = lhs.dimensions()[0], K = lhs.dimensions()[1], G = rhs.dimensions()[0];
  const int64_t rhs_depth = rhs.dimensions()[transpose_rhs ? 2 : 1];
  const int64_t N = rhs.dimensions()[transpose_rhs ? 1 : 2];
  if (rhs_depth != K) {
    return ShapeError("rhs", transpose_rhs ? "[G, N, K=" + std::to_string(K) + "] to match lhs"
                                           : "[G, K=" + std::to_string(K) + ", N] to match lhs",
                      rhs);
  }
  if (auto err = CheckShape("group_sizes", group_sizes.dimensions(), {G}); err.failure()) {
    return err;
  }
  if (auto err = CheckShape("out", out->dimensions(), {M, N}); err.failure()) return err;
  const Groups groups = MakeGroups(group_sizes.typed_data(), G, M);
  float* c = out->typed_data();
  AdviseHugePages(c, M * N * int64_t(sizeof(float)));
  std::fill(c + groups.rows() * N, c + M * N, 0.0f);
  const float* b = rhs.typed_data();
  GroupedProduct({pool, device}, groups, lhs.typed_data(), K, [&](int64_t g) {
    return transpose_rhs ? GroupMatrix(b, N, K, g, true) : GroupMatrix(b, K, N, g, false);
  }, N, c);
  return ffi::Error::Success();
}

ffi::Error GroupedGemmDwCpu(ffi::ThreadPool pool, int32_t device, F32 lhs, F32 rhs,
                            I32 group_sizes, F32Out out) {
  if (auto err = CheckRank(lhs, 2, "lhs"); err.failure()) return err;
  if (auto err = CheckRank(rhs, 2, "rhs"); err.failure()) return err;
  if (auto err = CheckRank(group_sizes, 1, "group_sizes"); err.failure()) return err;
  const int64_t M = lhs.dimensions()[0], K = lhs.dimensions()[1], N = rhs.dimensions()[1];
  const int64_t G = group_sizes.dimensions()[0];
  if (rhs.dimensions()[0] != M) {
    return ShapeError("rhs", std::to_string(M) + " rows to match lhs", rhs);
  }
  if (auto err = CheckShape("out", out->dimensions(), {G, K, N}); err.failure()) return err;
  const Groups groups = MakeGroups(group_sizes.typed_data(), G, M);
  AdviseHugePages(out->typed_data(), G * K * N * int64_t(sizeof(float)));
  GroupedWeightGrad({pool, device}, groups, lhs.typed_data(), K, rhs.typed_data(), N,
                    out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedGemmCpu, jax_ep::GroupedGemmCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::F32>()  // lhs [M, K]
                                  .Arg<jax_ep::F32>()  // rhs [G, K, N] or [G, N, K]
                                  .Arg<jax_ep::I32>()  // group_sizes [G]
                                  .Attr<bool>("transpose_rhs")
                                  .Ret<jax_ep::F32>());  // out [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedGemmDwCpu, jax_ep::GroupedGemmDwCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<jax_ep::F32>()  // lhs [M, K]
                                  .Arg<jax_ep::F32>()  // rhs [M, N]
                                  .Arg<jax_ep::I32>()  // group_sizes [G]
                                  .Ret<jax_ep::F32>());  // out [G, K, N]

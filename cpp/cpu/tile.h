// Tiles of the CPU kernels: packing rows of a (batch, seq, heads, head_dim)
// tensor into contiguous accumulation-type buffers, and the small matrix
// products that FlashAttention-2 is made of.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/numeric.h"
#include "cpu/simd.h"
#include "jax_flash/params.h"

namespace jax_flash::cpu {

// Query rows and key columns per tile. 64 x 64 accumulation-type tiles of
// the score matrix stay in L1; kBlockN is a multiple of every vector width.
inline constexpr int64_t kBlockM = 64;
inline constexpr int64_t kBlockN = 64;
// Tiles never straddle two cells of the block-sparse mask (mask.h), so a
// hidden cell's tiles are skipped whole.
static_assert(kBlockMaskBlock % kBlockM == 0 && kBlockMaskBlock % kBlockN == 0,
              "CPU tiles must divide the block mask's cells");
inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr double kLn2 = 0.6931471805599453;

// Work item `item` of a kernel over the query blocks of every (batch, query
// head), longest first: under a causal mask the last query blocks see the
// most keys, so they are handed out, for every head, before the short ones.
// Count(s) items.
struct QueryItem {
  int64_t b, h, h_kv;
  int64_t m_block;  // its query block
  int64_t i0;       // its first query
  int64_t rows;     // its rows below seqlen_q
  static int64_t Count(const AttentionShape& s) {
    return s.batch * s.num_heads_q * ((s.seqlen_q + kBlockM - 1) / kBlockM);
  }
  static QueryItem Of(const AttentionShape& s, int64_t item) {
    const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
    const int64_t num_heads_total = s.batch * s.num_heads_q;
    QueryItem q;
    q.h = item % num_heads_total % s.num_heads_q;
    q.b = item % num_heads_total / s.num_heads_q;
    q.h_kv = q.h / s.group_size();
    q.m_block = num_m_blocks - 1 - item / num_heads_total;
    q.i0 = q.m_block * kBlockM;
    q.rows = std::min(kBlockM, s.seqlen_q - q.i0);
    return q;
  }
};

// Head dim padded to whole vectors, so that row operations need no tail loop.
template <typename A>
inline int64_t PaddedHeadDim(int64_t head_dim) {
  return (head_dim + kLanes<A> - 1) / kLanes<A> * kLanes<A>;
}

// Copies `rows` rows of head h of batch b, starting at row0, into dst
// (rows x ld), converting to A; columns [head_dim, ld) are zeroed so padded
// columns contribute nothing to products. Rows [rows, total_rows) are zeroed.
template <typename T, typename A>
void PackRows(const T* src, const SeqStrides& st, int64_t b, int64_t h, int64_t row0,
              int64_t rows, int64_t total_rows, int64_t head_dim, A* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + st.offset(b, row0 + r, h);
    A* d = dst + r * ld;
    for (int64_t c = 0; c < head_dim; ++c) d[c] = ToAcc<A>(s[c]);
    std::fill(d + head_dim, d + ld, A(0));
  }
  std::fill(dst + rows * ld, dst + total_rows * ld, A(0));
}

// The transpose of PackRows: dst[c * ld + r] = src row (row0 + r), column c,
// for c < head_dim; rows [rows, ld) of the transpose are zero.
template <typename T, typename A>
void PackColumns(const T* src, const SeqStrides& st, int64_t b, int64_t h, int64_t row0,
                 int64_t rows, int64_t head_dim, A* dst, int64_t ld) {
  for (int64_t c = 0; c < head_dim; ++c) std::fill(dst + c * ld + rows, dst + (c + 1) * ld, A(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + st.offset(b, row0 + r, h);
    for (int64_t c = 0; c < head_dim; ++c) dst[c * ld + r] = ToAcc<A>(s[c]);
  }
}

// Writes rows of an accumulation-type tile back to a (b, s, h, d) tensor.
template <typename T, typename A>
void UnpackRows(const A* src, int64_t ld, int64_t rows, int64_t head_dim, T* dst,
                const SeqStrides& st, int64_t b, int64_t h, int64_t row0) {
  for (int64_t r = 0; r < rows; ++r) {
    T* d = dst + st.offset(b, row0 + r, h);
    for (int64_t c = 0; c < head_dim; ++c) d[c] = FromAcc<T>(src[r * ld + c]);
  }
}

// Register tile of the products: kRows x kCols vectors of accumulators. With
// 32 vector registers (AVX-512) 4 x 4 leaves room for the operands; with 16,
// 4 x 2.
inline constexpr int kMaxRowTile = 4;
inline constexpr int kMaxColTile = kVectorBytes == 64 ? 4 : 2;

// Operand a of a product is addressed with two strides, so that the same
// code multiplies by a matrix or by its transpose without copying it:
// element (row r, depth k) is a[r * row_stride + k * depth_stride].
template <typename A>
struct Lhs {
  const A* a;
  int64_t row_stride;
  int64_t depth_stride;
  const A* Row(int64_t r) const { return a + r * row_stride; }
};

template <typename A, int kRows, int kCols, bool kAccumulate>
inline void MicroKernel(int64_t depth, Lhs<A> lhs, const A* b, int64_t ldb, A* c, int64_t ldc) {
  Vec<A> acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kCols; ++j)
      acc[r][j] = kAccumulate ? Load(c + r * ldc + j * kLanes<A>) : Vec<A>{};
  for (int64_t k = 0; k < depth; ++k) {
    Vec<A> bv[kCols];
    for (int j = 0; j < kCols; ++j) bv[j] = Load(b + k * ldb + j * kLanes<A>);
    for (int r = 0; r < kRows; ++r) {
      // A scalar times a vector broadcasts inside the FMA.
      const A av = lhs.a[r * lhs.row_stride + k * lhs.depth_stride];
      for (int j = 0; j < kCols; ++j) acc[r][j] += av * bv[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kCols; ++j) Store(c + r * ldc + j * kLanes<A>, acc[r][j]);
}

template <typename A, int kRows, bool kAccumulate>
inline void MicroKernelCols(int cols, int64_t depth, Lhs<A> lhs, const A* b, int64_t ldb, A* c,
                            int64_t ldc) {
  switch (cols) {
    case 1: return MicroKernel<A, kRows, 1, kAccumulate>(depth, lhs, b, ldb, c, ldc);
    case 2: return MicroKernel<A, kRows, 2, kAccumulate>(depth, lhs, b, ldb, c, ldc);
    case 3: if constexpr (kMaxColTile >= 3) return MicroKernel<A, kRows, 3, kAccumulate>(depth, lhs, b, ldb, c, ldc);
            break;
    case 4: if constexpr (kMaxColTile >= 4) return MicroKernel<A, kRows, 4, kAccumulate>(depth, lhs, b, ldb, c, ldc);
            break;
  }
}

// c (m x n) = lhs (m x depth) . b (depth x n), or c += that when kAccumulate.
// b and c are row-major; n must be a multiple of kLanes<A> (buffers are
// padded).
template <typename A, bool kAccumulate>
void Gemm(int64_t m, int64_t n, int64_t depth, Lhs<A> lhs, const A* b, int64_t ldb, A* c,
          int64_t ldc) {
  const int64_t n_vectors = n / kLanes<A>;
  for (int64_t j0 = 0; j0 < n_vectors; j0 += kMaxColTile) {
    const int cols = static_cast<int>(std::min<int64_t>(kMaxColTile, n_vectors - j0));
    const A* bj = b + j0 * kLanes<A>;
    A* cj = c + j0 * kLanes<A>;
    int64_t i = 0;
    for (; i + kMaxRowTile <= m; i += kMaxRowTile)
      MicroKernelCols<A, kMaxRowTile, kAccumulate>(
          cols, depth, {lhs.Row(i), lhs.row_stride, lhs.depth_stride}, bj, ldb, cj + i * ldc, ldc);
    for (; i < m; ++i)
      MicroKernelCols<A, 1, kAccumulate>(cols, depth, {lhs.Row(i), lhs.row_stride, lhs.depth_stride},
                                         bj, ldb, cj + i * ldc, ldc);
  }
}

// A row-major matrix as a left operand, and the transpose of one.
template <typename A>
Lhs<A> RowMajor(const A* a, int64_t ld) { return {a, ld, 1}; }
template <typename A>
Lhs<A> Transposed(const A* a, int64_t ld) { return {a, 1, ld}; }

// Reusable per-thread buffers, grown on demand (never shrunk).
template <typename A>
struct Scratch {
  std::vector<A> storage;
  A* Get(size_t n) {
    if (storage.size() < n) storage.resize(n);
    return storage.data();
  }
};

}  // namespace jax_flash::cpu

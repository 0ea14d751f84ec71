// Score policies: what happens to a score between the two GEMMs, in one place
// for every kernel family, forward and backward.
//
//   x = scale * q.k (+ bias)  ->  soft cap  ->  mask  ->  softmax  ->  dropout
//
// - mask: the band (causal, window, lengths) as a window of columns per row
//   (KeyWindow / QueryWindow, exact for one row); MaskFragment applies it to
//   a warp's fragment in either orientation (rows = queries for S, rows =
//   keys for S^T), MaskFragmentElementwise the band, segments and a dense
//   mask per element. Whole tiles: the band cuts the key / query range
//   (BatchMask::KeyRange / QueryRange), BatchMask::AllVisible skips the
//   per-element work of full tiles, MaskPathOf picks the path of the others.
// - soft cap: x = cap * tanh(x / cap) and its derivative, on the special-
//   function unit for the tensor-core kernels, accurate for the exact ones.
// - dense mask, dropout (the tensor-core kernels' kTerms instantiations,
//   HasScoreTerms): MaskFragmentElementwise tests segments and the dense mask
//   per element inside the band, in the tiles the tile map leaves partial
//   (MaskTile); dropout (common/dropout.cuh) drops P after
//   the softmax, from one Philox call per 16 fragment elements (shared by
//   lanes l and l ^ 4).
// - bias (the tensor-core kernels' kTerms instantiations, common/bias.cuh): BiasView reads
//   this head's bias (float32 or the 16-bit inputs' type) straight from global memory into the fragment
//   layout (AddBias: x = scale * q.k + bias, before the soft cap; the launch
//   arguments then take scale out of exp2 and tanh), and the dK/dV kernel
//   sums dS into dbias (AccumulateDbiasT). The wgmma forwards add the same
//   x = scale * q.k + bias from TMA-staged tiles (sm90/bias_tile.cuh).
// - bias, dense mask, dropout on the exact kernels: HeadTerms resolves them
//   for one (batch, head); the exact kernels apply them per element.
//
// - tile classes: the band cuts every kernel's range; the tile map
//   (common/tile_map.cuh, from segments, a dense mask and a block mask) says
//   which tiles inside it are empty (skipped: the wgmma kernels and the
//   mma.sync kTerms ones), full (the band alone) or partial.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/bias.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/math.cuh"
#include "jax_flash/dropout.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// True when the mma.sync kernels run their kTerms instantiation: per-element
// terms beyond the band, segments and the soft cap (a bias, a dense mask,
// dropout), or a tile map (segments, a dense mask, a block mask), which only
// those kernels step through: the plain ones keep their registers and code.
// (The wgmma kernels read the map and a dense mask without a variant.)
inline bool HasScoreTerms(const FwdParams& p) {
  return p.score.bias != nullptr || p.mask.dense != nullptr || p.dropout.enabled() ||
         p.mask.tile_map != nullptr;
}

// True when every element of dbias gets its dS from one thread of the
// tensor-core dK/dV kernel (in the fixed order of its steps), so that the
// deterministic backward can add with plain read-modify-writes: the bias
// keeps the batch (or B = 1), keeps the head or has one kv head (the CTA
// walks the GQA group itself), and keeps the key dimension (or Sk = 1). A
// bias broadcast otherwise sums over CTAs (float atomics: fast mode only).
inline bool DbiasHasOneWriter(const FwdParams& p) {
  const int64_t* d = p.score.bias_dims;
  const AttentionShape& s = p.shape;
  return (d[0] != 1 || s.batch == 1) && (d[1] != 1 || s.num_heads_kv == 1) &&
         (d[3] != 1 || s.seqlen_k == 1);
}

// ---- mask: band windows ------------------------------------------------------

// The band part of the mask (causal, window, lengths) for one row of a tile:
// columns [lo, hi) of the tile, relative to its first column col0, are
// visible. From mask.h's KeyRange (rows = queries, columns = keys) or
// QueryRange (rows = keys, columns = queries) of a single row, which are exact
// for one row; segments are then tested per element with Visible.
struct ColWindow {
  int lo, hi;
  __device__ __forceinline__ bool Contains(int col) const { return col >= lo && col < hi; }
};
__device__ __forceinline__ ColWindow ClampWindow(int64_t begin, int64_t end, int64_t col0,
                                                 int cols) {
  int64_t lo = begin - col0, hi = end - col0;
  lo = lo < 0 ? 0 : (lo > cols ? cols : lo);
  hi = hi < 0 ? 0 : (hi > cols ? cols : hi);
  return ColWindow{static_cast<int>(lo), static_cast<int>(hi)};
}
__device__ __forceinline__ ColWindow KeyWindow(const BatchMask& mask, int64_t i, int64_t key0,
                                               int cols) {
  int64_t begin, end;
  mask.KeyRange(i, i + 1, &begin, &end);
  return ClampWindow(begin, end, key0, cols);
}
__device__ __forceinline__ ColWindow QueryWindow(const BatchMask& mask, int64_t j, int64_t q0,
                                                 int cols) {
  int64_t begin, end;
  mask.QueryRange(j, j + 1, &begin, &end);
  return ClampWindow(begin, end, q0, cols);
}

// ---- mask: fragments -----------------------------------------------------------

// Sets the hidden (query, key) pairs of a warp's score fragment to `hidden`:
// -inf before the softmax; 0 after exp2, by a select rather than a multiply,
// so that a masked P that overflowed to +inf (its key was not in the row's
// lse) still gives P = dS = 0. kMT m-tiles of 16 rows from row0 (rows g and
// g + 8 of each), kNTiles n-tiles of 8 columns from col0. The band (causal,
// window, lengths) alone, through the row's window of columns: a tile with
// no segments or dense mask, or one the tile map says they leave whole.
template <Rows kRows, int kMT, int kNTiles>
__device__ __forceinline__ void MaskFragment(float (&s)[kMT][kNTiles][4], const BatchMask& mask,
                                             int64_t row0, int64_t col0, int g, int t,
                                             float hidden) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t r = row0 + mt * 16 + g + hr * 8;
      const ColWindow w = kRows == Rows::kQueries ? KeyWindow(mask, r, col0, kNTiles * 8)
                                                  : QueryWindow(mask, r, col0, kNTiles * 8);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if (!w.Contains(nt * 8 + 2 * t + c)) s[mt][nt][2 * hr + c] = hidden;
    }
}

// The same on a fragment of one m-tile.
template <Rows kRows, int kNTiles>
__device__ __forceinline__ void MaskFragment(float (&s)[kNTiles][4], const BatchMask& mask,
                                             int64_t row0, int64_t col0, int g, int t,
                                             float hidden) {
  MaskFragment<kRows>(reinterpret_cast<float(&)[1][kNTiles][4]>(s), mask, row0, col0, g, t,
                      hidden);
}

// Column n of a block from col0 (kCols wide) as an end for this lane's
// compares: n - col0 clamped to [0, kCols], less the lane's first column
// 2t, in 32 bits (MaskEndsFragment, MaskEndsFragmentT).
template <int kCols>
__device__ __forceinline__ int LaneColumn(int64_t n, int64_t col0, int t) {
  n -= col0;
  return static_cast<int>(n < 0 ? 0 : (n > kCols ? kCols : n)) - 2 * t;
}

// MaskFragment for a mask that is at most the sequences' ends and causal
// (the ws forward's light kernels, which know it at compile time): row r
// sees keys [0, end(r)), end(r) = min(kv_len, r + diagonal + 1) with causal,
// kv_len without, none past q_len (mask.h's KeyRange of one row). A warp
// whose 16 rows all see the whole block skips the test; otherwise each
// element is one compare of a constant column against the row's end
// relative to this lane, in 32 bits (MaskFragment keeps the 64-bit window
// and a lower bound these masks never have). col0, a block's first key, is
// never negative.
template <int kNTiles>
__device__ __forceinline__ void MaskEndsFragment(float (&s)[kNTiles][4], const BatchMask& mask,
                                                 int64_t row0, int64_t col0, int g, int t,
                                                 float hidden) {
  constexpr int kCols = kNTiles * 8;
  auto end_of = [&](int64_t r) {
    if (r >= mask.q_len) return int64_t{0};
    const int64_t causal_end = r + mask.diagonal + 1;
    return mask.causal && causal_end < mask.kv_len ? causal_end : mask.kv_len;
  };
  // end(r) grows with r: the warp's first row sees the least.
  if (row0 + 15 < mask.q_len && end_of(row0) >= col0 + kCols) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int hi = LaneColumn<kCols>(end_of(row0 + g + hr * 8), col0, t);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (nt * 8 + c >= hi) s[nt][2 * hr + c] = hidden;
  }
}

// The same in the keys x queries orientation (the backward's S^T): key row j
// sees queries [begin(j), q_len), begin(j) = max(0, j - diagonal) with
// causal, 0 without, and none at or past kv_len (mask.h's QueryRange of one
// row).
template <int kNTiles>
__device__ __forceinline__ void MaskEndsFragmentT(float (&s)[kNTiles][4], const BatchMask& mask,
                                                  int64_t row0, int64_t col0, int g, int t,
                                                  float hidden) {
  constexpr int kCols = kNTiles * 8;
  auto begin_of = [&](int64_t j) {
    const int64_t causal_begin = j - mask.diagonal;
    return mask.causal && causal_begin > 0 ? causal_begin : int64_t{0};
  };
  // begin(j) grows with j: the warp's last row sees the least.
  if (row0 + 15 < mask.kv_len && begin_of(row0 + 15) <= col0 && col0 + kCols <= mask.q_len)
    return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t j = row0 + g + hr * 8;
    const int lo = LaneColumn<kCols>(begin_of(j), col0, t);
    const int hi = LaneColumn<kCols>(j < mask.kv_len ? mask.q_len : 0, col0, t);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (nt * 8 + c < lo || nt * 8 + c >= hi) s[nt][2 * hr + c] = hidden;
  }
}

// MaskFragment for the tiles with segments or a dense mask that the tile map
// (common/tile_map.h) leaves partial, or without a tile map: the band through
// the row's window, then segments and the dense mask per element.
// A row's loads depend on its window alone, never on another element's
// test, so that they are in flight together: tested one after another (the
// mask byte read only where the segment ids matched, each element behind a
// branch), a partial tile cost about six full ones on the H100
// (cuda/NOTES_score_terms.md, "Partial tiles"). Half a row per iteration
// of a loop that is not unrolled: unrolled, every row's loads and addresses
// at once spilled hundreds of bytes in the D = 128 kernels, which carry this
// code whether or not a call has a dense mask.
template <Rows kRows, int kMT, int kNTiles>
__device__ __forceinline__ void MaskFragmentElementwise(float (&s)[kMT][kNTiles][4],
                                                        const BatchMask& mask, int64_t row0,
                                                        int64_t col0, int g, int t,
                                                        float hidden) {
  static_assert(kNTiles <= 16, "a row's elements are the bits of one word");
  constexpr bool kQueryRows = kRows == Rows::kQueries;
  const int32_t* col_seg = kQueryRows ? mask.kv_seg : mask.q_seg;
  const int32_t* row_segs = kQueryRows ? mask.q_seg : mask.kv_seg;
  // The dense mask's rows are queries: its strides along this fragment's
  // rows and columns.
  const int64_t dense_row = kQueryRows ? mask.dense_row_stride : mask.dense_col_stride;
  const int64_t dense_col = kQueryRows ? mask.dense_col_stride : mask.dense_row_stride;
  // Bit 2 nt + c of row i (rows g and g + 8 of each m-tile): hidden.
  uint32_t hidden_bits[2 * kMT];
#pragma unroll
  for (int i = 0; i < 2 * kMT; ++i) hidden_bits[i] = 0;
  // A row in kParts pieces of kPartTiles n-tiles, one piece per iteration.
  constexpr int kParts = kNTiles % 2 == 0 && kNTiles >= 8 ? 2 : 1;
  constexpr int kPartTiles = kNTiles / kParts;
#pragma unroll 1
  for (int i = 0; i < 2 * kMT * kParts; ++i) {
    const int row = i / kParts;
    const int nt0 = (i % kParts) * kPartTiles;
    const int64_t r = row0 + (row / 2) * 16 + g + (row % 2) * 8;
    const ColWindow w = kQueryRows ? KeyWindow(mask, r, col0, kNTiles * 8)
                                   : QueryWindow(mask, r, col0, kNTiles * 8);
    // The window's bits first; then each term's loads, unconditional and
    // independent of one another (out of the window they read the view's
    // first element, which is in range, and their bit is set already): a
    // predicated load holds a predicate register until its test, and the
    // seven of them kept three loads in flight.
    uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < kPartTiles; ++k)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        bits |= static_cast<uint32_t>(!w.Contains((nt0 + k) * 8 + 2 * t + c)) << (2 * k + c);
    if (mask.q_seg != nullptr) {
      const int32_t row_seg = __ldg(w.lo < w.hi ? row_segs + r : row_segs);
      const int32_t* seg = col_seg + col0 + nt0 * 8 + 2 * t;
#pragma unroll
      for (int k = 0; k < kPartTiles; ++k)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool in = w.Contains((nt0 + k) * 8 + 2 * t + c);
          const int32_t id = __ldg(in ? seg + 8 * k + c : col_seg);
          bits |= static_cast<uint32_t>(id != row_seg) << (2 * k + c);
        }
    }
    if (mask.dense != nullptr) {
      // Column 2t of each n-tile, stepped by additions (a 64-bit multiply
      // per element kept fewer loads in flight).
      const uint8_t* col = mask.dense + r * dense_row + (col0 + nt0 * 8 + 2 * t) * dense_col;
#pragma unroll
      for (int k = 0; k < kPartTiles; ++k, col += 8 * dense_col)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool in = w.Contains((nt0 + k) * 8 + 2 * t + c);
          const uint8_t keep = __ldg(in ? col + c * dense_col : mask.dense);
          bits |= static_cast<uint32_t>(keep == 0) << (2 * k + c);
        }
    }
#pragma unroll
    for (int j = 0; j < 2 * kMT; ++j)  // registers, not a local array indexed by row
      if (j == row) hidden_bits[j] |= bits << (2 * nt0);
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if ((hidden_bits[2 * mt + hr] >> (2 * nt + c)) & 1u) s[mt][nt][2 * hr + c] = hidden;
}

template <Rows kRows, int kNTiles>
__device__ __forceinline__ void MaskFragmentElementwise(float (&s)[kNTiles][4],
                                                        const BatchMask& mask, int64_t row0,
                                                        int64_t col0, int g, int t,
                                                        float hidden) {
  MaskFragmentElementwise<kRows>(reinterpret_cast<float(&)[1][kNTiles][4]>(s), mask, row0, col0,
                                 g, t, hidden);
}

// What the mask does to the tile queries [i0, i1) x keys [j0, j1), by the
// tile's class (the tile map's, common/tile_map.cuh; partial without one):
// nothing where every pair is visible; the band alone where there are no
// segments or dense mask, or the map says they hide nothing in the tile
// (full); else the band, segments and the dense mask per element. Decided
// apart from applying it (ApplyMask) so that a kernel can decide while the
// tile's GEMMs run: the decision is a chain of 64-bit compares, which after
// the GEMM's wait sits on the step's critical path.
// (Segments had a path of their own, MaskFragment testing them per element,
// unrolled: its loads and 64-bit addresses in flight at once made the
// warp-specialized forward spill 500 B more at 160 registers, and every
// tile the band cut took it, with a branch per element, though there were
// no segments: ~14% of a causal D = 64 forward at S = 1k;
// cpp/cuda/NOTES_sm90_fwd.md.)
enum class MaskPath : uint8_t { kNone, kBand, kElementwise };

__device__ __forceinline__ MaskPath MaskPathOf(const BatchMask& mask, CellClass cls, int64_t i0,
                                               int64_t i1, int64_t j0, int64_t j1) {
  if (cls == kCellFull || !mask.HasElementwiseTerms())
    return mask.AllVisibleByBand(i0, i1, j0, j1) ? MaskPath::kNone : MaskPath::kBand;
  return MaskPath::kElementwise;
}

// The mask on a warp's fragment of a tile whose path is `path`. row0, col0:
// the fragment's first row and column (queries and keys, or keys and
// queries: kRows).
template <Rows kRows, int kMT, int kNTiles>
__device__ __forceinline__ void ApplyMask(float (&s)[kMT][kNTiles][4], const BatchMask& mask,
                                          MaskPath path, int64_t row0, int64_t col0, int g, int t,
                                          float hidden) {
  if (path == MaskPath::kBand)
    MaskFragment<kRows>(s, mask, row0, col0, g, t, hidden);
  else if (path == MaskPath::kElementwise)
    MaskFragmentElementwise<kRows>(s, mask, row0, col0, g, t, hidden);
}
template <Rows kRows, int kNTiles>
__device__ __forceinline__ void ApplyMask(float (&s)[kNTiles][4], const BatchMask& mask,
                                          MaskPath path, int64_t row0, int64_t col0, int g, int t,
                                          float hidden) {
  ApplyMask<kRows>(reinterpret_cast<float(&)[1][kNTiles][4]>(s), mask, path, row0, col0, g, t,
                   hidden);
}

// Both at once, for the tile queries [i0, i1) x keys [j0, j1).
template <Rows kRows, int kMT, int kNTiles>
__device__ __forceinline__ void MaskTile(float (&s)[kMT][kNTiles][4], const BatchMask& mask,
                                         CellClass cls, int64_t i0, int64_t i1, int64_t j0,
                                         int64_t j1, int64_t row0, int64_t col0, int g, int t,
                                         float hidden) {
  ApplyMask<kRows>(s, mask, MaskPathOf(mask, cls, i0, i1, j0, j1), row0, col0, g, t, hidden);
}
template <Rows kRows, int kNTiles>
__device__ __forceinline__ void MaskTile(float (&s)[kNTiles][4], const BatchMask& mask,
                                         CellClass cls, int64_t i0, int64_t i1, int64_t j0,
                                         int64_t j1, int64_t row0, int64_t col0, int g, int t,
                                         float hidden) {
  MaskTile<kRows>(reinterpret_cast<float(&)[1][kNTiles][4]>(s), mask, cls, i0, i1, j0, j1, row0,
                  col0, g, t, hidden);
}

// ---- soft cap (tensor-core kernels) ---------------------------------------------

// Soft cap on a warp's fragments of S: x = cap * tanh(x * scale / cap);
// softcap = 0: off.
template <int kMT, int kNTiles>
__device__ __forceinline__ void SoftCap(float (&s)[kMT][kNTiles][4], float softcap,
                                        float scale_over_cap) {
  if (softcap > 0.f) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          s[mt][nt][r] = softcap * FastTanh(s[mt][nt][r] * scale_over_cap);
  }
}

// Soft cap, then the mask (-inf where hidden) on one key block of S whose
// first key is n0; `row0` is the warp's first query row. kBlockM is the CTA's,
// for the whole-block visibility test that skips the per-element work;
// `cls` the block's class by the tile map (FwdBlock::BlockClass; partial
// without one): a full block tests the band alone.
// softcap = 0: off; scale_over_cap = scale / softcap.
template <int kBlockM, int kMT, int kNTiles>
__device__ __forceinline__ void TransformAndMask(float (&s)[kMT][kNTiles][4], float softcap,
                                                 float scale_over_cap, const BatchMask& mask,
                                                 int64_t m0, int64_t row0, int64_t n0, int g,
                                                 int t, CellClass cls = kCellPartial) {
  constexpr int kBlockN = kNTiles * 8;
  if (softcap > 0.f) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          s[mt][nt][r] = softcap * FastTanh(s[mt][nt][r] * scale_over_cap);
  }
  MaskTile<Rows::kQueries>(s, mask, cls, m0, m0 + kBlockM, n0, n0 + kBlockN, row0, n0, g, t,
                           -INFINITY);
}

// The backward's soft cap on a warp's S^T / dP^T fragments (16 keys x 8
// kQTiles queries, column nt * 8 + 2t + c of this lane): x = cap * tanh(s *
// scale / cap) in st; d x / d (scaled score) = 1 - tanh^2 = 1 - (x / cap)^2,
// folded into dP^T - D in dpt. D of the step's queries from shared memory, as
// float2 per lane.
template <int kQTiles>
__device__ __forceinline__ void SoftcapAndSubtractDelta(float (&st)[kQTiles][4],
                                                        float (&dpt)[kQTiles][4],
                                                        const float* delta_s, float softcap,
                                                        float scale_over_cap, float inv_softcap,
                                                        int t) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + nt * 8 + 2 * t);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float x = softcap * FastTanh(st[nt][r] * scale_over_cap);
      const float th = x * inv_softcap;
      st[nt][r] = x;
      dpt[nt][r] = (dpt[nt][r] - (r % 2 ? dl.y : dl.x)) * (1.f - th * th);
    }
  }
}

// ---- score transform (exact kernels) ----------------------------------------------

// The score transform of ScoreParams: x = scale * dot + bias, then the
// optional softcap x = cap * tanh(x / cap). `dx_dlogit` receives
// d x / d(scale * dot + bias): sech^2(x / cap) with a cap, 1 without; the
// backward multiplies it into dS. sech^2 is computed as 4 e / (1 + e)^2 with
// e = exp(-2 |t|) in (0, 1]: no cancellation (1 - tanh^2 loses every bit
// where tanh is near +-1) and no overflow (the sign of t does not matter,
// sech^2 is even).
template <typename Acc>
__device__ __forceinline__ Acc Score(Acc dot, Acc bias, Acc scale, Acc softcap, Acc* dx_dlogit) {
  const Acc x = scale * dot + bias;
  if (softcap > Acc(0)) {
    const Acc t = x / softcap;
    const Acc e = Exp(Acc(-2) * (t < Acc(0) ? -t : t));
    const Acc one_plus_e = Acc(1) + e;
    *dx_dlogit = Acc(4) * e / (one_plus_e * one_plus_e);
    return softcap * Tanh(t);
  }
  *dx_dlogit = Acc(1);
  return x;
}

// ---- per-head terms: mask, bias, dropout --------------------------------------------

// Everything elementwise about one (batch element b, query head h): the mask
// (with this head's view of the dense mask), this head's view of the bias and
// its dropout stream. The device twin of the CPU's HeadView (cpu/scores.h),
// built from the same shared definitions (BatchMask, HeadDropout) so that both
// backends see the same logits and draw the same dropout mask.
template <typename Acc>
struct HeadTerms {
  BatchMask mask;
  const void* bias;  // this head's (Sq, Sk) view, or null
  BiasType bias_type;
  int64_t bias_row_stride;
  int64_t bias_col_stride;
  HeadDropout dropout;
  Acc keep_scale;  // 1 / (1 - rate)

  __device__ static HeadTerms For(const FwdParams& p, int64_t b, int64_t h) {
    const AttentionShape& s = p.shape;
    const DenseStrides& bs = p.score.bias_strides;
    HeadTerms t;
    t.mask = BatchMask::WithBlocks(p.mask, b, h, s.seqlen_q, s.seqlen_k);
    t.bias_type = p.score.bias_type;
    t.bias = p.score.bias != nullptr
                 ? static_cast<const char*>(p.score.bias) +
                       (b * bs.batch + h * bs.head) * BiasElementBytes(p.score.bias_type, sizeof(Acc))
                 : nullptr;
    t.bias_row_stride = bs.row;
    t.bias_col_stride = bs.col;
    t.dropout = HeadDropout::For(p.dropout, s.batch, b, h);
    t.keep_scale = static_cast<Acc>(p.dropout.keep_scale());
    return t;
  }

  // Read only for visible (hence in-range) elements.
  __device__ __forceinline__ Acc Bias(int64_t i, int64_t j) const {
    if (bias == nullptr) return Acc(0);
    const int64_t at = i * bias_row_stride + j * bias_col_stride;
    switch (bias_type) {
      case BiasType::kBFloat16: return static_cast<Acc>(ToFloat(static_cast<const __nv_bfloat16*>(bias)[at]));
      case BiasType::kFloat16: return static_cast<Acc>(ToFloat(static_cast<const __half*>(bias)[at]));
      default: return static_cast<const Acc*>(bias)[at];
    }
  }

  // False only if no (i, j) of the tile is visible; such tiles are skipped.
  // The block-sparse mask by its cells (the same answer in every thread);
  // segments and the dense mask need the elementwise test (the band is
  // already cut by KeyRange/QueryRange). A block-wide vote: every thread of
  // the block must call it (it is a barrier) and all get the same answer.
  __device__ __forceinline__ bool TileMayBeVisible(int64_t i0, int m_valid, int64_t j0,
                                                   int n_valid) const {
    if (!mask.AnyBlockSet(i0, i0 + m_valid, j0, j0 + n_valid)) return false;
    if (!mask.HasElementwiseTerms()) return true;
    int found = 0;
    for (int idx = threadIdx.x; idx < m_valid * n_valid && !found; idx += blockDim.x)
      found = mask.Visible(i0 + idx / n_valid, j0 + idx % n_valid);
    return __syncthreads_or(found) != 0;
  }
};

}  // namespace jax_flash::cuda

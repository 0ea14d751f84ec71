// Host check of the fast backward's dQ accumulator layout (bwd/workspace.h,
// DqAccumLayout), run by tc_kernel_check before its cases and on the CPU by
// tests/test_dq_layout.py (tests/host/dq_layout_check.cu): for every
// head-dim bucket, Index is a bijection onto the allocation with 8-column
// groups contiguous (the conversion's and the zeroing's float4 pairs, the
// Ampere kernel's float2 atomics), and every fragment the Hopper kernel
// stages at PartOffset reaches its own element through IssueDqReduce's
// ranges (sm90/epilogue_bwd.cuh), with the column split and the row split,
// and at D = 128 the transposed staging of 80-query steps too (every lane's
// element at TransposedLanePart + TransposedTilePart, each store of
// StoreDqPartTransposed in 32 different banks); and the preprocess's zeroing
// (ZeroPiece) reaches exactly the entries below seqlen_q and head_dim, each
// warp's store in whole 32-byte sectors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/bwd/workspace.h"
#include "cuda/common/copy.cuh"
#include "jax_flash/supported.h"

namespace check {

// The 80-query steps' parts (column split: warpgroup w's half), staged from
// transposed fragments: lane (warp, g, t) holds column 16 warp + 8 hc + g,
// rows 8 nt + 2t + o of its part; lanes t >= 2 store o = 1 first.
template <int kHeadDim>
int TransposedStagingErrors(int64_t sq) {
  using L = jax_flash::cuda::DqAccumLayout<kHeadDim>;
  constexpr int kRows = 80;
  int bad = 0;
  for (int64_t m = 0; m < sq; m += kRows)
    for (int w = 0; w < 2; ++w) {
      const int64_t rows = std::min<int64_t>(kRows, L::PaddedRows(sq) - m);
      std::vector<int> seen(kRows * L::kHalf, 0);
      for (int nt = 0; nt < kRows / 8; ++nt)
        for (int hc = 0; hc < 2; ++hc)
          for (int store = 0; store < 2; ++store) {
            std::vector<int> banks(32, 0);
            for (int warp = 0; warp < 4; ++warp)
              for (int g = 0; g < 8; ++g)
                for (int t = 0; t < 4; ++t) {
                  const int o = (t >= 2) ^ store;
                  const int at = L::TransposedLanePart(warp, g, t) + L::kTileRowFloats * o +
                                 L::TransposedTilePart(nt, hc);
                  if (warp == 0) ++banks[at % 32];
                  if (at < 0 || at >= kRows * L::kHalf) { ++bad; continue; }
                  ++seen[at];
                  const int64_t row = m + 8 * nt + 2 * t + o;
                  const int col = w * L::kHalf + 16 * warp + 8 * hc + g;
                  if (row >= sq) continue;  // padding: reduced or not, never read
                  if (at >= rows * L::kHalf ||
                      L::HalfRows(1, sq, w, m) + at != L::Index(1, sq, row, col))
                    ++bad;
                }
            for (int n : banks) bad += n != 1;  // one warp's store: 32 banks
          }
      for (int n : seen) bad += n != 1;
    }
  return bad;
}

// The preprocess's blocks of RowVectorRows rows, zeroed piece by piece
// (ZeroDqAccumRows): the floats zeroed are those of rows below sq and
// columns below head_dim, each once.
template <int kHeadDim>
int ZeroingErrors(int64_t sq, int head_dim) {
  using L = jax_flash::cuda::DqAccumLayout<kHeadDim>;
  constexpr int kRows = jax_flash::cuda::RowVectorRows(kHeadDim);
  const int64_t bh = 1, total = 3 * 2 * L::PaddedRows(sq) * L::kHalf;
  std::vector<int> zeroed(total, 0), wanted(total, 0);
  int bad = 0;
  for (int64_t i = 0; i < sq; ++i)
    for (int c = 0; c < head_dim; ++c) ++wanted[L::Index(bh, sq, i, c)];
  for (int64_t i0 = 0; i0 < sq; i0 += kRows)
    for (int n = 0; n < L::template kZeroPieces<kRows>; ++n) {
      const auto at = L::template ZeroPiece<kRows>(n);
      if (i0 + at.row >= sq || at.col >= head_dim) continue;
      for (int e = 0; e < 4; ++e) {
        const int64_t x = L::Index(bh, sq, i0 + at.row, at.col) + 4 * at.piece + e;
        if (x < 0 || x >= total) { ++bad; continue; }
        ++zeroed[x];
      }
    }
  for (int64_t x = 0; x < total; ++x) bad += zeroed[x] != wanted[x];
  return bad;
}

// A warp's 32 pieces of a block whose rows are all valid cover whole
// 32-byte sectors (8 floats: two pieces each). The order does not depend on
// seqlen_q or the head dim, so this runs once per bucket.
template <int kHeadDim>
int ZeroSectorErrors() {
  using L = jax_flash::cuda::DqAccumLayout<kHeadDim>;
  constexpr int kRows = jax_flash::cuda::RowVectorRows(kHeadDim);
  constexpr int kPieces = L::template kZeroPieces<kRows>;
  int bad = 0;
  for (int w = 0; w * 32 < kPieces; ++w) {
    std::vector<int64_t> sectors;
    for (int n = 32 * w; n < std::min(32 * w + 32, kPieces); ++n) {
      const auto at = L::template ZeroPiece<kRows>(n);
      sectors.push_back((L::Index(1, 4096, at.row, at.col) + 4 * at.piece) / 8);
    }
    std::sort(sectors.begin(), sectors.end());
    for (size_t k = 0; k < sectors.size(); k += 2)
      bad += k + 1 >= sectors.size() || sectors[k] != sectors[k + 1];
  }
  return bad;
}

template <int kHeadDim>
int DqAccumLayoutErrors() {
  using L = jax_flash::cuda::DqAccumLayout<kHeadDim>;
  int bad = 0;
  for (int64_t sq : {1, 15, 16, 17, 63, 64, 65, 100, 129}) {
    const int64_t heads = 3, total = heads * 2 * L::PaddedRows(sq) * L::kHalf;
    std::vector<int> seen(total, 0);
    for (int64_t bh = 0; bh < heads; ++bh)
      for (int64_t i = 0; i < L::PaddedRows(sq); ++i)
        for (int c = 0; c < L::kCols; ++c) {
          const int64_t x = L::Index(bh, sq, i, c);
          if (x < 0 || x >= total) { ++bad; continue; }
          ++seen[x];
          if (c % 8 != 0 && x != L::Index(bh, sq, i, c - 1) + 1) ++bad;
        }
    for (int n : seen) bad += n != 1;
    // A warpgroup's part of 64 rows from m: its column half (column split) or
    // both halves (row split); reduced per half up to the padded rows.
    for (const bool row_split : {false, true})
      for (int64_t m = 0; m < sq; m += 64)
        for (int w = 0; w < 2; ++w) {
          const int tiles = (row_split ? 2 : 1) * L::kHalf / 8;
          const int64_t rows = std::min<int64_t>(64, L::PaddedRows(sq) - m);
          for (int warp = 0; warp < 4; ++warp)
            for (int g = 0; g < 8; ++g)
              for (int t = 0; t < 4; ++t)
                for (int dt = 0; dt < tiles; ++dt)
                  for (int hr = 0; hr < 2; ++hr) {
                    const int half = row_split ? dt / (L::kHalf / 8) : w;
                    const int col = half * L::kHalf + (dt % (L::kHalf / 8)) * 8 + 2 * t;
                    const int64_t row = m + warp * 16 + g + 8 * hr;
                    // Its place within its half's range of the part.
                    const int at = L::PartOffset(warp, g, t, dt, hr) -
                                   (row_split ? half : 0) * 64 * L::kHalf;
                    if (row >= sq) continue;  // padding: reduced or not, never read
                    if (at >= rows * L::kHalf ||
                        L::HalfRows(1, sq, half, m) + at != L::Index(1, sq, row, col))
                      ++bad;
                  }
        }
    if constexpr (L::kHalf == 64) bad += TransposedStagingErrors<kHeadDim>(sq);
    for (const int head_dim : {kHeadDim, kHeadDim - 8, 8})
      if (head_dim > 0) bad += ZeroingErrors<kHeadDim>(sq, head_dim);
  }
  return bad + ZeroSectorErrors<kHeadDim>();
}

// Every bucket; prints and returns whether the layout holds.
inline bool DqAccumLayoutOk() {
  int bad = 0;
#define JAX_FLASH_CASE(D) bad += DqAccumLayoutErrors<(D)>();
  JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_CASE)
#undef JAX_FLASH_CASE
  std::printf("%s dQ accumulator layout (%d errors)\n", bad ? "FAIL" : "PASS", bad);
  return bad == 0;
}

}  // namespace check

// Host check of the fast backward's dQ accumulator layout (bwd/workspace.h,
// DqAccumLayout), run by tc_kernel_check before its cases: for every
// head-dim bucket, Index is a bijection onto the allocation with 8-column
// groups contiguous (the conversion's and the zeroing's float4 pairs, the
// Ampere kernel's float2 atomics), and every fragment the Hopper kernel
// stages at PartOffset reaches its own element through IssueDqReduce's
// ranges (sm90/epilogue_bwd.cuh), with the column split and the row split.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/bwd/workspace.h"
#include "jax_flash/supported.h"

namespace check {

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
  }
  return bad;
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

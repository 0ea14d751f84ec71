// Copies into the 128-byte-swizzled shared tiles that wgmma reads
// (sm90/wgmma.cuh) with cp.async.
#pragma once

#include <cstdint>

#include "cuda/common/copy.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// cp.async a kRows x kCols tile (row0 onward) into the swizzled layout of
// wgmma.cuh at shared address `dst` (column blocks of 64: a tile whose
// kCols is not a multiple of 64 leaves the rest of its last block unwritten);
// rows >= src.rows and columns >= src.cols are zero-filled.
template <typename T, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void LoadSwizzledTile(uint32_t dst, const GmemRows<T>& src,
                                                 int64_t row0, int tid) {
  constexpr int kChunksPerRow = kCols / kVecElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  // The last round is partial where the chunks do not divide evenly.
  constexpr int kRounds = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kRounds; ++it) {
    const int c = tid + it * kThreads;
    if constexpr (kChunks % kThreads != 0) {
      if (c >= kChunks) break;
    }
    const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const int col = chunk * kVecElems;
    const int64_t row = row0 + r;
    const bool valid = row < src.rows && col < src.cols;
    const T* g = valid ? src.base + row * src.stride + col : src.base;
    CpAsync16(dst + SwizzledOffset(r, chunk, kRows), g, valid);
  }
}

}  // namespace jax_flash::cuda::sm90

// Tile copies of the sm_80 kernels: rows padded in shared memory so that
// ldmatrix is free of bank conflicts.
#pragma once

#include <cstdint>

#include "cuda/common/copy.cuh"
#include "cuda/common/views.cuh"

namespace jax_flash::cuda::sm80 {

// Shared-memory rows are padded by one 16-byte vector: with a row of
// (D + 8) elements, 8 consecutive rows start in 8 different 16-byte bank
// groups (D / 8 is even for every bucket), so ldmatrix is conflict free.
inline constexpr int kSmemPad = kVecElems;

// Issue cp.async for a kRows x kCols tile starting at row0 into shared memory
// with row stride kSmemStride elements; rows >= src.rows and columns >=
// src.cols are zero-filled. Spread over kThreads threads.
template <typename T, int kRows, int kCols, int kSmemStride, int kThreads>
__device__ __forceinline__ void LoadTile(T* smem, const GmemRows<T>& src, int64_t row0,
                                         int tid) {
  constexpr int kChunksPerRow = kCols / kVecElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int c = tid + it * kThreads;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * kVecElems;
    const int64_t row = row0 + r;
    const bool valid = row < src.rows && col < src.cols;
    const T* g = valid ? src.base + row * src.stride + col : src.base;
    CpAsync16(SmemAddr(smem + r * kSmemStride + col), g, valid);
  }
}

}  // namespace jax_flash::cuda::sm80

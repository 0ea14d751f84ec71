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

// A kRows x kCols tile of the next block held in registers (Turing, which has
// no cp.async: register double buffering): Load issues the global loads
// where the sm_80 kernels issue cp.async, Store writes them to shared memory
// where those wait for it, so the loads' latency passes behind the current
// block's MMAs instead of stalling the copy. Same chunks per thread and
// zero fill as LoadTile.
template <typename T, int kRows, int kCols, int kThreads>
struct StagedTile {
  static constexpr int kChunksPerRow = kCols / kVecElems;
  static constexpr int kPerThread = kRows * kChunksPerRow / kThreads;
  static_assert(kRows * kChunksPerRow % kThreads == 0,
                "tile chunks must divide evenly among threads");
  uint4 v[kPerThread];

  __device__ __forceinline__ void Load(const GmemRows<T>& src, int64_t row0, int tid) {
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
      const int c = tid + it * kThreads;
      const int64_t row = row0 + c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * kVecElems;
      v[it] = make_uint4(0, 0, 0, 0);
      // volatile: issued here, not sunk towards the store by the compiler.
      if (row < src.rows && col < src.cols)
        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v[it].x), "=r"(v[it].y), "=r"(v[it].z), "=r"(v[it].w)
                     : "l"(src.base + row * src.stride + col));
    }
  }

  template <int kSmemStride>
  __device__ __forceinline__ void Store(T* smem, int tid) const {
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
      const int c = tid + it * kThreads;
      const uint32_t dst = SmemAddr(smem + (c / kChunksPerRow) * kSmemStride +
                                    (c % kChunksPerRow) * kVecElems);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v[it].x),
                   "r"(v[it].y), "r"(v[it].z), "r"(v[it].w));
    }
  }
};

// The next K/V block of a kernel that streams keys through two stages:
// Issue starts its copy where the current block's MMAs are about to run,
// Land finishes it at the top of the block that uses it, before the barrier
// that publishes it. cp.async straight into the stage (Land: nothing), or
// with kRegStaged (Turing) through registers (StagedTile).
template <typename T, int kRows, int kCols, int kSmemStride, int kThreads, bool kRegStaged>
struct NextKvBlock {
  StagedTile<T, kRows, kCols, kThreads> k, v;  // with kRegStaged only

  __device__ __forceinline__ void Issue(T* k_stage, T* v_stage, const GmemRows<T>& k_src,
                                        const GmemRows<T>& v_src, int64_t row0, int tid) {
    if constexpr (kRegStaged) {
      k.Load(k_src, row0, tid);
      v.Load(v_src, row0, tid);
    } else {
      LoadTile<T, kRows, kCols, kSmemStride, kThreads>(k_stage, k_src, row0, tid);
      LoadTile<T, kRows, kCols, kSmemStride, kThreads>(v_stage, v_src, row0, tid);
    }
  }

  __device__ __forceinline__ void Land(T* k_stage, T* v_stage, int tid) const {
    if constexpr (kRegStaged) {
      k.template Store<kSmemStride>(k_stage, tid);
      v.template Store<kSmemStride>(v_stage, tid);
    }
  }
};

}  // namespace jax_flash::cuda::sm80

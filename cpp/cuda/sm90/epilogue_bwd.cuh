// The Hopper backward's dQ epilogue, once per step: each warpgroup's part of
// dQ (summed over the CTA's 128 keys; which part: BwdSm90Traits::kDqRowSplit)
// leaves through a staging tile in shared memory and bulk reduce-adds of the
// TMA unit into the float32 accumulator. The staging rows are padded as the
// accumulator's (DqAccumLayout), so a warpgroup's rows of one column half
// are one contiguous range there (one reduction instead of one per row:
// D=64 +20-25%, D=128 +7% on an H100) and a half-warp's fragment stores hit
// 32 different banks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/workspace.h"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// Named barrier of one warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int warpgroup) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
}

// Once, before the first step: the staging rows' padding is added to the
// accumulator's, so it must be zero. sDq: both warpgroups' staging tiles.
template <typename Traits>
__device__ __forceinline__ void ZeroDqStagingPadding(uint32_t sDq, int tid) {
  for (int r = tid; r < 2 * Traits::kBlockM; r += Traits::kThreads) {
    const uint32_t pad = sDq + r * Traits::kDqRowBytes + Traits::kDqHalfCols * 4;
    asm volatile("st.shared.v4.f32 [%0], {%1, %1, %1, %1};\n"
                 "st.shared.v4.f32 [%0+16], {%1, %1, %1, %1};\n" ::"r"(pad), "f"(0.f));
  }
}

// Before the step's dQ: the staging tile is free again once the bulk reduce
// of the previous step (issued long ago) has read it.
__device__ __forceinline__ void WaitDqStagingRead(int wg_tid) {
  if (wg_tid == 0) BulkWaitRead<0>();
}

// This warpgroup's dQ part of the step at query m0 of (batch, head) bh:
// fragments to the staging tile dq_part, then one bulk reduction of its rows
// (those below seqlen_q) into dq_accum, issued by the warpgroup's thread 0.
template <typename Traits, int kDqTiles>
__device__ __forceinline__ void ReduceDqPart(const float (&dq)[kDqTiles][4], uint32_t dq_part,
                                             float* dq_accum, int64_t bh, int64_t seqlen_q,
                                             int64_t m0, int warpgroup, int wg_warp, int wg_tid,
                                             int g, int t) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const uint32_t row = dq_part + (wg_warp * 16 + g + hr * 8) * Traits::kDqRowBytes;
#pragma unroll
    for (int dt = 0; dt < kDqTiles; ++dt)
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(row + (dt * 8 + 2 * t) * 4),
                   "f"(dq[dt][2 * hr]), "f"(dq[dt][2 * hr + 1]));
  }
  FenceProxyAsync();
  WarpgroupBarrier(warpgroup);
  // One bulk reduction per warpgroup: its half of the step's rows is one
  // range of the accumulator (DqAccumLayout), padding included.
  if (wg_tid == 0) {
    const int rows =
        static_cast<int>(seqlen_q - m0 < Traits::kBlockM ? seqlen_q - m0 : Traits::kBlockM);
    float* acc = dq_accum + DqAccumLayout<Traits::kHeadDim>::HalfRow(bh, seqlen_q, warpgroup, m0);
    BulkReduceAddF32(acc, dq_part, rows * Traits::kDqRowBytes);
    BulkCommit();
  }
}

// The row split's part (steps of 128 queries): this warpgroup's 64 queries
// from m0 + 64 warpgroup x every column, staged as [half][64 rows] and added
// by two bulk reductions, one per column half; none for rows at or past
// seqlen_q (the second warpgroup's, in a last step of 64 or fewer queries).
template <typename Traits, int kDqTiles>
__device__ __forceinline__ void ReduceDqRows(const float (&dq)[kDqTiles][4], uint32_t dq_part,
                                             float* dq_accum, int64_t bh, int64_t seqlen_q,
                                             int64_t m0, int warpgroup, int wg_warp, int wg_tid,
                                             int g, int t) {
  constexpr int kHalfTiles = Traits::kDqHalfCols / 8;
  constexpr uint32_t kHalfBytes = 64 * Traits::kDqRowBytes;
  static_assert(kDqTiles == 2 * kHalfTiles, "every column of the head dim");
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const uint32_t row = dq_part + (wg_warp * 16 + g + hr * 8) * Traits::kDqRowBytes;
#pragma unroll
    for (int dt = 0; dt < kDqTiles; ++dt) {
      const uint32_t at =
          row + (dt / kHalfTiles) * kHalfBytes + ((dt % kHalfTiles) * 8 + 2 * t) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(dq[dt][2 * hr]),
                   "f"(dq[dt][2 * hr + 1]));
    }
  }
  FenceProxyAsync();
  WarpgroupBarrier(warpgroup);
  const int64_t m = m0 + 64 * warpgroup;
  if (wg_tid == 0 && m < seqlen_q) {
    const int rows = static_cast<int>(seqlen_q - m < 64 ? seqlen_q - m : 64);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* acc = dq_accum + DqAccumLayout<Traits::kHeadDim>::HalfRow(bh, seqlen_q, half, m);
      BulkReduceAddF32(acc, dq_part + half * kHalfBytes, rows * Traits::kDqRowBytes);
    }
    BulkCommit();
  }
}

// After the last step: the staging tile must outlive the reads of the last
// reduction.
__device__ __forceinline__ void DrainDqReductions(int wg_tid) {
  if (wg_tid == 0) BulkWait<0>();
}

}  // namespace jax_flash::cuda::sm90

// The Hopper backward's dQ epilogue, once per step: each warpgroup's part of
// dQ (summed over the CTA's 128 keys; which part: BwdSm90Traits::kDqRowSplit)
// leaves through a staging tile in shared memory and bulk reduce-adds of the
// TMA unit into the float32 accumulator. The staging tile is in the
// accumulator's order (DqAccumLayout: the fragments' order, in 8 x 8 tiles),
// so a warpgroup's rows of one column half are one contiguous range there
// (one reduction instead of one per row: D=64 +20-25%, D=128 +7% on an H100,
// when rows were padded instead) and a warp's fragment stores cover 256
// contiguous bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/workspace.h"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// Named barrier of one warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int warpgroup) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warpgroup) : "memory");
}

// The warp-specialized backward's named barriers (sm90/bwd_ws.cuh; it uses
// no WarpgroupBarrier): the two MMA warpgroups' middle-of-step barrier, and
// per MMA warpgroup w the dQ handoff with the dQ warp. The warpgroup stages
// its part, posts where it goes ((batch, head) and first query, in its slot
// of shared memory), fences and arrives on Full(w) without waiting; the dQ
// warp syncs there, reads the slot, issues the reductions, waits until they
// have read the staging tile and arrives on Empty(w), on which the
// warpgroup syncs before it stages its next part (not before its first;
// after its last, so that the barrier ends with no arrival pending). A last
// post of kEnd ends the dQ warp (no Empty for it), which so needs no walk
// of the steps of its own.
struct DqHandoff {
  static constexpr int kMmaBarrier = 1;  // 256 threads: both MMA warpgroups
  static constexpr int kFull = 2;        // ids 2, 3
  static constexpr int kEmpty = 4;       // ids 4, 5
  static constexpr int kThreads = 128 + 32;
  static constexpr int32_t kEnd = -1;    // as the first query: no more parts
  // The MMA warpgroup w (Post: one thread, before the fence and Full).
  __device__ __forceinline__ static void Post(uint32_t slots, int w, int64_t bh, int64_t m0) {
    asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(slots + 8 * w),
                 "r"(static_cast<int32_t>(bh)), "r"(static_cast<int32_t>(m0))
                 : "memory");
  }
  __device__ __forceinline__ static void Full(int w) { NamedBarrierArrive(kFull + w, kThreads); }
  __device__ __forceinline__ static void WaitEmpty(int w) {
    NamedBarrierSync(kEmpty + w, kThreads);
  }
  // The dQ warp, every lane: waits for warpgroup w's next part and reads its
  // post.
  __device__ __forceinline__ static void WaitFull(uint32_t slots, int w, int32_t* bh,
                                                  int32_t* m0) {
    NamedBarrierSync(kFull + w, kThreads);
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(*bh), "=r"(*m0) : "r"(slots + 8 * w)
                 : "memory");
  }
  __device__ __forceinline__ static void Empty(int w) { NamedBarrierArrive(kEmpty + w, kThreads); }
};

// Before the step's dQ: the staging tile is free again once the bulk reduce
// of the previous step (issued long ago) has read it.
__device__ __forceinline__ void WaitDqStagingRead(int wg_tid) {
  if (wg_tid == 0) BulkWaitRead<0>();
}

// This warpgroup's dQ part of a step, from its fragments to its staging
// tile dq_part in the accumulator's order (DqAccumLayout): its 64 rows of
// its column half (the column split), or of each half, half 0 first (the
// row split, BwdSm90Traits::kDqRowSplit); warp w's rows are group w, the
// lane's pair of column tile dt at row g (+ 8 hr), columns 2t, 2t + 1.
template <typename Traits, int kDqTiles>
__device__ __forceinline__ void StoreDqPart(const float (&dq)[kDqTiles][4], uint32_t dq_part,
                                            int wg_warp, int g, int t) {
  using Layout = DqAccumLayout<Traits::kHeadDim>;
  static_assert(kDqTiles == (Traits::kDqRowSplit ? 2 : 1) * Traits::kDqHalfCols / 8,
                "the columns of the warpgroup's part");
#pragma unroll
  for (int dt = 0; dt < kDqTiles; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const uint32_t at = dq_part + 4 * Layout::PartOffset(wg_warp, g, t, dt, hr);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(dq[dt][2 * hr]),
                   "f"(dq[dt][2 * hr + 1]));
    }
}

// The same for dQ computed transposed (BwdSm90Traits::kDqTransposed): warp
// w's rows of dqt are the part's columns 16w.. (+ 8 for registers 2, 3), its
// n-tiles the step's queries, a lane's pair at queries 8 nt + 2t and + 1 of
// one column. Those two are 8 floats apart in the accumulator's order, so
// each is a store of its own; lanes with t >= 2 store the second query
// first, which puts a store's 32 lanes in 32 banks (rows 0, 2, 5, 7 and
// 1, 3, 4, 6 of an 8 x 8 tile, 8 floats each, are four different quarters).
template <typename Traits, int kQueryTiles>
__device__ __forceinline__ void StoreDqPartTransposed(const float (&dqt)[kQueryTiles][4],
                                                      uint32_t dq_part, int wg_warp, int g,
                                                      int t) {
  using Layout = DqAccumLayout<Traits::kHeadDim>;
  static_assert(kQueryTiles * 8 == Traits::kBlockM && Layout::kHalf == 64,
                "a step's queries x the warpgroup's 64 columns");
  // Two base addresses and immediate offsets (DqAccumLayout's
  // TransposedLanePart / TransposedTilePart): 40 addresses, hoisted out of
  // the step loop, took 40 registers and spilled 260 B.
  const int odd_first = t >= 2;
  const uint32_t lane_at = dq_part + 4 * Layout::TransposedLanePart(wg_warp, g, t);
  const uint32_t first_at = lane_at + 4 * Layout::kTileRowFloats * odd_first;
  const uint32_t second_at = lane_at + 4 * Layout::kTileRowFloats * (1 - odd_first);
#pragma unroll
  for (int nt = 0; nt < kQueryTiles; ++nt)
#pragma unroll
    for (int hc = 0; hc < 2; ++hc) {
      const float first = odd_first ? dqt[nt][2 * hc + 1] : dqt[nt][2 * hc];
      const float second = odd_first ? dqt[nt][2 * hc] : dqt[nt][2 * hc + 1];
      const uint32_t offset = 4 * Layout::TransposedTilePart(nt, hc);
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(first_at + offset), "f"(first));
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(second_at + offset), "f"(second));
    }
}

// The bulk reductions of warpgroup w's staged part of the step at query m0
// of (batch, head) bh into dq_accum, by one thread, committed as one bulk
// group: one contiguous range of the accumulator per column half, the
// part's groups of 16 rows that hold rows below seqlen_q (none: the row
// split's second warpgroup in a last step of 64 or fewer queries).
template <typename Traits>
__device__ __forceinline__ void IssueDqReduce(uint32_t dq_part, float* dq_accum, int64_t bh,
                                              int64_t seqlen_q, int64_t m0, int warpgroup) {
  using Layout = DqAccumLayout<Traits::kHeadDim>;
  constexpr int kRowBytes = Traits::kDqHalfCols * 4;
  const int64_t m = Traits::kDqRowSplit ? m0 + 64 * warpgroup : m0;
  if (m >= seqlen_q) return;
  const int64_t left = Layout::PaddedRows(seqlen_q) - m;
  constexpr int kRows = Traits::kDqPartRows;
  const int bytes = static_cast<int>(left < kRows ? left : kRows) * kRowBytes;
  if constexpr (Traits::kDqRowSplit) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
      BulkReduceAddF32(dq_accum + Layout::HalfRows(bh, seqlen_q, half, m),
                       dq_part + half * 64 * kRowBytes, bytes);
  } else {
    BulkReduceAddF32(dq_accum + Layout::HalfRows(bh, seqlen_q, warpgroup, m), dq_part, bytes);
  }
  BulkCommit();
}

// Both, in the warpgroup that computed the part: the stores, fenced for the
// TMA unit, a warpgroup barrier, then thread 0's reductions.
template <typename Traits, int kDqTiles>
__device__ __forceinline__ void ReduceDqPart(const float (&dq)[kDqTiles][4], uint32_t dq_part,
                                             float* dq_accum, int64_t bh, int64_t seqlen_q,
                                             int64_t m0, int warpgroup, int wg_warp, int wg_tid,
                                             int g, int t) {
  if constexpr (Traits::kDqTransposed)
    StoreDqPartTransposed<Traits>(dq, dq_part, wg_warp, g, t);
  else
    StoreDqPart<Traits>(dq, dq_part, wg_warp, g, t);
  FenceProxyAsync();
  WarpgroupBarrier(warpgroup);
  if (wg_tid == 0) IssueDqReduce<Traits>(dq_part, dq_accum, bh, seqlen_q, m0, warpgroup);
}

// The wide kernel's dQ part (sm90/mainloop_bwd_wide.cuh, kDq), added from
// registers: warpgroup w's fragments hold the step's 64 queries (warp
// wg_warp's rows 16 wg_warp.., the lane's pair of column tile dt at row g
// (+ 8 hr), columns 2t, 2t + 1) x column half w, which DqAccumLayout keeps as
// two contiguous floats each: one float2 atomic add per pair, fire and forget
// (no result: RED). A warp's rows are one group of 16, all at or past
// seqlen_q or none (the accumulator's rows stop at PaddedRows).
template <int kHeadDim, int kTiles>
__device__ __forceinline__ void RedDqFragments(const float (&dq)[kTiles][4], float* dq_accum,
                                               int64_t bh, int64_t seqlen_q, int64_t m0,
                                               int warpgroup, int wg_warp, int g, int t) {
  using Layout = DqAccumLayout<kHeadDim>;
  static_assert(kTiles == Layout::kHalf / 8, "a warpgroup's column half");
  if (m0 + Layout::kGroupRows * wg_warp >= seqlen_q) return;
  float* const part = dq_accum + Layout::HalfRows(bh, seqlen_q, warpgroup, m0);
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      atomicAdd(reinterpret_cast<float2*>(part + Layout::PartOffset(wg_warp, g, t, dt, hr)),
                make_float2(dq[dt][2 * hr], dq[dt][2 * hr + 1]));
}

// After the last step: the staging tile must outlive the reads of the last
// reduction.
__device__ __forceinline__ void DrainDqReductions(int wg_tid) {
  if (wg_tid == 0) BulkWait<0>();
}

}  // namespace jax_flash::cuda::sm90

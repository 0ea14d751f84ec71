// The Hopper backward's operands and their loads: the kernel's parameters
// (BwdTmaArgs), where the tiles and barriers lie in shared memory (BwdSmem),
// the stages' full barriers, and the loads that fill them: Q and dO through
// TMA, lse2 and D through TMA or cp.async, K and V by cp.async, a tile's
// first step. Used by the mainloops (mainloop_bwd.cuh, mainloop_bwd_wide.cuh),
// the kernels of bwd.cuh and the warp-specialized kernel's producer
// (bwd_ws.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/query_steps.cuh"
#include "cuda/common/copy.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm90/copy.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tma.cuh"

namespace jax_flash::cuda::sm90 {

// The kernel's parameters: Q and dO come through TMA (tma.cuh), in boxes
// of 64 columns x kBlockM rows; lse2 and D in boxes of kBlockM rows where
// stats_by_tma (the tile's stats_tma, and seqlen_q % 4 == 0: the launcher
// sets it), else by cp.async (LoadRowStats).
struct BwdTmaArgs {
  BwdArgs args;
  CUtensorMap q_map;
  CUtensorMap dout_map;
  CUtensorMap lse_map;
  CUtensorMap delta_map;
  bool stats_by_tma;
  KeyBlockSectionScheduler::Args sched;
  // dK and dV in boxes of 64 columns x 64 rows, where the tile stores them
  // by TMA (BwdTile::dkdv_tma; else unset).
  CUtensorMap dk_map;
  CUtensorMap dv_map;
};

// Where the tiles and barriers are in shared memory: BwdSm90Traits' offsets
// from the 1024-byte-aligned start of the dynamic shared memory, for the
// warp-specialized kernel's producer roles. (BwdMainloop adds the same
// offsets in place: through these accessors the kernels without warp
// specialization compiled to other SASS, and they are what has run on a GPU.)
template <typename Traits>
struct BwdSmem {
  uint32_t base;
  __device__ __forceinline__ static BwdSmem Of(unsigned char* smem_raw) {
    return BwdSmem{(SmemAddr(smem_raw) + sm90::kAtomBytes - 1) & ~(sm90::kAtomBytes - 1)};
  }
  __device__ __forceinline__ uint32_t q() const { return base + Traits::kQOffset; }
  __device__ __forceinline__ uint32_t dout() const { return base + Traits::kDoutOffset; }
  __device__ __forceinline__ uint32_t dq() const { return base + Traits::kDqOffset; }
  __device__ __forceinline__ uint32_t lse() const { return base + Traits::kLseOffset; }
  __device__ __forceinline__ uint32_t delta() const { return base + Traits::kDeltaOffset; }
  __device__ __forceinline__ uint32_t full() const { return base + Traits::kFullOffset; }
  __device__ __forceinline__ uint32_t empty() const { return base + Traits::kEmptyOffset; }
  __device__ __forceinline__ uint32_t dq_slot() const { return base + Traits::kDqSlotOffset; }
  // A shared address as a generic pointer (lse2 and D are read and written
  // through them).
  __device__ __forceinline__ static float* Floats(unsigned char* smem_raw, uint32_t addr) {
    return reinterpret_cast<float*>(smem_raw + (addr - SmemAddr(smem_raw)));
  }
};

// A step's lse2 and D (kBlockM rows of (batch, head) bh from query m0) into a
// stage, completing on the stage's mbarrier `bar`: by thread 0 through TMA,
// which costs the other threads nothing (ncu: 128 threads' cp.async were ~5%
// of the D = 64 step's samples, all in warpgroup 0), or by cp.async from the
// caller's first kLoaders threads (tid), at most 2 kBlockM of them, each an
// arrival of the barrier (RowStatsArrivals).
// The TMA bytes: RowStatsTxBytes, for thread 0's expect_tx. The TMA path is
// compiled only where the tile asks for it (BwdTile::stats_tma): at D = 128
// it cost the kernels 8-90 B more spills and 1-5% of their time.
template <class Traits>
__device__ __forceinline__ bool RowStatsByTma(const BwdTmaArgs& tma_args) {
  return Traits::kTile.stats_tma && tma_args.stats_by_tma;
}
template <class Traits, int kLoaders = Traits::kThreads>
__device__ __forceinline__ uint32_t RowStatsArrivals(const BwdTmaArgs& tma_args) {
  constexpr int kRows = 2 * Traits::kBlockM;
  return RowStatsByTma<Traits>(tma_args) ? 0 : (kLoaders < kRows ? kLoaders : kRows);
}
template <class Traits>
__device__ __forceinline__ uint32_t RowStatsTxBytes(const BwdTmaArgs& tma_args) {
  return RowStatsByTma<Traits>(tma_args) ? 2 * Traits::kBlockM * 4 : 0;
}
template <class Traits, int kLoaders = Traits::kThreads>
__device__ __forceinline__ void IssueRowStats(const BwdTmaArgs& tma_args, int64_t bh, int64_t m0,
                                              float* lse_stage, float* delta_stage, uint32_t bar,
                                              int tid) {
  constexpr int kBlockM = Traits::kBlockM;
  if (RowStatsByTma<Traits>(tma_args)) {
    if (tid == 0) {
      sm90::TmaLoadBox2D(SmemAddr(lse_stage), &tma_args.lse_map, static_cast<int>(m0),
                         static_cast<int>(bh), bar);
      sm90::TmaLoadBox2D(SmemAddr(delta_stage), &tma_args.delta_map, static_cast<int>(m0),
                         static_cast<int>(bh), bar);
    }
  } else {
    const int64_t seqlen_q = tma_args.args.p.shape.seqlen_q;
    if constexpr (kLoaders >= 2 * kBlockM) {
      LoadRowStats<kBlockM>(tma_args.args, bh * seqlen_q, m0, seqlen_q, lse_stage, delta_stage,
                            tid);
      if (tid < 2 * kBlockM) sm90::CpAsyncArriveOn(bar);
    } else {
#pragma unroll 1
      for (int r = tid; r < 2 * kBlockM; r += kLoaders)
        LoadRowStats<kBlockM>(tma_args.args, bh * seqlen_q, m0, seqlen_q, lse_stage,
                              delta_stage, r);
      if (tid < kLoaders) sm90::CpAsyncArriveOn(bar);
    }
  }
}

// A step's loads into stage `stage`, all onto its full mbarrier `bar`: Q and
// dO of query head h from query m0 through TMA (thread 0; rows past seqlen_q
// and columns past head_dim arrive as zeros), lse2 and D by IssueRowStats
// with the first kLoaders threads. Indices in 32 bits, as the mainloops keep
// them (dispatch.cu's kMaxIndex32 bounds batch x heads and the lengths).
template <class Traits, int kLoaders = Traits::kThreads>
__device__ __forceinline__ void IssueStepLoads(const BwdTmaArgs& tma_args, uint32_t q,
                                               uint32_t dout, float* lse, float* delta,
                                               int stage, int b, int h, int m0, uint32_t bar,
                                               int tid) {
  constexpr int kBlockM = Traits::kBlockM;
  if (tid == 0) {
    sm90::MbarrierArriveExpectTx(bar, 2 * Traits::kQBytes + RowStatsTxBytes<Traits>(tma_args));
#pragma unroll
    for (int block = 0; block < Traits::kSmemCols / 64; ++block) {
      const uint32_t offset = stage * Traits::kQBytes + block * kBlockM * sm90::kSwizzleBytes;
      sm90::TmaLoadBox(q + offset, &tma_args.q_map, block * 64, m0, h, b, bar);
      sm90::TmaLoadBox(dout + offset, &tma_args.dout_map, block * 64, m0, h, b, bar);
    }
  }
  const int num_heads_q = static_cast<int>(tma_args.args.p.shape.num_heads_q);
  IssueRowStats<Traits, kLoaders>(tma_args, b * num_heads_q + h, m0, lse + stage * kBlockM,
                                  delta + stage * kBlockM, bar, tid);
}

// The full mbarriers of the stages, once per CTA (kernels without warp
// specialization): one arrival of thread 0's expect_tx, plus IssueRowStats'
// cp.async arrivals.
template <class Traits>
__device__ __forceinline__ void InitStageBarriers(const BwdTmaArgs& tma_args, int tid) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t full_bar = BwdSmem<Traits>::Of(smem_raw).full();
  if (tid == 0) {
    for (int stage = 0; stage < Traits::kStages; ++stage)
      sm90::MbarrierInit(full_bar + 8 * stage, 1 + RowStatsArrivals<Traits>(tma_args));
    sm90::FenceBarrierInit();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
}

// A tile's K and V (keys n0.. of kv head h_kv) by cp.async from all kThreads
// threads, as one commit group. All kSmemCols columns, so that those past
// the head dim are zeros: the dQ GEMM of a head dim of 96 reads K's second
// column block whole.
template <typename T, class Traits>
__device__ __forceinline__ void IssueKvLoads(const BwdParams& p, uint32_t sK, uint32_t sV, int b,
                                             int h_kv, int n0, int tid) {
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const int64_t seqlen_k = p.shape.seqlen_k;
  const GmemRows<T> k = GmemRows<T>::Head(p.k, p.k_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v = GmemRows<T>::Head(p.v, p.v_strides, b, h_kv, seqlen_k, head_dim);
  LoadSwizzledTile<T, Traits::kBlockN, Traits::kSmemCols, Traits::kThreads>(sK, k, n0, tid);
  LoadSwizzledTile<T, Traits::kBlockN, Traits::kSmemCols, Traits::kThreads>(sV, v, n0, tid);
  CpAsyncCommit();
}

// The query steps of BwdKernel's tile: rotated (BwdTile::rotate_steps) by
// the key block's place among the head's key blocks, in non-causal calls
// only; the mainloop and IssueTileLoads take the same walk from here.
template <class Traits>
using TileSteps = QuerySteps<Traits::kBlockN, Traits::kBlockM, Traits::kTile.rotate_steps>;

template <class Traits>
__device__ __forceinline__ TileSteps<Traits> MakeTileSteps(const BwdParams& p,
                                                           const BatchMask& mask,
                                                           const KeyBlockScheduler::Tile& tile,
                                                           int n0, int group) {
  if constexpr (Traits::kTile.rotate_steps) {
    if (!p.mask.causal)
      return TileSteps<Traits>::Make(mask, n0, group, tile.n_block,
                                     CeilDiv(p.shape.seqlen_k, int64_t{Traits::kBlockN}));
  }
  return TileSteps<Traits>::Make(mask, n0, group);
}

// A tile's loads before its mainloop (kernels without warp specialization):
// K and V (IssueKvLoads, which BwdMainloop waits for), and its first step's
// into stage `step` % kStages, `step` counting the CTA's steps over its
// tiles so far. The persistent kernel issues them for its next tile while
// this one's dK and dV are stored: K, V and that stage must be free then
// (both warpgroups past the tile's last step).
template <typename T, class Traits>
__device__ __forceinline__ void IssueTileLoads(const BwdTmaArgs& tma_args,
                                               const KeyBlockScheduler::Tile& tile, int step,
                                               int tid) {
  constexpr int kBlockN = Traits::kBlockN, kBlockM = Traits::kBlockM;
  extern __shared__ unsigned char smem_raw[];
  const BwdSmem<Traits> sm = BwdSmem<Traits>::Of(smem_raw);
  const BwdParams& p = tma_args.args.p;
  const int h_kv = static_cast<int>(tile.h_kv), b = static_cast<int>(tile.b);
  const int n0 = static_cast<int>(tile.n_block) * kBlockN;
  IssueKvLoads<T, Traits>(p, sm.base, sm.base + Traits::kVOffset, b, h_kv, n0, tid);
  const int group = static_cast<int>(p.shape.group_size());
  const BatchMask mask =
      BatchMask::For(p.mask, b, h_kv * group, p.shape.seqlen_q, p.shape.seqlen_k);
  const TileSteps<Traits> walk = MakeTileSteps<Traits>(p, mask, tile, n0, group);
  if (walk.count > 0) {
    const int stage = step % Traits::kStages;
    IssueStepLoads<Traits>(tma_args, sm.q(), sm.dout(), BwdSmem<Traits>::Floats(smem_raw, sm.lse()),
                           BwdSmem<Traits>::Floats(smem_raw, sm.delta()), stage, b, h_kv * group,
                           static_cast<int>((walk.m_begin + walk.start) * kBlockM),
                           sm.full() + 8 * stage, tid);
  }
}

}  // namespace jax_flash::cuda::sm90

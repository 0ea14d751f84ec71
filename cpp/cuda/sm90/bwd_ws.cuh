// The warp-specialized Hopper backward (dK/dV, and dQ in the fast mode), after
// FlashAttention-3's: the work of sm90/bwd.cuh's BwdKernel split by role
// over three warpgroups per CTA of 128 keys, so that the MMA warpgroups
// neither issue loads nor wait on the dQ reductions:
//   producer warp 0: Q, dO, lse2 and D of every step into the ring of
//     kStages stages, each fill after both MMA warpgroups released the
//     stage (its empty mbarrier); one lane issues the TMA loads (lse2 and D
//     by TMA where the tile says so, else the warp's cp.async);
//   producer warp 1 (dQ warp): per step and MMA warpgroup, the bulk
//     reduce-adds of the part that warpgroup staged (DqHandoff,
//     sm90/epilogue_bwd.cuh), so that the warpgroup stages it and goes on
//     instead of waiting on a barrier of its own for one thread to issue
//     them;
//   MMA warpgroups (two of 64 keys): BwdMainloop<..., kWs = true>, the same
//     steps as BwdKernel's, then the same dK/dV epilogue.
// Registers: __launch_bounds__(384, 1) gives 168 per thread; setmaxnreg
// lowers the producer warpgroup's to kBwdWsProducerRegs and raises the MMA
// warpgroups' to kBwdWsMmaRegs (FA3's 24 / 240 for two MMA warpgroups).
// Built where the bucket's BwdTile::ws says so (a tuning hook until it has
// been timed: cpp/cuda/NOTES_sm90_bwd.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/query_steps.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/epilogue_bwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/epilogue_bwd.cuh"
#include "cuda/sm90/mainloop_bwd.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tma.cuh"

namespace jax_flash::cuda::sm90 {

inline constexpr int kBwdWsProducerRegs = 24;
inline constexpr int kBwdWsMmaRegs = 240;
static_assert(kBwdWsProducerRegs * 128 + kBwdWsMmaRegs * 256 <= 168 * 384,
              "what setmaxnreg can hand out of the launch's 168 registers x 384 threads");

// The steps of this CTA as every role walks them: (query head, first query).
template <typename Traits>
struct BwdWsSteps {
  QuerySteps<Traits::kBlockN, Traits::kBlockM> walk;
  int64_t h0, gi = 0, mi = 0;

  __device__ __forceinline__ static BwdWsSteps Make(const BwdParams& p,
                                                    const KeyBlockScheduler::Tile& tile) {
    BwdWsSteps r;
    const int64_t group = p.shape.group_size();
    r.h0 = tile.h_kv * group;
    const BatchMask mask =
        BatchMask::For(p.mask, tile.b, r.h0, p.shape.seqlen_q, p.shape.seqlen_k);
    r.walk = QuerySteps<Traits::kBlockN, Traits::kBlockM>::Make(
        mask, tile.n_block * Traits::kBlockN, group);
    r.mi = r.walk.first;
    return r;
  }
  __device__ __forceinline__ int64_t head() const { return h0 + gi; }
  __device__ __forceinline__ int64_t m0() const { return (walk.m_begin + mi) * Traits::kBlockM; }
  __device__ __forceinline__ void Advance() { walk.Advance(gi, mi); }
};

// Producer warp 0, every lane: the loads of every step (IssueStepLoads, the
// warp's 32 lanes the loaders), stage s % kStages, each after the stage's
// previous use is released.
template <typename Traits>
__device__ __forceinline__ void BwdWsProducer(const BwdTmaArgs& tma_args,
                                              const KeyBlockScheduler::Tile& tile, int lane) {
  extern __shared__ unsigned char smem_raw[];
  const BwdSmem<Traits> sm = BwdSmem<Traits>::Of(smem_raw);
  float* const lse = BwdSmem<Traits>::Floats(smem_raw, sm.lse());
  float* const delta = BwdSmem<Traits>::Floats(smem_raw, sm.delta());
  BwdWsSteps<Traits> steps = BwdWsSteps<Traits>::Make(tma_args.args.p, tile);
  for (int64_t s = 0; s < steps.walk.count; ++s, steps.Advance()) {
    const int stage = static_cast<int>(s % Traits::kStages);
    // Fill k of the stage once its use k - 1 is released (a fresh barrier
    // passes the wait for the phase before its first).
    MbarrierWait(sm.empty() + 8 * stage,
                 static_cast<uint32_t>(((s / Traits::kStages) & 1) ^ 1));
    IssueStepLoads<Traits, 32>(tma_args, sm.q(), sm.dout(), lse, delta, stage,
                               static_cast<int>(tile.b), static_cast<int>(steps.head()),
                               static_cast<int>(steps.m0()), sm.full() + 8 * stage, lane);
  }
}

// Producer warp 1 (the dQ warp), every lane: each MMA warpgroup's staged dQ
// parts into the accumulator, in step order, until both have posted their
// end (DqHandoff; the two warpgroups walk the same steps).
template <typename Traits>
__device__ __forceinline__ void BwdWsDqWriter(const BwdTmaArgs& tma_args, int lane) {
  extern __shared__ unsigned char smem_raw[];
  const BwdSmem<Traits> sm = BwdSmem<Traits>::Of(smem_raw);
  const int64_t seqlen_q = tma_args.args.p.shape.seqlen_q;
  for (bool more = true; more;) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      int32_t bh, m0;
      DqHandoff::WaitFull(sm.dq_slot(), w, &bh, &m0);
      more = m0 != DqHandoff::kEnd;
      if (!more) continue;
      if (lane == 0) {
        IssueDqReduce<Traits>(sm.dq() + w * Traits::kDqPartBytes, tma_args.args.dq_accum, bh,
                              seqlen_q, m0, w);
        BulkWaitRead<0>();  // the staging tile is free again
      }
      __syncwarp();
      DqHandoff::Empty(w);
    }
  }
  if (lane == 0) BulkWait<0>();  // the reductions are done before the CTA's memory goes
}

template <typename T, typename Traits, bool kSoftcap, bool kDq, bool kDropout>
__global__ void __launch_bounds__(Traits::kWsThreads, 1)
    BwdWsKernel(const __grid_constant__ BwdTmaArgs tma_args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const ThreadPos pos = ThreadPos::Here();
  const KeyBlockScheduler::Tile tile = KeyBlockSectionScheduler::Get(tma_args.sched);
  if (pos.tid == 0) {
    extern __shared__ unsigned char smem_raw[];
    const BwdSmem<Traits> sm = BwdSmem<Traits>::Of(smem_raw);
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      MbarrierInit(sm.full() + 8 * stage, 1 + RowStatsArrivals<Traits, 32>(tma_args));
      MbarrierInit(sm.empty() + 8 * stage, Traits::kThreads / 32);  // the MMA warps
    }
    FenceBarrierInit();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them; the last CTA barrier
  if (pos.warp < 4) {
    SetMaxRegsDec<kBwdWsProducerRegs>();
    if (pos.warp == 0) BwdWsProducer<Traits>(tma_args, tile, pos.lane);
    if (kDq && pos.warp == 1) BwdWsDqWriter<Traits>(tma_args, pos.lane);
    return;
  }
  SetMaxRegsInc<kBwdWsMmaRegs>();
  ThreadPos mma = pos;  // counted from the first MMA thread, as BwdMainloop counts
  mma.tid -= 128;
  mma.warp -= 4;
  float dk[Traits::kHeadDim / kMmaN][4], dv[Traits::kHeadDim / kMmaN][4];
  BwdMainloop<T, Traits, kSoftcap, kDq, kDropout, /*kWs=*/true>(tma_args, tile, mma, dk, dv);
  StoreWarpDkDv<T, Traits, kDropout>(tma_args, tile, mma, dk, dv);
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

}  // namespace jax_flash::cuda::sm90

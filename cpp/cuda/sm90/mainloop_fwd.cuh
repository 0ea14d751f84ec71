// The Hopper forward's mainloop: the CTA's key blocks, K/V through a
// two-stage pipeline (cp.async, or TMA where the tile table says so) into
// swizzled shared tiles, both GEMMs on wgmma; it produces this warp's O, m and l (common/fwd.cuh), one m-tile of 16
// rows. A warp-specialized pipeline (a producer warpgroup loading K/V with
// TMA, the consumers' softmax overlapping the next block's GEMM) replaces
// this function alone: the scheduler, FwdBlock and the epilogue stay.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/sm90/bias_tile.cuh"
#include "cuda/sm90/copy.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// The kernel's parameters: with Q, K and V through TMA (FwdTile::tma),
// their tensor maps, read in boxes of 64 columns x kBlockM (Q) or kBlockN
// (K, V) rows, which land as the column blocks of the swizzled tiles; with a
// bias, its map (EncodeBiasTensorMap), whatever FwdTile::tma says.
struct FwdTmaArgs {
  FwdArgs args;
  CUtensorMap q_map, k_map, v_map;
  CUtensorMap bias_map;
};

// Named barrier (sm90/pipeline.cuh) of both warpgroups after reading a bias
// stage.
inline constexpr int kBiasReadBarrier = 1;

// With a bias (args.p.score.bias), its tile of each key block comes through
// TMA into one stage after V's (sm90/bias_tile.cuh) and is added to S before
// the soft cap; the next block's tile is issued once both warpgroups have
// read it. kDropout: P is dropped after the softmax (l sums it before), from
// keep bits drawn once P is packed (DropPackedRows); the kernel scales O by
// 1 / (1 - rate) in its epilogue.
template <typename T, typename Traits, typename Bias, bool kDropout>
__device__ __forceinline__ void FwdMainloop(const FwdTmaArgs& kargs, const FwdBlock<T>& blk,
                                            const ThreadPos& pos,
                                            float (&o)[1][Traits::kHeadDim / kMmaN][4],
                                            float (&row_m)[1][2], float (&row_l)[1][2]) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = kBlockN / kMmaN;   // n-tiles of S per warp
  const FwdArgs& args = kargs.args;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (SmemAddr(smem_raw) + sm90::kAtomBytes - 1) & ~(sm90::kAtomBytes - 1);
  const uint32_t sQ = smem_base;
  const uint32_t sK = sQ + Traits::kQBytes;                       // [kStages] tiles
  const uint32_t sV = sK + Traits::kStages * Traits::kKvBytes;    // [kStages] tiles
  const bool has_bias = args.p.score.bias != nullptr;
  const uint32_t sBias = sV + Traits::kStages * Traits::kKvBytes;  // with a bias
  // The mbarriers of Q and of each K/V stage (TMA; the k-th use of a stage
  // completes its barrier's phase k), then the bias stage's.
  const uint32_t q_bar = sBias + (has_bias ? Bias::kBytes : 0);
  const uint32_t kv_bar = q_bar + 8;
  const uint32_t bias_bar = kv_bar + 8 * Traits::kStages;

  const int tid = pos.tid, warp = pos.warp, g = pos.g, t = pos.t;
  const int warpgroup = warp / 4;
  const int64_t m0 = blk.m0, n_begin = blk.n_begin, n_end = blk.n_end;
  const GmemRows<T>& q = blk.q;
  const GmemRows<T>& k = blk.k;
  const GmemRows<T>& v = blk.v;

  // TMA: the K and V tiles of key block n into `stage`, issued by thread 0
  // (generic, so that it is compiled only where ta is an FwdTmaArgs).
  auto tma_load_kv = [&](const auto& ta, int64_t n, int stage) {
    if (tid == 0) {
      const uint32_t bar = kv_bar + 8 * stage;
      MbarrierArriveExpectTx(bar, 2 * Traits::kKvBytes);
      const int h_kv = static_cast<int>(blk.h / args.p.shape.group_size());
#pragma unroll
      for (int block = 0; block < Traits::kSmemCols / kSwizzleElems; ++block) {
        const uint32_t offset = stage * Traits::kKvBytes + block * kBlockN * kSwizzleBytes;
        TmaLoadBox(sK + offset, &ta.k_map, block * kSwizzleElems,
                   static_cast<int>(n * kBlockN), h_kv, static_cast<int>(blk.b), bar);
        TmaLoadBox(sV + offset, &ta.v_map, block * kSwizzleElems,
                   static_cast<int>(n * kBlockN), h_kv, static_cast<int>(blk.b), bar);
      }
    }
  };

  // The bias tile of key block n into its stage, by thread 0.
  auto tma_load_bias = [&](int64_t n) {
    if (tid == 0)
      Bias::Load(sBias, &kargs.bias_map, args.p.score, static_cast<int>(n * kBlockN),
                         static_cast<int>(m0), blk.h, blk.b, bias_bar);
  };

  if (Traits::kTma || has_bias) {
    if (tid == 0) {
      MbarrierInit(q_bar, 1);
      for (int stage = 0; stage < Traits::kStages; ++stage) MbarrierInit(kv_bar + 8 * stage, 1);
      if (has_bias) MbarrierInit(bias_bar, 1);
      FenceBarrierInit();
    }
    __syncthreads();  // the barriers are initialized before anyone uses them
    if (has_bias && n_begin < n_end) tma_load_bias(n_begin);
  }
  if constexpr (Traits::kTma) {
    if (n_begin < n_end && tid == 0) {
      MbarrierArriveExpectTx(q_bar, Traits::kQBytes);
#pragma unroll
      for (int block = 0; block < Traits::kSmemCols / kSwizzleElems; ++block)
        TmaLoadBox(sQ + block * kBlockM * kSwizzleBytes, &kargs.q_map, block * kSwizzleElems,
                   static_cast<int>(m0), static_cast<int>(blk.h), static_cast<int>(blk.b), q_bar);
    }
    if (n_begin < n_end) tma_load_kv(kargs, n_begin, 0);
  } else if (n_begin < n_end) {
    LoadSwizzledTile<T, kBlockM, kHeadDim, Traits::kThreads>(sQ, q, m0, tid);
    LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
  }

  const int warp_row0 = warp * Traits::kWarpRows;
  // This warpgroup's 64 rows of Q: row 64 * warpgroup of every column block.
  const uint32_t q_rows = sQ + warpgroup * 64 * sm90::kSwizzleBytes;
  const float scale_log2 = args.scale_log2;
  const float scale = static_cast<float>(args.p.score.scale);  // with a bias (MakeFwdArgs)
  const float rescale_margin = args.rescale_margin;
  const HeadDropout dropout = kDropout ? HeadDropout::For(args.p.dropout, args.p.shape.batch,
                                                          blk.b, blk.h)
                                       : HeadDropout{};

  // Key blocks in FwdBlock::NextBlock's steps (every block without a tile
  // map); `step` counts them for the stages and the barriers' phases.
  int64_t next = blk.template NextBlock<kBlockN>(n_begin + 1);
  for (int64_t n = n_begin, step = 0; n < n_end; n = next, ++step) {
    if (step > 0) next = blk.template NextBlock<kBlockN>(n + 1);
    const int stage = static_cast<int>(step & 1);
    if constexpr (Traits::kTma) {
      // Both warpgroups are done with the previous block, whose stage the
      // prefetch below overwrites; then this block's tiles (and, the first
      // time, Q) are waited for on their barriers.
      __syncthreads();
      if (next < n_end) tma_load_kv(kargs, next, stage ^ 1);
      if (step == 0) MbarrierWait(q_bar, 0);
      MbarrierWait(kv_bar + 8 * stage, static_cast<uint32_t>((step >> 1) & 1));
    } else {
      // One barrier per block: publishes this block's K/V (fenced for the
      // async proxy that wgmma reads through) and tells that both warpgroups
      // are done with the previous block, whose stage the prefetch below
      // overwrites.
      CpAsyncWait<0>();
      sm90::FenceProxyAsync();
      __syncthreads();
      if (next < n_end) {
        const int other = stage ^ 1;
        LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sK + other * Traits::kKvBytes, k,
                                                                  next * kBlockN, tid);
        LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sV + other * Traits::kKvBytes, v,
                                                                  next * kBlockN, tid);
        CpAsyncCommit();
      }
    }
    const uint32_t k_tile = sK + stage * Traits::kKvBytes;
    const uint32_t v_tile = sV + stage * Traits::kKvBytes;

    // ---- S = Q K^T ----------------------------------------------------------
    float s[1][kNTiles][4];
    sm90::WgmmaFence();
    sm90::GemmKMajor<T, kHeadDim, kBlockM, kBlockN>(s[0], q_rows, k_tile);
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(s[0]);

    // ---- bias; soft cap, mask (common/score.cuh); online softmax: S -> P ----
    if (has_bias) {
      MbarrierWait(bias_bar, static_cast<uint32_t>(step & 1));
      Bias::Add(s[0], sBias, warp_row0, scale, g, t);
      // Both warpgroups have read the stage: the next block's tile may land.
      NamedBarrierSync(kBiasReadBarrier, Traits::kThreads);
      if (next < n_end) tma_load_bias(next);
    }
    TransformAndMask<kBlockM>(s, args.softcap, args.scale_over_cap, blk.mask, m0, m0 + warp_row0,
                              n * kBlockN, g, t, blk.template BlockClass<kBlockN>(n));
    OnlineSoftmax(s, o, row_m, row_l, scale_log2, rescale_margin);

    // ---- O += P V -----------------------------------------------------------
    // k-step ks covers keys 16ks..16ks+15: two 8-row groups, 2048 bytes into
    // every column block of V.
    uint32_t a[kBlockN / kMmaK][4];
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      PackA<T>(a[ks], s[0][2 * ks], s[0][2 * ks + 1]);
    }
    if constexpr (kDropout) DropPackedRows(a, dropout, m0 + warp_row0, n * kBlockN, g, t);
    sm90::WgmmaFence();
    sm90::FenceRegisters(o[0]);
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      const uint64_t desc_v =
          sm90::SmemDescriptor(v_tile + ks * 2 * sm90::kAtomBytes,
                               kBlockN * sm90::kSwizzleBytes, sm90::kAtomBytes);
      sm90::WgmmaRSColumns<T, kHeadDim>(o[0], a[ks], desc_v, kBlockN * sm90::kSwizzleBytes, 1);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(o[0]);
  }

}

}  // namespace jax_flash::cuda::sm90

// FlashAttention forward for Hopper (sm_90a): the FlashAttention-2 algorithm
// of sm80/fwd.cuh with its two GEMMs on warpgroup MMAs (wgmma.mma_async).
//
// Work partition: one CTA per (query block of 128 rows, q head, batch), two
// warpgroups of 4 warps, each warpgroup 64 query rows; every warp then owns
// 16 rows, as in the sm_80 kernel with one m-tile, so the mask, the online
// softmax (lazy rescale) and the epilogue are the ones it shares with that
// kernel (common/). K/V blocks of
// kBlockN keys stream through a two-stage cp.async pipeline into 128-byte-
// swizzled shared tiles that wgmma reads directly (wgmma.cuh):
//   S = Q K^T: A = Q and B = K from shared memory (both K-major);
//   O += P V:  A = P from registers (the S accumulators, converted to 16
//              bits in place), B = V from shared memory (MN-major).
// Not (yet) FA3's producer warpgroup with TMA, nor the ping-pong between
// warpgroups: the two warpgroups overlap each other's softmax and GEMMs only
// through the warp scheduler.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/copy.cuh"
#include "cuda/common/epilogue_fwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/copy.cuh"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim_>
struct FwdSm90Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr FwdTile kTile = FwdTileSize(kHeadDim);  // sm90/tile_size.h
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kThreads = kTile.threads;
  static constexpr int kStages = kTile.stages;
  static constexpr int kWarpRows = 16;
  static constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of O per warp
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // one K or V stage
  // + one swizzle period so that the tiles can start 1024-byte aligned.
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKvBytes + kAtomBytes;
  static_assert(kBlockM == 2 * 64 && kThreads == 2 * 128, "two warpgroups of 64 rows");
  static_assert(kHeadDim % kSwizzleElems == 0, "head dim must be a multiple of 64");
};

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FwdKernel(const __grid_constant__ FwdArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = kBlockN / kMmaN;   // n-tiles of S per warp
  constexpr int kDTiles = Traits::kDTiles;  // n-tiles of O per warp
  const FwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (SmemAddr(smem_raw) + sm90::kAtomBytes - 1) & ~(sm90::kAtomBytes - 1);
  const uint32_t sQ = smem_base;
  const uint32_t sK = sQ + Traits::kQBytes;                       // [kStages] tiles
  const uint32_t sV = sK + Traits::kStages * Traits::kKvBytes;    // [kStages] tiles

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warpgroup = warp / 4;
  const int g = lane / 4, t = lane % 4;
  const FwdBlock<T> blk =
      FwdBlock<T>::template Make<kBlockM, kBlockN>(p, QueryBlockScheduler::Get());
  const int64_t m0 = blk.m0, n_begin = blk.n_begin, n_end = blk.n_end;
  const GmemRows<T>& q = blk.q;
  const GmemRows<T>& k = blk.k;
  const GmemRows<T>& v = blk.v;

  // One m-tile per warp in the terms of common/softmax.cuh and common/fwd.cuh.
  float o[1][kDTiles][4];
  float row_m[1][2] = {{-INFINITY, -INFINITY}}, row_l[1][2] = {{0.f, 0.f}};
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[0][dt][r] = 0.f;

  if (n_begin < n_end) {
    LoadSwizzledTile<T, kBlockM, kHeadDim, Traits::kThreads>(sQ, q, m0, tid);
    LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
  }

  const int warp_row0 = warp * Traits::kWarpRows;
  // This warpgroup's 64 rows of Q: row 64 * warpgroup of every column block.
  const uint32_t q_rows = sQ + warpgroup * 64 * sm90::kSwizzleBytes;
  const float scale_log2 = args.scale_log2;
  const float rescale_margin = kRescaleLog2 / scale_log2;

  for (int64_t n = n_begin; n < n_end; ++n) {
    const int stage = static_cast<int>((n - n_begin) & 1);
    // One barrier per block: publishes this block's K/V (fenced for the async
    // proxy that wgmma reads through) and tells that both warpgroups are done
    // with the previous block, whose stage the prefetch below overwrites.
    CpAsyncWait<0>();
    sm90::FenceProxyAsync();
    __syncthreads();
    if (n + 1 < n_end) {
      const int next = stage ^ 1;
      LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sK + next * Traits::kKvBytes, k,
                                                                (n + 1) * kBlockN, tid);
      LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sV + next * Traits::kKvBytes, v,
                                                                (n + 1) * kBlockN, tid);
      CpAsyncCommit();
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

    // ---- score transform, mask, online softmax (common/) ------------
    TransformAndMask<kBlockM>(s, args.softcap, args.scale_over_cap, blk.mask, m0, m0 + warp_row0,
                              n * kBlockN, g, t);
    OnlineSoftmax(s, o, row_m, row_l, scale_log2, rescale_margin);

    // ---- O += P V -----------------------------------------------------------
    // k-step ks covers keys 16ks..16ks+15: two 8-row groups, 2048 bytes into
    // every column block of V.
    uint32_t a[kBlockN / kMmaK][4];
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      PackA<T>(a[ks], s[0][2 * ks], s[0][2 * ks + 1]);
    }
    sm90::WgmmaFence();
    sm90::FenceRegisters(o[0]);
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      const uint64_t desc_v =
          sm90::SmemDescriptor(v_tile + ks * 2 * sm90::kAtomBytes,
                               kBlockN * sm90::kSwizzleBytes, sm90::kAtomBytes);
      sm90::WgmmaRS<T, 1>(o[0], a[ks], desc_v, 1);
    }
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(o[0]);
  }

  // ---- epilogue: O / l, lse = m + log(l) (common/) -----------------
  StoreOutput<T>(p, blk.b, blk.h, m0 + warp_row0, o, row_m, row_l, scale_log2, g, t);
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

template <typename T, int kHeadDim>
cudaError_t LaunchFwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdSm90Traits<kHeadDim>;
  if (params.shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  return LaunchFwdGrid<Traits::kBlockM>(FwdKernel<T, Traits>, Traits::kThreads,
                                        Traits::kSmemBytes, params, stream);
}

}  // namespace jax_flash::cuda::sm90

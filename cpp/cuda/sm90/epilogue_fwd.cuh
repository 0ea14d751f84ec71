// The warp-specialized forward's epilogue through shared memory and the TMA
// unit, as FlashAttention-3's: a consumer warpgroup writes out = O / l for
// its 64 rows into a staging tile (stmatrix, the 128-byte swizzle of
// wgmma.cuh) and one of its threads stores the tile with TMA, which clips the
// rows past seqlen_q and the columns past head_dim. The threads' own 32-bit
// stores (common/epilogue_fwd.cuh's StoreOutput) fill half of each 32-byte
// sector per instruction, and sit on the consumers' path between tiles; the
// TMA store runs while the warpgroup starts its next tile. lse is written by
// the threads as before (one float per row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/epilogue_fwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// Warpgroup wg's out rows m0 .. m0 + 63 of (batch, head) (b, h), from this
// warp's (wg_warp of the warpgroup) O, m and l, through the staging tile
// `tile` (64 rows x kSmemCols, 1024-byte aligned) and `o_map` (boxes of 64
// columns x 64 rows). The tile is the warpgroup's own: the previous tile's
// TMA store must have read it (its issuing thread waits, then the warpgroup
// meets), and the writes are fenced for the TMA unit before the store.
// `read_barrier` (an mbarrier, 0: none): the issuing thread waits for the
// store's read and arrives on it, for a tile that lies over the V ring
// (fwd_ws.cuh, FwdWsSmem::kOOverV); otherwise the next tile's store waits.
template <typename T, int kSmemCols, int kConsumerWarpgroups, int kDTiles>
__device__ __forceinline__ void StoreOutputStaged(const CUtensorMap* o_map, const FwdParams& p,
                                                  int64_t b, int64_t h, int64_t m0, uint32_t tile,
                                                  int wg, int wg_warp, int lane,
                                                  const float (&o)[1][kDTiles][4],
                                                  const float (&row_m)[1][2],
                                                  const float (&row_l)[1][2], float scale_log2,
                                                  int g, int t, uint32_t read_barrier = 0) {
  static_assert(kDTiles % 2 == 0 && kDTiles * 8 <= kSmemCols, "whole 16-column steps");
  const bool issuer = wg_warp == 0 && lane == 0;
  float* lse = LseRow(p, b, h);
  const int64_t seqlen_q = p.shape.seqlen_q;
  const RowEnd end0 = FinishRow(row_m[0][0], row_l[0][0], scale_log2, lse,
                                m0 + wg_warp * 16 + g, seqlen_q, t);
  const RowEnd end1 = FinishRow(row_m[0][1], row_l[0][1], scale_log2, lse,
                                m0 + wg_warp * 16 + g + 8, seqlen_q, t);
  if (issuer) BulkWaitRead<0>();
  NamedBarrierSync(FwdWsBarrierIds<kConsumerWarpgroups>::kEpilogue + wg, 128);
  // One stmatrix per 16 columns: matrices (rows g, g + 8) x (columns
  // 16ks + 0..7, + 8..15) of this warp's 16 rows; lane l addresses row l % 8
  // of matrix l / 8.
  const int row = wg_warp * 16 + lane % 8 + ((lane / 8) % 2) * 8;
  auto out = [](const RowEnd& end, float x, float y) {
    return end.sees_nothing ? 0u : Pack2<T>(x * end.inv_l, y * end.inv_l);
  };
#pragma unroll
  for (int ks = 0; ks < kDTiles / 2; ++ks) {
    const float(&c0)[4] = o[0][2 * ks];
    const float(&c1)[4] = o[0][2 * ks + 1];
    StMatrixX4(tile + SwizzledOffset(row, 2 * ks + lane / 16, 64), out(end0, c0[0], c0[1]),
               out(end1, c0[2], c0[3]), out(end0, c1[0], c1[1]), out(end1, c1[2], c1[3]));
  }
  FenceProxyAsync();
  NamedBarrierSync(FwdWsBarrierIds<kConsumerWarpgroups>::kEpilogue + wg, 128);
  if (issuer) {
#pragma unroll
    for (int cb = 0; cb < (kDTiles * 8 + 63) / 64; ++cb)
      TmaStoreBox(o_map, cb * 64, static_cast<int>(m0), static_cast<int>(h), static_cast<int>(b),
                  tile + cb * 64 * kSwizzleBytes);
    BulkCommit();
    if (read_barrier != 0) {
      BulkWaitRead<0>();
      ArriveBarrier(read_barrier);
    }
  }
}

// Before the consumer warpgroup exits: its last TMA store has read the tile
// and written out.
__device__ __forceinline__ void DrainStagedOutput(int wg_warp, int lane) {
  if (wg_warp == 0 && lane == 0) BulkWait<0>();
}

}  // namespace jax_flash::cuda::sm90

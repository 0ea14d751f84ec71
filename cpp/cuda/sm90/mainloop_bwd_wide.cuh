// The Hopper backward's mainloop for head dims above 128 (192, 256), where
// dK and dV of 64 keys no longer fit one warpgroup's registers (2 x 128 per
// thread at D = 256). The CTA owns 64 keys; warpgroup w owns the head-dim
// half [w D/2, (w+1) D/2) of their dK and dV (D/2 registers per thread for
// both) and, per step of 64 queries, the queries [32w, 32w + 32):
//   S^T_w = K Q_w^T, dP^T_w = V dO_w^T  SS, both K-major (64 keys x 32 queries)
//   P^T_w, dS^T_w in registers          (common/softmax.cuh, common/score.cuh)
//     -> shared memory ([key][query] swizzled tiles, both warpgroups' halves)
//   -- CTA barrier --
//   dV_w += P^T dO_w, dK_w += dS^T Q_w   SS: P^T / dS^T K-major, B MN-major
//   with kDq: dQ_w = dS K_w              SS: dS M-major (dS^T's tile), K MN-major
// where X_w is the warpgroup's half of X's columns. dQ_w, the step's 64
// queries x the warpgroup's half summed over the CTA's 64 keys, goes into
// the float32 accumulator by atomics from registers (RedDqFragments): a
// staging tile of its own for the TMA unit's bulk reduction, as the D <= 128
// kernel has, does not fit in shared memory next to K, V and two Q/dO stages
// at D = 256 (staging it in the step's spent Q / dO halves instead was 4-8%
// slower on an H200: NOTES_sm90_bwd_tiles.md). Without kDq (the deterministic
// mode, and wherever sm90::SeparateDq says so) the dQ kernel (sm90/bwd_dq.cuh)
// follows.
//
// A half of 96 columns (D = 192) crosses a 64-column block of the tiles, and a
// wgmma's MN-major B covers whole blocks: it is computed as a 64-column piece
// (a whole block) and a 32-column one (half of the middle block), in the
// same accumulator tiles for both warpgroups (HalfColumns), so that both run
// one instruction stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/query_steps.cuh"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/workspace.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm90/copy.cuh"
#include "cuda/sm90/epilogue_bwd.cuh"
#include "cuda/sm90/mainloop_bwd.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// Where a warpgroup's half of the head dim lies: accumulator n-tiles
// [0, kFullTiles) are columns full.., the rest (kPartTiles, D = 192 only)
// columns part.. (MN-major B pieces of 64 and 32 columns).
template <int kHeadDim>
struct HalfColumns {
  static constexpr int kHalf = kHeadDim / 2;
  static constexpr int kFullTiles = kHalf % 64 == 0 ? kHalf / 8 : 8;
  static constexpr int kPartTiles = kHalf / 8 - kFullTiles;
  static_assert(kHalf % 64 == 0 || kHalf == 96, "halves of whole blocks, or 64 + 32 columns");
  int full, part;
  __device__ __forceinline__ static HalfColumns Of(int warpgroup) {
    // D = 192: [0, 64) + [64, 96) for warpgroup 0, [128, 192) + [96, 128) for 1.
    if constexpr (kPartTiles == 0) return HalfColumns{warpgroup * kHalf, 0};
    else return HalfColumns{warpgroup * 128, 64 + warpgroup * 32};
  }
  __device__ __forceinline__ int Col(int dt) const {
    return dt < kFullTiles ? full + dt * 8 : part + (dt - kFullTiles) * 8;
  }
};

// Byte offset of column `col` in a swizzled tile of `rows` rows (its
// 64-column block, then 2 bytes per column inside the 128-byte rows: an
// MN-major operand may start inside a row, the swizzle being a function of
// the address).
__device__ __forceinline__ uint32_t ColumnOffset(int col, int rows) {
  return (col / 64) * rows * kSwizzleBytes + (col % 64) * 2;
}

// One k-step of a warpgroup's half: d += A B_w, B MN-major, from the pieces'
// descriptors.
template <typename T, int kHeadDim, int kTransA, int kTiles>
__device__ __forceinline__ void HalfGemm(float (&d)[kTiles][4], uint64_t desc_a,
                                         uint64_t desc_full, uint64_t desc_part, int scale_d) {
  using Cols = HalfColumns<kHeadDim>;
  if constexpr (Cols::kPartTiles == 0) {
    WgmmaSS<T, 1, kTransA>(d, desc_a, desc_full, scale_d);
  } else {
    WgmmaSS<T, 1, kTransA, 8 * Cols::kFullTiles, 0>(d, desc_a, desc_full, scale_d);
    WgmmaSS<T, 1, kTransA, 8 * Cols::kPartTiles, Cols::kFullTiles>(d, desc_a, desc_part, scale_d);
  }
}

// kBias, kDropout: as mainloop_bwd.cuh's (at most one of kSoftcap, kBias,
// kDropout; P^T goes to shared memory for dV dropped but unscaled, so the dV
// returned lacks 1 / (1 - rate), which the caller applies: BwdWideKernel).
// kDq: dQ added into the accumulator as the steps go (above).
template <typename T, typename Traits, bool kSoftcap, bool kBias, bool kDropout, bool kDq>
__device__ __forceinline__ void BwdWideMainloop(const BwdTmaArgs& tma_args,
                                                const KeyBlockScheduler::Tile& tile,
                                                const ThreadPos& pos,
                                                float (&dk)[Traits::kHeadDim / 16][4],
                                                float (&dv)[Traits::kHeadDim / 16][4]) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQTiles = kBlockM / 2 / kMmaN;  // n-tiles of S^T: this warpgroup's 32 queries
  constexpr int kHalfTiles = kHeadDim / 16;     // n-tiles of dK, dV, dQ: half the head dim
  constexpr uint32_t kRow = kSwizzleBytes;
  using Cols = HalfColumns<kHeadDim>;
  static_assert(int{kSoftcap} + int{kBias} + int{kDropout} <= 1, "one of the terms per kernel");
  static_assert(!kDq || Cols::kPartTiles == 0, "dQ in halves of whole 64-column blocks");
  const BwdArgs& args = tma_args.args;
  const BwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (SmemAddr(smem_raw) + kAtomBytes - 1) & ~(kAtomBytes - 1);
  const uint32_t sK = base;
  const uint32_t sV = sK + Traits::kKvBytes;
  const uint32_t sQ = sV + Traits::kKvBytes;                     // [kStages]
  const uint32_t sdO = sQ + Traits::kStages * Traits::kQBytes;  // [kStages]
  const uint32_t sPt = sdO + Traits::kStages * Traits::kQBytes;  // [kPBuffers] P^T tiles
  const uint32_t sdSt = sPt + Traits::kPBuffers * Traits::kPBytes;  // [kPBuffers] dS^T tiles
  float* sLse = reinterpret_cast<float*>(
      smem_raw + (sdSt + Traits::kPBuffers * Traits::kPBytes - SmemAddr(smem_raw)));
  float* sDelta = sLse + Traits::kStages * kBlockM;
  // One mbarrier per stage (as mainloop_bwd.cuh): Q, dO by TMA, lse2 and D
  // by the cp.async arrivals of the threads that load them.
  const uint32_t full_bar = SmemAddr(sDelta + Traits::kStages * kBlockM);

  const int tid = pos.tid, warp = pos.warp, lane = pos.lane, g = pos.g, t = pos.t;
  const int warpgroup = warp / 4, wg_warp = warp % 4;
  // Tile and step indices in 32 bits, as BwdMainloop keeps them (dispatch.cu's
  // kMaxIndex32 bounds them; NOTES_sm90_bwd.md, "32-bit step indices").
  const int h_kv = static_cast<int>(tile.h_kv), b = static_cast<int>(tile.b);
  const int n0 = static_cast<int>(tile.n_block) * kBlockN;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int group = static_cast<int>(p.shape.group_size());
  const int head_dim = static_cast<int>(p.shape.head_dim);
  // The group's first head's mask; a dense mask's view moves to the step's
  // head below (a dense mask comes here with a tile map: BwdPath).
  BatchMask mask = BatchMask::For(p.mask, b, h_kv * group, seqlen_q, seqlen_k);
  const uint8_t* const dense0 = mask.dense;

  const GmemRows<T> k = GmemRows<T>::Head(p.k, p.k_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v = GmemRows<T>::Head(p.v, p.v_strides, b, h_kv, seqlen_k, head_dim);

  const QuerySteps<kBlockN, kBlockM> walk = QuerySteps<kBlockN, kBlockM>::Make(mask, n0, group);
  const int m_begin = static_cast<int>(walk.m_begin), steps = static_cast<int>(walk.count);

  // Step (head gi of the group, query block mi of the walk)'s loads into
  // `stage` (mainloop_bwd.cuh).
  auto issue = [&](int gi, int mi, int stage) {
    IssueStepLoads<Traits>(tma_args, sQ, sdO, sLse, sDelta, stage, b, h_kv * group + gi,
                           (m_begin + mi) * kBlockM, full_bar + 8 * stage, tid);
  };

  LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sK, k, n0, tid);
  LoadSwizzledTile<T, kBlockN, kHeadDim, Traits::kThreads>(sV, v, n0, tid);
  CpAsyncCommit();
  if (tid == 0) {
    for (int stage = 0; stage < Traits::kStages; ++stage)
      MbarrierInit(full_bar + 8 * stage, 1 + RowStatsArrivals<Traits>(tma_args));
    FenceBarrierInit();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
  if (steps > 0) issue(0, static_cast<int>(walk.first), 0);
  CpAsyncWait<0>();  // K and V, published to all threads and to wgmma here
  FenceProxyAsync();
  __syncthreads();

#pragma unroll
  for (int dt = 0; dt < kHalfTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) { dk[dt][r] = 0.f; dv[dt][r] = 0.f; }

  const int key_row0 = wg_warp * 16;  // this warp's first key (of the CTA's 64)
  const int q_col0 = warpgroup * (kBlockM / 2);  // this warpgroup's first query of a step
  const Cols cols = Cols::Of(warpgroup);
  // Descriptors of what stays put (k-steps and buffers add offsets): P^T and
  // dS^T as K-major A (dV, dK).
  const uint64_t desc_pt = SmemDescriptor(sPt, 0, kAtomBytes);
  const uint64_t desc_dst = SmemDescriptor(sdSt, 0, kAtomBytes);
  // Q and dO stages as dK's and dV's B: the same offsets in every stage.
  const uint32_t qo_full = ColumnOffset(cols.full, kBlockM);
  const uint32_t qo_part = ColumnOffset(cols.part, kBlockM);
  // dQ's operands: dS as an M-major A, the M-major view of the dS^T tile
  // ([key][query]: a k-step is 16 keys, two 8-row groups), and K's columns
  // of this warpgroup's half as an MN-major B (the same k-steps).
  const uint64_t desc_ds = SmemDescriptor(sdSt, kBlockN * kRow, kAtomBytes);
  const uint64_t desc_kq =
      SmemDescriptor(sK + ColumnOffset(cols.full, kBlockN), kBlockN * kRow, kAtomBytes);
  const int64_t num_heads_q = p.shape.num_heads_q;
  const float scale_log2 = args.scale_log2;
  // stmatrix rows: this warp's keys (lanes 8i..8i+7: matrix i).
  const int st_row = key_row0 + lane % 8 + ((lane / 8) % 2) * 8;

  // Dropout's keep bits of this warp's 16 keys x the warpgroup's 32 queries
  // of step (gi, mi): before the loop, then for the next step while this
  // one's dV and dK GEMMs run (as mainloop_bwd.cuh).
  const HeadDropout dropout0 = kDropout ? args.Dropout(b, h_kv * group) : HeadDropout{};
  auto draw_keep = [&](int gi, int mi) -> uint32_t {
    if constexpr (kDropout)
      return KeepBitsT<kQTiles, /*kSerial=*/true>(dropout0.PlusHeads(p.dropout, gi),
                                                  n0 + key_row0,
                                                  (m_begin + mi) * kBlockM + q_col0, g, t);
    else return 0;
  };

  int gi = 0, mi = static_cast<int>(walk.first);
  uint32_t keep = steps > 0 ? draw_keep(gi, mi) : 0;
  for (int s = 0; s < steps; ++s) {
    // No CTA barrier at the top (as mainloop_bwd.cuh): P^T and dS^T
    // alternate between two buffers, the loads of step s were issued after
    // the middle barrier of step s - 1.
    const int stage = static_cast<int>(s & 1);
    const uint32_t p_offset = static_cast<uint32_t>(s & 1) * Traits::kPBytes;
    const int h = h_kv * group + gi;
    const int m0 = (m_begin + mi) * kBlockM;
    const CellClass cls = walk.Class(mi);
    if (dense0 != nullptr) mask.dense = dense0 + gi * p.mask.dense_strides.head;
    walk.Advance(gi, mi);  // (gi, mi) is now the next step
    MbarrierWait(full_bar + 8 * stage, static_cast<uint32_t>((s / Traits::kStages) & 1));
    const uint32_t q_tile = sQ + stage * Traits::kQBytes;
    const uint32_t do_tile = sdO + stage * Traits::kQBytes;
    const float* lse2_s = sLse + stage * kBlockM + q_col0;
    const float* delta_s = sDelta + stage * kBlockM + q_col0;

    // ---- S^T_w = K Q_w^T, dP^T_w = V dO_w^T (64 keys x 32 queries) ---------
    float st[kQTiles][4], dpt[kQTiles][4];
    WgmmaFence();
    GemmKMajor<T, kHeadDim, kBlockN, kBlockM>(st, sK, q_tile + q_col0 * kRow);
    WgmmaCommit();
    GemmKMajor<T, kHeadDim, kBlockN, kBlockM>(dpt, sV, do_tile + q_col0 * kRow);
    WgmmaCommit();
    // What the mask does to this step's tile, decided while the GEMMs run.
    const MaskPath mask_path =
        MaskPathOf(mask, cls, m0 + q_col0, m0 + q_col0 + kBlockM / 2, n0, n0 + kBlockN);
    if constexpr (kSoftcap) {
      WgmmaWait<0>();
      FenceRegisters(st);
      FenceRegisters(dpt);
      SoftcapAndSubtractDelta(st, dpt, delta_s, args.softcap, args.scale_over_cap,
                              args.inv_softcap, t);
    } else {
      WgmmaWait<1>();
      FenceRegisters(st);
      // x = scale * s + bias (no soft cap with a bias here: LaunchDkDv).
      if constexpr (kBias)
        AddBias<Rows::kKeys>(st, BiasView<T>::For(p, b, h), args.scale, n0 + key_row0, m0 + q_col0,
                             g, t);
    }
    ExpScoresT(st, lse2_s, scale_log2, t);
    ApplyMask<Rows::kKeys>(st, mask, mask_path, n0 + key_row0, m0 + q_col0, g, t, 0.f);
    if constexpr (!kSoftcap) {
      WgmmaWait<0>();
      FenceRegisters(dpt);
      // Kept or 0, then 1 / (1 - rate) in SubtractDelta's FFMA.
      if constexpr (kDropout) ApplyKeepT(dpt, keep, 1.f);
      SubtractDelta(dpt, delta_s, t, kDropout ? args.keep_scale : 1.f);
    }
    if constexpr (kBias) AddDbiasT(dpt, st, p, args.batch0 + b, args.head0 + h, n0 + key_row0, m0 + q_col0, g, t);

    // ---- P^T and dS^T = P^T (dP^T - D) dx to shared memory ------------------
    // One stmatrix per 16 queries and tile: matrices (keys g, g + 8) x
    // (queries 16ks + 0..7, + 8..15) of this warp's 16 keys.
#pragma unroll
    for (int ks = 0; ks < kQTiles / 2; ++ks) {
      const float(&d0)[4] = dpt[2 * ks];
      const float(&d1)[4] = dpt[2 * ks + 1];
      const float(&p0)[4] = st[2 * ks];
      const float(&p1)[4] = st[2 * ks + 1];
      const uint32_t at = SwizzledOffset(st_row, q_col0 / 8 + 2 * ks + lane / 16, kBlockN);
      if constexpr (kDropout) {
        float z0[4], z1[4];
        // Kept or 0; 1 / (1 - rate) goes onto dV once, in BwdWideKernel.
        DroppedTileT(p0, keep, 2 * ks, z0);
        DroppedTileT(p1, keep, 2 * ks + 1, z1);
        StMatrixX4(sPt + p_offset + at, Pack2<T>(z0[0], z0[1]), Pack2<T>(z0[2], z0[3]),
                   Pack2<T>(z1[0], z1[1]), Pack2<T>(z1[2], z1[3]));
      } else {
        StMatrixX4(sPt + p_offset + at, Pack2<T>(p0[0], p0[1]), Pack2<T>(p0[2], p0[3]),
                   Pack2<T>(p1[0], p1[1]), Pack2<T>(p1[2], p1[3]));
      }
      StMatrixX4(sdSt + p_offset + at, Pack2<T>(d0[0] * p0[0], d0[1] * p0[1]),
                 Pack2<T>(d0[2] * p0[2], d0[3] * p0[3]), Pack2<T>(d1[0] * p1[0], d1[1] * p1[1]),
                 Pack2<T>(d1[2] * p1[2], d1[3] * p1[3]));
    }
    FenceProxyAsync();
    // Both warpgroups' queries are in; both are done with step s - 1, so its
    // stage takes step s + 1's loads.
    __syncthreads();
    if (s + 1 < steps) issue(gi, mi, stage ^ 1);

    // ---- dQ (kDq), dV, dK ---------------------------------------------------
    // dQ first, so that its wait below leaves dV and dK running while its
    // atomics issue.
    float dq[kDq ? kHalfTiles : 1][4];
    WgmmaFence();
    if constexpr (kDq) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
        const uint32_t step = kk * 2 * kAtomBytes;
        WgmmaSS<T, 1, 1>(dq, DescriptorPlus(desc_ds, p_offset + step),
                         DescriptorPlus(desc_kq, step), kk > 0);
      }
      WgmmaCommit();
    }
    {
      const uint64_t do_full = SmemDescriptor(do_tile + qo_full, kBlockM * kRow, kAtomBytes);
      const uint64_t do_part = SmemDescriptor(do_tile + qo_part, kBlockM * kRow, kAtomBytes);
      const uint64_t q_full = SmemDescriptor(q_tile + qo_full, kBlockM * kRow, kAtomBytes);
      const uint64_t q_part = SmemDescriptor(q_tile + qo_part, kBlockM * kRow, kAtomBytes);
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        // k-step ks = queries 16ks..16ks+15: 32 bytes into P^T / dS^T rows,
        // two 8-row groups of dO / Q.
        const uint32_t step = ks * 2 * kAtomBytes;
        HalfGemm<T, kHeadDim, 0>(dv, DescriptorPlus(desc_pt, p_offset + ks * 32),
                                 DescriptorPlus(do_full, step), DescriptorPlus(do_part, step), 1);
      }
      WgmmaCommit();
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        const uint32_t step = ks * 2 * kAtomBytes;
        HalfGemm<T, kHeadDim, 0>(dk, DescriptorPlus(desc_dst, p_offset + ks * 32),
                                 DescriptorPlus(q_full, step), DescriptorPlus(q_part, step), 1);
      }
      WgmmaCommit();
    }
    if constexpr (kDq) {
      WgmmaWait<2>();  // dQ done; dV and dK may still run
      FenceRegisters(dq);
      RedDqFragments<kHeadDim>(dq, args.dq_accum, b * num_heads_q + h, seqlen_q, m0, warpgroup,
                               wg_warp, g, t);
    }
    // Finished within the step, as in mainloop_bwd.cuh (C7515 otherwise).
    if (kDropout && s + 1 < steps) keep = draw_keep(gi, mi);  // (gi, mi): the next step
    WgmmaWait<0>();
    FenceRegisters(dv);
    FenceRegisters(dk);
  }
}

}  // namespace jax_flash::cuda::sm90

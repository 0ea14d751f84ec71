// The Hopper backward's mainloop: the CTA's (query head of the GQA group,
// block of kBlockM queries) steps, producing this warp's dK and dV (16 keys x
// the head dim) and adding each step's dQ through the epilogue of
// sm90/epilogue_bwd.cuh. A warp-specialized pipeline (a producer warpgroup for
// the loads, FA3-style) replaces this function alone: the scheduler and the
// epilogues stay.
//
// Q and dO come through TMA (tma.cuh), lse2 and D through cp.async,
// double-buffered, all completing on the stage's mbarrier. Per warpgroup
// and step (64 keys x kBlockM = 64 queries; 128 at D = 64 under the tuning
// hook of sm90/tile_size.h, dV then issued after dS^T and dQ split by rows):
//   S^T  = K_w Q^T,  dP^T = V_w dO^T   SS, both operands K-major (64 x 64);
//                                        RS at D = 64 (K_w, V_w in registers)
//   P^T, dS^T in registers (common/softmax.cuh, common/score.cuh)
//   dV  += P^T dO (RS: P^T from registers), dK += dS^T Q (RS, or SS where
//                                        the registers are short), B MN-major
//   dQ part = dS K                      SS: dS^T through shared memory as an
//                                        M-major A (and as dK's K-major A),
//                                        K as an MN-major B
// The GEMMs are issued as five commit groups so that P^T and the dV GEMM
// overlap dP^T, and the dQ epilogue overlaps the dK GEMM. The one CTA
// barrier of a step is in its middle (dQ needs both warpgroups' dS^T); the
// next step's loads are issued right after it, and dS^T alternates between
// two buffers, so a warpgroup goes on into the next step while the other
// still finishes this one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/query_steps.cuh"
#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/epilogue_bwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm90/copy.cuh"
#include "cuda/sm90/epilogue_bwd.cuh"
#include "cuda/sm90/loads_bwd.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// Named barriers of the staged dK / dV epilogue, one per warpgroup (ids 6,
// 7: DqHandoff's 1-5 belong to the warp-specialized kernel).
inline constexpr int kDkDvStagedBarrier = 6;

// kSoftcap: a template parameter rather than a branch, because ptxas
// serializes every wgmma of the kernel when the two waits of the two paths
// below meet in one function. kWs: the mainloop of the warp-specialized
// kernel's two MMA warpgroups (sm90/bwd_ws.cuh; `pos` counts their threads
// from 0): its producer warp initializes the barriers and issues the loads,
// its dQ warp the reductions (DqHandoff), so here the stage is released
// (its empty barrier) instead of refilled, and the middle barrier is the
// MMA warpgroups' alone. kDq = false: no dQ at all (the deterministic
// mode, whose dQ kernel runs after this one). kDropout (no soft cap then):
// dV takes the kept P^T unscaled, so the dV returned still lacks the factor
// s = 1 / (1 - rate), which the caller applies (BwdKernel); dP^T becomes
// Z s dP^T before D is subtracted, dS^T = P^T (Z s dP^T - D) from the
// undropped P^T, with keep bits drawn while the step's GEMMs run.
template <typename T, typename Traits, bool kSoftcap, bool kDq, bool kDropout, bool kWs = false>
__device__ __forceinline__ int BwdMainloop(const BwdTmaArgs& tma_args,
                                           const KeyBlockScheduler::Tile& tile,
                                           const ThreadPos& pos,
                                           float (&dk)[Traits::kHeadDim / kMmaN][4],
                                           float (&dv)[Traits::kHeadDim / kMmaN][4],
                                           int step_base = 0) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQTiles = kBlockM / kMmaN;   // n-tiles of S^T (queries)
  constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of dK, dV, dQ
  constexpr uint32_t kRow = sm90::kSwizzleBytes;
  static_assert(!(kSoftcap && kDropout), "dropout with a soft cap: the mma.sync kernels");
  // dQ transposed (80-query steps): the plain kernel with dQ alone.
  constexpr bool kDqTransposed = Traits::kDqTransposed;
  static_assert(!kDqTransposed || (kDq && !kWs && !kDropout && !kSoftcap),
                "80-query steps: the fast mode's plain kernel (LaunchDkDv)");
  const BwdArgs& args = tma_args.args;
  const BwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = BwdSmem<Traits>::Of(smem_raw).base;
  const uint32_t sK = base;
  const uint32_t sV = base + Traits::kVOffset;
  const uint32_t sQ = base + Traits::kQOffset;
  const uint32_t sdO = base + Traits::kDoutOffset;
  const uint32_t sdS = base + Traits::kDsOffset;
  const uint32_t sDq = base + Traits::kDqOffset;
  float* sLse =
      reinterpret_cast<float*>(smem_raw + (base + Traits::kLseOffset - SmemAddr(smem_raw)));
  float* sDelta = sLse + Traits::kStages * kBlockM;
  const uint32_t full_bar = SmemAddr(sDelta + Traits::kStages * kBlockM);
  const uint32_t empty_bar = base + Traits::kEmptyOffset;  // kWs
  const uint32_t dq_slot = base + Traits::kDqSlotOffset;   // kWs

  const int tid = pos.tid, warp = pos.warp, lane = pos.lane, g = pos.g, t = pos.t;
  const int warpgroup = warp / 4, wg_warp = warp % 4, wg_tid = tid % 128;
  // Tile and step indices in 32 bits (dispatch.cu's kMaxIndex32 bounds them):
  // as int64 they took two registers each across the loop, and the D = 64
  // kernels spilled (NOTES_sm90_bwd.md, "32-bit step indices").
  const int h_kv = static_cast<int>(tile.h_kv), b = static_cast<int>(tile.b);
  const int n0 = static_cast<int>(tile.n_block) * kBlockN;
  const int n0w = n0 + warpgroup * 64;  // this warpgroup's first key
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int num_heads_q = static_cast<int>(p.shape.num_heads_q);
  const int group = static_cast<int>(p.shape.group_size());
  // The group's first head's mask; a dense mask's view moves to the step's
  // head below (a dense mask comes here with a tile map: BwdPath).
  BatchMask mask = BatchMask::For(p.mask, b, h_kv * group, seqlen_q, seqlen_k);
  const uint8_t* const dense0 = mask.dense;

  const TileSteps<Traits> walk = MakeTileSteps<Traits>(p, mask, tile, n0, group);
  const int m_begin = static_cast<int>(walk.m_begin), steps = static_cast<int>(walk.count);

  // Step (head gi of the group, query block mi of the walk)'s loads into `stage`.
  auto issue = [&](int gi, int mi, int stage) {
    IssueStepLoads<Traits>(tma_args, sQ, sdO, sLse, sDelta, stage, b, h_kv * group + gi,
                           (m_begin + mi) * kBlockM, full_bar + 8 * stage, tid);
  };

  if constexpr (kWs) {
    IssueKvLoads<T, Traits>(p, sK, sV, b, h_kv, n0, tid);
    CpAsyncWait<0>();  // K and V, published to both warpgroups and to wgmma here
    sm90::FenceProxyAsync();
    NamedBarrierSync(DqHandoff::kMmaBarrier, Traits::kThreads);
  } else {
    // K, V and the first step's loads were issued before (IssueTileLoads).
    CpAsyncWait<0>();  // K and V, published to all threads and to wgmma here
    // The last tile's staged dK / dV (over dS^T and the dQ parts) read by
    // their TMA stores before this tile's first dS^T is written.
    if constexpr (Traits::kTile.dkdv_tma) WaitDqStagingRead(wg_tid);
    sm90::FenceProxyAsync();
    __syncthreads();
  }

  // dK = dV = 0 (here rather than in the kernel: the same place as before the
  // mainloop was split out, which kept the code closest to it).
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) { dk[dt][r] = 0.f; dv[dt][r] = 0.f; }

  // This warpgroup's 64 keys: row 64 * warpgroup of every column block.
  const uint32_t k_rows = sK + warpgroup * 64 * kRow;
  const uint32_t v_rows = sV + warpgroup * 64 * kRow;
  const int key_row0 = wg_warp * 16;  // this warp's first key within the warpgroup
  // This warpgroup's dQ columns: dq_col0.., in K's column block dq_col0 / 64
  // (an MN-major B may start inside a swizzled row: the swizzle is applied to
  // the address, as for the k-steps of a K-major operand); with the row split
  // every column, and its own 64 queries, column block `warpgroup` of dS^T.
  constexpr bool kDqRowSplit = Traits::kDqRowSplit;
  constexpr int kDqCols = Traits::kDqCols;
  const int dq_col0 = kDqRowSplit ? 0 : warpgroup * kDqCols;
  const uint32_t dq_query_block = kDqRowSplit ? warpgroup * kBlockN * kRow : 0;
  const uint32_t dq_k_cols = sK + (dq_col0 / 64) * kBlockN * kRow + (dq_col0 % 64) * 2;
  const uint32_t dq_part = sDq + warpgroup * Traits::kDqPartBytes;
  // dK's A, dS^T: from registers (RS), or as SS from the copy in shared
  // memory that dQ reads anyway where the bucket's row says the registers
  // are short (sm90/tile_size.h; with dropout, whose keep bits take some, a
  // choice of its own).
  constexpr bool kDkFromRegisters =
      !kDq || (kDropout ? Traits::kTile.dk_rs_with_dropout : Traits::kTile.dk_rs_with_dq);
  // Descriptors of the tiles that stay put (the k-steps add offsets): dS^T
  // as dQ's M-major A (all 128 keys) and as dK's K-major A (this warpgroup's
  // rows, SS only), K's dQ columns as dQ's MN-major B. Transposed (dS^T
  // stored [query][key]): K's dQ columns as dQ^T's M-major A, dS^T as its
  // K-major B (KMajorOffset below), and this warpgroup's 64-key block of
  // dS^T as dK's M-major A (SS only).
  const uint64_t desc_ds = sm90::SmemDescriptor(sdS, kBlockN * kRow, sm90::kAtomBytes);
  const uint64_t desc_dst =
      kDqTransposed
          ? sm90::SmemDescriptor(sdS + warpgroup * kBlockM * kRow, 0, sm90::kAtomBytes)
          : sm90::SmemDescriptor(sdS + warpgroup * 64 * kRow, 0, sm90::kAtomBytes);
  const uint64_t desc_kt = sm90::SmemDescriptor(dq_k_cols, kBlockN * kRow, sm90::kAtomBytes);
  const float scale_log2 = args.scale_log2;

  // Dropout's keep bits of this warp's 16 keys x the kBlockM queries of step
  // (gi, mi), drawn where the fewest registers are live: before the loop,
  // then for the next step while this one's dK GEMM runs (drawn next to the
  // S^T and dP^T GEMMs, with their accumulators in flight, they spilled
  // 320 bytes at D = 128).
  const HeadDropout dropout0 = kDropout ? args.Dropout(b, h_kv * group) : HeadDropout{};
  using KeepBits = KeepBitsTWord<kQTiles>;
  auto draw_keep = [&](int gi, int mi) -> KeepBits {
    if constexpr (kDropout)
      return KeepBitsT<kQTiles, /*kSerial=*/true>(dropout0.PlusHeads(p.dropout, gi),
                                                  n0w + key_row0, (m_begin + mi) * kBlockM, g, t);
    else return 0;
  };

  int gi = 0, mi = static_cast<int>(walk.start);
  KeepBits keep = steps > 0 ? draw_keep(gi, mi) : 0;
  for (int s = 0; s < steps; ++s) {
    // No CTA barrier at the top of a step: a warpgroup that is done with
    // step s - 1 starts step s while the other's dK GEMM may still run. The
    // loads of step s were issued after the middle barrier of step s - 1,
    // when both warpgroups were done with the stage; dS^T alternates
    // between two buffers so that this step's writes miss the other
    // warpgroup's dQ GEMM of step s - 1.
    // Stages, their barriers' phases and the dS^T buffers go by the CTA's
    // steps over all its tiles (step_base: the earlier tiles').
    const int sg = step_base + s;
    const int stage = sg % Traits::kStages;
    const uint32_t ds_offset = static_cast<uint32_t>(sg & 1) * Traits::kDsBytes;
    const int h = h_kv * group + gi;
    const int m0 = (m_begin + mi) * kBlockM;
    const CellClass cls = walk.Class(mi);
    if (dense0 != nullptr) mask.dense = dense0 + gi * p.mask.dense_strides.head;
    walk.Advance(gi, mi);  // (gi, mi) is now the next step
    // The stage's k-th use completes its barrier's phase k (parity k % 2).
    sm90::MbarrierWait(full_bar + 8 * stage, static_cast<uint32_t>((sg / Traits::kStages) & 1));
    const uint32_t q_tile = sQ + stage * Traits::kQBytes;
    const uint32_t do_tile = sdO + stage * Traits::kQBytes;
    const float* lse2_s = sLse + stage * kBlockM;
    const float* delta_s = sDelta + stage * kBlockM;

    // ---- S^T = K_w Q^T, dP^T = V_w dO^T (64 keys x 64 queries) ------------
    // Two commit groups, so that P^T (and the dV GEMM) can go ahead while
    // dP^T is still being computed. Group order below: S^T, dP^T, dV, dQ, dK;
    // each wait names how many of the latest may still run.
    float st[kQTiles][4], dpt[kQTiles][4];
    sm90::WgmmaFence();
    sm90::GemmKMajor<T, kHeadDim, kBlockN, kBlockM>(st, k_rows, q_tile);
    sm90::WgmmaCommit();
    sm90::GemmKMajor<T, kHeadDim, kBlockN, kBlockM>(dpt, v_rows, do_tile);
    sm90::WgmmaCommit();
    // What the mask does to this step's tile, decided while the GEMMs run
    // (a light mask decides per warp, in MaskEndsFragmentT).
    const MaskPath mask_path = Traits::kLightMask
                                   ? MaskPath::kNone
                                   : MaskPathOf(mask, cls, m0, m0 + kBlockM, n0w, n0w + 64);

    // ---- P^T (common/softmax.cuh) -------------------------------------------
    // With softcap, d x / d s needs x, which P overwrites: wait for dP^T too
    // and fold that factor in now.
    if constexpr (kSoftcap) {
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(st);
      sm90::FenceRegisters(dpt);
      SoftcapAndSubtractDelta(st, dpt, delta_s, args.softcap, args.scale_over_cap,
                              args.inv_softcap, t);
    } else {
      sm90::WgmmaWait<1>();
      sm90::FenceRegisters(st);
    }
    ExpScoresT(st, lse2_s, scale_log2, t);
    if constexpr (Traits::kLightMask)
      MaskEndsFragmentT(st, mask, n0w + key_row0, m0, g, t, 0.f);
    else
      ApplyMask<Rows::kKeys>(st, mask, mask_path, n0w + key_row0, m0, g, t, 0.f);

    // ---- dV += P^T dO: P^T from registers (RS), B = dO MN-major ------------
    // Issued while dP^T is still computed; with 128 queries per step after
    // dS^T instead (kLateDv): there P^T, its packed copy and dP^T in flight
    // would not fit the registers together.
    constexpr bool kLateDv = kBlockM == 128;
    // Or after dS^T's stores (BwdTile::dv_after_ds), before the step's barrier;
    // always with 80 queries, whose P^T and dP^T (40 registers each) left no
    // room for dV's A fragments beside them (ptxas: 24 B of spill, 0 after).
    constexpr bool kDvAfterDs = Traits::kTile.dv_after_ds || kDqTransposed;
    uint32_t ap[kBlockM / kMmaK][4];
    const uint64_t desc_do = sm90::SmemDescriptor(do_tile, kBlockM * kRow, sm90::kAtomBytes);
    auto issue_dv = [&] {
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        if constexpr (kDropout) {
          float p0[4], p1[4];
          // Kept or 0; 1 / (1 - rate) goes onto dV once, in BwdKernel.
          DroppedTileT(st[2 * ks], keep, 2 * ks, p0);
          DroppedTileT(st[2 * ks + 1], keep, 2 * ks + 1, p1);
          PackA<T>(ap[ks], p0, p1);
        } else {
          PackA<T>(ap[ks], st[2 * ks], st[2 * ks + 1]);
        }
      }
      sm90::WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        // k-step ks = queries 16ks..16ks+15: two 8-row groups of the dO tile.
        sm90::WgmmaRSColumns<T, kHeadDim>(dv, ap[ks],
                                          sm90::DescriptorPlus(desc_do, ks * 2 * sm90::kAtomBytes),
                                          kBlockM * kRow, 1);
      }
      sm90::WgmmaCommit();
    };
    if constexpr (!kLateDv && !kDvAfterDs) issue_dv();

    // ---- dS^T = P^T (dP^T - D) dx, to shared memory -------------------------
    if constexpr (!kSoftcap) {
      sm90::WgmmaWait<kLateDv || kDvAfterDs ? 0 : 1>();  // dP^T (an early dV may still run)
      sm90::FenceRegisters(dpt);
      // Kept or 0, then 1 / (1 - rate) in SubtractDelta's FFMA.
      if constexpr (kDropout) ApplyKeepT(dpt, keep, 1.f);
      SubtractDelta(dpt, delta_s, t, kDropout ? args.keep_scale : 1.f);
    }
    if constexpr (kLateDv) {
      // dS^T in place of dP^T first, so that P^T's floats die as dV's A
      // fragments are packed from them.
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dpt[nt][r] *= st[nt][r];
      if constexpr (!kDvAfterDs) issue_dv();
    }
    // dS^T, packed to 16 bits as A fragments (the C layout of S^T, as P^T
    // for dV): dK may take it from registers; dQ, which needs both
    // warpgroups' keys, from shared memory as an M-major A (transposed).
    // One stmatrix per 16 queries: matrices (keys g, g + 8) x (queries
    // 16ks + 0..7, 16ks + 8..15) of this warp's 16 keys; lane l addresses
    // row l % 8 of matrix l / 8 in the swizzled [key][query] tile, or
    // (kDqTransposed) column l % 8 of it, stored transposed as a row of the
    // swizzled [query][key] tile: query 16ks + 8 (l / 16) + l % 8, the 8 keys
    // of 16-byte chunk 8 w + 2 wg_warp + (l / 8) % 2, in 64-key block w.
    uint32_t ads[kBlockM / kMmaK][4];
    const int st_row = warpgroup * 64 + key_row0 + lane % 8 + ((lane / 8) % 2) * 8;
    const int st_key_chunk = warpgroup * 8 + wg_warp * 2 + (lane / 8) % 2;
    // [key][query]: this lane's address of k-step 0; k-step ks's is it XOR
    // (ks % 4) * 32, plus its column block's offset (the 128-byte swizzle
    // XORs a 16-byte chunk's index with row % 8, and 2 ks moves only the
    // chunk's bits 1-2). With dQ: as the addresses themselves, loop-invariant,
    // they were kept across the loop and spilled (D = 64: 20 reloads per
    // step, 7 so); without dQ that way spilled less.
    const uint32_t st_lane = sm90::SwizzledOffset(st_row, lane / 16, kBlockN);
    auto st_at = [&](int ks) -> uint32_t {
      if constexpr (kDq)
        return (st_lane ^ ((ks % 4) * 32)) + (ks / 4) * kBlockN * kRow;
      else
        return sm90::SwizzledOffset(st_row, 2 * ks + lane / 16, kBlockN);
    };
#pragma unroll
    for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
      if constexpr (kLateDv)
        PackA<T>(ads[ks], dpt[2 * ks], dpt[2 * ks + 1]);
      else
        PackProductA<T>(ads[ks], dpt[2 * ks], dpt[2 * ks + 1], st[2 * ks], st[2 * ks + 1]);
      if constexpr (kDqTransposed)
        sm90::StMatrixX4Trans(
            sdS + ds_offset +
                sm90::SwizzledOffset(16 * ks + 8 * (lane / 16) + lane % 8, st_key_chunk, kBlockM),
            ads[ks][0], ads[ks][1], ads[ks][2], ads[ks][3]);
      else
        sm90::StMatrixX4(sdS + ds_offset + st_at(ks), ads[ks][0], ads[ks][1], ads[ks][2],
                         ads[ks][3]);
    }
    if constexpr (kDvAfterDs) issue_dv();
    if constexpr (kDq && !kWs) WaitDqStagingRead(wg_tid);
    sm90::FenceProxyAsync();
    // dQ reads the other warpgroup's dS^T rows too; and both warpgroups are
    // done with step s - 1, so its stage takes step s + 1's loads (kWs: the
    // producer's, once the MMA warps have released it).
    if constexpr (kWs) {
      NamedBarrierSync(DqHandoff::kMmaBarrier, Traits::kThreads);
    } else {
      __syncthreads();
      if (s + 1 < steps) issue(gi, mi, (sg + 1) % Traits::kStages);
    }

    // dQ part: 64 queries x kDqCols columns, reduced over the CTA's keys, out
    // through the epilogue (sm90/epilogue_bwd.cuh) while dK runs. A = dS, the
    // M-major view of dS^T (this warpgroup's query block with the row split).
    // Transposed: its kDqCols (64) columns x the step's queries, A = K^T (K's
    // column block as an M-major A), B = dS^T K-major.
    float dq[kDq ? (kDqTransposed ? kBlockM : kDqCols) / kMmaN : 1][4];
    if constexpr (kDq) {
      sm90::WgmmaFence();
      const uint64_t desc_dsk = sm90::SmemDescriptor(sdS + ds_offset, 0, sm90::kAtomBytes);
#pragma unroll
      for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
        // k-step kk = keys 16kk..16kk+15: rows of dS^T and of K.
        const uint32_t step = kk * 2 * sm90::kAtomBytes;
        if constexpr (kDqTransposed)
          sm90::WgmmaSS<T, 0, 1>(dq, sm90::DescriptorPlus(desc_kt, step),
                                 sm90::DescriptorPlus(desc_dsk, sm90::KMajorOffset<kBlockM>(kk)),
                                 kk > 0);
        else
          sm90::WgmmaSS<T, 1, 1>(dq,
                                 sm90::DescriptorPlus(desc_ds, ds_offset + dq_query_block + step),
                                 sm90::DescriptorPlus(desc_kt, step), kk > 0);
      }
      sm90::WgmmaCommit();
    }
    {
      // ---- dK += dS^T Q: A = dS^T (registers or K-major), B = Q MN-major --
      // (with dQ, dQ's fence covers the registers written above)
      if constexpr (!kDq) sm90::WgmmaFence();
      const uint64_t desc_q = sm90::SmemDescriptor(q_tile, kBlockM * kRow, sm90::kAtomBytes);
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        const uint64_t b_q = sm90::DescriptorPlus(desc_q, ks * 2 * sm90::kAtomBytes);
        if constexpr (kDkFromRegisters)
          sm90::WgmmaRSColumns<T, kHeadDim>(dk, ads[ks], b_q, kBlockM * kRow, 1);
        else if constexpr (kDqTransposed)  // k-step ks: rows 16ks.. of dS^T
          sm90::WgmmaSSColumns<T, kHeadDim, /*kTransA=*/1>(
              dk, sm90::DescriptorPlus(desc_dst, ds_offset + ks * 2 * sm90::kAtomBytes), b_q,
              kBlockM * kRow, 1);
        else  // k-step ks: queries 16ks.., in column block ks / 4 of dS^T
          sm90::WgmmaSSColumns<T, kHeadDim>(
              dk,
              sm90::DescriptorPlus(desc_dst,
                                   ds_offset + (ks / 4) * kBlockN * kRow + (ks % 4) * 32),
              b_q, kBlockM * kRow, 1);
      }
      sm90::WgmmaCommit();
    }
    if constexpr (kDq) {
      sm90::WgmmaWait<1>();  // dQ (and dV) done; dK may still run
      sm90::FenceRegisters(dq);
      if constexpr (kWs) {
        if (s > 0) DqHandoff::WaitEmpty(warpgroup);  // the dQ warp read the last part
        StoreDqPart<Traits>(dq, dq_part, wg_warp, g, t);
        if (wg_tid == 0) DqHandoff::Post(dq_slot, warpgroup, b * num_heads_q + h, m0);
        sm90::FenceProxyAsync();
        DqHandoff::Full(warpgroup);
      } else {
        ReduceDqPart<Traits>(dq, dq_part, args.dq_accum, b * num_heads_q + h, seqlen_q, m0,
                             warpgroup, wg_warp, wg_tid, g, t);
      }
    }
    // dK is finished within its step although its inputs (this stage, this
    // dS^T buffer) are not rewritten before step s + 2: left in flight across
    // the loop's back edge, ptxas serializes the kernel's wgmmas (C7515)
    // unless dK's first k-step zeroes instead, and that variant measured no
    // faster (NOTES_sm90_bwd.md).
    if (kDropout && s + 1 < steps) keep = draw_keep(gi, mi);  // (gi, mi): the next step
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dv);
    sm90::FenceRegisters(dk);
    if constexpr (kWs) {  // this warp no longer reads the stage
      if (lane == 0) ArriveBarrier(empty_bar + 8 * stage);
    }
  }
  // kWs: the dQ warp's last arrival taken, then the part that ends it.
  if constexpr (kWs && kDq) {
    if (steps > 0) DqHandoff::WaitEmpty(warpgroup);
    if (wg_tid == 0) DqHandoff::Post(dq_slot, warpgroup, 0, DqHandoff::kEnd);
    DqHandoff::Full(warpgroup);
  }
  return steps;
}

// After the mainloop: this warp's dK and dV (its 16 keys of its warpgroup's
// 64) to global memory; `pos` counts the MMA threads from 0. With dropout dV
// still lacks 1 / (1 - rate) (the mainloop's kept P^T was unscaled).
// Each thread stores its fragments, or with BwdTile::dkdv_tma each
// warpgroup writes its 64 keys of dK (times the softmax scale) and dV into
// staging tiles over the dS^T buffers and dQ parts (stmatrix, the 128-byte
// swizzle of the boxes of tma_args.dk_map / dv_map, as the forward's out),
// and one of its threads stores them; TMA clips the keys past seqlen_k and
// the columns past head_dim. The caller has the staging free then (every dQ
// reduction's read waited for, then a CTA barrier); the next tile's
// mainloop waits for these stores' reads before its first dS^T (its
// issuer is this one, wg_tid 0).
template <typename T, typename Traits, bool kDropout>
__device__ __forceinline__ void StoreWarpDkDv(const BwdTmaArgs& tma_args,
                                              const KeyBlockScheduler::Tile& tile,
                                              const ThreadPos& pos,
                                              const float (&dk)[Traits::kHeadDim / kMmaN][4],
                                              float (&dv)[Traits::kHeadDim / kMmaN][4]) {
  if constexpr (kDropout) ScaleTiles(dv, tma_args.args.keep_scale);
  const int warpgroup = pos.warp / 4, wg_warp = pos.warp % 4;
  if constexpr (!Traits::kTile.dkdv_tma) {
    const int64_t key0 = tile.n_block * Traits::kBlockN + warpgroup * 64 + wg_warp * 16;
    StoreDkDv<T>(tma_args.args.p, tile.b, tile.h_kv, key0, 0, dk, dv, tma_args.args.scale, pos.g,
                 pos.t);
  } else {
    constexpr int kDTiles = Traits::kHeadDim / kMmaN;
    static_assert(kDTiles % 2 == 0, "whole 16-column steps");
    extern __shared__ unsigned char smem_raw[];
    const int lane = pos.lane;
    const uint32_t dk_tile = BwdSmem<Traits>::Of(smem_raw).base + Traits::kDsOffset +
                             warpgroup * 2 * Traits::kDkDvTileBytes;
    const uint32_t dv_tile = dk_tile + Traits::kDkDvTileBytes;
    const float scale = tma_args.args.scale;
    // One stmatrix per 16 columns: matrices (keys g, g + 8) x (columns 16ks +
    // 0..7, + 8..15) of this warp's 16 keys; lane l addresses row l % 8 of
    // matrix l / 8.
    const int row = wg_warp * 16 + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int ks = 0; ks < kDTiles / 2; ++ks) {
      const uint32_t at = sm90::SwizzledOffset(row, 2 * ks + lane / 16, 64);
      const float(&k0)[4] = dk[2 * ks];
      const float(&k1)[4] = dk[2 * ks + 1];
      sm90::StMatrixX4(dk_tile + at, Pack2<T>(k0[0] * scale, k0[1] * scale),
                       Pack2<T>(k0[2] * scale, k0[3] * scale),
                       Pack2<T>(k1[0] * scale, k1[1] * scale),
                       Pack2<T>(k1[2] * scale, k1[3] * scale));
      const float(&v0)[4] = dv[2 * ks];
      const float(&v1)[4] = dv[2 * ks + 1];
      sm90::StMatrixX4(dv_tile + at, Pack2<T>(v0[0], v0[1]), Pack2<T>(v0[2], v0[3]),
                       Pack2<T>(v1[0], v1[1]), Pack2<T>(v1[2], v1[3]));
    }
    sm90::FenceProxyAsync();
    NamedBarrierSync(kDkDvStagedBarrier + warpgroup, 128);
    // The dQ reductions' issuer (wg_tid 0), so that no other predicate stays
    // live across the tile loop (ptxas kept one and spilled the step loop's
    // mask predicates into a register's bits: 85 LOP3 a step).
    if (pos.tid % 128 == 0) {
      const int key0 = static_cast<int>(tile.n_block) * Traits::kBlockN + warpgroup * 64;
      const int h = static_cast<int>(tile.h_kv), b = static_cast<int>(tile.b);
#pragma unroll
      for (int cb = 0; cb < (kDTiles * 8 + 63) / 64; ++cb) {
        TmaStoreBox(&tma_args.dk_map, cb * 64, key0, h, b,
                    dk_tile + cb * 64 * sm90::kSwizzleBytes);
        TmaStoreBox(&tma_args.dv_map, cb * 64, key0, h, b,
                    dv_tile + cb * 64 * sm90::kSwizzleBytes);
      }
      BulkCommit();
    }
  }
}

}  // namespace jax_flash::cuda::sm90

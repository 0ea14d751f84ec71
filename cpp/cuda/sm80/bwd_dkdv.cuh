// The dK/dV kernel of the tensor-core backward on mma.sync (sm_80+), and in
// the fast mode its dQ part, added with float32 atomics.
//
// One CTA per (key block of kBlockN, kv head, batch) (FA2: parallel over
// keys). Each warp owns 16 keys and computes the transposed tiles S^T = K Q^T
// and dP^T = V dO^T, so that P^T and dS^T come out of the MMAs already in the
// A-fragment layout of dV += P^T dO and dK += dS^T Q: no shared-memory round
// trip. The CTA loops over the q heads of its GQA group and the query blocks
// each can see, so K/V are never repeated and dK/dV are summed in registers.
// Fast mode also computes dQ += dS K per query block (dS^T through a
// double-buffered shared tile, one step late so a step has a single barrier)
// and adds it with float32 atomics into the workspace (bwd/workspace.h).
// kTerms (a separate instantiation, the plain kernel's code unchanged): the
// bias (added before the soft cap; dS^T summed into dbias, with atomics in
// the fast mode, by plain adds of one owning lane in the deterministic mode),
// the dense mask, dropout and the tile map (the query blocks it leaves empty
// skipped, bwd/query_steps.cuh; the full ones masked by the band alone). With dropout Z (keep mask) and s = 1 / (1 - rate),
// dV takes the kept and scaled P^T, dP^T becomes Z s dP^T before D is
// subtracted, and dS^T = P^T (Z s dP^T - D) from the unscaled P^T.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/query_steps.cuh"
#include "cuda/bwd/workspace.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm80/copy.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tile_size.h"

namespace jax_flash::cuda::sm80 {

// dK/dV kernel traits, from the bucket's row of sm80/tile_size.h.
template <int kHeadDim_, int kArch = 80>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BwdTile kTile = TilesFor(kHeadDim, kArch).bwd;
  static constexpr int kBlockN = kTile.block_n;  // keys per CTA
  static constexpr int kBlockM = kTile.block_m;  // queries per step
  static constexpr int kNWarps = kBlockN / kMmaM;             // 16 keys per warp
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kDSplit = kTile.d_split;
  static constexpr int kDPart = kHeadDim / kDSplit;
  // dQ = dS K tile split: kWarpsQ warps over the query rows, kWarpsD over
  // the columns of the current head-dim slice.
  static constexpr int kWarpsQ = kBlockM / kMmaM;
  static constexpr int kWarpsD = kNWarps / kWarpsQ;
  static constexpr int kDqCols = kDPart / kWarpsD;
  static constexpr int kStride = kHeadDim + kSmemPad;
  static constexpr int kStrideS = kBlockM + kSmemPad;  // dS^T rows (keys) x queries
  static constexpr int kStages = 2;                    // Q/dO double buffer
  // dS^T double buffer: dQ of step s runs at the start of step s + 1, behind
  // that step's barrier, so a step needs one barrier instead of two.
  static constexpr int kDsBuffers = 2;
  static constexpr size_t kSmemBytes =
      sizeof(uint16_t) * (2 * kBlockN * kStride + 2 * kStages * kBlockM * kStride +
                          kDsBuffers * kBlockN * kStrideS) +
      sizeof(float) * 2 * kStages * kBlockM;
  // Turing (no cp.async): the next step's Q, dO, lse and D come through
  // registers (StagedTile, sm80/copy.cuh) where that takes 24 per thread or
  // fewer (D <= 128), except at D = 32, where the kernel with its atomic dQ
  // (the fast mode there, bwd/run.cuh) ran 2-5% slower staged (NOTES.md).
  static constexpr bool kRegStaged =
      kArch < 80 && kHeadDim > 32 && 2 * kBlockM * kHeadDim * 2 / 4 / kThreads <= 24;
  static_assert(kBlockN > 0, "no sm80 tile for this head-dim bucket (sm80/tile_size.h)");
  static_assert(kNWarps % kWarpsQ == 0 && kDqCols % 16 == 0 && kDPart % 16 == 0);
  static_assert(kThreads >= 2 * kBlockM, "one thread per lse / D element");
  static_assert(kSmemBytes <= MaxSmemBytes(kArch), "tile exceeds the arch's shared memory");
};

template <typename T, typename Traits, bool kAccumDq, bool kTerms>
__global__ void __launch_bounds__(Traits::kThreads)
    DkDvKernel(const __grid_constant__ BwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kDPart = Traits::kDPart, kStrideS = Traits::kStrideS;
  constexpr int kQTiles = kBlockM / kMmaN;     // n-tiles of S^T (queries)
  constexpr int kPartTiles = kDPart / kMmaN;   // n-tiles of dK, dV
  constexpr int kDqTiles = Traits::kDqCols / kMmaN;
  const BwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;                    // [kStages][kBlockM][kStride]
  T* sdO = sQ + Traits::kStages * kBlockM * kStride; // [kStages][kBlockM][kStride]
  T* sdS = sdO + Traits::kStages * kBlockM * kStride;  // [kDsBuffers][kBlockN][kStrideS]
  float* sLse = reinterpret_cast<float*>(sdS + Traits::kDsBuffers * kBlockN * kStrideS);  // [kStages][kBlockM]
  float* sDelta = sLse + Traits::kStages * kBlockM;                  // [kStages][kBlockM]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const KeyBlockScheduler::Tile tile = KeyBlockScheduler::Get();
  const int64_t n_block = tile.n_block, h_kv = tile.h_kv, b = tile.b;
  const int64_t n0 = n_block * kBlockN;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int64_t num_heads_q = p.shape.num_heads_q;
  const int64_t group = p.shape.group_size();
  const int head_dim = static_cast<int>(p.shape.head_dim);
  // The band, segments and (kTerms) the tile map, which every head shares;
  // the plain kernel sees no map (HasScoreTerms), and the compiler sees that.
  BatchMask mask = BatchMask::For(p.mask, b, seqlen_q, seqlen_k);
  if constexpr (!kTerms) mask.tile_map = nullptr;

  const GmemRows<T> k = GmemRows<T>::Head(p.k, p.k_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v = GmemRows<T>::Head(p.v, p.v_strides, b, h_kv, seqlen_k, head_dim);

  // (q head of the group, query block) pairs, walked in order.
  const QuerySteps<kBlockN, kBlockM> walk = QuerySteps<kBlockN, kBlockM>::Make(mask, n0, group);
  const int64_t m_begin = walk.m_begin, steps = walk.count;

  // Step (q head gi of the group, query block mi): loads Q, dO, lse, D
  // into a stage.
  auto issue = [&](int64_t gi, int64_t mi, int stage) {
    const int64_t h = h_kv * group + gi;
    const int64_t m0 = (m_begin + mi) * kBlockM;
    const GmemRows<T> q = GmemRows<T>::Head(p.q, p.q_strides, b, h, seqlen_q, head_dim);
    const GmemRows<T> d_o = GmemRows<T>::Head(p.dout, p.dout_strides, b, h, seqlen_q, head_dim);
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ + stage * kBlockM * kStride, q,
                                                              m0, tid);
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sdO + stage * kBlockM * kStride,
                                                              d_o, m0, tid);
    LoadRowStats<kBlockM>(args, (b * num_heads_q + h) * seqlen_q, m0, seqlen_q,
                          sLse + stage * kBlockM, sDelta + stage * kBlockM, tid);
  };
  // Traits::kRegStaged: `issue` through registers, loaded where it would be
  // called and stored into their stage at the top of that step.
  StagedTile<T, kBlockM, kHeadDim, Traits::kThreads> q_next, do_next;
  StagedRowStats<kBlockM> stats_next;
  auto stage_in_registers = [&](int64_t gi, int64_t mi) {
    const int64_t h = h_kv * group + gi;
    const int64_t m0 = (m_begin + mi) * kBlockM;
    q_next.Load(GmemRows<T>::Head(p.q, p.q_strides, b, h, seqlen_q, head_dim), m0, tid);
    do_next.Load(GmemRows<T>::Head(p.dout, p.dout_strides, b, h, seqlen_q, head_dim), m0, tid);
    stats_next.Load(args, (b * num_heads_q + h) * seqlen_q, m0, seqlen_q, tid);
  };

  // ldmatrix lane addresses (layouts in common/fragment.cuh): K, V as A operands
  // (rows = this warp's keys); Q, dO as B of S^T / dP^T (non-transposed)
  // and as B of dK / dV (transposed, queries are the k dimension).
  const int warp_row0 = warp * kMmaM;
  const uint32_t k_frag = SmemAddr(sK) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t v_frag = SmemAddr(sV) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t qb_lane = 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t qt_lane = 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  // dQ = dS K: dS (queries x keys) read transposed from sdS, K transposed.
  const int dq_row0 = (warp % Traits::kWarpsQ) * kMmaM;
  const int dq_col0 = (warp / Traits::kWarpsQ) * Traits::kDqCols;
  const uint32_t ds_frag =
      SmemAddr(sdS) + 2 * (((lane / 16) * 8 + lane % 8) * kStrideS + dq_row0 + ((lane / 8) % 2) * 8);
  const uint32_t kt_frag = SmemAddr(sK) + 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride +
                                               dq_col0 + (lane / 16) * 8);
  const uint32_t sQ_addr = SmemAddr(sQ), sdO_addr = SmemAddr(sdO);

  LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n0, tid);
  LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n0, tid);
  CpAsyncCommit();

  const float scale_log2 = args.scale_log2;
  const bool softcap = args.softcap > 0.f;
  for (int part = 0; part < Traits::kDSplit; ++part) {
    const int part_col0 = part * kDPart;
    float dk[kPartTiles][4], dv[kPartTiles][4];
#pragma unroll
    for (int dt = 0; dt < kPartTiles; ++dt)
#pragma unroll
      for (int r = 0; r < 4; ++r) { dk[dt][r] = 0.f; dv[dt][r] = 0.f; }

    // dQ += dS K for the step (q head h, query block at m0) whose dS^T sits
    // in dS buffer buf, then float32 atomics into the workspace. Runs one
    // step late (behind the next step's barrier, which publishes sdS), so
    // the step needs no second barrier and these MMAs overlap the next
    // step's S^T / dP^T GEMM instead of waiting for the slowest warp.
    auto dq_step = [&](int buf, int64_t h, int64_t m0) {
      float dq[kDqTiles][4];
#pragma unroll
      for (int dt = 0; dt < kDqTiles; ++dt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dq[dt][r] = 0.f;
      const uint32_t buf_off = buf * (kBlockN * kStrideS * 2);
#pragma unroll
      for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
        uint32_t a[4];
        Ldmatrix4Trans(a, ds_frag + buf_off + 2 * ks * 16 * kStrideS);
#pragma unroll
        for (int dt2 = 0; dt2 < kDqTiles / 2; ++dt2) {
          uint32_t bk[4];
          Ldmatrix4Trans(bk, kt_frag + 2 * (ks * 16 * kStride + part_col0 + dt2 * 16));
          Mma<T>(dq[2 * dt2], a, bk[0], bk[1]);
          Mma<T>(dq[2 * dt2 + 1], a, bk[2], bk[3]);
        }
      }
      using Acc = DqAccumLayout<kHeadDim>;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t i = m0 + dq_row0 + g + hr * 8;
        if (i < seqlen_q) {
#pragma unroll
          for (int dt = 0; dt < kDqTiles; ++dt) {
            const int col = part_col0 + dq_col0 + dt * 8 + 2 * t;
            if (col < head_dim) {
              // col and col + 1 are in the same half (kHalf is even).
              float* acc = args.dq_accum + Acc::Index(b * num_heads_q + h, seqlen_q, i, col);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              // One 8-byte vector reduction instead of two scalar ones.
              atomicAdd(reinterpret_cast<float2*>(acc),
                        make_float2(dq[dt][2 * hr], dq[dt][2 * hr + 1]));
#else
              atomicAdd(acc, dq[dt][2 * hr]);
              atomicAdd(acc + 1, dq[dt][2 * hr + 1]);
#endif
            }
          }
        }
      }
    };

    if (steps > 0) {
      __syncthreads();  // the previous pass may still read stage 0
      issue(0, walk.first, 0);
      CpAsyncCommit();
    }
    // Steps walk (gi, mi) in order; counters instead of divisions.
    int64_t gi = 0, mi = walk.first;
    int64_t prev_h = 0, prev_m0 = 0;  // the step whose dQ is still pending
    for (int64_t s = 0; s < steps; ++s) {
      const int stage = static_cast<int>(s & 1);
      if constexpr (Traits::kRegStaged) {
        // Into this step's stage (free: the previous barrier saw every warp
        // done with the step before, the stage's last reader).
        if (s > 0) {
          q_next.template Store<kStride>(sQ + stage * kBlockM * kStride, tid);
          do_next.template Store<kStride>(sdO + stage * kBlockM * kStride, tid);
          stats_next.Store(sLse + stage * kBlockM, sDelta + stage * kBlockM, tid);
        }
      }
      // One barrier at the top of a step: publishes this stage and the
      // previous step's dS^T, and every warp has finished the previous
      // step, so its Q/dO stage (prefetched into below) and the dS buffer
      // of two steps ago (written below) are free.
      CpAsyncWait<0>();
      __syncthreads();
      const int64_t h = h_kv * group + gi;
      const int64_t m0 = (m_begin + mi) * kBlockM;
      const CellClass cls = walk.Class(mi);
      walk.Advance(gi, mi);  // (gi, mi) is now the next step
      if (s + 1 < steps) {
        if constexpr (Traits::kRegStaged) stage_in_registers(gi, mi);
        else issue(gi, mi, stage ^ 1);
        CpAsyncCommit();
      }
      if constexpr (kAccumDq) {
        if (s > 0) dq_step(stage ^ 1, prev_h, prev_m0);
      }
      const uint32_t stage_off = stage * (kBlockM * kStride * 2);
      const float* lse2_s = sLse + stage * kBlockM;
      const float* delta_s = sDelta + stage * kBlockM;
      // With kTerms: query head h's view of the dense mask, its dropout.
      const BatchMask head_mask =
          kTerms ? BatchMask::For(p.mask, b, h, seqlen_q, seqlen_k) : mask;
      const HeadDropout dropout = kTerms ? args.Dropout(b, h) : HeadDropout{};
      const BiasView<T> bias = kTerms ? BiasView<T>::For(p, b, h) : BiasView<T>{};

      // ---- S^T = K Q^T and dP^T = V dO^T (16 keys x kBlockM queries) ----
      float st[kQTiles][4], dpt[kQTiles][4];
      ScoreGemms<T, kHeadDim, kBlockM, kStride>(st, dpt, k_frag, v_frag, sQ_addr, sdO_addr,
                                                stage_off + qb_lane);

      // ---- P^T and dS^T = P^T (dP^T - D) dx -------------------------------
      // The common case (no softcap, every pair visible) costs 4 instructions
      // per element; softcap and the mask are uniform branches around it.
      // Column qi = nt * 8 + 2t + c of this lane: lse2 and D as float2.
      uint32_t keep = 0;  // dropout's keep bits of this warp's 16 keys x kBlockM queries
      if constexpr (kTerms) {
        if (bias.present())
          AddBias<Rows::kKeys>(st, bias, args.scale, n0 + warp_row0, m0, g, t);
        if (dropout.enabled) {
          keep = KeepBitsT<kQTiles>(dropout, n0 + warp_row0, m0, g, t);
          ApplyKeepT(dpt, keep, args.keep_scale);
        }
      }
      if (softcap) {
        SoftcapAndSubtractDelta(st, dpt, delta_s, args.softcap, args.scale_over_cap,
                                args.inv_softcap, t);
      } else {
        SubtractDelta(dpt, delta_s, t, 1.f);  // ApplyKeepT scaled the kept dP^T
      }
      ExpScoresT(st, lse2_s, scale_log2, t);
      MaskTile<Rows::kKeys>(st, head_mask, cls, m0, m0 + kBlockM, n0, n0 + kBlockN,
                            n0 + warp_row0, m0, g, t, 0.f);
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dpt[nt][r] *= st[nt][r];
      if constexpr (kTerms) {
        // dpt is dS^T now (d loss / d x): dbias sums it over the bias's
        // broadcast dimensions, at the whole problem's (batch, head).
        if (p.dbias != nullptr && part == 0) {
          const int64_t* dims = p.score.bias_dims;
          AccumulateDbiasT<kAccumDq>(dpt, DbiasPlane(p, args.batch0 + b, args.head0 + h),
                                     dims[2], dims[3], n0 + warp_row0, m0, seqlen_q, seqlen_k,
                                     g, t);
        }
        if (dropout.enabled) ApplyKeepT(st, keep, args.keep_scale);  // dV takes Z s P^T
      }

      // ---- dV += P^T dO, dK += dS^T Q (this pass's head-dim slice) -------
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        uint32_t ap[4], ads[4];
        PackA<T>(ap, st[2 * ks], st[2 * ks + 1]);
        PackA<T>(ads, dpt[2 * ks], dpt[2 * ks + 1]);
        if constexpr (kAccumDq) {
          // dS^T for the next step's dQ: a0/a2 are row g, a1/a3 row g + 8.
          T* ds_row = sdS + stage * kBlockN * kStrideS + (warp_row0 + g) * kStrideS + ks * 16 + 2 * t;
          *reinterpret_cast<uint32_t*>(ds_row) = ads[0];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kStrideS) = ads[1];
          *reinterpret_cast<uint32_t*>(ds_row + 8) = ads[2];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kStrideS + 8) = ads[3];
        }
#pragma unroll
        for (int dt2 = 0; dt2 < kDPart / 16; ++dt2) {
          uint32_t bo[4], bq[4];
          const uint32_t off =
              stage_off + qt_lane + 2 * (ks * 16 * kStride + part_col0 + dt2 * 16);
          Ldmatrix4Trans(bo, sdO_addr + off);
          Ldmatrix4Trans(bq, sQ_addr + off);
          Mma<T>(dv[2 * dt2], ap, bo[0], bo[1]);
          Mma<T>(dv[2 * dt2 + 1], ap, bo[2], bo[3]);
          Mma<T>(dk[2 * dt2], ads, bq[0], bq[1]);
          Mma<T>(dk[2 * dt2 + 1], ads, bq[2], bq[3]);
        }
      }
      prev_h = h;
      prev_m0 = m0;
    }
    if constexpr (kAccumDq) {
      if (steps > 0) {
        __syncthreads();  // publishes the last step's dS^T
        dq_step(static_cast<int>((steps - 1) & 1), prev_h, prev_m0);
      }
    }
    // ---- write this slice of dK (times d score / d q.k) and dV -------------
    // common/epilogue_bwd.cuh's StoreDkDv, written out: calling it changed
    // this kernel's register allocation (D=32 fast mode on sm_80: 232 -> 230
    // registers), which no GPU at hand can time (NOTES.md).
    T* dk_out = static_cast<T*>(p.dk) + p.dk_strides.offset(b, 0, h_kv);
    T* dv_out = static_cast<T*>(p.dv) + p.dv_strides.offset(b, 0, h_kv);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t j = n0 + warp_row0 + g + hr * 8;
      if (j < seqlen_k) {
#pragma unroll
        for (int dt = 0; dt < kPartTiles; ++dt) {
          const int col = part_col0 + dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(dk_out + j * p.dk_strides.row + col) =
                Pack2<T>(dk[dt][2 * hr] * args.scale, dk[dt][2 * hr + 1] * args.scale);
            *reinterpret_cast<uint32_t*>(dv_out + j * p.dv_strides.row + col) =
                Pack2<T>(dv[dt][2 * hr], dv[dt][2 * hr + 1]);
          }
        }
      }
    }
  }
  CpAsyncWait<0>();  // K/V were loaded even when no query block sees this key block
}


// Launches the dK/dV kernel over (key blocks, kv heads, batch); with
// accumulate_dq (the fast mode) it also adds dQ into args.dq_accum.
template <typename T, int kHeadDim, bool kTerms, int kArch = 80>
cudaError_t LaunchDkDv(const BwdArgs& args, bool accumulate_dq, cudaStream_t stream) {
  using Traits = BwdTraits<kHeadDim, kArch>;
  const AttentionShape& shape = args.p.shape;
  const int64_t n_blocks = CeilDiv(shape.seqlen_k, Traits::kBlockN);
  if (n_blocks == 0) return cudaSuccess;
  const dim3 grid = KeyBlockScheduler::Grid(n_blocks, shape);
  auto kernel = accumulate_dq ? DkDvKernel<T, Traits, true, kTerms>
                              : DkDvKernel<T, Traits, false, kTerms>;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Traits::kSmemBytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::sm80

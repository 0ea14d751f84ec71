// The deterministic dQ kernel of the tensor-core backward on mma.sync
// (sm_80+): parallel over query blocks, it recomputes S and dP and sums dQ
// over keys in a fixed order (no atomics, so bitwise reproducible). kTerms:
// the bias, the dense mask, dropout and the tile map, as in
// sm80/bwd_dkdv.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/tile_map.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/sm80/copy.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tile_size.h"

namespace jax_flash::cuda::sm80 {

// Deterministic dQ kernel tile shape: the forward's structure (warps split
// the query block, keys stream through a two-stage pipeline).
template <int kHeadDim_, int kArch = 80>
struct BwdDqTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr DqTile kTile = TilesFor(kHeadDim, kArch).dq;  // sm80/tile_size.h
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStride = kHeadDim + kSmemPad;
  static constexpr int kStages = 2;
  static constexpr size_t kSmemBytes =
      sizeof(uint16_t) * (2 * kBlockM * kStride + 2 * kStages * kBlockN * kStride);
  // Turing (no cp.async): the next K/V block comes through registers
  // (StagedTile, sm80/copy.cuh) where that takes 32 per thread or fewer, as
  // in the forward.
  static constexpr bool kRegStaged = kArch < 80 && 2 * kBlockN * kHeadDim * 2 / 4 / kThreads <= 32;
  static_assert(kBlockM > 0, "no sm80 tile for this head-dim bucket (sm80/tile_size.h)");
  static_assert(kBlockM == kNWarps * kMmaM, "warps split the query block, 16 rows each");
  static_assert(kSmemBytes <= MaxSmemBytes(kArch), "tile exceeds the arch's shared memory");
};

// Deterministic dQ: one CTA per (query block, q head, batch), keys in order.
template <typename T, typename Traits, bool kTerms>
__global__ void __launch_bounds__(Traits::kThreads)
    DqKernel(const __grid_constant__ BwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  const BwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kStride;
  T* sK = sdO + kBlockM * kStride;                  // [kStages][kBlockN][kStride]
  T* sV = sK + Traits::kStages * kBlockN * kStride;  // [kStages][kBlockN][kStride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const QueryBlockScheduler::Tile tile = QueryBlockScheduler::Get();  // longest (causal) first
  const int64_t m_block = tile.m_block, h = tile.h, b = tile.b;
  const int64_t h_kv = h / p.shape.group_size();
  const int64_t m0 = m_block * kBlockM;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const BatchMask mask = kTerms ? BatchMask::For(p.mask, b, h, seqlen_q, seqlen_k)
                                : BatchMask::For(p.mask, b, seqlen_q, seqlen_k);
  const HeadDropout dropout = kTerms ? args.Dropout(b, h) : HeadDropout{};
  const BiasView<T> bias = kTerms ? BiasView<T>::For(p, b, h) : BiasView<T>{};

  const GmemRows<T> q = GmemRows<T>::Head(p.q, p.q_strides, b, h, seqlen_q, head_dim);
  const GmemRows<T> d_o = GmemRows<T>::Head(p.dout, p.dout_strides, b, h, seqlen_q, head_dim);
  const GmemRows<T> k = GmemRows<T>::Head(p.k, p.k_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v = GmemRows<T>::Head(p.v, p.v_strides, b, h_kv, seqlen_k, head_dim);

  int64_t key_begin, key_end;
  mask.KeyRange(m0, m0 + kBlockM, &key_begin, &key_end);
  const int64_t n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : key_begin / kBlockN;
  // kTerms: the key blocks the tile map leaves empty are skipped.
  const CellLine cells = kTerms ? CellLine::AlongKeys<kBlockM, kBlockN>(mask, m0) : CellLine{};
  const int64_t n_begin = cells.Next<kBlockN>(key_begin / kBlockN, n_end);

  const int warp_row0 = warp * kMmaM;
  // Per-row statistics of the two rows this lane owns.
  const int64_t row_base = (b * p.shape.num_heads_q + h) * seqlen_q;
  float lse2[2], delta[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    lse2[hr] = i < seqlen_q ? args.lse2[row_base + i] : INFINITY;
    delta[hr] = i < seqlen_q ? static_cast<const float*>(p.delta)[row_base + i] : 0.f;
  }

  float dq[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) dq[dt][r] = 0.f;

  if (n_begin < n_end) {
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ, q, m0, tid);
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sdO, d_o, m0, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
  }
  const uint32_t a_lane = 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t q_frag = SmemAddr(sQ) + a_lane, do_frag = SmemAddr(sdO) + a_lane;
  const uint32_t b_lane = 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t bt_lane = 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  const uint32_t sK_addr = SmemAddr(sK), sV_addr = SmemAddr(sV);
  const float scale_log2 = args.scale_log2;

  // The next block's K and V on their way (Traits::kRegStaged: in registers).
  NextKvBlock<T, kBlockN, kHeadDim, kStride, Traits::kThreads, Traits::kRegStaged> next_kv;

  int stage = 0;
  for (int64_t n = n_begin, next; n < n_end; n = next, stage ^= 1) {
    next = cells.Next<kBlockN>(n + 1, n_end);
    const CellClass cls = cells.At<kBlockN>(n);
    // Into this block's stage (free, as in sm80/fwd.cuh).
    if (n != n_begin)
      next_kv.Land(sK + stage * kBlockN * kStride, sV + stage * kBlockN * kStride, tid);
    // One barrier per block (see sm80/fwd.cuh): publishes this stage and
    // frees the other one for the prefetch.
    CpAsyncWait<0>();
    __syncthreads();
    if (next < n_end) {
      next_kv.Issue(sK + (stage ^ 1) * kBlockN * kStride, sV + (stage ^ 1) * kBlockN * kStride, k,
                    v, next * kBlockN, tid);
      CpAsyncCommit();
    }
    const uint32_t stage_off = stage * (kBlockN * kStride * 2);

    // ---- S = Q K^T, dP = dO V^T -------------------------------------------
    float s[kNTiles][4], dp[kNTiles][4];
    ScoreGemms<T, kHeadDim, kBlockN, kStride>(s, dp, q_frag, do_frag, sK_addr, sV_addr,
                                              stage_off + b_lane);

    // ---- P and dS (softcap and mask as in sm80/bwd_dkdv.cuh) -------------
    if constexpr (kTerms) {
      if (bias.present())
        AddBias<Rows::kQueries>(s, bias, args.scale, m0 + warp_row0, n * kBlockN, g, t);
      if (dropout.enabled)
        DropoutRows(dp, dropout, m0 + warp_row0, n * kBlockN, g, t, args.keep_scale);
    }
    if (args.softcap > 0.f) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float x = args.softcap * FastTanh(s[nt][r] * args.scale_over_cap);
          const float th = x * args.inv_softcap;
          s[nt][r] = x;
          dp[nt][r] = (dp[nt][r] - delta[r / 2]) * (1.f - th * th);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dp[nt][r] -= delta[r / 2];
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[nt][r] = FastExp2(fmaf(s[nt][r], scale_log2, -lse2[r / 2]));
    const int64_t n0 = n * kBlockN;
    MaskTile<Rows::kQueries>(s, mask, cls, m0, m0 + kBlockM, n0, n0 + kBlockN, m0 + warp_row0,
                             n0, g, t, 0.f);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[nt][r] *= dp[nt][r];  // dS

    // ---- dQ += dS K ---------------------------------------------------------
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      uint32_t a[4];
      PackA<T>(a, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
      for (int dt2 = 0; dt2 < kHeadDim / 16; ++dt2) {
        uint32_t bk[4];
        Ldmatrix4Trans(bk, sK_addr + stage_off + bt_lane + 2 * (ks * 16 * kStride + dt2 * 16));
        Mma<T>(dq[2 * dt2], a, bk[0], bk[1]);
        Mma<T>(dq[2 * dt2 + 1], a, bk[2], bk[3]);
      }
    }
  }

  T* dq_out = static_cast<T*>(p.dq) + p.dq_strides.offset(b, 0, h);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    if (i < seqlen_q) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(dq_out + i * p.dq_strides.row + col) =
              Pack2<T>(dq[dt][2 * hr] * args.scale, dq[dt][2 * hr + 1] * args.scale);
        }
      }
    }
  }
}


// Launches the deterministic dQ kernel over (query blocks, q heads, batch).
template <typename T, int kHeadDim, bool kTerms, int kArch = 80>
cudaError_t LaunchDq(const BwdArgs& args, cudaStream_t stream) {
  using Traits = BwdDqTraits<kHeadDim, kArch>;
  const AttentionShape& shape = args.p.shape;
  const int64_t m_blocks = CeilDiv(shape.seqlen_q, Traits::kBlockM);
  auto kernel = DqKernel<T, Traits, kTerms>;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Traits::kSmemBytes));
  if (err != cudaSuccess) return err;
  kernel<<<QueryBlockScheduler::Grid(m_blocks, shape), Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::sm80

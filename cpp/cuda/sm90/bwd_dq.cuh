// The deterministic dQ kernel on wgmma (sm_90a): the forward's structure
// (sm90/fwd.cuh with TMA) with the backward's arithmetic, as sm80/bwd_dq.cuh
// on mma.sync. One CTA per (block of 128 queries, q head, batch), two
// warpgroups of 64 queries; the key blocks of the CTA stream through a
// two-stage TMA pipeline in order, so dQ is summed over keys in a fixed
// order (no atomics: bitwise reproducible). Per warpgroup and key block:
//   S  = Q_w K^T, dP = dO_w V^T   SS, both K-major
//   P = exp2(S - lse2), dS = P (dP - D) dx   in registers (common/score.cuh)
//   dQ += dS K                    RS: dS from registers, K MN-major
// The dK/dV kernel of the deterministic mode is sm90/bwd.cuh's without dQ.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/bwd/args.h"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/math.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/bwd_routing.h"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim_>
struct DqSm90Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr DqTile kTile = DqTileSize(kHeadDim);  // sm90/tile_size.h
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kThreads = kTile.threads;
  static constexpr int kStages = kTile.stages;
  static constexpr int kSmemCols = SwizzledCols(kHeadDim);
  static constexpr int kQBytes = kBlockM * kSmemCols * 2;   // Q or dO
  static constexpr int kKvBytes = kBlockN * kSmemCols * 2;  // one K or V stage
  // + the TMA barriers (Q and dO's, one per K/V stage) + one swizzle period
  // so that the tiles can start 1024-byte aligned.
  static constexpr int kSmemBytes =
      2 * kQBytes + 2 * kStages * kKvBytes + 8 * (1 + kStages) + kAtomBytes;
  static_assert(kBlockM == 2 * 64 && kThreads == 2 * 128, "two warpgroups of 64 rows");
  static_assert(kHeadDim % 32 == 0, "head dim must be a multiple of 32");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: whole k-steps, one wgmma");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// The kernel's parameters: tensor maps of Q and dO (boxes of 64 columns x
// kBlockM rows) and of K and V (x kBlockN rows).
struct DqTmaArgs {
  BwdArgs args;
  CUtensorMap q_map, dout_map, k_map, v_map;
};

// The CTA's key blocks -> this warp's dQ (16 query rows x the head dim).
// At most one of kSoftcap, kBias, kDropout (dP becomes Z s dP before D is
// subtracted, from keep bits drawn while the block's GEMMs run).
template <typename T, typename Traits, bool kSoftcap, bool kBias, bool kDropout>
__device__ __forceinline__ void DqMainloop(const DqTmaArgs& ta, const FwdBlock<T>& blk,
                                           const ThreadPos& pos,
                                           float (&dq)[Traits::kHeadDim / kMmaN][4]) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kBlocks = Traits::kSmemCols / kSwizzleElems;  // TMA boxes per tile
  static_assert(int{kSoftcap} + int{kBias} + int{kDropout} <= 1, "one of the terms per kernel");
  const BwdArgs& args = ta.args;
  const BwdParams& p = args.p;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (SmemAddr(smem_raw) + kAtomBytes - 1) & ~(kAtomBytes - 1);
  const uint32_t sQ = base;
  const uint32_t sdO = sQ + Traits::kQBytes;
  const uint32_t sK = sdO + Traits::kQBytes;                     // [kStages]
  const uint32_t sV = sK + Traits::kStages * Traits::kKvBytes;  // [kStages]
  const uint32_t q_bar = sV + Traits::kStages * Traits::kKvBytes;
  const uint32_t kv_bar = q_bar + 8;  // [kStages]; the k-th use of a stage completes phase k

  const int tid = pos.tid, warp = pos.warp, g = pos.g, t = pos.t;
  const int warpgroup = warp / 4;
  const int64_t m0 = blk.m0, n_begin = blk.n_begin, n_end = blk.n_end;
  const int b = static_cast<int>(blk.b), h = static_cast<int>(blk.h);
  const int h_kv = static_cast<int>(blk.h / p.shape.group_size());

  auto load_kv = [&](int64_t n, int stage) {
    if (tid == 0) {
      const uint32_t bar = kv_bar + 8 * stage;
      MbarrierArriveExpectTx(bar, 2 * Traits::kKvBytes);
#pragma unroll
      for (int block = 0; block < kBlocks; ++block) {
        const uint32_t offset = stage * Traits::kKvBytes + block * kBlockN * kSwizzleBytes;
        TmaLoadBox(sK + offset, &ta.k_map, block * kSwizzleElems, static_cast<int>(n * kBlockN),
                   h_kv, b, bar);
        TmaLoadBox(sV + offset, &ta.v_map, block * kSwizzleElems, static_cast<int>(n * kBlockN),
                   h_kv, b, bar);
      }
    }
  };
  if (tid == 0) {
    MbarrierInit(q_bar, 1);
    for (int stage = 0; stage < Traits::kStages; ++stage) MbarrierInit(kv_bar + 8 * stage, 1);
    FenceBarrierInit();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
  if (n_begin < n_end) {
    if (tid == 0) {
      MbarrierArriveExpectTx(q_bar, 2 * Traits::kQBytes);
#pragma unroll
      for (int block = 0; block < kBlocks; ++block) {
        const uint32_t offset = block * kBlockM * kSwizzleBytes;
        TmaLoadBox(sQ + offset, &ta.q_map, block * kSwizzleElems, static_cast<int>(m0), h, b,
                   q_bar);
        TmaLoadBox(sdO + offset, &ta.dout_map, block * kSwizzleElems, static_cast<int>(m0), h, b,
                   q_bar);
      }
    }
    load_kv(n_begin, 0);
  }

  // lse2 and D of this lane's two rows (g, g + 8 of its warp's 16).
  const int warp_row0 = warp * 16;
  const int64_t row_base = (blk.b * p.shape.num_heads_q + blk.h) * p.shape.seqlen_q;
  float lse2[2], delta[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    lse2[hr] = i < p.shape.seqlen_q ? args.lse2[row_base + i] : INFINITY;
    delta[hr] = i < p.shape.seqlen_q ? static_cast<const float*>(p.delta)[row_base + i] : 0.f;
  }
#pragma unroll
  for (int dt = 0; dt < kHeadDim / kMmaN; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) dq[dt][r] = 0.f;

  const uint32_t q_rows = sQ + warpgroup * 64 * kSwizzleBytes;
  const uint32_t do_rows = sdO + warpgroup * 64 * kSwizzleBytes;
  const float scale_log2 = args.scale_log2;
  const BiasView<T> bias = kBias ? BiasView<T>::For(p, b, h) : BiasView<T>{};
  const HeadDropout dropout = kDropout ? args.Dropout(b, h) : HeadDropout{};

  // Key blocks in FwdBlock::NextBlock's steps; `step` counts them.
  int64_t next = blk.template NextBlock<kBlockN>(n_begin + 1);
  for (int64_t n = n_begin, step = 0; n < n_end; n = next, ++step) {
    if (step > 0) next = blk.template NextBlock<kBlockN>(n + 1);
    const int stage = static_cast<int>(step & 1);
    // Both warpgroups are done with the previous block, whose stage the
    // prefetch overwrites; then this block's tiles are waited for.
    __syncthreads();
    if (next < n_end) load_kv(next, stage ^ 1);
    if (step == 0) MbarrierWait(q_bar, 0);
    MbarrierWait(kv_bar + 8 * stage, static_cast<uint32_t>((step >> 1) & 1));
    const uint32_t k_tile = sK + stage * Traits::kKvBytes;
    const uint32_t v_tile = sV + stage * Traits::kKvBytes;

    // ---- S = Q_w K^T, dP = dO_w V^T ---------------------------------------
    float s[kNTiles][4], dp[kNTiles][4];
    WgmmaFence();
    GemmKMajor<T, kHeadDim, kBlockM, kBlockN>(s, q_rows, k_tile);
    WgmmaCommit();
    GemmKMajor<T, kHeadDim, kBlockM, kBlockN>(dp, do_rows, v_tile);
    WgmmaCommit();
    // What the mask does to this block, decided while the GEMMs run.
    const int64_t n0 = n * kBlockN;
    const MaskPath mask_path = MaskPathOf(blk.mask, blk.template BlockClass<kBlockN>(n), m0,
                                          m0 + kBlockM, n0, n0 + kBlockN);
    const auto keep = [&] {  // this warp's keep bits of the block (common/dropout.cuh)
      if constexpr (kDropout)
        return RowKeep<kNTiles>::Draw(dropout, m0 + warp_row0, n * kBlockN, g, t);
      else return 0;
    }();
    WgmmaWait<0>();
    FenceRegisters(s);
    FenceRegisters(dp);
    // Kept or 0; 1 / (1 - rate) joins the subtraction of D below.
    if constexpr (kDropout) keep.Apply(dp);
    const float dp_scale = kDropout ? args.keep_scale : 1.f;
    // x = scale * s + bias (no soft cap with a bias here: LaunchDq).
    if constexpr (kBias)
      AddBias<Rows::kQueries>(s, bias, args.scale, m0 + warp_row0, n * kBlockN, g, t);

    // ---- P, dS (soft cap and mask as in sm80/bwd_dq.cuh) -------------------
    if constexpr (kSoftcap) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float x = args.softcap * FastTanh(s[nt][r] * args.scale_over_cap);
          const float th = x * args.inv_softcap;
          s[nt][r] = x;
          dp[nt][r] = (dp[nt][r] * dp_scale - delta[r / 2]) * (1.f - th * th);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dp[nt][r] = dp[nt][r] * dp_scale - delta[r / 2];
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[nt][r] = FastExp2(fmaf(s[nt][r], scale_log2, -lse2[r / 2]));
    ApplyMask<Rows::kQueries>(s, blk.mask, mask_path, m0 + warp_row0, n0, g, t, 0.f);

    // ---- dQ += dS K: A = dS from registers, B = K MN-major ------------------
    uint32_t a[kBlockN / kMmaK][4];
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks)
      PackProductA<T>(a[ks], s[2 * ks], s[2 * ks + 1], dp[2 * ks], dp[2 * ks + 1]);
    WgmmaFence();
    FenceRegisters(dq);
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      // k-step ks = keys 16ks..16ks+15: two 8-row groups of K.
      const uint64_t desc_k = SmemDescriptor(k_tile + ks * 2 * kAtomBytes,
                                             kBlockN * kSwizzleBytes, kAtomBytes);
      WgmmaRSColumns<T, kHeadDim>(dq, a[ks], desc_k, kBlockN * kSwizzleBytes, 1);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegisters(dq);
  }
}

template <typename T, typename Traits, bool kSoftcap, bool kBias, bool kDropout>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    DqKernel(const __grid_constant__ DqTmaArgs ta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const ThreadPos pos = ThreadPos::Here();
  const BwdParams& p = ta.args.p;
  const FwdBlock<T> blk =
      FwdBlock<T>::template Make<Traits::kBlockM, Traits::kBlockN, /*kTileMap=*/true>(
          p, QueryBlockScheduler::Get());
  float dq[Traits::kHeadDim / kMmaN][4];
  DqMainloop<T, Traits, kSoftcap, kBias, kDropout>(ta, blk, pos, dq);
  // dQ = scale * (dS K), this warp's 16 rows.
  const int head_dim = static_cast<int>(p.shape.head_dim);
  T* dq_out = static_cast<T*>(p.dq) + p.dq_strides.offset(blk.b, 0, blk.h);
  const float scale = ta.args.scale;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = blk.m0 + pos.warp * 16 + pos.g + hr * 8;
    if (i < p.shape.seqlen_q) {
#pragma unroll
      for (int dt = 0; dt < Traits::kHeadDim / kMmaN; ++dt) {
        const int col = dt * 8 + 2 * pos.t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(dq_out + i * p.dq_strides.row + col) =
              Pack2<T>(dq[dt][2 * hr] * scale, dq[dt][2 * hr + 1] * scale);
        }
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

// cudaErrorNotSupported when TMA cannot address Q, dO, K or V: the caller
// runs the sm_80 kernel then.
template <typename T, int kHeadDim>
cudaError_t LaunchDq(const BwdArgs& args, cudaStream_t stream) {
  using Traits = DqSm90Traits<kHeadDim>;
  const AttentionShape& s = args.p.shape;
  const int64_t m_blocks = CeilDiv(s.seqlen_q, Traits::kBlockM);
  if (m_blocks == 0 || s.num_heads_q == 0 || s.batch == 0) return cudaSuccess;
  if (s.num_heads_q > 65535 || s.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  DqTmaArgs ta;
  ta.args = args;
  const BwdParams& p = args.p;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if (!EncodeRowsTensorMap(&ta.q_map, p.q, p.q_strides, s.batch, s.seqlen_q, s.num_heads_q,
                           s.head_dim, Traits::kBlockM, kBf16) ||
      !EncodeRowsTensorMap(&ta.dout_map, p.dout, p.dout_strides, s.batch, s.seqlen_q,
                           s.num_heads_q, s.head_dim, Traits::kBlockM, kBf16) ||
      !EncodeRowsTensorMap(&ta.k_map, p.k, p.k_strides, s.batch, s.seqlen_k, s.num_heads_kv,
                           s.head_dim, Traits::kBlockN, kBf16) ||
      !EncodeRowsTensorMap(&ta.v_map, p.v, p.v_strides, s.batch, s.seqlen_k, s.num_heads_kv,
                           s.head_dim, Traits::kBlockN, kBf16))
    return cudaErrorNotSupported;
  // The terms the kernels take (BwdTakesTerms), each its own instantiation.
  auto kernel = args.softcap > 0.f ? DqKernel<T, Traits, true, false, false>
                                   : DqKernel<T, Traits, false, false, false>;
  if (!BwdTakesTerms(p, /*deterministic=*/false)) return cudaErrorNotSupported;  // (LaunchDkDv)
  if (p.score.bias != nullptr) {
    if constexpr (kHeadDim >= 128) kernel = DqKernel<T, Traits, false, true, false>;
  } else if (p.dropout.enabled()) {
    kernel = DqKernel<T, Traits, false, false, true>;
  }
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<QueryBlockScheduler::Grid(m_blocks, s), Traits::kThreads, Traits::kSmemBytes, stream>>>(
      ta);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::sm90

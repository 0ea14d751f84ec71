// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, sm_80+).
//
// Work partition (FA2): one CTA per (query block of kBlockM rows, q head,
// batch); its warps split the query block (kWarpRows rows each) so that the
// softmax statistics of a row never leave one warp. K/V blocks of kBlockN
// keys stream through a two-stage cp.async pipeline; S = Q K^T, the online
// softmax (m, l in registers, exp2 with the scale pre-multiplied by log2 e)
// and O += P V all stay in registers, P converted to 16 bits in place.
// The tile scheduler, the score policies, the softmax and the epilogue are
// common/'s. kTerms adds the per-element terms of the score (bias, dense
// mask, dropout) and the tile map (its empty key blocks skipped, the full
// ones masked by the band alone, a block mask's hidden cells never read) as
// a separate instantiation, so the plain kernel's code stays as it is; the
// K/V loop stays in the kernel's body: as a function of its own it compiled
// to different code for D=128 (cpp/cuda/NOTES.md).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/epilogue_fwd.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/term_slab.cuh"
#include "cuda/sm80/copy.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tile_size.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm80 {

template <int kHeadDim_, int kArch_ = 80, bool kTerms = false>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kArch = kArch_;
  static constexpr FwdTile kTile = FwdTileFor(kHeadDim, kArch, kTerms);  // sm80/tile_size.h
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kMinBlocks = kTile.min_blocks;
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / kMmaM;
  static constexpr int kNTiles = kBlockN / kMmaN;   // n-tiles of S
  static constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of O
  static constexpr int kStride = kHeadDim + kSmemPad;  // smem row, elements
  static constexpr int kStages = 2;                    // K/V double buffer
  static constexpr int kSmemElems = kBlockM * kStride + 2 * kStages * kBlockN * kStride;
  // Turing (no cp.async): the next K/V block comes through registers
  // (StagedTile, sm80/copy.cuh) where that takes 32 per thread or fewer
  // (not D = 256), except in the kTerms kernels of two m-tiles (D = 32, 64),
  // which spill 400 bytes already: there the copy stays synchronous (with
  // the registers and one m-tile per warp, packed segments ran 5-13%
  // slower; NOTES.md).
  static constexpr bool kRegStaged = kArch < 80 &&
                                     2 * kBlockN * kHeadDim * 2 / 4 / kThreads <= 32 &&
                                     !(kTerms && kMTiles > 1);
  static_assert(kBlockM > 0, "no sm80 tile for this head-dim bucket (sm80/tile_size.h)");
  static_assert(kWarpRows % kMmaM == 0 && kHeadDim % 16 == 0 && kBlockN % 16 == 0);
  static_assert(kSmemElems * 2 <= MaxSmemBytes(kArch), "tile exceeds the arch's shared memory");
  // The kTerms kernel's bias and dense mask, staged per warp after sV
  // (common/term_slab.cuh), on sm_80+ (cp.async; Turing's 64 KiB would not
  // hold them), up to D = 128 (above, the staging's addresses spilled next
  // to O: D=256 16 -> 124 bytes).
  using BiasSlab = WarpSlab<kWarpRows, kBlockN, 4>;
  using MaskSlab = WarpSlab<kWarpRows, kBlockN, 1>;
  static constexpr bool kStagesTerms = kArch >= 80 && kHeadDim <= 128;
  static_assert(!kStagesTerms || kSmemElems * 2 + kNWarps * (BiasSlab::kBytes + MaskSlab::kBytes) <=
                                     MaxSmemBytes(kArch),
                "the staged score terms exceed the arch's shared memory");
  // Dynamic shared memory of a launch; the kernel lays it out the same way.
  static size_t SmemBytes(const FwdParams& p, bool terms) {
    size_t bytes = kSmemElems * 2;
    if (terms && kStagesTerms) {
      if (BiasStageable(p)) bytes += kNWarps * BiasSlab::kBytes;
      if (MaskStageable(p)) bytes += kNWarps * MaskSlab::kBytes;
    }
    return bytes;
  }
};

template <typename T, typename Traits, bool kTerms>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    FwdKernel(const __grid_constant__ FwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kMT = Traits::kMTiles, kNTiles = Traits::kNTiles, kDTiles = Traits::kDTiles;
  const FwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;                       // [kStages][kBlockN][kStride]
  T* sV = sK + Traits::kStages * kBlockN * kStride;     // [kStages][kBlockN][kStride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // kTerms: this head's view of the mask (a dense mask), stepping through
  // the tile map.
  const FwdBlock<T> blk = FwdBlock<T>::template Make<kBlockM, kBlockN, /*kTileMap=*/kTerms>(
      p, kTerms ? QueryBlockScheduler::Get(args.order) : QueryBlockScheduler::Get());
  const int64_t m0 = blk.m0, n_begin = blk.n_begin, n_end = blk.n_end;
  const GmemRows<T>& q = blk.q;
  const GmemRows<T>& k = blk.k;
  const GmemRows<T>& v = blk.v;
  const BatchMask& mask = blk.mask;
  // With kTerms: this head's dropout stream.
  const HeadDropout dropout = kTerms ? HeadDropout::For(p.dropout, p.shape.batch, blk.b, blk.h)
                                     : HeadDropout{};
  // And its view of the bias (x = scale * q.k + bias: MakeFwdArgs then keeps
  // scale out of scale_log2 and scale_over_cap).
  const BiasView<T> bias = kTerms ? BiasView<T>::For(p, blk.b, blk.h) : BiasView<T>{};
  const float scale = kTerms ? static_cast<float>(p.score.scale) : 0.f;
  // Staged terms (common/term_slab.cuh): this warp's slabs after sV, loaded
  // one key block ahead. The cp.async groups then alternate K/V, slab: the
  // waits below leave the newest group in flight.
  constexpr bool kStage = kTerms && Traits::kStagesTerms;
  using BiasSlab = typename Traits::BiasSlab;
  using MaskSlab = typename Traits::MaskSlab;
  const bool stage_bias = kStage && BiasStageable(p);
  const bool stage_mask = kStage && MaskStageable(p);
  unsigned char* const slabs = smem_raw + Traits::kSmemElems * sizeof(T);
  unsigned char* const bias_slab = slabs + warp * BiasSlab::kBytes;
  unsigned char* const mask_slab =
      slabs + (stage_bias ? Traits::kNWarps * BiasSlab::kBytes : 0) + warp * MaskSlab::kBytes;
  const int64_t slab_row0 = blk.m0 + warp * Traits::kWarpRows;
  // (A block the tile map says is full needs no mask.)
  auto load_slabs = [&](int64_t n) {
    if (stage_bias)
      BiasSlab::Load(SmemAddr(bias_slab), bias.f32, bias.row, slab_row0, p.shape.seqlen_q,
                     n * kBlockN, p.shape.seqlen_k, lane);
    if (stage_mask && blk.template BlockClass<kBlockN>(n) != kCellFull)
      MaskSlab::Load(SmemAddr(mask_slab), mask.dense, mask.dense_row_stride, slab_row0,
                     p.shape.seqlen_q, n * kBlockN, p.shape.seqlen_k, lane);
  };

  // O and the running statistics of the rows this lane owns: rows (mt, half)
  // = warp row + mt*16 + g + 8*half.
  float o[kMT][kDTiles][4];
  float row_m[kMT][2], row_l[kMT][2];
  InitFwdState(o, row_m, row_l);

  if (n_begin < n_end) {
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ, q, m0, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
    if constexpr (kStage) {
      load_slabs(n_begin);
      CpAsyncCommit();
    }
  }

  const int warp_row0 = warp * Traits::kWarpRows;
  // ldmatrix row addresses of this lane (see the fragment layouts in
  // common/fragment.cuh): Q as the A operand, K as B (non-transposed), V as B
  // (transposed, keys are the k dimension).
  const uint32_t q_frag =
      SmemAddr(sQ) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t k_lane =
      SmemAddr(sK) + 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t v_lane =
      SmemAddr(sV) + 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  const float scale_log2 = args.scale_log2;
  const float rescale_margin = args.rescale_margin;

  // The next block's K and V on their way (Traits::kRegStaged: in registers).
  NextKvBlock<T, kBlockN, kHeadDim, kStride, Traits::kThreads, Traits::kRegStaged> next_kv;

  // Key blocks n_begin.. in order, those the tile map leaves empty skipped
  // (kTerms; without a map `next` is n + 1).
  int stage = 0;
  for (int64_t n = n_begin, next; n < n_end; n = next, stage ^= 1) {
    next = blk.template NextBlock<kBlockN>(n + 1);
    const CellClass cls = blk.template BlockClass<kBlockN>(n);
    // This block, loaded during the previous one, into its stage (free: the
    // previous barrier saw every warp done with the block before).
    if (n != n_begin)
      next_kv.Land(sK + stage * kBlockN * kStride, sV + stage * kBlockN * kStride, tid);
    // One barrier per block: it publishes this block's K/V to all warps and
    // also tells that every warp is done with the previous block, whose
    // stage the prefetch below overwrites.
    // (Staged terms: this block's slab may stay in flight.)
    if constexpr (kStage) CpAsyncWait<1>();
    else CpAsyncWait<0>();
    __syncthreads();
    if (next < n_end) {
      // Prefetch the next K/V block into the other stage while this one computes.
      next_kv.Issue(sK + (stage ^ 1) * kBlockN * kStride, sV + (stage ^ 1) * kBlockN * kStride, k,
                    v, next * kBlockN, tid);
      if constexpr (!kStage) CpAsyncCommit();
    }
    if constexpr (kStage) CpAsyncCommit();  // a group every block, empty at the last
    // Shared addresses as 32-bit byte offsets: per-lane part once, the
    // unrolled tile offsets then fold into the ldmatrix immediates.
    const uint32_t k_frag = k_lane + stage * (kBlockN * kStride * 2);
    const uint32_t v_frag = v_lane + stage * (kBlockN * kStride * 2);

    // ---- S = Q K^T -------------------------------------------------------
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mt][nt][r] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        Ldmatrix4(a[mt], q_frag + 2 * (mt * 16 * kStride + kk * 16));
#pragma unroll
      for (int nt2 = 0; nt2 < kBlockN / 16; ++nt2) {
        uint32_t bf[4];
        Ldmatrix4(bf, k_frag + 2 * (nt2 * 16 * kStride + kk * 16));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>(s[mt][2 * nt2], a[mt], bf[0], bf[1]);
          Mma<T>(s[mt][2 * nt2 + 1], a[mt], bf[2], bf[3]);
        }
      }
    }

    // ---- score transform, mask, online softmax (common/score.cuh, common/softmax.cuh) ------------
    if constexpr (kTerms) {
      if constexpr (kStage) {  // this block's slab: all but the K/V prefetch landed
        CpAsyncWait<1>();
        __syncwarp();
      }
      if (stage_bias)
        AddStagedBias<BiasSlab::kRowBytes>(s, bias_slab, scale, g, t);
      else if (bias.present())
        AddBias<Rows::kQueries>(s, bias, scale, m0 + warp_row0, n * kBlockN, g, t);
      if (mask.HasElementwiseTerms() && cls != kCellFull) {
        SoftCap(s, args.softcap, args.scale_over_cap);
        if (stage_mask)
          MaskFragmentStaged<MaskSlab::kRowBytes>(s, mask, mask_slab, m0 + warp_row0,
                                                  n * kBlockN, g, t, -INFINITY);
        else
          MaskFragmentElementwise<Rows::kQueries>(s, mask, m0 + warp_row0, n * kBlockN, g, t,
                                                  -INFINITY);
      } else {  // no elementwise term, or a full block: the band alone
        TransformAndMask<kBlockM>(s, args.softcap, args.scale_over_cap, mask, m0,
                                  m0 + warp_row0, n * kBlockN, g, t, cls);
      }
      if constexpr (kStage) {  // the warp is done with the slab: the next block's
        __syncwarp();
        if (next < n_end) load_slabs(next);
        CpAsyncCommit();
      }
    } else {
      TransformAndMask<kBlockM>(s, args.softcap, args.scale_over_cap, mask, m0,
                                m0 + warp_row0, n * kBlockN, g, t, cls);
    }
    OnlineSoftmax(s, o, row_m, row_l, scale_log2, rescale_margin);
    if constexpr (kTerms) {
      // Dropout after the softmax: l sums P before it (as every backend);
      // the 1 / (1 - rate) of the kept elements goes into the epilogue.
      if (dropout.enabled) DropoutRows(s, dropout, m0 + warp_row0, n * kBlockN, g, t, 1.f);
    }

    // ---- O += P V (P from registers) -------------------------------------
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        PackA<T>(a[mt], s[mt][2 * ks], s[mt][2 * ks + 1]);
      }
#pragma unroll
      for (int dt2 = 0; dt2 < kHeadDim / 16; ++dt2) {
        uint32_t bf[4];
        Ldmatrix4Trans(bf, v_frag + 2 * (ks * 16 * kStride + dt2 * 16));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>(o[mt][2 * dt2], a[mt], bf[0], bf[1]);
          Mma<T>(o[mt][2 * dt2 + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
  }

  // ---- epilogue: O / l, lse = m + log(l) ---------------------------------
  if constexpr (kTerms) {
    if (dropout.enabled) ScaleFragment(o, static_cast<float>(p.dropout.keep_scale()));
  }
  StoreOutput<T>(p, blk.b, blk.h, m0 + warp_row0, o, row_m, row_l, scale_log2, g, t);
}

// kArch: 80 (sm_80+), or 75 for the Turing family's tiles (compiled for
// compute_75, where copy.cuh and mma.cuh take their sm_75 forms).
template <typename T, int kHeadDim, bool kTerms, int kArch = 80>
cudaError_t LaunchFwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdTraits<kHeadDim, kArch, kTerms>;
  if (params.shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  if (HasScoreTerms(params) != kTerms) return cudaErrorInvalidValue;
  return LaunchFwdGrid<Traits::kBlockM>(FwdKernel<T, Traits, kTerms>, Traits::kThreads,
                                        Traits::SmemBytes(params, kTerms), params, stream);
}

}  // namespace jax_flash::cuda::sm80

// FlashAttention forward for Hopper (sm_90a): the FlashAttention-2 algorithm
// of sm80/fwd.cuh with its two GEMMs on warpgroup MMAs (wgmma.mma_async).
//
// Work partition: one CTA per (query block of 128 rows, q head, batch), two
// warpgroups of 4 warps, each warpgroup 64 query rows; every warp then owns
// 16 rows, as in the sm_80 kernel with one m-tile, so the mask, the online
// softmax (lazy rescale) and the epilogue are the ones it shares with that
// kernel (common/). The kernel is the tile scheduler, the mainloop
// (sm90/mainloop_fwd.cuh) and the epilogue. K/V blocks of kBlockN keys stream
// through a two-stage cp.async pipeline into 128-byte-swizzled shared tiles
// that wgmma reads directly (wgmma.cuh):
//   S = Q K^T: A = Q and B = K from shared memory (both K-major);
//   O += P V:  A = P from registers (the S accumulators, converted to 16
//              bits in place), B = V from shared memory (MN-major).
// A bias comes as TMA-staged tiles (float32 or 16-bit), one key block ahead
// (sm90/bias_tile.cuh, mainloop_fwd.cuh).
// Not (yet) FA3's producer warpgroup with TMA, nor the ping-pong between
// warpgroups: the two warpgroups overlap each other's softmax and GEMMs only
// through the warp scheduler.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/common/dropout.cuh"
#include "cuda/common/epilogue_fwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/bias_tile.cuh"
#include "cuda/sm90/mainloop_fwd.cuh"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.cuh"
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
  static constexpr bool kTma = kTile.tma;
  static constexpr int kWarpRows = 16;
  static constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of O per warp
  static constexpr int kSmemCols = SwizzledCols(kHeadDim);
  static constexpr int kQBytes = kBlockM * kSmemCols * 2;
  static constexpr int kKvBytes = kBlockN * kSmemCols * 2;  // one K or V stage
  // + one swizzle period so that the tiles can start 1024-byte aligned,
  // + the barriers (Q's, one per stage, the bias's).
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKvBytes + kAtomBytes + 8 * (2 + kStages);
  static_assert(kBlockM == 2 * 64 && kThreads == 2 * 128, "two warpgroups of 64 rows");
  static_assert(kHeadDim % 32 == 0, "head dim must be a multiple of 32");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: whole k-steps, one wgmma");
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory of one CTA");
};

// One CTA: its tile from the scheduler, the mainloop over its key blocks,
// the epilogue. Bias: the tile type a bias is read as (BiasTile of float32 or
// T); the kernel runs without a bias too. kDropout: with dropout.
template <typename T, typename Traits, typename Bias, bool kDropout>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FwdKernel(const __grid_constant__ FwdTmaArgs kargs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const FwdArgs& args = kargs.args;
  const ThreadPos pos = ThreadPos::Here();
  // A bias or dense mask broadcast over the batch (heads): that index
  // innermost, so that its tiles come from L2 for all but the first reader.
  const FwdBlock<T> blk = FwdBlock<T>::template Make<Traits::kBlockM, Traits::kBlockN, /*kTileMap=*/true>(
      args.p, QueryBlockScheduler::Get(args.order));
  float o[1][Traits::kDTiles][4], row_m[1][2], row_l[1][2];
  InitFwdState(o, row_m, row_l);
  FwdMainloop<T, Traits, Bias, kDropout>(kargs, blk, pos, o, row_m, row_l);  // K/V blocks -> O, m, l
  if constexpr (kDropout)  // the kept P's 1 / (1 - rate)
    ScaleFragment(o, static_cast<float>(args.p.dropout.keep_scale()));
  StoreOutput<T>(args.p, blk.b, blk.h, blk.m0 + pos.warp * Traits::kWarpRows, o, row_m, row_l,
                 args.scale_log2, pos.g, pos.t);        // out = O / l, lse
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

// cudaErrorNotSupported when TMA cannot address Q, K or V (see
// EncodeRowsTensorMap) or the bias (EncodeBiasTensorMap), or the bias stage
// does not fit the bucket's shared memory or key block (a 16-bit tile's
// boxes are 64 keys), or for a 16-bit bias with dropout (a kernel of its own
// that no one has measured): the caller runs the sm_80 kernel then.
template <typename T, int kHeadDim>
cudaError_t LaunchFwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdSm90Traits<kHeadDim>;
  if (params.shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  FwdTmaArgs kargs;
  kargs.args = MakeFwdArgs(params);
  const AttentionShape& s = params.shape;
  if constexpr (Traits::kTma) {
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    if (!EncodeQkvTensorMaps(params, Traits::kBlockM, Traits::kBlockN, kBf16, &kargs.q_map,
                             &kargs.k_map, &kargs.v_map))
      return cudaErrorNotSupported;
  }
  // The kernel of the bias's element type (float32 also without a bias).
  auto launch = [&](auto bias_elem) {
    using Bias = BiasTile<Traits::kBlockM, Traits::kBlockN, decltype(bias_elem)>;
    const bool has_bias = params.score.bias != nullptr;
    if (has_bias && (!Bias::Fits(Traits::kSmemBytes, 1) ||
                     !EncodeBiasTensorMap(&kargs.bias_map, params.score, s, Traits::kBlockM)))
      return cudaErrorNotSupported;
    auto kernel = FwdKernel<T, Traits, Bias, false>;
    if constexpr (std::is_same_v<decltype(bias_elem), float>) {  // dropout: float tiles only
      if (params.dropout.enabled()) kernel = FwdKernel<T, Traits, Bias, true>;
    }
    return LaunchFwdGrid<Traits::kBlockM>(kernel, Traits::kThreads,
                                          Traits::kSmemBytes + (has_bias ? Bias::kBytes : 0),
                                          params, kargs, stream);
  };
  if (params.score.bias == nullptr || params.score.bias_type == BiasType::kAcc)
    return launch(float{});
  if (params.dropout.enabled()) return cudaErrorNotSupported;
  if constexpr (Traits::kBlockN % 64 == 0) {  // whole 16-bit boxes of 64 keys
    return launch(T{});
  } else {
    return cudaErrorNotSupported;
  }
}

}  // namespace jax_flash::cuda::sm90

// The warp-specialized FlashAttention forward for Hopper (sm_90a), after
// FlashAttention-3: a producer warpgroup loading Q, K and V with TMA into a
// ring of shared-memory stages, two or three consumer warpgroups (64 query
// rows each) running both GEMMs on wgmma with the softmax in between,
// ping-ponged against each other (a ring with three) and overlapping their
// own next S GEMM with this block's softmax (sm90/mainloop_fwd_ws.cuh); a
// persistent grid walking the tiles (sm90/scheduler_persistent.cuh); the
// common epilogue (out = O / l, lse).
//
// Registers: __launch_bounds__(kThreads, 1) caps every thread at 168 with
// two consumer warpgroups (128 with three); setmaxnreg then lowers the
// producer warpgroup's to producer_regs and raises the consumers' to
// consumer_regs (sm90/tile_size.h), so the consumers can hold O, the next S
// and the current P at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/epilogue_fwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/sm90/bias_tile.cuh"
#include "cuda/sm90/epilogue_fwd.cuh"
#include "cuda/sm90/mainloop_fwd_ws.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/scheduler_persistent.cuh"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// kTileOf: the mask mode whose tile the kernel takes, its own unless a light
// mask runs on kBand's tile (causal calls shorter than kLightMinRows, where
// kCausal's own tile is taller). kDropoutTile: FwdWsDropoutTileSize's tile
// instead.
template <int kHeadDim_, FwdWsMask kMask_ = FwdWsMask::kBand, FwdWsMask kTileOf = kMask_,
          bool kDropoutTile = false>
struct FwdWsTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr FwdWsMask kMask = kMask_;
  static constexpr bool kLightMask = IsLightMask(kMask);  // the tile's mask folded to constants
  static constexpr FwdWsTile kTile = kDropoutTile ? FwdWsDropoutTileSize(kHeadDim)
                                                  : FwdWsTileSize(kHeadDim, kTileOf);  // tile_size.h
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kQStages = kTile.q_stages;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kSmemCols = SwizzledCols(kHeadDim);
  static constexpr int kQBytes = kBlockM * kSmemCols * 2;  // one Q stage
  static constexpr int kKvBytes = kBlockN * kSmemCols * 2;  // one K or V stage
  // Q and the K/V ring, + one swizzle period so that the tiles can start
  // 1024-byte aligned (FwdWsSmem adds the bias stages and the barriers).
  static constexpr int kTileBytes = kQStages * kQBytes + 2 * kStages * kKvBytes + kAtomBytes;
  // What setmaxnreg can hand out: the registers that __launch_bounds__(kThreads,
  // 1) gives the CTA (168 x 384); setmaxnreg.inc waits forever for more.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8 * kThreads;
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3,
                "ping-pong of two consumer warpgroups, or a ring of three");
  static_assert(kHeadDim % 32 == 0, "head dim: a multiple of 32 (IssuePV's n64 / n32 pieces)");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "TMA boxes and wgmma N");
  static_assert(kQStages == 1 || kQStages == 2, "Q buffers");
  static_assert(kTile.producer_regs * 128 + kTile.consumer_regs * 128 * kConsumerWarpgroups <=
                    kLaunchRegs, "registers");
};

// Bias: the bias's tile type (BiasTile of 64 rows, one per consumer
// warpgroup), void without a bias. kDropout: with dropout (no bias then).
// The mask: Traits::kMask.
template <typename T, typename Traits, typename Bias, bool kDropout>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    FwdWsKernel(const __grid_constant__ FwdWsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  using Smem = FwdWsSmem<Traits, Bias>;
  const Smem sm = Smem::Carve(SmemAddr(smem_raw));
  const ThreadPos pos = ThreadPos::Here();
  if (pos.tid == 0) sm.Init();
  __syncthreads();  // the barriers are initialized before anyone uses them

  if (pos.warp < 4) {  // producer warpgroup
    SetMaxRegsDec<Traits::kTile.producer_regs>();
    if (pos.warp == 0) FwdWsProducer<T, Traits, Bias>(a, sm, pos.lane);
    return;
  }
  SetMaxRegsInc<Traits::kTile.consumer_regs>();
  const int consumer_warp = pos.warp - 4;
  const PingPong<Traits::kConsumerWarpgroups> ping{consumer_warp / 4};
  RingPos<Traits::kStages> kv;
  RingPos<Traits::kQStages> q;
  ping.Start();
  const TileIndexHandoff<Traits::kConsumerWarpgroups> handoff{sm.tile_index()};
  for (;;) {
    // The producer's next tile, broadcast from lane 0 (every lane read the
    // same slot) so that the compiler knows it, and what follows from it,
    // is warp-uniform: ring positions and tile addresses in uniform registers.
    const int index = __shfl_sync(0xffffffffu, handoff.Take(ping.wg), 0);
    if (index >= a.sched.tiles) break;
    const QueryBlockScheduler::Tile tile = PersistentScheduler::Get(a.sched, index);
    FwdBlock<T> blk =
        FwdBlock<T>::template Make<Traits::kBlockM, Traits::kBlockN, /*kTileMap=*/true>(
            a.args.p, tile, TileRowShift<Traits>(a.args.p));
    constexpr FwdWsMask kMask = Traits::kMask;
    if constexpr (kMask != FwdWsMask::kDense) blk.mask.dense = nullptr;
    if constexpr (Traits::kLightMask) {
      BatchMask& m = blk.mask;
      m.causal = kMask == FwdWsMask::kCausal;
      m.window_left = m.window_right = -1;
      m.q_seg = m.kv_seg = nullptr;
      m.block = m.tile_map = nullptr;
      blk.cells = CellLine{};
    }
    float o[1][Traits::kHeadDim / kMmaN][4], row_m[1][2], row_l[1][2];
    InitFwdState(o, row_m, row_l);
    const bool keyed = blk.n_begin < blk.n_end;
    if (keyed) {
      FwdWsConsumerTile<T, Traits, Bias, kDropout>(a, sm, blk, ping, consumer_warp, pos.lane, pos.g,
                                                   pos.t, kv, q, o, row_m, row_l);
    } else {  // no key to see: the producer completed a Q stage without Q
      MbarrierWait(sm.full_q(q.stage()), q.phase());
      if (pos.lane == 0) ArriveBarrier(sm.empty_q(q.stage()));
      q.Advance();
    }
    if constexpr (kDropout)  // the kept P's 1 / (1 - rate)
      ScaleFragment(o, static_cast<float>(a.args.p.dropout.keep_scale()));
    // out = O / l, lse: staged apart from the rings, staged over V (kOOverV:
    // once every consumer warpgroup has read the tile's last V, and with
    // barrier_o arrived once the store has read it, before the producer's
    // next V load; a tile without keys writes its zeros through the threads
    // and arrives on nothing, so one phase of barrier_o at most is pending),
    // or through the threads. A warpgroup whose rows start before row 0 (a
    // causal kernel's first tile, TileRowShift) stores through the threads
    // too: a TMA store box at a negative row is an illegal instruction
    // (loads at one fill zeros), and with kOOverV it arrives on barrier_o at
    // once, having staged nothing.
    const int64_t wg_m0 = blk.m0 + 64 * ping.wg;
    const bool rows_from_0 = !kTilesFromLastRow<Traits> || wg_m0 >= 0;
    if constexpr (Smem::kOOverV)
      if (keyed)
        NamedBarrierSync(FwdWsBarrierIds<Traits::kConsumerWarpgroups>::kVRead,
                         128 * Traits::kConsumerWarpgroups);
    if ((Smem::kOApart || (Smem::kOOverV && keyed)) && rows_from_0) {
      StoreOutputStaged<T, Traits::kSmemCols, Traits::kConsumerWarpgroups>(
          &a.o_map, a.args.p, blk.b, blk.h, wg_m0, sm.o_tile(ping.wg), ping.wg, consumer_warp % 4,
          pos.lane, o, row_m, row_l, a.args.scale_log2, pos.g, pos.t,
          Smem::kOOverV ? sm.barrier_o() : 0);
    } else {
      StoreOutput<T>(a.args.p, blk.b, blk.h, blk.m0 + consumer_warp * 16, o, row_m, row_l,
                     a.args.scale_log2, pos.g, pos.t);
      if constexpr (Smem::kOOverV)
        if (keyed && consumer_warp % 4 == 0 && pos.lane == 0) ArriveBarrier(sm.barrier_o());
    }
  }
  if constexpr (Smem::kStageO) DrainStagedOutput(consumer_warp % 4, pos.lane);
  ping.Finish();
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

// One kernel's launch: its tile's tensor maps, the persistent scheduler,
// the launch. cudaErrorNotSupported when TMA cannot address Q, K, V or the
// bias (see EncodeRowsTensorMap, EncodeBiasTensorMap), the bias stages do
// not fit, or the tiles do not fit an int: the caller runs the forward
// without warp specialization then.
template <typename T, typename Traits, typename Bias = void, bool kDropout = false>
cudaError_t LaunchFwdWsKernel(const FwdParams& params, void* workspace, cudaStream_t stream) {
  constexpr int kSmemBytes = FwdWsSmem<Traits, Bias>::kBytes;
  // Only a bias's stages may not fit (the caller then runs sm90/fwd.cuh).
  static_assert(!std::is_void_v<Bias> || kSmemBytes <= kMaxSmemBytes, "shared memory per block");
  if constexpr (kSmemBytes > kMaxSmemBytes) {
    return cudaErrorNotSupported;
  } else {
    const AttentionShape& s = params.shape;
    const int64_t m_blocks = CeilDiv(s.seqlen_q, Traits::kBlockM);
    if (m_blocks == 0 || s.num_heads_q == 0 || s.batch == 0) return cudaSuccess;
    FwdWsArgs a;
    a.args = MakeFwdArgs(params);
    if (workspace == nullptr) return cudaErrorInvalidValue;
    a.tile_counter = static_cast<int*>(workspace);
    if (!PersistentScheduler::MakeArgs(m_blocks, s, params.mask.causal, a.args.order,
                                      &a.sched) ||
        s.seqlen_k > INT32_MAX)
      return cudaErrorNotSupported;
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    if (!EncodeQkvTensorMaps(params, Traits::kBlockM, Traits::kBlockN, kBf16, &a.q_map, &a.k_map,
                             &a.v_map))
      return cudaErrorNotSupported;
    // out through TMA where the staging tiles fit (FwdWsSmem::kStageO): its
    // strides are Q's shape's, so where Q's map exists this one does too
    // unless out is laid out otherwise.
    if (!EncodeRowsTensorMap(&a.o_map, params.out, params.out_strides, s.batch, s.seqlen_q,
                             s.num_heads_q, s.head_dim, 64, kBf16))
      return cudaErrorNotSupported;
    if constexpr (!std::is_void_v<Bias>)
      if (!EncodeBiasTensorMap(&a.bias_map, params.score, s, 64)) return cudaErrorNotSupported;
    auto kernel = FwdWsKernel<T, Traits, Bias, kDropout>;
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    if (const cudaError_t zero = PersistentScheduler::ResetCounter(a.tile_counter, stream);
        zero != cudaSuccess)
      return zero;
    kernel<<<PersistentScheduler::Grid(a.sched, SmCount()), Traits::kThreads, kSmemBytes, stream>>>(
        a);
    return cudaGetLastError();
  }
}

// Calls of fewer query rows keep kBand's 128-row tile where the light
// masks' is taller and taller is not faster (H200 timings,
// NOTES_sm90_fwd_light.md): causal calls, whose 192-row tiles cross the diagonal in
// blocks computed whole and masked (a third more work than 128-row tiles at
// S = 1k: 5% slower there, 4-10% faster at 4k and 16k), and calls with
// dropout (non-causal: 7% slower at 1k, 3% / 7% faster at 4k / 16k).
// Tuning hook (tests/gpu/ab_run.sh): -DJAX_FLASH_TUNE_LIGHT_MIN_ROWS=<n>.
#ifdef JAX_FLASH_TUNE_LIGHT_MIN_ROWS
constexpr int64_t kLightMinRows = JAX_FLASH_TUNE_LIGHT_MIN_ROWS;
#else
constexpr int64_t kLightMinRows = 2048;
#endif

// Whether dropout takes a light kEnds tile whose key blocks differ from
// kBand's (D = 256's 128 x 80). Off until timed: tuning hook
// -DJAX_FLASH_TUNE_WS_LIGHT_TILE_DROPOUT=1.
#ifdef JAX_FLASH_TUNE_WS_LIGHT_TILE_DROPOUT
constexpr bool kLightTileDropout = JAX_FLASH_TUNE_WS_LIGHT_TILE_DROPOUT;
#else
constexpr bool kLightTileDropout = false;
#endif

// Whether causal dropout calls from kLightMinRows take the causal light
// kernel on its own tile (D = 64's 192 x 128), counted from the last row.
// Counted from row 0 it was 3% slower at 4k and 2% faster at 16k than
// kBand's (NOTES_sm90_fwd_light.md); off until timed again: tuning hook
// -DJAX_FLASH_TUNE_WS_CAUSAL_LIGHT_DROPOUT=1.
#ifdef JAX_FLASH_TUNE_WS_CAUSAL_LIGHT_DROPOUT
constexpr bool kCausalLightDropout = JAX_FLASH_TUNE_WS_CAUSAL_LIGHT_DROPOUT;
#else
constexpr bool kCausalLightDropout = false;
#endif

// The kernel for a call without bias or dense mask: a light-mask one where
// the bucket has a tile of its own for them (FwdWsTileSize: D = 64 both,
// D = 256 kEnds), the call's mask allows it (LightestMask) and the call is
// long enough where it has to be (kLightMinRows), else kBand's; a causal
// call shorter than that on D = 64 takes the causal light kernel on kBand's
// tile (5% faster at 1k than kBand's kernel, BENCHMARKS.md, twenty-ninth
// session). Where the bucket has no light tile of its own (D = 96, 128,
// 192; D = 256 causal), a light mask without dropout takes the light kernel
// on kBand's tile: 2-4% faster than kBand's kernel at D = 128 (thirtieth
// session), since its mask is MaskEndsFragment's 32-bit compare instead of
// kBand's 64-bit decision per key block. With dropout only D = 64's kEnds:
// the causal light kernel was 3% slower at 4k and 2% faster at 16k; D = 256's
// 80-key tile has not been timed with dropout (kLightTileDropout).
//
// Dropout calls whose mask is the sequences' ends alone (LightestMask kEnds:
// not causal, no window, segments, tile map or block mask) take the bucket's
// dropout tile where it has one (FwdWsDropoutTileSize: D = 128), from
// kLightMinRows query rows (at S = 1k its 192-row tiles would compute 1152
// rows). H200, D = 128, dropout 0.1: non-causal 1-2% faster at 2k, 4-6% at
// 4k-16k (BENCHMARKS.md, thirty-second session). Causal calls take it too,
// their tiles counted from the last row: 2-4% faster than on kBand's tile
// at 2k, 4-7% at 4k, 10% at 16k (thirty-fourth session).
template <typename T, int kHeadDim, bool kDropout>
cudaError_t LaunchFwdWsLightest(const FwdParams& params, void* workspace, cudaStream_t stream) {
  using Band = FwdWsTraits<kHeadDim>;
  const FwdWsMask light = LightestMask(params.mask);
  const bool tall = params.shape.seqlen_q >= kLightMinRows;
  if constexpr (kDropout && FwdWsDropoutTileSize(kHeadDim).block_m > 0) {
    using Dropout = FwdWsTraits<kHeadDim, FwdWsMask::kEnds, FwdWsMask::kBand, true>;
    if (light == FwdWsMask::kEnds && tall)
      return LaunchFwdWsKernel<T, Dropout, void, true>(params, workspace, stream);
    // Causal calls too, their tiles counted from the last row (TileRowShift):
    // counted from row 0, the 192-row tile's partial tile was the longest,
    // and causal calls ran 5-11% slower on it than on kBand's (2k, 4k).
    using CausalDropout = FwdWsTraits<kHeadDim, FwdWsMask::kCausal, FwdWsMask::kBand, true>;
    if (light == FwdWsMask::kCausal && tall)
      return LaunchFwdWsKernel<T, CausalDropout, void, true>(params, workspace, stream);
  }
  using Ends = FwdWsTraits<kHeadDim, FwdWsMask::kEnds>;
  using Causal = FwdWsTraits<kHeadDim, FwdWsMask::kCausal>;
  constexpr auto own_tile = [](auto traits) {
    using Traits = decltype(traits);
    return Traits::kBlockM != Band::kBlockM || Traits::kBlockN != Band::kBlockN;
  };
  if constexpr (own_tile(Ends{}) &&
                (!kDropout || Ends::kBlockN == Band::kBlockN || kLightTileDropout)) {
    if (light == FwdWsMask::kEnds && (tall || !kDropout))
      return LaunchFwdWsKernel<T, Ends, void, kDropout>(params, workspace, stream);
  }
  if constexpr (own_tile(Causal{}) && (!kDropout || kCausalLightDropout)) {
    if (light == FwdWsMask::kCausal && tall)
      return LaunchFwdWsKernel<T, Causal, void, kDropout>(params, workspace, stream);
    // Shorter causal calls without dropout: the causal light kernel on
    // kBand's tile.
    if constexpr (!kDropout) {
      using ShortCausal = FwdWsTraits<kHeadDim, FwdWsMask::kCausal, FwdWsMask::kBand>;
      if (light == FwdWsMask::kCausal)
        return LaunchFwdWsKernel<T, ShortCausal>(params, workspace, stream);
    }
  }
  if constexpr (!kDropout) {
    if constexpr (!own_tile(Ends{}))
      if (light == FwdWsMask::kEnds) return LaunchFwdWsKernel<T, Ends>(params, workspace, stream);
    if constexpr (!own_tile(Causal{}))
      if (light == FwdWsMask::kCausal)
        return LaunchFwdWsKernel<T, Causal>(params, workspace, stream);
  }
  return LaunchFwdWsKernel<T, Band, void, kDropout>(params, workspace, stream);
}

// The kernel for this call (LaunchFwdWsKernel's errors; also
// cudaErrorNotSupported for a bias with dropout, a kernel of its own that no
// one has measured, or a dense mask with a bias or dropout).
// `workspace`: PersistentScheduler::kWorkspaceBytes bytes for the tile
// counter (zeroed here, before the launch).
template <typename T, int kHeadDim>
cudaError_t LaunchFwdWs(const FwdParams& params, void* workspace, cudaStream_t stream) {
  if (params.shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  const bool bias = params.score.bias != nullptr, dropout = params.dropout.enabled();
  if (params.mask.dense != nullptr) {
    if (bias || dropout) return cudaErrorNotSupported;
    return LaunchFwdWsKernel<T, FwdWsTraits<kHeadDim, FwdWsMask::kDense>>(params, workspace,
                                                                           stream);
  }
  if (bias) {
    if (dropout) return cudaErrorNotSupported;
    using Band = FwdWsTraits<kHeadDim>;
    return params.score.bias_type == BiasType::kAcc
               ? LaunchFwdWsKernel<T, Band, BiasTile<64, Band::kBlockN, float>>(params, workspace,
                                                                                 stream)
               : LaunchFwdWsKernel<T, Band, BiasTile<64, Band::kBlockN, T>>(params, workspace,
                                                                             stream);
  }
  return dropout ? LaunchFwdWsLightest<T, kHeadDim, /*kDropout=*/true>(params, workspace, stream)
                 : LaunchFwdWsLightest<T, kHeadDim, /*kDropout=*/false>(params, workspace, stream);
}

}  // namespace jax_flash::cuda::sm90

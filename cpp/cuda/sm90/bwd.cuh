// FlashAttention backward dK/dV and dQ for Hopper (sm_90a): the algorithm
// of sm80/bwd_dkdv.cuh's DkDvKernel with its five GEMMs on warpgroup MMAs
// (wgmma.cuh). The kernel is its tile scheduler (common/tile_scheduler.cuh:
// key blocks outermost), mainloop (sm90/mainloop_bwd.cuh) and epilogues
// (common/epilogue_bwd.cuh for dK and dV, sm90/epilogue_bwd.cuh for dQ).
//
// Work partition: a tile per (block of 128 keys, KV head, batch), two
// warpgroups of 64 keys each; the tile walks (query head of the GQA group,
// block of 64 queries) steps (128 queries at D = 64: FA3's tile there).
// Up to D = 128 the CTAs take their tiles from a counter, one CTA per SM
// (the next tile's loads under this one's dK/dV stores) where every key
// block has the same steps; causal masks and windows, the wide and the
// warp-specialized kernels run a CTA per tile.
//
// dQ leaves through shared memory and the TMA unit's bulk reduce-add into the
// float32 accumulator: warpgroup w adds columns [w D/2, (w+1) D/2) of the
// step's 64 queries (with 128: all columns of queries [64 w, 64 w + 64)),
// summed over all 128 keys of the CTA (so both warpgroups' dS^T must be
// written first: a CTA barrier), as bulk reductions of contiguous ranges
// (DqAccumLayout). That barrier in the middle
// of the step is the only one: the next step's loads are issued right after
// it, and dS^T alternates between two buffers, so a warpgroup goes on into
// the next step while the other still finishes this one.
//
// What each piece was worth (H100, bf16, D = 128, S = 16k, kernel alone,
// TFLOP/s): float atomics of every warpgroup's own keys' full-width dQ 266;
// the column split with one bulk reduction per row 340, per warpgroup and
// step 363 (no dQ output at all: 559); descriptors moved by offsets instead
// of rebuilt per k-step 389; TMA instead of 256 threads' cp.async for Q and
// dO 403; no CTA barrier at the top of the step 474.
//
// Above D = 128 (BwdWideTraits, sm90/mainloop_bwd_wide.cuh) the CTA owns 64
// keys and the warpgroups split the head dim instead of the keys; with dQ
// (the tile's wide_dq) it adds dQ by atomics from registers. The dQ kernel
// (sm90/bwd_dq.cuh) follows the dK/dV kernel without dQ (kDq = false) in the
// deterministic mode and wherever SeparateDq says so.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/bwd/args.h"
#include "cuda/bwd/workspace.h"
#include "cuda/common/dropout.cuh"
#include "cuda/common/epilogue_bwd.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/sm90/bwd_routing.h"
#include "cuda/sm90/bwd_ws.cuh"
#include "cuda/sm90/epilogue_bwd.cuh"
#include "cuda/sm90/mainloop_bwd.cuh"
#include "cuda/sm90/mainloop_bwd_wide.cuh"
#include "cuda/sm90/scheduler_persistent.cuh"
#include "cuda/sm90/tile_size.h"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/math.h"

namespace jax_flash::cuda::sm90 {

// kBlockM_: the bucket's block_m, or its plain_block_m (LaunchDkDv).
// kLightMask_: the call's mask is at most the sequences' ends and causal
// (LaunchDkDv's plain kernel), so the steps test it per element by
// MaskEndsFragmentT (common/score.cuh) instead of the general band path,
// which reads no window, segments or dense mask: only calls LightestMask
// finds kEnds or kCausal may take such a kernel.
template <int kHeadDim_, int kBlockM_ = BwdTileSize(kHeadDim_).block_m, bool kLightMask_ = false>
struct BwdSm90Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BwdTile kTile = BwdTileSize(kHeadDim);  // sm90/tile_size.h
  static constexpr int kBlockN = kTile.block_n;  // keys per CTA: 2 warpgroups x 64
  static constexpr int kBlockM = kBlockM_;       // queries per step
  static constexpr bool kLightMask = kLightMask_;
  static constexpr int kThreads = kTile.threads;
  static constexpr int kStages = kTile.stages;
  static constexpr int kSmemCols = SwizzledCols(kHeadDim);
  static constexpr int kKvBytes = kBlockN * kSmemCols * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kSmemCols * 2;   // one stage of Q or dO
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;   // dS^T ([query][key]: kDqTransposed)
  static constexpr int kDsBuffers = 2;  // step s writes buffer s % 2
  static constexpr int kStatBytes = kBlockM * 4;           // one stage of lse2 or delta
  // Which part of a step's dQ a warpgroup adds. Steps of 64 queries: the
  // column split, warpgroup w all 64 queries x columns [w D/2, (w+1) D/2).
  // Steps of 128 (D = 64, FA3's tile there): the row split, warpgroup w its
  // 64 queries [64 w, 64 w + 64) x every column. Either way summed over the
  // CTA's 128 keys.
  static constexpr bool kDqRowSplit = kBlockM == 128;
  static constexpr int kDqCols = kDqRowSplit ? kHeadDim : DqAccumLayout<kHeadDim>::kHalf;
  // Steps of 80 queries (the plain calls at D = 128; a wgmma's M is 64):
  // the column split computed transposed, dQ^T = K^T dS^T with M = the
  // warpgroup's 64 columns and N = the 80 queries, and dS^T stored
  // [query][key] (80 rows of two 64-key blocks: K-major for dQ^T's B,
  // M-major for dK's A), where [key][query] would take a whole second
  // 64-query block for 16 queries (shared memory does not have it).
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  // Rows of a warpgroup's dQ part (the row split: its 64 queries).
  static constexpr int kDqPartRows = kDqRowSplit ? 64 : kBlockM;
  // One warpgroup's float32 dQ part in shared memory, in the accumulator's
  // order (DqAccumLayout): 64 rows of its column half (column split), or 64
  // rows of each half, half 0 first (row split).
  static constexpr int kDqHalfCols = DqAccumLayout<kHeadDim>::kHalf;
  static constexpr int kDqPartBytes = kBlockM * kDqHalfCols * 4;
  // Byte offsets of the tiles and barriers from the 1024-byte-aligned base
  // (BwdSmem): K, V; Q and dO per stage; dS^T per buffer; each warpgroup's dQ
  // staging; lse2 and D per stage; the full mbarriers, and in the
  // warp-specialized kernel the empty ones and the DqHandoff slots.
  static constexpr int kVOffset = kKvBytes;
  static constexpr int kQOffset = 2 * kKvBytes;
  static constexpr int kDoutOffset = kQOffset + kStages * kQBytes;
  static constexpr int kDsOffset = kDoutOffset + kStages * kQBytes;
  static constexpr int kDqOffset = kDsOffset + kDsBuffers * kDsBytes;
  static constexpr int kLseOffset = kDqOffset + 2 * kDqPartBytes;
  static constexpr int kDeltaOffset = kLseOffset + kStages * kStatBytes;
  static constexpr int kFullOffset = kDeltaOffset + kStages * kStatBytes;
  static constexpr int kEmptyOffset = kFullOffset + kStages * 8;
  static constexpr int kDqSlotOffset = kEmptyOffset + kStages * 8;
  // The persistent kernel's next tile index, two slots (by tile parity).
  static constexpr int kTileSlotOffset = kEmptyOffset;
  static constexpr int kSmemBytes = kTileSlotOffset + 2 * 4 + sm90::kAtomBytes;
  // The warp-specialized kernel (kTile.ws, sm90/bwd_ws.cuh): a producer
  // warpgroup more; an empty barrier per stage and a DqHandoff slot per MMA
  // warpgroup (BwdSmem).
  static constexpr int kWsThreads = kThreads + 128;
  static constexpr int kWsSmemBytes = kDqSlotOffset + 2 * 8 + sm90::kAtomBytes;
  static_assert(kBlockN == 2 * 64 && kThreads == 2 * 128 &&
                    (kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64) ||
                     (kBlockM == 80 && kHeadDim == 128)),
                "two warpgroups of 64 keys, 64 queries per step (128 at D = 64, 80 at 128)");
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128,
                "two warpgroups of 64 keys hold dK and dV up to D = 128 (bwd_wide.cuh above)");
  static_assert(kDqCols % 64 == 0 || kSmemCols == kHeadDim, "a dQ part of whole column blocks");
  static_assert(!kTile.stats_tma ||
                    (2 * kKvBytes + 2 * kStages * kQBytes + kDsBuffers * kDsBytes +
                     2 * kDqPartBytes + kStages * kStatBytes) % 128 == 0,
                "lse2 and D stages 128-byte aligned where TMA loads them");
  static_assert(!kTile.stats_tma || kStatBytes % 128 == 0,
                "every lse2 / D stage 128-byte aligned where TMA loads them (not 80 rows)");
  static_assert(kSmemBytes <= 227 * 1024 && kWsSmemBytes <= 227 * 1024,
                "shared memory of one CTA");
  // dK / dV staged (kTile.dkdv_tma): each warpgroup's 64 keys of dK and of
  // dV, 64 rows x kSmemCols each, over the dS^T buffers and the dQ parts.
  static constexpr int kDkDvTileBytes = 64 * kSmemCols * 2;
  static_assert(!kTile.dkdv_tma || (kLseOffset - kDsOffset >= 4 * kDkDvTileBytes &&
                                    kDsOffset % 1024 == 0 && !kTile.ws),
                "dK / dV staging: four 1024-byte-aligned tiles over dS^T and the dQ parts "
                "(BwdKernel's)");
  static_assert(!(kTile.ws && kTile.rotate_steps),
                "rotated steps: BwdKernel's walk (the ws producer's is not rotated)");
};

// A CTA taking key blocks (one per SM, or one per block: LaunchKeyBlocks):
// the scheduler's order at its blockIdx.x, then each next position not yet
// taken (the tile counter, asked by thread 0 when a tile starts and handed to
// the CTA through a shared slot of the tile's parity: read after the tile's
// end barrier, rewritten two tiles later); each the mainloop over
// its steps (adding dQ as it goes) and the dK/dV epilogue. The next key
// block's K, V and first step load while this one's dK and dV are stored,
// instead of after a CTA exit and launch: at S = 1k (eight steps per key
// block) those per-block costs were about a third of the kernel's time
// (NOTES_sm90_bwd.md).
template <typename T, typename Traits, bool kSoftcap, bool kDq, bool kDropout>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    BwdKernel(const __grid_constant__ BwdTmaArgs tma_args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const ThreadPos pos = ThreadPos::Here();
  const KeyBlockSectionScheduler::Args& sched = tma_args.sched;
  const int tiles = KeyBlockSectionScheduler::Tiles(sched);
  int* const slots = reinterpret_cast<int*>(BwdSmem<Traits>::Floats(
      smem_raw, BwdSmem<Traits>::Of(smem_raw).base + Traits::kTileSlotOffset));
  InitStageBarriers<Traits>(tma_args, pos.tid);
  int index = static_cast<int>(blockIdx.x), step = 0;  // step: the CTA's steps so far
  IssueTileLoads<T, Traits>(tma_args, KeyBlockSectionScheduler::At(sched, index), step, pos.tid);
  float dk[Traits::kHeadDim / kMmaN][4], dv[Traits::kHeadDim / kMmaN][4];
  for (int parity = 0;; parity ^= 1) {
    // The forward's counter protocol (sm90/scheduler_persistent.cuh).
    if (pos.tid == 0) slots[parity] = PersistentScheduler::NextIndex(tma_args.args.tile_counter);
    const KeyBlockScheduler::Tile tile = KeyBlockSectionScheduler::At(sched, index);
    step += BwdMainloop<T, Traits, kSoftcap, kDq, kDropout>(tma_args, tile, pos, dk, dv,
                                                            step);  // steps -> dK, dV (+ dQ)
    // Staged dK / dV go over the dQ parts: their last reductions have read
    // them (each warpgroup's issuer waits before the barrier).
    if constexpr (Traits::kTile.dkdv_tma) WaitDqStagingRead(pos.tid % 128);
    // Both warpgroups are past the last step: K, V and the stages are free,
    // and thread 0's slot is written.
    __syncthreads();
    index = slots[parity];
    if (index < tiles)
      IssueTileLoads<T, Traits>(tma_args, KeyBlockSectionScheduler::At(sched, index), step,
                                pos.tid);
    StoreWarpDkDv<T, Traits, kDropout>(tma_args, tile, pos, dk, dv);
    if (index >= tiles) break;
  }
  if constexpr (kDq || Traits::kTile.dkdv_tma) DrainDqReductions(pos.tid % 128);
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

// Above D = 128, and at D = 128 with a bias: 64 keys per CTA, warpgroup w
// holds the head-dim half w of their dK and dV and computes S^T / dP^T for
// half of a step's 64 queries (sm90/mainloop_bwd_wide.cuh).
template <int kHeadDim_>
struct BwdWideTraits {
  static constexpr int kHeadDim = kHeadDim_;
  // sm90/tile_size.h's above D = 128; at D = 128 (a bias alone) the tile of
  // the wider buckets, since the row of 128 is the other kernel's.
  static constexpr BwdTile kTile =
      kHeadDim > 128 ? BwdTileSize(kHeadDim) : BwdTile{64, 64, 256, 2};
  static constexpr int kBlockN = kTile.block_n;  // keys per CTA
  static constexpr int kBlockM = kTile.block_m;  // queries per step
  static constexpr int kThreads = kTile.threads;
  static constexpr int kStages = kTile.stages;
  static constexpr int kSmemCols = kHeadDim;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one stage of Q or dO
  static constexpr int kPBytes = kBlockN * kBlockM * 2;    // P^T or dS^T, [key][query]
  static constexpr int kPBuffers = 2;  // step s writes buffer s % 2
  static constexpr int kStatBytes = kBlockM * 4;           // one stage of lse2 or delta
  static constexpr int kSmemBytes = 2 * kKvBytes + 2 * kStages * kQBytes +
                                    2 * kPBuffers * kPBytes + 2 * kStages * kStatBytes +
                                    kStages * 8 + kAtomBytes;
  static_assert(kBlockN == 64 && kBlockM == 64 && kThreads == 2 * 128,
                "64 keys, 64 queries per step (32 per warpgroup), two warpgroups");
  static_assert(kHeadDim % 64 == 0 && kHeadDim >= 128, "whole 64-column blocks, from D = 128");
  static_assert(!kTile.stats_tma || (2 * kKvBytes + 2 * kStages * kQBytes +
                                      2 * kPBuffers * kPBytes + kStages * kStatBytes) % 128 == 0,
                "lse2 and D stages 128-byte aligned where TMA loads them");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
  static_assert(!kTile.dkdv_tma, "dK / dV by TMA: BwdKernel's (sm90/tile_size.h)");
};

template <typename T, typename Traits, bool kSoftcap, bool kBias, bool kDropout, bool kDq>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    BwdWideKernel(const __grid_constant__ BwdTmaArgs tma_args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const ThreadPos pos = ThreadPos::Here();
  const KeyBlockScheduler::Tile tile = KeyBlockSectionScheduler::Get(tma_args.sched);
  constexpr int kHalfTiles = Traits::kHeadDim / 16;
  float dk[kHalfTiles][4], dv[kHalfTiles][4];
  BwdWideMainloop<T, Traits, kSoftcap, kBias, kDropout, kDq>(tma_args, tile, pos, dk, dv);
  if constexpr (kDropout) ScaleTiles(dv, tma_args.args.keep_scale);  // dV took the kept P^T, unscaled
  // This warp's 16 keys x its warpgroup's half of the head dim, as pieces.
  using Cols = HalfColumns<Traits::kHeadDim>;
  const Cols cols = Cols::Of(pos.warp / 4);
  const int64_t key0 = tile.n_block * Traits::kBlockN + (pos.warp % 4) * 16;
  const BwdParams& p = tma_args.args.p;
  const float scale = tma_args.args.scale;
  using Full = const float(&)[Cols::kFullTiles][4];
  StoreDkDv<T>(p, tile.b, tile.h_kv, key0, cols.full, reinterpret_cast<Full>(dk[0]),
               reinterpret_cast<Full>(dv[0]), scale, pos.g, pos.t);
  if constexpr (Cols::kPartTiles > 0) {
    using Part = const float(&)[Cols::kPartTiles][4];
    StoreDkDv<T>(p, tile.b, tile.h_kv, key0, cols.part,
                 reinterpret_cast<Part>(dk[Cols::kFullTiles]),
                 reinterpret_cast<Part>(dv[Cols::kFullTiles]), scale, pos.g, pos.t);
  }
#else
  __trap();  // built without sm_90a; the dispatch never launches it then
#endif
}

// Launches a dK/dV kernel over KeyBlockSectionScheduler's tiles, with Q and
// dO through TMA in boxes of Traits::kBlockM rows, kThreads threads and
// kSmemBytes of shared memory (the warp-specialized kernel's are others);
// one CTA per tile; with `takes_tiles` (BwdKernel: its tile counter zeroed
// here) one per SM at most where the key blocks have equal work.
// cudaErrorNotSupported when TMA cannot address them (see
// EncodeRowsTensorMap).
template <typename T, typename Traits, int kThreads = Traits::kThreads,
          int kSmemBytes = Traits::kSmemBytes, typename Kernel>
cudaError_t LaunchKeyBlocks(const BwdArgs& args, Kernel kernel, cudaStream_t stream,
                            bool takes_tiles = false) {
  const AttentionShape& shape = args.p.shape;
  const int64_t n_blocks = CeilDiv(shape.seqlen_k, Traits::kBlockN);
  if (n_blocks == 0) return cudaSuccess;
  BwdTmaArgs tma_args;
  tma_args.args = args;
  if (!KeyBlockSectionScheduler::MakeArgs(n_blocks, Traits::kBlockN, shape, args.p.mask.causal,
                                           &tma_args.sched))
    return cudaErrorInvalidConfiguration;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if (!EncodeRowsTensorMap(&tma_args.q_map, args.p.q, args.p.q_strides, shape.batch,
                           shape.seqlen_q, shape.num_heads_q, shape.head_dim, Traits::kBlockM,
                           kBf16) ||
      !EncodeRowsTensorMap(&tma_args.dout_map, args.p.dout, args.p.dout_strides, shape.batch,
                           shape.seqlen_q, shape.num_heads_q, shape.head_dim, Traits::kBlockM,
                           kBf16))
    return cudaErrorNotSupported;
  if constexpr (Traits::kTile.dkdv_tma) {
    if (!EncodeRowsTensorMap(&tma_args.dk_map, args.p.dk, args.p.dk_strides, shape.batch,
                             shape.seqlen_k, shape.num_heads_kv, shape.head_dim, 64, kBf16) ||
        !EncodeRowsTensorMap(&tma_args.dv_map, args.p.dv, args.p.dv_strides, shape.batch,
                             shape.seqlen_k, shape.num_heads_kv, shape.head_dim, 64, kBf16))
      return cudaErrorNotSupported;
  }
  const int64_t stat_rows = shape.batch * shape.num_heads_q;
  tma_args.stats_by_tma =
      Traits::kTile.stats_tma &&
      EncodeRowStatsTensorMap(&tma_args.lse_map, args.lse2, shape.seqlen_q, stat_rows,
                              Traits::kBlockM) &&
      EncodeRowStatsTensorMap(&tma_args.delta_map, static_cast<const float*>(args.p.delta),
                              shape.seqlen_q, stat_rows, Traits::kBlockM);
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid = KeyBlockSectionScheduler::Grid(tma_args.sched);
  if (takes_tiles) {
    // One CTA per SM where every key block has the same steps; a CTA per
    // key block under a causal mask or a window, where the persistent CTAs
    // were 2-7% slower at D = 128 (H200; NOTES_sm90_bwd.md). Either way the
    // kernel takes its next tiles from the counter.
    const MaskParams& m = args.p.mask;
    if (!m.causal && m.window_left < 0 && m.window_right < 0)
      grid.x = std::min<unsigned>(grid.x, static_cast<unsigned>(SmCount()));
    err = PersistentScheduler::ResetCounter(args.tile_counter, stream);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(tma_args);
  return cudaGetLastError();
}

// dK and dV, and with accumulate_dq (the fast mode) dQ added into the float32
// accumulator; the score terms of BwdTakesTerms (dbias, when wanted, by
// float atomics). cudaErrorNotSupported when TMA cannot address Q or dO, or
// for terms the kernels do not take: the caller runs the sm_80 kernel then.
// cudaErrorInvalidValue for accumulate_dq where SeparateDq (no such kernel).
template <typename T, int kHeadDim>
cudaError_t LaunchDkDv(const BwdArgs& args, bool accumulate_dq, cudaStream_t stream) {
  // (A deterministic dbias is RunBwd's to route: where SeparateDq, the fast
  // mode runs without dQ here too.)
  if (!BwdTakesTerms(args.p, /*deterministic=*/false)) return cudaErrorNotSupported;
  const bool cap = args.softcap > 0.f;
  const bool bias = args.p.score.bias != nullptr;
  const bool dropout = args.p.dropout.enabled();
  // Calls without a mask beyond the sequences' ends (and causal, with
  // plain_causal) and without score terms: the bucket's plain step (80
  // queries at D = 128, sm90/tile_size.h), with dQ.
  constexpr BwdTile kTile = BwdTileSize(kHeadDim);
  constexpr int kPlainBlockM = kTile.plain_block_m;
  if constexpr (kPlainBlockM != 0 && !SeparateDq(kHeadDim, false) && !kTile.ws) {
    using Plain = BwdSm90Traits<kHeadDim, kPlainBlockM, /*kLightMask_=*/true>;
    const FwdWsMask light = LightestMask(args.p.mask);
    if (accumulate_dq && !cap && !bias && !dropout &&
        (light == FwdWsMask::kEnds || (kTile.plain_causal && light == FwdWsMask::kCausal)))
      return LaunchKeyBlocks<T, Plain>(args, BwdKernel<T, Plain, false, true, false>, stream,
                                       /*takes_tiles=*/true);
  }
  // The kernel of (kSoftcap, kBias, kDropout), with and without dQ.
  auto pick = [&](auto make) -> cudaError_t {
    return bias      ? make(std::false_type{}, std::true_type{}, std::false_type{})
           : dropout ? make(std::false_type{}, std::false_type{}, std::true_type{})
           : cap     ? make(std::true_type{}, std::false_type{}, std::false_type{})
                     : make(std::false_type{}, std::false_type{}, std::false_type{});
  };
  return pick([&](auto cap_c, auto bias_c, auto dropout_c) -> cudaError_t {
    constexpr bool kCap = decltype(cap_c)::value, kBias = decltype(bias_c)::value;
    constexpr bool kDrop = decltype(dropout_c)::value;
    if constexpr (kHeadDim > 128 || (kHeadDim == 128 && kBias)) {
      // The wide kernel's structure: above D = 128, and at D = 128 for a bias
      // (a bias variant of the other kernel, whose registers are full,
      // spilled 0.6-1 KB); with dQ where SeparateDq says no.
      using Traits = BwdWideTraits<kHeadDim>;
      if constexpr (SeparateDq(kHeadDim, kBias)) {
        if (accumulate_dq) return cudaErrorInvalidValue;
        return LaunchKeyBlocks<T, Traits>(
            args, BwdWideKernel<T, Traits, kCap, kBias, kDrop, false>, stream);
      } else {
        auto kernel = accumulate_dq ? BwdWideKernel<T, Traits, kCap, kBias, kDrop, true>
                                    : BwdWideKernel<T, Traits, kCap, kBias, kDrop, false>;
        return LaunchKeyBlocks<T, Traits>(args, kernel, stream);
      }
    } else if constexpr (kBias) {
      return cudaErrorNotSupported;  // below D = 128 (BwdTakesTerms said no already)
    } else if constexpr (BwdTileSize(kHeadDim).ws) {  // sm90/bwd_ws.cuh
      using Traits = BwdSm90Traits<kHeadDim>;
      constexpr int kThreads = Traits::kWsThreads, kSmemBytes = Traits::kWsSmemBytes;
      if constexpr (SeparateDq(kHeadDim, false)) {
        if (accumulate_dq) return cudaErrorInvalidValue;
        return LaunchKeyBlocks<T, Traits, kThreads, kSmemBytes>(
            args, BwdWsKernel<T, Traits, kCap, false, kDrop>, stream);
      } else {
        auto kernel = accumulate_dq ? BwdWsKernel<T, Traits, kCap, true, kDrop>
                                    : BwdWsKernel<T, Traits, kCap, false, kDrop>;
        return LaunchKeyBlocks<T, Traits, kThreads, kSmemBytes>(args, kernel, stream);
      }
    } else {
      using Traits = BwdSm90Traits<kHeadDim>;
      if constexpr (SeparateDq(kHeadDim, false)) {
        if (accumulate_dq) return cudaErrorInvalidValue;
        return LaunchKeyBlocks<T, Traits>(args, BwdKernel<T, Traits, kCap, false, kDrop>, stream,
                                          /*takes_tiles=*/true);
      } else {
        auto kernel = accumulate_dq ? BwdKernel<T, Traits, kCap, true, kDrop>
                                    : BwdKernel<T, Traits, kCap, false, kDrop>;
        return LaunchKeyBlocks<T, Traits>(args, kernel, stream, /*takes_tiles=*/true);
      }
    }
  });
}

}  // namespace jax_flash::cuda::sm90

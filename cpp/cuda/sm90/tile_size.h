// Tile shapes of the wgmma kernels (sm_90a), one row per head-dim bucket
// compiled for a direction (jax_flash/_supported.py, CUDA_SM90_FWD_BUCKETS
// and CUDA_SM90_BWD_BUCKETS); measurements and what was tried:
// cpp/cuda/NOTES_sm90_fwd.md and NOTES_sm90_bwd.md. The kernels' traits
// derive the shared-memory layout from these. A bucket without a row gives
// zeros, which the traits' static_asserts reject at compile time.
#pragma once

#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// Forward: query rows per CTA (two warpgroups of 64; every warp then owns 16
// rows, one m-tile of the common fragment code), keys per K/V block, threads,
// K/V stages, and whether Q, K and V come through TMA (one thread issues a
// tile; with cp.async every thread keeps the addresses of its share of the
// next K/V tiles, which at D = 256 alone cost ~80 registers and spilled). O
// takes head_dim / 2 registers per thread and S block_n / 2: above D = 128
// the key block shrinks so that both fit in 255 (FA3's D = 256 tile is
// 128 x 80 too), and Q + the K/V stages in 227 KiB of shared memory.
struct FwdTile {
  int block_m, block_n, threads, stages;
  bool tma;
};

// Backward (dK/dV and the fast mode's dQ): keys per CTA (two warpgroups of
// 64; above D = 128 64 keys, the warpgroups splitting the head dim), queries
// per step (128 at D = 64, FA3's step: dQ split by rows, 5-12% faster than
// 64 on an H200), threads, Q/dO/lse/D stages; and for the up-to-D = 128
// kernel (sm90/mainloop_bwd.cuh), K and V of S^T and dP^T from shared memory
// (from registers they were 1-3% faster with 64-query steps at D = 64, but
// spilled with 128 and at D = 96; taken out, NOTES_sm90_bwd.md):
// - stats_tma: a step's lse2 and D by TMA from one thread rather than
//   cp.async from 128 (4-6% faster at D = 64; at D = 128 within 1%);
// - dk_rs_with_dq: dS^T, dK's A, from registers in the kernel with dQ (the
//   kernels without dQ always do), else from the copy in shared memory that
//   dQ reads anyway (at D = 128 2-4% faster since the mask paths took its
//   spills away; before, 244 B of spill and 1.3-1.45x the time);
//   dk_rs_with_dropout the same with dropout, whose keep bits take registers
//   too (at D = 128 once 176 B of spill and 1.23-1.34x the time of SS; with
//   the unpadded dQ accumulator 4 B and 3-5% faster than SS, H200);
// - ws: the warp-specialized kernel (sm90/bwd_ws.cuh: a producer warp for
//   the loads, a dQ warp for the reductions) instead of BwdKernel; on an
//   H200 3-7% faster than 64-query steps at D = 64 but slower than 128-query
//   ones (with which it spills 112-396 B), 0-3% slower at D = 128;
// - dv_after_ds: the dV GEMM issued after dS^T is in shared memory (FA3's
//   order: the other warpgroup passes the step's barrier sooner) rather
//   than before it: on an H200 3-5% faster at D = 64 (fewer registers live
//   across dS^T's stores), no change at D = 128 (off there);
// - plain_block_m: queries per step of the fast mode's kernel for calls
//   whose mask is the sequences' ends alone (LightestMask kEnds: no causal
//   mask, window, segments, dense or block mask), without soft cap or
//   dropout; 0: block_m. 80 at D = 128 (FA3's step there): a step's fixed
//   costs over 25% more work. Not a multiple of 64, so dQ is computed
//   transposed (dQ^T = K^T dS^T, M = the warpgroup's 64 columns) and dS^T
//   is stored [query][key] (BwdSm90Traits::kDqTransposed);
// - plain_causal: plain_block_m's steps for causal calls too (LightestMask
//   kCausal). On at D = 128 (FA3 keeps 64-query steps there): under load on
//   an H200, 1-5% faster at 4k-16k, up to 4% slower at 1k;
// - wide_dq: above D = 128 (the wide kernel, sm90/mainloop_bwd_wide.cuh), the
//   fast mode adds dQ from the dK/dV kernel, from registers by float2
//   atomics (no shared memory is left there for a staging tile), instead of
//   running the dQ kernel after it (FA3's and cuDNN's structure at D = 256:
//   five GEMMs of a step's size instead of seven). Whole 128-column halves
//   only: on at D = 256, where on an H200 it is 7-13% faster from 2k
//   (dropout 5-9%), the same at 1k;
// - dkdv_tma: BwdKernel writes a tile's dK and dV through staging tiles and
//   TMA stores (FA3's epilogue), over the dS^T buffers and dQ parts, which
//   are free between tiles; else each thread stores its fragments, 32 bits
//   at a time (half of each 32-byte sector per instruction), on the CTA's
//   path between its tiles. Needs the dS^T and dQ staging bytes to hold four
//   64-row tiles (static_assert: D = 64, 96, 128). On at D = 96 and 128:
//   with rotate_steps, on an H200 at D = 128 2-6% faster at 1k-4k, 1-3% at
//   16k (causal and not; dkdv_tma alone 1-4%, rotate_steps alone -2 to +2%;
//   with dropout 1-7%), at D = 96 3-6% at 1k, 1-3% at 4k, about 1% at 16k.
//   Off at D = 64 (5% faster at 1k causal, 1-2% slower at 4k);
// - rotate_steps: in BwdKernel's non-causal calls each key block's walk
//   over the query steps starts at its own place (QuerySteps' kRotate: key
//   block n of N at n / N of the range) and wraps around; else every CTA of
//   a head starts at the first step, and those running side by side (all a
//   head's key blocks, in the section order) add their dQ parts into the
//   same rows at about the same time. Not the warp-specialized kernel. On
//   with dkdv_tma (above; BENCHMARKS.md, thirty-fourth and thirty-fifth
//   sessions).
// NOTES_sm90_bwd.md.
struct BwdTile {
  int block_n, block_m, threads, stages;
  bool stats_tma = false, dk_rs_with_dq = false, dk_rs_with_dropout = false;
  bool ws = false;
  bool dv_after_ds = false;
  int plain_block_m = 0;
  bool plain_causal = false;
  bool wide_dq = false;
  bool dkdv_tma = false;
  bool rotate_steps = false;

  // This tile with one option set, so that the table below names what it
  // sets (C++17 has no designated initializers):
  // BwdTile{128, 64, 256, 2}.With(&BwdTile::wide_dq, true).
  template <typename Field>
  constexpr BwdTile With(Field BwdTile::*field, Field value) const {
    BwdTile t = *this;
    t.*field = value;
    return t;
  }
};

// The warp-specialized forward (sm90/fwd_ws.cuh): query rows per tile (one
// consumer warpgroup per 64), keys per K/V block, K/V stages of the ring,
// registers per thread of the producer warpgroup and of the consumers after
// setmaxnreg (producer_regs * 128 + consumer_regs * block_m * 2 at most the
// CTA's registers at launch, 168 x 384 = 64512 with two consumer warpgroups,
// 128 x 512 with three: FwdWsTraits::kLaunchRegs),
// Q buffers (2: the next tile's Q loads while this tile's last blocks run,
// instead of after its last S GEMM, off the consumers' path at tile starts).
// FA3 uses 128 x 176 at D=128 (128 x 128 causal) and 192 x 192 at D=64.
struct FwdWsTile {
  int block_m, block_n, stages, producer_regs, consumer_regs;
  int q_stages = 1;
};

// The masking a ws forward kernel compiles in (sm90/fwd_ws.cuh):
// - kEnds: only the sequences' ends (no causal, window, lengths, segments,
//   dense or block mask), and kCausal: those and causal. The kernel sets the
//   tile's mask to these constants, so the rest of the band and the tile-map
//   code fold away and the key loop keeps its registers; the blocks on the
//   diagonal and past a sequence's end test their keys. Only where they
//   take a tile of their own (FwdWsTileSize: D = 64 both, D = 256 kEnds)
//   do they run; on kBand's tile they timed level to 3% slower than kBand
//   at D = 128 / 256 (H200, NOTES_sm90_fwd_light.md);
// - kBand: the band (causal, window, lengths), segments and the tile map;
// - kDense: kBand and a dense mask (and its tile map; neither bias nor
//   dropout then); the other instantiations know there is none, which keeps
//   its per-element loads out of their code.
enum class FwdWsMask { kEnds, kCausal, kBand, kDense };

// Whether a kernel of this mask mode folds the tile's mask to constants.
constexpr bool IsLightMask(FwdWsMask mask) {
  return mask == FwdWsMask::kEnds || mask == FwdWsMask::kCausal;
}

// kEnds or kCausal where the call's mask is no more than that, else kBand
// (a dense mask runs kDense: LaunchFwdWs). The ends are the sequences'
// lengths where the call has them: the light kernels keep q_len and kv_len
// at run time, as every kernel does. The backward's plain_block_m follows
// the same rule.
inline FwdWsMask LightestMask(const MaskParams& m) {
  const bool more = m.window_left >= 0 || m.window_right >= 0 || m.q_segment_ids != nullptr ||
                    m.kv_segment_ids != nullptr || m.dense != nullptr || m.block != nullptr ||
                    m.tile_map != nullptr;
  return more ? FwdWsMask::kBand : m.causal ? FwdWsMask::kCausal : FwdWsMask::kEnds;
}

// Deterministic dQ (the forward's structure: S and dP, then dQ += dS K):
// query rows per CTA (two warpgroups of 64), keys per K/V block, threads,
// K/V stages. dQ takes head_dim / 2 registers per thread, S and dP
// block_n / 2 each.
struct DqTile {
  int block_m, block_n, threads, stages;
};

struct Sm90Tiles {
  int head_dim;
  FwdTile fwd;
  BwdTile bwd;
  DqTile dq;
};

// ptxas -v, sm_90a: see NOTES.md.
inline constexpr Sm90Tiles kTiles[] = {
    // head_dim, fwd {BM, BN, threads, stages, TMA}, bwd {BN, BM, threads, stages} and its
    // options, dq {BM, BN, threads, stages}
    {64,
     {128, 128, 256, 2, false},
     BwdTile{128, 128, 256, 2}
         .With(&BwdTile::stats_tma, true)
         .With(&BwdTile::dk_rs_with_dq, true)
         .With(&BwdTile::dk_rs_with_dropout, true)
         .With(&BwdTile::dv_after_ds, true),
     {128, 64, 256, 2}},
    {96,
     {128, 128, 256, 2, true},
     BwdTile{128, 64, 256, 2}
         .With(&BwdTile::dk_rs_with_dq, true)
         .With(&BwdTile::dk_rs_with_dropout, true)
         .With(&BwdTile::dkdv_tma, true)
         .With(&BwdTile::rotate_steps, true),
     {128, 64, 256, 2}},
    {128,
     {128, 128, 256, 2, false},
     BwdTile{128, 64, 256, 2}
         .With(&BwdTile::dk_rs_with_dq, true)
         .With(&BwdTile::dk_rs_with_dropout, true)
         .With(&BwdTile::plain_block_m, 80)
         .With(&BwdTile::plain_causal, true)
         .With(&BwdTile::dkdv_tma, true)
         .With(&BwdTile::rotate_steps, true),
     {128, 64, 256, 2}},
    {192, {128, 96, 256, 2, true}, BwdTile{64, 64, 256, 2}, {128, 64, 256, 2}},
    {256,
     {128, 64, 256, 2, true},
     BwdTile{64, 64, 256, 2}.With(&BwdTile::wide_dq, true),
     {128, 32, 256, 2}},
};

// Tuning hook (tests/gpu/ab_run.sh variants), as sm80/tile_size.h's: with
// -DJAX_FLASH_TUNE_SM90_D=<bucket>, each of
// -DJAX_FLASH_TUNE_SM90_{FWD_BN,FWD_STAGES,FWD_TMA,BWD_BN,BWD_BM,BWD_DK_RS,
// BWD_DK_RS_DROPOUT,BWD_STATS_TMA,BWD_WS,BWD_DV_AFTER_DS,BWD_PLAIN_BM,BWD_PLAIN_CAUSAL,
// BWD_WIDE_DQ,BWD_DKDV_TMA,BWD_ROTATE,DQ_BN}=<n> replaces that field of the bucket's row.
constexpr Sm90Tiles Tuned(Sm90Tiles t) {
#ifdef JAX_FLASH_TUNE_SM90_D
  if (t.head_dim != JAX_FLASH_TUNE_SM90_D) return t;
#ifdef JAX_FLASH_TUNE_SM90_FWD_BN
  t.fwd.block_n = JAX_FLASH_TUNE_SM90_FWD_BN;
#endif
#ifdef JAX_FLASH_TUNE_SM90_FWD_STAGES
  t.fwd.stages = JAX_FLASH_TUNE_SM90_FWD_STAGES;
#endif
#ifdef JAX_FLASH_TUNE_SM90_FWD_TMA
  t.fwd.tma = JAX_FLASH_TUNE_SM90_FWD_TMA;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_BN
  t.bwd.block_n = JAX_FLASH_TUNE_SM90_BWD_BN;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_BM
  t.bwd.block_m = JAX_FLASH_TUNE_SM90_BWD_BM;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_DK_RS
  t.bwd.dk_rs_with_dq = JAX_FLASH_TUNE_SM90_BWD_DK_RS;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_DK_RS_DROPOUT
  t.bwd.dk_rs_with_dropout = JAX_FLASH_TUNE_SM90_BWD_DK_RS_DROPOUT;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_STATS_TMA
  t.bwd.stats_tma = JAX_FLASH_TUNE_SM90_BWD_STATS_TMA;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_WS
  t.bwd.ws = JAX_FLASH_TUNE_SM90_BWD_WS;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_DV_AFTER_DS
  t.bwd.dv_after_ds = JAX_FLASH_TUNE_SM90_BWD_DV_AFTER_DS;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_PLAIN_BM
  t.bwd.plain_block_m = JAX_FLASH_TUNE_SM90_BWD_PLAIN_BM;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_PLAIN_CAUSAL
  t.bwd.plain_causal = JAX_FLASH_TUNE_SM90_BWD_PLAIN_CAUSAL;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_WIDE_DQ
  t.bwd.wide_dq = JAX_FLASH_TUNE_SM90_BWD_WIDE_DQ;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_DKDV_TMA
  t.bwd.dkdv_tma = JAX_FLASH_TUNE_SM90_BWD_DKDV_TMA;
#endif
#ifdef JAX_FLASH_TUNE_SM90_BWD_ROTATE
  t.bwd.rotate_steps = JAX_FLASH_TUNE_SM90_BWD_ROTATE;
#endif
#ifdef JAX_FLASH_TUNE_SM90_DQ_BN
  t.dq.block_n = JAX_FLASH_TUNE_SM90_DQ_BN;
#endif
#endif
  return t;
}

constexpr Sm90Tiles TilesFor(int head_dim) {
  for (const Sm90Tiles& t : kTiles)
    if (t.head_dim == head_dim) return Tuned(t);
  return Sm90Tiles{};
}
constexpr FwdTile FwdTileSize(int head_dim) { return TilesFor(head_dim).fwd; }
constexpr BwdTile BwdTileSize(int head_dim) { return TilesFor(head_dim).bwd; }
constexpr DqTile DqTileSize(int head_dim) { return TilesFor(head_dim).dq; }

// Tuning hook (tests/gpu/ab_run.sh variants): with -DJAX_FLASH_TUNE_D=<bucket>,
// -DJAX_FLASH_TUNE_WS_STAGES=<n>, -DJAX_FLASH_TUNE_WS_BN=<64 or 128>,
// -DJAX_FLASH_TUNE_WS_QSTAGES=<1 or 2>, -DJAX_FLASH_TUNE_WS_BM=<128 or 192>
// (two or three consumer warpgroups), -DJAX_FLASH_TUNE_WS_PRODUCER_REGS=<n>
// and -DJAX_FLASH_TUNE_WS_CONSUMER_REGS=<n> replace that field of the
// bucket's warp-specialized forward tile, kBand's (three consumer
// warpgroups: 512 threads, 128 registers each at launch, so 24 and 160 at
// most).
// At D = 64 the light masks (kEnds, kCausal) take FA3's 192-row tile: three
// consumer warpgroups, whose 160 registers hold their key loop without a
// spill once the mask's code is folded away (kBand's spills 316 B there;
// NOTES_sm90_fwd_light.md). At D = 256 kEnds takes FA3's 128 x 80 tile (its
// shared memory's limit: 226 KB; 2-7% faster than kBand's 128 x 64). FA3's
// 128 x 176 at D = 128 was 3-12% slower than kBand's 128 x 128 at 1k-4k (H200,
// NOTES_sm90_fwd_light.md). Tile maps and block masks only meet kBand's tiles.
constexpr FwdWsTile FwdWsTileSize(int head_dim, FwdWsMask mask = FwdWsMask::kBand) {
  // The light tiles, sized to their registers and shared memory: the hooks
  // below tune kBand's tiles alone.
  if (head_dim <= 64 && IsLightMask(mask)) return FwdWsTile{192, 128, 4, 24, 160};
  if (head_dim == 256 && mask == FwdWsMask::kEnds) return FwdWsTile{128, 80, 2, 24, 240};
  FwdWsTile t = head_dim <= 64    ? FwdWsTile{128, 128, 4, 24, 240}
                : head_dim <= 128 ? FwdWsTile{128, 128, 2, 24, 240}
                                  : FwdWsTile{128, 64, 2, 24, 240};
#ifdef JAX_FLASH_TUNE_D
  if (head_dim != JAX_FLASH_TUNE_D) return t;
#ifdef JAX_FLASH_TUNE_WS_STAGES
  t.stages = JAX_FLASH_TUNE_WS_STAGES;
#endif
#ifdef JAX_FLASH_TUNE_WS_BN
  t.block_n = JAX_FLASH_TUNE_WS_BN;
#endif
#ifdef JAX_FLASH_TUNE_WS_QSTAGES
  t.q_stages = JAX_FLASH_TUNE_WS_QSTAGES;
#endif
#ifdef JAX_FLASH_TUNE_WS_BM
  t.block_m = JAX_FLASH_TUNE_WS_BM;
#endif
#ifdef JAX_FLASH_TUNE_WS_PRODUCER_REGS
  t.producer_regs = JAX_FLASH_TUNE_WS_PRODUCER_REGS;
#endif
#ifdef JAX_FLASH_TUNE_WS_CONSUMER_REGS
  t.consumer_regs = JAX_FLASH_TUNE_WS_CONSUMER_REGS;
#endif
#endif
  return t;
}

// The ws forward's tile for non-causal dropout calls whose mask is the
// sequences' ends alone (LightestMask kEnds; no tile map or block mask, whose
// cells a 192-row tile would straddle) where it is not kBand's; zeros
// elsewhere. At D = 128 three consumer warpgroups over 64-key
// blocks (FA3's 192-row shape, as D = 64's light tile): a key block's Philox
// draws are latency-bound there (issue slots 37% busy, NOTES_score_terms.md),
// so a third warpgroup's softmax and draws can run while the other two's
// GEMMs do. 160 registers hold its key loop (ptxas: 12 B of spill outside
// it; 128-key blocks spill 568 B); four stages of 64 keys keep the ring as
// deep in keys as kBand's two of 128.
constexpr FwdWsTile FwdWsDropoutTileSize(int head_dim) {
  return head_dim == 128 ? FwdWsTile{192, 64, 4, 24, 160} : FwdWsTile{};
}

// Whether every block of every sm90 kernel of this bucket lies inside one
// cell of kCell x kCell positions (the tile map's and the block mask's,
// mask.h): a block-sparse mask reaches these kernels through the tile map
// only then (cuda/dispatch.cu), since they skip its empty cells but test no
// cell inside a block. (The ws forward's light-mask and dropout tiles never
// see a map.)
constexpr bool TilesInCells(int head_dim, int cell) {
  auto in = [cell](int n) { return n > 0 && cell % n == 0; };
  const Sm90Tiles t = TilesFor(head_dim);
  const FwdWsTile w = FwdWsTileSize(head_dim);
  return in(t.fwd.block_m) && in(t.fwd.block_n) && in(w.block_m) && in(w.block_n) &&
         in(t.bwd.block_n) && in(t.bwd.block_m) && in(t.dq.block_m) && in(t.dq.block_n);
}

}  // namespace jax_flash::cuda::sm90

// Tile shapes of the mma.sync kernels, one row per head-dim bucket
// (jax_flash/_supported.py, CUDA_HEAD_DIM_BUCKETS; measurements and what was
// tried: cpp/cuda/NOTES.md). The kernels' traits derive everything else
// (warps, fragments, shared memory) from these.
#pragma once

#include "jax_flash/mask.h"

namespace jax_flash::cuda::sm80 {

// Forward: query rows per CTA, keys per K/V block, warps (each owns block_m /
// warps rows: 16 per m-tile, two m-tiles where registers allow, halving the
// shared-memory traffic of K and V per MMA), CTAs per SM the register
// allocation must allow (__launch_bounds__).
struct FwdTile {
  int block_m, block_n, warps, min_blocks;
};

// dK/dV kernel: keys per CTA (16 per warp), queries per step, and head-dim
// passes (registers hold dK and dV for 16 keys x head_dim / d_split columns;
// above 128 that would not fit, so the kernel makes d_split passes over the
// query blocks, recomputing S and dP).
struct BwdTile {
  int block_n, block_m, d_split;
};

// Deterministic dQ kernel: the forward's structure, query rows per CTA (16
// per warp), keys per block, warps.
struct DqTile {
  int block_m, block_n, warps;
};

struct Tiles {
  int head_dim;
  FwdTile fwd;
  BwdTile bwd;
  DqTile dq;
};

// ptxas -v, sm_90a: no spills but the backward's at 96 and above (NOTES.md).
inline constexpr Tiles kTiles[] = {
    // head_dim, fwd {BM, BN, warps, min CTAs}, bwd {BN, BM, d_split}, dq {BM, BN, warps}
    {32, {128, 64, 4, 1}, {128, 64, 1}, {64, 64, 4}},
    {64, {128, 64, 4, 1}, {128, 64, 1}, {64, 64, 4}},
    {96, {128, 64, 8, 1}, {128, 64, 1}, {64, 64, 4}},
    {128, {128, 32, 4, 1}, {128, 32, 1}, {64, 64, 4}},
    {192, {64, 32, 4, 1}, {64, 32, 2}, {64, 32, 4}},
    {256, {64, 32, 4, 1}, {64, 32, 4}, {64, 32, 4}},
};

// The Turing family (sm_75: these kernels compiled for compute_75): 64 KiB
// of shared memory per CTA at most, so smaller tiles; the traits'
// static_asserts check each row against kMaxSmemBytes. Rows chosen so every
// tile divides evenly among its threads' 16-byte copies (NOTES.md).
inline constexpr Tiles kTuringTiles[] = {
    // head_dim, fwd {BM, BN, warps, min CTAs}, bwd {BN, BM, d_split}, dq {BM, BN, warps}
    {32, {128, 64, 4, 1}, {64, 64, 1}, {64, 64, 4}},
    {64, {128, 64, 4, 1}, {64, 32, 1}, {64, 64, 4}},
    {96, {64, 32, 4, 1}, {64, 32, 1}, {64, 32, 4}},
    {128, {64, 32, 4, 1}, {64, 16, 1}, {32, 32, 2}},
    {192, {64, 16, 4, 1}, {32, 16, 2}, {32, 16, 2}},
    {256, {32, 16, 2, 1}, {16, 16, 4}, {16, 16, 1}},
};

// Dynamic shared memory one CTA may use: 64 KiB on sm_75, 163 KiB on sm_80
// (A100; Hopper has 227). sm_86 and sm_89 allow 99 KiB, which the larger
// sm80 tiles exceed: their launches fail there (cpp/cuda/NOTES.md).
constexpr int MaxSmemBytes(int arch) { return arch < 80 ? 64 * 1024 : 163 * 1024; }

// Tuning hook (tests/gpu/ab_run.sh variants): with -DJAX_FLASH_TUNE_D=<bucket>,
// each of -DJAX_FLASH_TUNE_{FWD_BM,FWD_BN,FWD_WARPS,FWD_MINB,BWD_BN,BWD_BM}=<n>
// replaces that field of the bucket's row. (Separate scalar macros: nvcc
// splits a -D value at its commas.)
constexpr Tiles Tuned(Tiles t) {
#ifdef JAX_FLASH_TUNE_D
  if (t.head_dim != JAX_FLASH_TUNE_D) return t;
#ifdef JAX_FLASH_TUNE_FWD_BM
  t.fwd.block_m = JAX_FLASH_TUNE_FWD_BM;
#endif
#ifdef JAX_FLASH_TUNE_FWD_BN
  t.fwd.block_n = JAX_FLASH_TUNE_FWD_BN;
#endif
#ifdef JAX_FLASH_TUNE_FWD_WARPS
  t.fwd.warps = JAX_FLASH_TUNE_FWD_WARPS;
#endif
#ifdef JAX_FLASH_TUNE_FWD_MINB
  t.fwd.min_blocks = JAX_FLASH_TUNE_FWD_MINB;
#endif
#ifdef JAX_FLASH_TUNE_BWD_BN
  t.bwd.block_n = JAX_FLASH_TUNE_BWD_BN;
#endif
#ifdef JAX_FLASH_TUNE_BWD_BM
  t.bwd.block_m = JAX_FLASH_TUNE_BWD_BM;
#endif
#endif
  return t;
}

// The row of a compiled bucket for arch path 80 (mma.sync, sm_80+) or 75
// (Turing); a head dim without a row gives zeros, which the traits'
// static_asserts reject at compile time.
constexpr Tiles TilesFor(int head_dim, int arch = 80) {
  if (arch < 80) {
    for (const Tiles& t : kTuringTiles)
      if (t.head_dim == head_dim) return Tuned(t);
    return Tiles{};
  }
  for (const Tiles& t : kTiles)
    if (t.head_dim == head_dim) return Tuned(t);
  return Tiles{};
}

// The forward-mode derivative (sm80/jvp.cuh): query rows per CTA (16 per
// warp), keys per block, and pipeline stages, each holding K, K_dot, V and
// V_dot (one stage where two would not fit an A100's 163 KiB).
// The forward's tile; with score terms (the kTerms kernels) on sm_80+,
// warps of one m-tile (16 rows): the bias and mask slabs, their addresses
// and the terms' views spilled next to two m-tiles' O and S (ptxas -v:
// D=64 472 bytes, D=128 284; cpp/cuda/NOTES.md).
constexpr FwdTile FwdTileFor(int head_dim, int arch, bool terms) {
  FwdTile t = TilesFor(head_dim, arch).fwd;
  if (terms && arch >= 80 && t.block_m / t.warps > 16) t.block_m = 16 * t.warps;
#ifdef JAX_FLASH_TUNE_TERMS_MINB
  if (terms && arch >= 80) t.min_blocks = JAX_FLASH_TUNE_TERMS_MINB;
#endif
  return t;
}

struct JvpTile {
  int head_dim, block_m, block_n, stages;
};

inline constexpr JvpTile kJvpTiles[] = {
    {32, 64, 64, 2}, {64, 64, 32, 2}, {96, 64, 32, 2},
    {128, 64, 32, 2}, {192, 64, 16, 2}, {256, 64, 16, 2},
};

// The Turing family's (64 KiB per CTA; every copy dividing evenly among the
// threads): two stages where they fit, else one (and fewer rows above 128).
// Shared memory 2 x (2 BM + 4 BN stages) x (D + 8) bytes: 51200, 55296,
// 53248, 52224, 51200, 50688.
inline constexpr JvpTile kTuringJvpTiles[] = {
    {32, 64, 64, 2}, {64, 64, 32, 2}, {96, 64, 32, 1},
    {128, 64, 16, 1}, {192, 32, 16, 1}, {256, 16, 16, 1},
};

// The row of a compiled bucket for arch path 80 or 75; zeros (rejected by
// JvpTraits' static_asserts) for any other head dim.
constexpr JvpTile JvpTileFor(int head_dim, int arch = 80) {
  if (arch < 80) {
    for (const JvpTile& t : kTuringJvpTiles)
      if (t.head_dim == head_dim) return t;
    return JvpTile{};
  }
  for (const JvpTile& t : kJvpTiles)
    if (t.head_dim == head_dim) return t;
  return JvpTile{};
}

// Every tile of every kernel lies in one cell of the tile map
// (kBlockMaskBlock positions a side), so that the kTerms kernels, which skip
// the cells it leaves empty, apply a block mask folded into it exactly
// (cuda/dispatch.cu, TileMapHoldsBlockMask).
constexpr bool EveryTileInOneCell() {
  auto in = [](int n) { return n > 0 && kBlockMaskBlock % n == 0; };
  const int archs[] = {75, 80};
  for (int arch : archs)
    for (const Tiles& row : kTiles) {
      const Tiles t = TilesFor(row.head_dim, arch);
      const FwdTile f = FwdTileFor(row.head_dim, arch, /*terms=*/true);
      const JvpTile j = JvpTileFor(row.head_dim, arch);
      if (!in(f.block_m) || !in(f.block_n) || !in(t.bwd.block_n) || !in(t.bwd.block_m) ||
          !in(t.dq.block_m) || !in(t.dq.block_n) || !in(j.block_m) || !in(j.block_n))
        return false;
    }
  return true;
}
static_assert(EveryTileInOneCell(), "an mma.sync tile straddles cells of the tile map");

}  // namespace jax_flash::cuda::sm80

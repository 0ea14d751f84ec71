// Tile shapes of the wgmma kernels (sm_90a). One shape per direction for
// every bucket compiled for it (jax_flash/_supported.py,
// CUDA_SM90_FWD_BUCKETS and CUDA_SM90_BWD_BUCKETS); measurements and what
// was tried: cpp/cuda/NOTES.md. The kernels' traits derive the shared-memory
// layout from these.
#pragma once

namespace jax_flash::cuda::sm90 {

// Forward: query rows per CTA (two warpgroups of 64; every warp then owns 16
// rows, one m-tile of the common fragment code), keys per K/V block, threads,
// K/V stages.
struct FwdTile {
  int block_m, block_n, threads, stages;
};

// Backward (dK/dV and the fast mode's dQ): keys per CTA (two warpgroups of
// 64), queries per step, threads, Q/dO/lse/D stages.
struct BwdTile {
  int block_n, block_m, threads, stages;
};

// The warp-specialized forward (sm90/fwd_ws.cuh): query rows per tile (one
// consumer warpgroup per 64), keys per K/V block, K/V stages of the ring,
// registers per thread of the producer warpgroup and of the consumers after
// setmaxnreg (producer_regs * 128 + consumer_regs * block_m * 2 <= 65536),
// Q buffers (2: the next tile's Q loads while this tile's last blocks run,
// instead of after its last S GEMM, off the consumers' path at tile starts).
// FA3 uses 128 x 176 at D=128 (128 x 128 causal) and 192 x 192 at D=64.
struct FwdWsTile {
  int block_m, block_n, stages, producer_regs, consumer_regs;
  int q_stages = 1;
};

constexpr FwdTile FwdTileSize(int /*head_dim*/) { return FwdTile{128, 128, 256, 2}; }
// Tuning hook (tests/gpu/fwd_ws_run.sh): with -DJAX_FLASH_TUNE_D=<bucket>,
// -DJAX_FLASH_TUNE_WS_STAGES=<n>, -DJAX_FLASH_TUNE_WS_BN=<64, 128 or 176>
// and -DJAX_FLASH_TUNE_WS_QSTAGES=<1 or 2> replace that field of the
// bucket's warp-specialized forward tile.
constexpr FwdWsTile FwdWsTileSize(int head_dim) {
  FwdWsTile t = head_dim <= 64 ? FwdWsTile{128, 128, 4, 24, 240} : FwdWsTile{128, 128, 2, 24, 240};
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
#endif
  return t;
}
constexpr BwdTile BwdTileSize(int /*head_dim*/) { return BwdTile{128, 64, 256, 2}; }

}  // namespace jax_flash::cuda::sm90

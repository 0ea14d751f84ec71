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

constexpr FwdTile FwdTileSize(int /*head_dim*/) { return FwdTile{128, 128, 256, 2}; }
constexpr BwdTile BwdTileSize(int /*head_dim*/) { return BwdTile{128, 64, 256, 2}; }

}  // namespace jax_flash::cuda::sm90

// Tile sizes of the exact (SIMT) kernels, per accumulation type and head-dim
// tier.
//
// Head dims are compiled in tiers (jax_flash/_supported.py,
// CUDA_EXACT_HEAD_DIM_TIERS; a head dim is zero-padded up to its tier inside
// shared memory): the accumulators of a (rows x kMaxD) tile live in
// registers, so the tier bounds register use. Shared-memory tiles are stored
// in the accumulation type with a row stride of kMaxD + 1 (odd), so that
// threads reading the same column of consecutive rows hit different banks.
#pragma once

#include <cstdint>

#include "jax_flash/mask.h"
#include "jax_flash/supported.h"

namespace jax_flash::cuda::simt {

// The smallest tier that holds head_dim, or 0 if none does.
inline int HeadDimTier(int64_t head_dim) {
#define JAX_FLASH_TIER(D) \
  if (head_dim <= (D)) return (D);
  JAX_FLASH_FOR_EACH_EXACT_TIER(JAX_FLASH_TIER)
#undef JAX_FLASH_TIER
  return 0;
}

// Query rows (kBlockM) and keys (kBlockN) per block: forward, backward, JVP.
// Chosen so that shared memory stays under kMaxSharedBytes (simt/common.cuh)
// and each thread holds at most 64 accumulator registers' worth of output
// tile.
template <typename Acc, int kMaxD>
struct ExactTiles {
  static constexpr bool kF64 = sizeof(Acc) == 8;
  static constexpr int kFwdBlockM = kF64 ? (kMaxD <= 128 ? 32 : 16) : (kMaxD <= 128 ? 64 : 32);
  static constexpr int kFwdBlockN = kF64 ? (kMaxD <= 64 ? 32 : kMaxD <= 128 ? 16 : 8)
                                         : (kMaxD <= 64 ? 64 : kMaxD <= 128 ? 32 : 16);
  static constexpr int kBwdBlockM = kF64 ? (kMaxD <= 64 ? 32 : kMaxD <= 128 ? 16 : 8)
                                         : (kMaxD <= 32 ? 64 : kMaxD <= 64 ? 64 : kMaxD <= 128 ? 32 : 16);
  static constexpr int kBwdBlockN = kF64 ? (kMaxD <= 64 ? 32 : kMaxD <= 128 ? 16 : 8)
                                         : (kMaxD <= 32 ? 64 : kMaxD <= 64 ? 32 : kMaxD <= 128 ? 32 : 16);
  // The JVP holds Q, Q_dot and four key-side tiles (K, K_dot, V, V_dot).
  static constexpr int kJvpBlockM = kF64 ? (kMaxD <= 64 ? 32 : kMaxD <= 128 ? 16 : 8)
                                         : (kMaxD <= 64 ? 64 : kMaxD <= 128 ? 32 : 16);
  static constexpr int kJvpBlockN = kF64 ? (kMaxD <= 32 ? 32 : kMaxD <= 64 ? 16 : 8)
                                         : (kMaxD <= 32 ? 64 : kMaxD <= 64 ? 32 : 16);
  static constexpr int kLd = kMaxD + 1;  // row stride of a head-dim tile
  // Tiles never straddle two cells of the block-sparse mask (mask.h), so a
  // hidden cell's tiles are skipped whole.
  static_assert(kBlockMaskBlock % kFwdBlockM == 0 && kBlockMaskBlock % kFwdBlockN == 0 &&
                    kBlockMaskBlock % kBwdBlockM == 0 && kBlockMaskBlock % kBwdBlockN == 0 &&
                    kBlockMaskBlock % kJvpBlockM == 0 && kBlockMaskBlock % kJvpBlockN == 0,
                "exact-kernel tiles must divide the block mask's cells");
};

}  // namespace jax_flash::cuda::simt

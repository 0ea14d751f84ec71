// Which tile a CTA computes, and the grid that covers the tiles: the blockIdx
// mapping of every tensor-core kernel in one place. A persistent or
// warp-specialized kernel replaces a scheduler here, not its mainloop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Which index of a query-block grid varies fastest. A bias or dense mask
// that broadcasts over the batch (or the heads) is read by every batch's
// (head's) CTA of a query block: with that index innermost those CTAs run
// side by side and read each tile once from DRAM, the rest from L2.
enum class TileOrder : int {
  kQueryBlocksInner,  // query blocks, then heads, then batch (no shared term)
  kBatchInner,        // batch, then query blocks, then heads
  kHeadsInner,        // heads, then query blocks, then batch
};

// The order for a forward's score terms: the bias's broadcast decides (its
// float32 tiles are the larger reads), else the dense mask's.
inline TileOrder TermsTileOrder(const FwdParams& p) {
  auto order = [&](const DenseStrides& s) {
    if (p.shape.batch > 1 && s.batch == 0) return TileOrder::kBatchInner;
    if (p.shape.num_heads_q > 1 && s.head == 0) return TileOrder::kHeadsInner;
    return TileOrder::kQueryBlocksInner;
  };
  if (p.score.bias != nullptr) return order(p.score.bias_strides);
  if (p.mask.dense != nullptr) return order(p.mask.dense_strides);
  return TileOrder::kQueryBlocksInner;
}

// Blocks of query rows of one (query head, batch): the forwards and the
// deterministic dQ kernel. Grid (query blocks, q heads, batch); the last
// query blocks run first: with causal masking they see the most keys, so
// scheduling them first shortens the tail.
struct QueryBlockScheduler {
  struct Tile {
    int64_t m_block, h, b;
  };
  // Grid dimensions y and z: q heads and batch, at most 65535 each (the
  // dispatch checks it).
  static dim3 Grid(int64_t m_blocks, const AttentionShape& shape) {
    return dim3(static_cast<unsigned>(m_blocks), static_cast<unsigned>(shape.num_heads_q),
                static_cast<unsigned>(shape.batch));
  }
  __device__ __forceinline__ static Tile Get() {
    Tile tile;
    tile.m_block = gridDim.x - 1 - blockIdx.x;
    tile.h = blockIdx.y;
    tile.b = blockIdx.z;
    return tile;
  }
  // The same grid's tiles in `order` (the launch order of CTAs follows their
  // linear index, x fastest).
  __device__ __forceinline__ static Tile Get(TileOrder order) {
    if (order == TileOrder::kQueryBlocksInner) return Get();
    const int64_t m_blocks = gridDim.x, heads = gridDim.y, batch = gridDim.z;
    const int64_t linear = blockIdx.x + m_blocks * (blockIdx.y + heads * int64_t{blockIdx.z});
    const int64_t inner = order == TileOrder::kBatchInner ? batch : heads;
    const int64_t rest = linear / inner;
    Tile tile;
    tile.m_block = m_blocks - 1 - rest % m_blocks;
    if (order == TileOrder::kBatchInner) {
      tile.b = linear % inner;
      tile.h = rest / m_blocks;
    } else {
      tile.h = linear % inner;
      tile.b = rest / m_blocks;
    }
    return tile;
  }
};

// Blocks of keys of one (kv head, batch): the mma.sync dK/dV kernel.
// Grid (key blocks, kv heads, batch).
struct KeyBlockScheduler {
  struct Tile {
    int64_t n_block, h_kv, b;
  };
  static dim3 Grid(int64_t n_blocks, const AttentionShape& shape) {
    return dim3(static_cast<unsigned>(n_blocks), static_cast<unsigned>(shape.num_heads_kv),
                static_cast<unsigned>(shape.batch));
  }
  __device__ __forceinline__ static Tile Get() {
    Tile tile;
    tile.n_block = blockIdx.x;
    tile.h_kv = blockIdx.y;
    tile.b = blockIdx.z;
    return tile;
  }
};

// Blocks of keys with the key blocks outermost: the Hopper dK/dV kernel.
// Grid (kv heads, batch, key blocks): every head's block n launches before
// any block n + 1; with a causal mask the first key blocks have the most
// query blocks to visit, which leaves the short ones for the tail (H100,
// causal, S=4k: D=128 242 -> 291 TFLOP/s, D=64 218 -> 243; no change without
// a mask). Key blocks are then limited to 65535 (grid z).
struct KeyBlockOutermostScheduler {
  using Tile = KeyBlockScheduler::Tile;
  static constexpr int64_t kMaxBlocks = 65535;
  static dim3 Grid(int64_t n_blocks, const AttentionShape& shape) {
    return dim3(static_cast<unsigned>(shape.num_heads_kv), static_cast<unsigned>(shape.batch),
                static_cast<unsigned>(n_blocks));
  }
  __device__ __forceinline__ static Tile Get() {
    Tile tile;
    tile.h_kv = blockIdx.x;
    tile.b = blockIdx.y;
    tile.n_block = blockIdx.z;
    return tile;
  }
};

}  // namespace jax_flash::cuda

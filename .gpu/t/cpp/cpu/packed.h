// Whole tensors converted once per call into the tile layouts that the tile
// products read, in the accumulation type.
//
// Without this, every (query block, key block) pair would convert and
// transpose its key and value tiles again: Sq / kBlockM times per key tile.
// Packing once costs one extra accumulation-type copy of each packed tensor,
// O(S * D) memory, never O(Sq * Sk).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/tile.h"

namespace jax_flash::cpu {

enum class TileLayout {
  kRows,        // tile[r][c], r < block, c < Dp: rows of the tensor
  kTransposed,  // tile[c][r], c < D, r < block: for products with X^T
};

// A (batch, seq, heads, head_dim) tensor cut into tiles of `block` rows per
// (batch, head), each tile contiguous and zero-padded.
template <typename A>
class PackedTensor {
 public:
  // Empty: stands for an absent (zero) tensor that is never read.
  PackedTensor() : heads_(0), num_blocks_(0), tile_elems_(0) {}

  template <typename T>
  PackedTensor(const T* src, const SeqStrides& strides, int64_t batch, int64_t seqlen,
               int64_t heads, int64_t head_dim, int64_t block, TileLayout layout,
               const ParallelFor& parallel_for)
      : heads_(heads), num_blocks_((seqlen + block - 1) / block),
        tile_elems_(layout == TileLayout::kRows ? block * PaddedHeadDim<A>(head_dim)
                                                : head_dim * block),
        data_(static_cast<size_t>(batch * heads * num_blocks_ * tile_elems_)) {
    const int64_t Dp = PaddedHeadDim<A>(head_dim);
    parallel_for(batch * heads * num_blocks_, [&](int64_t index) {
      const int64_t blk = index % num_blocks_;
      const int64_t h = index / num_blocks_ % heads;
      const int64_t b = index / (num_blocks_ * heads);
      const int64_t row0 = blk * block;
      const int64_t rows = std::min(block, seqlen - row0);
      A* tile = Tile(b, h, blk);
      if (layout == TileLayout::kRows)
        PackRows(src, strides, b, h, row0, rows, block, head_dim, tile, Dp);
      else
        PackColumns(src, strides, b, h, row0, rows, head_dim, tile, block);
    });
  }

  const A* Tile(int64_t b, int64_t h, int64_t blk) const {
    return data_.data() + ((b * heads_ + h) * num_blocks_ + blk) * tile_elems_;
  }
  A* Tile(int64_t b, int64_t h, int64_t blk) {
    return data_.data() + ((b * heads_ + h) * num_blocks_ + blk) * tile_elems_;
  }

 private:
  int64_t heads_, num_blocks_, tile_elems_;
  std::vector<A> data_;
};

}  // namespace jax_flash::cpu

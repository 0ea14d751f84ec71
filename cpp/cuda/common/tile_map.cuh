// The tile map (mask.h's CellClass per 128 x 128 cell of positions) as the
// tensor-core kernels read it: one line of cells that a CTA's tiles step
// along. A forward CTA's query rows lie in one row of cells and its key
// blocks step along it (CellLine::AlongKeys); a dK/dV CTA's keys lie in one
// column and its query blocks step down it (CellLine::AlongQueries). A block
// of the steps lies in one cell when its size divides the cell's and the
// chunk's positions are multiples of it (always, without offsets); otherwise
// the line is absent and every block is partial: the map is a hint, the
// elementwise test decides per element as without it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/mask.h"

namespace jax_flash::cuda {

struct CellLine {
  const uint8_t* cells = nullptr;  // null: no tile map, or blocks that straddle cells
  int64_t stride = 0;              // elements from one cell of the line to the next
  uint64_t count = 0;              // cells on the line (past them: partial)

  // The class of step block n of kBlock positions.
  template <int kBlock>
  __device__ __forceinline__ CellClass At(int64_t n) const {
    // Blocks that straddle cells: Make left the line absent.
    if constexpr (kBlockMaskBlock % kBlock != 0) {
      return kCellPartial;
    } else {
      if (cells == nullptr) return kCellPartial;
      const uint64_t c = static_cast<uint64_t>(n) / (kBlockMaskBlock / kBlock);
      if (c >= count) return kCellPartial;
      const uint8_t v = cells[c * stride];
      return v >= kCellFull ? kCellFull : static_cast<CellClass>(v);
    }
  }

  // The first step block at or after n that the map does not leave empty,
  // or `end`; n itself without a map (every block is partial then).
  template <int kBlock>
  __device__ __forceinline__ int64_t Next(int64_t n, int64_t end) const {
    if (cells == nullptr) return n;
    while (n < end && At<kBlock>(n) == kCellEmpty) ++n;
    return n < end ? n : end;
  }

  // The line of rows [i0, i0 + kRows) (queries), stepping along key blocks
  // of kCols.
  template <int kRows, int kCols>
  __device__ __forceinline__ static CellLine AlongKeys(const BatchMask& mask, int64_t i0) {
    return Make<kRows, kCols>(mask.q_position + i0, mask.kv_position, mask.tile_map,
                              mask.tile_map_row_stride, mask.tile_map_rows,
                              mask.tile_map_col_stride, mask.tile_map_cols);
  }
  // The line of keys [j0, j0 + kRows), stepping along query blocks of kCols.
  template <int kRows, int kCols>
  __device__ __forceinline__ static CellLine AlongQueries(const BatchMask& mask, int64_t j0) {
    return Make<kRows, kCols>(mask.kv_position + j0, mask.q_position, mask.tile_map,
                              mask.tile_map_col_stride, mask.tile_map_cols,
                              mask.tile_map_row_stride, mask.tile_map_rows);
  }

 private:
  // `first` (the position of the line's first row) picks the line; the
  // steps start at position `step0`.
  template <int kRows, int kCols>
  __device__ __forceinline__ static CellLine Make(int64_t first, int64_t step0,
                                                  const uint8_t* map, int64_t line_stride,
                                                  uint64_t lines, int64_t cell_stride,
                                                  uint64_t cells) {
    CellLine r;
    if constexpr (kBlockMaskBlock % kRows != 0 || kBlockMaskBlock % kCols != 0) return r;
    if (map == nullptr) return r;
    const int64_t line = first / kBlockMaskBlock;
    if (first < 0 || step0 < 0 || step0 % kBlockMaskBlock != 0 ||
        (first + kRows - 1) / kBlockMaskBlock != line || static_cast<uint64_t>(line) >= lines)
      return r;
    const uint64_t skip = static_cast<uint64_t>(step0 / kBlockMaskBlock);
    if (skip >= cells) return r;
    r.cells = map + line * line_stride + static_cast<int64_t>(skip) * cell_stride;
    r.stride = cell_stride;
    r.count = cells - skip;
    return r;
  }
};

}  // namespace jax_flash::cuda

// The one definition of "may query i attend key j".
//
// Every kernel (CPU, CUDA) asks this header, so the semantics cannot drift
// between backends. Conventions follow jax.nn.dot_product_attention, in
// positions: query row i is at position P + i and key j at position K + j,
// where P and K are the chunk's position offsets (0 for a whole sequence;
// under sharding or ring attention the chunk's place in the full sequence):
//   causal:  K + j <= P + i                  (top-left aligned, also for Sq != Sk)
//   window:  P + i - window_left <= K + j <= P + i + window_right  (a bound < 0 is unbounded)
//   lengths: P + i < q_seqlen[b] and K + j < kv_seqlen[b]
//   segments: q_segment_ids[b, i] == kv_segment_ids[b, j]   (this chunk's ids)
//   dense:   mask[b, h, i, j] (this chunk's mask, broadcast to (B, Hq, Sq, Sk))
//   block:   block_mask[b, h, (P + i) / 128, (K + j) / 128] (block-sparse
//            attention: blocks of kBlockMaskBlock positions, in positions like
//            causal, so a chunk of any size reads the whole problem's blocks)
// Causal and window depend on P - K only: the diagonal, key j <= i + diagonal.
#pragma once

#include <cstdint>

#include "jax_flash/macros.h"

namespace jax_flash {

// The optional int32 offsets operand (4,): where this call's chunk sits in the
// whole problem. Read on the kernel's device (they are traced values under
// shard_map), by BatchMask::For and HeadDropout::For alone.
enum Offset : int {
  kQueryPosition = 0,  // position of query row 0 (a multiple of 16 with dropout)
  kKeyPosition = 1,    // position of key 0 (a multiple of 16 with dropout)
  kBatchOffset = 2,    // global index of batch element 0 (dropout)
  kHeadOffset = 3,     // global index of query head 0 (dropout)
  kNumOffsets = 4,
};

// Query rows and keys per block of the block-sparse mask (Python's
// jax_flash.BLOCK_MASK_BLOCK). Every CPU and exact CUDA tile size divides it,
// so a tile never straddles two blocks of a whole problem and the tiles of a
// hidden block are skipped, never read.
inline constexpr int64_t kBlockMaskBlock = 128;

// The tile map (MaskParams::tile_map): per cell of kBlockMaskBlock x
// kBlockMaskBlock positions (the block mask's cells), what the segment ids
// (and any other elementwise term it was derived from) leave visible there.
// Derived by jax_flash from those terms (jax_flash/tile_map.py): kernels
// that read it skip empty cells and the elementwise test in full ones; for
// the segment ids and a dense mask it is a hint (a kernel that ignores it
// computes the same result). A block mask is folded in too (its hidden
// cells empty), which is how the tensor-core kernels take one
// (cuda/dispatch.cu). The band (causal, window, lengths) is not in it.
enum CellClass : uint8_t {
  kCellEmpty = 0,    // no pair of the cell is visible
  kCellPartial = 1,  // some may be: test per element
  kCellFull = 2,     // every pair is, as far as the terms go (values > 2 too)
};

// Element strides of an array broadcast to (B, Hq, Sq, Sk); a broadcast
// dimension has stride 0.
struct DenseStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
  int64_t col = 0;
};

// Whole-batch mask description; null pointers mean "absent".
struct MaskParams {
  bool causal = false;
  int64_t window_left = -1;   // < 0: unbounded.
  int64_t window_right = -1;  // < 0: unbounded.
  const int32_t* q_seqlens = nullptr;       // (B,)
  const int32_t* kv_seqlens = nullptr;      // (B,)
  const int32_t* q_segment_ids = nullptr;   // (B, Sq), contiguous
  const int32_t* kv_segment_ids = nullptr;  // (B, Sk), contiguous
  const uint8_t* dense = nullptr;           // boolean, broadcast to (B, Hq, Sq, Sk)
  DenseStrides dense_strides;
  // Boolean (B', H', R, C) block mask, B' and H' 1 or B and Hq; null if
  // absent. A dim of 1 broadcasts; block indices past R or C are hidden.
  const uint8_t* block = nullptr;
  DenseStrides block_strides;
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  const int32_t* offsets = nullptr;         // (kNumOffsets,), or null: all 0
  // CellClass per cell, (B', H', R, C) like the block mask (cells in
  // positions, a dim of 1 broadcasts); null if absent.
  const uint8_t* tile_map = nullptr;
  DenseStrides tile_map_strides;
  int64_t tile_map_rows = 0;
  int64_t tile_map_cols = 0;
};

// The mask for one (batch element, query head), with its lengths resolved.
struct BatchMask {
  bool causal;
  int64_t window_left;
  int64_t window_right;
  int64_t diagonal;  // query position - key position of (0, 0): j <= i + diagonal is causal
  int64_t q_len;   // rows i >= q_len see nothing (in this chunk's rows)
  int64_t kv_len;  // keys j >= kv_len are never seen (in this chunk's keys)
  const int32_t* q_seg;   // null if no segments
  const int32_t* kv_seg;
  const uint8_t* dense;  // this head's (Sq, Sk) view, or null
  int64_t dense_row_stride;
  int64_t dense_col_stride;
  const uint8_t* block;  // this head's block mask, or null
  int64_t block_row_stride;
  int64_t block_col_stride;
  uint64_t block_rows;  // block indices at or past these are hidden
  uint64_t block_cols;
  int64_t q_position;   // positions of row 0 and key 0 (blocks are in positions)
  int64_t kv_position;
  const uint8_t* tile_map;  // this head's tile map, or null
  int64_t tile_map_row_stride;
  int64_t tile_map_col_stride;
  uint64_t tile_map_rows;  // cell indices at or past these are empty
  uint64_t tile_map_cols;

  // Every term, the block-sparse mask included: the kernels that skip its
  // hidden cells (CPU, CUDA exact). cuda/dispatch.cu sends problems with a
  // block mask only to those.
  JAX_FLASH_HOST_DEVICE static BatchMask WithBlocks(const MaskParams& m, int64_t b, int64_t h,
                                                    int64_t seqlen_q, int64_t seqlen_k) {
    BatchMask r;
    r.causal = m.causal;
    r.window_left = m.window_left;
    r.window_right = m.window_right;
    const int64_t q_position = m.offsets ? m.offsets[kQueryPosition] : 0;
    const int64_t kv_position = m.offsets ? m.offsets[kKeyPosition] : 0;
    r.diagonal = q_position - kv_position;
    r.q_len = seqlen_q;
    r.kv_len = seqlen_k;
    // Lengths count from the start of the sequence; clamped to this chunk's
    // [0, seqlen]: a negative length hides everything, one past the end
    // changes nothing.
    if (m.q_seqlens != nullptr) r.q_len = Clamp(m.q_seqlens[b] - q_position, seqlen_q);
    if (m.kv_seqlens != nullptr) r.kv_len = Clamp(m.kv_seqlens[b] - kv_position, seqlen_k);
    r.q_seg = m.q_segment_ids ? m.q_segment_ids + b * seqlen_q : nullptr;
    r.kv_seg = m.kv_segment_ids ? m.kv_segment_ids + b * seqlen_k : nullptr;
    r.dense = m.dense ? m.dense + b * m.dense_strides.batch + h * m.dense_strides.head : nullptr;
    r.dense_row_stride = m.dense_strides.row;
    r.dense_col_stride = m.dense_strides.col;
    r.block = m.block ? m.block + b * m.block_strides.batch + h * m.block_strides.head : nullptr;
    r.block_row_stride = m.block_strides.row;
    r.block_col_stride = m.block_strides.col;
    // A broadcast dim (1, stride 0) admits every index; otherwise an index
    // outside the mask, which only a direct call with offsets can reach, is
    // hidden rather than read.
    r.block_rows = m.block_rows == 1 ? ~uint64_t{0} : static_cast<uint64_t>(m.block_rows);
    r.block_cols = m.block_cols == 1 ? ~uint64_t{0} : static_cast<uint64_t>(m.block_cols);
    r.q_position = q_position;
    r.kv_position = kv_position;
    r.tile_map =
        m.tile_map ? m.tile_map + b * m.tile_map_strides.batch + h * m.tile_map_strides.head
                   : nullptr;
    r.tile_map_row_stride = m.tile_map_strides.row;
    r.tile_map_col_stride = m.tile_map_strides.col;
    r.tile_map_rows =
        m.tile_map_rows == 1 ? ~uint64_t{0} : static_cast<uint64_t>(m.tile_map_rows);
    r.tile_map_cols =
        m.tile_map_cols == 1 ? ~uint64_t{0} : static_cast<uint64_t>(m.tile_map_cols);
    return r;
  }

  // Every term but the block-sparse mask (the tensor-core kernels): a null
  // block pointer the compiler sees, so their code is what it was without one.
  JAX_FLASH_HOST_DEVICE static BatchMask For(const MaskParams& m, int64_t b, int64_t h,
                                             int64_t seqlen_q, int64_t seqlen_k) {
    BatchMask r = WithBlocks(m, b, h, seqlen_q, seqlen_k);
    r.block = nullptr;
    return r;
  }

  // For kernels without dense-mask support either: the dispatch sends
  // problems with a dense mask to kernels that use the 5-argument forms.
  JAX_FLASH_HOST_DEVICE static BatchMask For(const MaskParams& m, int64_t b,
                                             int64_t seqlen_q, int64_t seqlen_k) {
    BatchMask r = For(m, b, 0, seqlen_q, seqlen_k);
    r.dense = nullptr;
    return r;
  }

  // The exact predicate.
  JAX_FLASH_HOST_DEVICE bool Visible(int64_t i, int64_t j) const {
    if (i >= q_len || j >= kv_len) return false;
    const int64_t d = i + diagonal;  // the key on this row's diagonal
    if (causal && j > d) return false;
    if (window_left >= 0 && j < d - window_left) return false;
    if (window_right >= 0 && j > d + window_right) return false;
    if (q_seg != nullptr && q_seg[i] != kv_seg[j]) return false;
    if (dense != nullptr && !dense[i * dense_row_stride + j * dense_col_stride]) return false;
    if (block != nullptr &&
        !BlockSet((q_position + i) / kBlockMaskBlock, (kv_position + j) / kBlockMaskBlock))
      return false;
    return true;
  }

  // Whether some (all) block-mask cells that rows [i0, i1) x keys [j0, j1)
  // fall in are set; true without a block mask (an empty rectangle has no
  // cell). A tile of a whole problem lies in one cell (kBlockMaskBlock), a
  // chunk's tiles in at most four.
  JAX_FLASH_HOST_DEVICE bool AnyBlockSet(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (block == nullptr) return true;
    if (i0 >= i1 || j0 >= j1) return false;
    for (int64_t bi = (q_position + i0) / kBlockMaskBlock;
         bi <= (q_position + i1 - 1) / kBlockMaskBlock; ++bi)
      for (int64_t bj = (kv_position + j0) / kBlockMaskBlock;
           bj <= (kv_position + j1 - 1) / kBlockMaskBlock; ++bj)
        if (BlockSet(bi, bj)) return true;
    return false;
  }
  JAX_FLASH_HOST_DEVICE bool AllBlocksSet(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (block == nullptr || i0 >= i1 || j0 >= j1) return true;
    for (int64_t bi = (q_position + i0) / kBlockMaskBlock;
         bi <= (q_position + i1 - 1) / kBlockMaskBlock; ++bi)
      for (int64_t bj = (kv_position + j0) / kBlockMaskBlock;
           bj <= (kv_position + j1 - 1) / kBlockMaskBlock; ++bj)
        if (!BlockSet(bi, bj)) return false;
    return true;
  }

  // Keys [*begin, *end) that rows [i0, i1) may see, from the band structure
  // (causal, window, lengths); segments and the dense mask are not used here
  // (kernels test whole tiles of those with AnyVisible). Everything outside
  // is invisible, so kernels skip it. Empty when begin >= end. With a block
  // mask, begin is moved back to the start of its block, so that tiles
  // stepping from it never straddle two blocks (a hidden one is skipped
  // whole, its keys never read).
  JAX_FLASH_HOST_DEVICE void KeyRange(int64_t i0, int64_t i1, int64_t* begin,
                                      int64_t* end) const {
    int64_t lo = 0, hi = kv_len;
    if (i1 > q_len) i1 = q_len;
    if (i0 >= i1) { *begin = 0; *end = 0; return; }
    if (causal) hi = Min(hi, i1 + diagonal);  // j <= i1 - 1 + diagonal
    if (window_right >= 0) hi = Min(hi, i1 + diagonal + window_right);
    if (window_left >= 0) lo = Max(lo, i0 + diagonal - window_left);
    // Empty as (0, 0), not (lo, lo): lo may lie past kv_len (rows past the
    // keys' end under a left window), and a loop over the blocks from
    // lo / kBlockN to end would visit the block that holds lo.
    if (hi <= lo) { *begin = 0; *end = 0; return; }
    *begin = BlockStart(lo, kv_position);
    *end = hi;
  }

  // Query rows [*begin, *end) that may see some key in [j0, j1): the
  // transpose of KeyRange, used by kernels that loop over key blocks (begin
  // likewise at a block start with a block mask).
  JAX_FLASH_HOST_DEVICE void QueryRange(int64_t j0, int64_t j1, int64_t* begin,
                                        int64_t* end) const {
    int64_t lo = 0, hi = q_len;
    if (j1 > kv_len) j1 = kv_len;
    if (j0 >= j1) { *begin = 0; *end = 0; return; }
    if (causal) lo = Max(lo, j0 - diagonal);  // i >= j - diagonal
    if (window_right >= 0) lo = Max(lo, j0 - diagonal - window_right);  // i >= j - d - right
    if (window_left >= 0) hi = Min(hi, j1 - diagonal + window_left);  // i <= j - d + left
    if (hi <= lo) { *begin = 0; *end = 0; return; }  // as in KeyRange: lo may be past q_len
    *begin = BlockStart(lo, q_position);
    *end = hi;
  }

  // True when every (i, j) in the rectangle is visible, so a kernel can skip
  // the per-element test. Needs no segments or dense mask; the band
  // conditions are checked at the corners that bind them, the block mask by
  // its cells.
  JAX_FLASH_HOST_DEVICE bool AllVisible(int64_t i0, int64_t i1, int64_t j0,
                                        int64_t j1) const {
    if (q_seg != nullptr || dense != nullptr) return false;
    if (!AllBlocksSet(i0, i1, j0, j1)) return false;
    int64_t begin, end;
    FullKeyRange(i0, i1, &begin, &end);
    return begin <= j0 && j1 <= end;
  }

  // Keys [*begin, *end) that every row of [i0, i1) sees by the band
  // structure (causal, window, lengths): the intersection of the rows' key
  // ranges, where KeyRange is their union; empty (begin >= end) when a row
  // is past q_len. A kernel can leave the mask out of the key blocks inside
  // it when there are no segments, dense mask or block mask.
  JAX_FLASH_HOST_DEVICE void FullKeyRange(int64_t i0, int64_t i1, int64_t* begin,
                                          int64_t* end) const {
    int64_t lo = 0, hi = kv_len;
    if (i1 > q_len || i0 >= i1) { *begin = 0; *end = 0; return; }
    if (causal) hi = Min(hi, i0 + diagonal + 1);  // j <= i0 + diagonal
    if (window_right >= 0) hi = Min(hi, i0 + diagonal + window_right + 1);
    if (window_left >= 0) lo = Max(lo, i1 - 1 + diagonal - window_left);
    *begin = lo;
    *end = hi > lo ? hi : lo;
  }

  // False when no (i, j) in the rectangle is visible, so a kernel can skip
  // the tile. Exact; costs one pass over the tile, so kernels call it only
  // when segments or a dense mask are present (the band is handled by
  // KeyRange/QueryRange, the block mask by AnyBlockSet, cell by cell).
  JAX_FLASH_HOST_DEVICE bool AnyVisible(int64_t i0, int64_t i1, int64_t j0,
                                        int64_t j1) const {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t j = j0; j < j1; ++j)
        if (Visible(i, j)) return true;
    return false;
  }

  JAX_FLASH_HOST_DEVICE bool HasElementwiseTerms() const {
    return q_seg != nullptr || dense != nullptr;
  }

  // The class of rows [i0, i1) x keys [j0, j1) by the tile map: empty when
  // every cell it touches is, full when every one is, partial otherwise and
  // without a tile map (the elementwise terms then decide per element, as
  // without one). A tile of a whole problem lies in one cell when its sides
  // divide kBlockMaskBlock, a chunk's (offsets) in up to four.
  JAX_FLASH_HOST_DEVICE CellClass TileClass(int64_t i0, int64_t i1, int64_t j0,
                                            int64_t j1) const {
    if (tile_map == nullptr || i0 >= i1 || j0 >= j1) return kCellPartial;
    bool any = false, all = true;
    for (int64_t bi = (q_position + i0) / kBlockMaskBlock;
         bi <= (q_position + i1 - 1) / kBlockMaskBlock; ++bi)
      for (int64_t bj = (kv_position + j0) / kBlockMaskBlock;
           bj <= (kv_position + j1 - 1) / kBlockMaskBlock; ++bj) {
        const int c = Cell(bi, bj);
        any = any || c != kCellEmpty;
        all = all && c >= kCellFull;
      }
    return !any ? kCellEmpty : (all ? kCellFull : kCellPartial);
  }

  // AllVisible for a tile whose TileClass is full: the elementwise terms
  // hide nothing there, so only the band and the block mask are left.
  JAX_FLASH_HOST_DEVICE bool AllVisibleByBand(int64_t i0, int64_t i1, int64_t j0,
                                              int64_t j1) const {
    BatchMask band = *this;
    band.q_seg = nullptr;
    band.dense = nullptr;
    return band.AllVisible(i0, i1, j0, j1);
  }

 private:
  // Tile-map cell (bi, bj)'s class; past the map (or a negative index):
  // empty, as for the block mask.
  JAX_FLASH_HOST_DEVICE int Cell(int64_t bi, int64_t bj) const {
    return static_cast<uint64_t>(bi) < tile_map_rows && static_cast<uint64_t>(bj) < tile_map_cols
               ? tile_map[bi * tile_map_row_stride + bj * tile_map_col_stride]
               : kCellEmpty;
  }
  // Block-mask cell (bi, bj) is set; a negative index (a negative offset of
  // a direct call) wraps to a huge one and is hidden.
  JAX_FLASH_HOST_DEVICE bool BlockSet(int64_t bi, int64_t bj) const {
    return static_cast<uint64_t>(bi) < block_rows && static_cast<uint64_t>(bj) < block_cols &&
           block[bi * block_row_stride + bj * block_col_stride];
  }
  // Index n moved back to the start of its block-mask block (index + position
  // a multiple of kBlockMaskBlock, not below 0); n itself without a block mask.
  JAX_FLASH_HOST_DEVICE int64_t BlockStart(int64_t n, int64_t position) const {
    if (block == nullptr) return n;
    const int64_t into = (position + n) % kBlockMaskBlock;
    return Max(0, n - (into < 0 ? into + kBlockMaskBlock : into));
  }
  JAX_FLASH_HOST_DEVICE static int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }
  JAX_FLASH_HOST_DEVICE static int64_t Max(int64_t a, int64_t b) { return a > b ? a : b; }
  JAX_FLASH_HOST_DEVICE static int64_t Clamp(int64_t n, int64_t upper) {
    return n < 0 ? 0 : (n > upper ? upper : n);
  }
};

}  // namespace jax_flash

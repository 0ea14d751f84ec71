// One row of a score tile: from raw q.k products to log2-domain logits, with
// bias, soft cap and mask applied, plus what every pass needs to know about
// one (batch element, head). Shared by the forward and the backward passes so
// that they see exactly the same logits and the same dropout mask.
#pragma once

#include <cstdint>
#include <limits>

#include "cpu/simd.h"
#include "cpu/tile.h"
#include "jax_flash/dropout.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"

namespace jax_flash::cpu {

// Everything elementwise about one (batch element b, query head h).
template <typename A>
struct HeadView {
  BatchMask mask;
  const A* bias;  // this head's (Sq, Sk) view of the bias, or null
  int64_t bias_row_stride;
  int64_t bias_col_stride;
  HeadDropout dropout;

  static HeadView For(const FwdParams& p, int64_t b, int64_t h) {
    const AttentionShape& s = p.shape;
    HeadView v;
    v.mask = BatchMask::WithBlocks(p.mask, b, h, s.seqlen_q, s.seqlen_k);
    const DenseStrides& bs = p.score.bias_strides;
    v.bias = p.score.bias != nullptr
                 ? static_cast<const A*>(p.score.bias) + b * bs.batch + h * bs.head
                 : nullptr;
    v.bias_row_stride = bs.row;
    v.bias_col_stride = bs.col;
    v.dropout = HeadDropout::For(p.dropout, s.batch, b, h);
    return v;
  }

  // False only if no (i, j) of the tile is visible; such tiles are skipped
  // (a hidden block of the block-sparse mask, or cells the tile map calls
  // empty, by their cells alone: the elements are never read).
  bool TileMayBeVisible(int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    if (!mask.AnyBlockSet(i0, i0 + rows, j0, j0 + cols)) return false;
    if (mask.TileClass(i0, i0 + rows, j0, j0 + cols) == kCellEmpty) return false;
    return !mask.HasElementwiseTerms() || mask.AnyVisible(i0, i0 + rows, j0, j0 + cols);
  }
};

// s_row holds kBlockN raw products q_i . k_j for keys j0 .. j0 + kBlockN.
// On return it holds log2(e) * x, where x = scale * q.k + bias, capped as
// cap * tanh(x / cap) when cap > 0, and -inf where query i may not see the
// key (including columns >= cols, past the end of the key block).
// With a cap, sech2_row (if not null) receives 1 - tanh^2(x / cap), the
// derivative of the cap, for the backward.
template <typename A>
inline void ScoreRow(A* s_row, const ScoreParams& score, const HeadView<A>& head, int64_t i,
                     int64_t j0, int64_t cols, bool all_visible, A* sech2_row) {
  const A scale = static_cast<A>(score.scale);
  const A cap = static_cast<A>(score.softcap);
  for (int64_t c = 0; c < kBlockN; c += kLanes<A>) Store(s_row + c, Load(s_row + c) * scale);
  if (head.bias != nullptr) {
    const A* bias_row = head.bias + i * head.bias_row_stride + j0 * head.bias_col_stride;
    for (int64_t c = 0; c < cols; ++c) s_row[c] += bias_row[c * head.bias_col_stride];
  }
  for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
    Vec<A> x = Load(s_row + c);
    if (cap > 0) {
      Vec<A> sech2;
      const Vec<A> t = Tanh<A>(x / cap, sech2_row != nullptr ? &sech2 : nullptr);
      if (sech2_row != nullptr) Store(sech2_row + c, sech2);
      x = t * cap;
    }
    Store(s_row + c, x * static_cast<A>(kLog2e));
  }
  if (!all_visible) {
    constexpr A kMasked = -std::numeric_limits<A>::infinity();
    for (int64_t c = 0; c < kBlockN; ++c)
      if (c >= cols || !head.mask.Visible(i, j0 + c)) s_row[c] = kMasked;
  }
}

// Calls keep(c, kept) for columns c < cols of row i, in order. The Philox
// calls of each aligned group of 16 columns serve all of it (dropout.h).
template <typename F>
inline void ForEachDropoutColumn(const HeadDropout& dropout, int64_t i, int64_t j0, int64_t cols,
                                 F&& keep) {
  uint32_t words[4][4];
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t j = j0 + c;
    if (c == 0 || (j & 15) == 0) dropout.RowCalls(i, j & ~int64_t(15), words);
    keep(c, dropout.KeepIn(words, i, j));
  }
}

}  // namespace jax_flash::cpu

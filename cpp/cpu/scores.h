// One row of a score tile: from raw q.k products to log2-domain logits, with
// the soft cap and the mask applied. Shared by the forward and both backward
// passes so that they see exactly the same logits.
#pragma once

#include <cstdint>
#include <limits>

#include "cpu/simd.h"
#include "cpu/tile.h"
#include "jax_flash/mask.h"
#include "jax_flash/params.h"

namespace jax_flash::cpu {

// s_row holds kBlockN raw products q_i . k_j for keys j0 .. j0 + kBlockN.
// On return it holds log2(e) * x, where x = scale * q.k, capped as
// cap * tanh(x / cap) when cap > 0, and -inf where query i may not see the
// key (including columns >= cols, past the end of the key block).
// With a cap, tanh_row (if not null) receives tanh(x / cap) for the backward.
template <typename A>
inline void ScoreRow(A* s_row, const ScoreParams& score, const BatchMask& mask, int64_t i,
                     int64_t j0, int64_t cols, bool all_visible, A* tanh_row) {
  const A scale = static_cast<A>(score.scale);
  const A cap = static_cast<A>(score.softcap);
  for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
    Vec<A> x = Load(s_row + c) * scale;
    if (cap > 0) {
      const Vec<A> t = Tanh<A>(x / cap);
      if (tanh_row != nullptr) Store(tanh_row + c, t);
      x = t * cap;
    }
    Store(s_row + c, x * static_cast<A>(kLog2e));
  }
  if (!all_visible) {
    constexpr A kMasked = -std::numeric_limits<A>::infinity();
    for (int64_t c = 0; c < kBlockN; ++c)
      if (c >= cols || !mask.Visible(i, j0 + c)) s_row[c] = kMasked;
  }
}

}  // namespace jax_flash::cpu

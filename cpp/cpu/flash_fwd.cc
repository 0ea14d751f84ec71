// CPU FlashAttention-2 forward.
//
// Work item: (batch, query head, block of kBlockM query rows). The item keeps
// its output rows in an accumulation-type tile and streams key/value tiles
// (packed once per call) through the cache: S = Q K^T, online softmax
// (running max m and sum l, in base 2), O = diag(alpha) O + P V; with
// dropout, P V uses the dropped and rescaled P while l sums P itself.
// Memory: the packed K and V plus a few tiles per thread, never Sq x Sk.
#include <cmath>
#include <limits>

#include "cpu/kernels.h"
#include "cpu/packed.h"
#include "cpu/scores.h"
#include "cpu/tile.h"

namespace jax_flash::cpu {
namespace {

template <typename T>
struct FwdInputs {
  using A = Acc<T>;
  const FwdParams& p;
  const PackedTensor<A>& k_transposed;  // tiles [D][kBlockN]
  const PackedTensor<A>& v_rows;        // tiles [kBlockN][Dp]
};

template <typename T>
void FwdItem(const FwdInputs<T>& in, int64_t item) {
  using A = Acc<T>;
  const FwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const QueryItem qi = QueryItem::Of(s, item);
  const int64_t b = qi.b, h = qi.h, h_kv = qi.h_kv, i0 = qi.i0, rows = qi.rows;
  const int64_t D = s.head_dim;
  const int64_t Dp = PaddedHeadDim<A>(D);
  const HeadView<A> head = HeadView<A>::For(p, b, h);
  const BatchMask& mask = head.mask;
  const A keep_scale = static_cast<A>(p.dropout.keep_scale());

  thread_local Scratch<A> scratch;
  A* q = scratch.Get(2 * kBlockM * Dp + kBlockM * kBlockN + 2 * kBlockM);
  A* o = q + kBlockM * Dp;
  A* s_tile = o + kBlockM * Dp;
  A* m = s_tile + kBlockM * kBlockN;
  A* l = m + kBlockM;

  PackRows(static_cast<const T*>(p.q), p.q_strides, b, h, i0, rows, rows, D, q, Dp);
  std::fill(o, o + rows * Dp, A(0));
  std::fill(m, m + rows, -std::numeric_limits<A>::infinity());
  std::fill(l, l + rows, A(0));

  int64_t j_begin, j_end;
  mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
  for (int64_t n_block = j_begin / kBlockN; n_block * kBlockN < j_end; ++n_block) {
    const int64_t j0 = n_block * kBlockN;
    const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
    if (!head.TileMayBeVisible(i0, rows, j0, cols)) continue;
    const A* kt = in.k_transposed.Tile(b, h_kv, n_block);
    const A* v = in.v_rows.Tile(b, h_kv, n_block);
    Gemm<A, false>(rows, kBlockN, D, RowMajor(q, Dp), kt, kBlockN, s_tile, kBlockN);  // S = Q K^T
    const bool all_visible = cols == kBlockN && mask.AllVisible(i0, i0 + rows, j0, j0 + cols);
    for (int64_t r = 0; r < rows; ++r) {
      A* s_row = s_tile + r * kBlockN;
      ScoreRow<A>(s_row, p.score, head, i0 + r, j0, cols, all_visible, nullptr);
      Vec<A> row_max = Load(s_row);
      for (int64_t c = kLanes<A>; c < kBlockN; c += kLanes<A>) row_max = Max<A>(row_max, Load(s_row + c));
      const A m_new = std::max(m[r], ReduceMax<A>(row_max));
      // While a row has seen nothing but -inf (hidden keys) and NaN, P is
      // taken against 0: exp2(-inf) = 0 keeps O and l unchanged, and a NaN
      // logit still gives P = NaN, so a NaN row becomes NaN (as in jax.nn)
      // instead of passing for a row that sees no key.
      const A m_ref = m_new == -std::numeric_limits<A>::infinity() ? A(0) : m_new;
      Vec<A> row_sum{};
      for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
        const Vec<A> prob = Exp2<A>(Load(s_row + c) - m_ref);
        Store(s_row + c, prob);
        row_sum += prob;
      }
      const A alpha = std::exp2(m[r] - m_ref);  // rescales what came before; 0 while m = -inf
      l[r] = l[r] * alpha + ReduceSum<A>(row_sum);
      m[r] = m_new;
      if (head.dropout.enabled)  // l sums P before dropout; P V uses the dropped P
        ForEachDropoutColumn(head.dropout, i0 + r, j0, cols, [&](int64_t c, bool kept) {
          s_row[c] = kept ? s_row[c] * keep_scale : A(0);
        });
      if (alpha != A(1)) {
        A* o_row = o + r * Dp;
        for (int64_t c = 0; c < Dp; c += kLanes<A>) Store(o_row + c, Load(o_row + c) * alpha);
      }
    }
    Gemm<A, true>(rows, Dp, kBlockN, RowMajor<A>(s_tile, kBlockN), v, Dp, o, Dp);  // O += P V
  }

  A* lse = static_cast<A*>(p.lse) + (b * s.num_heads_q + h) * s.seqlen_q + i0;
  for (int64_t r = 0; r < rows; ++r) {
    A* o_row = o + r * Dp;
    // No visible key: output 0, lse = log(0). A NaN l (a NaN logit) is not
    // 0, so NaN reaches out and lse.
    if (l[r] == A(0)) {
      std::fill(o_row, o_row + Dp, A(0));
      lse[r] = -std::numeric_limits<A>::infinity();
      continue;
    }
    const A inv_l = A(1) / l[r];
    for (int64_t c = 0; c < Dp; c += kLanes<A>) Store(o_row + c, Load(o_row + c) * inv_l);
    lse[r] = (m[r] + std::log2(l[r])) * static_cast<A>(kLn2);
  }
  UnpackRows(o, Dp, rows, D, static_cast<T*>(p.out), p.out_strides, b, h, i0);
}

template <typename T>
void Fwd(const FwdParams& p, const ParallelFor& parallel_for) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const PackedTensor<A> k_transposed(static_cast<const T*>(p.k), p.k_strides, s.batch,
                                     s.seqlen_k, s.num_heads_kv, s.head_dim, kBlockN,
                                     TileLayout::kTransposed, parallel_for);
  const PackedTensor<A> v_rows(static_cast<const T*>(p.v), p.v_strides, s.batch, s.seqlen_k,
                               s.num_heads_kv, s.head_dim, kBlockN, TileLayout::kRows,
                               parallel_for);
  const FwdInputs<T> in{p, k_transposed, v_rows};
  parallel_for(QueryItem::Count(s), [&in](int64_t item) { FwdItem<T>(in, item); });
}

}  // namespace

void FlashFwd(const FwdParams& p, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF32: return Fwd<float>(p, parallel_for);
    case DType::kF64: return Fwd<double>(p, parallel_for);
    case DType::kBF16: return Fwd<bf16>(p, parallel_for);
    case DType::kF16: return Fwd<f16>(p, parallel_for);
  }
}

const char* CompiledMarch() { return JAX_FLASH_CPU_MARCH; }
int VectorBytes() { return kVectorBytes; }

}  // namespace jax_flash::cpu

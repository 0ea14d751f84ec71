// CPU FlashAttention forward-mode derivative (JVP), fused.
//
// Work item: (batch, query head, block of kBlockM query rows), as in the
// forward. The forward's lse makes P = exp(x - lse) known tile by tile (no
// online softmax, nothing to rescale), so every key tile simply adds its
// share to two accumulators:
//   acc     += (Pd o dS) V + Pd V_dot,      lse_dot += rowsum(P o dS),
// with dS = scale (Q_dot K^T + Q K_dot^T) + bias_dot (times sech^2 under a
// soft cap) the derivative of the logits, and Pd the forward's dropped and
// rescaled P. At the end out_dot = acc - lse_dot o out (softmax's Jacobian
// applied without a second pass, since out = Pd V). Five tile products per
// tile where the forward has two; absent tangents skip theirs.
// With a per-row shift c, acc takes (Pd o (dS - c)) V and the end subtracts
// (lse_dot - c) o out (the same in exact arithmetic, since out = Pd V): c is
// the P-weighted mean of dS over the row's first tile with a visible key (the
// CUDA JVP kernel, sm80/jvp.cuh, shifts likewise), 0 for a row that sees no
// key. Where a row sees few keys, lse_dot ~ dS, and the unshifted form left
// lse_dot times out's 16-bit rounding, which the plain implementation's
// result does not carry.
// Memory: packed K, V (and their tangents) plus a few tiles per thread.
#include <cmath>
#include <limits>

#include "cpu/kernels.h"
#include "cpu/packed.h"
#include "cpu/scores.h"
#include "cpu/tile.h"

namespace jax_flash::cpu {
namespace {

template <typename A>
struct JvpInputs {
  const JvpParams& p;
  const PackedTensor<A>& k_transposed;      // tiles [D][kBlockN]
  const PackedTensor<A>& v_rows;            // tiles [kBlockN][Dp]
  const PackedTensor<A>* k_dot_transposed;  // null when k_dot is zero
  const PackedTensor<A>* v_dot_rows;        // null when v_dot is zero
};

// Per-thread tiles, row-major.
template <typename A>
struct JvpTiles {
  A *q, *q_dot, *acc, *p, *ds, *sech2, *lse2, *lse_dot, *shift;

  static JvpTiles Get(int64_t Dp) {
    thread_local Scratch<A> scratch;
    const int64_t rows = kBlockM * Dp, tile = kBlockM * kBlockN;
    JvpTiles t;
    t.q = scratch.Get(3 * rows + 3 * tile + 3 * kBlockM);
    t.q_dot = t.q + rows;
    t.acc = t.q_dot + rows;
    t.p = t.acc + rows;
    t.ds = t.p + tile;
    t.sech2 = t.ds + tile;
    t.lse2 = t.sech2 + tile;
    t.lse_dot = t.lse2 + kBlockM;
    t.shift = t.lse_dot + kBlockM;
    return t;
  }
};

// One row of a tile: on entry p_row holds the raw products q.k and ds_row
// those of the tangents (or nothing, when has_ds is false); on return p_row
// holds P, ds_row holds P o dS (0 wherever the key is hidden, whatever the
// tangents hold), and the row's sum of P o dS is returned.
template <typename A>
A ProbsAndTangentRow(const JvpParams& p, const HeadView<A>& head, const A* bias_dot_head,
                     int64_t i, int64_t j0, int64_t cols, bool all_visible, bool has_ds,
                     A lse2, A* p_row, A* ds_row, A* sech2_row) {
  const bool capped = p.score.softcap > 0;
  ScoreRow<A>(p_row, p.score, head, i, j0, cols, all_visible, capped ? sech2_row : nullptr);
  if (!has_ds) {
    for (int64_t c = 0; c < kBlockN; c += kLanes<A>)
      Store(p_row + c, Exp2<A>(Load(p_row + c) - lse2));
    return A(0);
  }
  const A scale = static_cast<A>(p.score.scale);
  for (int64_t c = 0; c < kBlockN; c += kLanes<A>) Store(ds_row + c, Load(ds_row + c) * scale);
  if (bias_dot_head != nullptr) {
    const A* row = bias_dot_head + i * head.bias_row_stride + j0 * head.bias_col_stride;
    for (int64_t c = 0; c < cols; ++c) ds_row[c] += row[c * head.bias_col_stride];
  }
  constexpr A kMasked = -std::numeric_limits<A>::infinity();
  Vec<A> sum{};
  for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
    const Vec<A> x = Load(p_row + c);
    const Vec<A> prob = Exp2<A>(x - lse2);
    Vec<A> ds = Load(ds_row + c);
    if (capped) ds *= Load(sech2_row + c);  // d(cap tanh(x / cap)) = sech^2(x / cap) dx
    // Hidden keys contribute exactly 0, also where a tangent is inf or NaN.
    const Vec<A> pds = x == kMasked ? Splat<A>(0) : prob * ds;
    Store(p_row + c, prob);
    Store(ds_row + c, pds);
    sum += pds;
  }
  return ReduceSum<A>(sum);
}

template <typename T>
void JvpItem(const JvpInputs<Acc<T>>& in, int64_t item) {
  using A = Acc<T>;
  const JvpParams& p = in.p;
  const AttentionShape& s = p.shape;
  const QueryItem qi = QueryItem::Of(s, item);
  const int64_t b = qi.b, h = qi.h, h_kv = qi.h_kv, i0 = qi.i0, rows = qi.rows;
  const int64_t D = s.head_dim;
  const int64_t Dp = PaddedHeadDim<A>(D);
  const HeadView<A> head = HeadView<A>::For(p, b, h);
  const DenseStrides& bs = p.score.bias_strides;
  const A* bias_dot_head =
      p.bias_dot != nullptr ? static_cast<const A*>(p.bias_dot) + b * bs.batch + h * bs.head
                            : nullptr;
  const bool has_ds = p.q_dot != nullptr || in.k_dot_transposed != nullptr ||
                      bias_dot_head != nullptr;
  const A keep_scale = static_cast<A>(p.dropout.keep_scale());
  JvpTiles<A> t = JvpTiles<A>::Get(Dp);

  PackRows(static_cast<const T*>(p.q), p.q_strides, b, h, i0, rows, rows, D, t.q, Dp);
  if (p.q_dot != nullptr)
    PackRows(static_cast<const T*>(p.q_dot), p.q_dot_strides, b, h, i0, rows, rows, D, t.q_dot,
             Dp);
  std::fill(t.acc, t.acc + rows * Dp, A(0));
  std::fill(t.lse_dot, t.lse_dot + rows, A(0));
  // The shift c of each row, set at its first tile with a visible key (0
  // until then: subtracting it changes nothing).
  std::fill(t.shift, t.shift + rows, A(0));
  bool shift_set[kBlockM] = {};
  const A* lse = static_cast<const A*>(p.lse) + (b * s.num_heads_q + h) * s.seqlen_q + i0;
  for (int64_t r = 0; r < rows; ++r)  // lse = -inf (nothing visible): +inf makes P = 0
    t.lse2[r] = std::isinf(lse[r]) && lse[r] < 0 ? std::numeric_limits<A>::infinity()
                                                 : lse[r] * static_cast<A>(kLog2e);

  int64_t j_begin, j_end;
  head.mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
  for (int64_t n_block = j_begin / kBlockN; n_block * kBlockN < j_end; ++n_block) {
    const int64_t j0 = n_block * kBlockN;
    const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
    if (!head.TileMayBeVisible(i0, rows, j0, cols)) continue;
    const A* kt = in.k_transposed.Tile(b, h_kv, n_block);
    Gemm<A, false>(rows, kBlockN, D, RowMajor(t.q, Dp), kt, kBlockN, t.p, kBlockN);  // S = Q K^T
    if (p.q_dot != nullptr)  // dS = Q_dot K^T
      Gemm<A, false>(rows, kBlockN, D, RowMajor(t.q_dot, Dp), kt, kBlockN, t.ds, kBlockN);
    if (in.k_dot_transposed != nullptr) {  // dS += Q K_dot^T
      const A* k_dot_t = in.k_dot_transposed->Tile(b, h_kv, n_block);
      if (p.q_dot != nullptr)
        Gemm<A, true>(rows, kBlockN, D, RowMajor(t.q, Dp), k_dot_t, kBlockN, t.ds, kBlockN);
      else
        Gemm<A, false>(rows, kBlockN, D, RowMajor(t.q, Dp), k_dot_t, kBlockN, t.ds, kBlockN);
    } else if (p.q_dot == nullptr && has_ds) {  // only the bias moves
      std::fill(t.ds, t.ds + rows * kBlockN, A(0));
    }
    const bool all_visible = cols == kBlockN && head.mask.AllVisible(i0, i0 + rows, j0, j0 + cols);
    for (int64_t r = 0; r < rows; ++r) {
      A* p_row = t.p + r * kBlockN;
      A* ds_row = t.ds + r * kBlockN;
      const A pds_sum = ProbsAndTangentRow<A>(p, head, bias_dot_head, i0 + r, j0, cols,
                                              all_visible, has_ds, t.lse2[r], p_row, ds_row,
                                              t.sech2 + r * kBlockN);
      t.lse_dot[r] += pds_sum;
      if (has_ds && !shift_set[r]) {
        A p_sum = 0;
        for (int64_t c = 0; c < cols; ++c) p_sum += p_row[c];
        if (p_sum > 0) {
          t.shift[r] = pds_sum / p_sum;
          shift_set[r] = true;
        }
      }
      if (head.dropout.enabled)  // lse_dot used P itself; the products use Pd
        ForEachDropoutColumn(head.dropout, i0 + r, j0, cols, [&](int64_t c, bool kept) {
          p_row[c] = kept ? p_row[c] * keep_scale : A(0);
          if (has_ds) ds_row[c] = kept ? ds_row[c] * keep_scale : A(0);
        });
      if (shift_set[r]) {  // Pd o (dS - c): 0 where Pd is
        const A c_r = t.shift[r];
        for (int64_t c = 0; c < cols; ++c) ds_row[c] -= c_r * p_row[c];
      }
    }
    if (has_ds)  // acc += (Pd o dS) V
      Gemm<A, true>(rows, Dp, kBlockN, RowMajor<A>(t.ds, kBlockN), in.v_rows.Tile(b, h_kv, n_block),
                    Dp, t.acc, Dp);
    if (in.v_dot_rows != nullptr)  // acc += Pd V_dot
      Gemm<A, true>(rows, Dp, kBlockN, RowMajor<A>(t.p, kBlockN),
                    in.v_dot_rows->Tile(b, h_kv, n_block), Dp, t.acc, Dp);
  }

  // out_dot = acc - (lse_dot - c) o out, with out as the forward wrote it.
  const T* out = static_cast<const T*>(p.out);
  T* out_dot = static_cast<T*>(p.out_dot);
  for (int64_t r = 0; r < rows; ++r) {
    const T* o_row = out + p.out_strides.offset(b, i0 + r, h);
    T* d_row = out_dot + p.out_dot_strides.offset(b, i0 + r, h);
    const A* acc_row = t.acc + r * Dp;
    const A weight = t.lse_dot[r] - t.shift[r];
    for (int64_t c = 0; c < D; ++c)
      d_row[c] = FromAcc<T>(acc_row[c] - weight * ToAcc<A>(o_row[c]));
  }
  A* lse_dot = static_cast<A*>(p.lse_dot) + (b * s.num_heads_q + h) * s.seqlen_q + i0;
  std::copy(t.lse_dot, t.lse_dot + rows, lse_dot);
}

template <typename T>
void Jvp(const JvpParams& p, const ParallelFor& parallel_for) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const auto pack = [&](const void* x, const SeqStrides& strides, TileLayout layout) {
    return PackedTensor<A>(static_cast<const T*>(x), strides, s.batch, s.seqlen_k, s.num_heads_kv,
                           s.head_dim, kBlockN, layout, parallel_for);
  };
  const PackedTensor<A> k_transposed = pack(p.k, p.k_strides, TileLayout::kTransposed);
  const PackedTensor<A> v_rows = pack(p.v, p.v_strides, TileLayout::kRows);
  // Absent tangents are packed as empty tensors and never read.
  const PackedTensor<A> k_dot_transposed =
      p.k_dot != nullptr ? pack(p.k_dot, p.k_dot_strides, TileLayout::kTransposed)
                         : PackedTensor<A>();
  const PackedTensor<A> v_dot_rows =
      p.v_dot != nullptr ? pack(p.v_dot, p.v_dot_strides, TileLayout::kRows) : PackedTensor<A>();
  const JvpInputs<A> in{p, k_transposed, v_rows, p.k_dot != nullptr ? &k_dot_transposed : nullptr,
                        p.v_dot != nullptr ? &v_dot_rows : nullptr};
  parallel_for(QueryItem::Count(s), [&in](int64_t item) { JvpItem<T>(in, item); });
}

}  // namespace

void FlashJvp(const JvpParams& p, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF32: return Jvp<float>(p, parallel_for);
    case DType::kF64: return Jvp<double>(p, parallel_for);
    case DType::kBF16: return Jvp<bf16>(p, parallel_for);
    case DType::kF16: return Jvp<f16>(p, parallel_for);
  }
}

}  // namespace jax_flash::cpu

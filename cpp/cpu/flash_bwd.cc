// CPU FlashAttention-2 backward.
//
// Three parallel passes, each writing disjoint outputs, so the result is
// deterministic and needs no atomics:
//   1. D = rowsum(dO * O) per query row.
//   2. dK, dV: work item (batch, kv head, key block); loops over the query
//      blocks of every query head in the GQA group that can see the block.
//   3. dQ: work item (batch, query head, query block); loops over key blocks.
//   4. dbias, when there is a bias (see DbiasItem).
// Both 2 and 3 recompute P = exp(x - lse) and dS = P * (dP - D) tile by tile
// from Q, dO, K, V packed once per call (packed.h). Recomputing in pass 3
// costs three extra tile products per tile over a single pass with a shared
// dQ accumulator, but a single pass would need atomics or one dQ copy per
// thread.
#include <cmath>
#include <limits>

#include "cpu/kernels.h"
#include "cpu/packed.h"
#include "cpu/scores.h"
#include "cpu/tile.h"

namespace jax_flash::cpu {
namespace {

// The backward's inputs, packed once: query-side tiles of kBlockM rows,
// key-side tiles of kBlockN rows.
template <typename A>
struct BwdInputs {
  const BwdParams& p;
  const PackedTensor<A>& q_rows;        // [kBlockM][Dp]
  const PackedTensor<A>& dout_rows;     // [kBlockM][Dp]
  const PackedTensor<A>& k_transposed;  // [D][kBlockN]
  const PackedTensor<A>& v_transposed;  // [D][kBlockN]
  const PackedTensor<A>& k_rows;        // [kBlockN][Dp]
};

// Per-thread tiles of the backward, row-major.
template <typename A>
struct BwdTiles {
  A *p, *ds, *sech2, *acc0, *acc1, *lse2, *delta;

  static BwdTiles Get(int64_t Dp) {
    thread_local Scratch<A> scratch;
    const int64_t tile = kBlockM * kBlockN;
    const int64_t acc = std::max(kBlockM, kBlockN) * Dp;
    A* base = scratch.Get(3 * tile + 2 * acc + 2 * kBlockM);
    BwdTiles t;
    t.p = base;
    t.ds = t.p + tile;
    t.sech2 = t.ds + tile;
    t.acc0 = t.sech2 + tile;
    t.acc1 = t.acc0 + acc;
    t.lse2 = t.acc1 + acc;
    t.delta = t.lse2 + kBlockM;
    return t;
  }
};

// Loads lse (in base 2) and D of query rows [i0, i0 + rows) of head h.
template <typename A>
void LoadRowStats(const BwdParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows,
                  BwdTiles<A>& t) {
  const AttentionShape& s = p.shape;
  const int64_t row_offset = (b * s.num_heads_q + h) * s.seqlen_q + i0;
  const A* lse = static_cast<const A*>(p.lse) + row_offset;
  const A* delta = static_cast<const A*>(p.delta) + row_offset;
  for (int64_t r = 0; r < rows; ++r) {
    // A row with no visible key has lse = -inf; +inf makes every P in it 0.
    t.lse2[r] = std::isinf(lse[r]) && lse[r] < 0 ? std::numeric_limits<A>::infinity()
                                                 : lse[r] * static_cast<A>(kLog2e);
    t.delta[r] = delta[r];
  }
}

// For query rows [i0, i0 + rows) of (b, h) against key block n_block:
// t.p = P as the forward applied it to V (after dropout) and t.ds = dS, the
// gradient with respect to the logits before the soft cap (which is also
// the bias gradient); rows x kBlockN, columns past the keys are 0. The
// softmax scale is applied by the callers when they write dQ and dK.
template <typename A>
void ProbsAndScoreGrads(const BwdInputs<A>& in, const HeadView<A>& head, int64_t b, int64_t h,
                        int64_t m_block, int64_t rows, int64_t n_block, BwdTiles<A>& t) {
  const BwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const int64_t h_kv = h / s.group_size();
  const int64_t i0 = m_block * kBlockM, j0 = n_block * kBlockN;
  const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
  const Lhs<A> q = RowMajor(in.q_rows.Tile(b, h, m_block), Dp);
  const Lhs<A> dout = RowMajor(in.dout_rows.Tile(b, h, m_block), Dp);
  Gemm<A, false>(rows, kBlockN, D, q, in.k_transposed.Tile(b, h_kv, n_block), kBlockN, t.p,
                 kBlockN);  // S = Q K^T
  Gemm<A, false>(rows, kBlockN, D, dout, in.v_transposed.Tile(b, h_kv, n_block), kBlockN, t.ds,
                 kBlockN);  // dP = dO V^T
  const bool all_visible =
      cols == kBlockN && head.mask.AllVisible(i0, i0 + rows, j0, j0 + cols);
  const bool capped = p.score.softcap > 0;
  const A keep_scale = static_cast<A>(p.dropout.keep_scale());
  for (int64_t r = 0; r < rows; ++r) {
    A* p_row = t.p + r * kBlockN;
    A* ds_row = t.ds + r * kBlockN;
    A* sech2_row = t.sech2 + r * kBlockN;
    ScoreRow<A>(p_row, p.score, head, i0 + r, j0, cols, all_visible, capped ? sech2_row : nullptr);
    const A delta = t.delta[r];
    if (!head.dropout.enabled) {
      for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
        const Vec<A> prob = Exp2<A>(Load(p_row + c) - t.lse2[r]);
        Store(p_row + c, prob);
        Store(ds_row + c, prob * (Load(ds_row + c) - delta));  // dS = P (dP - D)
      }
    } else {
      // The forward used Z P / (1 - rate) for P V, so dV sees that and dP
      // flows back through the same mask Z; D = rowsum(dO O) already holds it.
      for (int64_t c = 0; c < kBlockN; c += kLanes<A>)
        Store(p_row + c, Exp2<A>(Load(p_row + c) - t.lse2[r]));
      ForEachDropoutColumn(head.dropout, i0 + r, j0, cols, [&](int64_t c, bool kept) {
        const A prob = p_row[c];
        ds_row[c] = prob * ((kept ? ds_row[c] * keep_scale : A(0)) - delta);
        p_row[c] = kept ? prob * keep_scale : A(0);
      });
      for (int64_t c = cols; c < kBlockN; ++c) ds_row[c] = p_row[c] = 0;
    }
    if (capped) {  // d(cap tanh(x / cap)) / dx = sech^2(x / cap)
      for (int64_t c = 0; c < kBlockN; c += kLanes<A>)
        Store(ds_row + c, Load(ds_row + c) * Load(sech2_row + c));
    }
  }
}

// Multiplies rows x Dp accumulators by the softmax scale before they are written.
template <typename A>
void Scale(A* acc, int64_t rows, int64_t Dp, A scale) {
  for (int64_t i = 0; i < rows * Dp; i += kLanes<A>) Store(acc + i, Load(acc + i) * scale);
}

template <typename T>
void DeltaItem(const BwdParams& p, int64_t item) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t b = item / num_m_blocks;
  const int64_t i0 = item % num_m_blocks * kBlockM;
  const int64_t i1 = std::min(i0 + kBlockM, s.seqlen_q);
  const T* out = static_cast<const T*>(p.out);
  const T* dout = static_cast<const T*>(p.dout);
  A* delta = static_cast<A*>(p.delta);
  for (int64_t h = 0; h < s.num_heads_q; ++h)
    for (int64_t i = i0; i < i1; ++i) {
      const T* o_row = out + p.out_strides.offset(b, i, h);
      const T* do_row = dout + p.dout_strides.offset(b, i, h);
      A sum = 0;
      for (int64_t c = 0; c < s.head_dim; ++c) sum += ToAcc<A>(o_row[c]) * ToAcc<A>(do_row[c]);
      delta[(b * s.num_heads_q + h) * s.seqlen_q + i] = sum;
    }
}

template <typename T>
void DkDvItem(const BwdInputs<Acc<T>>& in, int64_t item) {
  using A = Acc<T>;
  const BwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const int64_t num_kv_heads_total = s.batch * s.num_heads_kv;
  // Key-block major: with a causal mask the first key blocks are seen by the
  // most queries, so the longest items go first.
  const int64_t n_block = item / num_kv_heads_total;
  const int64_t b = item % num_kv_heads_total / s.num_heads_kv;
  const int64_t h_kv = item % num_kv_heads_total % s.num_heads_kv;
  const int64_t j0 = n_block * kBlockN;
  const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
  BwdTiles<A> t = BwdTiles<A>::Get(Dp);
  A* dk = t.acc0;
  A* dv = t.acc1;
  std::fill(dk, dk + kBlockN * Dp, A(0));
  std::fill(dv, dv + kBlockN * Dp, A(0));

  for (int64_t g = 0; g < s.group_size(); ++g) {
    const int64_t h = h_kv * s.group_size() + g;
    const HeadView<A> head = HeadView<A>::For(p, b, h);
    int64_t i_begin, i_end;
    head.mask.QueryRange(j0, j0 + cols, &i_begin, &i_end);
    for (int64_t m_block = i_begin / kBlockM; m_block * kBlockM < i_end; ++m_block) {
      const int64_t rows = std::min(kBlockM, s.seqlen_q - m_block * kBlockM);
      if (!head.TileMayBeVisible(m_block * kBlockM, rows, j0, cols)) continue;
      LoadRowStats(p, b, h, m_block * kBlockM, rows, t);
      ProbsAndScoreGrads(in, head, b, h, m_block, rows, n_block, t);
      Gemm<A, true>(cols, Dp, rows, Transposed<A>(t.p, kBlockN),
                    in.dout_rows.Tile(b, h, m_block), Dp, dv, Dp);  // dV += P^T dO
      Gemm<A, true>(cols, Dp, rows, Transposed<A>(t.ds, kBlockN),
                    in.q_rows.Tile(b, h, m_block), Dp, dk, Dp);  // dK += dS^T Q
    }
  }
  Scale(dk, cols, Dp, static_cast<A>(p.score.scale));
  UnpackRows(dk, Dp, cols, D, static_cast<T*>(p.dk), p.dk_strides, b, h_kv, j0);
  UnpackRows(dv, Dp, cols, D, static_cast<T*>(p.dv), p.dv_strides, b, h_kv, j0);
}

template <typename T>
void DqItem(const BwdInputs<Acc<T>>& in, int64_t item) {
  using A = Acc<T>;
  const BwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const QueryItem qi = QueryItem::Of(s, item);
  const int64_t b = qi.b, h = qi.h, h_kv = qi.h_kv, i0 = qi.i0, rows = qi.rows;
  const HeadView<A> head = HeadView<A>::For(p, b, h);
  BwdTiles<A> t = BwdTiles<A>::Get(Dp);
  A* dq = t.acc0;

  LoadRowStats(p, b, h, i0, rows, t);
  std::fill(dq, dq + rows * Dp, A(0));
  int64_t j_begin, j_end;
  head.mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
  for (int64_t n_block = j_begin / kBlockN; n_block * kBlockN < j_end; ++n_block) {
    const int64_t j0 = n_block * kBlockN;
    if (!head.TileMayBeVisible(i0, rows, j0, std::min(kBlockN, s.seqlen_k - j0))) continue;
    ProbsAndScoreGrads(in, head, b, h, qi.m_block, rows, n_block, t);
    Gemm<A, true>(rows, Dp, kBlockN, RowMajor<A>(t.ds, kBlockN), in.k_rows.Tile(b, h_kv, n_block),
                  Dp, dq, Dp);  // dQ += dS K
  }
  Scale(dq, rows, Dp, static_cast<A>(p.score.scale));
  UnpackRows(dq, Dp, rows, D, static_cast<T*>(p.dq), p.dq_strides, b, h, i0);
}

// dbias = dS summed over the dimensions along which the bias broadcasts.
// Work item: one (bias batch, bias head, block of bias rows); it owns those
// rows of dbias and visits every (b, h, query block) that maps onto them,
// so no two items write the same element. dS is recomputed here rather than
// kept from the dK/dV pass, which would need an Sq x Sk buffer.
template <typename T>
void DbiasItem(const BwdInputs<Acc<T>>& in, int64_t item) {
  using A = Acc<T>;
  const BwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const int64_t* dims = p.score.bias_dims;  // (Bb, Hb, Tb, Sb), each 1 or full
  const bool per_row = dims[2] == s.seqlen_q, per_col = dims[3] == s.seqlen_k;
  const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t row_items = per_row ? num_m_blocks : 1;
  const int64_t bias_b = item / (dims[1] * row_items);
  const int64_t bias_h = item / row_items % dims[1];
  const int64_t m_first = per_row ? item % row_items : 0;
  const int64_t m_last = per_row ? m_first + 1 : num_m_blocks;
  A* dbias = static_cast<A*>(p.dbias) + (bias_b * dims[1] + bias_h) * dims[2] * dims[3];
  const int64_t row_stride = per_row ? dims[3] : 0;
  const int64_t col_stride = per_col ? 1 : 0;
  if (per_row) {
    const int64_t i0 = m_first * kBlockM;
    std::fill(dbias + i0 * dims[3], dbias + std::min(i0 + kBlockM, s.seqlen_q) * dims[3], A(0));
  } else {
    std::fill(dbias, dbias + dims[3], A(0));
  }
  BwdTiles<A> t = BwdTiles<A>::Get(PaddedHeadDim<A>(s.head_dim));
  const int64_t b_count = dims[0] == 1 ? s.batch : 1, h_count = dims[1] == 1 ? s.num_heads_q : 1;
  for (int64_t bi = 0; bi < b_count; ++bi)
    for (int64_t hi = 0; hi < h_count; ++hi) {
      const int64_t b = dims[0] == 1 ? bi : bias_b, h = dims[1] == 1 ? hi : bias_h;
      const HeadView<A> head = HeadView<A>::For(p, b, h);
      for (int64_t m_block = m_first; m_block < m_last; ++m_block) {
        const int64_t i0 = m_block * kBlockM;
        const int64_t rows = std::min(kBlockM, s.seqlen_q - i0);
        LoadRowStats(p, b, h, i0, rows, t);
        int64_t j_begin, j_end;
        head.mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
        for (int64_t n_block = j_begin / kBlockN; n_block * kBlockN < j_end; ++n_block) {
          const int64_t j0 = n_block * kBlockN;
          const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
          if (!head.TileMayBeVisible(i0, rows, j0, cols)) continue;
          ProbsAndScoreGrads(in, head, b, h, m_block, rows, n_block, t);
          for (int64_t r = 0; r < rows; ++r) {
            A* out_row = dbias + (i0 + r) * row_stride + j0 * col_stride;
            const A* ds_row = t.ds + r * kBlockN;
            if (per_col) {
              for (int64_t c = 0; c < cols; ++c) out_row[c] += ds_row[c];
            } else {  // summed over keys: lane-wise partial sums keep the error small
              Vec<A> sum{};
              for (int64_t c = 0; c < kBlockN; c += kLanes<A>) sum += Load(ds_row + c);
              out_row[0] += ReduceSum<A>(sum);
            }
          }
        }
      }
    }
}

template <typename T>
void Bwd(const BwdParams& p, const ParallelFor& parallel_for) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const int64_t B = s.batch, Sq = s.seqlen_q, Sk = s.seqlen_k, D = s.head_dim;
  const int64_t num_m_blocks = (Sq + kBlockM - 1) / kBlockM;
  const int64_t num_n_blocks = (Sk + kBlockN - 1) / kBlockN;
  parallel_for(B * num_m_blocks, [&p](int64_t item) { DeltaItem<T>(p, item); });
  const PackedTensor<A> q_rows(static_cast<const T*>(p.q), p.q_strides, B, Sq, s.num_heads_q, D,
                               kBlockM, TileLayout::kRows, parallel_for);
  const PackedTensor<A> dout_rows(static_cast<const T*>(p.dout), p.dout_strides, B, Sq,
                                  s.num_heads_q, D, kBlockM, TileLayout::kRows, parallel_for);
  const PackedTensor<A> k_transposed(static_cast<const T*>(p.k), p.k_strides, B, Sk,
                                     s.num_heads_kv, D, kBlockN, TileLayout::kTransposed,
                                     parallel_for);
  const PackedTensor<A> v_transposed(static_cast<const T*>(p.v), p.v_strides, B, Sk,
                                     s.num_heads_kv, D, kBlockN, TileLayout::kTransposed,
                                     parallel_for);
  const PackedTensor<A> k_rows(static_cast<const T*>(p.k), p.k_strides, B, Sk, s.num_heads_kv,
                               D, kBlockN, TileLayout::kRows, parallel_for);
  const BwdInputs<A> in{p, q_rows, dout_rows, k_transposed, v_transposed, k_rows};
  parallel_for(B * s.num_heads_kv * num_n_blocks, [&in](int64_t item) { DkDvItem<T>(in, item); });
  parallel_for(QueryItem::Count(s), [&in](int64_t item) { DqItem<T>(in, item); });
  if (p.dbias != nullptr) {
    const int64_t* dims = p.score.bias_dims;
    const int64_t row_items = dims[2] == Sq ? num_m_blocks : 1;
    parallel_for(dims[0] * dims[1] * row_items, [&in](int64_t item) { DbiasItem<T>(in, item); });
  }
}

}  // namespace

void FlashBwd(const BwdParams& p, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kF32: return Bwd<float>(p, parallel_for);
    case DType::kF64: return Bwd<double>(p, parallel_for);
    case DType::kBF16: return Bwd<bf16>(p, parallel_for);
    case DType::kF16: return Bwd<f16>(p, parallel_for);
  }
}

}  // namespace jax_flash::cpu

// CPU FlashAttention-2 backward.
//
// Three parallel passes, each writing disjoint outputs, so the result is
// deterministic and needs no atomics:
//   1. D = rowsum(dO * O) per query row.
//   2. dK, dV: work item (batch, kv head, key block); loops over the query
//      blocks of every query head in the GQA group that can see the block.
//   3. dQ: work item (batch, query head, query block); loops over key blocks.
// Both 2 and 3 recompute P = exp(x - lse) and dS = P * (dP - D) tile by tile.
// Recomputing in pass 3 costs three extra tile products per tile over a
// single pass with a shared dQ accumulator, but a single pass would need
// either atomics or one dQ copy per thread.
#include <cmath>
#include <limits>

#include "cpu/kernels.h"
#include "cpu/scores.h"
#include "cpu/tile.h"

namespace jax_flash::cpu {
namespace {

// Per-thread tiles of the backward. Row-major; ld of head-dim tiles is Dp.
template <typename A>
struct BwdTiles {
  A *q, *dout, *kt, *vt, *k_rows, *p, *ds, *tanh, *transposed, *dk, *dv, *dq, *lse2, *delta;

  static BwdTiles Get(int64_t D, int64_t Dp) {
    thread_local Scratch<A> scratch;
    const int64_t tile = kBlockM * kBlockN;
    A* base = scratch.Get(3 * kBlockM * Dp + 3 * kBlockN * Dp + 2 * D * kBlockN + 4 * tile +
                          2 * kBlockM);
    BwdTiles t;
    t.q = base;
    t.dout = t.q + kBlockM * Dp;
    t.dq = t.dout + kBlockM * Dp;
    t.k_rows = t.dq + kBlockM * Dp;
    t.dk = t.k_rows + kBlockN * Dp;
    t.dv = t.dk + kBlockN * Dp;
    t.kt = t.dv + kBlockN * Dp;
    t.vt = t.kt + D * kBlockN;
    t.p = t.vt + D * kBlockN;
    t.ds = t.p + tile;
    t.tanh = t.ds + tile;
    t.transposed = t.tanh + tile;
    t.lse2 = t.transposed + tile;
    t.delta = t.lse2 + kBlockM;
    return t;
  }
};

// Loads what pass 2 and 3 need of query rows [i0, i0 + rows) of head h:
// Q, dO, lse in base 2, and D.
template <typename T, typename A>
void LoadQueryBlock(const BwdParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows,
                    int64_t Dp, BwdTiles<A>& t) {
  const AttentionShape& s = p.shape;
  PackRows(static_cast<const T*>(p.q), p.q_strides, b, h, i0, rows, rows, s.head_dim, t.q, Dp);
  PackRows(static_cast<const T*>(p.dout), p.dout_strides, b, h, i0, rows, rows, s.head_dim,
           t.dout, Dp);
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

// For query rows [i0, i0 + rows) against keys [j0, j0 + cols): t.p = P and
// t.ds = dS with respect to the raw products q.k (soft cap and scale folded
// in), both rows x kBlockN; columns >= cols are 0.
template <typename A>
void ProbsAndScoreGrads(const BwdParams& p, const BatchMask& mask, int64_t i0, int64_t rows,
                        int64_t j0, int64_t cols, int64_t Dp, BwdTiles<A>& t) {
  const int64_t D = p.shape.head_dim;
  Gemm<A, false>(rows, kBlockN, D, t.q, Dp, t.kt, kBlockN, t.p, kBlockN);      // S = Q K^T
  Gemm<A, false>(rows, kBlockN, D, t.dout, Dp, t.vt, kBlockN, t.ds, kBlockN);  // dP = dO V^T
  const bool all_visible = cols == kBlockN && mask.AllVisible(i0, i0 + rows, j0, j0 + cols);
  const bool capped = p.score.softcap > 0;
  const A scale = static_cast<A>(p.score.scale);
  for (int64_t r = 0; r < rows; ++r) {
    A* p_row = t.p + r * kBlockN;
    A* ds_row = t.ds + r * kBlockN;
    A* tanh_row = t.tanh + r * kBlockN;
    ScoreRow<A>(p_row, p.score, mask, i0 + r, j0, cols, all_visible, capped ? tanh_row : nullptr);
    for (int64_t c = 0; c < kBlockN; c += kLanes<A>) {
      const Vec<A> prob = Exp2<A>(Load(p_row + c) - t.lse2[r]);
      Store(p_row + c, prob);
      Vec<A> ds = prob * (Load(ds_row + c) - t.delta[r]);
      if (capped) {
        const Vec<A> th = Load(tanh_row + c);
        ds *= 1 - th * th;  // d(cap * tanh(x / cap)) / dx
      }
      Store(ds_row + c, ds * scale);
    }
  }
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
void DkDvItem(const BwdParams& p, int64_t item) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const int64_t num_kv_heads_total = s.batch * s.num_heads_kv;
  // Key-block major: with a causal mask the first key blocks are seen by the
  // most queries, so the longest items go first.
  const int64_t j0 = item / num_kv_heads_total * kBlockN;
  const int64_t b = item % num_kv_heads_total / s.num_heads_kv;
  const int64_t h_kv = item % num_kv_heads_total % s.num_heads_kv;
  const int64_t cols = std::min(kBlockN, s.seqlen_k - j0);
  const BatchMask mask = BatchMask::For(p.mask, b, s.seqlen_q, s.seqlen_k);
  BwdTiles<A> t = BwdTiles<A>::Get(D, Dp);

  PackColumns(static_cast<const T*>(p.k), p.k_strides, b, h_kv, j0, cols, D, t.kt, kBlockN);
  PackColumns(static_cast<const T*>(p.v), p.v_strides, b, h_kv, j0, cols, D, t.vt, kBlockN);
  std::fill(t.dk, t.dk + kBlockN * Dp, A(0));
  std::fill(t.dv, t.dv + kBlockN * Dp, A(0));

  int64_t i_begin, i_end;
  mask.QueryRange(j0, j0 + cols, &i_begin, &i_end);
  for (int64_t g = 0; g < s.group_size(); ++g) {
    const int64_t h = h_kv * s.group_size() + g;
    for (int64_t i0 = i_begin; i0 < i_end; i0 += kBlockM) {
      const int64_t rows = std::min(kBlockM, i_end - i0);
      LoadQueryBlock<T>(p, b, h, i0, rows, Dp, t);
      ProbsAndScoreGrads(p, mask, i0, rows, j0, cols, Dp, t);
      Transpose(t.p, kBlockN, rows, cols, t.transposed, kBlockM);
      Gemm<A, true>(cols, Dp, rows, t.transposed, kBlockM, t.dout, Dp, t.dv, Dp);  // dV += P^T dO
      Transpose(t.ds, kBlockN, rows, cols, t.transposed, kBlockM);
      Gemm<A, true>(cols, Dp, rows, t.transposed, kBlockM, t.q, Dp, t.dk, Dp);  // dK += dS^T Q
    }
  }
  UnpackRows(t.dk, Dp, cols, D, static_cast<T*>(p.dk), p.dk_strides, b, h_kv, j0);
  UnpackRows(t.dv, Dp, cols, D, static_cast<T*>(p.dv), p.dv_strides, b, h_kv, j0);
}

template <typename T>
void DqItem(const BwdParams& p, int64_t item) {
  using A = Acc<T>;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t num_heads_total = s.batch * s.num_heads_q;
  // Longest first, as in the forward.
  const int64_t i0 = (num_m_blocks - 1 - item / num_heads_total) * kBlockM;
  const int64_t b = item % num_heads_total / s.num_heads_q;
  const int64_t h = item % num_heads_total % s.num_heads_q;
  const int64_t h_kv = h / s.group_size();
  const int64_t rows = std::min(kBlockM, s.seqlen_q - i0);
  const BatchMask mask = BatchMask::For(p.mask, b, s.seqlen_q, s.seqlen_k);
  BwdTiles<A> t = BwdTiles<A>::Get(D, Dp);

  LoadQueryBlock<T>(p, b, h, i0, rows, Dp, t);
  std::fill(t.dq, t.dq + rows * Dp, A(0));
  int64_t j_begin, j_end;
  mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlockN) {
    const int64_t cols = std::min(kBlockN, j_end - j0);
    PackColumns(static_cast<const T*>(p.k), p.k_strides, b, h_kv, j0, cols, D, t.kt, kBlockN);
    PackColumns(static_cast<const T*>(p.v), p.v_strides, b, h_kv, j0, cols, D, t.vt, kBlockN);
    PackRows(static_cast<const T*>(p.k), p.k_strides, b, h_kv, j0, cols, kBlockN, D, t.k_rows, Dp);
    ProbsAndScoreGrads(p, mask, i0, rows, j0, cols, Dp, t);
    Gemm<A, true>(rows, Dp, kBlockN, t.ds, kBlockN, t.k_rows, Dp, t.dq, Dp);  // dQ += dS K
  }
  UnpackRows(t.dq, Dp, rows, D, static_cast<T*>(p.dq), p.dq_strides, b, h, i0);
}

template <typename T>
void Bwd(const BwdParams& p, const ParallelFor& parallel_for) {
  const AttentionShape& s = p.shape;
  const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t num_n_blocks = (s.seqlen_k + kBlockN - 1) / kBlockN;
  parallel_for(s.batch * num_m_blocks, [&p](int64_t item) { DeltaItem<T>(p, item); });
  parallel_for(s.batch * s.num_heads_kv * num_n_blocks, [&p](int64_t item) { DkDvItem<T>(p, item); });
  parallel_for(s.batch * s.num_heads_q * num_m_blocks, [&p](int64_t item) { DqItem<T>(p, item); });
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

// CPU FlashAttention-2 backward.
//
// Three parallel passes, each writing disjoint outputs, so the result is
// deterministic and needs no atomics:
//   1. D = rowsum(dO * O) per query row.
//   2. dK, dV: work item (batch, kv head, key block); loops over the query
//      blocks of every query head in the GQA group that can see the block.
//   3. dQ: work item (batch, query head, query block); loops over key blocks.
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
  A *p, *ds, *tanh, *acc0, *acc1, *lse2, *delta;

  static BwdTiles Get(int64_t Dp) {
    thread_local Scratch<A> scratch;
    const int64_t tile = kBlockM * kBlockN;
    const int64_t acc = std::max(kBlockM, kBlockN) * Dp;
    A* base = scratch.Get(3 * tile + 2 * acc + 2 * kBlockM);
    BwdTiles t;
    t.p = base;
    t.ds = t.p + tile;
    t.tanh = t.ds + tile;
    t.acc0 = t.tanh + tile;
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
// t.p = P and t.ds = dS with respect to the raw products q.k (soft cap and
// scale folded in), both rows x kBlockN; columns past the keys are 0.
template <typename A>
void ProbsAndScoreGrads(const BwdInputs<A>& in, const BatchMask& mask, int64_t b, int64_t h,
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
  const BatchMask mask = BatchMask::For(p.mask, b, s.seqlen_q, s.seqlen_k);
  BwdTiles<A> t = BwdTiles<A>::Get(Dp);
  A* dk = t.acc0;
  A* dv = t.acc1;
  std::fill(dk, dk + kBlockN * Dp, A(0));
  std::fill(dv, dv + kBlockN * Dp, A(0));

  int64_t i_begin, i_end;
  mask.QueryRange(j0, j0 + cols, &i_begin, &i_end);
  for (int64_t g = 0; g < s.group_size(); ++g) {
    const int64_t h = h_kv * s.group_size() + g;
    for (int64_t m_block = i_begin / kBlockM; m_block * kBlockM < i_end; ++m_block) {
      const int64_t rows = std::min(kBlockM, s.seqlen_q - m_block * kBlockM);
      LoadRowStats(p, b, h, m_block * kBlockM, rows, t);
      ProbsAndScoreGrads(in, mask, b, h, m_block, rows, n_block, t);
      Gemm<A, true>(cols, Dp, rows, Transposed<A>(t.p, kBlockN),
                    in.dout_rows.Tile(b, h, m_block), Dp, dv, Dp);  // dV += P^T dO
      Gemm<A, true>(cols, Dp, rows, Transposed<A>(t.ds, kBlockN),
                    in.q_rows.Tile(b, h, m_block), Dp, dk, Dp);  // dK += dS^T Q
    }
  }
  UnpackRows(dk, Dp, cols, D, static_cast<T*>(p.dk), p.dk_strides, b, h_kv, j0);
  UnpackRows(dv, Dp, cols, D, static_cast<T*>(p.dv), p.dv_strides, b, h_kv, j0);
}

template <typename T>
void DqItem(const BwdInputs<Acc<T>>& in, int64_t item) {
  using A = Acc<T>;
  const BwdParams& p = in.p;
  const AttentionShape& s = p.shape;
  const int64_t D = s.head_dim, Dp = PaddedHeadDim<A>(D);
  const int64_t num_m_blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t num_heads_total = s.batch * s.num_heads_q;
  // Longest first, as in the forward.
  const int64_t m_block = num_m_blocks - 1 - item / num_heads_total;
  const int64_t b = item % num_heads_total / s.num_heads_q;
  const int64_t h = item % num_heads_total % s.num_heads_q;
  const int64_t h_kv = h / s.group_size();
  const int64_t i0 = m_block * kBlockM;
  const int64_t rows = std::min(kBlockM, s.seqlen_q - i0);
  const BatchMask mask = BatchMask::For(p.mask, b, s.seqlen_q, s.seqlen_k);
  BwdTiles<A> t = BwdTiles<A>::Get(Dp);
  A* dq = t.acc0;

  LoadRowStats(p, b, h, i0, rows, t);
  std::fill(dq, dq + rows * Dp, A(0));
  int64_t j_begin, j_end;
  mask.KeyRange(i0, i0 + rows, &j_begin, &j_end);
  for (int64_t n_block = j_begin / kBlockN; n_block * kBlockN < j_end; ++n_block) {
    ProbsAndScoreGrads(in, mask, b, h, m_block, rows, n_block, t);
    Gemm<A, true>(rows, Dp, kBlockN, RowMajor<A>(t.ds, kBlockN), in.k_rows.Tile(b, h_kv, n_block),
                  Dp, dq, Dp);  // dQ += dS K
  }
  UnpackRows(dq, Dp, rows, D, static_cast<T*>(p.dq), p.dq_strides, b, h, i0);
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
  parallel_for(B * s.num_heads_q * num_m_blocks, [&in](int64_t item) { DqItem<T>(in, item); });
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

// Exact FlashAttention-2 backward: SIMT, IEEE arithmetic in the accumulation
// type, any head_dim in [1, 256], any sequence lengths, GQA.
//
// Up to four kernels, in stream order:
//   1. Delta:  D = rowsum(dO * O) per query row, into the scratch buffer.
//   2. dK/dV:  one block per (batch, kv head, key block); it loops over the
//              query blocks (QueryRange) of every query head of its group:
//                P  = exp(S - lse),  dP = dO V^T,  dS = P * (dP - D)
//                dV += P^T dO,  dK += dS^T Q     (dK, dV in registers)
//   3. dQ:     one block per (batch, query head, query block); it loops over
//              the key blocks (KeyRange): dQ += dS K   (dQ in registers)
//   4. dbias (with a bias): one block per block of the bias's own shape; it
//              loops over the (batch, head, query block, key block) tiles
//              that map onto it and sums dS over the broadcast dimensions.
// Every output element is written by exactly one block and summed in a fixed
// order, so the backward needs no atomics and is deterministic by
// construction (bitwise reproducible run to run); the price is computing S and
// dP twice (three times with a bias).
//
// x = scale * q.k + bias; with a softcap x = cap * tanh(x / cap), so dS is
// multiplied by sech^2. With dropout (Z the keep mask, HeadDropout), the
// forward multiplied V by Z * P / (1 - rate): dV sees that, and
// dP = Z * (dO V^T) / (1 - rate) before dS = P * (dP - D). Rows whose lse is
// -inf (no visible key) get P = 0: their lse is replaced by +inf, so
// exp(x - lse) = 0 and no -inf - (-inf) appears.
// Instantiated once per storage type (RunExactBwd<T>, cuda/kernels.h) in a
// file generated from jax_flash/_supported.py: one instantiation per file
// keeps each compile short and lets the build run them in parallel.
#pragma once

#include <cstdint>

#include "cuda/common/math.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/views.cuh"
#include "cuda/kernels.h"
#include "cuda/simt/common.cuh"
#include "cuda/simt/tile_size.h"
#include "jax_flash/mask.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::simt {
namespace {

// ---------------------------------------------------------------------------
// 1. D = rowsum(dO * O), one warp per query row.

inline constexpr int kDeltaRowsPerBlock = kThreads / kWarpSize;

template <typename T>
__global__ void __launch_bounds__(kThreads) BwdDeltaKernel(const BwdParams p) {
  using Acc = AccType<T>;
  const AttentionShape& s = p.shape;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDeltaRowsPerBlock + warp;
  if (row >= s.batch * s.num_heads_q * s.seqlen_q) return;
  // row enumerates the (B, Hq, Sq) layout of delta.
  const int64_t i = row % s.seqlen_q;
  const int64_t h = (row / s.seqlen_q) % s.num_heads_q;
  const int64_t b = row / s.seqlen_q / s.num_heads_q;
  const T* dout = static_cast<const T*>(p.dout) + p.dout_strides.offset(b, i, h);
  const T* out = static_cast<const T*>(p.out) + p.out_strides.offset(b, i, h);
  Acc sum = Acc(0);
  for (int64_t d = lane; d < s.head_dim; d += kWarpSize) sum = fma(ToAcc(dout[d]), ToAcc(out[d]), sum);
  sum = GroupSum<kWarpSize>(sum);
  if (lane == 0) static_cast<Acc*>(p.delta)[row] = sum;
}

// ---------------------------------------------------------------------------
// Shared-memory layout of the dK/dV and dQ kernels (the same tiles).

template <typename Acc, int kMaxD>
struct BwdLayout {
  using Tiles = ExactTiles<Acc, kMaxD>;
  static constexpr int kBlockM = Tiles::kBwdBlockM;
  static constexpr int kBlockN = Tiles::kBwdBlockN;
  static constexpr int kLd = Tiles::kLd;
  static constexpr int kLdP = kBlockN + 1;  // odd: see ExactTiles
  // sQ, sdO [kBlockM][kLd]; sK, sV [kBlockN][kLd]; sP, sdS [kBlockM][kLdP];
  // sLse, sDelta [kBlockM].
  static constexpr size_t kSharedElems = size_t(2 * kBlockM + 2 * kBlockN) * kLd +
                                         size_t(2 * kBlockM) * kLdP + 2 * kBlockM;
  static constexpr size_t kSharedBytes = kSharedElems * sizeof(Acc);
  static_assert(kSharedBytes <= kMaxSharedBytes, "backward tiles exceed shared memory");
  // The dbias kernel adds one kBlockM x kLdP tile of running sums after them.
  static constexpr size_t kDbiasSharedBytes = kSharedBytes + size_t(kBlockM) * kLdP * sizeof(Acc);
  static_assert(kDbiasSharedBytes <= kMaxSharedBytes, "dbias tiles exceed shared memory");

  Acc *sQ, *sdO, *sK, *sV, *sP, *sdS, *sLse, *sDelta;

  __device__ explicit BwdLayout(unsigned char* raw) {
    sQ = reinterpret_cast<Acc*>(raw);
    sdO = sQ + kBlockM * kLd;
    sK = sdO + kBlockM * kLd;
    sV = sK + kBlockN * kLd;
    sP = sV + kBlockN * kLd;
    sdS = sP + kBlockM * kLdP;
    sLse = sdS + kBlockM * kLdP;
    sDelta = sLse + kBlockM;
  }
};

// Loads the query-side tiles of rows [i0, i0 + m_valid) of head h: Q, dO,
// lse (with -inf replaced by +inf so that P = exp(x - lse) = 0) and D.
template <typename T, int kMaxD, typename Layout>
__device__ __forceinline__ void LoadQuerySide(const BwdParams& p, const Layout& t, int64_t b,
                                              int64_t h, int64_t i0, int m_valid) {
  using Acc = AccType<T>;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  LoadTile<Layout::kBlockM, kMaxD>(t.sQ, static_cast<const T*>(p.q) + p.q_strides.offset(b, i0, h),
                                   p.q_strides.row, m_valid, head_dim);
  LoadTile<Layout::kBlockM, kMaxD>(t.sdO,
                                   static_cast<const T*>(p.dout) + p.dout_strides.offset(b, i0, h),
                                   p.dout_strides.row, m_valid, head_dim);
  for (int r = threadIdx.x; r < Layout::kBlockM; r += kThreads) {
    Acc lse = Infinity<Acc>(), delta = Acc(0);
    if (r < m_valid) {
      const int64_t at = RowStatOffset(p.shape, b, h, i0 + r);
      lse = static_cast<const Acc*>(p.lse)[at];
      if (lse == -Infinity<Acc>()) lse = Infinity<Acc>();
      delta = static_cast<const Acc*>(p.delta)[at];
    }
    t.sLse[r] = lse;
    t.sDelta[r] = delta;
  }
}

// For the tile of query rows [i0, i0 + m_valid) x keys [j0, j0 + n_valid)
// already in shared memory, computes
//   P~ = Z * P / (1 - rate), P = exp(x - lse)   (0 where invisible) -> sP
//   dS = P * (Z * dO V^T / (1 - rate) - D) * dx (0 where invisible) -> sdS
// (Z = 1 without dropout), where x is the transformed score and dx its
// derivative (softcap); dS is also the gradient of the bias. If ds_sum is not
// null, dS is also added to it, a kBlockM x kLdP shared tile in which each
// thread touches only the elements it owns (the dbias kernel). The factor
// `scale` of dS is applied once to the final dQ/dK.
template <typename Layout, typename Acc>
__device__ __forceinline__ void ProbsAndScoreGrads(const Layout& t, const HeadTerms<Acc>& head,
                                                   int64_t i0, int m_valid, int64_t j0,
                                                   int n_valid, int head_dim, Acc scale,
                                                   Acc softcap, Acc* ds_sum = nullptr) {
  constexpr int kLd = Layout::kLd, kLdP = Layout::kLdP;
  using SMap = TileMap<Layout::kBlockM, Layout::kBlockN>;
  const SMap smap(threadIdx.x);
  const BatchMask& mask = head.mask;
  Fragment<SMap, Acc> dot, dp;
  Fill<SMap, Acc>(dot, Acc(0));
  Fill<SMap, Acc>(dp, Acc(0));
  MultiplyAccumulate(smap, dot, t.sQ, kLd, 1, t.sK, kLd, 1, head_dim);   // Q K^T
  MultiplyAccumulate(smap, dp, t.sdO, kLd, 1, t.sV, kLd, 1, head_dim);   // dO V^T
  if (!smap.active) return;
  // Park the two products in sP and sdS (each thread only its own elements,
  // so no barrier is needed) and do the elementwise part as a rolled loop:
  // with the bias, mask and Philox code unrolled over the fragments, the
  // fragments stayed live across it and the kernels spilled.
  ForEachOwned(smap, kLdP, [&](int i, int j, int at) {
    t.sP[at] = dot[i][j];
    t.sdS[at] = dp[i][j];
  });
  const bool all_visible = mask.AllVisible(i0, i0 + m_valid, j0, j0 + n_valid);
#pragma unroll 1
  for (int e = 0; e < SMap::kRowsPerThread * SMap::kColsPerThread; ++e) {
    const int r = smap.row(e / SMap::kColsPerThread), c = smap.col(e % SMap::kColsPerThread);
    const int at = r * kLdP + c;
    Acc prob = Acc(0), dscore = Acc(0);
    if (r < m_valid && c < n_valid && (all_visible || mask.Visible(i0 + r, j0 + c))) {
      Acc dx;
      const Acc x = Score(t.sP[at], head.Bias(i0 + r, j0 + c), scale, softcap, &dx);
      prob = Exp(x - t.sLse[r]);
      Acc dprob = t.sdS[at];
      if (head.dropout.enabled) {
        // One Philox call per element here (the forward shares a call
        // between four keys); the draw is the same either way.
        const bool kept = head.dropout.Keep(i0 + r, j0 + c);
        dprob = kept ? dprob * head.keep_scale : Acc(0);
        dscore = prob * (dprob - t.sDelta[r]) * dx;
        prob = kept ? prob * head.keep_scale : Acc(0);
      } else {
        dscore = prob * (dprob - t.sDelta[r]) * dx;
      }
    }
    t.sP[at] = prob;  // the dQ and dbias kernels ignore it
    t.sdS[at] = dscore;
    if (ds_sum != nullptr) ds_sum[at] += dscore;
  }
}

// ---------------------------------------------------------------------------
// 2. dK, dV.

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kThreads) BwdDkDvKernel(const BwdParams p) {
  using Acc = AccType<T>;
  using L = BwdLayout<Acc, kMaxD>;
  constexpr int kBlockM = L::kBlockM, kBlockN = L::kBlockN, kLd = L::kLd, kLdP = L::kLdP;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const L t(shared_raw);

  const AttentionShape& s = p.shape;
  const int head_dim = static_cast<int>(s.head_dim);
  // (batch, kv head, key block), key block fastest; one grid dimension.
  const int64_t num_n_blocks = CeilDiv(s.seqlen_k, kBlockN);
  const int64_t n_block = blockIdx.x % num_n_blocks;
  const int64_t h_kv = (blockIdx.x / num_n_blocks) % s.num_heads_kv;
  const int64_t b = blockIdx.x / num_n_blocks / s.num_heads_kv;
  const int64_t j0 = n_block * kBlockN;
  const int n_valid = ValidRows<kBlockN>(s.seqlen_k - j0);

  // The band (hence QueryRange, block-aligned with a block mask) is the same
  // for every head.
  int64_t query_begin, query_end;
  BatchMask::WithBlocks(p.mask, b, h_kv * s.group_size(), s.seqlen_q, s.seqlen_k)
      .QueryRange(j0, j0 + n_valid, &query_begin, &query_end);

  const Acc scale = static_cast<Acc>(p.score.scale);
  const Acc softcap = static_cast<Acc>(p.score.softcap);
  LoadTile<kBlockN, kMaxD>(t.sK, static_cast<const T*>(p.k) + p.k_strides.offset(b, j0, h_kv),
                           p.k_strides.row, n_valid, head_dim);
  LoadTile<kBlockN, kMaxD>(t.sV, static_cast<const T*>(p.v) + p.v_strides.offset(b, j0, h_kv),
                           p.v_strides.row, n_valid, head_dim);

  using KvMap = TileMap<kBlockN, kMaxD>;
  const KvMap kvmap(threadIdx.x);
  Fragment<KvMap, Acc> dk, dv;
  Fill<KvMap, Acc>(dk, Acc(0));
  Fill<KvMap, Acc>(dv, Acc(0));

  // GQA: this kv head serves query heads [h_kv * G, (h_kv + 1) * G); their
  // contributions are summed here, in a fixed order.
  const int64_t group = s.group_size();
  for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
    const HeadTerms<Acc> head = HeadTerms<Acc>::For(p, b, h);
    for (int64_t i0 = query_begin; i0 < query_end; i0 += kBlockM) {
      const int m_valid = ValidRows<kBlockM>(query_end - i0);
      // A tile hidden by segments or the dense mask contributes nothing.
      if (!head.TileMayBeVisible(i0, m_valid, j0, n_valid)) continue;
      __syncthreads();  // the previous query block's readers are done
      LoadQuerySide<T, kMaxD>(p, t, b, h, i0, m_valid);
      __syncthreads();
      ProbsAndScoreGrads(t, head, i0, m_valid, j0, n_valid, head_dim, scale,
                                           softcap);
      __syncthreads();
      // Both products reduce over the query rows of the block: rows are the
      // keys (P^T, dS^T read with unit row stride), columns the head dim.
      MultiplyAccumulate(kvmap, dv, t.sP, 1, kLdP, t.sdO, 1, kLd, m_valid);  // dV += P^T dO
      MultiplyAccumulate(kvmap, dk, t.sdS, 1, kLdP, t.sQ, 1, kLd, m_valid);  // dK += dS^T Q
    }
  }

  StoreFragment<T>(kvmap, dk, scale, static_cast<T*>(p.dk) + p.dk_strides.offset(b, j0, h_kv),
                   p.dk_strides.row, n_valid, head_dim);
  StoreFragment<T>(kvmap, dv, Acc(1), static_cast<T*>(p.dv) + p.dv_strides.offset(b, j0, h_kv),
                   p.dv_strides.row, n_valid, head_dim);
}

// ---------------------------------------------------------------------------
// 3. dQ.

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kThreads) BwdDqKernel(const BwdParams p) {
  using Acc = AccType<T>;
  using L = BwdLayout<Acc, kMaxD>;
  constexpr int kBlockM = L::kBlockM, kBlockN = L::kBlockN, kLd = L::kLd, kLdP = L::kLdP;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const L t(shared_raw);

  const AttentionShape& s = p.shape;
  const int head_dim = static_cast<int>(s.head_dim);
  const QueryBlock<kBlockM> qb = QueryBlock<kBlockM>::Here(s);
  const int64_t b = qb.b, h = qb.h, h_kv = qb.h_kv, i0 = qb.i0;
  const int m_valid = qb.m_valid;

  const HeadTerms<Acc> head = HeadTerms<Acc>::For(p, b, h);
  int64_t key_begin, key_end;
  head.mask.KeyRange(i0, i0 + m_valid, &key_begin, &key_end);

  const Acc scale = static_cast<Acc>(p.score.scale);
  const Acc softcap = static_cast<Acc>(p.score.softcap);
  LoadQuerySide<T, kMaxD>(p, t, b, h, i0, m_valid);
  const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, 0, h_kv);
  const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, 0, h_kv);

  using QMap = TileMap<kBlockM, kMaxD>;
  const QMap qmap(threadIdx.x);
  Fragment<QMap, Acc> dq;
  Fill<QMap, Acc>(dq, Acc(0));

  for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockN) {
    const int n_valid = ValidRows<kBlockN>(key_end - j0);
    if (!head.TileMayBeVisible(i0, m_valid, j0, n_valid)) continue;
    __syncthreads();  // the previous key block's readers are done
    LoadTile<kBlockN, kMaxD>(t.sK, k + j0 * p.k_strides.row, p.k_strides.row, n_valid, head_dim);
    LoadTile<kBlockN, kMaxD>(t.sV, v + j0 * p.v_strides.row, p.v_strides.row, n_valid, head_dim);
    __syncthreads();
    ProbsAndScoreGrads(t, head, i0, m_valid, j0, n_valid, head_dim, scale,
                                          softcap);
    __syncthreads();
    MultiplyAccumulate(qmap, dq, t.sdS, kLdP, 1, t.sK, 1, kLd, n_valid);  // dQ += dS K
  }

  StoreFragment<T>(qmap, dq, scale, static_cast<T*>(p.dq) + p.dq_strides.offset(b, i0, h),
                   p.dq_strides.row, m_valid, head_dim);
}

// ---------------------------------------------------------------------------
// 4. dbias = dS summed over the dimensions along which the bias broadcasts.
//
// The bias has its own shape (Bb, Hb, Tb, Sb), each 1 or full. One block owns
// one (bias batch, bias head, row block if Tb is full, key block if Sb is
// full) piece of dbias and visits every (b, h, query block, key block) tile
// that maps onto it, so no two blocks write the same element and the sum
// runs in a fixed order. dS is recomputed (as the CPU's DbiasItem does)
// rather than kept from the dK/dV pass, which would need an Sq x Sk buffer.

struct DbiasGrid {
  bool per_row, per_col;  // dbias keeps the query / key dimension
  int64_t row_blocks, col_blocks;

  template <int kBlockM, int kBlockN>
  __host__ __device__ static DbiasGrid For(const BwdParams& p) {
    const int64_t* dims = p.score.bias_dims;
    DbiasGrid g;
    g.per_row = dims[2] == p.shape.seqlen_q;
    g.per_col = dims[3] == p.shape.seqlen_k;
    g.row_blocks = g.per_row ? CeilDiv(p.shape.seqlen_q, kBlockM) : 1;
    g.col_blocks = g.per_col ? CeilDiv(p.shape.seqlen_k, kBlockN) : 1;
    return g;
  }
  __host__ __device__ int64_t blocks(const BwdParams& p) const {
    return p.score.bias_dims[0] * p.score.bias_dims[1] * row_blocks * col_blocks;
  }
};

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kThreads) BwdDbiasKernel(const BwdParams p) {
  using Acc = AccType<T>;
  using L = BwdLayout<Acc, kMaxD>;
  constexpr int kBlockM = L::kBlockM, kBlockN = L::kBlockN, kLdP = L::kLdP;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const L t(shared_raw);

  const AttentionShape& s = p.shape;
  const int head_dim = static_cast<int>(s.head_dim);
  const int64_t* dims = p.score.bias_dims;  // (Bb, Hb, Tb, Sb)
  const DbiasGrid grid = DbiasGrid::For<kBlockM, kBlockN>(p);
  // (bias batch, bias head, row block, key block), key block fastest.
  int64_t rest = blockIdx.x;
  const int64_t col_block = rest % grid.col_blocks;
  rest /= grid.col_blocks;
  const int64_t row_block = rest % grid.row_blocks;
  rest /= grid.row_blocks;
  const int64_t bias_h = rest % dims[1];
  const int64_t bias_b = rest / dims[1];
  const int64_t num_m_blocks = CeilDiv(s.seqlen_q, kBlockM);
  const int64_t m_first = grid.per_row ? row_block : 0;
  const int64_t m_last = grid.per_row ? row_block + 1 : num_m_blocks;
  // With a full key dimension the block's key tile is fixed (and aligned
  // with the dbias columns it owns); otherwise it walks KeyRange.
  const int64_t own_j0 = col_block * kBlockN;
  const int own_n_valid = ValidRows<kBlockN>(s.seqlen_k - own_j0);

  const Acc scale = static_cast<Acc>(p.score.scale);
  const Acc softcap = static_cast<Acc>(p.score.softcap);
  // The running sums of dS live in shared memory after the usual tiles: in
  // registers they would spill.
  Acc* ds_sum = reinterpret_cast<Acc*>(shared_raw) + L::kSharedElems;
  for (int idx = threadIdx.x; idx < kBlockM * kLdP; idx += kThreads) ds_sum[idx] = Acc(0);

  const int64_t b_count = dims[0] == 1 ? s.batch : 1;
  const int64_t h_count = dims[1] == 1 ? s.num_heads_q : 1;
  for (int64_t bi = 0; bi < b_count; ++bi) {
    for (int64_t hi = 0; hi < h_count; ++hi) {
      const int64_t b = dims[0] == 1 ? bi : bias_b;
      const int64_t h = dims[1] == 1 ? hi : bias_h;
      const int64_t h_kv = h / s.group_size();
      const HeadTerms<Acc> head = HeadTerms<Acc>::For(p, b, h);
      const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, 0, h_kv);
      const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, 0, h_kv);
      for (int64_t m_block = m_first; m_block < m_last; ++m_block) {
        const int64_t i0 = m_block * kBlockM;
        const int m_valid = ValidRows<kBlockM>(s.seqlen_q - i0);
        int64_t key_begin, key_end;
        head.mask.KeyRange(i0, i0 + m_valid, &key_begin, &key_end);
        if (grid.per_col) {
          // Only the owned key tile, if the band reaches it at all.
          if (own_j0 >= key_end || own_j0 + own_n_valid <= key_begin) continue;
          key_begin = own_j0;
          key_end = own_j0 + own_n_valid;
        }
        bool query_side_loaded = false;  // uniform over the block
        for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockN) {
          const int n_valid = ValidRows<kBlockN>(key_end - j0);
          if (!head.TileMayBeVisible(i0, m_valid, j0, n_valid)) continue;
          __syncthreads();  // the previous tile's readers are done
          if (!query_side_loaded) {
            LoadQuerySide<T, kMaxD>(p, t, b, h, i0, m_valid);
            query_side_loaded = true;
          }
          LoadTile<kBlockN, kMaxD>(t.sK, k + j0 * p.k_strides.row, p.k_strides.row, n_valid,
                                   head_dim);
          LoadTile<kBlockN, kMaxD>(t.sV, v + j0 * p.v_strides.row, p.v_strides.row, n_valid,
                                   head_dim);
          __syncthreads();
          // Columns of ds_sum are keys j0 + c: aligned with the owned
          // columns when per_col, and summed over in the end otherwise.
          // Likewise for rows.
          ProbsAndScoreGrads(t, head, i0, m_valid, j0, n_valid, head_dim,
                                                scale, softcap, ds_sum);
        }
      }
    }
  }

  // Reduce the tile of sums over the broadcast dimensions and write the owned
  // piece of dbias; elements no tile reached are written as 0.
  __syncthreads();
  const int out_rows = grid.per_row ? ValidRows<kBlockM>(s.seqlen_q - row_block * kBlockM) : 1;
  const int out_cols = grid.per_col ? own_n_valid : 1;
  const int64_t row0 = grid.per_row ? row_block * kBlockM : 0;
  const int64_t col0 = grid.per_col ? own_j0 : 0;
  Acc* dbias = static_cast<Acc*>(p.dbias) + (bias_b * dims[1] + bias_h) * dims[2] * dims[3];
  for (int idx = threadIdx.x; idx < out_rows * out_cols; idx += kThreads) {
    const int r = idx / out_cols, c = idx % out_cols;
    const int r_end = grid.per_row ? r + 1 : kBlockM;
    const int c_end = grid.per_col ? c + 1 : kBlockN;
    Acc sum = Acc(0);
    for (int rr = grid.per_row ? r : 0; rr < r_end; ++rr)
      for (int cc = grid.per_col ? c : 0; cc < c_end; ++cc) sum += ds_sum[rr * kLdP + cc];
    dbias[(row0 + r) * dims[3] + col0 + c] = sum;
  }
}

// ---------------------------------------------------------------------------
// Launch.

template <typename T, int kMaxD>
cudaError_t LaunchBwdTier(const BwdParams& p, cudaStream_t stream) {
  using L = BwdLayout<AccType<T>, kMaxD>;
  const AttentionShape& s = p.shape;
  const int64_t rows = s.batch * s.num_heads_q * s.seqlen_q;
  cudaError_t err = Launch(BwdDeltaKernel<T>, CeilDiv(rows, kDeltaRowsPerBlock), 0, p, stream);
  if (err != cudaSuccess) return err;
  err = Launch(BwdDkDvKernel<T, kMaxD>,
               CeilDiv(s.seqlen_k, L::kBlockN) * s.num_heads_kv * s.batch, L::kSharedBytes, p,
               stream);
  if (err != cudaSuccess) return err;
  err = Launch(BwdDqKernel<T, kMaxD>, QueryBlock<L::kBlockM>::Count(s), L::kSharedBytes, p, stream);
  if (err != cudaSuccess || p.score.bias == nullptr || p.dbias == nullptr) return err;
  const DbiasGrid grid = DbiasGrid::For<L::kBlockM, L::kBlockN>(p);
  return Launch(BwdDbiasKernel<T, kMaxD>, grid.blocks(p), L::kDbiasSharedBytes, p, stream);
}

}  // namespace

}  // namespace jax_flash::cuda::simt

namespace jax_flash::cuda {

template <typename T>
cudaError_t RunExactBwd(const BwdParams& p, cudaStream_t stream) {
  return simt::WithExactTier(p.shape.head_dim, [&](auto tier) {
    return simt::LaunchBwdTier<T, decltype(tier)::value>(p, stream);
  });
}

}  // namespace jax_flash::cuda

// Exact FlashAttention-2 forward: SIMT, IEEE arithmetic in the accumulation
// type, any head_dim in [1, 256], any sequence lengths.
//
// One block computes kBlockM query rows of one (batch, query head):
//   for each key block j in KeyRange(rows):       (fully masked blocks skipped)
//     S   = scale * Q K_j^T + bias, softcap, mask -> -inf   (shared memory)
//     m'  = max(m, rowmax S);  P = exp(S - m');  alpha = exp(m - m')
//     l   = alpha * l + rowsum P;  O = alpha * O + P~ V_j   (O in registers)
//   out = O / l,  lse = m + log(l)
// where P~ = P without dropout, Z * P / (1 - rate) with it (Z the keep mask
// of HeadDropout): l and lse sum P before dropout, as on the CPU.
// No Sq x Sk buffer exists. A row that sees no key ends with l = 0 and gets
// out = 0, lse = -inf.
// Instantiated once per storage type (RunExactFwd<T>, cuda/kernels.h) in a
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

template <typename Acc, int kMaxD>
struct FwdLayout {
  using Tiles = ExactTiles<Acc, kMaxD>;
  static constexpr int kBlockM = Tiles::kFwdBlockM;
  static constexpr int kBlockN = Tiles::kFwdBlockN;
  static constexpr int kLd = Tiles::kLd;
  static constexpr int kLdP = kBlockN + 1;  // odd: column reads of P avoid bank conflicts
  // sQ[kBlockM][kLd], sK[kBlockN][kLd], sV[kBlockN][kLd], sP[kBlockM][kLdP],
  // sRowScale[kBlockM].
  static constexpr size_t kSharedElems =
      size_t(kBlockM + 2 * kBlockN) * kLd + size_t(kBlockM) * kLdP + kBlockM;
  static constexpr size_t kSharedBytes = kSharedElems * sizeof(Acc);
  static_assert(kSharedBytes <= kMaxSharedBytes, "forward tiles exceed shared memory");
  // The row-wise softmax gives each query row kThreadsPerRow threads.
  static constexpr int kThreadsPerRow = kThreads / kBlockM;
  static_assert(kThreadsPerRow * kBlockM == kThreads && kThreadsPerRow <= kWarpSize &&
                    (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                "softmax rows must split a warp evenly");
};

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kThreads) FwdKernel(const FwdParams p) {
  using Acc = AccType<T>;
  using L = FwdLayout<Acc, kMaxD>;
  constexpr int kBlockM = L::kBlockM, kBlockN = L::kBlockN, kLd = L::kLd, kLdP = L::kLdP;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* sQ = reinterpret_cast<Acc*>(shared_raw);
  Acc* sK = sQ + kBlockM * kLd;
  Acc* sV = sK + kBlockN * kLd;
  Acc* sP = sV + kBlockN * kLd;          // scores, then probabilities
  Acc* sRowScale = sP + kBlockM * kLdP;  // alpha per key block, then l at the end

  const AttentionShape& s = p.shape;
  const int head_dim = static_cast<int>(s.head_dim);
  const QueryBlock<kBlockM> qb = QueryBlock<kBlockM>::Here(s);
  const int64_t b = qb.b, h = qb.h, h_kv = qb.h_kv, i0 = qb.i0;
  const int m_valid = qb.m_valid;

  const HeadTerms<Acc> head = HeadTerms<Acc>::For(p, b, h);
  const BatchMask& mask = head.mask;
  int64_t key_begin, key_end;
  mask.KeyRange(i0, i0 + m_valid, &key_begin, &key_end);

  const Acc scale = static_cast<Acc>(p.score.scale);
  const Acc softcap = static_cast<Acc>(p.score.softcap);
  const T* q = static_cast<const T*>(p.q) + p.q_strides.offset(b, i0, h);
  const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, 0, h_kv);
  const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, 0, h_kv);

  LoadTile<kBlockM, kMaxD>(sQ, q, p.q_strides.row, m_valid, head_dim);

  // Softmax state of row `row`, held (identically) by its kThreadsPerRow threads.
  const int row = threadIdx.x / L::kThreadsPerRow;
  const int row_lane = threadIdx.x % L::kThreadsPerRow;
  Acc m = -Infinity<Acc>();
  Acc l = Acc(0);

  using SMap = TileMap<kBlockM, kBlockN>;
  using OMap = TileMap<kBlockM, kMaxD>;
  const SMap smap(threadIdx.x);
  const OMap omap(threadIdx.x);
  Fragment<OMap, Acc> o;
  Fill<OMap, Acc>(o, Acc(0));

  for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockN) {
    const int n_valid = ValidRows<kBlockN>(key_end - j0);
    // Segments or a dense mask may hide the whole tile: then it changes
    // neither m, l nor O.
    if (!head.TileMayBeVisible(i0, m_valid, j0, n_valid)) continue;
    __syncthreads();  // the previous block's readers of sK, sV, sP are done
    LoadTile<kBlockN, kMaxD>(sK, k + j0 * p.k_strides.row, p.k_strides.row, n_valid, head_dim);
    LoadTile<kBlockN, kMaxD>(sV, v + j0 * p.v_strides.row, p.v_strides.row, n_valid, head_dim);
    __syncthreads();

    // S = scale * Q K^T with the score transform; invisible entries -> -inf.
    {
      Fragment<SMap, Acc> dot;
      Fill<SMap, Acc>(dot, Acc(0));
      MultiplyAccumulate(smap, dot, sQ, kLd, 1, sK, kLd, 1, head_dim);
      const bool all_visible = mask.AllVisible(i0, i0 + m_valid, j0, j0 + n_valid);
      if (smap.active) {
#pragma unroll
        for (int i = 0; i < SMap::kRowsPerThread; ++i) {
#pragma unroll
          for (int jj = 0; jj < SMap::kColsPerThread; ++jj) {
            const int r = smap.row(i), c = smap.col(jj);
            const bool visible =
                r < m_valid && c < n_valid && (all_visible || mask.Visible(i0 + r, j0 + c));
            Acc x = -Infinity<Acc>();
            if (visible) {
              Acc unused_derivative;
              x = Score(dot[i][jj], head.Bias(i0 + r, j0 + c), scale, softcap,
                        &unused_derivative);
            }
            sP[r * kLdP + c] = x;
          }
        }
      }
    }
    __syncthreads();

    // Online softmax, one row per group of kThreadsPerRow threads.
    {
      Acc* p_row = sP + row * kLdP;
      Acc tile_max = -Infinity<Acc>();
      for (int c = row_lane; c < n_valid; c += L::kThreadsPerRow) tile_max = Max(tile_max, p_row[c]);
      tile_max = GroupMax<L::kThreadsPerRow>(tile_max);
      const Acc m_new = Max(m, tile_max);
      // While a row has seen no visible key, m_new = -inf; exponentiate
      // against 0 instead so that exp(-inf - (-inf)) cannot produce NaN.
      const Acc m_ref = m_new == -Infinity<Acc>() ? Acc(0) : m_new;
      // P in Philox units, so that one call serves the dropout of a whole
      // unit: unit k is the four keys 16 J + 2 p + {0, 1, 8, 9} of one call
      // (dropout.h), J = j0 / 16 + k / 4, p = k % 4. l sums P before
      // dropout; sP receives what multiplies V.
      Acc row_sum = Acc(0);
      const HeadDropout& dropout = head.dropout;
      const bool drop = dropout.enabled && row < m_valid;
      const int64_t units = 4 * (CeilDiv(j0 + n_valid, 16) - j0 / 16);
      for (int64_t k = row_lane; k < units; k += L::kThreadsPerRow) {
        const int64_t unit_key = (j0 / 16 + k / 4) * 16 + 2 * (k % 4);
        uint32_t words[4] = {0, 0, 0, 0};
        if (drop) dropout.Call(i0 + row, unit_key, words);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t j = unit_key + (u & 1) + 8 * (u >> 1);
          const int64_t c = j - j0;
          if (c < 0 || c >= n_valid) continue;
          const Acc prob = Exp(p_row[c] - m_ref);
          row_sum += prob;
          const bool kept =
              !drop || HeadDropout::Draw(words, HeadDropout::DrawSlot(i0 + row, j)) >= dropout.threshold;
          p_row[c] = !drop ? prob : (kept ? prob * head.keep_scale : Acc(0));
        }
      }
      row_sum = GroupSum<L::kThreadsPerRow>(row_sum);
      const Acc alpha = Exp(m - m_ref);  // 0 while m = -inf
      l = alpha * l + row_sum;
      m = m_new;
      if (row_lane == 0) sRowScale[row] = alpha;
    }
    __syncthreads();

    // O = alpha * O + P V.
    if (omap.active) {
#pragma unroll
      for (int i = 0; i < OMap::kRowsPerThread; ++i) {
        const Acc alpha = sRowScale[omap.row(i)];
#pragma unroll
        for (int jj = 0; jj < OMap::kColsPerThread; ++jj) o[i][jj] *= alpha;
      }
    }
    MultiplyAccumulate(omap, o, sP, kLdP, 1, sV, 1, kLd, n_valid);
  }

  // lse, and l for the division below.
  __syncthreads();  // sRowScale's last alphas have been read
  if (row_lane == 0) {
    sRowScale[row] = l;
    if (row < m_valid) {
      Acc* lse = static_cast<Acc*>(p.lse);
      // l == 0 only for a row that sees no key; a NaN logit makes l NaN,
      // which then reaches lse and the output (jax.nn semantics).
      lse[RowStatOffset(s, b, h, i0 + row)] = l == Acc(0) ? -Infinity<Acc>() : m + Log(l);
    }
  }
  __syncthreads();

  if (omap.active) {
    T* out = static_cast<T*>(p.out) + p.out_strides.offset(b, i0, h);
#pragma unroll
    for (int i = 0; i < OMap::kRowsPerThread; ++i) {
      const int r = omap.row(i);
      if (r >= m_valid) continue;
      const Acc row_l = sRowScale[r];
#pragma unroll
      for (int jj = 0; jj < OMap::kColsPerThread; ++jj) {
        const int d = omap.col(jj);
        // Division (not a reciprocal multiply): one rounding, as the reference.
        if (d < head_dim)
          out[r * p.out_strides.row + d] = FromAcc<T>(row_l == Acc(0) ? Acc(0) : o[i][jj] / row_l);
      }
    }
  }
}

template <typename T, int kMaxD>
cudaError_t LaunchFwdTier(const FwdParams& p, cudaStream_t stream) {
  using L = FwdLayout<AccType<T>, kMaxD>;
  return Launch(FwdKernel<T, kMaxD>, QueryBlock<L::kBlockM>::Count(p.shape), L::kSharedBytes, p,
                stream);
}

}  // namespace

}  // namespace jax_flash::cuda::simt

namespace jax_flash::cuda {

template <typename T>
cudaError_t RunExactFwd(const FwdParams& p, cudaStream_t stream) {
  return simt::WithExactTier(p.shape.head_dim, [&](auto tier) {
    return simt::LaunchFwdTier<T, decltype(tier)::value>(p, stream);
  });
}

}  // namespace jax_flash::cuda

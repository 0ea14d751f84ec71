// Exact FlashAttention forward-mode derivative (JVP): SIMT, IEEE arithmetic in
// the accumulation type, any head_dim in [1, 256], every option the forward
// has. The CUDA twin of cpu/flash_jvp.cc, with the forward's structure
// (simt/fwd.cuh) and its score code (common/score.cuh).
//
// One block computes kBlockM query rows of one (batch, query head). The
// forward's lse makes P = exp(x - lse) known tile by tile (no online softmax,
// nothing to rescale), so every key block simply adds its share:
//   for each key block j in KeyRange(rows):        (fully masked blocks skipped)
//     S   = Q K_j^T,   dS' = Q_dot K_j^T + Q K_dot_j^T         (registers)
//     x   = Score(scale * S + bias),  P = exp(x - lse)   (0 where hidden)
//     dS  = (scale * dS' + bias_dot) * dx/dlogit         (sech^2 under a cap)
//     lse_dot += rowsum(P o dS)
//     acc += (Pd o (dS - c)) V_j + Pd V_dot_j            (acc in registers)
//   out_dot = acc - (lse_dot - c) o out,  with out as the forward wrote it
// where Pd is P after the forward's dropout (HeadDropout: kept elements
// scaled by 1 / (1 - rate), the others 0); lse_dot sums P before dropout.
// The per-row shift c, the P-weighted mean of dS over the row's first block
// with a visible key (0 before it), changes nothing in exact arithmetic
// (out = Pd V) but keeps lse_dot times out's rounding out of rows that see
// few keys, where lse_dot ~ dS (as cpu/flash_jvp.cc and sm80/jvp.cuh do).
// Absent (zero) tangents skip their products and loads. Hidden keys
// contribute exactly 0, by a select, also where a tangent is inf or NaN; a
// row that sees no key (lse = -inf) gets out_dot = 0 and lse_dot = 0; a NaN
// reaches exactly the rows whose logits it touches (as in the forward).
// Instantiated once per storage type (RunExactJvp<T>, cuda/kernels.h) in a
// file generated from jax_flash/_supported.py.
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
struct JvpLayout {
  using Tiles = ExactTiles<Acc, kMaxD>;
  static constexpr int kBlockM = Tiles::kJvpBlockM;
  static constexpr int kBlockN = Tiles::kJvpBlockN;
  static constexpr int kLd = Tiles::kLd;
  static constexpr int kLdP = kBlockN + 1;  // odd: column reads of P avoid bank conflicts
  // sQ, sQd [kBlockM][kLd]; sK, sKd, sV, sVd [kBlockN][kLd]; sP, sdS
  // [kBlockM][kLdP]; sLse [kBlockM].
  static constexpr size_t kSharedElems =
      size_t(2 * kBlockM + 4 * kBlockN) * kLd + size_t(2 * kBlockM) * kLdP + kBlockM;
  static constexpr size_t kSharedBytes = kSharedElems * sizeof(Acc);
  static_assert(kSharedBytes <= kMaxSharedBytes, "JVP tiles exceed shared memory");

  Acc *sQ, *sQd, *sK, *sKd, *sV, *sVd, *sP, *sdS, *sLse;

  __device__ explicit JvpLayout(unsigned char* raw) {
    sQ = reinterpret_cast<Acc*>(raw);
    sQd = sQ + kBlockM * kLd;
    sK = sQd + kBlockM * kLd;
    sKd = sK + kBlockN * kLd;
    sV = sKd + kBlockN * kLd;
    sVd = sV + kBlockN * kLd;
    sP = sVd + kBlockN * kLd;
    sdS = sP + kBlockM * kLdP;
    sLse = sdS + kBlockM * kLdP;
  }
};

// For the tile of query rows [i0, i0 + m_valid) x keys [j0, j0 + n_valid)
// whose raw products Q K^T and Q_dot K^T + Q K_dot^T this thread parked in sP
// and sdS (its own elements only), leaves there
//   sP  = Pd       = Z * P / (1 - rate), P = exp(x - lse)  (0 where hidden)
//   sdS = Pd o dS                                           (0 where hidden)
// (Z = 1 without dropout), and this thread's share of each owned row's sums
// of P and of P o dS (both before dropout) in p_part and pds_part. A rolled
// loop, as in the backward: the bias, mask and Philox code unrolled over the
// fragments kept them live and spilled.
template <typename Layout, typename Map, typename Acc>
__device__ __forceinline__ void ProbsAndTangents(const Layout& t, const Map& smap,
                                                 const HeadTerms<Acc>& head,
                                                 const Acc* bias_dot, int64_t i0, int m_valid,
                                                 int64_t j0, int n_valid, bool has_ds, Acc scale,
                                                 Acc softcap, Acc (&p_part)[Map::kRowsPerThread],
                                                 Acc (&pds_part)[Map::kRowsPerThread]) {
  constexpr int kLdP = Layout::kLdP;
  const BatchMask& mask = head.mask;
  const bool all_visible = mask.AllVisible(i0, i0 + m_valid, j0, j0 + n_valid);
#pragma unroll 1
  for (int ri = 0; ri < Map::kRowsPerThread; ++ri) {
    const int r = smap.row(ri);
    Acc row_p = Acc(0), row_pds = Acc(0);
#pragma unroll 1
    for (int ci = 0; ci < Map::kColsPerThread; ++ci) {
      const int c = smap.col(ci);
      const int at = r * kLdP + c;
      Acc prob = Acc(0), pds = Acc(0);
      if (r < m_valid && c < n_valid && (all_visible || mask.Visible(i0 + r, j0 + c))) {
        const int64_t i = i0 + r, j = j0 + c;
        Acc dx;
        const Acc x = Score(t.sP[at], head.Bias(i, j), scale, softcap, &dx);
        prob = Exp(x - t.sLse[r]);
        row_p += prob;
        if (has_ds) {
          Acc dlogit = scale * t.sdS[at];
          if (bias_dot != nullptr)
            dlogit += bias_dot[i * head.bias_row_stride + j * head.bias_col_stride];
          pds = prob * (dlogit * dx);
          row_pds += pds;
        }
        if (head.dropout.enabled) {
          const bool kept = head.dropout.Keep(i, j);
          prob = kept ? prob * head.keep_scale : Acc(0);
          pds = kept ? pds * head.keep_scale : Acc(0);
        }
      }
      t.sP[at] = prob;
      t.sdS[at] = pds;
    }
    // A select per row keeps the sums in registers (indexing them with the
    // loop's ri would put them in local memory).
#pragma unroll
    for (int k = 0; k < Map::kRowsPerThread; ++k)
      if (k == ri) {
        p_part[k] = row_p;
        pds_part[k] = row_pds;
      }
  }
}

template <typename T, int kMaxD>
__global__ void __launch_bounds__(kThreads) JvpKernel(const JvpParams p) {
  using Acc = AccType<T>;
  using L = JvpLayout<Acc, kMaxD>;
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
  const DenseStrides& bs = p.score.bias_strides;
  const Acc* bias_dot = p.bias_dot != nullptr && p.score.bias != nullptr
                            ? static_cast<const Acc*>(p.bias_dot) + b * bs.batch + h * bs.head
                            : nullptr;
  const bool has_ds = p.q_dot != nullptr || p.k_dot != nullptr || bias_dot != nullptr;

  const Acc scale = static_cast<Acc>(p.score.scale);
  const Acc softcap = static_cast<Acc>(p.score.softcap);
  const T* k = static_cast<const T*>(p.k) + p.k_strides.offset(b, 0, h_kv);
  const T* v = static_cast<const T*>(p.v) + p.v_strides.offset(b, 0, h_kv);
  const T* k_dot = p.k_dot != nullptr
                       ? static_cast<const T*>(p.k_dot) + p.k_dot_strides.offset(b, 0, h_kv)
                       : nullptr;
  const T* v_dot = p.v_dot != nullptr
                       ? static_cast<const T*>(p.v_dot) + p.v_dot_strides.offset(b, 0, h_kv)
                       : nullptr;

  LoadTile<kBlockM, kMaxD>(t.sQ, static_cast<const T*>(p.q) + p.q_strides.offset(b, i0, h),
                           p.q_strides.row, m_valid, head_dim);
  if (p.q_dot != nullptr)
    LoadTile<kBlockM, kMaxD>(t.sQd,
                             static_cast<const T*>(p.q_dot) + p.q_dot_strides.offset(b, i0, h),
                             p.q_dot_strides.row, m_valid, head_dim);
  // lse = -inf (the row sees nothing) becomes +inf, so that P = exp(x - lse)
  // = 0 and no -inf - (-inf) appears.
  for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
    Acc lse = Infinity<Acc>();
    if (r < m_valid) {
      lse = static_cast<const Acc*>(p.lse)[RowStatOffset(s, b, h, i0 + r)];
      if (lse == -Infinity<Acc>()) lse = Infinity<Acc>();
    }
    t.sLse[r] = lse;
  }

  using SMap = TileMap<kBlockM, kBlockN>;
  using OMap = TileMap<kBlockM, kMaxD>;
  const SMap smap(threadIdx.x);
  const OMap omap(threadIdx.x);
  Fragment<OMap, Acc> acc;
  Fill<OMap, Acc>(acc, Acc(0));
  // Per owned row, the same in every thread of its column group: lse_dot so
  // far and the shift c (set at the row's first block with a visible key).
  Acc lse_dot[SMap::kRowsPerThread], shift[SMap::kRowsPerThread];
  bool shift_set[SMap::kRowsPerThread];
#pragma unroll
  for (int i = 0; i < SMap::kRowsPerThread; ++i) {
    lse_dot[i] = shift[i] = Acc(0);
    shift_set[i] = false;
  }

  for (int64_t j0 = key_begin; j0 < key_end; j0 += kBlockN) {
    const int n_valid = ValidRows<kBlockN>(key_end - j0);
    if (!head.TileMayBeVisible(i0, m_valid, j0, n_valid)) continue;
    __syncthreads();  // the previous block's readers of the key-side tiles are done
    LoadTile<kBlockN, kMaxD>(t.sK, k + j0 * p.k_strides.row, p.k_strides.row, n_valid, head_dim);
    LoadTile<kBlockN, kMaxD>(t.sV, v + j0 * p.v_strides.row, p.v_strides.row, n_valid, head_dim);
    if (k_dot != nullptr)
      LoadTile<kBlockN, kMaxD>(t.sKd, k_dot + j0 * p.k_dot_strides.row, p.k_dot_strides.row,
                               n_valid, head_dim);
    if (v_dot != nullptr)
      LoadTile<kBlockN, kMaxD>(t.sVd, v_dot + j0 * p.v_dot_strides.row, p.v_dot_strides.row,
                               n_valid, head_dim);
    __syncthreads();

    // S = Q K^T and dS' = Q_dot K^T + Q K_dot^T, parked in sP and sdS by
    // their owners (no barrier needed before ProbsAndTangents).
    Acc p_part[SMap::kRowsPerThread], pds_part[SMap::kRowsPerThread];
#pragma unroll
    for (int i = 0; i < SMap::kRowsPerThread; ++i) p_part[i] = pds_part[i] = Acc(0);
    {
      Fragment<SMap, Acc> dot, ddot;
      Fill<SMap, Acc>(dot, Acc(0));
      Fill<SMap, Acc>(ddot, Acc(0));
      MultiplyAccumulate(smap, dot, t.sQ, kLd, 1, t.sK, kLd, 1, head_dim);
      if (p.q_dot != nullptr) MultiplyAccumulate(smap, ddot, t.sQd, kLd, 1, t.sK, kLd, 1, head_dim);
      if (k_dot != nullptr) MultiplyAccumulate(smap, ddot, t.sQ, kLd, 1, t.sKd, kLd, 1, head_dim);
      if (smap.active) {
        ForEachOwned(smap, kLdP, [&](int i, int j, int at) {
          t.sP[at] = dot[i][j];
          t.sdS[at] = ddot[i][j];
        });
        ProbsAndTangents(t, smap, head, bias_dot, i0, m_valid, j0, n_valid, has_ds, scale,
                         softcap, p_part, pds_part);
      }
    }
    // Row sums over the column group (every thread takes part: the shuffles
    // span whole warps), then sdS = Pd o (dS - c) on the owned elements.
    if (has_ds) {
#pragma unroll
      for (int i = 0; i < SMap::kRowsPerThread; ++i) {
        const Acc p_sum = GroupSum<SMap::kColThreads>(p_part[i]);
        const Acc pds_sum = GroupSum<SMap::kColThreads>(pds_part[i]);
        lse_dot[i] += pds_sum;
        if (!shift_set[i] && p_sum > Acc(0)) {
          shift[i] = pds_sum / p_sum;
          shift_set[i] = true;
        }
      }
      if (smap.active)
        ForEachOwned(smap, kLdP, [&](int i, int, int at) { t.sdS[at] -= shift[i] * t.sP[at]; });
    }
    __syncthreads();

    // acc += (Pd o dS) V + Pd V_dot.
    if (has_ds) MultiplyAccumulate(omap, acc, t.sdS, kLdP, 1, t.sV, 1, kLd, n_valid);
    if (v_dot != nullptr) MultiplyAccumulate(omap, acc, t.sP, kLdP, 1, t.sVd, 1, kLd, n_valid);
  }

  // Store lse_dot; publish each row's weight lse_dot - c through shared
  // memory (sLse is free: the last readers passed the loop's final barrier,
  // or never ran).
  __syncthreads();
  if (smap.active && smap.col0 == 0) {
#pragma unroll
    for (int i = 0; i < SMap::kRowsPerThread; ++i) {
      const int r = smap.row(i);
      t.sLse[r] = lse_dot[i] - shift[i];
      if (r < m_valid) static_cast<Acc*>(p.lse_dot)[RowStatOffset(s, b, h, i0 + r)] = lse_dot[i];
    }
  }
  __syncthreads();

  // out_dot = acc - (lse_dot - c) o out (out as the forward stored it).
  if (omap.active) {
    const T* out = static_cast<const T*>(p.out) + p.out_strides.offset(b, i0, h);
    T* out_dot = static_cast<T*>(p.out_dot) + p.out_dot_strides.offset(b, i0, h);
#pragma unroll
    for (int i = 0; i < OMap::kRowsPerThread; ++i) {
      const int r = omap.row(i);
      if (r >= m_valid) continue;
      const Acc weight = t.sLse[r];
#pragma unroll
      for (int jj = 0; jj < OMap::kColsPerThread; ++jj) {
        const int d = omap.col(jj);
        if (d < head_dim)
          out_dot[r * p.out_dot_strides.row + d] =
              FromAcc<T>(acc[i][jj] - weight * ToAcc(out[r * p.out_strides.row + d]));
      }
    }
  }
}

template <typename T, int kMaxD>
cudaError_t LaunchJvpTier(const JvpParams& p, cudaStream_t stream) {
  using L = JvpLayout<AccType<T>, kMaxD>;
  return Launch(JvpKernel<T, kMaxD>, QueryBlock<L::kBlockM>::Count(p.shape), L::kSharedBytes, p,
                stream);
}

}  // namespace

}  // namespace jax_flash::cuda::simt

namespace jax_flash::cuda {

template <typename T>
cudaError_t RunExactJvp(const JvpParams& p, cudaStream_t stream) {
  return simt::WithExactTier(p.shape.head_dim, [&](auto tier) {
    return simt::LaunchJvpTier<T, decltype(tier)::value>(p, stream);
  });
}

}  // namespace jax_flash::cuda

// Softmax on a warp's score fragments (common/fragment.cuh layout), both
// tensor-core arch paths: the forward's online softmax over key blocks, and
// the backward's recomputation of P from the saved lse and of dP - D.
// Exponentials are exp2 with the scale pre-multiplied by log2(e).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/common/math.cuh"

namespace jax_flash::cuda {

// Lazy rescale threshold of the online softmax (log2 units): P <= 2^8.
inline constexpr float kRescaleLog2 = 8.f;

// The second half of both online softmaxes below: S becomes P = exp2(S *
// scale_log2 - m * scale_log2) against the rows' (updated) maxima, and each
// lane adds its part of the row sums to l (reduced across the quad at the
// end). Masked scores are -inf, so their P is exp2(-inf) = 0; a row whose
// maximum is still -inf takes its exponent against 0.
template <int kMT, int kNTiles>
__device__ __forceinline__ void ExponentiateRows(float (&s)[kMT][kNTiles][4],
                                                 const float (&row_m)[kMT][2],
                                                 float (&row_l)[kMT][2], float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m_scaled = row_m[mt][hr] == -INFINITY ? 0.f : row_m[mt][hr] * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float pv = FastExp2(fmaf(s[mt][nt][2 * hr + c], scale_log2, -m_scaled));
          s[mt][nt][2 * hr + c] = pv;
          sum += pv;
        }
      }
      row_l[mt][hr] += sum;
    }
  }
}

// The maximum of this lane's part of row (mt, hr) of S (the vote and the
// quad's shuffles make it the row's). Four running maxima, combined at the
// end: one chain through all kNTiles n-tiles put 2 kNTiles dependent FMNMX
// (about 4 cycles each) between the S GEMM's wait and the vote, which the
// exponentials of the common path wait for. max is exact in any order.
template <int kMT, int kNTiles>
__device__ __forceinline__ float LaneRowMax(const float (&s)[kMT][kNTiles][4], int mt, int hr) {
  constexpr int kChains = kNTiles >= 4 ? 4 : kNTiles;
  // Each chain starts at its first pair, not at -inf: fmaxf(x, -inf) is not
  // x for a NaN x, so ptxas keeps that FMNMX. (A lane whose scores are all
  // NaN then gives NaN rather than -inf; the callers' fmaxf with row_m and
  // the quad ignores either, and NaN > m is false as -inf > m is.)
  float m[kChains];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const float pair = fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]);
    m[nt % kChains] = nt < kChains ? pair : fmaxf(m[nt % kChains], pair);
  }
#pragma unroll
  for (int width = kChains / 2; width > 0; width /= 2)
#pragma unroll
    for (int c = 0; c < width; ++c) m[c] = fmaxf(m[c], m[c + width]);
  return m[0];
}

// Online softmax of one key block, lazy rescale: S becomes P in place, O
// and l are rescaled when the reference max moves.
//
// row_m is the reference P is taken against, not always the running max: it
// moves (and O, l are rescaled) only when some row of this warp grew past it
// by more than kRescaleLog2 in log2 units. O and l share the reference and
// lse uses it too, so the result is exact either way; P is then <=
// 2^kRescaleLog2, harmless in 16 bits and float32. Random data rarely grows
// that much after the first block, so the O multiplies per block (as many as
// the exp2s at BN 32) mostly go. The row max (over this lane's part of the
// row: the vote covers the quad) is recomputed in the rare rescale branch
// rather than kept live across the vote, which would cost registers in the
// common path. rescale_margin = kRescaleLog2 / scale_log2 (score units).
template <int kMT, int kNTiles, int kDTiles>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[kMT][kNTiles][4],
                                              float (&o)[kMT][kDTiles][4],
                                              float (&row_m)[kMT][2], float (&row_l)[kMT][2],
                                              float scale_log2, float rescale_margin) {
  bool grow = false;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)  // -inf + margin = -inf: a row's first visible key moves it
      grow |= LaneRowMax(s, mt, hr) > row_m[mt][hr] + rescale_margin;
  if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float m = LaneRowMax(s, mt, hr);
        // The 4 lanes of a quad hold one row.
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float m_new = fmaxf(row_m[mt][hr], m);
        // A row with nothing visible yet keeps m = -inf; subtracting 0
        // then gives alpha = exp2(-inf) = 0 instead of NaN.
        const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
        const float alpha = FastExp2(row_m[mt][hr] * scale_log2 - m_scaled);
        row_m[mt][hr] = m_new;
        row_l[mt][hr] *= alpha;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][2 * hr] *= alpha;
          o[mt][dt][2 * hr + 1] *= alpha;
        }
      }
    }
  }
  ExponentiateRows(s, row_m, row_l, scale_log2);
}

// OnlineSoftmax with O's rescale left to the caller, for kernels whose O
// accumulators are still in flight on the tensor cores (the previous block's
// O += P V) while this block's softmax runs: S becomes P, m and l move as in
// OnlineSoftmax; when it returns true (warp-uniform), O must be multiplied
// row-wise by alpha (RescaleO) before its next GEMM.
template <int kMT, int kNTiles>
__device__ __forceinline__ bool OnlineSoftmaxDeferRescale(float (&s)[kMT][kNTiles][4],
                                                          float (&row_m)[kMT][2],
                                                          float (&row_l)[kMT][2],
                                                          float (&alpha)[kMT][2],
                                                          float scale_log2,
                                                          float rescale_margin) {
  bool grow = false;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) grow |= LaneRowMax(s, mt, hr) > row_m[mt][hr] + rescale_margin;
  const bool rescale = __any_sync(0xffffffffu, grow);
  if (rescale) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float m = LaneRowMax(s, mt, hr);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float m_new = fmaxf(row_m[mt][hr], m);
        const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
        alpha[mt][hr] = FastExp2(row_m[mt][hr] * scale_log2 - m_scaled);
        row_m[mt][hr] = m_new;
        row_l[mt][hr] *= alpha[mt][hr];
      }
    }
  }
  ExponentiateRows(s, row_m, row_l, scale_log2);
  return rescale;
}

// O *= alpha row-wise (after OnlineSoftmaxDeferRescale returned true).
template <int kMT, int kDTiles>
__device__ __forceinline__ void RescaleO(float (&o)[kMT][kDTiles][4],
                                         const float (&alpha)[kMT][2]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[mt][dt][r] *= alpha[mt][r / 2];
}

// ---- backward, on a warp's S^T / dP^T fragments: 16 keys (rows g, g + 8) x 8
// kQTiles queries (column nt * 8 + 2t + c of this lane); lse2 and D of the
// step's queries come from shared memory, as float2 per lane.

// dpt = scale dP^T - D (no soft cap; with one, SoftcapAndSubtractDelta in
// score.cuh). scale: dropout's 1 / (1 - rate) on the kept dP^T, in the same
// FFMA; 1 without dropout, or where dP^T is scaled already (x * 1 is x: the
// compiler drops the multiply).
template <int kQTiles>
__device__ __forceinline__ void SubtractDelta(float (&dpt)[kQTiles][4], const float* delta_s,
                                              int t, float scale) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + nt * 8 + 2 * t);
#pragma unroll
    for (int r = 0; r < 4; ++r) dpt[nt][r] = dpt[nt][r] * scale - (r % 2 ? dl.y : dl.x);
  }
}

// st = P^T = exp2(x * scale_log2 - lse2).
template <int kQTiles>
__device__ __forceinline__ void ExpScoresT(float (&st)[kQTiles][4], const float* lse2_s,
                                           float scale_log2, int t) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 l2 = *reinterpret_cast<const float2*>(lse2_s + nt * 8 + 2 * t);
#pragma unroll
    for (int r = 0; r < 4; ++r)
      st[nt][r] = FastExp2(fmaf(st[nt][r], scale_log2, -(r % 2 ? l2.y : l2.x)));
  }
}

}  // namespace jax_flash::cuda

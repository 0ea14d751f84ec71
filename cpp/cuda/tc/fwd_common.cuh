// What the two tensor-core forwards share (flash_fwd.cuh on mma.sync,
// flash_fwd_sm90.cuh on wgmma): the launch constants, the block's view of
// its inputs, and the per-warp work on S between the two GEMMs (soft cap,
// mask, online softmax) and after the last one (O / l, lse).
//
// A warp owns kMT m-tiles of 16 query rows; s[mt][nt][0..3] and
// o[mt][dt][0..3] are mma.sync C fragments (rows g and g + 8 of the m-tile,
// columns 8 nt + 2t, 2t + 1; g = lane / 4, t = lane % 4), which is also how
// a warp holds its part of a wgmma accumulator.
#pragma once

#include <cmath>

#include "tc/tc_api.h"
#include "tc/tc_common.cuh"

namespace jax_flash::cuda::tc {

// Lazy rescale threshold of the online softmax (log2 units): P <= 2^8.
inline constexpr float kRescaleLog2 = 8.f;

// Per-launch constants, computed once on the host.
struct FwdArgs {
  FwdParams p;
  float scale_log2;      // log2(e) * scale, or log2(e) when softcap is on (scale goes into tanh)
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap
};

inline FwdArgs MakeFwdArgs(const FwdParams& params) {
  FwdArgs args;
  args.p = params;
  const float scale = static_cast<float>(params.score.scale);
  args.softcap = static_cast<float>(params.score.softcap);
  if (args.softcap > 0.f) {
    args.scale_log2 = kLog2e;
    args.scale_over_cap = scale / args.softcap;
  } else {
    args.softcap = 0.f;
    args.scale_log2 = scale * kLog2e;
    args.scale_over_cap = 0.f;
  }
  return args;
}

// Launches a forward kernel over (query blocks of kBlockM rows, q heads,
// batch), the grid both forwards use (FwdBlock reads it back).
template <int kBlockM, typename Kernel>
cudaError_t LaunchFwdGrid(Kernel kernel, int threads, size_t smem_bytes, const FwdParams& params,
                          cudaStream_t stream) {
  const FwdArgs args = MakeFwdArgs(params);
  const int64_t m_blocks = CeilDiv(params.shape.seqlen_q, kBlockM);
  if (m_blocks == 0 || params.shape.num_heads_q == 0 || params.shape.batch == 0) return cudaSuccess;
  if (params.shape.num_heads_q > 65535 || params.shape.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(params.shape.num_heads_q),
                  static_cast<unsigned>(params.shape.batch));
  kernel<<<grid, threads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

// One CTA's problem: query rows [m0, m0 + kBlockM) of head h, batch b; its
// K/V rows; the key blocks [n_begin, n_end) that hold visible keys.
template <typename T>
struct FwdBlock {
  int64_t b, h, m0, n_begin, n_end;
  BatchMask mask;
  GmemRows<T> q, k, v;

  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ static FwdBlock Make(const FwdParams& p) {
    FwdBlock r;
    // Longest blocks first: with causal masking the last query blocks see the
    // most keys, so scheduling them first shortens the tail.
    const int64_t m_block = gridDim.x - 1 - blockIdx.x;
    r.h = blockIdx.y;
    r.b = blockIdx.z;
    const int64_t h_kv = r.h / GroupSize(p.shape);
    r.m0 = m_block * kBlockM;
    const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
    const int head_dim = static_cast<int>(p.shape.head_dim);
    r.mask = BatchMask::For(p.mask, r.b, seqlen_q, seqlen_k);
    r.q = GmemRows<T>{static_cast<const T*>(p.q) + Offset(p.q_strides, r.b, 0, r.h),
                      p.q_strides.row, seqlen_q, head_dim};
    r.k = GmemRows<T>{static_cast<const T*>(p.k) + Offset(p.k_strides, r.b, 0, h_kv),
                      p.k_strides.row, seqlen_k, head_dim};
    r.v = GmemRows<T>{static_cast<const T*>(p.v) + Offset(p.v_strides, r.b, 0, h_kv),
                      p.v_strides.row, seqlen_k, head_dim};
    int64_t key_begin, key_end;
    r.mask.KeyRange(r.m0, r.m0 + kBlockM, &key_begin, &key_end);
    r.n_begin = key_begin / kBlockN;
    r.n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : r.n_begin;
    return r;
  }
};

// Soft cap, then the mask (-inf where hidden) on one key block of S whose
// first key is n0; `row0` is the warp's first query row. kBlockM is the CTA's,
// for the whole-block visibility test that skips the per-element work.
template <int kBlockM, int kMT, int kNTiles>
__device__ __forceinline__ void TransformAndMask(float (&s)[kMT][kNTiles][4], const FwdArgs& args,
                                                 const BatchMask& mask, int64_t m0, int64_t row0,
                                                 int64_t n0, int g, int t) {
  constexpr int kBlockN = kNTiles * kMmaN;
  if (args.softcap > 0.f) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          s[mt][nt][r] = args.softcap * FastTanh(s[mt][nt][r] * args.scale_over_cap);
  }
  if (!mask.AllVisible(m0, m0 + kBlockM, n0, n0 + kBlockN))
    HideKeys(s, mask, row0, n0, g, t, -INFINITY);
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
  auto lane_max = [&](int mt, int hr) {
    float m = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      m = fmaxf(m, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
    return m;
  };
  bool grow = false;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)  // -inf + margin = -inf: a row's first visible key moves it
      grow |= lane_max(mt, hr) > row_m[mt][hr] + rescale_margin;
  if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float m = lane_max(mt, hr);
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
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      // Masked scores are -inf, so their P is exp2(-inf) = 0.
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
      row_l[mt][hr] += sum;  // per-lane partial; reduced at the end
    }
  }
}

// out = O / l and lse = m + log(l) for the warp's rows from row0 on.
template <typename T, int kMT, int kDTiles>
__device__ __forceinline__ void WriteOutput(const FwdParams& p, int64_t b, int64_t h,
                                            int64_t row0, const float (&o)[kMT][kDTiles][4],
                                            const float (&row_m)[kMT][2],
                                            const float (&row_l)[kMT][2], float scale_log2, int g,
                                            int t) {
  const int64_t seqlen_q = p.shape.seqlen_q;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  T* out = static_cast<T*>(p.out) + Offset(p.out_strides, b, 0, h);
  float* lse = static_cast<float*>(p.lse) + (b * p.shape.num_heads_q + h) * seqlen_q;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = row_l[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // l == 0 only for rows that see no key: out = 0, lse = -inf. A NaN
      // logit makes l NaN, which reaches out and lse (jax.nn semantics).
      // Such a row writes 0 outright: its O may hold 0 x NaN from a NaN in
      // a value row it cannot see.
      const bool sees_nothing = l == 0.f;
      const float inv_l = 1.f / l;
      const int64_t i = row0 + mt * 16 + g + hr * 8;
      if (i < seqlen_q) {
        if (t == 0) {
          lse[i] = sees_nothing ? -INFINITY : (row_m[mt][hr] * scale_log2 + __log2f(l)) * kLn2;
        }
        T* out_row = out + i * p.out_strides.row;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(out_row + col) =
                sees_nothing ? 0u
                             : Pack2<T>(o[mt][dt][2 * hr] * inv_l, o[mt][dt][2 * hr + 1] * inv_l);
          }
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda::tc

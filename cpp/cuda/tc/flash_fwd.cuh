// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, sm_80+).
//
// Work partition (FA2): one CTA per (query block of kBlockM rows, q head,
// batch); its warps split the query block (kWarpRows rows each) so that the
// softmax statistics of a row never leave one warp. K/V blocks of kBlockN
// keys stream through a two-stage cp.async pipeline; S = Q K^T, the online
// softmax (m, l in registers, exp2 with the scale pre-multiplied by log2 e)
// and O += P V all stay in registers, P converted to 16 bits in place.
#pragma once

#include <cmath>

#include "tc/tc_api.h"
#include "tc/tc_common.cuh"

namespace jax_flash::cuda::tc {

// Tile shape per head-dim bucket. Rows per warp is 16 * kMTiles; two m-tiles
// per warp halve the shared-memory traffic of K and V per MMA (each B
// fragment feeds two MMAs) where registers allow it.
// Tile shape per head-dim bucket (ptxas -v: no spills at these shapes).
// Rows per warp is 16 * kMTiles; two m-tiles per warp halve the shared-memory
// traffic of K and V per MMA (each B fragment feeds two MMAs) where the
// registers allow it. JAX_FLASH_TC_FWD_{BM,BN,WARPS} override it for tuning.
template <int kHeadDim>
struct FwdTileShape {
  static constexpr int kBlockM = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kBlockN = kHeadDim <= 64 ? 64 : (kHeadDim == 96 ? 64 : 32);
  static constexpr int kNWarps = kHeadDim == 96 ? 8 : 4;
};
template <int kHeadDim_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
#ifdef JAX_FLASH_TC_FWD_BM
  static constexpr bool kTuned = kHeadDim == JAX_FLASH_TC_TUNE_D;
  static constexpr int kBlockM = kTuned ? JAX_FLASH_TC_FWD_BM : FwdTileShape<kHeadDim>::kBlockM;
  static constexpr int kBlockN = kTuned ? JAX_FLASH_TC_FWD_BN : FwdTileShape<kHeadDim>::kBlockN;
  static constexpr int kNWarps = kTuned ? JAX_FLASH_TC_FWD_WARPS : FwdTileShape<kHeadDim>::kNWarps;
#else
  static constexpr int kBlockM = FwdTileShape<kHeadDim>::kBlockM;
  static constexpr int kBlockN = FwdTileShape<kHeadDim>::kBlockN;
  static constexpr int kNWarps = FwdTileShape<kHeadDim>::kNWarps;
#endif
  static constexpr int kThreads = kNWarps * 32;
  // CTAs per SM the register allocation must allow (__launch_bounds__).
#ifdef JAX_FLASH_TC_FWD_MINB
  static constexpr int kMinBlocks = kHeadDim == JAX_FLASH_TC_TUNE_D ? JAX_FLASH_TC_FWD_MINB : 1;
#else
  static constexpr int kMinBlocks = 1;
#endif
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / kMmaM;
  static constexpr int kStride = kHeadDim + kSmemPad;  // smem row, elements
  static constexpr int kStages = 2;                    // K/V double buffer
  static constexpr int kSmemElems = kBlockM * kStride + 2 * kStages * kBlockN * kStride;
  static_assert(kWarpRows % kMmaM == 0 && kHeadDim % 16 == 0 && kBlockN % 16 == 0);
};

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

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    FlashFwdKernel(const __grid_constant__ FwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kMT = Traits::kMTiles;
  constexpr int kNTiles = kBlockN / kMmaN;   // n-tiles of S
  constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of O
  const FwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;                       // [kStages][kBlockN][kStride]
  T* sV = sK + Traits::kStages * kBlockN * kStride;     // [kStages][kBlockN][kStride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // Longest blocks first: with causal masking the last query blocks see the
  // most keys, so scheduling them first shortens the tail.
  const int64_t m_block = gridDim.x - 1 - blockIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t h_kv = h / GroupSize(p.shape);
  const int64_t m0 = m_block * kBlockM;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const BatchMask mask = BatchMask::For(p.mask, b, seqlen_q, seqlen_k);

  const GmemRows<T> q{static_cast<const T*>(p.q) + Offset(p.q_strides, b, 0, h), p.q_strides.row,
                      seqlen_q, head_dim};
  const GmemRows<T> k{static_cast<const T*>(p.k) + Offset(p.k_strides, b, 0, h_kv),
                      p.k_strides.row, seqlen_k, head_dim};
  const GmemRows<T> v{static_cast<const T*>(p.v) + Offset(p.v_strides, b, 0, h_kv),
                      p.v_strides.row, seqlen_k, head_dim};

  int64_t key_begin, key_end;
  mask.KeyRange(m0, m0 + kBlockM, &key_begin, &key_end);
  const int64_t n_begin = key_begin / kBlockN;
  const int64_t n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : n_begin;

  // Running statistics per owned row: rows (mt, half) = warp row + mt*16 + g + 8*half.
  float o[kMT][kDTiles][4];
  float row_m[kMT][2], row_l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) { row_m[mt][hr] = -INFINITY; row_l[mt][hr] = 0.f; }
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[mt][dt][r] = 0.f;
  }

  if (n_begin < n_end) {
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ, q, m0, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
  }

  const int warp_row0 = warp * Traits::kWarpRows;
  // ldmatrix row addresses of this lane (see the fragment layouts in
  // tc_common.cuh): Q as the A operand, K as B (non-transposed), V as B
  // (transposed, keys are the k dimension).
  const uint32_t q_frag =
      SmemAddr(sQ) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t k_lane =
      SmemAddr(sK) + 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t v_lane =
      SmemAddr(sV) + 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  const float scale_log2 = args.scale_log2;
  // Growth of a row max (score units) that forces a rescale: kRescaleLog2
  // in log2 units (scale_log2 > 0).
  const float rescale_margin = kRescaleLog2 / scale_log2;

  for (int64_t n = n_begin; n < n_end; ++n) {
    const int stage = static_cast<int>((n - n_begin) & 1);
    // One barrier per block: it publishes this block's K/V to all warps and
    // also tells that every warp is done with the previous block, whose
    // stage the prefetch below overwrites.
    CpAsyncWait<0>();
    __syncthreads();
    if (n + 1 < n_end) {
      // Prefetch the next K/V block into the other stage while this one computes.
      const int next = stage ^ 1;
      LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK + next * kBlockN * kStride, k,
                                                                (n + 1) * kBlockN, tid);
      LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV + next * kBlockN * kStride, v,
                                                                (n + 1) * kBlockN, tid);
      CpAsyncCommit();
    }
    // Shared addresses as 32-bit byte offsets: per-lane part once, the
    // unrolled tile offsets then fold into the ldmatrix immediates.
    const uint32_t k_frag = k_lane + stage * (kBlockN * kStride * 2);
    const uint32_t v_frag = v_lane + stage * (kBlockN * kStride * 2);

    // ---- S = Q K^T -------------------------------------------------------
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mt][nt][r] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        Ldmatrix4(a[mt], q_frag + 2 * (mt * 16 * kStride + kk * 16));
#pragma unroll
      for (int nt2 = 0; nt2 < kBlockN / 16; ++nt2) {
        uint32_t bf[4];
        Ldmatrix4(bf, k_frag + 2 * (nt2 * 16 * kStride + kk * 16));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>(s[mt][2 * nt2], a[mt], bf[0], bf[1]);
          Mma<T>(s[mt][2 * nt2 + 1], a[mt], bf[2], bf[3]);
        }
      }
    }

    // ---- score transform and mask ------------------------------------------
    if (args.softcap > 0.f) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            s[mt][nt][r] = args.softcap * FastTanh(s[mt][nt][r] * args.scale_over_cap);
    }
    const int64_t n0 = n * kBlockN;
    if (!mask.AllVisible(m0, m0 + kBlockM, n0, n0 + kBlockN)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int64_t i = m0 + warp_row0 + mt * 16 + g + hr * 8;
          const ColWindow w = KeyWindow(mask, i, n0, kBlockN);
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int jr = nt * 8 + 2 * t + c;
              // Segments: only inside the band, the one per-element test.
              const bool visible =
                  w.Contains(jr) && (mask.q_seg == nullptr || mask.Visible(i, n0 + jr));
              if (!visible) s[mt][nt][2 * hr + c] = -INFINITY;
            }
        }
    }

    // ---- online softmax, lazy rescale ---------------------------------------
    // row_m is the reference P is taken against, not always the running max:
    // it moves (and O, l are rescaled) only when some row of this warp grew
    // past it by more than kRescaleLog2 in log2 units. O and l share the
    // reference and lse uses it too, so the result is exact either way; P is
    // then <= 2^kRescaleLog2, harmless in 16 bits and float32. Random data
    // rarely grows that much after the first block, so the kMT x kDTiles x 4
    // multiplies of O per block (as many as the exp2s at BN 32) mostly go.
    // The row max (over this lane's part of the row: the vote covers the
    // quad) is recomputed in the rare rescale branch rather than kept live
    // across the vote, which would cost registers in the common path.
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

    // ---- O += P V (P from registers) -------------------------------------
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = Pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
        a[mt][1] = Pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
        a[mt][2] = Pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
        a[mt][3] = Pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
      }
#pragma unroll
      for (int dt2 = 0; dt2 < kHeadDim / 16; ++dt2) {
        uint32_t bf[4];
        Ldmatrix4Trans(bf, v_frag + 2 * (ks * 16 * kStride + dt2 * 16));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>(o[mt][2 * dt2], a[mt], bf[0], bf[1]);
          Mma<T>(o[mt][2 * dt2 + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
  }

  // ---- epilogue: O / l, lse = m + log(l) ---------------------------------
  T* out = static_cast<T*>(p.out) + Offset(p.out_strides, b, 0, h);
  float* lse = static_cast<float*>(p.lse) + (b * p.shape.num_heads_q + h) * seqlen_q;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = row_l[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // l == 0 only for rows that see no key: out = 0, lse = -inf.
      const float inv_l = l > 0.f ? 1.f / l : 0.f;
      const int64_t i = m0 + warp_row0 + mt * 16 + g + hr * 8;
      if (i < seqlen_q) {
        if (t == 0) {
          lse[i] = l > 0.f ? (row_m[mt][hr] * scale_log2 + __log2f(l)) * kLn2 : -INFINITY;
        }
        T* out_row = out + i * p.out_strides.row;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(out_row + col) =
                Pack2<T>(o[mt][dt][2 * hr] * inv_l, o[mt][dt][2 * hr + 1] * inv_l);
          }
        }
      }
    }
  }
}

template <typename T, int kHeadDim>
cudaError_t RunFwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdTraits<kHeadDim>;
  if (params.shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  const FwdArgs args = MakeFwdArgs(params);
  const int64_t m_blocks = CeilDiv(params.shape.seqlen_q, Traits::kBlockM);
  if (m_blocks == 0 || params.shape.num_heads_q == 0 || params.shape.batch == 0) return cudaSuccess;
  if (params.shape.num_heads_q > 65535 || params.shape.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const size_t smem = Traits::kSmemElems * sizeof(T);
  auto kernel = FlashFwdKernel<T, Traits>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(params.shape.num_heads_q),
                  static_cast<unsigned>(params.shape.batch));
  kernel<<<grid, Traits::kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::tc

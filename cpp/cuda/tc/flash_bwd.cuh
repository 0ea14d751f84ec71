// FlashAttention-2 backward on tensor cores (mma.sync m16n8k16, sm_80+).
//
// Kernels, in stream order:
//   1. BwdPreprocessKernel: D = rowsum(dO * O) into params.delta.
//   2. FlashBwdDkDvKernel: one CTA per (key block of kBlockN, kv head, batch)
//      (FA2: parallel over keys). Each warp owns 16 keys and computes the
//      transposed tiles S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T
//      come out of the MMAs already in the A-fragment layout of
//      dV += P^T dO and dK += dS^T Q: no shared-memory round trip. The CTA
//      loops over the q heads of its GQA group and the query blocks each can
//      see, so K/V are never repeated and dK/dV are summed in registers.
//      Fast mode also computes dQ += dS K per query block (dS^T through a
//      double-buffered shared tile, one step late so a step has a single
//      barrier) and adds it with float32 atomics into the workspace.
//   3. fast mode: DqConvertKernel (float32 workspace -> dq, times scale);
//      deterministic mode: FlashBwdDqKernel, parallel over query blocks,
//      recomputes S and dP and sums dQ over keys in a fixed order (no
//      atomics, so bitwise reproducible).
#pragma once

#include <algorithm>
#include <cmath>

#include "tc/tc_api.h"
#include "tc/tc_common.cuh"

namespace jax_flash::cuda::tc {

// dK/dV kernel tile shape. Registers per warp hold dK and dV for 16 keys x
// kDPart columns; for head dims above 128 that would not fit, so the kernel
// makes kDSplit passes over the query blocks, each accumulating one slice of
// the head dim (S and dP are recomputed per pass).
template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
#ifdef JAX_FLASH_TC_BWD_BN
  static constexpr int kBlockN =
      kHeadDim == JAX_FLASH_TC_TUNE_D ? JAX_FLASH_TC_BWD_BN : (kHeadDim <= 128 ? 128 : 64);
#else
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;  // keys per CTA
#endif
  // 32 queries per step where dK/dV fill most registers (D > 96).
  // JAX_FLASH_TC_BWD_BM overrides it for tuning.
#ifdef JAX_FLASH_TC_BWD_BM
  static constexpr int kBlockM =
      kHeadDim == JAX_FLASH_TC_TUNE_D ? JAX_FLASH_TC_BWD_BM : (kHeadDim <= 96 ? 64 : 32);
#else
  static constexpr int kBlockM = kHeadDim <= 96 ? 64 : 32;  // queries per step
#endif
  static constexpr int kNWarps = kBlockN / kMmaM;             // 16 keys per warp
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kDSplit = kHeadDim <= 128 ? 1 : (kHeadDim <= 192 ? 2 : 4);
  static constexpr int kDPart = kHeadDim / kDSplit;
  // dQ = dS K tile split: kWarpsQ warps over the query rows, kWarpsD over
  // the columns of the current head-dim slice.
  static constexpr int kWarpsQ = kBlockM / kMmaM;
  static constexpr int kWarpsD = kNWarps / kWarpsQ;
  static constexpr int kDqCols = kDPart / kWarpsD;
  static constexpr int kStride = kHeadDim + kSmemPad;
  static constexpr int kStrideS = kBlockM + kSmemPad;  // dS^T rows (keys) x queries
  static constexpr int kStages = 2;                    // Q/dO double buffer
  // dS^T double buffer: dQ of step s runs at the start of step s + 1, behind
  // that step's barrier, so a step needs one barrier instead of two.
  static constexpr int kDsBuffers = 2;
  static constexpr size_t kSmemBytes =
      sizeof(uint16_t) * (2 * kBlockN * kStride + 2 * kStages * kBlockM * kStride +
                          kDsBuffers * kBlockN * kStrideS) +
      sizeof(float) * 2 * kStages * kBlockM;
  static_assert(kNWarps % kWarpsQ == 0 && kDqCols % 16 == 0 && kDPart % 16 == 0);
  static_assert(kThreads >= 2 * kBlockM, "one thread per lse / D element");
};

// Deterministic dQ kernel tile shape: the forward's structure (warps split
// the query block, keys stream through a two-stage pipeline).
template <int kHeadDim_>
struct BwdDqTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kBlockM = kNWarps * kMmaM;
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kStride = kHeadDim + kSmemPad;
  static constexpr int kStages = 2;
  static constexpr size_t kSmemBytes =
      sizeof(uint16_t) * (2 * kBlockM * kStride + 2 * kStages * kBlockN * kStride);
};

struct BwdArgs {
  BwdParams p;
  float scale;           // d score / d (q.k) without softcap
  float scale_log2;      // log2(e) * scale, or log2(e) when softcap is on
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap
  float inv_softcap;     // 1 / softcap, 0 when off (then d x / d s = 1 - 0 = 1)
  float* lse2;           // (B, Hq, Sq) float32 workspace: Lse2(lse), see below
  float* dq_accum;       // float32 workspace, fast mode only: DqAccumLayout below
};

// The float32 dQ accumulator of the fast backward. Each (batch, query head)
// has its kHeadDim columns as two halves, [half][query][kHeadDim / 2 + 8
// floats]: a row of a half is padded by 32 bytes. So a block of queries of
// one half is one contiguous range, which the Hopper kernel adds with a
// single bulk reduction from a shared staging tile with the same padded rows
// (whose padding keeps its fragment stores free of bank conflicts).
template <int kHeadDim>
struct DqAccumLayout {
  static constexpr int kHalf = kHeadDim / 2;         // columns per half
  static constexpr int kHalfRowFloats = kHalf + 8;   // a half-row and its padding
  static constexpr int kRowFloats = 2 * kHalfRowFloats;  // floats per query row
  // Element (query i, column col) of the accumulator of (batch, head) bh.
  __host__ __device__ static int64_t Index(int64_t bh, int64_t seqlen_q, int64_t i, int col) {
    const int half = col >= kHalf;
    return ((bh * 2 + half) * seqlen_q + i) * kHalfRowFloats + (col - half * kHalf);
  }
  // The first element of half `half`'s row i of (batch, head) bh.
  __host__ __device__ static int64_t HalfRow(int64_t bh, int64_t seqlen_q, int half, int64_t i) {
    return ((bh * 2 + half) * seqlen_q + i) * kHalfRowFloats;
  }
};

// lse in log2 units for P = exp2(x * scale_log2 - lse2). A row that sees no
// key has lse = -inf; +inf makes its P exactly 0 instead of exp2(+inf).
__device__ __forceinline__ float Lse2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// D = rowsum(dO * O), one warp per row, 16-byte loads; also lse in log2
// units, once per row instead of once per (row, key block) in the kernels.
template <typename T>
__global__ void __launch_bounds__(256) BwdPreprocessKernel(const __grid_constant__ BwdArgs args) {
  const BwdParams& p = args.p;
  const int64_t rows = p.shape.batch * p.shape.num_heads_q * p.shape.seqlen_q;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t i = r % p.shape.seqlen_q;
  const int64_t h = (r / p.shape.seqlen_q) % p.shape.num_heads_q;
  const int64_t b = r / (p.shape.seqlen_q * p.shape.num_heads_q);
  const T* o = static_cast<const T*>(p.out) + Offset(p.out_strides, b, i, h);
  const T* d_o = static_cast<const T*>(p.dout) + Offset(p.dout_strides, b, i, h);
  float sum = 0.f;
  for (int c = lane * kVecElems; c < p.shape.head_dim; c += 32 * kVecElems) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) sum += ToFloat(oe[e]) * ToFloat(de[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    static_cast<float*>(p.delta)[r] = sum;
    args.lse2[r] = Lse2(static_cast<const float*>(p.lse)[r]);
  }
}

// ---- One warp's S^T / dP^T fragments: 16 keys (rows g, g + 8) x 8 kQTiles
// queries (column nt * 8 + 2t + c of this lane), mma.sync C layout; both
// dK/dV kernels (this file's and flash_bwd_sm90.cuh's) turn them into P^T
// and dS^T with these. lse2 and D of the step's queries come from shared
// memory, as float2 per lane.

// Soft cap: x = cap * tanh(s * scale / cap) in st; d x / d (scaled score) =
// 1 - tanh^2 = 1 - (x / cap)^2, folded into dP^T - D in dpt.
template <int kQTiles>
__device__ __forceinline__ void SoftcapAndSubtractDelta(float (&st)[kQTiles][4],
                                                        float (&dpt)[kQTiles][4],
                                                        const float* delta_s, const BwdArgs& args,
                                                        int t) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + nt * 8 + 2 * t);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float x = args.softcap * FastTanh(st[nt][r] * args.scale_over_cap);
      const float th = x * args.inv_softcap;
      st[nt][r] = x;
      dpt[nt][r] = (dpt[nt][r] - (r % 2 ? dl.y : dl.x)) * (1.f - th * th);
    }
  }
}

// dpt = dP^T - D (no soft cap).
template <int kQTiles>
__device__ __forceinline__ void SubtractDelta(float (&dpt)[kQTiles][4], const float* delta_s,
                                              int t) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + nt * 8 + 2 * t);
#pragma unroll
    for (int r = 0; r < 4; ++r) dpt[nt][r] -= r % 2 ? dl.y : dl.x;
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

// P^T = 0 where the mask hides the pair, by a select: a masked P that
// overflowed to +inf (its key was not in the row's lse) still gives P = dS =
// 0. key0: the warp's first key; m0: the step's first query.
template <int kQTiles>
__device__ __forceinline__ void MaskProbabilitiesT(float (&st)[kQTiles][4], const BatchMask& mask,
                                                   int64_t key0, int64_t m0, int g, int t) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t j = key0 + g + hr * 8;
    const ColWindow w = QueryWindow(mask, j, m0, 8 * kQTiles);
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int qi = nt * 8 + 2 * t + c;
        const bool visible =
            w.Contains(qi) && (mask.q_seg == nullptr || mask.Visible(m0 + qi, j));
        if (!visible) st[nt][2 * hr + c] = 0.f;
      }
  }
}

// cp.async of one step's lse2 and D (kBlockM rows each, from row_base + m0)
// into a stage of sLse / sDelta; threads 0 .. 2 kBlockM - 1 take one each.
template <int kBlockM>
__device__ __forceinline__ void LoadRowStats(const BwdArgs& args, int64_t row_base, int64_t m0,
                                             int64_t seqlen_q, float* lse_stage,
                                             float* delta_stage, int tid) {
  if (tid < 2 * kBlockM) {
    const int r = tid % kBlockM;
    const bool valid = m0 + r < seqlen_q;
    const float* src = tid < kBlockM ? static_cast<const float*>(args.lse2)
                                     : static_cast<const float*>(args.p.delta);
    float* dst = (tid < kBlockM ? lse_stage : delta_stage) + r;
    CpAsync4(SmemAddr(dst), valid ? src + row_base + m0 + r : src, valid);
  }
}

template <typename T, typename Traits, bool kAccumDq>
__global__ void __launch_bounds__(Traits::kThreads)
    FlashBwdDkDvKernel(const __grid_constant__ BwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kDPart = Traits::kDPart, kStrideS = Traits::kStrideS;
  constexpr int kQTiles = kBlockM / kMmaN;     // n-tiles of S^T (queries)
  constexpr int kPartTiles = kDPart / kMmaN;   // n-tiles of dK, dV
  constexpr int kDqTiles = Traits::kDqCols / kMmaN;
  const BwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;                    // [kStages][kBlockM][kStride]
  T* sdO = sQ + Traits::kStages * kBlockM * kStride; // [kStages][kBlockM][kStride]
  T* sdS = sdO + Traits::kStages * kBlockM * kStride;  // [kDsBuffers][kBlockN][kStrideS]
  float* sLse = reinterpret_cast<float*>(sdS + Traits::kDsBuffers * kBlockN * kStrideS);  // [kStages][kBlockM]
  float* sDelta = sLse + Traits::kStages * kBlockM;                  // [kStages][kBlockM]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = n_block * kBlockN;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int64_t num_heads_q = p.shape.num_heads_q;
  const int64_t group = GroupSize(p.shape);
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const BatchMask mask = BatchMask::For(p.mask, b, seqlen_q, seqlen_k);

  const GmemRows<T> k{static_cast<const T*>(p.k) + Offset(p.k_strides, b, 0, h_kv),
                      p.k_strides.row, seqlen_k, head_dim};
  const GmemRows<T> v{static_cast<const T*>(p.v) + Offset(p.v_strides, b, 0, h_kv),
                      p.v_strides.row, seqlen_k, head_dim};

  int64_t q_begin, q_end;
  mask.QueryRange(n0, n0 + kBlockN, &q_begin, &q_end);
  const int64_t m_begin = q_begin / kBlockM;
  const int64_t m_count = q_begin < q_end ? CeilDiv(q_end, kBlockM) - m_begin : 0;
  const int64_t steps = group * m_count;  // (q head of the group, query block) pairs

  // Step (q head gi of the group, query block mi): loads Q, dO, lse, D
  // into a stage.
  auto issue = [&](int64_t gi, int64_t mi, int stage) {
    const int64_t h = h_kv * group + gi;
    const int64_t m0 = (m_begin + mi) * kBlockM;
    const GmemRows<T> q{static_cast<const T*>(p.q) + Offset(p.q_strides, b, 0, h),
                        p.q_strides.row, seqlen_q, head_dim};
    const GmemRows<T> d_o{static_cast<const T*>(p.dout) + Offset(p.dout_strides, b, 0, h),
                          p.dout_strides.row, seqlen_q, head_dim};
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ + stage * kBlockM * kStride, q,
                                                              m0, tid);
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sdO + stage * kBlockM * kStride,
                                                              d_o, m0, tid);
    LoadRowStats<kBlockM>(args, (b * num_heads_q + h) * seqlen_q, m0, seqlen_q,
                          sLse + stage * kBlockM, sDelta + stage * kBlockM, tid);
  };

  // ldmatrix lane addresses (layouts in tc_common.cuh): K, V as A operands
  // (rows = this warp's keys); Q, dO as B of S^T / dP^T (non-transposed)
  // and as B of dK / dV (transposed, queries are the k dimension).
  const int warp_row0 = warp * kMmaM;
  const uint32_t k_frag = SmemAddr(sK) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t v_frag = SmemAddr(sV) + 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t qb_lane = 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t qt_lane = 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  // dQ = dS K: dS (queries x keys) read transposed from sdS, K transposed.
  const int dq_row0 = (warp % Traits::kWarpsQ) * kMmaM;
  const int dq_col0 = (warp / Traits::kWarpsQ) * Traits::kDqCols;
  const uint32_t ds_frag =
      SmemAddr(sdS) + 2 * (((lane / 16) * 8 + lane % 8) * kStrideS + dq_row0 + ((lane / 8) % 2) * 8);
  const uint32_t kt_frag = SmemAddr(sK) + 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride +
                                               dq_col0 + (lane / 16) * 8);
  const uint32_t sQ_addr = SmemAddr(sQ), sdO_addr = SmemAddr(sdO);

  LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n0, tid);
  LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n0, tid);
  CpAsyncCommit();

  const float scale_log2 = args.scale_log2;
  const bool softcap = args.softcap > 0.f;
  for (int part = 0; part < Traits::kDSplit; ++part) {
    const int part_col0 = part * kDPart;
    float dk[kPartTiles][4], dv[kPartTiles][4];
#pragma unroll
    for (int dt = 0; dt < kPartTiles; ++dt)
#pragma unroll
      for (int r = 0; r < 4; ++r) { dk[dt][r] = 0.f; dv[dt][r] = 0.f; }

    // dQ += dS K for the step (q head h, query block at m0) whose dS^T sits
    // in dS buffer buf, then float32 atomics into the workspace. Runs one
    // step late (behind the next step's barrier, which publishes sdS), so
    // the step needs no second barrier and these MMAs overlap the next
    // step's S^T / dP^T GEMM instead of waiting for the slowest warp.
    auto dq_step = [&](int buf, int64_t h, int64_t m0) {
      float dq[kDqTiles][4];
#pragma unroll
      for (int dt = 0; dt < kDqTiles; ++dt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dq[dt][r] = 0.f;
      const uint32_t buf_off = buf * (kBlockN * kStrideS * 2);
#pragma unroll
      for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
        uint32_t a[4];
        Ldmatrix4Trans(a, ds_frag + buf_off + 2 * ks * 16 * kStrideS);
#pragma unroll
        for (int dt2 = 0; dt2 < kDqTiles / 2; ++dt2) {
          uint32_t bk[4];
          Ldmatrix4Trans(bk, kt_frag + 2 * (ks * 16 * kStride + part_col0 + dt2 * 16));
          Mma<T>(dq[2 * dt2], a, bk[0], bk[1]);
          Mma<T>(dq[2 * dt2 + 1], a, bk[2], bk[3]);
        }
      }
      using Acc = DqAccumLayout<kHeadDim>;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t i = m0 + dq_row0 + g + hr * 8;
        if (i < seqlen_q) {
#pragma unroll
          for (int dt = 0; dt < kDqTiles; ++dt) {
            const int col = part_col0 + dq_col0 + dt * 8 + 2 * t;
            if (col < head_dim) {
              // col and col + 1 are in the same half (kHalf is even).
              float* acc = args.dq_accum + Acc::Index(b * num_heads_q + h, seqlen_q, i, col);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              // One 8-byte vector reduction instead of two scalar ones.
              atomicAdd(reinterpret_cast<float2*>(acc),
                        make_float2(dq[dt][2 * hr], dq[dt][2 * hr + 1]));
#else
              atomicAdd(acc, dq[dt][2 * hr]);
              atomicAdd(acc + 1, dq[dt][2 * hr + 1]);
#endif
            }
          }
        }
      }
    };

    if (steps > 0) {
      __syncthreads();  // the previous pass may still read stage 0
      issue(0, 0, 0);
      CpAsyncCommit();
    }
    // Steps walk (gi, mi) in order; counters instead of divisions.
    int64_t gi = 0, mi = 0;
    int64_t prev_h = 0, prev_m0 = 0;  // the step whose dQ is still pending
    for (int64_t s = 0; s < steps; ++s) {
      const int stage = static_cast<int>(s & 1);
      // One barrier at the top of a step: publishes this stage and the
      // previous step's dS^T, and every warp has finished the previous
      // step, so its Q/dO stage (prefetched into below) and the dS buffer
      // of two steps ago (written below) are free.
      CpAsyncWait<0>();
      __syncthreads();
      const int64_t h = h_kv * group + gi;
      const int64_t m0 = (m_begin + mi) * kBlockM;
      if (++mi == m_count) { mi = 0; ++gi; }  // (gi, mi) is now the next step
      if (s + 1 < steps) {
        issue(gi, mi, stage ^ 1);
        CpAsyncCommit();
      }
      if constexpr (kAccumDq) {
        if (s > 0) dq_step(stage ^ 1, prev_h, prev_m0);
      }
      const uint32_t stage_off = stage * (kBlockM * kStride * 2);
      const float* lse2_s = sLse + stage * kBlockM;
      const float* delta_s = sDelta + stage * kBlockM;

      // ---- S^T = K Q^T and dP^T = V dO^T (16 keys x kBlockM queries) ----
      float st[kQTiles][4], dpt[kQTiles][4];
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) { st[nt][r] = 0.f; dpt[nt][r] = 0.f; }
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
        uint32_t ak[4], av[4];
        Ldmatrix4(ak, k_frag + 2 * kk * 16);
        Ldmatrix4(av, v_frag + 2 * kk * 16);
#pragma unroll
        for (int nt2 = 0; nt2 < kBlockM / 16; ++nt2) {
          uint32_t bq[4], bo[4];
          const uint32_t off = stage_off + qb_lane + 2 * (nt2 * 16 * kStride + kk * 16);
          Ldmatrix4(bq, sQ_addr + off);
          Ldmatrix4(bo, sdO_addr + off);
          Mma<T>(st[2 * nt2], ak, bq[0], bq[1]);
          Mma<T>(st[2 * nt2 + 1], ak, bq[2], bq[3]);
          Mma<T>(dpt[2 * nt2], av, bo[0], bo[1]);
          Mma<T>(dpt[2 * nt2 + 1], av, bo[2], bo[3]);
        }
      }

      // ---- P^T and dS^T = P^T (dP^T - D) dx -------------------------------
      // The common case (no softcap, every pair visible) costs 4 instructions
      // per element; softcap and the mask are uniform branches around it.
      // Column qi = nt * 8 + 2t + c of this lane: lse2 and D as float2.
      if (softcap) {
        SoftcapAndSubtractDelta(st, dpt, delta_s, args, t);
      } else {
        SubtractDelta(dpt, delta_s, t);
      }
      ExpScoresT(st, lse2_s, scale_log2, t);
      if (!mask.AllVisible(m0, m0 + kBlockM, n0, n0 + kBlockN))
        MaskProbabilitiesT(st, mask, n0 + warp_row0, m0, g, t);
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dpt[nt][r] *= st[nt][r];

      // ---- dV += P^T dO, dK += dS^T Q (this pass's head-dim slice) -------
#pragma unroll
      for (int ks = 0; ks < kBlockM / kMmaK; ++ks) {
        uint32_t ap[4], ads[4];
        PackA<T>(ap, st[2 * ks], st[2 * ks + 1]);
        PackA<T>(ads, dpt[2 * ks], dpt[2 * ks + 1]);
        if constexpr (kAccumDq) {
          // dS^T for the next step's dQ: a0/a2 are row g, a1/a3 row g + 8.
          T* ds_row = sdS + stage * kBlockN * kStrideS + (warp_row0 + g) * kStrideS + ks * 16 + 2 * t;
          *reinterpret_cast<uint32_t*>(ds_row) = ads[0];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kStrideS) = ads[1];
          *reinterpret_cast<uint32_t*>(ds_row + 8) = ads[2];
          *reinterpret_cast<uint32_t*>(ds_row + 8 * kStrideS + 8) = ads[3];
        }
#pragma unroll
        for (int dt2 = 0; dt2 < kDPart / 16; ++dt2) {
          uint32_t bo[4], bq[4];
          const uint32_t off =
              stage_off + qt_lane + 2 * (ks * 16 * kStride + part_col0 + dt2 * 16);
          Ldmatrix4Trans(bo, sdO_addr + off);
          Ldmatrix4Trans(bq, sQ_addr + off);
          Mma<T>(dv[2 * dt2], ap, bo[0], bo[1]);
          Mma<T>(dv[2 * dt2 + 1], ap, bo[2], bo[3]);
          Mma<T>(dk[2 * dt2], ads, bq[0], bq[1]);
          Mma<T>(dk[2 * dt2 + 1], ads, bq[2], bq[3]);
        }
      }
      prev_h = h;
      prev_m0 = m0;
    }
    if constexpr (kAccumDq) {
      if (steps > 0) {
        __syncthreads();  // publishes the last step's dS^T
        dq_step(static_cast<int>((steps - 1) & 1), prev_h, prev_m0);
      }
    }
    // ---- write this slice of dK (times d score / d q.k) and dV -------------
    T* dk_out = static_cast<T*>(p.dk) + Offset(p.dk_strides, b, 0, h_kv);
    T* dv_out = static_cast<T*>(p.dv) + Offset(p.dv_strides, b, 0, h_kv);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t j = n0 + warp_row0 + g + hr * 8;
      if (j < seqlen_k) {
#pragma unroll
        for (int dt = 0; dt < kPartTiles; ++dt) {
          const int col = part_col0 + dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(dk_out + j * p.dk_strides.row + col) =
                Pack2<T>(dk[dt][2 * hr] * args.scale, dk[dt][2 * hr + 1] * args.scale);
            *reinterpret_cast<uint32_t*>(dv_out + j * p.dv_strides.row + col) =
                Pack2<T>(dv[dt][2 * hr], dv[dt][2 * hr + 1]);
          }
        }
      }
    }
  }
  CpAsyncWait<0>();  // K/V were loaded even when no query block sees this key block
}

// Deterministic dQ: one CTA per (query block, q head, batch), keys in order.
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    FlashBwdDqKernel(const __grid_constant__ BwdArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  const BwdParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kStride;
  T* sK = sdO + kBlockM * kStride;                  // [kStages][kBlockN][kStride]
  T* sV = sK + Traits::kStages * kBlockN * kStride;  // [kStages][kBlockN][kStride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t m_block = gridDim.x - 1 - blockIdx.x;  // longest (causal) first
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t h_kv = h / GroupSize(p.shape);
  const int64_t m0 = m_block * kBlockM;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  const BatchMask mask = BatchMask::For(p.mask, b, seqlen_q, seqlen_k);

  const GmemRows<T> q{static_cast<const T*>(p.q) + Offset(p.q_strides, b, 0, h), p.q_strides.row,
                      seqlen_q, head_dim};
  const GmemRows<T> d_o{static_cast<const T*>(p.dout) + Offset(p.dout_strides, b, 0, h),
                        p.dout_strides.row, seqlen_q, head_dim};
  const GmemRows<T> k{static_cast<const T*>(p.k) + Offset(p.k_strides, b, 0, h_kv),
                      p.k_strides.row, seqlen_k, head_dim};
  const GmemRows<T> v{static_cast<const T*>(p.v) + Offset(p.v_strides, b, 0, h_kv),
                      p.v_strides.row, seqlen_k, head_dim};

  int64_t key_begin, key_end;
  mask.KeyRange(m0, m0 + kBlockM, &key_begin, &key_end);
  const int64_t n_begin = key_begin / kBlockN;
  const int64_t n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : n_begin;

  const int warp_row0 = warp * kMmaM;
  // Per-row statistics of the two rows this lane owns.
  const int64_t row_base = (b * p.shape.num_heads_q + h) * seqlen_q;
  float lse2[2], delta[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    lse2[hr] = i < seqlen_q ? args.lse2[row_base + i] : INFINITY;
    delta[hr] = i < seqlen_q ? static_cast<const float*>(p.delta)[row_base + i] : 0.f;
  }

  float dq[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) dq[dt][r] = 0.f;

  if (n_begin < n_end) {
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sQ, q, m0, tid);
    LoadTile<T, kBlockM, kHeadDim, kStride, Traits::kThreads>(sdO, d_o, m0, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK, k, n_begin * kBlockN, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV, v, n_begin * kBlockN, tid);
    CpAsyncCommit();
  }
  const uint32_t a_lane = 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t q_frag = SmemAddr(sQ) + a_lane, do_frag = SmemAddr(sdO) + a_lane;
  const uint32_t b_lane = 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t bt_lane = 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  const uint32_t sK_addr = SmemAddr(sK), sV_addr = SmemAddr(sV);
  const float scale_log2 = args.scale_log2;

  for (int64_t n = n_begin; n < n_end; ++n) {
    const int stage = static_cast<int>((n - n_begin) & 1);
    // One barrier per block (see FlashFwdKernel): publishes this stage and
    // frees the other one for the prefetch.
    CpAsyncWait<0>();
    __syncthreads();
    if (n + 1 < n_end) {
      const int next = stage ^ 1;
      LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sK + next * kBlockN * kStride, k,
                                                                (n + 1) * kBlockN, tid);
      LoadTile<T, kBlockN, kHeadDim, kStride, Traits::kThreads>(sV + next * kBlockN * kStride, v,
                                                                (n + 1) * kBlockN, tid);
      CpAsyncCommit();
    }
    const uint32_t stage_off = stage * (kBlockN * kStride * 2);

    // ---- S = Q K^T, dP = dO V^T -------------------------------------------
    float s[kNTiles][4], dp[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) { s[nt][r] = 0.f; dp[nt][r] = 0.f; }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
      uint32_t aq[4], ao[4];
      Ldmatrix4(aq, q_frag + 2 * kk * 16);
      Ldmatrix4(ao, do_frag + 2 * kk * 16);
#pragma unroll
      for (int nt2 = 0; nt2 < kBlockN / 16; ++nt2) {
        uint32_t bk[4], bv[4];
        const uint32_t off = stage_off + b_lane + 2 * (nt2 * 16 * kStride + kk * 16);
        Ldmatrix4(bk, sK_addr + off);
        Ldmatrix4(bv, sV_addr + off);
        Mma<T>(s[2 * nt2], aq, bk[0], bk[1]);
        Mma<T>(s[2 * nt2 + 1], aq, bk[2], bk[3]);
        Mma<T>(dp[2 * nt2], ao, bv[0], bv[1]);
        Mma<T>(dp[2 * nt2 + 1], ao, bv[2], bv[3]);
      }
    }

    // ---- P and dS (softcap and mask as in FlashBwdDkDvKernel) -------------
    if (args.softcap > 0.f) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float x = args.softcap * FastTanh(s[nt][r] * args.scale_over_cap);
          const float th = x * args.inv_softcap;
          s[nt][r] = x;
          dp[nt][r] = (dp[nt][r] - delta[r / 2]) * (1.f - th * th);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) dp[nt][r] -= delta[r / 2];
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[nt][r] = FastExp2(fmaf(s[nt][r], scale_log2, -lse2[r / 2]));
    const int64_t n0 = n * kBlockN;
    if (!mask.AllVisible(m0, m0 + kBlockM, n0, n0 + kBlockN))  // one m-tile: s as [1][..]
      HideKeys(reinterpret_cast<float(&)[1][kNTiles][4]>(s), mask, m0 + warp_row0, n0, g, t, 0.f);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[nt][r] *= dp[nt][r];  // dS

    // ---- dQ += dS K ---------------------------------------------------------
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      uint32_t a[4];
      PackA<T>(a, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
      for (int dt2 = 0; dt2 < kHeadDim / 16; ++dt2) {
        uint32_t bk[4];
        Ldmatrix4Trans(bk, sK_addr + stage_off + bt_lane + 2 * (ks * 16 * kStride + dt2 * 16));
        Mma<T>(dq[2 * dt2], a, bk[0], bk[1]);
        Mma<T>(dq[2 * dt2 + 1], a, bk[2], bk[3]);
      }
    }
  }

  T* dq_out = static_cast<T*>(p.dq) + Offset(p.dq_strides, b, 0, h);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    if (i < seqlen_q) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(dq_out + i * p.dq_strides.row + col) =
              Pack2<T>(dq[dt][2 * hr] * args.scale, dq[dt][2 * hr + 1] * args.scale);
        }
      }
    }
  }
}

// dq = scale * dq_accum, eight elements (two float4 loads, one 16-byte
// store) per thread: head_dim is a multiple of 8 (tc Supports), so a group
// is all inside or all outside it. Two elements per thread spent more time
// in the 64-bit index divisions than in memory (H100, D=128: ~33 us per 16M
// elements against ~18 us for the bytes).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) DqConvertKernel(const __grid_constant__ BwdArgs args) {
  const BwdParams& p = args.p;
  constexpr int kGroups = kHeadDim / 8;  // groups of 8 columns per row
  const int64_t groups = p.shape.batch * p.shape.num_heads_q * p.shape.seqlen_q * kGroups;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < groups;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(e % kGroups) * 8;
    if (col >= p.shape.head_dim) continue;
    const int64_t r = e / kGroups;
    const int64_t i = r % p.shape.seqlen_q;
    const int64_t bh = r / p.shape.seqlen_q;
    const int64_t h = bh % p.shape.num_heads_q;
    const int64_t b = bh / p.shape.num_heads_q;
    const float4* acc = reinterpret_cast<const float4*>(
        args.dq_accum + DqAccumLayout<kHeadDim>::Index(bh, p.shape.seqlen_q, i, col));
    const float4 lo = acc[0], hi = acc[1];
    const float s = args.scale;
    const uint4 out = {Pack2<T>(lo.x * s, lo.y * s), Pack2<T>(lo.z * s, lo.w * s),
                       Pack2<T>(hi.x * s, hi.y * s), Pack2<T>(hi.z * s, hi.w * s)};
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + Offset(p.dq_strides, b, i, h) + col) = out;
  }
}

// Workspace: [lse2: rows floats, padded to 256 bytes][dq_accum: rows x
// DqAccumLayout::kRowFloats floats, fast mode only], rows = B * Hq * Sq of
// the chunk below.
inline size_t Lse2Bytes(const AttentionShape& shape) {
  const size_t rows = static_cast<size_t>(shape.batch * shape.num_heads_q * shape.seqlen_q);
  return (rows * sizeof(float) + 255) / 256 * 256;
}

// The fast (atomic) backward accumulates dQ in float32, 4 bytes per element
// of q (and 16 floats of padding per row): about a quarter of q, k, v, dout,
// out and the gradients together. A problem
// whose accumulator would exceed kMaxDqAccumBytes runs as consecutive chunks,
// runs of whole batch elements or else runs of KV heads (with their query
// heads) of one batch element, that reuse one accumulator of at most that
// size. Peak memory then stays near the inputs + outputs + gradients at long
// sequences, and every chunk is still large enough to fill the GPU.
// tests/gpu/run.sh also builds the kernel check with a tiny limit so that its
// small cases run chunked too.
#ifdef JAX_FLASH_TC_MAX_DQ_ACCUM_BYTES
inline constexpr size_t kMaxDqAccumBytes = JAX_FLASH_TC_MAX_DQ_ACCUM_BYTES;
#else
inline constexpr size_t kMaxDqAccumBytes = size_t{64} << 20;
#endif

struct BwdChunk {
  int64_t batches;   // batch elements per chunk (all of them: no chunking)
  int64_t kv_heads;  // KV heads per chunk; < num_heads_kv only when batches == 1
};

template <int kHeadDim>
BwdChunk ChunkFor(const AttentionShape& shape) {
  if (shape.batch == 0 || shape.num_heads_kv == 0 || shape.seqlen_q == 0)
    return {shape.batch, shape.num_heads_kv};
  const size_t per_kv_head = sizeof(float) * DqAccumLayout<kHeadDim>::kRowFloats *
                             static_cast<size_t>(shape.seqlen_q) *
                             static_cast<size_t>(GroupSize(shape));
  const size_t per_batch = per_kv_head * static_cast<size_t>(shape.num_heads_kv);
  if (per_batch * static_cast<size_t>(shape.batch) <= kMaxDqAccumBytes)
    return {shape.batch, shape.num_heads_kv};
  if (per_batch <= kMaxDqAccumBytes)
    return {static_cast<int64_t>(kMaxDqAccumBytes / per_batch), shape.num_heads_kv};
  const int64_t heads = static_cast<int64_t>(kMaxDqAccumBytes / per_kv_head);
  return {1, heads > 0 ? heads : 1};
}

// The shape of chunk (b0, hk0) of `chunk`, clipped at the problem's edges.
inline AttentionShape ChunkShape(const AttentionShape& shape, const BwdChunk& chunk, int64_t b0,
                                 int64_t hk0) {
  AttentionShape s = shape;
  s.batch = std::min(chunk.batches, shape.batch - b0);
  s.num_heads_kv = std::min(chunk.kv_heads, shape.num_heads_kv - hk0);
  s.num_heads_q = s.num_heads_kv * GroupSize(shape);
  return s;
}

// The same problem restricted to batch elements [b0, b0 + sub.batch) and KV
// heads [hk0, hk0 + sub.num_heads_kv): every pointer moved to the chunk's
// first element, strides kept. lse and delta are (B, Hq, Sq) rows; a chunk
// is either whole batch elements or one batch element, so its rows are
// contiguous there too.
template <typename T>
BwdParams ChunkParams(const BwdParams& p, const AttentionShape& sub, int64_t b0, int64_t hk0) {
  BwdParams c = p;
  c.shape = sub;
  const int64_t hq0 = hk0 * GroupSize(p.shape);
  c.q = static_cast<const T*>(p.q) + Offset(p.q_strides, b0, 0, hq0);
  c.k = static_cast<const T*>(p.k) + Offset(p.k_strides, b0, 0, hk0);
  c.v = static_cast<const T*>(p.v) + Offset(p.v_strides, b0, 0, hk0);
  c.out = static_cast<T*>(p.out) + Offset(p.out_strides, b0, 0, hq0);
  c.dout = static_cast<const T*>(p.dout) + Offset(p.dout_strides, b0, 0, hq0);
  c.dq = static_cast<T*>(p.dq) + Offset(p.dq_strides, b0, 0, hq0);
  c.dk = static_cast<T*>(p.dk) + Offset(p.dk_strides, b0, 0, hk0);
  c.dv = static_cast<T*>(p.dv) + Offset(p.dv_strides, b0, 0, hk0);
  const int64_t row0 = (b0 * p.shape.num_heads_q + hq0) * p.shape.seqlen_q;
  c.lse = static_cast<float*>(p.lse) + row0;
  c.delta = static_cast<float*>(p.delta) + row0;
  MaskParams& m = c.mask;
  if (m.q_seqlens != nullptr) m.q_seqlens += b0;
  if (m.kv_seqlens != nullptr) m.kv_seqlens += b0;
  if (m.q_segment_ids != nullptr) m.q_segment_ids += b0 * p.shape.seqlen_q;
  if (m.kv_segment_ids != nullptr) m.kv_segment_ids += b0 * p.shape.seqlen_k;
  return c;
}

template <typename T, int kHeadDim>
size_t BwdWorkspaceBytes(const AttentionShape& shape, bool deterministic) {
  if (deterministic) return Lse2Bytes(shape);
  const AttentionShape chunk = ChunkShape(shape, ChunkFor<kHeadDim>(shape), 0, 0);
  const size_t rows = static_cast<size_t>(chunk.batch * chunk.num_heads_q * chunk.seqlen_q);
  return Lse2Bytes(chunk) + sizeof(float) * rows * DqAccumLayout<kHeadDim>::kRowFloats;
}

template <typename Kernel>
static cudaError_t SetSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// The Hopper dK/dV kernel (flash_bwd_sm90.cuh), fast mode only.
template <typename T, int kHeadDim>
cudaError_t LaunchBwdSm90DkDv(const BwdArgs& args, cudaStream_t stream);

// One chunk (or the whole problem): preprocess, dK/dV (+ dQ atomics), dQ.
// kSm90: dK/dV on the Hopper kernel (only with deterministic = false).
template <typename T, int kHeadDim, bool kSm90 = false>
cudaError_t RunBwdChunk(const BwdParams& params, void* workspace, bool deterministic,
                        cudaStream_t stream) {
  using Traits = BwdTraits<kHeadDim>;
  using DqTraits = BwdDqTraits<kHeadDim>;
  const AttentionShape& shape = params.shape;
  if (shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  if (shape.batch == 0 || shape.num_heads_q == 0 || (shape.seqlen_q == 0 && shape.seqlen_k == 0))
    return cudaSuccess;
  if (shape.num_heads_q > 65535 || shape.batch > 65535) return cudaErrorInvalidConfiguration;
  BwdArgs args;
  args.p = params;
  args.scale = static_cast<float>(params.score.scale);
  args.softcap = static_cast<float>(params.score.softcap);
  if (args.softcap > 0.f) {
    args.scale_log2 = kLog2e;
    args.scale_over_cap = args.scale / args.softcap;
  } else {
    args.softcap = 0.f;
    args.scale_log2 = args.scale * kLog2e;
    args.scale_over_cap = 0.f;
  }
  args.inv_softcap = args.softcap > 0.f ? 1.f / args.softcap : 0.f;
  args.lse2 = static_cast<float*>(workspace);
  args.dq_accum = reinterpret_cast<float*>(static_cast<char*>(workspace) + Lse2Bytes(shape));
  cudaError_t err;

  const int64_t rows = shape.batch * shape.num_heads_q * shape.seqlen_q;
  if (rows > 0) {
    BwdPreprocessKernel<T><<<static_cast<unsigned>(CeilDiv(rows, 8)), 256, 0, stream>>>(args);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (!deterministic && rows > 0) {
    err = cudaMemsetAsync(args.dq_accum, 0,
                          sizeof(float) * rows * DqAccumLayout<kHeadDim>::kRowFloats, stream);
    if (err != cudaSuccess) return err;
  }

  // The Hopper kernel declines (cudaErrorNotSupported) where TMA cannot
  // address Q or dO; the sm_80 kernel, with the same dQ accumulator, runs then.
  bool dkdv_launched = false;
  if constexpr (kSm90) {
    err = LaunchBwdSm90DkDv<T, kHeadDim>(args, stream);
    if (err == cudaSuccess) dkdv_launched = true;
    else if (err != cudaErrorNotSupported) return err;
  }
  if (!dkdv_launched) {
    const int64_t n_blocks = CeilDiv(shape.seqlen_k, Traits::kBlockN);
    if (n_blocks > 0) {
      const dim3 grid(static_cast<unsigned>(n_blocks), static_cast<unsigned>(shape.num_heads_kv),
                      static_cast<unsigned>(shape.batch));
      if (deterministic) {
        auto kernel = FlashBwdDkDvKernel<T, Traits, false>;
        if ((err = SetSmem(kernel, Traits::kSmemBytes)) != cudaSuccess) return err;
        kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
      } else {
        auto kernel = FlashBwdDkDvKernel<T, Traits, true>;
        if ((err = SetSmem(kernel, Traits::kSmemBytes)) != cudaSuccess) return err;
        kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
      }
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }

  if (rows == 0) return cudaSuccess;
  if (deterministic) {
    const int64_t m_blocks = CeilDiv(shape.seqlen_q, DqTraits::kBlockM);
    auto kernel = FlashBwdDqKernel<T, DqTraits>;
    if ((err = SetSmem(kernel, DqTraits::kSmemBytes)) != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(shape.num_heads_q),
                    static_cast<unsigned>(shape.batch));
    kernel<<<grid, DqTraits::kThreads, DqTraits::kSmemBytes, stream>>>(args);
  } else {
    const int64_t groups = rows * (kHeadDim / 8);
    const int64_t blocks = CeilDiv(groups, 256) < 65536 * 8 ? CeilDiv(groups, 256) : 65536 * 8;
    DqConvertKernel<T, kHeadDim><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

template <typename T, int kHeadDim, bool kSm90>
cudaError_t RunBwd(const BwdParams& params, void* workspace, bool deterministic,
                   cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  if (shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  const BwdChunk chunk = ChunkFor<kHeadDim>(shape);
  if (deterministic || (chunk.batches >= shape.batch && chunk.kv_heads >= shape.num_heads_kv))
    return RunBwdChunk<T, kHeadDim, kSm90>(params, workspace, deterministic, stream);
  for (int64_t b0 = 0; b0 < shape.batch; b0 += chunk.batches) {
    for (int64_t hk0 = 0; hk0 < shape.num_heads_kv; hk0 += chunk.kv_heads) {
      const AttentionShape sub = ChunkShape(shape, chunk, b0, hk0);
      const cudaError_t err =
          RunBwdChunk<T, kHeadDim, kSm90>(ChunkParams<T>(params, sub, b0, hk0), workspace, false,
                                          stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_flash::cuda::tc

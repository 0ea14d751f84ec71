// FlashAttention forward-mode derivative (JVP) on tensor cores (mma.sync
// m16n8k16, sm_80+): the sm80 forward (sm80/fwd.cuh) with two more GEMMs per
// key block and the forward's lse in place of the online softmax.
//
// One CTA per (query block, q head, batch); each warp owns 16 query rows, so
// a row's sums never leave its warp. Per key block, in registers:
//   S   = Q K^T,   dS' = Q_dot K^T + Q K_dot^T
//   soft cap: x = cap tanh(S scale / cap), dS' *= 1 - (x / cap)^2
//   P   = exp2(x scale_log2 - lse2),  dS = scale dS'   (both 0 where hidden)
//   lse_dot += rowsum(P o dS);   acc += (P o (dS - c)) V + P V_dot
// then out_dot = acc - (lse_dot - c) o out (out as the forward stored it),
// with a per-row shift c, the P-weighted mean of dS over the row's first
// block with a visible key (any c gives the same result in exact
// arithmetic, since rowsum(P) o out = sum P V): P o dS rounded to 16 bits
// for the GEMM and the rounded out would otherwise cancel, and where a row
// sees few keys lse_dot ~ dS and that cancellation left errors several
// times a plain 16-bit implementation's. P and
// P o (dS - c) become A operands of the last two GEMMs without leaving registers
// (common/fragment.cuh). K, K_dot, V, V_dot stream through a cp.async
// pipeline of JvpTile::stages stages. Absent (zero) tangents skip their loads
// and GEMMs (uniform branches). Options: those of the sm80 forward (causal,
// window, lengths, segments, soft cap, GQA; a bias takes the exact kernel,
// cuda/dispatch.cu). kTerms, as in the forward, adds the per-element terms
// in an instantiation of its own, so the plain kernel's code stays as it is:
//   - dense mask: MaskFragmentElementwise on P and P o dS (0 where hidden);
//   - the tile map: the key blocks it leaves empty skipped (a block mask's
//     hidden cells), the full ones masked by the band alone;
//   - dropout, with the forward's keep mask Z: out = (Z o P) V / (1 - rate),
//     so d out = (Z o dP) V / (1 - rate) + (Z o P) V_dot / (1 - rate) with
//     dP = P o (dS - lse_dot): lse_dot = rowsum(P o dS) takes P itself,
//     the two GEMMs take Z o P and Z o (P o dS), and 1 / (1 - rate) goes
//     onto acc before the epilogue, whose lse_dot o out already holds it
//     (as cpu/flash_jvp.cc).
// kArch 75: the Turing family's tiles (kTuringJvpTiles), compiled for
// compute_75 like the forward (copy.cuh and mma.cuh take their sm_75 forms).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/copy.cuh"
#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/math.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/tile_map.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "cuda/kernels.h"
#include "cuda/sm80/copy.cuh"
#include "cuda/sm80/mma.cuh"
#include "cuda/sm80/tile_size.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm80 {

template <int kHeadDim_, int kArch = 80>
struct JvpTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr JvpTile kTile = JvpTileFor(kHeadDim, kArch);  // sm80/tile_size.h
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kNWarps = kBlockM / kMmaM;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kNTiles = kBlockN / kMmaN;   // n-tiles of S
  static constexpr int kDTiles = kHeadDim / kMmaN;  // n-tiles of out_dot
  static constexpr int kStride = kHeadDim + kSmemPad;
  // sQ, sQd [kBlockM][kStride]; per stage sK, sKd, sV, sVd [kBlockN][kStride].
  static constexpr int kTileElems = kBlockN * kStride;
  static constexpr int kStageElems = 4 * kTileElems;
  static constexpr size_t kSmemBytes =
      sizeof(uint16_t) * (2 * kBlockM * kStride + kStages * kStageElems);
  // Turing (no cp.async): with two stages, the next block's K, K_dot, V and
  // V_dot come through registers (StagedTile, sm80/copy.cuh) where that takes
  // 32 per thread or fewer, as in the forward.
  static constexpr bool kRegStaged =
      kArch < 80 && kStages == 2 && 4 * kBlockN * kHeadDim * 2 / 4 / kThreads <= 32;
  static_assert(kBlockM > 0, "no sm80 JVP tile for this head-dim bucket (sm80/tile_size.h)");
  static_assert(kStages == 1 || kStages == 2, "one or two pipeline stages");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0);
  static_assert(kSmemBytes <= MaxSmemBytes(kArch), "tile exceeds the arch's shared memory");
};

// Per-launch constants, computed once on the host.
struct JvpArgs {
  JvpParams p;
  float scale;
  float scale_log2;      // log2(e) * scale, or log2(e) with a soft cap (scale goes into tanh)
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap
  float inv_softcap;
};

inline JvpArgs MakeJvpArgs(const JvpParams& params) {
  JvpArgs args;
  args.p = params;
  args.scale = static_cast<float>(params.score.scale);
  args.softcap = params.score.softcap > 0 ? static_cast<float>(params.score.softcap) : 0.f;
  args.scale_log2 = args.softcap > 0.f ? kLog2e : args.scale * kLog2e;
  args.scale_over_cap = args.softcap > 0.f ? args.scale / args.softcap : 0.f;
  args.inv_softcap = args.softcap > 0.f ? 1.f / args.softcap : 0.f;
  return args;
}

// Rows of one (batch, head) of a tangent, or rows of nothing (base null) when
// the tangent is absent: then no offset is ever added to a null pointer.
template <typename T>
__device__ __forceinline__ GmemRows<T> TangentRows(const void* tangent, const SeqStrides& strides,
                                                   int64_t b, int64_t h, int64_t rows, int cols) {
  if (tangent == nullptr) return GmemRows<T>{nullptr, 0, 0, 0};
  return GmemRows<T>::Head(tangent, strides, b, h, rows, cols);
}

template <typename T, typename Traits, bool kTerms>
__global__ void __launch_bounds__(Traits::kThreads)
    JvpKernel(const __grid_constant__ JvpArgs args) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim, kStride = Traits::kStride;
  constexpr int kNTiles = Traits::kNTiles, kDTiles = Traits::kDTiles;
  constexpr int kThreads = Traits::kThreads, kTileElems = Traits::kTileElems;
  const JvpParams& p = args.p;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sQd = sQ + kBlockM * kStride;
  T* sKV = sQd + kBlockM * kStride;  // [kStages][K, K_dot, V, V_dot][kBlockN][kStride]

  const ThreadPos pos = ThreadPos::Here();
  const int tid = pos.tid, lane = pos.lane, g = pos.g, t = pos.t;
  const QueryBlockScheduler::Tile tile = QueryBlockScheduler::Get();  // longest (causal) first
  const int64_t h = tile.h, b = tile.b;
  const int64_t h_kv = h / p.shape.group_size();
  const int64_t m0 = tile.m_block * kBlockM;
  const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  // With kTerms: this head's view of the dense mask, and its dropout stream.
  const BatchMask mask = kTerms ? BatchMask::For(p.mask, b, h, seqlen_q, seqlen_k)
                                : BatchMask::For(p.mask, b, seqlen_q, seqlen_k);
  const HeadDropout dropout =
      kTerms ? HeadDropout::For(p.dropout, p.shape.batch, b, h) : HeadDropout{};

  const GmemRows<T> q = GmemRows<T>::Head(p.q, p.q_strides, b, h, seqlen_q, head_dim);
  const GmemRows<T> k = GmemRows<T>::Head(p.k, p.k_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v = GmemRows<T>::Head(p.v, p.v_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> q_dot = TangentRows<T>(p.q_dot, p.q_dot_strides, b, h, seqlen_q, head_dim);
  const GmemRows<T> k_dot = TangentRows<T>(p.k_dot, p.k_dot_strides, b, h_kv, seqlen_k, head_dim);
  const GmemRows<T> v_dot = TangentRows<T>(p.v_dot, p.v_dot_strides, b, h_kv, seqlen_k, head_dim);
  const bool has_qd = p.q_dot != nullptr, has_kd = p.k_dot != nullptr;
  const bool has_vd = p.v_dot != nullptr, has_ds = has_qd || has_kd;

  int64_t key_begin, key_end;
  mask.KeyRange(m0, m0 + kBlockM, &key_begin, &key_end);
  const int64_t n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : key_begin / kBlockN;
  // kTerms: the key blocks the tile map leaves empty are skipped.
  const CellLine cells = kTerms ? CellLine::AlongKeys<kBlockM, kBlockN>(mask, m0) : CellLine{};
  const int64_t n_begin = cells.Next<kBlockN>(key_begin / kBlockN, n_end);

  // lse of the two rows this lane owns, in log2 units; -inf (the row sees
  // nothing) becomes +inf so that P = exp2(x - lse2) = 0.
  const int warp_row0 = pos.warp * kMmaM;
  const int64_t row_base = (b * p.shape.num_heads_q + h) * seqlen_q;
  float lse2[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    const float lse = i < seqlen_q ? static_cast<const float*>(p.lse)[row_base + i] : -INFINITY;
    lse2[hr] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }

  float acc[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[dt][r] = 0.f;
  // Per-lane partial sums of P o dS and of P, reduced over the quad at the
  // end; the shift c of each row, set at its first block with a visible key.
  float lse_dot[2] = {0.f, 0.f}, p_sum[2] = {0.f, 0.f};
  float shift[2] = {0.f, 0.f};
  bool shift_set[2] = {false, false};

  // Key block n's K, K_dot, V, V_dot into a stage (absent tangents: nothing).
  auto load_keys = [&](int stage, int64_t n) {
    T* dst = sKV + stage * Traits::kStageElems;
    const int64_t row0 = n * kBlockN;
    LoadTile<T, kBlockN, kHeadDim, kStride, kThreads>(dst, k, row0, tid);
    if (has_kd) LoadTile<T, kBlockN, kHeadDim, kStride, kThreads>(dst + kTileElems, k_dot, row0, tid);
    LoadTile<T, kBlockN, kHeadDim, kStride, kThreads>(dst + 2 * kTileElems, v, row0, tid);
    if (has_vd)
      LoadTile<T, kBlockN, kHeadDim, kStride, kThreads>(dst + 3 * kTileElems, v_dot, row0, tid);
  };
  // Traits::kRegStaged: the next block's tiles on their way, in registers.
  StagedTile<T, kBlockN, kHeadDim, kThreads> k_next, kd_next, v_next, vd_next;
  auto stage_keys_in_registers = [&](int64_t n) {
    const int64_t row0 = n * kBlockN;
    k_next.Load(k, row0, tid);
    if (has_kd) kd_next.Load(k_dot, row0, tid);
    v_next.Load(v, row0, tid);
    if (has_vd) vd_next.Load(v_dot, row0, tid);
  };
  auto store_staged_keys = [&](int stage) {
    T* dst = sKV + stage * Traits::kStageElems;
    k_next.template Store<kStride>(dst, tid);
    if (has_kd) kd_next.template Store<kStride>(dst + kTileElems, tid);
    v_next.template Store<kStride>(dst + 2 * kTileElems, tid);
    if (has_vd) vd_next.template Store<kStride>(dst + 3 * kTileElems, tid);
  };
  if (n_begin < n_end) {
    LoadTile<T, kBlockM, kHeadDim, kStride, kThreads>(sQ, q, m0, tid);
    if (has_qd) LoadTile<T, kBlockM, kHeadDim, kStride, kThreads>(sQd, q_dot, m0, tid);
    load_keys(0, n_begin);
    CpAsyncCommit();
  }

  // ldmatrix row addresses of this lane (common/fragment.cuh): Q and Q_dot as
  // A operands, K and K_dot as B (non-transposed), V and V_dot as B
  // (transposed: keys are the k dimension).
  const uint32_t a_lane = 2 * ((warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const uint32_t q_frag = SmemAddr(sQ) + a_lane, qd_frag = SmemAddr(sQd) + a_lane;
  const uint32_t b_lane = 2 * (((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  const uint32_t bt_lane = 2 * ((((lane / 8) % 2) * 8 + lane % 8) * kStride + (lane / 16) * 8);
  const uint32_t kv_addr = SmemAddr(sKV);
  constexpr uint32_t kTileBytes = 2 * kTileElems;

  int stage = 0;  // with two stages; one stage: always 0
  for (int64_t n = n_begin, next; n < n_end; n = next, stage ^= Traits::kStages - 1) {
    next = cells.Next<kBlockN>(n + 1, n_end);
    const CellClass cls = cells.At<kBlockN>(n);
    // Into this block's stage (free, as in sm80/fwd.cuh).
    if constexpr (Traits::kRegStaged) {
      if (n != n_begin) store_staged_keys(stage);
    }
    // One barrier per block with two stages (as in sm80/fwd.cuh): it
    // publishes this stage and frees the other one for the prefetch.
    CpAsyncWait<0>();
    __syncthreads();
    if (Traits::kStages == 2 && next < n_end) {
      if constexpr (Traits::kRegStaged) stage_keys_in_registers(next);
      else load_keys(stage ^ 1, next);
      CpAsyncCommit();
    }
    const uint32_t k_frag = kv_addr + stage * (Traits::kStageElems * 2) + b_lane;
    const uint32_t kd_frag = k_frag + kTileBytes;
    const uint32_t v_frag = kv_addr + stage * (Traits::kStageElems * 2) + 2 * kTileBytes + bt_lane;
    const uint32_t vd_frag = v_frag + kTileBytes;

    // ---- S = Q K^T, dS' = Q_dot K^T + Q K_dot^T ------------------------------
    float s[kNTiles][4], ds[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) { s[nt][r] = 0.f; ds[nt][r] = 0.f; }
    // Partly rolled above D = 128: fully unrolled, the loads of the next
    // steps kept registers live next to the 128 of acc and spilled.
#pragma unroll(kHeadDim > 128 ? 4 : kHeadDim / kMmaK)
    for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
      uint32_t aq[4], aqd[4];
      Ldmatrix4(aq, q_frag + 2 * kk * 16);
      if (has_qd) Ldmatrix4(aqd, qd_frag + 2 * kk * 16);
#pragma unroll
      for (int nt2 = 0; nt2 < kBlockN / 16; ++nt2) {
        const uint32_t off = 2 * (nt2 * 16 * kStride + kk * 16);
        uint32_t bk[4];
        Ldmatrix4(bk, k_frag + off);
        Mma<T>(s[2 * nt2], aq, bk[0], bk[1]);
        Mma<T>(s[2 * nt2 + 1], aq, bk[2], bk[3]);
        if (has_qd) {
          Mma<T>(ds[2 * nt2], aqd, bk[0], bk[1]);
          Mma<T>(ds[2 * nt2 + 1], aqd, bk[2], bk[3]);
        }
        if (has_kd) {
          uint32_t bkd[4];
          Ldmatrix4(bkd, kd_frag + off);
          Mma<T>(ds[2 * nt2], aq, bkd[0], bkd[1]);
          Mma<T>(ds[2 * nt2 + 1], aq, bkd[2], bkd[3]);
        }
      }
    }

    // ---- soft cap, P, dS, mask ------------------------------------------------
    // dS = scale dS' (times d cap tanh(x / cap) = 1 - (x / cap)^2 with a cap).
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float x = s[nt][r], dx = args.scale;
        if (args.softcap > 0.f) {
          x = args.softcap * FastTanh(x * args.scale_over_cap);
          const float th = x * args.inv_softcap;
          dx *= 1.f - th * th;
        }
        s[nt][r] = FastExp2(fmaf(x, args.scale_log2, -lse2[r / 2]));  // P
        ds[nt][r] *= dx;
      }
    const int64_t n0 = n * kBlockN;
    // Hidden keys give exactly 0, by a select: their logits may be NaN (a
    // NaN in a key this row cannot see) or P may have overflowed.
    MaskTile<Rows::kQueries>(s, mask, cls, m0, m0 + kBlockM, n0, n0 + kBlockN, m0 + warp_row0,
                             n0, g, t, 0.f);
    MaskTile<Rows::kQueries>(ds, mask, cls, m0, m0 + kBlockM, n0, n0 + kBlockN, m0 + warp_row0,
                             n0, g, t, 0.f);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        ds[nt][r] *= s[nt][r];  // P o dS
        lse_dot[r / 2] += ds[nt][r];
        p_sum[r / 2] += s[nt][r];
      }
    // Until every row of the warp has its shift: the quad's sums so far are
    // this block's (P was 0 on the row's earlier blocks), c = their ratio.
    if (__any_sync(0xffffffffu, !(shift_set[0] && shift_set[1]))) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float pds = lse_dot[hr], ps = p_sum[hr];
        pds += __shfl_xor_sync(0xffffffffu, pds, 1);
        pds += __shfl_xor_sync(0xffffffffu, pds, 2);
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        if (!shift_set[hr] && ps > 0.f) {
          shift[hr] = pds / ps;
          shift_set[hr] = true;
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) ds[nt][r] = fmaf(-shift[r / 2], s[nt][r], ds[nt][r]);
    if constexpr (kTerms) {
      // lse_dot took P itself; the GEMMs take Z o P and Z o (P o (dS - c)).
      if (dropout.enabled) DropoutRowsPair(s, ds, dropout, m0 + warp_row0, n0, g, t);
    }

    // ---- acc += (P o dS) V + P V_dot (A operands from registers) -------------
#pragma unroll
    for (int ks = 0; ks < kBlockN / kMmaK; ++ks) {
      uint32_t a_pds[4], a_p[4];
      PackA<T>(a_pds, ds[2 * ks], ds[2 * ks + 1]);
      PackA<T>(a_p, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
      for (int dt2 = 0; dt2 < kHeadDim / 16; ++dt2) {
        const uint32_t off = 2 * (ks * 16 * kStride + dt2 * 16);
        if (has_ds) {
          uint32_t bv[4];
          Ldmatrix4Trans(bv, v_frag + off);
          Mma<T>(acc[2 * dt2], a_pds, bv[0], bv[1]);
          Mma<T>(acc[2 * dt2 + 1], a_pds, bv[2], bv[3]);
        }
        if (has_vd) {
          uint32_t bvd[4];
          Ldmatrix4Trans(bvd, vd_frag + off);
          Mma<T>(acc[2 * dt2], a_p, bvd[0], bvd[1]);
          Mma<T>(acc[2 * dt2 + 1], a_p, bvd[2], bvd[3]);
        }
      }
    }
    if (Traits::kStages == 1 && next < n_end) {
      __syncthreads();  // every warp is done with the one stage
      load_keys(0, next);
      CpAsyncCommit();
    }
  }

  // ---- epilogue: lse_dot, out_dot = acc - lse_dot o out -----------------------
  if constexpr (kTerms) {
    if (dropout.enabled) {
      const float keep_scale = static_cast<float>(p.dropout.keep_scale());
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[dt][r] *= keep_scale;
    }
  }
  const T* out = static_cast<const T*>(p.out) + p.out_strides.offset(b, 0, h);
  T* out_dot = static_cast<T*>(p.out_dot) + p.out_dot_strides.offset(b, 0, h);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float row_dot = lse_dot[hr], row_p = p_sum[hr];  // the 4 lanes of a quad hold one row
    row_dot += __shfl_xor_sync(0xffffffffu, row_dot, 1);
    row_dot += __shfl_xor_sync(0xffffffffu, row_dot, 2);
    row_p += __shfl_xor_sync(0xffffffffu, row_p, 1);
    row_p += __shfl_xor_sync(0xffffffffu, row_p, 2);
    const int64_t i = m0 + warp_row0 + g + hr * 8;
    if (i >= seqlen_q) continue;
    if (t == 0) static_cast<float*>(p.lse_dot)[row_base + i] = row_dot;
    const float shifted_dot = fmaf(-shift[hr], row_p, row_dot);  // lse_dot - c rowsum(P)
    const T* out_row = out + i * p.out_strides.row;
    T* out_dot_row = out_dot + i * p.out_dot_strides.row;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col < head_dim) {
        const float o0 = ToFloat(out_row[col]), o1 = ToFloat(out_row[col + 1]);
        *reinterpret_cast<uint32_t*>(out_dot_row + col) =
            Pack2<T>(acc[dt][2 * hr] - shifted_dot * o0, acc[dt][2 * hr + 1] - shifted_dot * o1);
      }
    }
  }
}

template <typename T, int kHeadDim, bool kTerms, int kArch = 80>
cudaError_t LaunchJvp(const JvpParams& params, cudaStream_t stream) {
  using Traits = JvpTraits<kHeadDim, kArch>;
  const AttentionShape& shape = params.shape;
  if (shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  if (HasScoreTerms(params) != kTerms) return cudaErrorInvalidValue;
  const int64_t m_blocks = CeilDiv(shape.seqlen_q, Traits::kBlockM);
  if (m_blocks == 0 || shape.num_heads_q == 0 || shape.batch == 0) return cudaSuccess;
  if (shape.num_heads_q > 65535 || shape.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  auto kernel = JvpKernel<T, Traits, kTerms>;
  // Not a stream operation: allowed while XLA captures a command buffer.
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Traits::kSmemBytes));
  if (err != cudaSuccess) return err;
  kernel<<<QueryBlockScheduler::Grid(m_blocks, shape), Traits::kThreads, Traits::kSmemBytes,
           stream>>>(MakeJvpArgs(params));
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::sm80

namespace jax_flash::cuda {

template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunJvp(const JvpParams& params, cudaStream_t stream) {
  static_assert(kArch == 75 || kArch == 80,
                "the JVP's tensor-core arch paths: 75 (mma.sync, Turing), 80 (mma.sync)");
  return sm80::LaunchJvp<T, kHeadDim, kTerms, kArch>(params, stream);
}

}  // namespace jax_flash::cuda

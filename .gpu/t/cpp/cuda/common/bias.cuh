// The bias on the tensor-core kernels (a score policy of common/score.cuh):
// a (batch, head)'s view of it in float32 or the inputs' 16-bit type,
// x = scale * s + bias on a warp's fragments (AddBias), and the dK/dV
// kernels' sums of dS into dbias (AccumulateDbiasT, AddDbiasT).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// One (batch, head)'s view of the bias, in float32 (the 16-bit inputs'
// accumulation type) or in the inputs' own type T (ScoreParams::bias_type),
// strides in elements (0 where broadcast). Read straight from global memory
// into the fragment layout: a warp's load of one fragment row covers 8
// consecutive keys (one 32-byte sector of float32) in either orientation, so
// staging through shared memory would buy no coalescing, only latency hiding
// (cpp/cuda/NOTES_score_terms.md).
template <typename T>
struct BiasView {
  const float* f32;  // the bias in float32, or null
  const T* narrow;   // the bias in T, or null (at most one of them is set)
  int64_t row, col;  // query and key strides
  int64_t seqlen_q, seqlen_k;
  bool pairs;  // keys j, j + 1 (j even) adjacent and aligned for one 2-element load

  __device__ __forceinline__ static BiasView For(const FwdParams& p, int64_t b, int64_t h) {
    const DenseStrides& bs = p.score.bias_strides;
    BiasView v{};
    const int64_t offset = b * bs.batch + h * bs.head;
    const bool is_narrow = p.score.bias_type != BiasType::kAcc;
    if (p.score.bias != nullptr && is_narrow) v.narrow = static_cast<const T*>(p.score.bias) + offset;
    if (p.score.bias != nullptr && !is_narrow) v.f32 = static_cast<const float*>(p.score.bias) + offset;
    v.row = bs.row;
    v.col = bs.col;
    v.seqlen_q = p.shape.seqlen_q;
    v.seqlen_k = p.shape.seqlen_k;
    const uintptr_t base = is_narrow ? reinterpret_cast<uintptr_t>(v.narrow)
                                     : reinterpret_cast<uintptr_t>(v.f32);
    v.pairs = bs.col == 1 && bs.row % 2 == 0 && base % (is_narrow ? 4 : 8) == 0;
    return v;
  }
  __device__ __forceinline__ bool present() const { return f32 != nullptr || narrow != nullptr; }
};

namespace bias_detail {

__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ float Widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float Widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float2 Widen(float2 x) { return x; }
__device__ __forceinline__ float2 Widen(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 Widen(__half2 x) { return __half22float2(x); }

template <typename E> struct PairOf;
template <> struct PairOf<float> { using type = float2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct PairOf<__half> { using type = __half2; };

// x = scale * s + bias from a bias of element type E (float, or the inputs'
// 16-bit T) at `ptr` (the view's strides), loads global and read-only by
// name (__ldg). Where a fragment lies inside the sequences and its key
// pairs are adjacent (a query-row fragment: most tiles), one pair load each
// and no bounds check. Elsewhere one element at a time, in two passes: all
// loads (checked) into raw registers, then the conversions and sums. A check
// and a conversion per element together made each 16-bit load's conversion
// wait for it inside its branch, one load at a time, and the backward ran
// 1.4x slower than with a float32 bias (cuda/NOTES_score_terms.md).
template <Rows kRows, int kMT, int kNTiles, typename E, typename View>
__device__ __forceinline__ void AddBiasOf(float (&s)[kMT][kNTiles][4], const E* ptr,
                                          const View& v, float scale, int64_t row0,
                                          int64_t col0, int g, int t) {
  using Pair = typename PairOf<E>::type;
  if (kRows == Rows::kQueries && v.pairs && row0 + kMT * 16 <= v.seqlen_q &&
      col0 + kNTiles * 8 <= v.seqlen_k) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const E* row = ptr + (row0 + mt * 16 + g + hr * 8) * v.row + col0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float2 b = Widen(__ldg(reinterpret_cast<const Pair*>(row + nt * 8)));
          s[mt][nt][2 * hr] = fmaf(s[mt][nt][2 * hr], scale, b.x);
          s[mt][nt][2 * hr + 1] = fmaf(s[mt][nt][2 * hr + 1], scale, b.y);
        }
      }
    return;
  }
  // bias[i, j] inside the sequences, 0 outside (those elements are masked).
  auto at = [&](int64_t i, int64_t j) {
    return i < v.seqlen_q && j < v.seqlen_k ? __ldg(ptr + i * v.row + j * v.col) : E{};
  };
  E raw[kMT][kNTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t r = row0 + mt * 16 + g + hr * 8;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int64_t c0 = col0 + nt * 8 + 2 * t;
        const bool queries = kRows == Rows::kQueries;
        raw[mt][nt][2 * hr] = queries ? at(r, c0) : at(c0, r);
        raw[mt][nt][2 * hr + 1] = queries ? at(r, c0 + 1) : at(c0 + 1, r);
      }
    }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = fmaf(s[mt][nt][e], scale, Widen(raw[mt][nt][e]));
}

}  // namespace bias_detail

// x = scale * s + bias on a warp's fragments (layout as MaskFragment's),
// before the soft cap and the mask; the element type chosen once per call.
template <Rows kRows, int kMT, int kNTiles, typename T>
__device__ __forceinline__ void AddBias(float (&s)[kMT][kNTiles][4], const BiasView<T>& bias,
                                        float scale, int64_t row0, int64_t col0, int g, int t) {
  if (bias.narrow != nullptr)
    bias_detail::AddBiasOf<kRows>(s, bias.narrow, bias, scale, row0, col0, g, t);
  else
    bias_detail::AddBiasOf<kRows>(s, bias.f32, bias, scale, row0, col0, g, t);
}

template <Rows kRows, int kNTiles, typename T>
__device__ __forceinline__ void AddBias(float (&s)[kNTiles][4], const BiasView<T>& bias, float scale,
                                        int64_t row0, int64_t col0, int g, int t) {
  AddBias<kRows>(reinterpret_cast<float(&)[1][kNTiles][4]>(s), bias, scale, row0, col0, g, t);
}

// dbias += dS on a warp's dS^T fragment (the dK/dV kernel: rows keys key0 +
// g (+ 8), columns queries q0 + nt * 8 + 2t + c), summed over the bias's
// broadcast dimensions: over this fragment's queries (a broadcast query
// dimension) and keys (a broadcast key dimension) by shuffles first, then one
// add per dbias element. `head` points at dbias[bb, hh] (the bias's own,
// contiguous shape, dims (Tb, Sb) left). kAtomic: float atomics (the fast
// mode: other CTAs add to the same elements); otherwise a plain read-modify-
// write, valid when DbiasHasOneWriter (each element then has one owning
// lane, which adds in step order: bitwise reproducible).
// dbias's (Tb, Sb) plane for (batch b, query head h) of the whole problem
// (a chunk's indices plus its batch0, head0), 1-sized dims broadcast.
__device__ __forceinline__ float* DbiasPlane(const BwdParams& p, int64_t b, int64_t h) {
  const int64_t* dims = p.score.bias_dims;
  const int64_t bb = dims[0] == 1 ? 0 : b, hh = dims[1] == 1 ? 0 : h;
  return static_cast<float*>(p.dbias) + (bb * dims[1] + hh) * dims[2] * dims[3];
}

template <bool kAtomic, int kQTiles>
__device__ __forceinline__ void AccumulateDbiasT(const float (&ds)[kQTiles][4], float* head,
                                                 int64_t tb, int64_t sb, int64_t key0,
                                                 int64_t q0, int64_t seqlen_q, int64_t seqlen_k,
                                                 int g, int t) {
  auto add = [&](float* p, float v) {
    if constexpr (kAtomic) atomicAdd(p, v);
    else *p += v;
  };
  // A warp past the last key adds nothing (and must not: its plain adds of
  // 0 would race with the owning warp's where the key dimension broadcasts).
  if (key0 >= seqlen_k) return;
  const bool key_ok[2] = {key0 + g < seqlen_k, key0 + g + 8 < seqlen_k};
  if (tb == 1) {  // broadcast over queries: sum this lane's columns, then the quad's
    float v[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool q_ok = q0 + nt * 8 + 2 * t + c < seqlen_q;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          if (q_ok && key_ok[hr]) v[hr] += ds[nt][2 * hr + c];
      }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      v[hr] += __shfl_xor_sync(0xffffffffu, v[hr], 1);
      v[hr] += __shfl_xor_sync(0xffffffffu, v[hr], 2);
    }
    if (sb == 1) {  // and over keys: the warp's 16 rows
      float w = v[0] + v[1];
      w += __shfl_xor_sync(0xffffffffu, w, 4);
      w += __shfl_xor_sync(0xffffffffu, w, 8);
      w += __shfl_xor_sync(0xffffffffu, w, 16);
      if (g == 0 && t == 0) add(head, w);
    } else if (t == 0) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        if (key_ok[hr]) add(head + key0 + g + hr * 8, v[hr]);
    }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t i = q0 + nt * 8 + 2 * t + c;
      if (sb == 1) {  // broadcast over keys: sum the warp's 16 rows
        float w = (key_ok[0] ? ds[nt][c] : 0.f) + (key_ok[1] ? ds[nt][2 + c] : 0.f);
        w += __shfl_xor_sync(0xffffffffu, w, 4);
        w += __shfl_xor_sync(0xffffffffu, w, 8);
        w += __shfl_xor_sync(0xffffffffu, w, 16);
        if (g == 0 && i < seqlen_q) add(head + i, w);
      } else if (i < seqlen_q) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          if (key_ok[hr]) add(head + i * sb + key0 + g + hr * 8, ds[nt][2 * hr + c]);
      }
    }
}

// dbias += dS^T = P^T o (dP^T - D) on a warp's fragments of the wgmma
// backward (rows keys key0 + g (+ 8), columns queries q0 + ...), where dbias
// is wanted; float atomics. (b, h): the whole problem's batch and head.
template <int kQTiles>
__device__ __forceinline__ void AddDbiasT(const float (&dpt)[kQTiles][4],
                                          const float (&pt)[kQTiles][4], const BwdParams& p,
                                          int64_t b, int64_t h, int64_t key0, int64_t q0, int g,
                                          int t) {
  if (p.dbias == nullptr) return;
  float ds[kQTiles][4];
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) ds[nt][r] = dpt[nt][r] * pt[nt][r];
  const int64_t* dims = p.score.bias_dims;
  AccumulateDbiasT<true>(ds, DbiasPlane(p, b, h), dims[2], dims[3], key0, q0, p.shape.seqlen_q,
                         p.shape.seqlen_k, g, t);
}

}  // namespace jax_flash::cuda

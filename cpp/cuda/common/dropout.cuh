// Dropout on tensor-core fragments: one Philox call per 8 elements.
//
// dropout.h lays the 8 draws of a Philox call over the 8 elements one thread
// holds of a 16 x 16 block of an mma.sync / wgmma accumulator (rows g, g + 8;
// columns 2t, 2t + 1, 8 + 2t, 9 + 2t). Here are the two orientations the
// kernels hold scores in:
//   - queries x keys (forwards, the deterministic dQ kernel): the thread's
//     8 elements are exactly one call's;
//   - keys x queries (the dK/dV kernels' S^T): the thread's 8 elements are
//     half of two calls (its key parity); the thread computes one of them
//     and swaps halves with the thread of the other key parity (lane ^ 4).
// Either way a thread makes one Philox call per 8 elements. The mask is the
// same function of (b, h, i, j) as on the CPU (HeadDropout::Keep).
//
// Keep bits: bit (2 a + b) * 2 + c of a block's byte is element
// (row + 8 a, column + 8 b + c) in the thread's own orientation, i.e.
// s[mt][2 nb + b][2 a + c] (forward) or st[2 nb + b][2 a + c] (transposed).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dropout.h"

namespace jax_flash::cuda {

// 16-bit draw >= threshold, for both halves of a word: bits 0 (low) and 1.
__device__ __forceinline__ uint32_t KeepPair(uint32_t word, uint32_t threshold) {
  return ((word & 0xffffu) >= threshold ? 1u : 0u) | ((word >> 16) >= threshold ? 2u : 0u);
}

// Keep bits of one 16 x 16 block in the queries x keys orientation: rows
// i0 + g (+ 8), columns j0 + 2t (+ 1, + 8, + 9); i0 and j0 multiples of 16.
__device__ __forceinline__ uint32_t KeepBitsRows(const HeadDropout& d, int64_t i0, int64_t j0,
                                                 int g, int t) {
  uint32_t w[4];
  d.Call(i0 + g, j0 + 2 * t, w);
  // Word 2 a + b holds (row + 8 a, column + 8 b + c) in half c.
  return KeepPair(w[0], d.threshold) | (KeepPair(w[1], d.threshold) << 2) |
         (KeepPair(w[2], d.threshold) << 4) | (KeepPair(w[3], d.threshold) << 6);
}

// Keep bits of one 16 x 16 block in the keys x queries orientation: rows
// (keys) j0 + g (+ 8), columns (queries) i0 + 2t (+ 1, + 8, + 9). Bit
// (2 a + b) * 2 + c is key j0 + g + 8 a, query i0 + 2t + c + 8 b.
// All 32 lanes must call it together (a shuffle).
__device__ __forceinline__ uint32_t KeepBitsTransposed(const HeadDropout& d, int64_t j0,
                                                       int64_t i0, int g, int t) {
  // The call of query parity c = g % 2 (dropout.h: call lane ((i % 8) << 2) |
  // ((j % 8) >> 1)); its 8 draws are (query i0 + 2t + c + 8 qa, key
  // j0 + 2 (g / 2) + kp + 8 kb) at word 2 qa + kb, half kp (key parity).
  const int parity = g & 1;
  uint32_t w[4];
  d.Call(i0 + 2 * t + parity, j0 + g, w);
  // Halves of my key parity stay, the others go to the lane of the other
  // key parity, which computed the call of the other query parity.
  const uint32_t mine = parity ? 0x7632u : 0x5410u, theirs = parity ? 0x5410u : 0x7632u;
  const uint32_t keep0 = __byte_perm(w[0], w[1], mine), keep1 = __byte_perm(w[2], w[3], mine);
  const uint32_t send0 = __byte_perm(w[0], w[1], theirs), send1 = __byte_perm(w[2], w[3], theirs);
  const uint32_t got0 = __shfl_xor_sync(0xffffffffu, send0, 4);
  const uint32_t got1 = __shfl_xor_sync(0xffffffffu, send1, 4);
  // keepX / gotX: query half qa = X, halves kb = 0 (low), 1 (high); from my
  // call (query parity c = parity) and the other (c = 1 - parity).
  uint32_t bits = 0;
  const uint32_t threshold = d.threshold;
  const uint32_t own[2] = {keep0, keep1}, other[2] = {got0, got1};
#pragma unroll
  for (int qa = 0; qa < 2; ++qa) {
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      // Element (key + 8 kb, query + c + 8 qa) -> bit (2 kb + qa) * 2 + c.
      const uint32_t mine_draw = (own[qa] >> (16 * kb)) & 0xffffu;
      const uint32_t other_draw = (other[qa] >> (16 * kb)) & 0xffffu;
      const int base = (2 * kb + qa) * 2;
      bits |= (mine_draw >= threshold ? 1u : 0u) << (base + parity);
      bits |= (other_draw >= threshold ? 1u : 0u) << (base + 1 - parity);
    }
  }
  return bits;
}

// Queries x keys orientation, a warp's kMT m-tiles (rows row0 + 16 mt ..) x
// kNTiles n-tiles (keys n0 ..): x = kept ? x * scale : 0. The forwards pass
// scale 1 (their 1 / (1 - rate) goes into the epilogue, one multiply per
// output); the deterministic dQ kernel scales dP.
template <int kMT, int kNTiles>
__device__ __forceinline__ void DropoutRows(float (&x)[kMT][kNTiles][4], const HeadDropout& d,
                                            int64_t row0, int64_t n0, int g, int t, float scale) {
  static_assert(kNTiles % 2 == 0, "dropout works on 16-column blocks");
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nb = 0; nb < kNTiles / 2; ++nb) {
      const uint32_t bits = KeepBitsRows(d, row0 + 16 * mt, n0 + 16 * nb, g, t);
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& e = x[mt][2 * nb + b][2 * a + c];
            e = (bits >> ((2 * a + b) * 2 + c)) & 1u ? e * scale : 0.f;
          }
    }
}

// The keep bits of one warp's 16 rows x kNTiles n-tiles (queries x keys),
// byte nb for block nb (KeepBitsRows): the wgmma kernels draw them while
// their S GEMM runs, and apply them (Apply) after the softmax. One call at a
// time (not unrolled): with the accumulators of GEMMs in flight, unrolled
// calls overlapped and spilled (ptxas: 184-268 bytes at D = 128).
template <int kNTiles>
struct RowKeep {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "up to 8 blocks of 16 columns in 64 bits");
  static constexpr int kBlocks = kNTiles / 2;
  uint64_t bits;

  __device__ __forceinline__ static RowKeep Draw(const HeadDropout& d, int64_t row0, int64_t n0,
                                                 int g, int t) {
    RowKeep k{0};
#pragma unroll 1
    for (int nb = 0; nb < kBlocks; ++nb)
      k.bits |= static_cast<uint64_t>(KeepBitsRows(d, row0, n0 + 16 * nb, g, t)) << (8 * nb);
    return k;
  }

  // x = kept ? x * scale : 0.
  __device__ __forceinline__ void Apply(float (&x)[kNTiles][4], float scale) const {
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb)
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& e = x[2 * nb + b][2 * a + c];
            const bool kept = (bits >> (8 * nb + (2 * a + b) * 2 + c)) & 1u;
            e = kept ? e * scale : 0.f;
          }
  }
};

// x *= scale over a warp's fragments (the forward's O before its epilogue).
template <int kMT, int kTiles>
__device__ __forceinline__ void ScaleFragment(float (&x)[kMT][kTiles][4], float scale) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) x[mt][nt][r] *= scale;
}

// DropoutRows on the fragments of one m-tile (the deterministic dQ kernel).
template <int kNTiles>
__device__ __forceinline__ void DropoutRows(float (&x)[kNTiles][4], const HeadDropout& d,
                                            int64_t row0, int64_t n0, int g, int t, float scale) {
  DropoutRows(reinterpret_cast<float(&)[1][kNTiles][4]>(x), d, row0, n0, g, t, scale);
}

// The JVP's two fragments of one m-tile (sm80/jvp.cuh: P and P o dS, queries
// x keys) dropped with the same keep bits, from one Philox call per 8
// elements: x = kept ? x : 0, y likewise (1 / (1 - rate) goes into the
// epilogue, as in the forwards).
template <int kNTiles>
__device__ __forceinline__ void DropoutRowsPair(float (&x)[kNTiles][4], float (&y)[kNTiles][4],
                                                const HeadDropout& d, int64_t row0, int64_t n0,
                                                int g, int t) {
  static_assert(kNTiles % 2 == 0, "dropout works on 16-column blocks");
#pragma unroll
  for (int nb = 0; nb < kNTiles / 2; ++nb) {
    const uint32_t bits = KeepBitsRows(d, row0, n0 + 16 * nb, g, t);
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool kept = (bits >> ((2 * a + b) * 2 + c)) & 1u;
          float& ex = x[2 * nb + b][2 * a + c];
          float& ey = y[2 * nb + b][2 * a + c];
          ex = kept ? ex : 0.f;
          ey = kept ? ey : 0.f;
        }
  }
}

// Keys x queries orientation (S^T, dP^T of one warp: keys key0 + g (+ 8),
// queries m0 + 8 nt + 2t + c): the keep bits of the warp's kQTiles / 2
// blocks, one byte each, for ApplyKeepT.
// kSerial: one call at a time (the wgmma backwards, which draw while their
// GEMMs' accumulators are in flight; see RowKeep).
template <int kQTiles, bool kSerial = false>
__device__ __forceinline__ uint32_t KeepBitsT(const HeadDropout& d, int64_t key0, int64_t m0,
                                              int g, int t) {
  static_assert(kQTiles % 2 == 0 && kQTiles <= 8, "up to 4 blocks of 16 queries in 32 bits");
  uint32_t bits = 0;
#pragma unroll(kSerial ? 1 : kQTiles / 2)
  for (int nb = 0; nb < kQTiles / 2; ++nb)
    bits |= KeepBitsTransposed(d, key0, m0 + 16 * nb, g, t) << (8 * nb);
  return bits;
}

// Kept(bits) of one element of a keys x queries fragment (see ApplyKeepT).
__device__ __forceinline__ bool KeptT(uint32_t bits, int nt, int r) {
  return (bits >> (8 * (nt / 2) + (2 * (r / 2) + nt % 2) * 2 + r % 2)) & 1u;
}

// n-tile nt of a keys x queries fragment, dropped and scaled into y (the
// wgmma backwards' P^T for dV: dS^T still needs the undropped P^T).
__device__ __forceinline__ void DroppedTileT(const float (&x)[4], uint32_t bits, int nt,
                                             float scale, float (&y)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) y[r] = KeptT(bits, nt, r) ? x[r] * scale : 0.f;
}

// x[nt][r] = kept ? x * scale : 0 over keys x queries fragments; element
// st[2 nb + qb][2 kb + c] is bit (2 kb + qb) * 2 + c of byte nb. (Note the
// transposed roles: r / 2 = key half kb, nt % 2 = query half qb.)
template <int kQTiles>
__device__ __forceinline__ void ApplyKeepT(float (&x)[kQTiles][4], uint32_t bits, float scale) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      x[nt][r] = KeptT(bits, nt, r) ? x[nt][r] * scale : 0.f;
    }
}

}  // namespace jax_flash::cuda

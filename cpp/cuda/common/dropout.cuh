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
// Keep bits: a block's byte holds the thread's 8 elements, bit
// RowBit(a, b, c) for element (row + 8 a, column + 8 b + c) in the queries x
// keys orientation (s[mt][2 nb + b][2 a + c]), bit KeyQueryBit for the keys
// x queries one. The compare and the packing work on whole words (KeepFlags,
// PackFlagPairs): per 8 elements about 20 instructions besides Philox's 40.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/dropout.h"

namespace jax_flash::cuda {

// Bit of element (row + 8 a, column + 8 b + c) in a queries x keys byte.
__host__ __device__ constexpr int RowBit(int a, int b, int c) { return 2 * (2 * b + c) + a; }

// The threshold as KeepFlags compares with it.
struct HalfThreshold {
  uint32_t low;  // the threshold's low 15 bits, in both halves
  uint32_t top;  // 0x80008000 when the threshold's bit 15 is clear, else 0
  __device__ __forceinline__ explicit HalfThreshold(uint32_t threshold)
      : low((threshold & 0x7fffu) * 0x10001u), top(threshold & 0x8000u ? 0u : 0x80008000u) {}
};

// Both 16-bit draws of `word` >= threshold, as bits 15 (low half) and 31
// (high half); the other bits are garbage. With draw = 2^15 H + l and
// threshold = 2^15 T + u: kept when H > T, or H = T and l >= u. The
// difference (draw | 2^15) - u cannot borrow from the next half, and its bit
// 15 is l >= u; the answer is the majority of that bit, H and (T = 0).
__device__ __forceinline__ uint32_t KeepFlags(uint32_t word, HalfThreshold th) {
  const uint32_t low_ge = (word | 0x80008000u) - th.low;
  return (low_ge & word) | (low_ge & th.top) | (word & th.top);
}

// One byte from the flags in bit 7 of each byte of two words: bit 2 m + 1
// from byte m of `one`, bit 2 m from byte m of `zero`; the result's bits
// 8 and up are garbage. The multiply moves the 2-bit field at 8 m + 6 to
// 32 + 2 m; its 16 partial products land on distinct bit pairs, so nothing
// carries.
__device__ __forceinline__ uint32_t PackFlagPairs(uint32_t one, uint32_t zero) {
  const uint32_t both = ((one & 0x80808080u) | ((zero >> 1) & 0x7f7f7f7fu)) & 0xc0c0c0c0u;
  return __umulhi(both, (1u << 26) | (1u << 20) | (1u << 14) | (1u << 8));
}

// Keep bits (bits 0..7, garbage above) of the 16 x 16 block whose call has
// this counter, queries x keys: words 2 a + b, halves c (dropout.h).
__device__ __forceinline__ uint32_t KeepByteRows(const uint32_t counter[4],
                                                 const uint32_t key[2], HalfThreshold th) {
  uint32_t w[4];
  philox::Philox4x32(counter, key, w);
  // Bit 7 of byte 2 b + c: the flag of (a, b, c).
  const uint32_t a0 = __byte_perm(KeepFlags(w[0], th), KeepFlags(w[1], th), 0x7531);
  const uint32_t a1 = __byte_perm(KeepFlags(w[2], th), KeepFlags(w[3], th), 0x7531);
  return PackFlagPairs(a1, a0);
}

// Bit of element (key + 8 kb, query + c + 8 qa) in a keys x queries byte.
__host__ __device__ constexpr int KeyQueryBit(int qa, int kb, int c) {
  return 2 * (2 * qa + kb) + c;
}

// Keep bits (bits 0..7, garbage above) of a 16 x 16 block in the keys x
// queries orientation: rows (keys) j0 + g (+ 8), columns (queries) i0 + 2t
// (+ 1, + 8, + 9). The thread computes the call of query parity g % 2,
// whose counter is given: (query i0 + 2t + c + 8 qa, key j0 + 2 (g / 2) +
// kp + 8 kb) at word 2 qa + kb, half kp (key parity). It keeps the halves
// of its key parity and swaps the others with the thread of the other key
// parity (lane ^ 4), which computed the call of the other query parity. All
// 32 lanes must call it together (a shuffle).
__device__ __forceinline__ uint32_t KeepByteTransposed(const uint32_t counter[4],
                                                       const uint32_t key[2], HalfThreshold th,
                                                       int parity) {
  uint32_t w[4];
  philox::Philox4x32(counter, key, w);
  // Bytes (mine, mine, theirs, theirs) of words (2 qa, 2 qa + 1): the flag of
  // half kp sits in bit 7 of byte 2 kp + 1.
  const uint32_t split = parity ? 0x5173u : 0x7351u;
  const uint32_t q0 = __byte_perm(KeepFlags(w[0], th), KeepFlags(w[1], th), split);
  const uint32_t q1 = __byte_perm(KeepFlags(w[2], th), KeepFlags(w[3], th), split);
  // Byte 2 qa + kb: mine (query parity `parity`) and the partner's.
  const uint32_t mine = __byte_perm(q0, q1, 0x5410), theirs = __byte_perm(q0, q1, 0x7632);
  const uint32_t got = __shfl_xor_sync(0xffffffffu, theirs, 4);
  return parity ? PackFlagPairs(mine, got) : PackFlagPairs(got, mine);
}

// x = kept ? x * scale : 0 over block nb of a queries x keys fragment, its
// keep bits at bit `shift` of `bits` on (a byte, or RowKeep's 64-bit word:
// the shift stays in the word's own width).
template <int kNTiles, typename Bits>
__device__ __forceinline__ void ApplyKeepBlock(float (&x)[kNTiles][4], int nb, Bits bits,
                                               int shift, float scale) {
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& e = x[2 * nb + b][2 * a + c];
        e = (bits >> (shift + RowBit(a, b, c))) & 1u ? e * scale : 0.f;
      }
}

// Queries x keys orientation, a warp's kMT m-tiles (rows row0 + 16 mt ..) x
// kNTiles n-tiles (keys n0 ..): x = kept ? x * scale : 0. The forwards pass
// scale 1 (their 1 / (1 - rate) goes into the epilogue, one multiply per
// output); the deterministic dQ kernel scales dP.
template <int kMT, int kNTiles>
__device__ __forceinline__ void DropoutRows(float (&x)[kMT][kNTiles][4], const HeadDropout& d,
                                            int64_t row0, int64_t n0, int g, int t, float scale) {
  static_assert(kNTiles % 2 == 0, "dropout works on 16-column blocks");
  const HalfThreshold th(d.threshold);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    uint32_t counter[4];
    d.Counter(row0 + 16 * mt + g, n0 + 2 * t, counter);
#pragma unroll
    for (int nb = 0; nb < kNTiles / 2; ++nb, ++counter[0]) {
      ApplyKeepBlock(x[mt], nb, KeepByteRows(counter, d.key, th), 0, scale);
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
    uint32_t counter[4];
    d.Counter(row0 + g, n0 + 2 * t, counter);
    const HalfThreshold th(d.threshold);
    // Each block's byte enters at the top and the earlier ones move down
    // (a funnel shift per word), so that block nb ends at byte
    // 8 - kBlocks + nb without a variable shift.
    uint32_t lo = 0, hi = 0;
#pragma unroll 1
    for (int nb = 0; nb < kBlocks; ++nb, ++counter[0]) {
      const uint32_t byte = KeepByteRows(counter, d.key, th);
      lo = __funnelshift_r(lo, hi, 8);
      hi = __funnelshift_r(hi, byte, 8);
    }
    return RowKeep{((static_cast<uint64_t>(hi) << 32) | lo) >> (8 * (8 - kBlocks))};
  }

  // x = kept ? x * scale : 0.
  __device__ __forceinline__ void Apply(float (&x)[kNTiles][4], float scale) const {
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb) ApplyKeepBlock(x, nb, bits, 8 * nb, scale);
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
  uint32_t counter[4];
  d.Counter(row0 + g, n0 + 2 * t, counter);
  const HalfThreshold th(d.threshold);
#pragma unroll
  for (int nb = 0; nb < kNTiles / 2; ++nb, ++counter[0]) {
    const uint32_t bits = KeepByteRows(counter, d.key, th);
    ApplyKeepBlock(x, nb, bits, 0, 1.f);  // (x * 1 is x: the compiler drops the multiply)
    ApplyKeepBlock(y, nb, bits, 0, 1.f);
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
  constexpr int kBlocks = kQTiles / 2;
  uint32_t counter[4];
  d.Counter(m0 + 2 * t + (g & 1), key0 + g, counter);
  const HalfThreshold th(d.threshold);
  // Block nb ends at byte 4 - kBlocks + nb (see RowKeep::Draw).
  uint32_t bits = 0;
#pragma unroll(kSerial ? 1 : kBlocks)
  for (int nb = 0; nb < kBlocks; ++nb, ++counter[1])
    bits = __funnelshift_r(bits, KeepByteTransposed(counter, d.key, th, g & 1), 8);
  return bits >> (8 * (4 - kBlocks));
}

// Kept(bits) of one element of a keys x queries fragment (see ApplyKeepT).
__device__ __forceinline__ bool KeptT(uint32_t bits, int nt, int r) {
  return (bits >> (8 * (nt / 2) + KeyQueryBit(nt % 2, r / 2, r % 2))) & 1u;
}

// n-tile nt of a keys x queries fragment, dropped and scaled into y (the
// wgmma backwards' P^T for dV: dS^T still needs the undropped P^T).
__device__ __forceinline__ void DroppedTileT(const float (&x)[4], uint32_t bits, int nt,
                                             float scale, float (&y)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) y[r] = KeptT(bits, nt, r) ? x[r] * scale : 0.f;
}

// x[nt][r] = kept ? x * scale : 0 over keys x queries fragments; element
// st[2 nb + qa][2 kb + c] is bit KeyQueryBit(qa, kb, c) of byte nb. (Note
// the transposed roles: r / 2 = key half kb, nt % 2 = query half qa.)
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

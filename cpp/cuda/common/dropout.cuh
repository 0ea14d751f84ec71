// Dropout on tensor-core fragments: one Philox call per 16 elements.
//
// dropout.h lays the 16 draws of a Philox call over the elements that two
// threads, lanes l and l ^ 4, hold of a 16 x 16 block of an mma.sync / wgmma
// accumulator (rows g, g + 8; columns 2t, 2t + 1, 8 + 2t, 9 + 2t), in both
// orientations the kernels hold scores in:
//   - queries x keys (forwards, dQ kernels): thread (g, t) holds half e = g % 2
//     of call (u, v) = (g / 2, t);
//   - keys x queries (the dK/dV kernels' S^T): thread (g, t) holds half c =
//     g % 2 of call (u, v) = (t, g / 2).
// The two threads of a call take two blocks at a time: each computes the call
// of the block of its parity, keeps its own 8 draws and passes the other 8 to
// its partner (KeepBytes: one shuffle for up to 4 pairs; DropPackedRows: two
// per pair). So each thread makes one Philox call per 16 of its elements. A
// thread with an odd number of blocks computes the last one's call itself, as
// its partner does. The mask is the
// same function of (b, h, i, j) as on the CPU (HeadDropout::Keep).
//
// Keep bits: a block's byte holds the thread's 8 elements, bit
// RowBit(a, b, c) for element (row + 8 a, column + 8 b + c) in the queries x
// keys orientation (s[mt][2 nb + b][2 a + c]), bit KeyQueryBit for the keys
// x queries one. The compare and the packing work on whole words (KeepFlags,
// PackFlagPairs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_flash/dropout.h"

namespace jax_flash::cuda {

// Bit of element (row + 8 a, column + 8 b + c) in a queries x keys byte.
__host__ __device__ constexpr int RowBit(int a, int b, int c) { return 2 * (2 * b + c) + a; }

// Bit of element (key + 8 kb, query + c + 8 qa) in a keys x queries byte.
__host__ __device__ constexpr int KeyQueryBit(int qa, int kb, int c) {
  return 2 * (2 * qa + kb) + c;
}

// The threshold as KeepFlags compares with it.
struct ByteThreshold {
  uint32_t low;  // the threshold's low 7 bits, in every byte
  uint32_t top;  // 0x80808080 when the threshold's bit 7 is clear, else 0
  __device__ __forceinline__ explicit ByteThreshold(uint32_t threshold)
      : low((threshold & 0x7fu) * 0x01010101u), top(threshold & 0x80u ? 0u : 0x80808080u) {}
};

// The four 8-bit draws of `word` >= threshold, as bit 7 of each byte; the
// other bits are garbage. With draw = 2^7 H + l and threshold = 2^7 T + u:
// kept when H > T, or H = T and l >= u. The difference (draw | 2^7) - u
// cannot borrow from the next byte, and its bit 7 is l >= u; the answer is
// the majority of that bit, H and (T = 0).
__device__ __forceinline__ uint32_t KeepFlags(uint32_t word, ByteThreshold th) {
  const uint32_t low_ge = (word | 0x80808080u) - th.low;
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

// The keep flags of the call with this counter: f[w] holds draws 4w..4w+3
// (dropout.h: byte 2 e + c of word 2 a + b), each >= threshold in its bit 7.
__device__ __forceinline__ void CallFlags(const uint32_t counter[4], const uint32_t key[2],
                                          ByteThreshold th, uint32_t (&f)[4]) {
  uint32_t w[4];
  philox::Philox4x32(counter, key, w);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = KeepFlags(w[i], th);
}

// A thread's keep flags of one 16 x 16 block, queries x keys, as they come
// from the compare (bit 7 of each byte, garbage below): word a holds its
// elements (row + 8 a, column + 8 b + c) at byte 2 b + c (dropout.h: bytes
// 2 e + c of words 2 a and 2 a + 1).
struct BlockFlags {
  uint32_t row[2];
};

// The call with this counter as flags: this thread's (half `parity`) and its
// partner's, queries x keys, no packing.
__device__ __forceinline__ void FlagsOfCallRows(const uint32_t counter[4], const uint32_t key[2],
                                                ByteThreshold th, int parity, BlockFlags& mine,
                                                BlockFlags& theirs) {
  uint32_t f[4];
  CallFlags(counter, key, th, f);
  const uint32_t sel_mine = parity ? 0x7632u : 0x5410u, sel_theirs = parity ? 0x5410u : 0x7632u;
  mine.row[0] = __byte_perm(f[0], f[1], sel_mine);
  mine.row[1] = __byte_perm(f[2], f[3], sel_mine);
  theirs.row[0] = __byte_perm(f[0], f[1], sel_theirs);
  theirs.row[1] = __byte_perm(f[2], f[3], sel_theirs);
}

// A call's keep bits as the two threads that share it hold them: this
// thread's byte and its partner's (bits 0..7, garbage above).
struct CallKeep {
  uint32_t mine, theirs;
};

// The call with this counter, split between the thread of half `parity` and
// its partner, packed to bytes:
//   - queries x keys (half e): FlagsOfCallRows' words, byte m = 2 b + c of
//     PackFlagPairs' operands, `one` the row + 8 word (a = 1);
//   - keys x queries (half c): byte 2 e + c of word m = 2 a + b is bit
//     2 m + e (KeyQueryBit): bytes c (`zero`) and 2 + c (`one`) of each word.
template <bool kKeysByQueries>
__device__ __forceinline__ CallKeep KeepOfCall(const uint32_t counter[4], const uint32_t key[2],
                                               ByteThreshold th, int parity) {
  if constexpr (!kKeysByQueries) {
    BlockFlags mine, theirs;
    FlagsOfCallRows(counter, key, th, parity, mine, theirs);
    return {PackFlagPairs(mine.row[1], mine.row[0]), PackFlagPairs(theirs.row[1], theirs.row[0])};
  } else {
    uint32_t f[4];
    CallFlags(counter, key, th, f);
    // Bytes (c, c, 2 + c, 2 + c) of words (0, 1, 0, 1), then of (2, 3, 2, 3).
    const uint32_t mine = parity ? 0x7351u : 0x6240u, theirs = parity ? 0x6240u : 0x7351u;
    auto pack = [&](uint32_t sel) {
      const uint32_t x = __byte_perm(f[0], f[1], sel), y = __byte_perm(f[2], f[3], sel);
      return PackFlagPairs(__byte_perm(x, y, 0x7632), __byte_perm(x, y, 0x5410));
    };
    return {pack(mine), pack(theirs)};
  }
}

// The keep bytes of kBlocks consecutive 16 x 16 blocks (byte nb for block
// nb, up to 8), the thread's `counter` being that of block 0: along the
// columns (counter word 0) for queries x keys, along the queries (word 1)
// for keys x queries. Pairs of blocks share calls with the partner lane
// (lane ^ 4): all 32 lanes must call it together. kSerial: one call at a
// time (the wgmma kernels, which draw while their GEMMs' accumulators are in
// flight: unrolled calls overlapped and spilled).
template <int kBlocks, bool kKeysByQueries, bool kSerial>
__device__ __forceinline__ uint64_t KeepBytes(uint32_t counter[4], const uint32_t key[2],
                                              ByteThreshold th, int parity) {
  static_assert(kBlocks >= 1 && kBlocks <= 8, "1 to 8 blocks of 16 in 64 bits");
  constexpr int kWord = kKeysByQueries ? 1 : 0;  // the counter word that counts blocks
  constexpr int kPairs = kBlocks / 2;
  const uint32_t block0 = counter[kWord];
  uint64_t bits = 0;
  if constexpr (kPairs > 0) {
    // Pair k's bytes enter at the top and the earlier ones move down, so
    // that pair k ends at byte 4 - kPairs + k without a variable shift.
    uint32_t mine = 0, theirs = 0;
    counter[kWord] = block0 + parity;
#pragma unroll(kSerial ? 1 : kPairs)
    for (int k = 0; k < kPairs; ++k, counter[kWord] += 2) {
      const CallKeep call = KeepOfCall<kKeysByQueries>(counter, key, th, parity);
      mine = __funnelshift_r(mine, call.mine, 8);
      theirs = __funnelshift_r(theirs, call.theirs, 8);
    }
    const uint32_t got = __shfl_xor_sync(0xffffffffu, theirs, 4);
    // Block 2 k + parity is mine, block 2 k + 1 - parity the partner's.
    const uint32_t evens = (parity ? got : mine) >> (8 * (4 - kPairs));
    const uint32_t odds = (parity ? mine : got) >> (8 * (4 - kPairs));
    bits = (static_cast<uint64_t>(__byte_perm(evens, odds, 0x7362)) << 32) |
           __byte_perm(evens, odds, 0x5140);
  }
  if constexpr (kBlocks % 2 == 1) {
    counter[kWord] = block0 + kBlocks - 1;
    const uint32_t last = KeepOfCall<kKeysByQueries>(counter, key, th, parity).mine & 0xffu;
    bits |= static_cast<uint64_t>(last) << (8 * (kBlocks - 1));
  }
  counter[kWord] = block0;
  return bits;
}

// The keep bytes of a warp's kBlocks 16 x 16 blocks in the queries x keys
// orientation: rows row0 + g (+ 8), columns n0 + 16 nb + 2t (+ 1, + 8, + 9).
template <int kBlocks, bool kSerial = false>
__device__ __forceinline__ uint64_t KeepBytesRows(const HeadDropout& d, int64_t row0, int64_t n0,
                                                  int g, int t) {
  uint32_t counter[4];
  d.Counter(row0 + g, n0 + 2 * t, counter);
  return KeepBytes<kBlocks, false, kSerial>(counter, d.key, ByteThreshold(d.threshold), g & 1);
}

// PRMT with selector nibbles of bit 3 set: each result byte the sign (bit 7)
// of the byte selected, replicated (PTX prmt.b32's default mode; the
// __byte_perm intrinsic takes 3-bit selectors and cannot ask for it).
template <uint32_t kSelector>
__device__ __forceinline__ uint32_t ReplicateSigns(uint32_t x) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "n"(kSelector));
  return r;
}

// x = kept ? x : 0 on one block of packed 16-bit P (the A operand of a
// k-step: a[2 b + a] holds elements (row + 8 a, column + 8 b + {0, 1}) in
// its halves). A PRMT replicating each flag's bit 7 over its half makes the
// mask of a pair: two instructions per two elements, no bit packing.
__device__ __forceinline__ void DropPackedBlock(uint32_t (&p)[4], const BlockFlags& f) {
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    p[a] &= ReplicateSigns<0x9988u>(f.row[a]);      // bytes 0, 1: b = 0
    p[2 + a] &= ReplicateSigns<0xbbaau>(f.row[a]);  // bytes 2, 3: b = 1
  }
}

// x = kept ? x : 0 over a warp's packed P of kBlocks blocks (queries x keys:
// rows row0 + g (+ 8), block ks = columns n0 + 16 ks + ...), drawing as it
// goes: one Philox call per pair of blocks, the partner lane (lane ^ 4)
// computing the other block's call and the two swapping halves. The
// forwards scale O by 1 / (1 - rate) in the epilogue. All 32 lanes together.
template <int kBlocks>
__device__ __forceinline__ void DropPackedRows(uint32_t (&p)[kBlocks][4], const HeadDropout& d,
                                               int64_t row0, int64_t n0, int g, int t) {
  uint32_t counter[4];
  d.Counter(row0 + g, n0 + 2 * t, counter);
  const ByteThreshold th(d.threshold);
  const int parity = g & 1;
  const uint32_t block0 = counter[0];
#pragma unroll
  for (int k = 0; k < kBlocks / 2; ++k) {
    counter[0] = block0 + 2 * k + parity;
    BlockFlags mine, theirs, got;
    FlagsOfCallRows(counter, d.key, th, parity, mine, theirs);
#pragma unroll
    for (int a = 0; a < 2; ++a) got.row[a] = __shfl_xor_sync(0xffffffffu, theirs.row[a], 4);
    // Block 2 k + parity is mine, the other the partner's (selects: p's
    // index must stay a constant, or p would go to local memory).
    BlockFlags even, odd;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      even.row[a] = parity ? got.row[a] : mine.row[a];
      odd.row[a] = parity ? mine.row[a] : got.row[a];
    }
    DropPackedBlock(p[2 * k], even);
    DropPackedBlock(p[2 * k + 1], odd);
  }
  if constexpr (kBlocks % 2 == 1) {  // the last block alone: both partners compute its call
    counter[0] = block0 + kBlocks - 1;
    BlockFlags mine, theirs;
    FlagsOfCallRows(counter, d.key, th, parity, mine, theirs);
    DropPackedBlock(p[kBlocks - 1], mine);
  }
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
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const uint64_t bits = KeepBytesRows<kNTiles / 2>(d, row0 + 16 * mt, n0, g, t);
#pragma unroll
    for (int nb = 0; nb < kNTiles / 2; ++nb) ApplyKeepBlock(x[mt], nb, bits, 8 * nb, scale);
  }
}

// The keep bits of one warp's 16 rows x kNTiles n-tiles (queries x keys),
// byte nb for block nb: the wgmma dQ kernel draws them while its S and dP
// GEMMs run and applies them (Apply) to dP. One call at a time (not
// unrolled): with the accumulators of GEMMs in flight, unrolled calls
// overlapped and spilled (the forwards, ptxas: 184-268 bytes at D = 128).
template <int kNTiles>
struct RowKeep {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "up to 8 blocks of 16 columns in 64 bits");
  static constexpr int kBlocks = kNTiles / 2;
  uint64_t bits;

  __device__ __forceinline__ static RowKeep Draw(const HeadDropout& d, int64_t row0, int64_t n0,
                                                 int g, int t) {
    return RowKeep{KeepBytesRows<kBlocks, /*kSerial=*/true>(d, row0, n0, g, t)};
  }

  // x = kept ? x : 0 (the scale joins a later FFMA).
  __device__ __forceinline__ void Apply(float (&x)[kNTiles][4]) const {
#pragma unroll
    for (int nb = 0; nb < kBlocks; ++nb) ApplyKeepBlock(x, nb, bits, 8 * nb, 1.f);
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

// x *= scale over one warp's tiles (the backwards' dV, which took the kept
// P^T unscaled).
template <int kTiles>
__device__ __forceinline__ void ScaleTiles(float (&x)[kTiles][4], float scale) {
  ScaleFragment(reinterpret_cast<float(&)[1][kTiles][4]>(x), scale);
}

// DropoutRows on the fragments of one m-tile (the deterministic dQ kernel).
template <int kNTiles>
__device__ __forceinline__ void DropoutRows(float (&x)[kNTiles][4], const HeadDropout& d,
                                            int64_t row0, int64_t n0, int g, int t, float scale) {
  DropoutRows(reinterpret_cast<float(&)[1][kNTiles][4]>(x), d, row0, n0, g, t, scale);
}

// The JVP's two fragments of one m-tile (sm80/jvp.cuh: P and P o dS, queries
// x keys) dropped with the same keep bits, from one Philox call per 16
// elements: x = kept ? x : 0, y likewise (1 / (1 - rate) goes into the
// epilogue, as in the forwards).
template <int kNTiles>
__device__ __forceinline__ void DropoutRowsPair(float (&x)[kNTiles][4], float (&y)[kNTiles][4],
                                                const HeadDropout& d, int64_t row0, int64_t n0,
                                                int g, int t) {
  static_assert(kNTiles % 2 == 0, "dropout works on 16-column blocks");
  const uint64_t bits = KeepBytesRows<kNTiles / 2>(d, row0, n0, g, t);
#pragma unroll
  for (int nb = 0; nb < kNTiles / 2; ++nb) {
    ApplyKeepBlock(x, nb, bits, 8 * nb, 1.f);  // (x * 1 is x: the compiler drops the multiply)
    ApplyKeepBlock(y, nb, bits, 8 * nb, 1.f);
  }
}

// The keep bits of kQTiles / 2 blocks of 16 queries, one byte each: a 32-bit
// word up to 4 blocks (64 queries), 64 bits up to 8.
template <int kQTiles>
using KeepBitsTWord = std::conditional_t<(kQTiles > 8), uint64_t, uint32_t>;

// Keys x queries orientation (S^T, dP^T of one warp: keys key0 + g (+ 8),
// queries m0 + 8 nt + 2t + c): the keep bits of the warp's kQTiles / 2
// blocks, one byte each, for ApplyKeepT. All 32 lanes call it together.
// kSerial: one call at a time (the wgmma backwards, which draw while their
// GEMMs' accumulators are in flight; see RowKeep).
template <int kQTiles, bool kSerial = false>
__device__ __forceinline__ KeepBitsTWord<kQTiles> KeepBitsT(const HeadDropout& d, int64_t key0,
                                                            int64_t m0, int g, int t) {
  static_assert(kQTiles % 2 == 0 && kQTiles <= 16, "up to 8 blocks of 16 queries in 64 bits");
  uint32_t counter[4];
  d.Counter(m0 + 2 * t, key0 + g, counter);
  return static_cast<KeepBitsTWord<kQTiles>>(
      KeepBytes<kQTiles / 2, /*kKeysByQueries=*/true, kSerial>(counter, d.key,
                                                               ByteThreshold(d.threshold), g & 1));
}

// Kept(bits) of one element of a keys x queries fragment (see ApplyKeepT).
template <typename Bits>
__device__ __forceinline__ bool KeptT(Bits bits, int nt, int r) {
  return (bits >> (8 * (nt / 2) + KeyQueryBit(nt % 2, r / 2, r % 2))) & 1u;
}

// n-tile nt of a keys x queries fragment, dropped into y (the wgmma
// backwards' P^T for dV, which they scale once at the end: dS^T still needs
// the undropped P^T).
template <typename Bits>
__device__ __forceinline__ void DroppedTileT(const float (&x)[4], Bits bits, int nt,
                                             float (&y)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) y[r] = KeptT(bits, nt, r) ? x[r] : 0.f;
}

// x[nt][r] = kept ? x * scale : 0 over keys x queries fragments; element
// st[2 nb + qa][2 kb + c] is bit KeyQueryBit(qa, kb, c) of byte nb. (Note
// the transposed roles: r / 2 = key half kb, nt % 2 = query half qa.)
template <int kQTiles>
__device__ __forceinline__ void ApplyKeepT(float (&x)[kQTiles][4], KeepBitsTWord<kQTiles> bits,
                                           float scale) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      x[nt][r] = KeptT(bits, nt, r) ? x[nt][r] * scale : 0.f;
    }
}

}  // namespace jax_flash::cuda

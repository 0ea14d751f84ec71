// Dropout on attention probabilities, identical on every backend.
//
// Whether element (b, h, i, j) is kept is a pure function of the key and of
// those four indices, so the CPU and CUDA kernels, the forward and the
// backward, and any tiling draw the same mask: an 8-bit draw, kept when it is
// >= an 8-bit threshold (the rate is a multiple of 2^-8; keep_scale uses that
// exact rate, so the result stays unbiased). 8 bits, as FlashAttention-2's
// draws: one Philox call then serves 16 elements, and the calls are most of
// dropout's cost on tensor cores.
//
// Draws come from Philox-4x32-7, a counter-based generator (7 rounds, as
// FlashAttention-2's: Salmon et al. found 7 rounds pass TestU01's BigCrush;
// 10, Random123's default, adds a margin that cost 12 of a call's ~70
// instructions); one call gives 16 draws (four 32-bit words, four bytes
// each). Within a 16 x 16 block of (i, j), write i = 16 I + 8 a + 2 u + e
// and j = 16 J + 8 b + 2 v + c
// (a, b, e, c in {0, 1}; u, v in 0..3). Call (u, v) of the block holds the 16
// elements of rows {2u, 2u + 1} (+ 8) and columns {2v, 2v + 1} (+ 8); the draw
// of element (a, e, b, c) is byte 2 e + c of word 2 a + b. Why this shape: a
// tensor-core accumulator fragment (mma m16n8k16, or a wgmma accumulator over
// two n-tiles) gives thread (g, t) of a warp rows g, g + 8 and columns 2t,
// 2t + 1, 8 + 2t, 9 + 2t of each 16 x 16 block; call (u, v) is then exactly
// the elements of the two threads g = 2u + {0, 1}, t = v (lanes l, l ^ 4) in a
// queries x keys fragment, and of the two threads g = 2v + {0, 1}, t = u in a
// keys x queries one (the backward's S^T). Either way two threads share each
// call, so each computes the call of one of two blocks and they swap halves.
// Kernels that walk rows (CPU, SIMT) use the 4 draws of a call that lie in
// their row.
//
// Counter words: {J, I, (u * 4 + v) << 24 | head, batch}.
//
// The indices are global: a call that holds one shard or chunk of the problem
// adds its offsets (mask.h's Offset) to batch, head, I and J, so a sharded run
// drops what the unsharded one does. Its query and key positions must be
// multiples of 16 (whole blocks), which keeps i % 16 and j % 16, hence every
// kernel's grouping of draws, the same as in the whole problem.
#pragma once

#include <cstdint>

#include "jax_flash/macros.h"
#include "jax_flash/mask.h"  // Offset: the offsets operand's entries

namespace jax_flash {

struct DropoutParams {
  double rate = 0.0;  // probability of dropping; 0 disables dropout
  // Keys, uint32 (key_batch, 2), on the kernel's device. Batch element b
  // uses key b / (B / key_batch) and counts itself as batch b % (B / key_batch):
  // vmap over keys folds them into the batch and draws what the unbatched
  // call would.
  const uint32_t* keys = nullptr;
  int64_t key_batch = 0;
  // Flax's broadcast_dropout: one mask shared by every batch element and head.
  bool broadcast_batch_and_heads = false;
  // mask.h's offsets operand (kNumOffsets,), on the kernel's device, or null.
  const int32_t* offsets = nullptr;

  JAX_FLASH_HOST_DEVICE bool enabled() const { return rate > 0; }
  // An element is kept when its 8-bit draw is >= this threshold: the rate
  // rounded to a multiple of 2^-8 (jax_flash's Python side passes rates that
  // already are). A rate below 2^-9 drops nothing.
  JAX_FLASH_HOST_DEVICE uint32_t threshold() const {
    const double t = rate * kDrawRange + 0.5;
    return t >= kDrawRange - 1 ? kDrawRange - 1 : static_cast<uint32_t>(t);
  }
  // Kept elements are scaled by 1 / (1 - the rate the threshold realises).
  JAX_FLASH_HOST_DEVICE double keep_scale() const {
    return kDrawRange / (kDrawRange - static_cast<double>(threshold()));
  }
  static constexpr uint32_t kDrawRange = 1u << 8;
};

namespace philox {

inline constexpr uint32_t kMul0 = 0xD2511F53u;
inline constexpr uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
inline constexpr int kRounds = 7;

JAX_FLASH_HOST_DEVICE void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Philox-4x32-7: four 32-bit outputs for a 128-bit counter and 64-bit key.
JAX_FLASH_HOST_DEVICE void Philox4x32(const uint32_t counter[4], const uint32_t key[2],
                                      uint32_t out[4]) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < kRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo(kMul0, c0, &hi0, &lo0);
    MulHiLo(kMul1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

}  // namespace philox

// Dropout resolved for one (batch element, head): its key and counter words.
struct HeadDropout {
  uint32_t key[2];
  uint32_t batch_word, head_word;  // head_word < 2^24: the call lane takes the top byte
  uint32_t row_block, col_block;   // the chunk's first 16 x 16 block (its offsets / 16)
  uint32_t threshold;
  bool enabled;

  JAX_FLASH_HOST_DEVICE static HeadDropout For(const DropoutParams& d, int64_t batch, int64_t b,
                                               int64_t h) {
    HeadDropout r{};
    r.enabled = d.enabled();
    if (!r.enabled) return r;
    const int64_t period = batch / d.key_batch;
    r.key[0] = d.keys[2 * (b / period)];
    r.key[1] = d.keys[2 * (b / period) + 1];
    const int32_t* o = d.offsets;
    const int64_t batch_offset = o ? o[kBatchOffset] : 0, head_offset = o ? o[kHeadOffset] : 0;
    r.batch_word = d.broadcast_batch_and_heads ? 0u
                                               : static_cast<uint32_t>(b % period + batch_offset);
    r.head_word = d.broadcast_batch_and_heads ? 0u : static_cast<uint32_t>(h + head_offset);
    r.row_block = o ? static_cast<uint32_t>(o[kQueryPosition]) >> 4 : 0u;
    r.col_block = o ? static_cast<uint32_t>(o[kKeyPosition]) >> 4 : 0u;
    r.threshold = d.threshold();
    return r;
  }

  // The same batch element's head h + dh, for kernels that walk the heads of
  // a GQA group (without For's divisions and loads per head).
  JAX_FLASH_HOST_DEVICE HeadDropout PlusHeads(const DropoutParams& d, int64_t dh) const {
    HeadDropout r = *this;
    if (!d.broadcast_batch_and_heads) r.head_word += static_cast<uint32_t>(dh);
    return r;
  }

  // Position (u, v) of (i, j)'s call in its 16 x 16 block (see the top of this file).
  JAX_FLASH_HOST_DEVICE static uint32_t CallLane(int64_t i, int64_t j) {
    return static_cast<uint32_t>((((i & 7) >> 1) << 2) | ((j & 7) >> 1));
  }
  // Byte of (i, j)'s draw among its call's 16: byte 2 e + c of word 2 a + b.
  JAX_FLASH_HOST_DEVICE static int DrawSlot(int64_t i, int64_t j) {
    const int a = (i >> 3) & 1, e = i & 1, b = (j >> 3) & 1, c = j & 1;
    return 4 * (2 * a + b) + 2 * e + c;
  }

  // The counter of the call that holds element (i, j) of this chunk. Word 0
  // counts 16-column blocks and word 1 16-row blocks, so a kernel walking
  // blocks steps them instead of recomputing the counter.
  JAX_FLASH_HOST_DEVICE void Counter(int64_t i, int64_t j, uint32_t counter[4]) const {
    counter[0] = static_cast<uint32_t>(j >> 4) + col_block;
    counter[1] = static_cast<uint32_t>(i >> 4) + row_block;
    counter[2] = (CallLane(i, j) << 24) | head_word;
    counter[3] = batch_word;
  }

  // The 16 draws of the call that holds element (i, j) of this chunk, as 4 words.
  JAX_FLASH_HOST_DEVICE void Call(int64_t i, int64_t j, uint32_t words[4]) const {
    uint32_t counter[4];
    Counter(i, j, counter);
    philox::Philox4x32(counter, key, words);
  }

  // Draw `slot` (0..15) of a call's words.
  JAX_FLASH_HOST_DEVICE static uint32_t Draw(const uint32_t words[4], int slot) {
    return (words[slot >> 2] >> (8 * (slot & 3))) & 0xffu;
  }

  // Is element (i, j) kept?
  JAX_FLASH_HOST_DEVICE bool Keep(int64_t i, int64_t j) const {
    uint32_t words[4];
    Call(i, j, words);
    return Draw(words, DrawSlot(i, j)) >= threshold;
  }

  // The calls that serve row i over the 16 columns from j16 (a multiple of
  // 16): call p (v = p) holds its columns j16 + 2p, + 1, + 8, + 9. KeepIn then
  // reads them.
  JAX_FLASH_HOST_DEVICE void RowCalls(int64_t i, int64_t j16, uint32_t words[4][4]) const {
    for (int p = 0; p < 4; ++p) Call(i, j16 + 2 * p, words[p]);
  }
  JAX_FLASH_HOST_DEVICE bool KeepIn(const uint32_t words[4][4], int64_t i, int64_t j) const {
    return Draw(words[(j & 7) >> 1], DrawSlot(i, j)) >= threshold;
  }
};

}  // namespace jax_flash

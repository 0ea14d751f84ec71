// Dropout on attention probabilities, identical on every backend.
//
// Whether element (b, h, i, j) is kept is a pure function of the key and of
// those four indices (Philox-4x32-10, a counter-based generator), so the CPU
// and CUDA kernels, the forward and the backward, and any tiling draw the
// same mask. One Philox call yields four 32-bit numbers; they serve four
// consecutive columns j.
#pragma once

#include <cstdint>

#include "jax_flash/mask.h"  // JAX_FLASH_HOST_DEVICE

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

  JAX_FLASH_HOST_DEVICE bool enabled() const { return rate > 0; }
  // Kept elements are scaled by 1 / (1 - rate).
  JAX_FLASH_HOST_DEVICE double keep_scale() const { return 1.0 / (1.0 - rate); }
  // An element is kept when its 32-bit draw is >= this threshold.
  JAX_FLASH_HOST_DEVICE uint32_t threshold() const {
    const double t = rate * 4294967296.0;  // rate * 2^32
    return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
  }
};

namespace philox {

inline constexpr uint32_t kMul0 = 0xD2511F53u;
inline constexpr uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
inline constexpr int kRounds = 10;

JAX_FLASH_HOST_DEVICE void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Philox-4x32-10: four 32-bit outputs for a 128-bit counter and 64-bit key.
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
  uint32_t batch_word, head_word;
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
    r.batch_word = d.broadcast_batch_and_heads ? 0u : static_cast<uint32_t>(b % period);
    r.head_word = d.broadcast_batch_and_heads ? 0u : static_cast<uint32_t>(h);
    r.threshold = d.threshold();
    return r;
  }

  // The four draws for columns 4*(j/4) .. 4*(j/4)+3 of row i.
  JAX_FLASH_HOST_DEVICE void Draws(int64_t i, int64_t j, uint32_t out[4]) const {
    const uint32_t counter[4] = {static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
                                 head_word, batch_word};
    philox::Philox4x32(counter, key, out);
  }

  // Is element (i, j) kept?
  JAX_FLASH_HOST_DEVICE bool Keep(int64_t i, int64_t j) const {
    uint32_t draws[4];
    Draws(i, j, draws);
    return draws[j & 3] >= threshold;
  }
};

}  // namespace jax_flash

// Which Hopper backward runs a problem: the rules the launchers
// (sm90/bwd.cuh, sm90/bwd_dq.cuh) and the routing (bwd/run.cuh) share, in a
// header of their own, so that the dQ kernel's file does not include the
// dK/dV kernels' for them.
#pragma once

#include "cuda/sm90/tile_size.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// Whether the Hopper backward takes this problem's score terms, each a
// variant of the kernels of its own, alone:
// - a bias from the D = 128 bucket (head dims above 96; the wide kernel and
//   the dQ kernel, per element: common/bias.cuh's AddBias; in the D <= 128
//   kernel, whose registers are full, a bias variant spilled 0.6-1 KB per
//   thread), without a soft cap and
//   without a deterministic dbias (its adds are float atomics; the mma.sync
//   kernels have the ordered ones);
// - dropout, every head dim, without a soft cap or a bias.
// A dense mask (with its tile map) needs no variant. The mma.sync kTerms
// kernels take every other combination (bwd/run.cuh).
inline bool BwdTakesTerms(const BwdParams& p, bool deterministic) {
  const bool cap = p.score.softcap != 0.0;
  if (p.score.bias != nullptr)
    return p.shape.head_dim > 96 && !cap && !p.dropout.enabled() &&
           !(deterministic && p.dbias != nullptr);
  return !(p.dropout.enabled() && cap);
}

// Whether the fast mode runs the deterministic structure (dK/dV without dQ,
// then the dQ kernel over query blocks) instead of adding dQ with atomics in
// the dK/dV kernel, for bucket kHeadDim:
// - above D = 128 unless the bucket's row says wide_dq (sm90/tile_size.h);
//   without it the separate kernel was the faster of the two on an H100
//   (bf16, S 4k-16k: 295-367 TFLOP/s against 238-279 for the first atomic
//   dQ of mainloop_bwd_wide.cuh; cpp/cuda/NOTES.md);
// - at D = 128 with a bias, which runs on the wide kernel's structure.
// The dK/dV kernels with dQ are not built for these. At D = 128 with dropout
// the kernel with dQ runs (it spilled 284 bytes until the fourteenth
// session's mask paths, 28 since; the separate structure, which draws the
// keep bits twice, took 1.11-1.33x its time on an H200: NOTES_sm90_bwd.md).
constexpr bool SeparateDq(int head_dim, bool bias) {
  return (head_dim > 128 && !BwdTileSize(head_dim).wide_dq) || (head_dim == 128 && bias);
}

}  // namespace jax_flash::cuda::sm90

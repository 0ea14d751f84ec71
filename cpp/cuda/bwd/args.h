// The per-launch constants every kernel of the tensor-core backward reads:
// the problem, the score transform folded into exp2 form, and where the
// workspace parts are (bwd/workspace.h).
#pragma once

#include <cstddef>

#include "cuda/bwd/workspace.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

struct BwdArgs {
  BwdParams p;
  float scale;           // d score / d (q.k) without softcap
  float scale_log2;      // log2(e) * scale, or log2(e) when softcap is on or with a bias
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap (1 / softcap with a bias)
  float inv_softcap;     // 1 / softcap, 0 when off (then d x / d s = 1 - 0 = 1)
  int* tile_counter;     // the persistent dK/dV kernel's (sm90/bwd.cuh), zeroed per launch
  float* lse2;           // (B, Hq, Sq) float32 workspace: Lse2(lse), bwd/preprocess.cuh
  float* dq_accum;       // float32 workspace, fast mode only: DqAccumLayout
  float keep_scale;      // dropout: 1 / (1 - rate), the kept elements' factor
  // Where this chunk (bwd/workspace.h) starts in the whole problem: dropout
  // draws from the global batch element and head (HeadDropout::For).
  int64_t batch, batch0, head0;

  // The dropout stream of the chunk's (batch element b, query head h).
  __device__ __forceinline__ HeadDropout Dropout(int64_t b, int64_t h) const {
    return HeadDropout::For(p.dropout, batch, batch0 + b, head0 + h);
  }
};

// `workspace`: the kernels' part of the workspace (bwd/workspace.h);
// params: the chunk (ChunkParams) whose first batch element and query head
// are batch0 and head0 of a problem of `batch` elements.
inline BwdArgs MakeBwdArgs(const BwdParams& params, void* workspace, int64_t batch,
                           int64_t batch0, int64_t head0) {
  BwdArgs args;
  args.p = params;
  args.scale = static_cast<float>(params.score.scale);
  args.softcap = static_cast<float>(params.score.softcap);
  // With a bias the kTerms kernels hold x = scale * q.k + bias (AddBias in
  // common/score.cuh), so scale leaves exp2 and tanh (as in MakeFwdArgs).
  const float pre = params.score.bias != nullptr ? 1.f : args.scale;
  if (args.softcap > 0.f) {
    args.scale_log2 = kLog2e;
    args.scale_over_cap = pre / args.softcap;
  } else {
    args.softcap = 0.f;
    args.scale_log2 = pre * kLog2e;
    args.scale_over_cap = 0.f;
  }
  args.inv_softcap = args.softcap > 0.f ? 1.f / args.softcap : 0.f;
  char* const base = static_cast<char*>(workspace);
  args.tile_counter = reinterpret_cast<int*>(base);
  args.lse2 = reinterpret_cast<float*>(base + kTileCounterBytes);
  args.dq_accum = reinterpret_cast<float*>(base + kTileCounterBytes + Lse2Bytes(params.shape));
  args.keep_scale = static_cast<float>(params.dropout.keep_scale());
  args.batch = batch;
  args.batch0 = batch0;
  args.head0 = head0;
  return args;
}

}  // namespace jax_flash::cuda

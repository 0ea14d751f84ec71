// The tensor-core backward of one (arch path, dtype, head-dim bucket), in
// stream order:
//   1. preprocess (bwd/preprocess.cuh): D = rowsum(dO * O), lse in log2 units,
//      and in the fast mode the float32 dQ accumulator zeroed;
//   2. dK/dV (sm80/bwd_dkdv.cuh, or on Hopper sm90/bwd.cuh), which in the
//      fast mode also adds dQ into a float32 accumulator;
//   3. dQ: fast mode, its conversion (bwd/postprocess.cuh); deterministic
//      mode, the dQ kernel parallel over query blocks (sm80/bwd_dq.cuh, or
//      on Hopper sm90/bwd_dq.cuh). The fast mode takes the deterministic
//      structure where it is the faster (sm90::SeparateDq, TuringSeparateDq).
// A problem whose dQ accumulator would exceed kMaxDqAccumBytes runs as
// chunks that reuse one accumulator (bwd/workspace.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/postprocess.cuh"
#include "cuda/bwd/preprocess.cuh"
#include "cuda/bwd/workspace.h"
#include "cuda/kernels.h"
#include "cuda/sm80/bwd_dkdv.cuh"
#include "cuda/sm80/bwd_dq.cuh"
#include "cuda/sm90/bwd.cuh"
#include "cuda/sm90/bwd_dq.cuh"
#include "cuda/sm90/bwd_routing.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"
#include "jax_flash/supported.h"

namespace jax_flash::cuda {

// One chunk (or the whole problem): batch elements from batch0 and query
// heads from head0 of a problem of `batch` elements. kArch = 90: dK/dV, and
// the deterministic mode's dQ, on the Hopper kernels.
template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunBwdChunk(const BwdParams& params, void* workspace, bool deterministic,
                        int64_t batch, int64_t batch0, int64_t head0, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  if (shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  if (shape.batch == 0 || shape.num_heads_q == 0 || (shape.seqlen_q == 0 && shape.seqlen_k == 0))
    return cudaSuccess;
  if (shape.num_heads_q > 65535 || shape.batch > 65535) return cudaErrorInvalidConfiguration;
  const BwdArgs args = MakeBwdArgs(params, workspace, batch, batch0, head0);
  cudaError_t err;

  const int64_t rows = shape.batch * shape.num_heads_q * shape.seqlen_q;
  if (rows > 0) {  // D, lse2, and in the fast mode the zeroed dQ accumulator
    if ((err = LaunchPreprocess<T, kHeadDim>(args, !deterministic, stream)) != cudaSuccess)
      return err;
  }

  // The Hopper kernels decline (cudaErrorNotSupported) where TMA cannot
  // address Q, dO (K, V); the sm_80 kernels, with the same dQ accumulator,
  // run then.
  bool dkdv_launched = false;
  if constexpr (kArch == 90) {
    err = sm90::LaunchDkDv<T, kHeadDim>(args, /*accumulate_dq=*/!deterministic, stream);
    if (err == cudaSuccess) dkdv_launched = true;
    else if (err != cudaErrorNotSupported) return err;
  }
  if (!dkdv_launched) {
    // A dense or block mask reaches here only if TMA failed for a reason
    // RunBwd's check missed: an error rather than the plain kernels' wrong
    // answer (LaunchBwd then runs the exact backward).
    if (kArch == 90 && !kTerms && HasScoreTerms(params)) return cudaErrorNotSupported;
    // Arch path 75: the same kernels with the Turing tiles.
    err = sm80::LaunchDkDv<T, kHeadDim, kTerms, kArch == 75 ? 75 : 80>(
        args, /*accumulate_dq=*/!deterministic, stream);
    if (err != cudaSuccess) return err;
  }

  if (rows == 0) return cudaSuccess;
  if (deterministic) {
    if constexpr (kArch == 90) {
      err = sm90::LaunchDq<T, kHeadDim>(args, stream);
      if (err != cudaErrorNotSupported) return err;
      if (!kTerms && HasScoreTerms(params)) return cudaErrorNotSupported;  // as above
    }
    return sm80::LaunchDq<T, kHeadDim, kTerms, kArch == 75 ? 75 : 80>(args, stream);
  }
  return LaunchDqConvert<T, kHeadDim>(args, stream);
}

// The fast mode on Turing runs the deterministic structure (dK/dV, then dQ
// over query blocks, no atomics) above D = 32: the one-kernel backward with
// its scalar float atomics into the dQ accumulator ran 1.2-1.6x slower on
// the forced family (at D = 32 about as fast; cpp/cuda/NOTES.md). Not with
// dropout (the second kernel would draw the mask again; not measured), nor
// with a dbias of several writers per element (the deterministic dK/dV
// kernel adds it without atomics).
inline bool TuringSeparateDq(const BwdParams& params, int head_dim_bucket) {
  return head_dim_bucket > 32 && !params.dropout.enabled() &&
         (params.dbias == nullptr || DbiasHasOneWriter(params));
}

template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunBwd(const BwdParams& params, void* workspace, bool deterministic,
                   cudaStream_t stream) {
  static_assert(kArch == 75 || kArch == 80 || kArch == 90,
                "arch paths: 75 (mma.sync, Turing), 80 (mma.sync), 90 (wgmma)");
  static_assert(kArch != 90 || !kTerms, "score terms: the mma.sync kernels only");
  if constexpr (kArch == 90) {
    // Of the terms, the tile map (segments, a dense mask, a block mask in
    // it), a bias and dropout come here (BwdPath); the mma.sync kTerms
    // kernels (their own units) take them where TMA cannot address Q, dO, K
    // or V, and the combinations that the wgmma kernels have no variant for
    // (sm90::BwdTakesTerms).
    const bool tma = sm90::TmaCanAddress(params.q, params.q_strides) &&
                     sm90::TmaCanAddress(params.dout, params.dout_strides) &&
                     sm90::TmaCanAddress(params.k, params.k_strides) &&
                     sm90::TmaCanAddress(params.v, params.v_strides);
    if (HasScoreTerms(params) && (!tma || !sm90::BwdTakesTerms(params, deterministic))) {
#ifdef JAX_FLASH_HAS_SM80
      return RunBwd<80, T, kHeadDim, true>(params, workspace, deterministic, stream);
#else
      return cudaErrorNotSupported;
#endif
    }
  } else if (HasScoreTerms(params) != kTerms) {
    return cudaErrorInvalidValue;
  }
  const AttentionShape& shape = params.shape;
  if (shape.head_dim > kHeadDim) return cudaErrorInvalidValue;
  // The dK/dV kernel adds dS into dbias (float32, the bias's own shape):
  // zero first, which also covers the elements no visible tile reaches.
  if (params.score.bias != nullptr && params.dbias != nullptr) {
    const int64_t* d = params.score.bias_dims;
    const cudaError_t err =
        cudaMemsetAsync(params.dbias, 0, sizeof(float) * d[0] * d[1] * d[2] * d[3], stream);
    if (err != cudaSuccess) return err;
  }
  if constexpr (kTerms) {
    // Plain adds need one writer per element (common/score.cuh); BwdPath
    // keeps the other deterministic problems on the exact kernels. Without
    // dbias (not wanted) nothing is summed.
    if (deterministic && params.dbias != nullptr && !DbiasHasOneWriter(params))
      return cudaErrorInvalidValue;
  }
  const BwdChunk chunk = ChunkFor<kHeadDim>(shape);
  // The fast mode on Hopper runs the deterministic structure where
  // sm90::SeparateDq says it is the faster, on Turing where TuringSeparateDq does.
  if (deterministic ||
      (kArch == 90 && sm90::SeparateDq(kHeadDim, params.score.bias != nullptr)) ||
      (kArch == 75 && TuringSeparateDq(params, kHeadDim)))
    return RunBwdChunk<kArch, T, kHeadDim, kTerms>(params, workspace, /*deterministic=*/true,
                                                   shape.batch, 0, 0, stream);
  if (chunk.batches >= shape.batch && chunk.kv_heads >= shape.num_heads_kv)
    return RunBwdChunk<kArch, T, kHeadDim, kTerms>(params, workspace, false, shape.batch, 0, 0,
                                                   stream);
  for (int64_t b0 = 0; b0 < shape.batch; b0 += chunk.batches) {
    for (int64_t hk0 = 0; hk0 < shape.num_heads_kv; hk0 += chunk.kv_heads) {
      const AttentionShape sub = ChunkShape(shape, chunk, b0, hk0);
      const cudaError_t err =
          RunBwdChunk<kArch, T, kHeadDim, kTerms>(ChunkParams<T>(params, sub, b0, hk0), workspace, false,
                                          shape.batch, b0, hk0 * shape.group_size(), stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

// The kTerms backward that the sm90 one falls back to is its own units'
// (as fwd.cuh's): declared here, not instantiated.
#ifdef JAX_FLASH_HAS_SM80
#define JAX_FLASH_EXTERN_TERMS_BWD(D)                                                         \
  extern template cudaError_t RunBwd<80, __nv_bfloat16, D, true>(const BwdParams&, void*,    \
                                                                 bool, cudaStream_t);       \
  extern template cudaError_t RunBwd<80, __half, D, true>(const BwdParams&, void*, bool,     \
                                                          cudaStream_t);
JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_EXTERN_TERMS_BWD)
#undef JAX_FLASH_EXTERN_TERMS_BWD
#endif

}  // namespace jax_flash::cuda

// The tensor-core forward of one (arch path, dtype, head-dim bucket): the
// mma.sync kernel (sm80/fwd.cuh; arch path 75 is the same kernel with the
// Turing tiles, compiled for compute_75) or a wgmma one: the warp-specialized
// pipeline (sm90/fwd_ws.cuh) for CUDA_SM90_FWD_WS_BUCKETS, sm90/fwd.cuh for
// the other Hopper buckets and wherever TMA cannot address the operands.
// -DJAX_FLASH_SM90_FWD_WS=0 builds sm90/fwd.cuh for every Hopper bucket (to
// check and time the two against each other).
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/sm80/fwd.cuh"
#include "cuda/sm90/fwd.cuh"
#include "cuda/sm90/fwd_ws.cuh"
#include "jax_flash/params.h"
#include "jax_flash/supported.h"

#ifndef JAX_FLASH_SM90_FWD_WS
#define JAX_FLASH_SM90_FWD_WS 1
#endif

namespace jax_flash::cuda {

constexpr bool InSm90FwdWsBuckets(int head_dim) {
#define JAX_FLASH_BUCKET(D) \
  if (head_dim == (D)) return true;
  JAX_FLASH_FOR_EACH_SM90_FWD_WS_BUCKET(JAX_FLASH_BUCKET)
#undef JAX_FLASH_BUCKET
  return false;
}

template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunFwd(const FwdParams& params, void* workspace, cudaStream_t stream) {
  static_assert(kArch == 75 || kArch == 80 || kArch == 90,
                "arch paths: 75 (mma.sync, Turing), 80 (mma.sync), 90 (wgmma)");
  static_assert(kArch != 90 || !kTerms, "score terms: the mma.sync kernels only");
  if constexpr (kArch == 90) {
    // A dense mask (with a tile map: FwdPath) runs on the warp-specialized
    // forward, a kernel of its own (in the consumers of every instantiation
    // its per-element test spilled their registers in every block), with a
    // bias or dropout on sm90/fwd.cuh.
    if constexpr (JAX_FLASH_SM90_FWD_WS && InSm90FwdWsBuckets(kHeadDim)) {
      const cudaError_t err = sm90::LaunchFwdWs<T, kHeadDim>(params, workspace, stream);
      if (err != cudaErrorNotSupported) return err;
    }
    // sm90/fwd.cuh declines (cudaErrorNotSupported) where its TMA loads
    // cannot address Q, K, V or the bias; the sm_80 kernel runs then, its
    // kTerms instantiation (another unit's) for a dense mask, a bias or a
    // tile map (a block mask in it included: FwdPath's Sm90Supports).
    const cudaError_t err = sm90::LaunchFwd<T, kHeadDim>(params, stream);
    if (err != cudaErrorNotSupported) return err;
    if (HasScoreTerms(params)) {
#ifdef JAX_FLASH_HAS_SM80
      return RunFwd<80, T, kHeadDim, true>(params, workspace, stream);
#else
      return cudaErrorNotSupported;
#endif
    }
  }
  return sm80::LaunchFwd<T, kHeadDim, kTerms, /*kArch=*/kArch == 90 ? 80 : kArch>(params, stream);
}

// The kTerms kernels that the sm90 forward falls back to are their own
// units' (_supported.py: a second kernel in a file changes how nvcc compiles
// the first): declared here, not instantiated.
#ifdef JAX_FLASH_HAS_SM80
#define JAX_FLASH_EXTERN_TERMS_FWD(D)                                                        \
  extern template cudaError_t RunFwd<80, __nv_bfloat16, D, true>(const FwdParams&, void*,   \
                                                                 cudaStream_t);            \
  extern template cudaError_t RunFwd<80, __half, D, true>(const FwdParams&, void*,          \
                                                          cudaStream_t);
JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_EXTERN_TERMS_FWD)
#undef JAX_FLASH_EXTERN_TERMS_FWD
#endif

}  // namespace jax_flash::cuda

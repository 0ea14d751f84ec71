// The tensor-core forward of one (arch path, dtype, head-dim bucket): the
// mma.sync kernel (sm80/fwd.cuh; arch path 75 is the same kernel with the
// Turing tiles, compiled for compute_75) or the wgmma one (sm90/fwd.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/sm80/fwd.cuh"
#include "cuda/sm90/fwd.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunFwd(const FwdParams& params, cudaStream_t stream) {
  static_assert(kArch == 75 || kArch == 80 || kArch == 90,
                "arch paths: 75 (mma.sync, Turing), 80 (mma.sync), 90 (wgmma)");
  static_assert(kArch != 90 || !kTerms, "score terms: the mma.sync kernels only");
  if constexpr (kArch == 90) {
    return sm90::LaunchFwd<T, kHeadDim>(params, stream);
  } else {
    return sm80::LaunchFwd<T, kHeadDim, kTerms, kArch>(params, stream);
  }
}

}  // namespace jax_flash::cuda

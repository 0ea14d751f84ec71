// The tensor-core forward of one (arch path, dtype, head-dim bucket): the
// mma.sync kernel (sm80/fwd.cuh) or the wgmma one (sm90/fwd.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/sm80/fwd.cuh"
#include "cuda/sm90/fwd.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunFwd(const FwdParams& params, cudaStream_t stream) {
  static_assert(kArch == 80 || kArch == 90, "arch paths: 80 (mma.sync), 90 (wgmma)");
  static_assert(kArch == 80 || !kTerms, "score terms: the sm80 kernels only");
  if constexpr (kArch == 90) {
    return sm90::LaunchFwd<T, kHeadDim>(params, stream);
  } else {
    return sm80::LaunchFwd<T, kHeadDim, kTerms>(params, stream);
  }
}

}  // namespace jax_flash::cuda

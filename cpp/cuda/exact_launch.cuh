// Entry points of the exact (SIMT, IEEE) kernels, one per storage type
// T in {float, double, __nv_bfloat16, __half}. Only dispatch.cu calls them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "jax_flash/params.h"

namespace jax_flash::cuda::exact {

// out and lse. Any head_dim in [1, 256]; bias, dense mask and dropout included.
template <typename T>
cudaError_t LaunchExactFwd(const FwdParams& params, cudaStream_t stream);

// dq, dk, dv, and dbias when params.score.bias and params.dbias are set (the
// bias's own shape, contiguous, accumulation type). params.delta must point to
// B * Hq * Sq accumulation-type elements of scratch (D = rowsum(dout * out) is
// written there first).
// Deterministic by construction (no atomics), whatever the caller asks.
template <typename T>
cudaError_t LaunchExactBwd(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda::exact

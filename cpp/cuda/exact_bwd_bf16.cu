// The exact bwd kernels for __nv_bfloat16 inputs (see exact_bwd.cuh).
#include "cuda/exact_bwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactBwd<__nv_bfloat16>(const BwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

// The exact bwd kernels for __half inputs (see exact_bwd.cuh).
#include "cuda/exact_bwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactBwd<__half>(const BwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

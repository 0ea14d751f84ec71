// The exact bwd kernels for float inputs (see exact_bwd.cuh).
#include "cuda/exact_bwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactBwd<float>(const BwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

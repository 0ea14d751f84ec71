// The exact fwd kernels for float inputs (see exact_fwd.cuh).
#include "cuda/exact_fwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactFwd<float>(const FwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

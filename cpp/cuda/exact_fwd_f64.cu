// The exact fwd kernels for double inputs (see exact_fwd.cuh).
#include "cuda/exact_fwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactFwd<double>(const FwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

// The exact fwd kernels for __nv_bfloat16 inputs (see exact_fwd.cuh).
#include "cuda/exact_fwd.cuh"

namespace jax_flash::cuda::exact {
template cudaError_t LaunchExactFwd<__nv_bfloat16>(const FwdParams&, cudaStream_t);
}  // namespace jax_flash::cuda::exact

// The kernel entry points the dispatch (cuda/dispatch.cu) calls, declared
// once. Each is explicitly instantiated in a file of its own, generated from
// jax_flash/_supported.py, which holds nothing but one of the macros below
// (template arguments only): a 2-core machine compiles them in parallel and a
// change to one kernel rebuilds only its own files.
//
// Everything here is stream-ordered and command-buffer compatible: no
// cudaMalloc, no synchronisation, no host reads of device data.
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Tensor-core kernels (T = __nv_bfloat16 or __half) of one arch path (80:
// mma.sync, sm_80 and later; 90: wgmma and TMA, sm_90a) and head-dim bucket
// (a smaller head_dim is zero-padded inside the kernel). kTerms: the kernels
// that take the per-element score terms (bias, dense mask, dropout) and the
// tile map (common/score.cuh's HasScoreTerms), for the arch paths of
// _supported.py's CUDA_TERMS_ARCHS; the others run problems without them. Defined in
// cuda/fwd.cuh and cuda/bwd/run.cuh.
//
// RunFwd writes params.out and params.lse; `workspace`: FwdWorkspaceBytes()
// bytes (cuda/launch.h), the Hopper persistent forward's tile counter.
template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunFwd(const FwdParams& params, void* workspace, cudaStream_t stream);

// RunBwd writes dq, dk, dv (and params.delta = rowsum(dout * out));
// `workspace`: Lse2AndDqAccumBytes<kHeadDim>(...) bytes (bwd/workspace.h:
// the tile counter, lse2 and the dQ accumulator),
// 256-byte aligned. deterministic = true: bitwise reproducible (dQ by a pass
// parallel over query blocks, no atomics).
template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunBwd(const BwdParams& params, void* workspace, bool deterministic,
                   cudaStream_t stream);

// Exact (SIMT, IEEE) kernels of one storage type T in {float, double,
// __nv_bfloat16, __half}, every head_dim in [1, 256] (compiled per head-dim
// tier), bias, dense mask and dropout included. Defined in simt/fwd.cuh and
// simt/bwd.cuh.
//
// RunExactFwd writes out and lse.
template <typename T>
cudaError_t RunExactFwd(const FwdParams& params, cudaStream_t stream);

// RunExactBwd writes dq, dk, dv, and dbias when params.score.bias and
// params.dbias are set (the bias's own shape, contiguous, accumulation type).
// params.delta must point to B * Hq * Sq accumulation-type elements of
// scratch (D = rowsum(dout * out) is written there first). Deterministic by
// construction (no atomics), whatever the caller asks.
template <typename T>
cudaError_t RunExactBwd(const BwdParams& params, cudaStream_t stream);

// RunExactJvp writes out_dot and lse_dot (forward mode; simt/jvp.cuh).
template <typename T>
cudaError_t RunExactJvp(const JvpParams& params, cudaStream_t stream);

// RunJvp: the forward-mode derivative on mma.sync (arch path 80, T =
// __nv_bfloat16 or __half; arch path 75, the Turing family, __half), for the
// options of the mma.sync forward; kTerms as for RunFwd (a dense mask,
// dropout, the tile map). A bias takes RunExactJvp. Defined in sm80/jvp.cuh.
template <int kArch, typename T, int kHeadDim, bool kTerms>
cudaError_t RunJvp(const JvpParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda

// The explicit instantiations, one per generated file.
#define JAX_FLASH_INSTANTIATE_FWD(kArch, T, kHeadDim, kTerms)                \
  template cudaError_t jax_flash::cuda::RunFwd<kArch, T, kHeadDim, kTerms>(  \
      const jax_flash::FwdParams&, void*, cudaStream_t);
#define JAX_FLASH_INSTANTIATE_BWD(kArch, T, kHeadDim, kTerms)                \
  template cudaError_t jax_flash::cuda::RunBwd<kArch, T, kHeadDim, kTerms>(  \
      const jax_flash::BwdParams&, void*, bool, cudaStream_t);
#define JAX_FLASH_INSTANTIATE_EXACT_FWD(T) \
  template cudaError_t jax_flash::cuda::RunExactFwd<T>(const jax_flash::FwdParams&, cudaStream_t);
#define JAX_FLASH_INSTANTIATE_EXACT_BWD(T) \
  template cudaError_t jax_flash::cuda::RunExactBwd<T>(const jax_flash::BwdParams&, cudaStream_t);
#define JAX_FLASH_INSTANTIATE_EXACT_JVP(T) \
  template cudaError_t jax_flash::cuda::RunExactJvp<T>(const jax_flash::JvpParams&, cudaStream_t);
#define JAX_FLASH_INSTANTIATE_JVP(kArch, T, kHeadDim, kTerms)                \
  template cudaError_t jax_flash::cuda::RunJvp<kArch, T, kHeadDim, kTerms>(  \
      const jax_flash::JvpParams&, cudaStream_t);

// Tensor-core FlashAttention-2 kernels for bfloat16 / float16 (sm_80+, also
// run on Hopper through mma.sync).
//
// Element types are the CUDA ones: T = __nv_bfloat16 or __half. Head dims are
// compiled per bucket (kHeadDim in 32, 64, 96, 128, 192, 256); a smaller
// actual head_dim is zero-padded inside the kernel.
//
// Everything here is stream-ordered and command-buffer compatible: no
// cudaMalloc, no synchronisation, no host reads of device data. Workspace
// memory comes from the caller (cuda/launch.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "jax_flash/params.h"

namespace jax_flash::cuda::tc {

// True if the tensor-core kernels handle a problem of this shape and dtype:
// bf16/fp16, head_dim <= 256 and a multiple of 8 (16-byte vector loads).
bool Supports(const AttentionShape& shape, bool is_bf16_or_fp16);

// The shape test plus what the 16-byte loads need of the buffers: every row
// and head stride a multiple of 8 elements and every pointer 16-byte aligned;
// and no bias, dropout or dense mask (not implemented here yet).
// The dispatch should ask these; when false, use the SIMT kernels.
bool Supports(const FwdParams& params, bool is_bf16_or_fp16);
bool Supports(const BwdParams& params, bool is_bf16_or_fp16);

// The smallest compiled bucket that holds head_dim, or 0 if none does.
int HeadDimBucket(int64_t head_dim);

// Per (dtype, bucket) entry points; one explicit instantiation per .cu file.
template <typename T, int kHeadDim>
cudaError_t RunFwd(const FwdParams& params, cudaStream_t stream);

// The Hopper forward (flash_fwd_sm90.cuh) of the buckets in
// CUDA_SM90_FWD_BUCKETS; LaunchFwd takes it on sm_90 devices when the build
// has sm_90a code (JAX_FLASH_HAS_SM90A).
template <typename T, int kHeadDim>
cudaError_t RunFwdSm90(const FwdParams& params, cudaStream_t stream);

// Workspace bytes RunBwd needs: lse in log2 units per row (B * Hq * Sq
// floats), plus a float32 dQ accumulator (B * Hq * Sq * bucket floats) when
// !deterministic. The caller passes at least this many bytes, 256-byte
// aligned, to RunBwd.
template <typename T, int kHeadDim>
size_t BwdWorkspaceBytes(const AttentionShape& shape, bool deterministic);

// Writes dq, dk, dv (and params.delta = rowsum(dout * out)).
// deterministic = true: bitwise reproducible (dQ computed by a separate pass
// parallel over query blocks, no atomics).
// kSm90 = true: the Hopper dK/dV kernel (flash_bwd_sm90.cuh; fast mode only,
// buckets in CUDA_SM90_BWD_BUCKETS).
template <typename T, int kHeadDim, bool kSm90 = false>
cudaError_t RunBwd(const BwdParams& params, void* workspace, bool deterministic,
                   cudaStream_t stream);

// Dispatch over dtype and head-dim bucket: what the FFI handlers call.
// bf16 = true for bfloat16, false for float16. Return cudaErrorNotSupported
// when !Supports(params, true).
cudaError_t LaunchFwd(const FwdParams& params, bool bf16, cudaStream_t stream);
size_t BwdWorkspace(const AttentionShape& shape, bool bf16, bool deterministic);
cudaError_t LaunchBwd(const BwdParams& params, bool bf16, void* workspace,
                      bool deterministic, cudaStream_t stream);

}  // namespace jax_flash::cuda::tc

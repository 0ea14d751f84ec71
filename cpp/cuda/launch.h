// What the CUDA FFI handlers call: dtype + params in, kernels launched on a
// stream out. Free of XLA types, so kernels and tests can use it directly.
//
// Everything here is stream-ordered and command-buffer compatible: no
// cudaMalloc, no synchronisation, no host reads of device data. Workspace
// memory comes from the caller (in the handler, an extra result of the FFI
// call, sized by FwdWorkspaceBytes or BwdWorkspaceBytes when the call is
// lowered).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Storage dtype of q, k, v, out (and the gradients). Accumulation (and lse,
// delta) is float64 for kFloat64, float32 otherwise.
enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// Alignment the kernels assume of the workspace pointer (16-byte vector
// accesses); XLA's buffers are aligned to more.
inline constexpr size_t kWorkspaceAlignment = 16;

// Bytes of device workspace LaunchFwd needs (the persistent forward's tile
// counter), for any problem: a constant, never 0.
size_t FwdWorkspaceBytes();

// Writes params.out and params.lse. `workspace` holds FwdWorkspaceBytes()
// bytes aligned to kWorkspaceAlignment (the Hopper persistent forward's tile
// counter, passed down to sm90::LaunchFwdWs).
cudaError_t LaunchFwd(const FwdParams& params, DType dtype, void* workspace, cudaStream_t stream);

// Forward mode: writes params.out_dot and params.lse_dot from the forward's
// out and lse and the tangents (null = zero). Needs no workspace.
cudaError_t LaunchJvp(const JvpParams& params, DType dtype, cudaStream_t stream);

// Bytes of device workspace LaunchBwd needs for any problem of this shape
// (delta = rowsum(dout * out), plus what the tensor-core kernels need when
// the shape allows them); never 0, so callers always pass a real pointer.
// A function of the shape alone, so that the workspace can be sized before
// any buffer exists (at lowering, from Python).
size_t BwdWorkspaceBytes(const AttentionShape& shape, DType dtype, bool deterministic);

// Writes params.dq, dk, dv. `workspace` holds BwdWorkspaceBytes(...) bytes
// aligned to kWorkspaceAlignment; params.delta is ignored (set from it).
// deterministic = true asks for bitwise-reproducible gradients; the exact
// kernels are deterministic either way.
cudaError_t LaunchBwd(const BwdParams& params, DType dtype, void* workspace, bool deterministic,
                      cudaStream_t stream);

}  // namespace jax_flash::cuda

// Chooses the kernel family for a problem and launches it.
//
// Two families: the tensor-core kernels (cpp/cuda/tc, bf16/fp16 only, head-dim
// buckets) and the exact SIMT kernels (cpp/cuda/exact_*, every dtype and
// head_dim, IEEE arithmetic). UseTensorCores() below is the single place that
// routes between them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/exact_launch.cuh"
#include "cuda/launch.h"
#include "cuda/tc/tc_api.h"

namespace jax_flash::cuda {
namespace {

size_t AccBytes(DType dtype) { return dtype == DType::kFloat64 ? sizeof(double) : sizeof(float); }

size_t RoundUp(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Parts of the workspace start at multiples of this from its base.
constexpr size_t kPartAlignment = 256;

// Bytes of the delta = rowsum(dout * out) buffer, (B, Hq, Sq) accumulation type.
size_t DeltaBytes(const AttentionShape& s, DType dtype) {
  return RoundUp(static_cast<size_t>(s.batch * s.num_heads_q * s.seqlen_q) * AccBytes(dtype),
                 kPartAlignment);
}

// ===========================================================================
// THE ROUTING DECISION: tensor cores or exact kernels.
//
// bf16/fp16 problems the tensor-core kernels support (tc::Supports: head dim
// a multiple of 8 up to 256, aligned buffers, no bias/dropout/dense mask yet)
// take them; everything else, and float32/float64 always (no TF32:
// check_grads relies on exact arithmetic), takes the exact kernels.
bool IsTensorCoreDType(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

template <typename Params>
bool UseTensorCores(const Params& params, DType dtype) {
  return IsTensorCoreDType(dtype) && tc::Supports(params, true);
}
// ===========================================================================

template <typename Fn>
cudaError_t ByDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat64: return fn(double{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchFwd(const FwdParams& params, DType dtype, cudaStream_t stream) {
  if (UseTensorCores(params, dtype)) {
    return tc::LaunchFwd(params, dtype == DType::kBFloat16, stream);
  }
  return ByDType(dtype, [&](auto tag) {
    return exact::LaunchExactFwd<decltype(tag)>(params, stream);
  });
}

size_t BwdWorkspaceBytes(const AttentionShape& shape, DType dtype, bool deterministic) {
  size_t bytes = DeltaBytes(shape, dtype);
  // Enough for the tensor-core kernels whenever the shape alone allows them;
  // the buffers decide at launch (UseTensorCores), and the exact kernels
  // need only delta.
  if (IsTensorCoreDType(dtype) && tc::Supports(shape, true)) {
    bytes += RoundUp(tc::BwdWorkspace(shape, dtype == DType::kBFloat16, deterministic),
                     kPartAlignment);
  }
  return bytes > 0 ? bytes : kPartAlignment;
}

cudaError_t LaunchBwd(const BwdParams& params, DType dtype, void* workspace, bool deterministic,
                      cudaStream_t stream) {
  BwdParams p = params;
  // The workspace starts with delta; the rest (if any) belongs to the kernel.
  p.delta = workspace;
  if (UseTensorCores(p, dtype)) {
    void* rest = static_cast<char*>(workspace) + DeltaBytes(p.shape, dtype);
    return tc::LaunchBwd(p, dtype == DType::kBFloat16, rest, deterministic, stream);
  }
  (void)deterministic;  // the exact backward is deterministic by construction
  return ByDType(dtype, [&](auto tag) { return exact::LaunchExactBwd<decltype(tag)>(p, stream); });
}

}  // namespace jax_flash::cuda

// CUDA FFI handlers: the ops of ops.h (decoded and validated as on every
// platform), launched on XLA's stream.
//
// Command-buffer compatible: no synchronisation, no cudaMalloc (the forward's
// and the backward's workspaces are extra results of the calls, which XLA
// allocates and keeps for the life of a recorded graph), no host reads of device data
// (sequence lengths, segment ids, the dense mask, the bias and the dropout
// keys stay on the device and are read by the kernels).
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "cuda/launch.h"
#include "ffi/handlers.h"
#include "ffi/ops.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

// decode.h has already rejected every other dtype.
cuda::DType ToCudaDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return cuda::DType::kFloat64;
    case ffi::DataType::BF16: return cuda::DType::kBFloat16;
    case ffi::DataType::F16: return cuda::DType::kFloat16;
    default: return cuda::DType::kFloat32;
  }
}

// Launches made while XLA was recording the stream into a CUDA graph (its
// command buffers trace compatible custom calls); the tests read them through
// cuda_captured_calls() to see that both handlers do get recorded.
std::atomic<int64_t> captured_fwd{0}, captured_bwd{0};

void CountIfCapturing(cudaStream_t stream, std::atomic<int64_t>& counter) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusActive)
    ++counter;
}

ffi::Error LaunchError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_flash: launching the CUDA ") + what +
                              " failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

// A workspace result as the lowering sized it (`sizer`, its Python name):
// uint8, rank 1, at least `needed` bytes, aligned for the kernels.
ffi::Error CheckWorkspace(ffi::Result<ffi::AnyBuffer>& workspace, size_t needed, const char* op,
                          const char* sizer, void** base) {
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->size_bytes() < needed)
    return ffi::Error::InvalidArgument(std::string("jax_flash: the ") + op +
                                       " workspace must be uint8 with at least " +
                                       std::to_string(needed) +
                                       " bytes (jax_flash.primitives sizes it with " + sizer + ")");
  *base = workspace->untyped_data();
  if (reinterpret_cast<uintptr_t>(*base) % cuda::kWorkspaceAlignment != 0)
    return ffi::Error::InvalidArgument(std::string("jax_flash: the ") + op +
                                       " workspace is misaligned");
  return ffi::Error::Success();
}

// The CUDA platform of ops.h: XLA's stream as context.
struct Cuda {
  using ContextBinding = ffi::PlatformStream<cudaStream_t>;
  using Context = cudaStream_t;
  // Every CUDA kernel reads a bias in the 16-bit inputs' dtype as it is
  // (ScoreParams::bias_type): half the bytes, and no conversion pass.
  static constexpr bool kReads16BitBias = true;
  static constexpr const char* kName = "CUDA";

  // The forward's and backward's results after the contract's (ops.h's
  // ExtraResults).
  struct FwdExtra {
    JAX_FLASH_CUDA_FWD_EXTRA_RESULTS(JAX_FLASH_FFI_RESULT_FIELD)
  };
  struct BwdExtra {
    JAX_FLASH_CUDA_BWD_EXTRA_RESULTS(JAX_FLASH_FFI_RESULT_FIELD)
  };

  static ffi::Error Fwd(cudaStream_t stream, const FwdParams& p, ffi::DataType dtype,
                        FwdExtra& extra) {
    void* workspace = nullptr;
    if (ffi::Error error = CheckWorkspace(extra.workspace, cuda::FwdWorkspaceBytes(), "forward",
                                          "cuda_fwd_workspace_bytes", &workspace);
        error.failure())
      return error;
    CountIfCapturing(stream, captured_fwd);
    if (cudaError_t err = cuda::LaunchFwd(p, ToCudaDType(dtype), workspace, stream);
        err != cudaSuccess)
      return LaunchError("forward", err);
    return ffi::Error::Success();
  }

  static ffi::Error Bwd(cudaStream_t stream, BwdParams& p, ffi::DataType input_type,
                        bool deterministic, BwdExtra& extra) {
    const cuda::DType dtype = ToCudaDType(input_type);
    void* base = nullptr;
    if (ffi::Error error =
            CheckWorkspace(extra.workspace, cuda::BwdWorkspaceBytes(p.shape, dtype, deterministic),
                           "backward", "cuda_bwd_workspace_bytes", &base);
        error.failure())
      return error;
    CountIfCapturing(stream, captured_bwd);
    if (cudaError_t err = cuda::LaunchBwd(p, dtype, base, deterministic, stream);
        err != cudaSuccess)
      return LaunchError("backward", err);
    return ffi::Error::Success();
  }

  static ffi::Error Jvp(cudaStream_t stream, const JvpParams& p, ffi::DataType dtype,
                        ffi_ops::NoExtraResults&) {
    if (cudaError_t err = cuda::LaunchJvp(p, ToCudaDType(dtype), stream); err != cudaSuccess)
      return LaunchError("forward-mode derivative", err);
    return ffi::Error::Success();
  }
};

}  // namespace

template <>
struct ffi_ops::ExtraResults<Cuda, ffi_ops::FwdOp> {
  using type = Cuda::FwdExtra;
  static constexpr size_t kCount = 0 JAX_FLASH_CUDA_FWD_EXTRA_RESULTS(JAX_FLASH_FFI_COUNT);
};
template <>
struct ffi_ops::ExtraResults<Cuda, ffi_ops::BwdOp> {
  using type = Cuda::BwdExtra;
  static constexpr size_t kCount = 0 JAX_FLASH_CUDA_BWD_EXTRA_RESULTS(JAX_FLASH_FFI_COUNT);
};

using CudaFwd = ffi_ops::Handler<ffi_ops::FwdOp, Cuda>;
using CudaBwd = ffi_ops::Handler<ffi_ops::BwdOp, Cuda>;
using CudaJvp = ffi_ops::Handler<ffi_ops::JvpOp, Cuda>;

CapturedCalls CudaCapturedCalls() { return {captured_fwd.load(), captured_bwd.load()}; }

size_t CudaFwdWorkspaceBytes() { return cuda::FwdWorkspaceBytes(); }

size_t CudaBwdWorkspaceBytes(const AttentionShape& shape, std::string_view dtype,
                             bool deterministic) {
  cuda::DType t;
  if (dtype == "float32") t = cuda::DType::kFloat32;
  else if (dtype == "float64") t = cuda::DType::kFloat64;
  else if (dtype == "bfloat16") t = cuda::DType::kBFloat16;
  else if (dtype == "float16") t = cuda::DType::kFloat16;
  else return 0;
  return cuda::BwdWorkspaceBytes(shape, t, deterministic);
}

}  // namespace jax_flash

// No scratch, no host work beyond launches: XLA may record each into a CUDA
// graph (command buffer). Operands, results and attributes: contract.h.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCuda, jax_flash::CudaFwd::Impl(),
                              jax_flash::CudaFwd::Binding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCuda, jax_flash::CudaBwd::Impl(),
                              jax_flash::CudaBwd::Binding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashJvpCuda, jax_flash::CudaJvp::Impl(),
                              jax_flash::CudaJvp::Binding(),
                              {ffi::Traits::kCmdBufferCompatible});

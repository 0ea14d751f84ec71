// CUDA FFI handlers: decode (shared with the CPU handlers, cpp/ffi/decode.h),
// then launch on XLA's stream.
//
// Command-buffer compatible: no synchronisation, no cudaMalloc (scratch comes
// from XLA's ScratchAllocator), no host reads of device data (sequence
// lengths, segment ids, the dense mask, the bias and the dropout keys stay on
// the device and are read by the kernels).
#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "cuda/launch.h"
#include "ffi/decode.h"
#include "ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

using ffi_decode::ScoreAndMaskAttrs;

// decode.h has already rejected every other dtype.
cuda::DType ToCudaDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return cuda::DType::kFloat64;
    case ffi::DataType::BF16: return cuda::DType::kBFloat16;
    case ffi::DataType::F16: return cuda::DType::kFloat16;
    default: return cuda::DType::kFloat32;
  }
}

ffi::Error LaunchError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_flash: launching the CUDA ") + what +
                              " failed: " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   double scale, double softcap, bool is_causal, int64_t window_left,
                   int64_t window_right, double dropout_rate, bool broadcast_dropout) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key};
  FwdParams p;
  if (auto e = ffi_decode::DecodeFwd(attrs, q, k, v, ops, out->dimensions(),
                                     out->element_type(), lse->dimensions(),
                                     lse->element_type(), &p);
      e.failure())
    return e;
  p.out = out->untyped_data();
  p.lse = lse->untyped_data();
  if (cudaError_t err = cuda::LaunchFwd(p, ToCudaDType(q.element_type()), stream);
      err != cudaSuccess)
    return LaunchError("forward", err);
  return ffi::Error::Success();
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                   ffi::AnyBuffer dout, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                   double scale, double softcap, bool is_causal, int64_t window_left,
                   int64_t window_right, double dropout_rate, bool broadcast_dropout,
                   bool deterministic) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key};
  BwdParams p;
  if (auto e = ffi_decode::DecodeBwd(attrs, q, k, v, out, lse, dout, ops, dq, dk, dv, dbias, &p);
      e.failure())
    return e;

  const cuda::DType dtype = ToCudaDType(q.element_type());
  const size_t workspace_bytes = cuda::BwdWorkspaceBytes(p, dtype, deterministic);
  std::optional<void*> workspace = scratch.Allocate(workspace_bytes, cuda::kWorkspaceAlignment);
  if (!workspace.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_flash: could not allocate " + std::to_string(workspace_bytes) +
                          " bytes of backward scratch");
  if (cudaError_t err = cuda::LaunchBwd(p, dtype, *workspace, deterministic, stream);
      err != cudaSuccess)
    return LaunchError("backward", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash

// Operand order is the contract in cpp/ffi/decode.h, identical to the CPU
// handlers (cpu_handlers.cc); only the context differs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdCuda, jax_flash::FwdCuda,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(
            ffi::Ffi::Bind()
                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                .Arg<ffi::AnyBuffer>()   // q (B, Sq, Hq, D)
                .Arg<ffi::AnyBuffer>()   // k (B, Sk, Hkv, D)
                .Arg<ffi::AnyBuffer>())  // v (B, Sk, Hkv, D)
            .Ret<ffi::AnyBuffer>()   // out (B, Sq, Hq, D)
            .Ret<ffi::AnyBuffer>()),   // lse (B, Hq, Sq), accumulation type
    // No scratch, no host work beyond launches: XLA may record it into a
    // CUDA graph (command buffer).
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwdCuda, jax_flash::BwdCuda,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(
            ffi::Ffi::Bind()
                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                .Ctx<ffi::ScratchAllocator>()  // delta = rowsum(dout * out), kernel scratch
                .Arg<ffi::AnyBuffer>()   // q
                .Arg<ffi::AnyBuffer>()   // k
                .Arg<ffi::AnyBuffer>()   // v
                .Arg<ffi::AnyBuffer>()   // out (forward result)
                .Arg<ffi::AnyBuffer>()   // lse (forward result)
                .Arg<ffi::AnyBuffer>())  // dout
            .Ret<ffi::AnyBuffer>()   // dq
            .Ret<ffi::AnyBuffer>()   // dk
            .Ret<ffi::AnyBuffer>()   // dv
            .Ret<ffi::AnyBuffer>())  // dbias: bias's shape, or (0,)
        .Attr<bool>("deterministic"));  // bitwise-reproducible gradients
// The backward is not declared command-buffer compatible: its delta buffer
// comes from the ScratchAllocator, whose memory is returned to XLA's
// allocator when the handler returns, and a recorded graph would keep using
// that address on every replay. (Passing delta as an extra result would lift
// this.)

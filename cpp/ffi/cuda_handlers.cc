// CUDA FFI handlers: decode (shared with the CPU handlers, cpp/ffi/decode.h),
// then launch on XLA's stream.
//
// Command-buffer compatible: no synchronisation, no cudaMalloc (the
// backward's workspace is an extra result of the call, which XLA allocates and
// keeps for the life of a recorded graph), no host reads of device data
// (sequence lengths, segment ids, the dense mask, the bias and the dropout
// keys stay on the device and are read by the kernels).
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

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

ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                   ffi::AnyBuffer offsets,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   double scale, double softcap, bool is_causal, int64_t window_left,
                   int64_t window_right, double dropout_rate, bool broadcast_dropout) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key, offsets};
  FwdParams p;
  if (auto e = ffi_decode::DecodeFwd(attrs, q, k, v, ops, out->dimensions(),
                                     out->element_type(), lse->dimensions(),
                                     lse->element_type(), &p);
      e.failure())
    return e;
  p.out = out->untyped_data();
  p.lse = lse->untyped_data();
  CountIfCapturing(stream, captured_fwd);
  if (cudaError_t err = cuda::LaunchFwd(p, ToCudaDType(q.element_type()), stream);
      err != cudaSuccess)
    return LaunchError("forward", err);
  return ffi::Error::Success();
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                   ffi::AnyBuffer dout, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                   ffi::AnyBuffer offsets,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                   ffi::Result<ffi::AnyBuffer> workspace, double scale, double softcap, bool is_causal, int64_t window_left,
                   int64_t window_right, double dropout_rate, bool broadcast_dropout,
                   bool deterministic) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key, offsets};
  BwdParams p;
  if (auto e = ffi_decode::DecodeBwd(attrs, q, k, v, out, lse, dout, ops, dq, dk, dv, dbias, &p);
      e.failure())
    return e;

  const cuda::DType dtype = ToCudaDType(q.element_type());
  const size_t needed = cuda::BwdWorkspaceBytes(p.shape, dtype, deterministic);
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->size_bytes() < needed)
    return ffi::Error::InvalidArgument(
        "jax_flash: the backward workspace must be uint8 with at least " + std::to_string(needed) +
        " bytes (jax_flash.primitives sizes it with cuda_bwd_workspace_bytes)");
  void* base = workspace->untyped_data();
  if (reinterpret_cast<uintptr_t>(base) % cuda::kWorkspaceAlignment != 0)
    return ffi::Error::InvalidArgument("jax_flash: the backward workspace is misaligned");
  CountIfCapturing(stream, captured_bwd);
  if (cudaError_t err = cuda::LaunchBwd(p, dtype, base, deterministic, stream);
      err != cudaSuccess)
    return LaunchError("backward", err);
  return ffi::Error::Success();
}

// Forward mode: the tangents of out and lse (decode.h's JVP contract).
ffi::Error JvpCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer q_dot,
                   ffi::AnyBuffer k_dot, ffi::AnyBuffer v_dot, ffi::AnyBuffer bias_dot,
                   ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                   ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> out_dot,
                   ffi::Result<ffi::AnyBuffer> lse_dot, double scale, double softcap,
                   bool is_causal, int64_t window_left, int64_t window_right,
                   double dropout_rate, bool broadcast_dropout) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key, offsets};
  JvpParams p;
  if (auto e = ffi_decode::DecodeJvp(attrs, q, k, v, out, lse, ops, q_dot, k_dot, v_dot, bias_dot,
                                     out_dot, lse_dot, &p);
      e.failure())
    return e;
  if (cudaError_t err = cuda::LaunchJvp(p, ToCudaDType(q.element_type()), stream);
      err != cudaSuccess)
    return LaunchError("forward-mode derivative", err);
  return ffi::Error::Success();
}

}  // namespace

CapturedCalls CudaCapturedCalls() { return {captured_fwd.load(), captured_bwd.load()}; }

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
                .Arg<ffi::AnyBuffer>()   // q
                .Arg<ffi::AnyBuffer>()   // k
                .Arg<ffi::AnyBuffer>()   // v
                .Arg<ffi::AnyBuffer>()   // out (forward result)
                .Arg<ffi::AnyBuffer>()   // lse (forward result)
                .Arg<ffi::AnyBuffer>())  // dout
            .Ret<ffi::AnyBuffer>()   // dq
            .Ret<ffi::AnyBuffer>()   // dk
            .Ret<ffi::AnyBuffer>()   // dv
            .Ret<ffi::AnyBuffer>()   // dbias: bias's shape, or (0,)
            .Ret<ffi::AnyBuffer>())  // workspace: uint8 (CudaBwdWorkspaceBytes,)
        .Attr<bool>("deterministic"),   // bitwise-reproducible gradients
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashJvpCuda, jax_flash::JvpCuda,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(
            ffi::Ffi::Bind()
                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                .Arg<ffi::AnyBuffer>()   // q
                .Arg<ffi::AnyBuffer>()   // k
                .Arg<ffi::AnyBuffer>()   // v
                .Arg<ffi::AnyBuffer>()   // out (forward result)
                .Arg<ffi::AnyBuffer>()   // lse (forward result)
                .Arg<ffi::AnyBuffer>()   // q_dot, like q, or (0,)
                .Arg<ffi::AnyBuffer>()   // k_dot, like k, or (0,)
                .Arg<ffi::AnyBuffer>()   // v_dot, like v, or (0,)
                .Arg<ffi::AnyBuffer>())  // bias_dot, like bias, or (0,)
            .Ret<ffi::AnyBuffer>()     // out_dot, like out
            .Ret<ffi::AnyBuffer>()),   // lse_dot, like lse
    {ffi::Traits::kCmdBufferCompatible});

// CPU FFI handlers: decode (shared with CUDA), then run the CPU kernels on
// XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/kernels.h"
#include "ffi/decode.h"
#include "ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

using ffi_decode::ScoreAndMaskAttrs;

cpu::DType ToCpuDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return cpu::DType::kF64;
    case ffi::DataType::BF16: return cpu::DType::kBF16;
    case ffi::DataType::F16: return cpu::DType::kF16;
    default: return cpu::DType::kF32;
  }
}

// Shared state of one parallel loop. Helpers scheduled on the pool hold a
// reference, so a helper that starts after the loop has finished finds no
// work and touches only this state. The caller works too and waits only for
// items that were claimed, each of which is being run by a live thread: the
// loop cannot deadlock even if the pool never runs our helpers.
struct LoopState {
  explicit LoopState(int64_t n, std::function<void(int64_t)> f)
      : num_items(n), body(std::move(f)) {}
  const int64_t num_items;
  const std::function<void(int64_t)> body;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
      body(i);
      if (done.fetch_add(1) + 1 == num_items) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

cpu::ParallelFor PoolParallelFor(ffi::ThreadPool& pool) {
  return [&pool](int64_t n, const std::function<void(int64_t)>& body) {
    if (n <= 0) return;
    auto state = std::make_shared<LoopState>(n, body);
    const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Work(); });
    state->Work();
    std::unique_lock<std::mutex> lock(state->mu);
    state->all_done.wait(lock, [&] { return state->done.load() == n; });
  };
}

ffi::Error FwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias,
                  ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
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
  cpu::FlashFwd(p, ToCpuDType(q.element_type()), PoolParallelFor(pool));
  return ffi::Error::Success();
}

ffi::Error BwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                  ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias,
                  ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key,
                  ffi::AnyBuffer offsets,
                  ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                  ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                  double scale, double softcap, bool is_causal, int64_t window_left,
                  int64_t window_right, double dropout_rate, bool broadcast_dropout,
                  bool deterministic) {
  (void)deterministic;  // The CPU backward is always deterministic.
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key, offsets};
  BwdParams p;
  if (auto e = ffi_decode::DecodeBwd(attrs, q, k, v, out, lse, dout, ops, dq, dk, dv, dbias, &p);
      e.failure())
    return e;
  const AttentionShape& s = p.shape;
  const bool f64 = q.element_type() == ffi::DataType::F64;
  const size_t delta_elems = static_cast<size_t>(s.batch * s.num_heads_q * s.seqlen_q);
  std::vector<double> delta_f64(f64 ? delta_elems : 0);
  std::vector<float> delta_f32(f64 ? 0 : delta_elems);
  p.delta = f64 ? static_cast<void*>(delta_f64.data()) : static_cast<void*>(delta_f32.data());
  cpu::FlashBwd(p, ToCpuDType(q.element_type()), PoolParallelFor(pool));
  return ffi::Error::Success();
}

ffi::Error JvpCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer q_dot,
                  ffi::AnyBuffer k_dot, ffi::AnyBuffer v_dot, ffi::AnyBuffer bias_dot,
                  ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                  ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias,
                  ffi::AnyBuffer mask, ffi::AnyBuffer dropout_key, ffi::AnyBuffer offsets,
                  ffi::Result<ffi::AnyBuffer> out_dot, ffi::Result<ffi::AnyBuffer> lse_dot,
                  double scale, double softcap, bool is_causal, int64_t window_left,
                  int64_t window_right, double dropout_rate, bool broadcast_dropout) {
  const ScoreAndMaskAttrs attrs{scale,        softcap,      is_causal,        window_left,
                                window_right, dropout_rate, broadcast_dropout};
  const ffi_decode::MaskOperands ops{q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                                     bias,      mask,       dropout_key,   offsets};
  JvpParams p;
  if (auto e = ffi_decode::DecodeJvp(attrs, q, k, v, out, lse, ops, q_dot, k_dot, v_dot, bias_dot,
                                     out_dot, lse_dot, &p);
      e.failure())
    return e;
  cpu::FlashJvp(p, ToCpuDType(q.element_type()), PoolParallelFor(pool));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash

// Operand order is the contract in cpp/ffi/decode.h; CUDA binds the same.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdCpu, jax_flash::FwdCpu,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::AnyBuffer>()   // q (B, Sq, Hq, D)
                                                   .Arg<ffi::AnyBuffer>()   // k (B, Sk, Hkv, D)
                                                   .Arg<ffi::AnyBuffer>())  // v (B, Sk, Hkv, D)
            .Ret<ffi::AnyBuffer>()     // out (B, Sq, Hq, D)
            .Ret<ffi::AnyBuffer>()));  // lse (B, Hq, Sq), accumulation type

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwdCpu, jax_flash::BwdCpu,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashJvpCpu, jax_flash::JvpCpu,
    jax_flash::ffi_decode::AddScoreAndMaskAttrs(
        jax_flash::ffi_decode::AddMaskOperands(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
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
            .Ret<ffi::AnyBuffer>()));  // lse_dot, like lse

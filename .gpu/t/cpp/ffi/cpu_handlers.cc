// CPU FFI handlers: the ops of ops.h (decoded and validated as on every
// platform), run by the CPU kernels on XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/kernels.h"
#include "ffi/handlers.h"
#include "ffi/ops.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

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

// The CPU platform of ops.h: XLA's intra-op thread pool as context.
struct Cpu {
  using ContextBinding = ffi::ThreadPool;
  using Context = ffi::ThreadPool;

  // The CPU kernels read the bias in the accumulation type: jax_flash's CPU
  // lowering converts a 16-bit one before the call (jax_flash/primitives.py).
  static constexpr bool kReads16BitBias = false;
  static constexpr const char* kName = "CPU";

  static ffi::Error Fwd(ffi::ThreadPool pool, const FwdParams& p, ffi::DataType dtype,
                        ffi_ops::NoExtraResults&) {
    cpu::FlashFwd(p, ToCpuDType(dtype), PoolParallelFor(pool));
    return ffi::Error::Success();
  }

  // The CPU backward is always deterministic.
  static ffi::Error Bwd(ffi::ThreadPool pool, BwdParams& p, ffi::DataType dtype,
                        bool /*deterministic*/, ffi_ops::NoExtraResults&) {
    const AttentionShape& s = p.shape;
    const bool f64 = dtype == ffi::DataType::F64;
    const size_t delta_elems = static_cast<size_t>(s.batch * s.num_heads_q * s.seqlen_q);
    std::vector<double> delta_f64(f64 ? delta_elems : 0);
    std::vector<float> delta_f32(f64 ? 0 : delta_elems);
    p.delta = f64 ? static_cast<void*>(delta_f64.data()) : static_cast<void*>(delta_f32.data());
    cpu::FlashBwd(p, ToCpuDType(dtype), PoolParallelFor(pool));
    return ffi::Error::Success();
  }

  static ffi::Error Jvp(ffi::ThreadPool pool, const JvpParams& p, ffi::DataType dtype,
                        ffi_ops::NoExtraResults&) {
    cpu::FlashJvp(p, ToCpuDType(dtype), PoolParallelFor(pool));
    return ffi::Error::Success();
  }
};

using CpuFwd = ffi_ops::Handler<ffi_ops::FwdOp, Cpu>;
using CpuBwd = ffi_ops::Handler<ffi_ops::BwdOp, Cpu>;
using CpuJvp = ffi_ops::Handler<ffi_ops::JvpOp, Cpu>;

}  // namespace
}  // namespace jax_flash

// Operands, results and attributes: contract.h, bound by ops.h.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::CpuFwd::Impl(),
                              jax_flash::CpuFwd::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::CpuBwd::Impl(),
                              jax_flash::CpuBwd::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashJvpCpu, jax_flash::CpuJvp::Impl(),
                              jax_flash::CpuJvp::Binding());

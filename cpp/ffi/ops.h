// One handler per op, over every platform.
//
// An op (FwdOp, BwdOp, JvpOp) is its operands, results and attributes, from
// contract.h, and one body: decode and validate them (decode.h), then hand
// the params to the platform. A platform (cpu_handlers.cc, cuda_handlers.cc)
// is an XLA context and one launcher per op. Handler<Op, Platform> binds the
// two to XLA from the contract's lists, so the operand order and the
// attributes are written nowhere else.
//
// Platform::kReads16BitBias: whether its kernels read a bias in the 16-bit
// inputs' own dtype (decode.h takes one, contract.h); a platform whose
// kernels do not refuses it (its lowering converts it before the call).
#pragma once

#include <cstddef>
#include <string>
#include <tuple>
#include <utility>

#include "ffi/attrs.h"
#include "ffi/contract.h"
#include "ffi/decode.h"
#include "jax_flash/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_ops {

namespace ffi = xla::ffi;
using ffi_decode::MaskOperands;

// Struct fields and counts from the contract's lists (platforms use them too).
#define JAX_FLASH_FFI_BUFFER_FIELD(name, dtype, shape) ffi::AnyBuffer name;
#define JAX_FLASH_FFI_RESULT_FIELD(name, dtype, shape) ffi::Result<ffi::AnyBuffer> name;
#define JAX_FLASH_FFI_COUNT(name, dtype, shape) +1

template <typename Platform>
ffi::Error PlatformTakesBias(const ScoreParams& score) {
  if (score.bias == nullptr || score.bias_type == BiasType::kAcc || Platform::kReads16BitBias)
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jax_flash: the ") + Platform::kName + " kernels read the bias in float32, got " +
      (score.bias_type == BiasType::kBFloat16 ? "bfloat16" : "float16") +
      " (jax_flash's lowering converts it before the call: call the primitives, not the custom "
      "call)");
}

struct FwdOp {
  struct Operands { JAX_FLASH_FWD_OPERANDS(JAX_FLASH_FFI_BUFFER_FIELD) };
  struct Results { JAX_FLASH_FWD_RESULTS(JAX_FLASH_FFI_RESULT_FIELD) };
  using Attrs = ffi_decode::ScoreAttrs;
  static constexpr size_t kNumOperands = 0 JAX_FLASH_FWD_OPERANDS(JAX_FLASH_FFI_COUNT);
  static constexpr size_t kNumResults = 0 JAX_FLASH_FWD_RESULTS(JAX_FLASH_FFI_COUNT);

  template <typename Platform, typename Extra>
  static ffi::Error Run(typename Platform::Context ctx, const Operands& in,
                        const MaskOperands& mask, Results& r, const Attrs& attrs, Extra& extra) {
    FwdParams p;
    if (auto e = ffi_decode::DecodeFwd(attrs, in.q, in.k, in.v, mask, r.out->dimensions(),
                                       r.out->element_type(), r.lse->dimensions(),
                                       r.lse->element_type(), &p);
        e.failure())
      return e;
    p.out = r.out->untyped_data();
    p.lse = r.lse->untyped_data();
    if (auto e = PlatformTakesBias<Platform>(p.score); e.failure()) return e;
    return Platform::Fwd(ctx, p, in.q.element_type(), extra);
  }
};

struct BwdOp {
  struct Operands { JAX_FLASH_BWD_OPERANDS(JAX_FLASH_FFI_BUFFER_FIELD) };
  struct Results { JAX_FLASH_BWD_RESULTS(JAX_FLASH_FFI_RESULT_FIELD) };
  using Attrs = ffi_decode::BwdAttrs;
  static constexpr size_t kNumOperands = 0 JAX_FLASH_BWD_OPERANDS(JAX_FLASH_FFI_COUNT);
  static constexpr size_t kNumResults = 0 JAX_FLASH_BWD_RESULTS(JAX_FLASH_FFI_COUNT);

  template <typename Platform, typename Extra>
  static ffi::Error Run(typename Platform::Context ctx, const Operands& in,
                        const MaskOperands& mask, Results& r, const Attrs& attrs, Extra& extra) {
    BwdParams p;
    if (auto e = ffi_decode::DecodeBwd(attrs, in.q, in.k, in.v, in.out, in.lse, in.dout, mask,
                                       r.dq, r.dk, r.dv, r.dbias, &p);
        e.failure())
      return e;
    if (auto e = PlatformTakesBias<Platform>(p.score); e.failure()) return e;
    // The platform provides p.delta (scratch of B * Hq * Sq accumulation-type values).
    return Platform::Bwd(ctx, p, in.q.element_type(), attrs.deterministic, extra);
  }
};

struct JvpOp {
  struct Operands { JAX_FLASH_JVP_OPERANDS(JAX_FLASH_FFI_BUFFER_FIELD) };
  struct Results { JAX_FLASH_JVP_RESULTS(JAX_FLASH_FFI_RESULT_FIELD) };
  using Attrs = ffi_decode::ScoreAttrs;
  static constexpr size_t kNumOperands = 0 JAX_FLASH_JVP_OPERANDS(JAX_FLASH_FFI_COUNT);
  static constexpr size_t kNumResults = 0 JAX_FLASH_JVP_RESULTS(JAX_FLASH_FFI_COUNT);

  template <typename Platform, typename Extra>
  static ffi::Error Run(typename Platform::Context ctx, const Operands& in,
                        const MaskOperands& mask, Results& r, const Attrs& attrs, Extra& extra) {
    JvpParams p;
    if (auto e = ffi_decode::DecodeJvp(attrs, in.q, in.k, in.v, in.out, in.lse, mask, in.q_dot,
                                       in.k_dot, in.v_dot, in.bias_dot, r.out_dot, r.lse_dot, &p);
        e.failure())
      return e;
    if (auto e = PlatformTakesBias<Platform>(p.score); e.failure()) return e;
    return Platform::Jvp(ctx, p, in.q.element_type(), extra);
  }
};

// Results a platform adds to an op after the contract's (the CUDA forward's
// and backward's workspaces): none unless specialised.
struct NoExtraResults {};
template <typename Platform, typename Op>
struct ExtraResults {
  using type = NoExtraResults;
  static constexpr size_t kCount = 0;
};

inline constexpr size_t kNumMaskOperands = 0 JAX_FLASH_MASK_OPERANDS(JAX_FLASH_FFI_COUNT);

namespace internal {

// Append N AnyBuffer operands (results) to a binding, N >= 1. Bindings move
// only through their own methods, so every step returns what one made.
template <size_t N, typename Binding>
auto AddArgs(Binding&& binding) {
  if constexpr (N == 1) {
    return std::move(binding).template Arg<ffi::AnyBuffer>();
  } else {
    return AddArgs<N - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

template <size_t N, typename Binding>
auto AddRets(Binding&& binding) {
  if constexpr (N == 1) {
    return std::move(binding).template Ret<ffi::AnyBuffer>();
  } else {
    return AddRets<N - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  }
}

// The aggregate T of elements [kFirst, kFirst + sizeof...(I)) of a tuple.
template <typename T, size_t kFirst, typename Tuple, size_t... I>
T Take(Tuple& all, std::index_sequence<I...>) {
  return T{std::get<kFirst + I>(all)...};
}

}  // namespace internal

// Binds Op on Platform. Platform provides `ContextBinding` (what XLA passes
// as context, e.g. ffi::ThreadPool), `Context` (the type the handler gets)
// and Fwd/Bwd/Jvp launchers for the ops it registers.
template <typename Op, typename Platform>
struct Handler {
  using Extra = ExtraResults<Platform, Op>;
  static constexpr size_t kNumArgs = Op::kNumOperands + kNumMaskOperands;
  static constexpr size_t kNumRets = Op::kNumResults + Extra::kCount;

  // Context, operands (the op's, then the mask operands), results (the
  // contract's, then the platform's), the attributes as one struct.
  static auto Binding() {
    auto with_context = ffi::Ffi::Bind().template Ctx<typename Platform::ContextBinding>();
    return internal::AddRets<kNumRets>(internal::AddArgs<kNumArgs>(std::move(with_context)))
        .template Attrs<typename Op::Attrs>();
  }

  // What XLA calls, with the binding's values in its order.
  static auto Impl() {
    return [](typename Platform::Context ctx, auto... values) -> ffi::Error {
      static_assert(sizeof...(values) == kNumArgs + kNumRets + 1);
      auto all = std::forward_as_tuple(values...);
      const auto operands = internal::Take<typename Op::Operands, 0>(
          all, std::make_index_sequence<Op::kNumOperands>());
      const auto mask = internal::Take<MaskOperands, Op::kNumOperands>(
          all, std::make_index_sequence<kNumMaskOperands>());
      auto results = internal::Take<typename Op::Results, kNumArgs>(
          all, std::make_index_sequence<Op::kNumResults>());
      auto extra = internal::Take<typename Extra::type, kNumArgs + Op::kNumResults>(
          all, std::make_index_sequence<Extra::kCount>());
      return Op::template Run<Platform>(ctx, operands, mask, results,
                                        std::get<sizeof...(values) - 1>(all), extra);
    };
  }
};

}  // namespace jax_flash::ffi_ops

// CPU FlashAttention-2: the entry points the CPU handlers call.
//
// Kernels know nothing of XLA: they read FwdParams/BwdParams and split their
// work into independent items that a caller-provided ParallelFor runs (the
// handler backs it with XLA's CPU thread pool).
#pragma once

#include <cstdint>
#include <functional>

#include "jax_flash/params.h"

namespace jax_flash::cpu {

enum class DType { kF32, kF64, kBF16, kF16 };

// Runs body(i) for every i in [0, num_items), possibly concurrently, and
// returns when all have finished.
using ParallelFor =
    std::function<void(int64_t num_items, const std::function<void(int64_t)>& body)>;

// out and lse. Needs no scratch memory beyond a few tiles per thread.
void FlashFwd(const FwdParams& p, DType dtype, const ParallelFor& parallel_for);

// dq, dk, dv; p.delta must hold B * Hq * Sq accumulation-type elements.
// Deterministic: every output element is written by exactly one work item.
void FlashBwd(const BwdParams& p, DType dtype, const ParallelFor& parallel_for);

// out_dot and lse_dot (forward mode, see JvpParams); like the forward, no
// scratch beyond a few tiles per thread and the packed key-side tensors.
void FlashJvp(const JvpParams& p, DType dtype, const ParallelFor& parallel_for);

// Facts about how the kernels were compiled, for build_info().
const char* CompiledMarch();
int VectorBytes();

}  // namespace jax_flash::cpu

// The FFI handler symbols the Python module registers.
//
// Target names are the same on every platform (contract.h); Python registers
// each symbol under its platform. Operands, results and attributes: contract.h.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashJvpCpu);  // forward mode

#ifdef JAX_FLASH_WITH_CUDA
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "jax_flash/params.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashJvpCuda);

namespace jax_flash {
// Bytes of the CUDA forward's workspace result (its last result, uint8): the
// same for every problem.
size_t CudaFwdWorkspaceBytes();
// Bytes of the CUDA backward's workspace result (its last result, uint8) for
// a problem of this shape and dtype name ("float32", "bfloat16", ...; 0 for
// any other name). The lowering asks this, the handler checks it.
size_t CudaBwdWorkspaceBytes(const AttentionShape& shape, std::string_view dtype,
                             bool deterministic);

// Handler calls so far that ran while their stream was being recorded into a
// CUDA graph (diagnostics for the tests).
struct CapturedCalls {
  int64_t fwd, bwd;
};
CapturedCalls CudaCapturedCalls();
}  // namespace jax_flash
#endif

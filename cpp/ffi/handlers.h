// The FFI handler symbols the Python module registers.
//
// Target names are the same on every platform ("jax_flash_fwd",
// "jax_flash_bwd"); Python registers each symbol under its platform. The
// operand and attribute contract is documented in cpp/ffi/decode.h.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCpu);

#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCuda);
#endif

// Constants and integer helpers the CUDA kernels and their launchers share.
#pragma once

#include <cstdint>

#include "jax_flash/macros.h"

namespace jax_flash {

// float, as the kernels compute with them: exp(x) = exp2(x * kLog2e),
// ln(x) = log2(x) * kLn2.
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// ceil(a / b) for b > 0.
JAX_FLASH_HOST_DEVICE int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jax_flash

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

// Division of non-negative ints by a divisor fixed before a launch, as a
// multiply-high and a shift instead of the ~20 dependent instructions of a
// division by a run-time int (the persistent kernels decode a tile index
// with three of them, once per tile and warp). Granlund-Montgomery: with
// 2^(l - 1) < d <= 2^l, multiplier = ceil(2^(31 + l) / d) < 2^32 and
// n / d = (n * multiplier) >> (31 + l), exact for 0 <= n < 2^31 and
// 1 <= d < 2^31 (tests/test_fast_divisor.py).
struct FastDivisor {
  int32_t divisor = 1;
  uint32_t multiplier = 0;  // 0: divisor 1, n / 1 = n
  uint32_t shift = 0;       // l - 1

  // Host side, when the launch is set up; 1 <= d < 2^31.
  static FastDivisor Of(int32_t d) {
    FastDivisor f;
    f.divisor = d;
    if (d > 1) {
      uint32_t l = 1;
      while ((int64_t{1} << l) < d) ++l;
      f.multiplier = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) + d - 1) / d);
      f.shift = l - 1;
    }
    return f;
  }

  // n / divisor for 0 <= n < 2^31.
  JAX_FLASH_HOST_DEVICE int32_t Divide(int32_t n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(u, multiplier);
#else
    const uint32_t high = static_cast<uint32_t>((uint64_t{u} * multiplier) >> 32);
#endif
    return multiplier == 0 ? n : static_cast<int32_t>(high >> shift);
  }
};

}  // namespace jax_flash

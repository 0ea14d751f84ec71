// Storage types of the CPU kernels and their conversion to and from the
// accumulation type. bfloat16 and float16 are handled by bit manipulation so
// the kernels need no compiler support for 16-bit floats.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_flash::cpu {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Accumulation type: float64 inputs accumulate in float64, the rest in float32.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using Acc = typename AccOf<T>::type;

template <typename A> inline A ToAcc(float x) { return static_cast<A>(x); }
template <typename A> inline A ToAcc(double x) { return static_cast<A>(x); }
template <typename A> inline A ToAcc(bf16 x) { return BitsToFloat(uint32_t(x.bits) << 16); }
template <typename A> inline A ToAcc(f16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1f;
  const uint32_t mantissa = x.bits & 0x3ff;
  if (exponent == 0x1f)  // inf or nan
    return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0)  // normal: rebias 15 -> 127
    return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // zero or subnormal: exactly mantissa * 2^-24
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

template <typename T> inline T FromAcc(float x);
template <typename T> inline T FromAcc(double x);
template <> inline float FromAcc<float>(float x) { return x; }
template <> inline double FromAcc<double>(double x) { return x; }
template <> inline float FromAcc<float>(double x) { return static_cast<float>(x); }
template <> inline double FromAcc<double>(float x) { return x; }

// float -> bfloat16, round to nearest even (NaN stays NaN).
template <> inline bf16 FromAcc<bf16>(float x) {
  uint32_t u = FloatToBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

// float -> float16, round to nearest even, with subnormals and overflow to inf.
template <> inline f16 FromAcc<f16>(float x) {
  const uint32_t u = FloatToBits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{uint16_t(sign | 0x7e00)};   // nan
  if (abs >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00)};  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or 0
    // Scale so that the half subnormal step (2^-24) is 1, then round to even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;  // 2^24, exact
    return f16{uint16_t(sign | uint16_t(std::nearbyint(scaled)))};
  }
  // normal: drop 13 mantissa bits with round to nearest even, rebias 127 -> 15
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return f16{uint16_t(sign | ((rounded - (112u << 23)) >> 13))};
}

}  // namespace jax_flash::cpu

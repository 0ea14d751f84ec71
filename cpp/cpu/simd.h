// Portable SIMD for the CPU kernels: GCC/Clang vector types of the widest
// width the target has, plus the few math functions the kernels need.
//
// Vector types make the generated code explicit (one vector op per line, no
// reliance on the auto-vectoriser) while staying portable: the same source
// compiles to AVX-512, AVX2, SSE or NEON depending on -march.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace jax_flash::cpu {

#if defined(__AVX512F__)
inline constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
inline constexpr int kVectorBytes = 32;
#else
inline constexpr int kVectorBytes = 16;
#endif

template <typename A> struct VecTraits;
template <> struct VecTraits<float> {
  typedef float Vec __attribute__((vector_size(kVectorBytes)));
  typedef int32_t IVec __attribute__((vector_size(kVectorBytes)));
  using Bits = int32_t;
  static constexpr int kMantissaBits = 23;
  static constexpr int kExponentBias = 127;
  // Adding 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer.
  static constexpr float kRoundMagic = 12582912.0f;
  static constexpr float kMinExponent = -126.0f;
  static constexpr float kMaxExponent = 127.0f;
};
template <> struct VecTraits<double> {
  typedef double Vec __attribute__((vector_size(kVectorBytes)));
  typedef int64_t IVec __attribute__((vector_size(kVectorBytes)));
  using Bits = int64_t;
  static constexpr int kMantissaBits = 52;
  static constexpr int kExponentBias = 1023;
  static constexpr double kRoundMagic = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr double kMinExponent = -1022.0;
  static constexpr double kMaxExponent = 1023.0;
};

template <typename A> using Vec = typename VecTraits<A>::Vec;
template <typename A> inline constexpr int kLanes = kVectorBytes / sizeof(A);

template <typename A>
inline Vec<A> Load(const A* p) {
  Vec<A> v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

template <typename A>
inline void Store(A* p, Vec<A> v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename A>
inline Vec<A> Splat(A x) {
  // x - (+0) == x exactly (also for -0 and NaN), so this folds to a single
  // broadcast; x + 0 would not (-0 + 0 is +0).
  return x - Vec<A>{};
}

template <typename A>
inline Vec<A> Max(Vec<A> a, Vec<A> b) {
  return a > b ? a : b;
}

template <typename A>
inline A ReduceMax(Vec<A> v) {
  A r = v[0];
  for (int i = 1; i < kLanes<A>; ++i) r = v[i] > r ? v[i] : r;
  return r;
}

template <typename A>
inline A ReduceSum(Vec<A> v) {
  A r = 0;
  for (int i = 0; i < kLanes<A>; ++i) r += v[i];
  return r;
}

// 2^x, elementwise, to within a few ulp. Inputs below the smallest normal
// exponent (including -inf) give exactly 0, which is what masked logits need.
// Method: x = n + f with n integer and |f| <= 1/2; 2^f by its Taylor series
// (degree 7 for float, 12 for double: truncation below half an ulp), 2^n by
// writing n into the exponent bits.
template <typename A>
inline Vec<A> Exp2(Vec<A> x) {
  using T = VecTraits<A>;
  using IVec = typename T::IVec;
  const Vec<A> underflow = x < T::kMinExponent ? Splat<A>(1) : Splat<A>(0);
  x = x < T::kMinExponent ? Splat<A>(T::kMinExponent) : x;
  x = x > T::kMaxExponent ? Splat<A>(T::kMaxExponent) : x;
  const Vec<A> shifted = x + T::kRoundMagic;
  const Vec<A> n = shifted - T::kRoundMagic;
  const Vec<A> f = (x - n) * static_cast<A>(M_LN2);  // 2^f = e^(f ln 2)
  constexpr int kDegree = sizeof(A) == 4 ? 7 : 12;
  // Horner: sum_k f^k / k!
  Vec<A> p = Splat<A>(1);
  for (int k = kDegree; k >= 1; --k) p = p * f * (static_cast<A>(1) / k) + 1;
  const Vec<A> magic = Splat<A>(T::kRoundMagic);
  const IVec n_int = (IVec)shifted - (IVec)magic;
  const Vec<A> result = (Vec<A>)((IVec)p + (n_int << T::kMantissaBits));
  return underflow != 0 ? Splat<A>(0) : result;
}

// tanh for the logit soft cap, and its derivative sech^2 = 1 - tanh^2 for
// the backward: with e = e^(-2|x|) in [0, 1], tanh |x| = (1 - e) / (1 + e)
// and sech^2 = 4 e / (1 + e)^2. Computing sech^2 this way avoids the
// cancellation of 1 - tanh^2 where tanh is close to +-1, and e^(-2|x|)
// cannot overflow (with e^(2x), sech^2 was inf / inf = NaN from x ~ 44 in
// float32): where it underflows, tanh is +-1 and sech^2 0, both exact.
// Absolute error of tanh a few ulp of 1, which after the multiplication by
// the cap matches the rounding of the logit itself.
template <typename A>
inline Vec<A> Tanh(Vec<A> x, Vec<A>* sech2 = nullptr) {
  constexpr A kMinusTwoLog2e = static_cast<A>(-2.0 * M_LOG2E);
  const Vec<A> e = Exp2<A>((x < 0 ? -x : x) * kMinusTwoLog2e);
  const Vec<A> d = 1 + e;
  if (sech2 != nullptr) *sech2 = 4 * e / (d * d);
  const Vec<A> magnitude = (1 - e) / d;
  return x < 0 ? -magnitude : magnitude;
}

}  // namespace jax_flash::cpu

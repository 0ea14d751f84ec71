// WidenToFloat32 (launch.h): a 16-bit bias to the float32 copy the kernels
// read. Memory-bound and exact (every bfloat16 and float16 value is a float),
// one pass: 2 bytes read and 4 written per element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cuda/launch.h"

namespace jax_flash::cuda {
namespace {

constexpr int kThreads = 256;
// Four elements a step: one 8-byte load, one 16-byte store.
constexpr int kVector = 4;
// Enough blocks to fill any GPU; the rest is a grid-stride loop.
constexpr int64_t kMaxBlocks = 8192;

__device__ inline float2 ToFloat2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ inline float2 ToFloat2(__half2 x) { return __half22float2(x); }
__device__ inline float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float ToFloat(__half x) { return __half2float(x); }

// Two 16-bit values packed in 32 bits, as the pair type that converts them.
template <typename Pair>
__device__ inline Pair AsPair(uint32_t bits) {
  Pair pair;
  memcpy(&pair, &bits, sizeof(pair));
  return pair;
}

// Elements [0, kVector * vectors) in vectors (both pointers aligned for it),
// the rest one by one.
template <typename T, typename Pair>
__global__ void __launch_bounds__(kThreads)
    WidenKernel(const T* __restrict__ from, float* __restrict__ to, int64_t n, int64_t vectors) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const auto* from4 = reinterpret_cast<const uint2*>(from);
  auto* to4 = reinterpret_cast<float4*>(to);
  for (int64_t i = first; i < vectors; i += stride) {
    const uint2 bits = from4[i];
    const float2 lo = ToFloat2(AsPair<Pair>(bits.x)), hi = ToFloat2(AsPair<Pair>(bits.y));
    to4[i] = make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  for (int64_t i = kVector * vectors + first; i < n; i += stride) to[i] = ToFloat(from[i]);
}

template <typename T, typename Pair>
cudaError_t Widen(const void* from, float* to, int64_t n, cudaStream_t stream) {
  // XLA's buffers are aligned far beyond this; a direct caller's may not be.
  const bool aligned = reinterpret_cast<uintptr_t>(from) % sizeof(uint2) == 0 &&
                       reinterpret_cast<uintptr_t>(to) % sizeof(float4) == 0;
  const int64_t vectors = aligned ? n / kVector : 0;
  const int64_t steps = std::max<int64_t>(vectors, n - kVector * vectors);
  const int64_t blocks = std::min(kMaxBlocks, (steps + kThreads - 1) / kThreads);
  WidenKernel<T, Pair><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(from), to, n, vectors);
  return cudaGetLastError();
}

}  // namespace

cudaError_t WidenToFloat32(const void* from, DType from_type, float* to, int64_t n,
                           cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  switch (from_type) {
    case DType::kBFloat16: return Widen<__nv_bfloat16, __nv_bfloat162>(from, to, n, stream);
    case DType::kFloat16: return Widen<__half, __half2>(from, to, n, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash::cuda

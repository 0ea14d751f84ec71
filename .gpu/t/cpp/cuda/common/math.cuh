// Device math of the kernels: the special-function-unit forms the tensor-core
// kernels use, and the accurate library forms of the exact (SIMT) kernels.
// Constants (kLog2e, kLn2) and CeilDiv: jax_flash/math.h.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "jax_flash/math.h"

namespace jax_flash::cuda {

// ---- fast (tensor-core kernels) ----------------------------------------------

// exp2 on the special-function unit; ex2.approx(-inf) = +0, which is what
// masked scores rely on.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float FastTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- accurate (exact kernels) -------------------------------------------------

// The accurate library functions (expf is within 2 ulp; __expf is not used:
// it goes through exp2 of a rounded product and loses bits for large |x|).
__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }
__device__ __forceinline__ float Log(float x) { return logf(x); }
__device__ __forceinline__ double Log(double x) { return log(x); }
__device__ __forceinline__ float Tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double Tanh(double x) { return tanh(x); }
__device__ __forceinline__ float Max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double Max(double a, double b) { return fmax(a, b); }

template <typename Acc>
__device__ __forceinline__ Acc Infinity() {
  return static_cast<Acc>(INFINITY);
}

}  // namespace jax_flash::cuda

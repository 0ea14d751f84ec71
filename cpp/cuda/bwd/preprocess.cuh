// Backward preprocess: D = rowsum(dO * O) and lse in log2 units per query
// row, once, before the dK/dV and dQ kernels read them per step
// (LoadRowStats).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/fragment.cuh"
#include "jax_flash/math.h"

namespace jax_flash::cuda {

// lse in log2 units for P = exp2(x * scale_log2 - lse2). A row that sees no
// key has lse = -inf; +inf makes its P exactly 0 instead of exp2(+inf).
__device__ __forceinline__ float Lse2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// D = rowsum(dO * O), one warp per row, 16-byte loads; also lse in log2
// units, once per row instead of once per (row, key block) in the kernels.
template <typename T>
__global__ void __launch_bounds__(256) BwdPreprocessKernel(const __grid_constant__ BwdArgs args) {
  const BwdParams& p = args.p;
  const int64_t rows = p.shape.batch * p.shape.num_heads_q * p.shape.seqlen_q;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t i = r % p.shape.seqlen_q;
  const int64_t h = (r / p.shape.seqlen_q) % p.shape.num_heads_q;
  const int64_t b = r / (p.shape.seqlen_q * p.shape.num_heads_q);
  const T* o = static_cast<const T*>(p.out) + p.out_strides.offset(b, i, h);
  const T* d_o = static_cast<const T*>(p.dout) + p.dout_strides.offset(b, i, h);
  float sum = 0.f;
  for (int c = lane * kVecElems; c < p.shape.head_dim; c += 32 * kVecElems) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) sum += ToFloat(oe[e]) * ToFloat(de[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    static_cast<float*>(p.delta)[r] = sum;
    args.lse2[r] = Lse2(static_cast<const float*>(p.lse)[r]);
  }
}

// Launches the preprocess over the problem's `rows` (B * Hq * Sq) query rows,
// eight per block of 256 threads.
template <typename T>
cudaError_t LaunchPreprocess(const BwdArgs& args, int64_t rows, cudaStream_t stream) {
  BwdPreprocessKernel<T><<<static_cast<unsigned>(CeilDiv(rows, 8)), 256, 0, stream>>>(args);
  return cudaGetLastError();
}

// cp.async of one step's lse2 and D (kBlockM rows each, from row_base + m0)
// into a stage of sLse / sDelta; threads 0 .. 2 kBlockM - 1 take one each.
template <int kBlockM>
__device__ __forceinline__ void LoadRowStats(const BwdArgs& args, int64_t row_base, int64_t m0,
                                             int64_t seqlen_q, float* lse_stage,
                                             float* delta_stage, int tid) {
  if (tid < 2 * kBlockM) {
    const int r = tid % kBlockM;
    const bool valid = m0 + r < seqlen_q;
    const float* src = tid < kBlockM ? static_cast<const float*>(args.lse2)
                                     : static_cast<const float*>(args.p.delta);
    float* dst = (tid < kBlockM ? lse_stage : delta_stage) + r;
    CpAsync4(SmemAddr(dst), valid ? src + row_base + m0 + r : src, valid);
  }
}

// LoadRowStats through a register (Turing's register double buffering, as
// sm80/copy.cuh's StagedTile): Load where the cp.async would be issued,
// Store where it would be waited for.
template <int kBlockM>
struct StagedRowStats {
  float value;

  __device__ __forceinline__ void Load(const BwdArgs& args, int64_t row_base, int64_t m0,
                                       int64_t seqlen_q, int tid) {
    value = 0.f;
    // The element of LoadRowStats; volatile: issued here, not sunk towards
    // the store by the compiler.
    if (tid < 2 * kBlockM && m0 + tid % kBlockM < seqlen_q) {
      const float* src = tid < kBlockM ? static_cast<const float*>(args.lse2)
                                       : static_cast<const float*>(args.p.delta);
      asm volatile("ld.global.cg.f32 %0, [%1];\n"
                   : "=f"(value)
                   : "l"(src + row_base + m0 + tid % kBlockM));
    }
  }

  __device__ __forceinline__ void Store(float* lse_stage, float* delta_stage, int tid) const {
    if (tid < 2 * kBlockM) (tid < kBlockM ? lse_stage : delta_stage)[tid % kBlockM] = value;
  }
};

}  // namespace jax_flash::cuda

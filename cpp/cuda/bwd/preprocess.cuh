// Backward preprocess: D = rowsum(dO * O) and lse in log2 units per query
// row, once, before the dK/dV and dQ kernels read them per step
// (LoadRowStats).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/workspace.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/fragment.cuh"
#include "jax_flash/math.h"

namespace jax_flash::cuda {

// lse in log2 units for P = exp2(x * scale_log2 - lse2). A row that sees no
// key has lse = -inf; +inf makes its P exactly 0 instead of exp2(+inf).
__device__ __forceinline__ float Lse2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// Zeroes the float32 dQ accumulator's rows i0 .. i0 + kRows - 1 below
// seqlen_q, columns below head_dim, the block's threads on consecutive
// 16-byte pieces (DqAccumLayout::ZeroPiece), so that each warp's store covers
// whole 32-byte sectors; row by row, each store covered halves of 32 sectors.
template <int kHeadDim, int kRows>
__device__ __forceinline__ void ZeroDqAccumRows(float* dq_accum, int64_t bh, int64_t seqlen_q,
                                                int64_t i0, int head_dim) {
  using Layout = DqAccumLayout<kHeadDim>;
  for (int n = threadIdx.x; n < Layout::template kZeroPieces<kRows>; n += kRowVectorThreads) {
    const auto at = Layout::template ZeroPiece<kRows>(n);
    if (i0 + at.row < seqlen_q && at.col < head_dim)
      reinterpret_cast<float4*>(dq_accum + Layout::Index(bh, seqlen_q, i0 + at.row, at.col))
          [at.piece] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// D = rowsum(dO * O), RowVectorLanes lanes per row, 16-byte loads (at
// D = 64 a warp per row had 8 of its lanes loading: too few loads in flight
// to read at the memory's rate); also lse in log2 units, once per row
// instead of once per (row, key block) in the kernels, its load issued with
// O's and dO's (after the sum it was a second memory latency in every
// block's life); and with zero_dq_accum (the fast mode) the block's rows of
// the float32 dQ accumulator zeroed (ZeroDqAccumRows): the memset that did
// it was a launch and a pass over memory of its own. Grid (query blocks,
// q heads, batch): no index divisions.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kRowVectorThreads)
    BwdPreprocessKernel(const __grid_constant__ BwdArgs args, bool zero_dq_accum) {
  constexpr int kLanes = RowVectorLanes(kHeadDim);
  constexpr int kRows = RowVectorRows(kHeadDim);
  const BwdParams& p = args.p;
  const int64_t seqlen_q = p.shape.seqlen_q;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t i = i0 + threadIdx.x / kLanes;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = b * p.shape.num_heads_q + h;
  const int64_t r = bh * seqlen_q + i;
  const int lane = threadIdx.x % kLanes;
  // Rows past seqlen_q stay in the shuffles below (their lanes share warps
  // with valid rows) and store nothing.
  const bool valid = i < seqlen_q;
  const float lse = valid && lane == 0 ? static_cast<const float*>(p.lse)[r] : 0.f;
  float sum = 0.f;
  if (valid) {
    const T* o = static_cast<const T*>(p.out) + p.out_strides.offset(b, i, h);
    const T* d_o = static_cast<const T*>(p.dout) + p.dout_strides.offset(b, i, h);
    for (int c = lane * kVecElems; c < p.shape.head_dim; c += kLanes * kVecElems) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) sum += ToFloat(oe[e]) * ToFloat(de[e]);
    }
  }
  if (zero_dq_accum)
    ZeroDqAccumRows<kHeadDim, kRows>(args.dq_accum, bh, seqlen_q, i0, p.shape.head_dim);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (valid && lane == 0) {
    static_cast<float*>(p.delta)[r] = sum;
    args.lse2[r] = Lse2(lse);
  }
}

// Launches the preprocess over the chunk's query rows; zero_dq_accum: the
// fast mode's accumulator too.
template <typename T, int kHeadDim>
cudaError_t LaunchPreprocess(const BwdArgs& args, bool zero_dq_accum, cudaStream_t stream) {
  const AttentionShape& s = args.p.shape;
  const dim3 grid = RowVectorGrid(kHeadDim, s.seqlen_q, s.num_heads_q, s.batch);
  BwdPreprocessKernel<T, kHeadDim><<<grid, kRowVectorThreads, 0, stream>>>(args, zero_dq_accum);
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

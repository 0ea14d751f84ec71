// Backward postprocess of the fast mode: dQ from its float32 accumulator
// (bwd/workspace.h), times the softmax scale, in the output dtype.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/workspace.h"
#include "cuda/common/copy.cuh"
#include "cuda/common/fragment.cuh"
#include "jax_flash/math.h"

namespace jax_flash::cuda {

// dq = scale * dq_accum, eight elements (two float4 loads, one 16-byte
// store) per thread: head_dim is a multiple of 8 (cuda/dispatch.cu), so a group
// is all inside or all outside it. RowVectorLanes threads per row, a grid
// of (query blocks, q heads, batch): the index divisions of a flat grid
// (64-bit, per thread) once cost more than the memory (H100, D=128, two
// elements per thread: ~33 us per 16M elements against ~18 us for the bytes).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) DqConvertKernel(const __grid_constant__ BwdArgs args) {
  const BwdParams& p = args.p;
  constexpr int kLanes = RowVectorLanes(kHeadDim);  // threads per row, 8 columns each
  constexpr int kRows = 256 / kLanes;                // rows per block
  static_assert(kLanes * 8 >= kHeadDim, "one group of 8 columns per thread covers the row");
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kLanes;
  const int col = static_cast<int>(threadIdx.x % kLanes) * 8;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (i >= p.shape.seqlen_q || col >= p.shape.head_dim) return;
  const int64_t bh = b * p.shape.num_heads_q + h;
  const float4* acc = reinterpret_cast<const float4*>(
      args.dq_accum + DqAccumLayout<kHeadDim>::Index(bh, p.shape.seqlen_q, i, col));
  const float4 lo = acc[0], hi = acc[1];
  const float s = args.scale;
  const uint4 out = {Pack2<T>(lo.x * s, lo.y * s), Pack2<T>(lo.z * s, lo.w * s),
                     Pack2<T>(hi.x * s, hi.y * s), Pack2<T>(hi.z * s, hi.w * s)};
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + p.dq_strides.offset(b, i, h) + col) = out;
}

// Launches the conversion of the chunk's query rows.
template <typename T, int kHeadDim>
cudaError_t LaunchDqConvert(const BwdArgs& args, cudaStream_t stream) {
  constexpr int kRows = 256 / RowVectorLanes(kHeadDim);
  const AttentionShape& s = args.p.shape;
  const dim3 grid(static_cast<unsigned>(CeilDiv(s.seqlen_q, kRows)),
                  static_cast<unsigned>(s.num_heads_q), static_cast<unsigned>(s.batch));
  DqConvertKernel<T, kHeadDim><<<grid, 256, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda

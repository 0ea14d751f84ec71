// Backward postprocess of the fast mode: dQ from its float32 accumulator
// (bwd/workspace.h), times the softmax scale, in the output dtype.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/args.h"
#include "cuda/bwd/workspace.h"
#include "cuda/common/fragment.cuh"
#include "jax_flash/math.h"

namespace jax_flash::cuda {

// dq = scale * dq_accum, eight elements (two float4 loads, one 16-byte
// store) per thread: head_dim is a multiple of 8 (cuda/dispatch.cu), so a group
// is all inside or all outside it. Two elements per thread spent more time
// in the 64-bit index divisions than in memory (H100, D=128: ~33 us per 16M
// elements against ~18 us for the bytes).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) DqConvertKernel(const __grid_constant__ BwdArgs args) {
  const BwdParams& p = args.p;
  constexpr int kGroups = kHeadDim / 8;  // groups of 8 columns per row
  const int64_t groups = p.shape.batch * p.shape.num_heads_q * p.shape.seqlen_q * kGroups;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < groups;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(e % kGroups) * 8;
    if (col >= p.shape.head_dim) continue;
    const int64_t r = e / kGroups;
    const int64_t i = r % p.shape.seqlen_q;
    const int64_t bh = r / p.shape.seqlen_q;
    const int64_t h = bh % p.shape.num_heads_q;
    const int64_t b = bh / p.shape.num_heads_q;
    const float4* acc = reinterpret_cast<const float4*>(
        args.dq_accum + DqAccumLayout<kHeadDim>::Index(bh, p.shape.seqlen_q, i, col));
    const float4 lo = acc[0], hi = acc[1];
    const float s = args.scale;
    const uint4 out = {Pack2<T>(lo.x * s, lo.y * s), Pack2<T>(lo.z * s, lo.w * s),
                       Pack2<T>(hi.x * s, hi.y * s), Pack2<T>(hi.z * s, hi.w * s)};
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + p.dq_strides.offset(b, i, h) + col) = out;
  }
}

// Launches the conversion of `rows` (B * Hq * Sq) query rows: one thread per
// eight columns, a grid-stride loop past 2^19 blocks.
template <typename T, int kHeadDim>
cudaError_t LaunchDqConvert(const BwdArgs& args, int64_t rows, cudaStream_t stream) {
  const int64_t groups = rows * (kHeadDim / 8);
  const int64_t blocks = CeilDiv(groups, 256) < 65536 * 8 ? CeilDiv(groups, 256) : 65536 * 8;
  DqConvertKernel<T, kHeadDim><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda

// The backward's dK/dV epilogue, both tensor-core arch paths: a warp's dK
// (times d score / d q.k, the softmax scale) and dV for its 16 keys (rows g,
// g + 8 of the fragments, common/fragment.cuh), in the output dtype.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Keys key0 .. key0 + 15 of kv head h_kv, batch b; columns col0 + 8 dt + 2t
// (col0: the head-dim slice a pass of the sm80 kernel computed).
template <typename T, int kDTiles>
__device__ __forceinline__ void StoreDkDv(const BwdParams& p, int64_t b, int64_t h_kv,
                                          int64_t key0, int col0, const float (&dk)[kDTiles][4],
                                          const float (&dv)[kDTiles][4], float scale, int g,
                                          int t) {
  const int64_t seqlen_k = p.shape.seqlen_k;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  T* dk_out = static_cast<T*>(p.dk) + p.dk_strides.offset(b, 0, h_kv);
  T* dv_out = static_cast<T*>(p.dv) + p.dv_strides.offset(b, 0, h_kv);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t j = key0 + g + hr * 8;
    if (j < seqlen_k) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = col0 + dt * 8 + 2 * t;
        if (col < head_dim) {
          *reinterpret_cast<uint32_t*>(dk_out + j * p.dk_strides.row + col) =
              Pack2<T>(dk[dt][2 * hr] * scale, dk[dt][2 * hr + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv_out + j * p.dv_strides.row + col) =
              Pack2<T>(dv[dt][2 * hr], dv[dt][2 * hr + 1]);
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda

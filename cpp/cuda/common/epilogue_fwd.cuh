// The forward's epilogue, both tensor-core arch paths: out = O / l and
// lse = m + log(l) from a warp's O, m and l (common/fwd.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// A row's end: l summed over the row's four lanes, lse = m + log(l) written
// (by lane t == 0, for a row in [0, seqlen_q): tiles of the ws forward's
// causal kernels start before row 0). A row that sees no key has
// l == 0: its out is 0 and its lse -inf. A NaN logit makes l NaN, which
// reaches out and lse (jax.nn semantics). A row that sees nothing writes 0
// outright: its O may hold 0 x NaN from a NaN in a value row it cannot see.
struct RowEnd {
  bool sees_nothing;
  float inv_l;
};
__device__ __forceinline__ RowEnd FinishRow(float row_m, float row_l, float scale_log2, float* lse,
                                            int64_t i, int64_t seqlen_q, int t) {
  float l = row_l;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  const bool sees_nothing = l == 0.f;
  if (static_cast<uint64_t>(i) < static_cast<uint64_t>(seqlen_q) && t == 0)
    lse[i] = sees_nothing ? -INFINITY : (row_m * scale_log2 + __log2f(l)) * kLn2;
  return RowEnd{sees_nothing, 1.f / l};
}

// The lse row of (batch, head) (b, h): lse[i] is query i's.
__device__ __forceinline__ float* LseRow(const FwdParams& p, int64_t b, int64_t h) {
  return static_cast<float*>(p.lse) + (b * p.shape.num_heads_q + h) * p.shape.seqlen_q;
}

// out = O / l and lse = m + log(l) for the warp's rows from row0 on.
template <typename T, int kMT, int kDTiles>
__device__ __forceinline__ void StoreOutput(const FwdParams& p, int64_t b, int64_t h,
                                            int64_t row0, const float (&o)[kMT][kDTiles][4],
                                            const float (&row_m)[kMT][2],
                                            const float (&row_l)[kMT][2], float scale_log2, int g,
                                            int t) {
  const int64_t seqlen_q = p.shape.seqlen_q;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  T* out = static_cast<T*>(p.out) + p.out_strides.offset(b, 0, h);
  float* lse = LseRow(p, b, h);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t i = row0 + mt * 16 + g + hr * 8;
      const RowEnd end = FinishRow(row_m[mt][hr], row_l[mt][hr], scale_log2, lse, i, seqlen_q, t);
      if (static_cast<uint64_t>(i) < static_cast<uint64_t>(seqlen_q)) {
        T* out_row = out + i * p.out_strides.row;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(out_row + col) =
                end.sees_nothing ? 0u
                                 : Pack2<T>(o[mt][dt][2 * hr] * end.inv_l,
                                            o[mt][dt][2 * hr + 1] * end.inv_l);
          }
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda

// What the two tensor-core forwards share (sm80/fwd.cuh on mma.sync,
// sm90/fwd.cuh on wgmma): the launch constants, the block's view of its
// inputs, and the epilogue (O / l, lse).
//
// A warp owns kMT m-tiles of 16 query rows; o[mt][dt][0..3] are C fragments
// (common/fragment.cuh), which is also how a warp holds its part of a wgmma
// accumulator.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "cuda/common/views.cuh"
#include "jax_flash/mask.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Per-launch constants, computed once on the host.
struct FwdArgs {
  FwdParams p;
  float scale_log2;      // log2(e) * scale, or log2(e) when softcap is on (scale goes into tanh)
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap
};

inline FwdArgs MakeFwdArgs(const FwdParams& params) {
  FwdArgs args;
  args.p = params;
  const float scale = static_cast<float>(params.score.scale);
  args.softcap = static_cast<float>(params.score.softcap);
  if (args.softcap > 0.f) {
    args.scale_log2 = kLog2e;
    args.scale_over_cap = scale / args.softcap;
  } else {
    args.softcap = 0.f;
    args.scale_log2 = scale * kLog2e;
    args.scale_over_cap = 0.f;
  }
  return args;
}

// Launches a forward kernel over (query blocks of kBlockM rows, q heads,
// batch), the grid both forwards use (FwdBlock reads it back).
template <int kBlockM, typename Kernel>
cudaError_t LaunchFwdGrid(Kernel kernel, int threads, size_t smem_bytes, const FwdParams& params,
                          cudaStream_t stream) {
  const FwdArgs args = MakeFwdArgs(params);
  const int64_t m_blocks = CeilDiv(params.shape.seqlen_q, kBlockM);
  if (m_blocks == 0 || params.shape.num_heads_q == 0 || params.shape.batch == 0) return cudaSuccess;
  if (params.shape.num_heads_q > 65535 || params.shape.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(params.shape.num_heads_q),
                  static_cast<unsigned>(params.shape.batch));
  kernel<<<grid, threads, smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

// One CTA's problem: query rows [m0, m0 + kBlockM) of head h, batch b; its
// K/V rows; the key blocks [n_begin, n_end) that hold visible keys.
template <typename T>
struct FwdBlock {
  int64_t b, h, m0, n_begin, n_end;
  BatchMask mask;
  GmemRows<T> q, k, v;

  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ static FwdBlock Make(const FwdParams& p) {
    FwdBlock r;
    // Longest blocks first: with causal masking the last query blocks see the
    // most keys, so scheduling them first shortens the tail.
    const int64_t m_block = gridDim.x - 1 - blockIdx.x;
    r.h = blockIdx.y;
    r.b = blockIdx.z;
    const int64_t h_kv = r.h / p.shape.group_size();
    r.m0 = m_block * kBlockM;
    const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
    const int head_dim = static_cast<int>(p.shape.head_dim);
    r.mask = BatchMask::For(p.mask, r.b, seqlen_q, seqlen_k);
    r.q = GmemRows<T>::Head(p.q, p.q_strides, r.b, r.h, seqlen_q, head_dim);
    r.k = GmemRows<T>::Head(p.k, p.k_strides, r.b, h_kv, seqlen_k, head_dim);
    r.v = GmemRows<T>::Head(p.v, p.v_strides, r.b, h_kv, seqlen_k, head_dim);
    int64_t key_begin, key_end;
    r.mask.KeyRange(r.m0, r.m0 + kBlockM, &key_begin, &key_end);
    r.n_begin = key_begin / kBlockN;
    r.n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : r.n_begin;
    return r;
  }
};

// out = O / l and lse = m + log(l) for the warp's rows from row0 on.
template <typename T, int kMT, int kDTiles>
__device__ __forceinline__ void WriteOutput(const FwdParams& p, int64_t b, int64_t h,
                                            int64_t row0, const float (&o)[kMT][kDTiles][4],
                                            const float (&row_m)[kMT][2],
                                            const float (&row_l)[kMT][2], float scale_log2, int g,
                                            int t) {
  const int64_t seqlen_q = p.shape.seqlen_q;
  const int head_dim = static_cast<int>(p.shape.head_dim);
  T* out = static_cast<T*>(p.out) + p.out_strides.offset(b, 0, h);
  float* lse = static_cast<float*>(p.lse) + (b * p.shape.num_heads_q + h) * seqlen_q;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = row_l[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      // l == 0 only for rows that see no key: out = 0, lse = -inf. A NaN
      // logit makes l NaN, which reaches out and lse (jax.nn semantics).
      // Such a row writes 0 outright: its O may hold 0 x NaN from a NaN in
      // a value row it cannot see.
      const bool sees_nothing = l == 0.f;
      const float inv_l = 1.f / l;
      const int64_t i = row0 + mt * 16 + g + hr * 8;
      if (i < seqlen_q) {
        if (t == 0) {
          lse[i] = sees_nothing ? -INFINITY : (row_m[mt][hr] * scale_log2 + __log2f(l)) * kLn2;
        }
        T* out_row = out + i * p.out_strides.row;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < head_dim) {
            *reinterpret_cast<uint32_t*>(out_row + col) =
                sees_nothing ? 0u
                             : Pack2<T>(o[mt][dt][2 * hr] * inv_l, o[mt][dt][2 * hr + 1] * inv_l);
          }
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda

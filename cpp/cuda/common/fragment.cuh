// The register fragments of the tensor-core kernels and their conversions.
//
// Layouts (PTX ISA, mma.m16n8k16 with 16-bit inputs), g = lane / 4,
// t = lane % 4:
//   A 16x16 (row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8  (float):     c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
// A C fragment of two neighbouring n-tiles is therefore exactly the A
// fragment of one 16-wide k-step, which is why P and dS never leave
// registers between the two GEMMs that use them. A warp's part of a wgmma
// accumulator (sm90/wgmma.cuh) has the C layout too, so everything written
// against it (score policies, softmax, epilogues) serves both arch paths.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash::cuda {

// Four 8x8 16-bit matrices from shared memory into registers in the fragment
// layout (register i: matrix i, row lane / 4, columns 2 (lane % 4) and + 1;
// .trans: transposed); lanes 8i..8i+7 give the addresses of matrix i's rows.
// sm_75 and later: the mma.sync kernels' A and B loads, and the Hopper
// backward's K and V fragments (sm90/mainloop_bwd.cuh).
__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Which way a warp's score fragment runs: rows are queries and columns keys
// (S: the forwards and the deterministic dQ kernel), or rows are keys and
// columns queries (S^T: the dK/dV kernels, whose P^T and dS^T are then the A
// operands of dV += P^T dO and dK += dS^T Q).
enum class Rows { kQueries, kKeys };

inline constexpr int kMmaM = 16;  // mma.m16n8k16 tile
inline constexpr int kMmaN = 8;
inline constexpr int kMmaK = 16;

// A thread's place in its CTA, its warp and the fragments: g = lane / 4 (the
// row in an 8-row group), t = lane % 4 (the column pair). Computed once per
// kernel and handed to its mainloop and epilogue (computing the indices again
// in each changed the register allocation of the mma.sync forward). The warp
// index is lane 0's, broadcast: the compiler then knows it is the same in
// every lane, so what derives from it (a warpgroup's rows of K, its dQ
// part, the wgmma descriptors built from them) lives in uniform registers,
// computed once per warp on the uniform datapath, instead of per thread and
// copied over (R2UR) before every wgmma. Called where whole warps run.
struct ThreadPos {
  int tid, warp, lane, g, t;
  __device__ __forceinline__ static ThreadPos Here() {
    ThreadPos pos;
    pos.tid = threadIdx.x;
    pos.warp = __shfl_sync(0xffffffffu, pos.tid / 32, 0);
    pos.lane = pos.tid % 32;
    pos.g = pos.lane / 4;
    pos.t = pos.lane % 4;
    return pos;
  }
};

// Two floats -> one register of two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&h);
  }
  return r;
}

// The 16-bit A fragment (16 x 16) of one k-step from two 8-column tiles of
// float accumulators (the C layout): how a result (P, dS) becomes the A
// operand of the next MMA without going through shared memory.
template <typename T>
__device__ __forceinline__ void PackA(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = Pack2<T>(c0[0], c0[1]);
  a[1] = Pack2<T>(c0[2], c0[3]);
  a[2] = Pack2<T>(c1[0], c1[1]);
  a[3] = Pack2<T>(c1[2], c1[3]);
}

// PackA of elementwise products, x0 o y0 and x1 o y1: dS = P o (dP - D) as
// the A operand of the GEMM that takes it from registers.
template <typename T>
__device__ __forceinline__ void PackProductA(uint32_t (&a)[4], const float (&x0)[4],
                                             const float (&x1)[4], const float (&y0)[4],
                                             const float (&y1)[4]) {
  float c0[4], c1[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    c0[r] = x0[r] * y0[r];
    c1[r] = x1[r] * y1[r];
  }
  PackA<T>(a, c0, c1);
}

template <typename T>
__device__ __forceinline__ float ToFloat(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

}  // namespace jax_flash::cuda

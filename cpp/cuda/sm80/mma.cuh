// The sm_80 tensor-core instruction as inline PTX: mma.sync m16n8k16 with
// float accumulation (two m16n8k8 on sm_75; fragment layouts and ldmatrix:
// common/fragment.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/fragment.cuh"

namespace jax_flash::cuda::sm80 {

// c += a * b on one 16x8x16 tile, float accumulation.
//
// sm_75 (the Turing family) has m16n8k8 for float16 only: the 16x8x16 tile
// is two of them over k = 0..7 and 8..15. The fragments line up exactly:
// a[0], a[1] (rows g and g + 8, k = 2t, 2t + 1) and b0 are the first k-half's
// A and B fragments of m16n8k8, a[2], a[3] and b1 the second's.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  static_assert(std::is_same_v<T, __half>, "sm_75 tensor cores take float16 only");
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[2]), "r"(a[3]), "r"(b1));
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// The backward's two score products of a step, over the head dim: a warp's
// 16 rows of c1 = A1 B1^T and c2 = A2 B2^T (S^T and dP^T in the dK/dV
// kernel, S and dP in the dQ kernel), kCols columns each. A's k-step kk at
// a1 / a2 + 32 kk (ldmatrix addresses of the warp's fragments in shared
// memory); B's rows in shared memory at b1 / b2 + b_off, kStride elements
// apart (b_off: the stage and the lane's row).
template <typename T, int kHeadDim, int kCols, int kStride>
__device__ __forceinline__ void ScoreGemms(float (&c1)[kCols / kMmaN][4],
                                           float (&c2)[kCols / kMmaN][4], uint32_t a1, uint32_t a2,
                                           uint32_t b1, uint32_t b2, uint32_t b_off) {
#pragma unroll
  for (int nt = 0; nt < kCols / kMmaN; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) { c1[nt][r] = 0.f; c2[nt][r] = 0.f; }
#pragma unroll
  for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
    uint32_t x1[4], x2[4];
    Ldmatrix4(x1, a1 + 2 * kk * 16);
    Ldmatrix4(x2, a2 + 2 * kk * 16);
#pragma unroll
    for (int nt2 = 0; nt2 < kCols / 16; ++nt2) {
      uint32_t y1[4], y2[4];
      const uint32_t off = b_off + 2 * (nt2 * 16 * kStride + kk * 16);
      Ldmatrix4(y1, b1 + off);
      Ldmatrix4(y2, b2 + off);
      Mma<T>(c1[2 * nt2], x1, y1[0], y1[1]);
      Mma<T>(c1[2 * nt2 + 1], x1, y1[2], y1[3]);
      Mma<T>(c2[2 * nt2], x2, y2[0], y2[1]);
      Mma<T>(c2[2 * nt2 + 1], x2, y2[2], y2[3]);
    }
  }
}

}  // namespace jax_flash::cuda::sm80

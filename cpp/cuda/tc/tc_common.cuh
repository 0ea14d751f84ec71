// Device building blocks of the tensor-core kernels: the sm_80 instructions
// (cp.async, ldmatrix, mma.sync m16n8k16) as inline PTX, and tile copies.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with 16-bit inputs), g = lane / 4,
// t = lane % 4:
//   A 16x16 (row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8  (float):     c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
// A C fragment of two neighbouring n-tiles is therefore exactly the A
// fragment of one 16-wide k-step, which is why P and dS never leave
// registers between the two GEMMs that use them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jax_flash/params.h"

namespace jax_flash::cuda::tc {

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
inline constexpr float kLn2 = 0.6931471805599453f;    // ln(2): ln(x) = log2(x) * kLn2
inline constexpr int kMmaM = 16;                      // mma.m16n8k16 tile
inline constexpr int kMmaN = 8;
inline constexpr int kMmaK = 16;
inline constexpr int kVecElems = 8;                   // 16-byte vector of 16-bit elements
// Shared-memory rows are padded by one 16-byte vector: with a row of
// (D + 8) elements, 8 consecutive rows start in 8 different 16-byte bank
// groups (D / 8 is even for every bucket), so ldmatrix is conflict free.
inline constexpr int kSmemPad = kVecElems;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; with valid = false it
// writes zeros (src-size 0), which is how padding rows/columns become 0.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

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

// c += a * b on one 16x8x16 tile, float accumulation.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
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
}

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

template <typename T>
__device__ __forceinline__ float ToFloat(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

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

// A 2-D view of one (batch, head) slice of a (B, S, H, D) tensor: rows are
// sequence positions, columns the head dim.
template <typename T>
struct GmemRows {
  const T* base;   // element (row 0, col 0)
  int64_t stride;  // elements between rows
  int64_t rows;    // valid rows (sequence length)
  int cols;        // valid columns (actual head_dim)
};

// Issue cp.async for a kRows x kCols tile starting at row0 into shared memory
// with row stride kSmemStride elements; rows >= src.rows and columns >=
// src.cols are zero-filled. Spread over kThreads threads.
template <typename T, int kRows, int kCols, int kSmemStride, int kThreads>
__device__ __forceinline__ void LoadTile(T* smem, const GmemRows<T>& src, int64_t row0,
                                         int tid) {
  constexpr int kChunksPerRow = kCols / kVecElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int c = tid + it * kThreads;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * kVecElems;
    const int64_t row = row0 + r;
    const bool valid = row < src.rows && col < src.cols;
    const T* g = valid ? src.base + row * src.stride + col : src.base;
    CpAsync16(SmemAddr(smem + r * kSmemStride + col), g, valid);
  }
}

// params.h is host-only C++; these are its device-side equivalents.
__host__ __device__ __forceinline__ int64_t Offset(const SeqStrides& s, int64_t b, int64_t row,
                                                   int64_t h) {
  return b * s.batch + row * s.row + h * s.head;
}
__host__ __device__ __forceinline__ int64_t GroupSize(const AttentionShape& shape) {
  return shape.num_heads_q / shape.num_heads_kv;
}

// The band part of the mask (causal, window, lengths) for one row of a tile:
// columns [lo, hi) of the tile, relative to its first column col0, are
// visible. From mask.h's KeyRange (rows = queries, columns = keys) or
// QueryRange (rows = keys, columns = queries) of a single row, which are exact
// for one row; segments are then tested per element with Visible.
struct ColWindow {
  int lo, hi;
  __device__ __forceinline__ bool Contains(int col) const { return col >= lo && col < hi; }
};
__device__ __forceinline__ ColWindow ClampWindow(int64_t begin, int64_t end, int64_t col0,
                                                 int cols) {
  int64_t lo = begin - col0, hi = end - col0;
  lo = lo < 0 ? 0 : (lo > cols ? cols : lo);
  hi = hi < 0 ? 0 : (hi > cols ? cols : hi);
  return ColWindow{static_cast<int>(lo), static_cast<int>(hi)};
}
__device__ __forceinline__ ColWindow KeyWindow(const BatchMask& mask, int64_t i, int64_t key0,
                                               int cols) {
  int64_t begin, end;
  mask.KeyRange(i, i + 1, &begin, &end);
  return ClampWindow(begin, end, key0, cols);
}
__device__ __forceinline__ ColWindow QueryWindow(const BatchMask& mask, int64_t j, int64_t q0,
                                                 int cols) {
  int64_t begin, end;
  mask.QueryRange(j, j + 1, &begin, &end);
  return ClampWindow(begin, end, q0, cols);
}

// Sets the hidden (query, key) pairs of a warp's score tile to `hidden`
// (-inf before the softmax, 0 after exp2): kMT m-tiles of 16 query rows from
// row0 (rows g and g + 8 of each), kNTiles n-tiles of 8 keys from n0. Band
// (causal, window, lengths) via KeyWindow per row; segments per element.
template <int kMT, int kNTiles>
__device__ __forceinline__ void HideKeys(float (&s)[kMT][kNTiles][4], const BatchMask& mask,
                                         int64_t row0, int64_t n0, int g, int t, float hidden) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t i = row0 + mt * 16 + g + hr * 8;
      const ColWindow w = KeyWindow(mask, i, n0, kNTiles * 8);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int jr = nt * 8 + 2 * t + c;
          // Segments: only inside the band, the one per-element test.
          const bool visible =
              w.Contains(jr) && (mask.q_seg == nullptr || mask.Visible(i, n0 + jr));
          if (!visible) s[mt][nt][2 * hr + c] = hidden;
        }
    }
}

// Shared (and used by the host) helper: ceil(a / b) for positive b.
__host__ __device__ __forceinline__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jax_flash::cuda::tc

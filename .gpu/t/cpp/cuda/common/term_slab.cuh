// Score terms staged in shared memory, one slab per warp (the sm80
// forward's kTerms kernel): the float32 bias and the dense boolean mask of
// the rows a warp owns, for one key block, copied by the warp's own lanes with
// cp.async a key block ahead of their use.
//
// Why: read straight from global memory in the fragment layout, each element
// a load right before its use, the bias kept the warps waiting on L1TEX for
// 65% of their cycles (ncu, H100, bf16, D=128, S=4k: 8.2 ms against 0.92 ms
// for the plain forward); cuda/NOTES_score_terms.md.
//
// A warp reads only its own rows, so no CTA barrier guards the slabs: the
// warp waits for its own copies (cp.async.wait_group) and __syncwarp orders
// them, and its reads before the next copy, among its lanes.
//
// A term is staged when cp.async's 16-byte chunks can copy it: keys
// contiguous, rows and the (batch, head) offsets multiples of 16 bytes, the
// base 16-byte aligned. Any other layout (a key dimension broadcast, odd
// strides) keeps the direct loads (common/score.cuh's BiasView and
// MaskFragmentElementwise).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/copy.cuh"
#include "cuda/common/score.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

JAX_FLASH_HOST_DEVICE bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

JAX_FLASH_HOST_DEVICE bool StridesStageable(const DenseStrides& s, int64_t elems_per_16) {
  return s.col == 1 && s.row % elems_per_16 == 0 && s.batch % elems_per_16 == 0 &&
         s.head % elems_per_16 == 0;
}

// A float32 bias only: a 16-bit one is read per element (BiasView).
JAX_FLASH_HOST_DEVICE bool BiasStageable(const FwdParams& p) {
  return p.score.bias != nullptr && p.score.bias_type == BiasType::kAcc && Aligned16(p.score.bias) &&
         StridesStageable(p.score.bias_strides, 4);
}

JAX_FLASH_HOST_DEVICE bool MaskStageable(const FwdParams& p) {
  return p.mask.dense != nullptr && Aligned16(p.mask.dense) &&
         StridesStageable(p.mask.dense_strides, 16);
}

// kRows x kCols elements of kElemBytes (4: the bias, 1: the mask) at
// `slab` (a shared address), rows kRowBytes apart. The padding makes the
// fragment reads conflict-free: a float2 (8-byte) read is served per half
// warp, whose lanes g = 0..3 then start 8 banks apart; a 2-byte mask read by
// the whole warp, rows 20 (kCols 64) or 12 (kCols 32) banks apart, the 8
// rows' 2-bank pairs all distinct.
template <int kRows, int kCols, int kElemBytes>
struct WarpSlab {
  static constexpr int kPadBytes = kElemBytes == 4 ? 32 : 16;
  static constexpr int kRowBytes = kCols * kElemBytes + kPadBytes;
  static constexpr int kBytes = kRows * kRowBytes;
  static constexpr int kChunkElems = 16 / kElemBytes;
  static constexpr int kChunksPerRow = kCols / kChunkElems;
  static_assert(kCols % kChunkElems == 0, "key blocks are whole 16-byte chunks");

  // Rows [row0, row0 + kRows) x columns [col0, col0 + kCols) of the head
  // view `base` (row stride in elements), zero past `rows` and `cols`: the
  // warp's part of one key block. Every lane commits no group; the caller does.
  __device__ __forceinline__ static void Load(uint32_t slab, const void* base, int64_t row_stride,
                                              int64_t row0, int64_t rows, int64_t col0,
                                              int64_t cols, int lane) {
    constexpr int kChunks = kRows * kChunksPerRow;
    const char* head = static_cast<const char*>(base);
#pragma unroll
    for (int it = 0; it < (kChunks + 31) / 32; ++it) {
      const int c = it * 32 + lane;
      if (kChunks % 32 != 0 && c >= kChunks) break;
      const int r = c / kChunksPerRow, k = c % kChunksPerRow;
      const int64_t i = row0 + r, j = col0 + k * kChunkElems;
      int64_t valid = i < rows ? cols - j : 0;
      valid = valid < 0 ? 0 : (valid > kChunkElems ? kChunkElems : valid);
      const char* src = valid > 0 ? head + (i * row_stride + j) * kElemBytes : head;
      CpAsync16Bytes(slab + r * kRowBytes + k * 16, src, static_cast<int>(valid) * kElemBytes);
    }
  }
};

// x = scale * s + bias on a warp's fragments (queries x keys), the bias read
// from the warp's slab (rows: the warp's; columns: this key block's).
template <int kRowBytes, int kMT, int kNTiles>
__device__ __forceinline__ void AddStagedBias(float (&s)[kMT][kNTiles][4],
                                              const unsigned char* slab, float scale, int g,
                                              int t) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float* row = reinterpret_cast<const float*>(slab + (mt * 16 + g + hr * 8) * kRowBytes);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const float2 b = *reinterpret_cast<const float2*>(row + nt * 8 + 2 * t);
        s[mt][nt][2 * hr] = fmaf(s[mt][nt][2 * hr], scale, b.x);
        s[mt][nt][2 * hr + 1] = fmaf(s[mt][nt][2 * hr + 1], scale, b.y);
      }
    }
}

// MaskFragmentElementwise (queries x keys) with the dense mask read from the
// warp's slab: the band through each row's window, segments per element,
// then the mask's byte.
template <int kRowBytes, int kMT, int kNTiles>
__device__ __forceinline__ void MaskFragmentStaged(float (&s)[kMT][kNTiles][4],
                                                   const BatchMask& mask,
                                                   const unsigned char* slab,
                                                   int64_t row0, int64_t col0, int g, int t,
                                                   float hidden) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t r = row0 + mt * 16 + g + hr * 8;
      const ColWindow w = KeyWindow(mask, r, col0, kNTiles * 8);
      const int32_t row_seg = mask.q_seg != nullptr && w.lo < w.hi ? mask.q_seg[r] : 0;
      const unsigned char* row = slab + (mt * 16 + g + hr * 8) * kRowBytes;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const uint16_t pair = *reinterpret_cast<const uint16_t*>(row + nt * 8 + 2 * t);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int cr = nt * 8 + 2 * t + c;
          const bool visible = w.Contains(cr) && ((pair >> (8 * c)) & 0xff) != 0 &&
                               (mask.q_seg == nullptr || mask.kv_seg[col0 + cr] == row_seg);
          if (!visible) s[mt][nt][2 * hr + c] = hidden;
        }
      }
    }
}

}  // namespace jax_flash::cuda

// Hopper (sm_90a) warpgroup MMA as inline PTX: wgmma.mma_async m64nNk16 with
// float accumulators, shared-memory descriptors for 128-byte-swizzled tiles,
// and the fences around them. Compiled only where __CUDA_ARCH_FEAT_SM90_ALL
// is defined (the sm_90a target); see sm90/fwd.cuh.
//
// Accumulator layout: a warpgroup's 64 x N result is split by warp (warp w of
// the group holds rows 16w..16w+15), and within a warp it is exactly the
// mma.sync C layout repeated over n-tiles of 8 columns: d[nt][0..1] at (g,
// 8nt + 2t..2t+1), d[nt][2..3] at (g + 8, same columns), g = lane / 4, t =
// lane % 4. The register A operand (P in the forward) has the mma.sync A
// layout per warp. So the softmax code of the sm_80 kernels applies as is.
//
// Shared tiles: rows of 64 16-bit elements (128 bytes) in 8-row atoms whose
// 16-byte chunks are XOR-swizzled by the row (chunk c of row r at c ^ (r % 8));
// a tile with more than 64 columns is stored as column blocks of 64, one
// after the other. Every tile starts at a multiple of 1024 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sm90/wgmma_shapes.cuh"

namespace jax_flash::cuda::sm90 {

inline constexpr int kSwizzleBytes = 128;          // one row of a swizzle atom
inline constexpr int kSwizzleElems = 64;           // 16-bit elements per atom row
inline constexpr int kAtomBytes = 8 * kSwizzleBytes;  // 8 rows: the swizzle period

// Columns of a swizzled tile holding `cols` columns: whole 64-column blocks
// (a head dim of 96 leaves half of its second block unused; TMA fills it
// with zeros).
inline constexpr int SwizzledCols(int cols) {
  return (cols + kSwizzleElems - 1) / kSwizzleElems * kSwizzleElems;
}

// Byte offset of the 16-byte chunk `chunk` (column chunk * 8) of row `row` in
// a swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk, int rows) {
  const int block = chunk / 8, c = chunk % 8;
  return block * rows * kSwizzleBytes + row * kSwizzleBytes + ((c ^ (row % 8)) << 4);
}

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor format"):
// start address, leading and stride byte offsets (all >> 4), 128-byte swizzle.
//   K-major operand (Q, K: the reduction dim is contiguous): stride = 1024
//   between 8-row groups; the leading offset is unused.
//   MN-major operand (V in P V: the output dim is contiguous): leading = the
//   distance between 64-column blocks, stride = 1024 between 8-row groups
//   along the reduction dim.
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t addr, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // layout type: 128-byte swizzle
  return desc;
}

// The descriptor of the same tile `offset_bytes` (a multiple of 16) further
// on. The start address is the low field, in 16-byte units, and shared
// addresses stay below 2^18, so this is one add that never carries into the
// other fields. Building each k-step's descriptor from its address instead
// costs a chain of dependent integer ops per wgmma, which in the backward
// left the tensor cores waiting (ncu; D=128 +7% with this).
__device__ __forceinline__ uint64_t DescriptorPlus(uint64_t desc, uint32_t offset_bytes) {
  return desc + (offset_bytes >> 4);
}

// Orders this warpgroup's register writes (accumulators, A fragments) before
// the wgmma instructions that follow.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) must
// be fenced before the async proxy (wgmma) reads it.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Bulk asynchronous reduction (the TMA unit): global[dst..dst+bytes) +=
// shared[src..) as float32, 16-byte aligned, bytes a multiple of 16; tracked
// by bulk groups of the issuing thread.
__device__ __forceinline__ void BulkReduceAddF32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void BulkCommit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's bulk groups but kPending have read their source.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until this thread's bulk groups but kPending are complete.
template <int kPending>
__device__ __forceinline__ void BulkWait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// x, hidden from the compiler's loop-invariant code motion: what is computed
// from it inside a loop is recomputed there instead of being kept live (and
// spilled) across the loop.
__device__ __forceinline__ uint32_t Opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Stores four 8x8 16-bit matrices from registers in the mma fragment layout
// (register i: matrix i, row lane / 4, columns 2 (lane % 4) and + 1); lanes
// 8i..8i+7 give the shared addresses of matrix i's rows (16 bytes each).
__device__ __forceinline__ void StMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                           uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same with each matrix transposed: element (row r, column c) of
// matrix i (its fragment as above) goes to 16-bit position r of the 16 bytes
// that lane 8i + c addresses.
__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Keeps the compiler from moving accesses to accumulator registers across
// the asynchronous MMAs that own them.
template <int kRows>
__device__ __forceinline__ void FenceRegisters(float (&d)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[i][r])::"memory");
}

// d (64 x N, this thread's part) = A B + (scale_d ? d : 0), one k-step of 16,
// into the n-tiles [kOff, kOff + N / 8) of d (sm90/wgmma_shapes.cuh).
// WgmmaSS: A and B from shared-memory descriptors. WgmmaRS: A from registers.
// kTransB = 1 for an MN-major B, kTransA = 1 for an M-major A (SS only).
// Without kN, the wgmma covers all of d.
template <typename T, int kTransB, int kTransA = 0, int kN = 0, int kOff = 0, int kTiles>
__device__ __forceinline__ void WgmmaSS(float (&d)[kTiles][4], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  WgmmaSSN<T, kN == 0 ? kTiles * 8 : kN, kTransB, kTransA, kOff>(d, desc_a, desc_b, scale_d);
}
template <typename T, int kTransB, int kN = 0, int kOff = 0, int kTiles>
__device__ __forceinline__ void WgmmaRS(float (&d)[kTiles][4], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
  WgmmaRSN<T, kN == 0 ? kTiles * 8 : kN, kTransB, kOff>(d, a, desc_b, scale_d);
}

// d += A B for one k-step with B MN-major over kCols columns stored as
// 64-column blocks `block_bytes` apart (desc_b: the first block, leading
// offset block_bytes). One wgmma when kCols is a multiple of 64; otherwise one
// per column block, N = 64 or what is left (a head dim of 96: 64 + 32), since
// the canonical MN-major layout of a wgmma covers whole 64-column blocks.
template <typename T, int kCols, int kCol0 = 0, int kTiles>
__device__ __forceinline__ void WgmmaRSColumns(float (&d)[kTiles][4], const uint32_t (&a)[4],
                                               uint64_t desc_b, uint32_t block_bytes,
                                               int scale_d) {
  static_assert(kCols == kTiles * 8, "one accumulator n-tile per 8 columns");
  if constexpr (kCols % 64 == 0) {
    WgmmaRS<T, 1>(d, a, desc_b, scale_d);
  } else {
    constexpr int kN = kCols - kCol0 < 64 ? kCols - kCol0 : 64;
    WgmmaRS<T, 1, kN, kCol0 / 8>(d, a, DescriptorPlus(desc_b, (kCol0 / 64) * block_bytes),
                                 scale_d);
    if constexpr (kCol0 + 64 < kCols)
      WgmmaRSColumns<T, kCols, kCol0 + 64>(d, a, desc_b, block_bytes, scale_d);
  }
}

// The same with A from shared memory (kTransA = 1: M-major).
template <typename T, int kCols, int kTransA = 0, int kCol0 = 0, int kTiles>
__device__ __forceinline__ void WgmmaSSColumns(float (&d)[kTiles][4], uint64_t desc_a,
                                               uint64_t desc_b, uint32_t block_bytes,
                                               int scale_d) {
  static_assert(kCols == kTiles * 8, "one accumulator n-tile per 8 columns");
  if constexpr (kCols % 64 == 0) {
    WgmmaSS<T, 1, kTransA>(d, desc_a, desc_b, scale_d);
  } else {
    constexpr int kN = kCols - kCol0 < 64 ? kCols - kCol0 : 64;
    WgmmaSS<T, 1, kTransA, kN, kCol0 / 8>(
        d, desc_a, DescriptorPlus(desc_b, (kCol0 / 64) * block_bytes), scale_d);
    if constexpr (kCol0 + 64 < kCols)
      WgmmaSSColumns<T, kCols, kTransA, kCol0 + 64>(d, desc_a, desc_b, block_bytes, scale_d);
  }
}

// Where k-step kk (columns 16kk..16kk+15) of a K-major swizzled tile of
// kRows rows starts, in bytes from the tile: its columns in 64-column blocks,
// column block kk / 4, 32 bytes per step inside the block's 128-byte rows. A
// k-step's descriptor is the tile's plus this (DescriptorPlus): one add,
// rather than the address masked, shifted and merged again per wgmma.
template <int kRows>
__device__ __forceinline__ constexpr uint32_t KMajorOffset(int kk) {
  return (kk / 4) * kRows * kSwizzleBytes + (kk % 4) * 32;
}

// d = A B^T summed over kCols columns (one commit group's worth of wgmmas,
// not committed): A = rows a.. (64 of them) of a swizzled tile of kARows
// rows, B = a swizzled tile of kBRows rows, both K-major (S = Q K^T in the
// forward, S^T = K Q^T and dP^T = V dO^T in the backward).
template <typename T, int kCols, int kARows, int kBRows, int kN>
__device__ __forceinline__ void GemmKMajor(float (&d)[kN][4], uint32_t a, uint32_t b) {
  const uint64_t desc_a = SmemDescriptor(a, 0, kAtomBytes);
  const uint64_t desc_b = SmemDescriptor(b, 0, kAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk)
    WgmmaSS<T, 0>(d, DescriptorPlus(desc_a, KMajorOffset<kARows>(kk)),
                  DescriptorPlus(desc_b, KMajorOffset<kBRows>(kk)), kk > 0);
}

}  // namespace jax_flash::cuda::sm90

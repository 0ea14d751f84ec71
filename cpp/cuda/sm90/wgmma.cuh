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

namespace jax_flash::cuda::sm90 {

inline constexpr int kSwizzleBytes = 128;          // one row of a swizzle atom
inline constexpr int kSwizzleElems = 64;           // 16-bit elements per atom row
inline constexpr int kAtomBytes = 8 * kSwizzleBytes;  // 8 rows: the swizzle period

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

// Stores four 8x8 16-bit matrices from registers in the mma fragment layout
// (register i: matrix i, row lane / 4, columns 2 (lane % 4) and + 1); lanes
// 8i..8i+7 give the shared addresses of matrix i's rows (16 bytes each).
__device__ __forceinline__ void StMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                           uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
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

// d (64 x N, this thread's part) = A B + (scale_d ? d : 0), one k-step of 16.
// WgmmaSS: A and B from shared-memory descriptors. WgmmaRS: A from registers.
// kTransB = 1 for an MN-major B, kTransA = 1 for an M-major A (SS only).
// The operand lists are spelled out because
// inline PTX cannot take arrays; N = 8 * (first extent of d).
// Accumulator operand text and bindings of one thread's N/2 floats.
#define JAX_FLASH_WGMMA_ACC16 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" "}"
#define JAX_FLASH_WGMMA_OUT16(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define JAX_FLASH_WGMMA_ACC32 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}"
#define JAX_FLASH_WGMMA_OUT32(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3])
#define JAX_FLASH_WGMMA_ACC64 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}"
#define JAX_FLASH_WGMMA_OUT64(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
    "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
    "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])

// N = 176 (22 8-column tiles): FlashAttention-3's D=128 key block.
#define JAX_FLASH_WGMMA_ACC88 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87" "}"
#define JAX_FLASH_WGMMA_OUT88(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
    "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
    "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), \
    "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
    "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), \
    "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), \
    "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3])

// One wgmma with float accumulators; TYPE is the PTX input type ("bf16",
// "f16"); the operand numbers follow the accumulators (ACC: their text, then
// the bindings last, as __VA_ARGS__, since they hold commas).
#define JAX_FLASH_WGMMA_SS(SHAPE, TYPE, ACC, A, B, P, TA, TB, ...)                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                             \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " ACC ", " A \
               ", " B ", p, 1, 1, " TA ", " TB ";\n}\n"                                   \
               : __VA_ARGS__                                                              \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))
#define JAX_FLASH_WGMMA_RS(SHAPE, TYPE, ACC, A, B, P, TB, ...)                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                             \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " ACC ", " A \
               ", " B ", p, 1, 1, " TB ";\n}\n"                                           \
               : __VA_ARGS__                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d),  \
                 "n"(kTransB))

template <typename T, int kTransB, int kTransA = 0>
__device__ __forceinline__ void WgmmaSS(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_SS("m64n32k16", "f16", JAX_FLASH_WGMMA_ACC16, "%16", "%17", "%18", "%19", "%20",
                       JAX_FLASH_WGMMA_OUT16(d));
  } else {
    JAX_FLASH_WGMMA_SS("m64n32k16", "bf16", JAX_FLASH_WGMMA_ACC16, "%16", "%17", "%18", "%19", "%20",
                       JAX_FLASH_WGMMA_OUT16(d));
  }
}

template <typename T, int kTransB, int kTransA = 0>
__device__ __forceinline__ void WgmmaSS(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_SS("m64n64k16", "f16", JAX_FLASH_WGMMA_ACC32, "%32", "%33", "%34", "%35", "%36",
                       JAX_FLASH_WGMMA_OUT32(d));
  } else {
    JAX_FLASH_WGMMA_SS("m64n64k16", "bf16", JAX_FLASH_WGMMA_ACC32, "%32", "%33", "%34", "%35", "%36",
                       JAX_FLASH_WGMMA_OUT32(d));
  }
}

template <typename T, int kTransB, int kTransA = 0>
__device__ __forceinline__ void WgmmaSS(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_SS("m64n128k16", "f16", JAX_FLASH_WGMMA_ACC64, "%64", "%65", "%66", "%67", "%68",
                       JAX_FLASH_WGMMA_OUT64(d));
  } else {
    JAX_FLASH_WGMMA_SS("m64n128k16", "bf16", JAX_FLASH_WGMMA_ACC64, "%64", "%65", "%66", "%67", "%68",
                       JAX_FLASH_WGMMA_OUT64(d));
  }
}

template <typename T, int kTransB, int kTransA = 0>
__device__ __forceinline__ void WgmmaSS(float (&d)[22][4], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_SS("m64n176k16", "f16", JAX_FLASH_WGMMA_ACC88, "%88", "%89", "%90", "%91", "%92",
                       JAX_FLASH_WGMMA_OUT88(d));
  } else {
    JAX_FLASH_WGMMA_SS("m64n176k16", "bf16", JAX_FLASH_WGMMA_ACC88, "%88", "%89", "%90", "%91", "%92",
                       JAX_FLASH_WGMMA_OUT88(d));
  }
}

template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaRS(float (&d)[8][4], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_RS("m64n64k16", "f16", JAX_FLASH_WGMMA_ACC32, "{%32, %33, %34, %35}", "%36",
                       "%37", "%38", JAX_FLASH_WGMMA_OUT32(d));
  } else {
    JAX_FLASH_WGMMA_RS("m64n64k16", "bf16", JAX_FLASH_WGMMA_ACC32, "{%32, %33, %34, %35}", "%36",
                       "%37", "%38", JAX_FLASH_WGMMA_OUT32(d));
  }
}

template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaRS(float (&d)[16][4], const uint32_t (&a)[4],
                                        uint64_t desc_b, int scale_d) {
  if constexpr (std::is_same_v<T, __half>) {
    JAX_FLASH_WGMMA_RS("m64n128k16", "f16", JAX_FLASH_WGMMA_ACC64, "{%64, %65, %66, %67}", "%68",
                       "%69", "%70", JAX_FLASH_WGMMA_OUT64(d));
  } else {
    JAX_FLASH_WGMMA_RS("m64n128k16", "bf16", JAX_FLASH_WGMMA_ACC64, "{%64, %65, %66, %67}", "%68",
                       "%69", "%70", JAX_FLASH_WGMMA_OUT64(d));
  }
}

#undef JAX_FLASH_WGMMA_SS
#undef JAX_FLASH_WGMMA_RS

// d = A B^T summed over kCols columns (one commit group's worth of wgmmas,
// not committed): A = rows a.. (64 of them) of a swizzled tile of kARows
// rows, B = a swizzled tile of kBRows rows, both K-major with their columns
// in 64-column blocks (S = Q K^T in the forward, S^T = K Q^T and dP^T =
// V dO^T in the backward). k-step kk covers columns 16kk..16kk+15: column
// block kk / 4, 32 bytes per step inside the block's 128-byte rows.
template <typename T, int kCols, int kARows, int kBRows, int kN>
__device__ __forceinline__ void GemmKMajor(float (&d)[kN][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < kCols / 16; ++kk) {
    const uint32_t block = kk / 4, step_bytes = (kk % 4) * 32;
    const uint64_t desc_a =
        SmemDescriptor(a + block * kARows * kSwizzleBytes + step_bytes, 0, kAtomBytes);
    const uint64_t desc_b =
        SmemDescriptor(b + block * kBRows * kSwizzleBytes + step_bytes, 0, kAtomBytes);
    WgmmaSS<T, 0>(d, desc_a, desc_b, kk > 0);
  }
}

}  // namespace jax_flash::cuda::sm90

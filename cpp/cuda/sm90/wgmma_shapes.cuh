// The wgmma.mma_async shapes (m64nNk16, float accumulators, bf16 / fp16
// inputs) the Hopper kernels use, as inline PTX, for N in
// {8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 176, 192, 256}. Inline PTX
// cannot take arrays, so each shape spells out its N / 2 accumulator operands;
// the operand strings and the shape table below were written by a short
// script (the same text for every N, only the numbers differ), the bindings
// are composed from runs of 1 .. 32 n-tiles. Use through WgmmaSS / WgmmaRS
// (sm90/wgmma.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash::cuda::sm90 {

// "{%0, ..., %(N/2 - 1)}": the accumulator operands of an m64nNk16 wgmma.
#define JAX_FLASH_WGMMA_N8_ACC "{%0, %1, %2, %3}"
#define JAX_FLASH_WGMMA_N16_ACC "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define JAX_FLASH_WGMMA_N24_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}"
#define JAX_FLASH_WGMMA_N32_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define JAX_FLASH_WGMMA_N40_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19}"
#define JAX_FLASH_WGMMA_N48_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23}"
#define JAX_FLASH_WGMMA_N56_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}"
#define JAX_FLASH_WGMMA_N64_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JAX_FLASH_WGMMA_N80_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39}"
#define JAX_FLASH_WGMMA_N96_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define JAX_FLASH_WGMMA_N112_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55}"
#define JAX_FLASH_WGMMA_N128_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define JAX_FLASH_WGMMA_N176_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87}"
#define JAX_FLASH_WGMMA_N192_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define JAX_FLASH_WGMMA_N256_ACC "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// Bindings of n-tiles [i, i + k) of an accumulator array d[][4].
#define JAX_FLASH_WGMMA_TILES1(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define JAX_FLASH_WGMMA_TILES2(d, i) JAX_FLASH_WGMMA_TILES1(d, i), JAX_FLASH_WGMMA_TILES1(d, (i) + 1)
#define JAX_FLASH_WGMMA_TILES4(d, i) JAX_FLASH_WGMMA_TILES2(d, i), JAX_FLASH_WGMMA_TILES2(d, (i) + 2)
#define JAX_FLASH_WGMMA_TILES8(d, i) JAX_FLASH_WGMMA_TILES4(d, i), JAX_FLASH_WGMMA_TILES4(d, (i) + 4)
#define JAX_FLASH_WGMMA_TILES16(d, i) JAX_FLASH_WGMMA_TILES8(d, i), JAX_FLASH_WGMMA_TILES8(d, (i) + 8)
#define JAX_FLASH_WGMMA_TILES32(d, i) \
  JAX_FLASH_WGMMA_TILES16(d, i), JAX_FLASH_WGMMA_TILES16(d, (i) + 16)

// One wgmma with float accumulators; TYPE is the PTX input type ("bf16",
// "f16"); the operand numbers follow the accumulators (ACC: their text, then
// the bindings last, as __VA_ARGS__, since they hold commas). The _T forms
// pick TYPE from T.
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
#define JAX_FLASH_WGMMA_SS_T(SHAPE, ACC, A, B, P, TA, TB, ...)              \
  if constexpr (std::is_same_v<T, __half>) {                                \
    JAX_FLASH_WGMMA_SS(SHAPE, "f16", ACC, A, B, P, TA, TB, __VA_ARGS__);    \
  } else {                                                                  \
    JAX_FLASH_WGMMA_SS(SHAPE, "bf16", ACC, A, B, P, TA, TB, __VA_ARGS__);   \
  }
#define JAX_FLASH_WGMMA_RS_T(SHAPE, ACC, A, B, P, TB, ...)                  \
  if constexpr (std::is_same_v<T, __half>) {                                \
    JAX_FLASH_WGMMA_RS(SHAPE, "f16", ACC, A, B, P, TB, __VA_ARGS__);        \
  } else {                                                                  \
    JAX_FLASH_WGMMA_RS(SHAPE, "bf16", ACC, A, B, P, TB, __VA_ARGS__);       \
  }

template <int kN>
inline constexpr bool kWgmmaShape = kN == 8 || kN == 16 || kN == 24 || kN == 32 || kN == 40 ||
                                    kN == 48 || kN == 56 || kN == 64 || kN == 80 || kN == 96 ||
                                    kN == 112 || kN == 128 || kN == 176 || kN == 192 ||
                                    kN == 256;

// d[kOff .. kOff + kN / 8) = A B (+ d), A and B from shared-memory
// descriptors; kTransA / kTransB: A M-major / B MN-major.
template <typename T, int kN, int kTransB, int kTransA, int kOff, int kTiles>
__device__ __forceinline__ void WgmmaSSN(float (&d)[kTiles][4], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  static_assert(kWgmmaShape<kN> && kOff >= 0 && kOff + kN / 8 <= kTiles, "wgmma shape");
  if constexpr (kN == 8) {
    JAX_FLASH_WGMMA_SS_T("m64n8k16", JAX_FLASH_WGMMA_N8_ACC, "%4", "%5", "%6", "%7", "%8",
                         JAX_FLASH_WGMMA_TILES1(d, kOff + 0));
  } else if constexpr (kN == 16) {
    JAX_FLASH_WGMMA_SS_T("m64n16k16", JAX_FLASH_WGMMA_N16_ACC, "%8", "%9", "%10", "%11", "%12",
                         JAX_FLASH_WGMMA_TILES2(d, kOff + 0));
  } else if constexpr (kN == 24) {
    JAX_FLASH_WGMMA_SS_T("m64n24k16", JAX_FLASH_WGMMA_N24_ACC, "%12", "%13", "%14", "%15", "%16",
                         JAX_FLASH_WGMMA_TILES2(d, kOff + 0), JAX_FLASH_WGMMA_TILES1(d, kOff + 2));
  } else if constexpr (kN == 32) {
    JAX_FLASH_WGMMA_SS_T("m64n32k16", JAX_FLASH_WGMMA_N32_ACC, "%16", "%17", "%18", "%19", "%20",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0));
  } else if constexpr (kN == 40) {
    JAX_FLASH_WGMMA_SS_T("m64n40k16", JAX_FLASH_WGMMA_N40_ACC, "%20", "%21", "%22", "%23", "%24",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES1(d, kOff + 4));
  } else if constexpr (kN == 48) {
    JAX_FLASH_WGMMA_SS_T("m64n48k16", JAX_FLASH_WGMMA_N48_ACC, "%24", "%25", "%26", "%27", "%28",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 4));
  } else if constexpr (kN == 56) {
    JAX_FLASH_WGMMA_SS_T("m64n56k16", JAX_FLASH_WGMMA_N56_ACC, "%28", "%29", "%30", "%31", "%32",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 4), JAX_FLASH_WGMMA_TILES1(d, kOff + 6));
  } else if constexpr (kN == 64) {
    JAX_FLASH_WGMMA_SS_T("m64n64k16", JAX_FLASH_WGMMA_N64_ACC, "%32", "%33", "%34", "%35", "%36",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0));
  } else if constexpr (kN == 80) {
    JAX_FLASH_WGMMA_SS_T("m64n80k16", JAX_FLASH_WGMMA_N80_ACC, "%40", "%41", "%42", "%43", "%44",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 8));
  } else if constexpr (kN == 96) {
    JAX_FLASH_WGMMA_SS_T("m64n96k16", JAX_FLASH_WGMMA_N96_ACC, "%48", "%49", "%50", "%51", "%52",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 8));
  } else if constexpr (kN == 112) {
    JAX_FLASH_WGMMA_SS_T("m64n112k16", JAX_FLASH_WGMMA_N112_ACC, "%56", "%57", "%58", "%59", "%60",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 8), JAX_FLASH_WGMMA_TILES2(d, kOff + 12));
  } else if constexpr (kN == 128) {
    JAX_FLASH_WGMMA_SS_T("m64n128k16", JAX_FLASH_WGMMA_N128_ACC, "%64", "%65", "%66", "%67", "%68",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0));
  } else if constexpr (kN == 176) {
    JAX_FLASH_WGMMA_SS_T("m64n176k16", JAX_FLASH_WGMMA_N176_ACC, "%88", "%89", "%90", "%91", "%92",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 16), JAX_FLASH_WGMMA_TILES2(d, kOff + 20));
  } else if constexpr (kN == 192) {
    JAX_FLASH_WGMMA_SS_T("m64n192k16", JAX_FLASH_WGMMA_N192_ACC, "%96", "%97", "%98", "%99", "%100",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0), JAX_FLASH_WGMMA_TILES8(d, kOff + 16));
  } else if constexpr (kN == 256) {
    JAX_FLASH_WGMMA_SS_T("m64n256k16", JAX_FLASH_WGMMA_N256_ACC, "%128", "%129", "%130", "%131", "%132",
                         JAX_FLASH_WGMMA_TILES32(d, kOff + 0));
  }
}

// d[kOff .. kOff + kN / 8) = A B (+ d), A (this thread's 16 x 16 mma.sync A
// fragment of its warp's rows) from registers, B from a descriptor.
template <typename T, int kN, int kTransB, int kOff, int kTiles>
__device__ __forceinline__ void WgmmaRSN(float (&d)[kTiles][4], const uint32_t (&a)[4],
                                         uint64_t desc_b, int scale_d) {
  static_assert(kWgmmaShape<kN> && kOff >= 0 && kOff + kN / 8 <= kTiles, "wgmma shape");
  if constexpr (kN == 8) {
    JAX_FLASH_WGMMA_RS_T("m64n8k16", JAX_FLASH_WGMMA_N8_ACC, "{%4, %5, %6, %7}", "%8", "%9", "%10",
                         JAX_FLASH_WGMMA_TILES1(d, kOff + 0));
  } else if constexpr (kN == 16) {
    JAX_FLASH_WGMMA_RS_T("m64n16k16", JAX_FLASH_WGMMA_N16_ACC, "{%8, %9, %10, %11}", "%12", "%13", "%14",
                         JAX_FLASH_WGMMA_TILES2(d, kOff + 0));
  } else if constexpr (kN == 24) {
    JAX_FLASH_WGMMA_RS_T("m64n24k16", JAX_FLASH_WGMMA_N24_ACC, "{%12, %13, %14, %15}", "%16", "%17", "%18",
                         JAX_FLASH_WGMMA_TILES2(d, kOff + 0), JAX_FLASH_WGMMA_TILES1(d, kOff + 2));
  } else if constexpr (kN == 32) {
    JAX_FLASH_WGMMA_RS_T("m64n32k16", JAX_FLASH_WGMMA_N32_ACC, "{%16, %17, %18, %19}", "%20", "%21", "%22",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0));
  } else if constexpr (kN == 40) {
    JAX_FLASH_WGMMA_RS_T("m64n40k16", JAX_FLASH_WGMMA_N40_ACC, "{%20, %21, %22, %23}", "%24", "%25", "%26",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES1(d, kOff + 4));
  } else if constexpr (kN == 48) {
    JAX_FLASH_WGMMA_RS_T("m64n48k16", JAX_FLASH_WGMMA_N48_ACC, "{%24, %25, %26, %27}", "%28", "%29", "%30",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 4));
  } else if constexpr (kN == 56) {
    JAX_FLASH_WGMMA_RS_T("m64n56k16", JAX_FLASH_WGMMA_N56_ACC, "{%28, %29, %30, %31}", "%32", "%33", "%34",
                         JAX_FLASH_WGMMA_TILES4(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 4), JAX_FLASH_WGMMA_TILES1(d, kOff + 6));
  } else if constexpr (kN == 64) {
    JAX_FLASH_WGMMA_RS_T("m64n64k16", JAX_FLASH_WGMMA_N64_ACC, "{%32, %33, %34, %35}", "%36", "%37", "%38",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0));
  } else if constexpr (kN == 80) {
    JAX_FLASH_WGMMA_RS_T("m64n80k16", JAX_FLASH_WGMMA_N80_ACC, "{%40, %41, %42, %43}", "%44", "%45", "%46",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES2(d, kOff + 8));
  } else if constexpr (kN == 96) {
    JAX_FLASH_WGMMA_RS_T("m64n96k16", JAX_FLASH_WGMMA_N96_ACC, "{%48, %49, %50, %51}", "%52", "%53", "%54",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 8));
  } else if constexpr (kN == 112) {
    JAX_FLASH_WGMMA_RS_T("m64n112k16", JAX_FLASH_WGMMA_N112_ACC, "{%56, %57, %58, %59}", "%60", "%61", "%62",
                         JAX_FLASH_WGMMA_TILES8(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 8), JAX_FLASH_WGMMA_TILES2(d, kOff + 12));
  } else if constexpr (kN == 128) {
    JAX_FLASH_WGMMA_RS_T("m64n128k16", JAX_FLASH_WGMMA_N128_ACC, "{%64, %65, %66, %67}", "%68", "%69", "%70",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0));
  } else if constexpr (kN == 176) {
    JAX_FLASH_WGMMA_RS_T("m64n176k16", JAX_FLASH_WGMMA_N176_ACC, "{%88, %89, %90, %91}", "%92", "%93", "%94",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0), JAX_FLASH_WGMMA_TILES4(d, kOff + 16), JAX_FLASH_WGMMA_TILES2(d, kOff + 20));
  } else if constexpr (kN == 192) {
    JAX_FLASH_WGMMA_RS_T("m64n192k16", JAX_FLASH_WGMMA_N192_ACC, "{%96, %97, %98, %99}", "%100", "%101", "%102",
                         JAX_FLASH_WGMMA_TILES16(d, kOff + 0), JAX_FLASH_WGMMA_TILES8(d, kOff + 16));
  } else if constexpr (kN == 256) {
    JAX_FLASH_WGMMA_RS_T("m64n256k16", JAX_FLASH_WGMMA_N256_ACC, "{%128, %129, %130, %131}", "%132", "%133", "%134",
                         JAX_FLASH_WGMMA_TILES32(d, kOff + 0));
  }
}

#undef JAX_FLASH_WGMMA_SS
#undef JAX_FLASH_WGMMA_RS
#undef JAX_FLASH_WGMMA_SS_T
#undef JAX_FLASH_WGMMA_RS_T

}  // namespace jax_flash::cuda::sm90

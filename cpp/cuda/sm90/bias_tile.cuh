// The bias on the Hopper forwards (sm90/mainloop_fwd.cuh, mainloop_fwd_ws.cuh):
// one key block's bias tile, float32 or the 16-bit inputs' type
// (ScoreParams::bias_type), loaded by TMA (EncodeBiasTensorMap) a block ahead
// of its use, and added to the S fragments from shared memory.
//
// Why staged: read per element from global memory right before its use, the
// bias kept the mma.sync kernel's warps waiting on L1TEX for most of their
// cycles (cuda/NOTES_score_terms.md); here one thread issues the tile, no
// thread keeps its addresses, and the load runs under the softmax and both
// GEMMs of the block before.
//
// Layout: boxes of kBlockM rows x 128 bytes of keys (32 float32 or 64 16-bit
// ones); a row's eight 16-byte chunks are swizzled by row % 8 (TMA's 128-byte
// swizzle). float32: a lane's float2 (row g or g + 8, keys 8nt + 2t, + 1)
// lies in chunk 2(nt % 4) + t / 2, and a warp's 8 rows x 32 bytes fill the 32
// banks twice, the least two wavefronts that 256 bytes take. 16-bit: the
// lane's pair (4 bytes) lies in chunk nt % 8, and 8 rows x 16 bytes fill the
// banks once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// Shared memory a CTA may use (sm_90).
inline constexpr int kMaxSmemBytes = 227 * 1024;

// BiasT: float, or the inputs' 16-bit type when the bias comes in it.
template <int kBlockM, int kBlockN, typename BiasT>
struct BiasTile {
  static constexpr int kElemBytes = static_cast<int>(sizeof(BiasT));
  static constexpr int kBoxKeys = 128 / kElemBytes;  // keys per 128-byte row
  static constexpr int kBoxBytes = kBlockM * 128;    // one box: kBlockM rows
  static constexpr int kBytes = kBlockM * kBlockN * kElemBytes;
  static_assert(kElemBytes == 4 || kElemBytes == 2, "float32 or a 16-bit bias");
  static_assert(kBlockN % kBoxKeys == 0, "key blocks are whole boxes");
  // Whether a kernel whose other shared memory takes `smem_bytes` has room
  // for `stages` tiles.
  static constexpr bool Fits(int smem_bytes, int stages) {
    return smem_bytes + stages * kBytes <= kMaxSmemBytes;
  }

  // One thread: the tile of queries [row0, row0 + kBlockM) x keys [key0,
  // key0 + kBlockN) of (batch b, q head h) into `tile` through `map`
  // (EncodeBiasTensorMap with box rows kBlockM), its bytes counted on `bar`.
  // A bias dim of 1 (broadcast) reads its one index.
  __device__ __forceinline__ static void Load(uint32_t tile, const CUtensorMap* map,
                                              const ScoreParams& score, int key0, int row0,
                                              int64_t h, int64_t b, uint32_t bar) {
    MbarrierArriveExpectTx(bar, kBytes);
    const int bias_h = score.bias_dims[1] > 1 ? static_cast<int>(h) : 0;
    const int bias_b = score.bias_dims[0] > 1 ? static_cast<int>(b) : 0;
#pragma unroll
    for (int box = 0; box < kBlockN / kBoxKeys; ++box)
      TmaLoadBox(tile + box * kBoxBytes, map, key0 + box * kBoxKeys, row0, bias_h, bias_b, bar);
  }

  // x = scale * s + bias on one warp's S fragment (16 rows from tile row
  // row0, a multiple of 8, by kBlockN keys; common/fragment.cuh's layout).
  // Returns with every lane's reads of the tile performed, so that the
  // caller may release the stage to the next TMA load: the reads are
  // generic-proxy loads and that load an async-proxy write, so each lane
  // fences the proxies (fence.proxy.async, which ptxas emits as a MEMBAR
  // that waits for the loads in flight) and the warp reconverges before its
  // arrival. Pinning the sums in registers was not enough: ptxas still put
  // the arrive before the last loads had returned, and the D = 256 kernel
  // with a float32 bias read the next block's bias (NOTES.md;
  // tests/gpu/sass_release_check.py finds the pattern in SASS).
  template <int kNTiles>
  __device__ __forceinline__ static void Add(float (&s)[kNTiles][4], uint32_t tile, int row0,
                                             float scale, int g, int t) {
    static_assert(kNTiles * 8 == kBlockN, "the fragment spans the key block");
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const uint32_t row = tile + (row0 + g + 8 * hr) * 128;  // (row0 + g + 8hr) % 8 == g
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const float2 b = Pair(row, nt, g, t);
        s[nt][2 * hr] = fmaf(s[nt][2 * hr], scale, b.x);
        s[nt][2 * hr + 1] = fmaf(s[nt][2 * hr + 1], scale, b.y);
      }
    }
    FenceProxyAsync();
    __syncwarp();
  }

 private:
  // Keys 8nt + 2t, + 1 of the row at shared address `row`.
  __device__ __forceinline__ static float2 Pair(uint32_t row, int nt, int g, int t) {
    float2 b;
    if constexpr (kElemBytes == 4) {
      const int chunk = ((nt % 4) * 2 + t / 2) ^ g;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                   : "=f"(b.x), "=f"(b.y)
                   : "r"(row + (nt / 4) * kBoxBytes + chunk * 16 + (t % 2) * 8));
    } else {
      const int chunk = (nt % 8) ^ g;
      uint32_t bits;
      asm volatile("ld.shared.b32 %0, [%1];\n"
                   : "=r"(bits)
                   : "r"(row + (nt / 8) * kBoxBytes + chunk * 16 + t * 4));
      b = Widen(bits);
    }
    return b;
  }
  __device__ __forceinline__ static float2 Widen(uint32_t bits) {
    if constexpr (std::is_same_v<BiasT, __nv_bfloat16>) {
      __nv_bfloat162 v;
      memcpy(&v, &bits, 4);
      return __bfloat1622float2(v);
    } else {
      __half2 v;
      memcpy(&v, &bits, 4);
      return __half22float2(v);
    }
  }
};

// Bytes of one tile of type Bias (a BiasTile), 0 for none (void).
template <typename Bias>
inline constexpr int kBiasTileBytes = Bias::kBytes;
template <>
inline constexpr int kBiasTileBytes<void> = 0;

}  // namespace jax_flash::cuda::sm90

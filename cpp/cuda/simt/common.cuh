// Device helpers shared by the exact (SIMT, IEEE, no tensor cores) kernels.
//
// "Exact" means: every product and sum is an ordinary IEEE float32/float64
// operation (no TF32, no tensor cores, no fast-math intrinsics), so that the
// float32/float64 paths agree with a dense reference to the rounding of the
// accumulation type and jax.test_util.check_grads passes on the GPU.
//
// The pieces:
//   AccType<T>          accumulation type (double for double, else float)
//   ToAcc / FromAcc     storage <-> accumulation conversion
//   TileMap             which elements of an R x C tile one thread owns
//   MultiplyAccumulate  register-tiled product of two shared-memory tiles
//   LoadTile            global (B, S, H, D) rows -> zero-padded shared tile
// Elsewhere: the accurate math (Exp, Log, Tanh) in common/math.cuh; the score
// transform (Score) and a head's bias, mask and dropout (HeadTerms) in
// common/score.cuh; tile sizes in simt/tile_size.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/math.cuh"
#include "cuda/simt/tile_size.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::simt {

// Every exact kernel runs four warps: enough threads to hide shared-memory
// latency, few enough that the register-resident accumulators fit.
inline constexpr int kThreads = 128;
inline constexpr int kWarpSize = 32;

// The largest dynamic shared memory every sm_80+ part grants one block
// (sm_86/sm_89 allow 99 KiB; sm_80 163 KiB; sm_90 227 KiB). Tile sizes are
// chosen to stay under it so one build runs on all of them.
inline constexpr size_t kMaxSharedBytes = 99 * 1024;
// Above this a kernel must opt in to more dynamic shared memory.
inline constexpr size_t kDefaultSharedBytes = 48 * 1024;
// Grids are one-dimensional (blockIdx.x allows 2^31 - 1 blocks; y and z only
// 65535, too few for a folded batch * heads).
inline constexpr int64_t kMaxGridX = 2147483647;

// One kernel over `blocks` blocks of kThreads (a one-dimensional grid),
// opting in to more dynamic shared memory where it needs it: no launch for
// no blocks, cudaErrorInvalidConfiguration past kMaxGridX.
template <typename Kernel, typename Params>
cudaError_t Launch(Kernel kernel, int64_t blocks, size_t shared_bytes, const Params& p,
                   cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  if (blocks > kMaxGridX) return cudaErrorInvalidConfiguration;
  if (shared_bytes > kDefaultSharedBytes) {
    // Not a stream operation: allowed while XLA captures a command buffer.
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

// launch(std::integral_constant<int, D>{}) for head_dim's tier D
// (tile_size.h), or cudaErrorInvalidValue past the largest.
template <typename LaunchTier>
cudaError_t WithExactTier(int64_t head_dim, LaunchTier&& launch) {
  switch (HeadDimTier(head_dim)) {
#define JAX_FLASH_TIER_CASE(D) \
  case (D):                    \
    return launch(std::integral_constant<int, (D)>{});
    JAX_FLASH_FOR_EACH_EXACT_TIER(JAX_FLASH_TIER_CASE)
#undef JAX_FLASH_TIER_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------
// Types and conversions.

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using AccType = typename AccOf<T>::type;

__device__ __forceinline__ float ToAcc(float x) { return x; }
__device__ __forceinline__ double ToAcc(double x) { return x; }
__device__ __forceinline__ float ToAcc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToAcc(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T FromAcc(AccType<T> x);
template <> __device__ __forceinline__ float FromAcc<float>(float x) { return x; }
template <> __device__ __forceinline__ double FromAcc<double>(double x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 FromAcc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half FromAcc<__half>(float x) {
  return __float2half_rn(x);
}

// ---------------------------------------------------------------------------
// Thread ownership of an R x C tile.
//
// kColThreads threads run along the columns (consecutive threads own
// consecutive columns, so a warp's shared-memory reads are conflict-free and
// its global writes coalesce); the rest run along the rows. Thread t owns rows
// row(0..kRowsPerThread) and columns col(0..kColsPerThread), interleaved.
// When the tile has fewer elements than threads, the extra threads own
// nothing (active == false).
template <int R, int C>
struct TileMap {
  static constexpr int kColThreads = C < 16 ? C : 16;
  static constexpr int kRowThreads = (kThreads / kColThreads) < R ? kThreads / kColThreads : R;
  static constexpr int kRowsPerThread = R / kRowThreads;
  static constexpr int kColsPerThread = C / kColThreads;
  static_assert(R % kRowThreads == 0 && C % kColThreads == 0, "tile does not split evenly");
  static_assert(kRowThreads * kColThreads <= kThreads, "more owners than threads");

  int row0, col0;
  bool active;

  __device__ __forceinline__ explicit TileMap(int tid)
      : row0(tid / kColThreads), col0(tid % kColThreads),
        active(tid < kRowThreads * kColThreads) {}
  __device__ __forceinline__ int row(int i) const { return row0 + i * kRowThreads; }
  __device__ __forceinline__ int col(int j) const { return col0 + j * kColThreads; }
};

template <typename Map, typename Acc>
using Fragment = Acc[Map::kRowsPerThread][Map::kColsPerThread];

template <typename Map, typename Acc>
__device__ __forceinline__ void Fill(Fragment<Map, Acc>& acc, Acc value) {
#pragma unroll
  for (int i = 0; i < Map::kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < Map::kColsPerThread; ++j) acc[i][j] = value;
}

// f(i, j, at) for each element this thread owns: (i, j) its place in the
// fragment, at its index in a row-major shared tile of row stride ld.
template <typename Map, typename F>
__device__ __forceinline__ void ForEachOwned(const Map& map, int ld, F&& f) {
#pragma unroll
  for (int i = 0; i < Map::kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < Map::kColsPerThread; ++j) f(i, j, map.row(i) * ld + map.col(j));
}

// acc(r, c) += sum_{k < k_len} A(r, k) * B(c, k) over the elements this
// thread owns, where A(r, k) = a[r * a_row + k * a_k] and
// B(c, k) = b[c * b_col + k * b_k] are shared-memory tiles. The strides say
// which operand is transposed, so one routine serves Q K^T, P V, P^T dO, ...
// Each k step loads kRowsPerThread + kColsPerThread values for
// kRowsPerThread * kColsPerThread fused multiply-adds (IEEE fma: one rounding).
template <typename Map, typename Acc>
__device__ __forceinline__ void MultiplyAccumulate(const Map& map, Fragment<Map, Acc>& acc,
                                                   const Acc* a, int a_row, int a_k,
                                                   const Acc* b, int b_col, int b_k,
                                                   int k_len) {
  if (!map.active) return;
#pragma unroll 2
  for (int k = 0; k < k_len; ++k) {
    Acc a_frag[Map::kRowsPerThread];
    Acc b_frag[Map::kColsPerThread];
#pragma unroll
    for (int i = 0; i < Map::kRowsPerThread; ++i) a_frag[i] = a[map.row(i) * a_row + k * a_k];
#pragma unroll
    for (int j = 0; j < Map::kColsPerThread; ++j) b_frag[j] = b[map.col(j) * b_col + k * b_k];
#pragma unroll
    for (int i = 0; i < Map::kRowsPerThread; ++i)
#pragma unroll
      for (int j = 0; j < Map::kColsPerThread; ++j) acc[i][j] = fma(a_frag[i], b_frag[j], acc[i][j]);
  }
}

// Copies rows [0, valid_rows) x columns [0, head_dim) of a (seq, head_dim)
// slice of global memory (row stride in elements) into a kRows x kMaxD shared
// tile, converting to the accumulation type and writing zeros everywhere
// else, so that padding can never inject NaN into a product. Consecutive
// threads read consecutive elements of a row: coalesced.
template <int kRows, int kMaxD, typename T, typename Acc>
__device__ __forceinline__ void LoadTile(Acc* tile, const T* rows, int64_t row_stride,
                                         int valid_rows, int head_dim) {
  constexpr int kLd = kMaxD + 1;
  for (int idx = threadIdx.x; idx < kRows * kMaxD; idx += kThreads) {
    const int r = idx / kMaxD;
    const int d = idx % kMaxD;
    Acc x = Acc(0);
    if (r < valid_rows && d < head_dim) x = ToAcc(rows[static_cast<int64_t>(r) * row_stride + d]);
    tile[r * kLd + d] = x;
  }
}

// Writes the owned part of a (rows x kMaxD) register tile, times `factor`, to
// rows [0, valid_rows) x columns [0, head_dim) of a global slice.
template <typename T, typename Map, typename Acc>
__device__ __forceinline__ void StoreFragment(const Map& map, const Fragment<Map, Acc>& acc,
                                              Acc factor, T* rows, int64_t row_stride,
                                              int valid_rows, int head_dim) {
  if (!map.active) return;
#pragma unroll
  for (int i = 0; i < Map::kRowsPerThread; ++i) {
    const int r = map.row(i);
    if (r >= valid_rows) continue;
#pragma unroll
    for (int j = 0; j < Map::kColsPerThread; ++j) {
      const int d = map.col(j);
      if (d < head_dim) rows[static_cast<int64_t>(r) * row_stride + d] = FromAcc<T>(acc[i][j] * factor);
    }
  }
}

// Reductions over groups of kGroup consecutive lanes (kGroup a power of two
// dividing the warp size); every lane of the group gets the result.
template <int kGroup, typename Acc>
__device__ __forceinline__ Acc GroupMax(Acc x) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2)
    x = Max(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <int kGroup, typename Acc>
__device__ __forceinline__ Acc GroupSum(Acc x) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Rows of a block of size kBlock that exist when `remaining` rows are left.
template <int kBlock>
__device__ __forceinline__ int ValidRows(int64_t remaining) {
  return remaining < kBlock ? static_cast<int>(remaining) : kBlock;
}

// This block's query block in a kernel over (batch, query head, query block),
// the query block fastest, so that blocks sharing a head's K and V run
// together (L2 reuse); one grid dimension of Count(s) blocks, since y and z
// allow only 65535 for a large batch * heads.
template <int kBlockM>
struct QueryBlock {
  int64_t b, h, h_kv;
  int64_t i0;   // its first query
  int m_valid;  // its rows below seqlen_q
  __host__ __device__ static int64_t Count(const AttentionShape& s) {
    return CeilDiv(s.seqlen_q, kBlockM) * s.num_heads_q * s.batch;
  }
  __device__ __forceinline__ static QueryBlock Here(const AttentionShape& s) {
    const int64_t num_m_blocks = CeilDiv(s.seqlen_q, kBlockM);
    QueryBlock q;
    q.h = (blockIdx.x / num_m_blocks) % s.num_heads_q;
    q.b = blockIdx.x / num_m_blocks / s.num_heads_q;
    q.h_kv = q.h / s.group_size();
    q.i0 = blockIdx.x % num_m_blocks * kBlockM;
    q.m_valid = ValidRows<kBlockM>(s.seqlen_q - q.i0);
    return q;
  }
};

}  // namespace jax_flash::cuda::simt

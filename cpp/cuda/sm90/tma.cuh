// Hopper tensor memory accelerator (TMA) loads: host-side tensor maps for
// the (batch, seq, head, head_dim) operands, and the device-side mbarrier and
// cp.async.bulk.tensor PTX around them (sm_90a).
//
// One thread issues a whole tile copy; the unit writes it in the 128-byte
// swizzle of wgmma.cuh (a box of 64 columns x kRows rows lands exactly as one
// column block of a swizzled tile), fills rows and columns outside the tensor
// with zeros, and counts the bytes on an mbarrier that the readers wait on.
// In the backward this replaced 256 threads' cp.async address arithmetic,
// which ncu showed as the largest block of issue time of the step.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

// ---- host --------------------------------------------------------------------

using TensorMapEncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                            const cuuint64_t*, const cuuint64_t*,
                                            const cuuint32_t*, const cuuint32_t*,
                                            CUtensorMapInterleave, CUtensorMapSwizzle,
                                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, found through the runtime (so the
// library does not link libcuda itself); nullptr when the driver lacks it.
inline TensorMapEncodeTiledFn TensorMapEncoder() {
  static const TensorMapEncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                         cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return static_cast<TensorMapEncodeTiledFn>(nullptr);
    return reinterpret_cast<TensorMapEncodeTiledFn>(ptr);
  }();
  return fn;
}

// Whether EncodeRowsTensorMap can address 16-bit rows at `base` with these
// strides (its checks before encoding): the callers that must know before
// launching (a backward with a dense mask, bwd/run.cuh).
inline bool TmaCanAddress(const void* base, const SeqStrides& strides) {
  if (TensorMapEncoder() == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (const int64_t s : {strides.row, strides.head, strides.batch}) {
    if (s * 2 % 16 != 0) return false;
  }
  return true;
}

// A map of a 16-bit (batch, rows, heads, cols) tensor with element strides
// `strides`, read in boxes of 64 columns x box_rows rows of one head, 128-byte
// swizzled. False where TMA cannot address the tensor: the base or a stride
// not a multiple of 16 bytes (e.g. an odd head_dim), an empty dimension (no
// keys: a map's extents are at least 1; asked anyway, the driver fails the
// call and compute-sanitizer reports it), or no driver support; the caller
// then uses a kernel without TMA.
inline bool EncodeRowsTensorMap(CUtensorMap* map, const void* base, const SeqStrides& strides,
                                int64_t batch, int64_t rows, int64_t heads, int64_t cols,
                                int box_rows, bool bf16) {
  if (!TmaCanAddress(base, strides) || batch <= 0 || rows <= 0 || heads <= 0 || cols <= 0)
    return false;
  const TensorMapEncodeTiledFn encode = TensorMapEncoder();
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides.row) * 2,
                                      static_cast<cuuint64_t>(strides.head) * 2,
                                      static_cast<cuuint64_t>(strides.batch) * 2};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The forwards' maps of Q, K and V (sm90/fwd.cuh, sm90/fwd_ws.cuh): boxes of
// box_m query rows and box_n key rows; false where TMA cannot address one.
inline bool EncodeQkvTensorMaps(const FwdParams& p, int box_m, int box_n, bool bf16,
                                CUtensorMap* q, CUtensorMap* k, CUtensorMap* v) {
  const AttentionShape& s = p.shape;
  return EncodeRowsTensorMap(q, p.q, p.q_strides, s.batch, s.seqlen_q, s.num_heads_q,
                             s.head_dim, box_m, bf16) &&
         EncodeRowsTensorMap(k, p.k, p.k_strides, s.batch, s.seqlen_k, s.num_heads_kv,
                             s.head_dim, box_n, bf16) &&
         EncodeRowsTensorMap(v, p.v, p.v_strides, s.batch, s.seqlen_k, s.num_heads_kv,
                             s.head_dim, box_n, bf16);
}

// A map of the bias (contract.h: its own shape (B', N', T', S'), 1 where it
// broadcasts, contiguous; float32 or 16-bit, ScoreParams::bias_type), read in
// boxes of 128 bytes of keys (one row of the swizzle: 32 float32 or 64 16-bit
// keys) x box_rows queries of one (batch, head), 128-byte swizzled. False
// where TMA cannot read the bias as tiles: a query or key dimension broadcast
// (a box would repeat its one row, which TMA does not do), the base or the
// row pitch not a multiple of 16 bytes, an empty dimension, or no driver
// support; the caller then runs a kernel that reads the bias per element.
inline bool EncodeBiasTensorMap(CUtensorMap* map, const ScoreParams& score,
                                const AttentionShape& shape, int box_rows) {
  const int64_t* d = score.bias_dims;
  const bool is_float = score.bias_type == BiasType::kAcc;
  const int64_t elem_bytes = is_float ? 4 : 2;
  if (TensorMapEncoder() == nullptr || score.bias == nullptr ||
      reinterpret_cast<uintptr_t>(score.bias) % 16 != 0 || d[2] != shape.seqlen_q ||
      d[3] != shape.seqlen_k || d[3] * elem_bytes % 16 != 0 || d[0] <= 0 || d[1] <= 0 ||
      d[2] <= 0 || d[3] <= 0)
    return false;
  const CUtensorMapDataType type = is_float                                   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : score.bias_type == BiasType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d[3]), static_cast<cuuint64_t>(d[2]),
                              static_cast<cuuint64_t>(d[1]), static_cast<cuuint64_t>(d[0])};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(d[3] * elem_bytes),
                                      static_cast<cuuint64_t>(d[2] * d[3] * elem_bytes),
                                      static_cast<cuuint64_t>(d[1] * d[2] * d[3] * elem_bytes)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / elem_bytes),
                             static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return TensorMapEncoder()(map, type, 4, const_cast<void*>(score.bias), dims, byte_strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A map of the backward's per-row float32 statistics (lse2 or D: (B Hq, Sq)
// rows of seqlen floats, contiguous), read in boxes of box_rows queries of one
// (batch, head); queries past seqlen arrive as zeros, as LoadRowStats's
// cp.async zero-fill gives. False where TMA cannot address it: a row pitch or
// base not a multiple of 16 bytes (seqlen % 4 != 0), or no driver support.
inline bool EncodeRowStatsTensorMap(CUtensorMap* map, const float* base, int64_t seqlen,
                                    int64_t rows, int box_rows) {
  if (TensorMapEncoder() == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 ||
      seqlen * 4 % 16 != 0)
    return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(rows)};
  const cuuint64_t byte_strides[1] = {static_cast<cuuint64_t>(seqlen) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[2] = {1, 1};
  return TensorMapEncoder()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base),
                            dims, byte_strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// ---- device ------------------------------------------------------------------

__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialized barriers visible to the TMA unit (and other threads,
// after a CTA barrier).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// This thread's arrival, announcing `bytes` that copies will complete.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Arrives on the barrier when this thread's earlier cp.async copies are
// done (the arrival is part of the barrier's initial count: .noinc).
__device__ __forceinline__ void CpAsyncArriveOn(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Copies the box at (col, row, head, batch) of `map` to shared `dst`
// (1024-byte aligned for the swizzle), completing its bytes on `bar`.
__device__ __forceinline__ void TmaLoadBox(uint32_t dst, const CUtensorMap* map, int col, int row,
                                           int head, int batch, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
      : "memory");
}

// Copies the box at (col, row) of a 2-D `map` (EncodeRowStatsTensorMap) to
// shared `dst` (128-byte aligned), completing its bytes on `bar`.
__device__ __forceinline__ void TmaLoadBox2D(uint32_t dst, const CUtensorMap* map, int col, int row,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

// Copies shared `src` (a box laid out as TmaLoadBox writes one) to the box at
// (col, row, head, batch) of `map`, as a bulk group of the issuing thread
// (BulkCommit, BulkWaitRead, BulkWait in wgmma.cuh); rows and columns
// outside the tensor are not written. The writers of `src` fence it
// (FenceProxyAsync) and meet the issuing thread at a barrier first.
__device__ __forceinline__ void TmaStoreBox(const CUtensorMap* map, int col, int row, int head,
                                           int batch, uint32_t src) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(row), "r"(head), "r"(batch), "r"(src)
      : "memory");
}

}  // namespace jax_flash::cuda::sm90

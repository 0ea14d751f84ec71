// Global -> shared copies of the tensor-core kernels: cp.async (sm_80+; a
// synchronous copy on sm_75), and
// the shared-address conversion every PTX wrapper takes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::cuda {

inline constexpr int kVecElems = 8;  // 16-byte vector of 16-bit elements

// Threads that cover a row of `cols` 16-bit elements with one kVecElems
// vector each: cols / 8 rounded up to a power of two, at most a warp (the
// backward's row-wise pre- and postprocess, bwd/).
__host__ __device__ constexpr int RowVectorLanes(int cols) {
  int lanes = 1;
  while (lanes < 32 && lanes * kVecElems < cols) lanes *= 2;
  return lanes;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; with valid = false it
// writes zeros (src-size 0), which is how padding rows/columns become 0.
//
// sm_75 (the Turing family: the sm80 kernels compiled for compute_75) has no
// cp.async: the same calls copy synchronously through registers, and the
// commit / wait become no-ops. Every kernel publishes a stage with
// __syncthreads after its wait, which then orders the plain shared stores
// just as it orders the completed cp.async.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (valid) v = __ldcg(static_cast<const uint4*>(src));
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, bool valid) {
  const uint32_t v = valid ? *static_cast<const uint32_t*>(src) : 0u;
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(dst), "r"(v));
}
// The first `bytes` (0..16) of a 16-byte chunk, zeros after them.
__device__ __forceinline__ void CpAsync16Bytes(uint32_t dst, const void* src, int bytes) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (bytes == 16) {
    v = __ldcg(static_cast<const uint4*>(src));
  } else {
    unsigned char* b = reinterpret_cast<unsigned char*>(&v);
    for (int i = 0; i < bytes; ++i) b[i] = static_cast<const unsigned char*>(src)[i];
  }
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ void CpAsyncCommit() {}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {}
#else
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
// The first `bytes` (0..16) of a 16-byte chunk, zeros after them (src-size).
__device__ __forceinline__ void CpAsync16Bytes(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
#endif

}  // namespace jax_flash::cuda

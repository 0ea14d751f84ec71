// Dispatch over dtype and head-dim bucket for the tensor-core kernels, and
// the checks of what they support. The bucket list comes from
// jax_flash/_supported.py (generated tc_buckets.inc), like the instantiation
// files, so the three cannot disagree.
#include <atomic>
#include <cstdint>

#include "tc/tc_api.h"
#include "tc_buckets.inc"

namespace jax_flash::cuda::tc {
namespace {

constexpr int kTcMaxHeadDim = 256;
constexpr int kVectorElems = 8;      // 16-byte loads of 16-bit elements
constexpr uintptr_t kVectorBytes = 16;

bool Aligned(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }
bool VectorStrides(const SeqStrides& s) {
  return s.batch % kVectorElems == 0 && s.row % kVectorElems == 0 && s.head % kVectorElems == 0;
}

}  // namespace

int HeadDimBucket(int64_t head_dim) {
#define JAX_FLASH_TC_BUCKET(D) \
  if (head_dim <= (D)) return (D);
  JAX_FLASH_TC_FOR_EACH_BUCKET(JAX_FLASH_TC_BUCKET)
#undef JAX_FLASH_TC_BUCKET
  return 0;
}

bool Supports(const AttentionShape& shape, bool is_bf16_or_fp16) {
  return is_bf16_or_fp16 && shape.head_dim > 0 && shape.head_dim <= kTcMaxHeadDim &&
         shape.head_dim % kVectorElems == 0 && HeadDimBucket(shape.head_dim) != 0 &&
         shape.num_heads_kv > 0 && shape.num_heads_q % shape.num_heads_kv == 0 &&
         shape.num_heads_q <= 65535 && shape.batch <= 65535;
}

bool Supports(const FwdParams& p, bool is_bf16_or_fp16) {
  // Not (yet) in these kernels: an additive bias, dropout, a dense boolean
  // mask (they use the 4-argument BatchMask::For, which ignores it). Such
  // problems go to the exact SIMT kernels.
  if (p.score.bias != nullptr || p.dropout.enabled() || p.mask.dense != nullptr) return false;
  return Supports(p.shape, is_bf16_or_fp16) && Aligned(p.q) && Aligned(p.k) && Aligned(p.v) &&
         Aligned(p.out) && VectorStrides(p.q_strides) && VectorStrides(p.k_strides) &&
         VectorStrides(p.v_strides) && VectorStrides(p.out_strides);
}

bool Supports(const BwdParams& p, bool is_bf16_or_fp16) {
  // out and dout are read with 16-byte loads (D = rowsum(dout * out)), the
  // fast mode's dq is written with 16-byte stores (DqConvertKernel); dk, dv
  // and the deterministic dq take 4-byte stores, but one rule is simpler.
  return Supports(static_cast<const FwdParams&>(p), is_bf16_or_fp16) && Aligned(p.dout) &&
         Aligned(p.dq) && Aligned(p.dk) && Aligned(p.dv) && VectorStrides(p.dout_strides) &&
         VectorStrides(p.dq_strides) && VectorStrides(p.dk_strides) &&
         VectorStrides(p.dv_strides);
}

// True when the current device is a Hopper GPU and this build holds sm_90a
// code for it (the wgmma kernels exist only there). The device query runs
// once per device; after that a launch pays one cudaGetDevice.
namespace {
bool OnHopperWithSm90a() {
#ifdef JAX_FLASH_HAS_SM90A
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};  // 0 unknown, 1 yes, 2 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device >= 0 && device < kCachedDevices) {
    if (const int known = cache[device].load(std::memory_order_relaxed); known != 0)
      return known == 1;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  const bool hopper = major == 9 && minor == 0;
  if (device >= 0 && device < kCachedDevices)
    cache[device].store(hopper ? 1 : 2, std::memory_order_relaxed);
  return hopper;
#else
  return false;
#endif
}
}  // namespace

cudaError_t LaunchFwd(const FwdParams& params, bool bf16, cudaStream_t stream) {
  if (!Supports(params, true)) return cudaErrorNotSupported;
  const int bucket = HeadDimBucket(params.shape.head_dim);
  if (OnHopperWithSm90a()) {
    switch (bucket) {
#define JAX_FLASH_TC_CASE(D)                                                     \
  case (D):                                                                      \
    return bf16 ? RunFwdSm90<__nv_bfloat16, (D)>(params, stream)                 \
                : RunFwdSm90<__half, (D)>(params, stream);
      JAX_FLASH_TC_FOR_EACH_SM90_FWD_BUCKET(JAX_FLASH_TC_CASE)
#undef JAX_FLASH_TC_CASE
      default:
        break;  // no Hopper kernel for this bucket: the sm_80 one below
    }
  }
  switch (bucket) {
#define JAX_FLASH_TC_CASE(D)                                                         \
  case (D):                                                                          \
    return bf16 ? RunFwd<__nv_bfloat16, (D)>(params, stream) : RunFwd<__half, (D)>(params, stream);
    JAX_FLASH_TC_FOR_EACH_BUCKET(JAX_FLASH_TC_CASE)
#undef JAX_FLASH_TC_CASE
    default:
      return cudaErrorNotSupported;
  }
}

size_t BwdWorkspace(const AttentionShape& shape, bool bf16, bool deterministic) {
  switch (HeadDimBucket(shape.head_dim)) {
#define JAX_FLASH_TC_CASE(D)                                                  \
  case (D):                                                                   \
    return bf16 ? BwdWorkspaceBytes<__nv_bfloat16, (D)>(shape, deterministic) \
                : BwdWorkspaceBytes<__half, (D)>(shape, deterministic);
    JAX_FLASH_TC_FOR_EACH_BUCKET(JAX_FLASH_TC_CASE)
#undef JAX_FLASH_TC_CASE
    default:
      return 0;
  }
}

cudaError_t LaunchBwd(const BwdParams& params, bool bf16, void* workspace, bool deterministic,
                      cudaStream_t stream) {
  if (!Supports(params, true)) return cudaErrorNotSupported;
  const int bucket = HeadDimBucket(params.shape.head_dim);
  if (!deterministic && OnHopperWithSm90a()) {
    switch (bucket) {
#define JAX_FLASH_TC_CASE(D)                                                               \
  case (D):                                                                                \
    return bf16 ? RunBwd<__nv_bfloat16, (D), true>(params, workspace, false, stream)       \
                : RunBwd<__half, (D), true>(params, workspace, false, stream);
      JAX_FLASH_TC_FOR_EACH_SM90_BWD_BUCKET(JAX_FLASH_TC_CASE)
#undef JAX_FLASH_TC_CASE
      default:
        break;  // no Hopper kernel for this bucket: the sm_80 one below
    }
  }
  switch (bucket) {
#define JAX_FLASH_TC_CASE(D)                                                          \
  case (D):                                                                           \
    return bf16 ? RunBwd<__nv_bfloat16, (D)>(params, workspace, deterministic, stream) \
                : RunBwd<__half, (D)>(params, workspace, deterministic, stream);
    JAX_FLASH_TC_FOR_EACH_BUCKET(JAX_FLASH_TC_CASE)
#undef JAX_FLASH_TC_CASE
    default:
      return cudaErrorNotSupported;
  }
}

}  // namespace jax_flash::cuda::tc

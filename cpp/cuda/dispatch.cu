// The one routing table: which kernel family and arch path runs a problem.
//
//   exact   (simt/)  every dtype and head_dim, IEEE arithmetic; float32 and
//                    float64 always (no TF32: check_grads relies on exact
//                    arithmetic), and whatever the tensor-core kernels lack
//   sm80    (sm80/)  bf16/fp16 on tensor cores through mma.sync, head-dim
//                    buckets, every sm_80+ GPU
//   sm90    (sm90/)  the same on wgmma and TMA, on Hopper when the build has
//                    sm_90a code: the forward of CUDA_SM90_FWD_BUCKETS and the
//                    backward (both modes) of CUDA_SM90_BWD_BUCKETS
//   sm75    (sm80/ compiled for compute_75) float16 on Turing (T4, RTX 20xx):
//                    the mma.sync kernels with m16n8k8, synchronous copies and
//                    tiles for 64 KiB of shared memory; bfloat16 runs exact there
// The forward-mode derivative (JVP) has an exact kernel and the mma.sync one
// of the sm80 and sm75 paths (no sm90 JVP: Hopper runs sm80's).
//
// Per-element score terms (cuda/common/score.cuh, HasScoreTerms): a bias, a
// dense mask, dropout and the tile map run on the mma.sync kernels (their kTerms
// instantiations), except the deterministic backward of a bias whose dbias
// sums over CTAs (DbiasHasOneWriter), which stays exact. On Hopper the wgmma
// kernels take a dense mask with its tile map and a bias (Sm90Supports;
// the backward of a bias with a soft cap or a deterministic dbias on the
// mma.sync kernels, bwd/run.cuh). A block mask runs on the tensor cores
// through the tile map it is folded into (TileMapHoldsBlockMask), on the
// exact kernels otherwise.
// The JVP's kTerms kernels take a dense mask and dropout; a bias keeps the
// JVP on the exact kernel.
//
// The routing follows the GPU's compute capability. JAX_FLASH_FORCE_PATH
// (environment, read at every launch, for tests and comparisons; jax_flash
// checks its value on import) routes as on an older GPU: "sm80" as on an
// Ampere GPU (the mma.sync kernels on Hopper), "sm75" as on a Turing GPU
// (float16 on the Turing family, whose compute_75 code the driver compiles
// for the GPU at hand; the rest exact), "exact" every problem on the exact
// kernels; unset or empty: the GPU decides. A path that cannot run a problem
// is not forced onto it.
//
// The lists (buckets, tiers, Hopper buckets) come from jax_flash/_supported.py
// through the generated jax_flash/supported.h, like the instantiation files,
// so the three cannot disagree.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/bwd/workspace.h"
#include "cuda/common/score.cuh"
#include "cuda/dispatch.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"
#include "cuda/sm90/scheduler_persistent.cuh"
#include "cuda/sm90/tile_size.h"
#include "jax_flash/supported.h"

namespace jax_flash::cuda {
namespace {

// ===========================================================================
// What the tensor-core kernels support.

constexpr int kVectorElems = 8;  // 16-byte loads of 16-bit elements
constexpr uintptr_t kVectorBytes = 16;

bool IsTensorCoreDType(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

// The smallest compiled bucket that holds head_dim, or 0 if none does.
int HeadDimBucket(int64_t head_dim) {
#define JAX_FLASH_BUCKET(D) \
  if (head_dim <= (D)) return (D);
  JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_BUCKET)
#undef JAX_FLASH_BUCKET
  return 0;
}

bool Aligned(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0;
}
bool VectorStrides(const SeqStrides& s) {
  return s.batch % kVectorElems == 0 && s.row % kVectorElems == 0 && s.head % kVectorElems == 0;
}

// Positions and (batch, head) rows the tensor-core kernels count in 32 bits
// (TMA coordinates; the sm90 backward's step indices, which in 64 bits cost
// it registers), with a tile's slack past the end.
constexpr int64_t kMaxIndex32 = (int64_t{1} << 31) - 256;

// The shape: bf16/fp16, head_dim <= the largest bucket and a multiple of 8
// (16-byte vector loads), grid dimensions y and z within 65535, indices
// within kMaxIndex32.
bool TensorCoresSupport(const AttentionShape& shape, DType dtype) {
  return IsTensorCoreDType(dtype) && shape.head_dim > 0 &&
         shape.head_dim <= kCudaTensorCoreMaxHeadDim && shape.head_dim % kVectorElems == 0 &&
         HeadDimBucket(shape.head_dim) != 0 && shape.num_heads_kv > 0 &&
         shape.num_heads_q % shape.num_heads_kv == 0 && shape.num_heads_q <= 65535 &&
         shape.batch <= 65535 && shape.batch * shape.num_heads_q <= kMaxIndex32 &&
         shape.seqlen_q <= kMaxIndex32 && shape.seqlen_k <= kMaxIndex32;
}

// The shape test plus what the 16-byte loads need of the buffers: every row
// and head stride a multiple of 8 elements and every pointer 16-byte aligned.
// (The bias takes any strides: common/score.cuh's BiasView falls back to
// scalar loads.) A block-sparse mask: FwdPath and BwdPath.
bool TensorCoresSupport(const FwdParams& p, DType dtype) {
  return TensorCoresSupport(p.shape, dtype) && Aligned(p.q) && Aligned(p.k) && Aligned(p.v) &&
         Aligned(p.out) && VectorStrides(p.q_strides) && VectorStrides(p.k_strides) &&
         VectorStrides(p.v_strides) && VectorStrides(p.out_strides);
}

bool TensorCoresSupport(const BwdParams& p, DType dtype) {
  // out and dout are read with 16-byte loads (D = rowsum(dout * out)), the
  // fast mode's dq is written with 16-byte stores (bwd/postprocess.cuh); dk,
  // dv and the deterministic dq take 4-byte stores, but one rule is simpler.
  return TensorCoresSupport(static_cast<const FwdParams&>(p), dtype) && Aligned(p.dout) &&
         Aligned(p.dq) && Aligned(p.dk) && Aligned(p.dv) && VectorStrides(p.dout_strides) &&
         VectorStrides(p.dq_strides) && VectorStrides(p.dk_strides) &&
         VectorStrides(p.dv_strides);
}

// The JVP reads its tangents like their primals and writes out_dot like out.
bool TensorCoresSupport(const JvpParams& p, DType dtype) {
  return TensorCoresSupport(static_cast<const FwdParams&>(p), dtype) && Aligned(p.q_dot) &&
         Aligned(p.k_dot) && Aligned(p.v_dot) && Aligned(p.out_dot) &&
         VectorStrides(p.q_dot_strides) && VectorStrides(p.k_dot_strides) &&
         VectorStrides(p.v_dot_strides) && VectorStrides(p.out_dot_strides);
}

// The current device's compute capability, major * 10 + minor (0 if it
// cannot be read). The query runs once per device; after that a launch pays
// one cudaGetDevice.
int DeviceArch() {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    if (const int known = cache[device].load(std::memory_order_relaxed); known != 0) return known;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return 0;
  const int arch = major * 10 + minor;
  if (cached) cache[device].store(arch, std::memory_order_relaxed);
  return arch;
}

// The compute capability the routing follows: the device's, lowered by
// JAX_FLASH_FORCE_PATH (see the top of this file); 0 routes everything to
// the exact kernels.
int RoutingArch() {
  const int arch = DeviceArch();
  const char* v = std::getenv("JAX_FLASH_FORCE_PATH");
  if (v == nullptr || *v == 0) return arch;
  if (std::strcmp(v, "sm80") == 0) return arch < 80 ? arch : 80;
  if (std::strcmp(v, "sm75") == 0) return arch < 75 ? arch : 75;
  if (std::strcmp(v, "exact") == 0) return 0;
  return arch;
}

// What this build holds (cmake/cuda_sources.cmake): the sm80 family (and
// the JVP's) needs an sm_80+ architecture in the build, sm90 sm_90a code and
// a Hopper GPU (sm_90a code runs on compute capability 9.0 alone), the
// Turing family the architecture 75.
#ifdef JAX_FLASH_HAS_SM80
constexpr bool kHasSm80 = true;
#else
constexpr bool kHasSm80 = false;
#endif
#ifdef JAX_FLASH_HAS_SM90A
constexpr bool kHasSm90a = true;
#else
constexpr bool kHasSm90a = false;
#endif
#ifdef JAX_FLASH_HAS_SM75
constexpr bool kHasSm75 = true;
#else
constexpr bool kHasSm75 = false;
#endif

// The tensor-core family for a problem the tensor cores support.
KernelPath TensorCorePath(int arch, DType dtype, bool sm90_runs_it) {
  if (kHasSm90a && arch == 90 && sm90_runs_it) return KernelPath::kSm90;
  if (kHasSm80 && arch >= 80) return KernelPath::kSm80;
  if (kHasSm75 && arch >= 75 && dtype == DType::kFloat16) return KernelPath::kSm75;
  return KernelPath::kExact;
}

bool InSm90FwdBuckets(int bucket) {
#define JAX_FLASH_BUCKET(D) \
  if (bucket == (D)) return true;
  JAX_FLASH_FOR_EACH_SM90_FWD_BUCKET(JAX_FLASH_BUCKET)
#undef JAX_FLASH_BUCKET
  return false;
}

bool InSm90BwdBuckets(int bucket) {
#define JAX_FLASH_BUCKET(D) \
  if (bucket == (D)) return true;
  JAX_FLASH_FOR_EACH_SM90_BWD_BUCKET(JAX_FLASH_BUCKET)
#undef JAX_FLASH_BUCKET
  return false;
}

// A block-sparse mask on the tensor cores: through the tile map that
// flash_attention folds it into (its hidden cells empty; contract.h), whose
// empty cells the wgmma kernels and the mma.sync kTerms ones skip. That is
// the whole mask only where every block of theirs lies in one cell: the
// whole problem's positions (no offsets), one block mask for every head (the
// map has one head), and block sizes that divide the cell (every mma.sync
// tile: sm80/tile_size.h's static_asserts; the wgmma tiles of
// sm90::TilesInCells). Anywhere else the exact kernels.
bool TileMapHoldsBlockMask(const FwdParams& p) {
  const MaskParams& m = p.mask;
  return m.tile_map != nullptr && m.offsets == nullptr && m.block_strides.head == 0;
}

bool Sm90TakesBlockMask(const FwdParams& p) {
  return TileMapHoldsBlockMask(p) &&
         sm90::TilesInCells(HeadDimBucket(p.shape.head_dim), static_cast<int>(kBlockMaskBlock));
}

// The sm90 kernels take dropout and a bias (the forward's bias as TMA
// tiles, sm90/bias_tile.cuh; each declines to the mma.sync kTerms kernels
// where its variants stop: sm90/fwd.cuh, sm90::BwdTakesTerms), and a dense mask
// with a tile map, testing it per element in the cells the map leaves
// partial (MaskTile). Without a map every tile would read the mask from
// global memory per element, which the mma.sync kernels' staging does better.
bool Sm90Supports(const FwdParams& p) {
  return (p.mask.dense == nullptr || p.mask.tile_map != nullptr) &&
         (p.mask.block == nullptr || Sm90TakesBlockMask(p));
}

// ===========================================================================
// Launching a chosen path: dtype and bucket as template arguments.

template <typename Fn>
cudaError_t ByDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat64: return fn(double{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

// fn(std::integral_constant<int, bucket>) for a bucket compiled for the arch
// path (and direction), cudaErrorNotSupported for any other.
template <int kArch, bool kFwd, typename Fn>
cudaError_t ByBucket(int bucket, Fn&& fn) {
#define JAX_FLASH_CASE(D) \
  case (D):               \
    return fn(std::integral_constant<int, (D)>{});
  if constexpr (kArch == 90 && kFwd) {
    switch (bucket) { JAX_FLASH_FOR_EACH_SM90_FWD_BUCKET(JAX_FLASH_CASE) default: break; }
  } else if constexpr (kArch == 90) {
    switch (bucket) { JAX_FLASH_FOR_EACH_SM90_BWD_BUCKET(JAX_FLASH_CASE) default: break; }
  } else if constexpr (kArch == 75) {
    switch (bucket) { JAX_FLASH_FOR_EACH_SM75_BUCKET(JAX_FLASH_CASE) default: break; }
  } else {
    switch (bucket) { JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_CASE) default: break; }
  }
#undef JAX_FLASH_CASE
  return cudaErrorNotSupported;
}

// fn(std::bool_constant<kTerms>) with kTerms = HasScoreTerms(params); the
// sm90 path has no kTerms kernels (FwdPath and BwdPath do not choose it then).
template <int kArch, typename Fn>
cudaError_t ByTerms(const FwdParams& params, Fn&& fn) {
  if constexpr (kArch != 90) {
    if (HasScoreTerms(params)) return fn(std::true_type{});
  }
  return fn(std::false_type{});
}

template <int kArch>
cudaError_t RunFwdPath(const FwdParams& params, DType dtype, void* workspace,
                       cudaStream_t stream) {
  return ByBucket<kArch, true>(HeadDimBucket(params.shape.head_dim), [&](auto bucket) {
    return ByTerms<kArch>(params, [&](auto terms) {
      constexpr int kBucket = decltype(bucket)::value;
      constexpr bool kTerms = decltype(terms)::value;
      if constexpr (kArch == 75) {  // float16 only (TensorCorePath)
        return RunFwd<kArch, __half, kBucket, kTerms>(params, workspace, stream);
      } else {
        return dtype == DType::kBFloat16
                   ? RunFwd<kArch, __nv_bfloat16, kBucket, kTerms>(params, workspace, stream)
                   : RunFwd<kArch, __half, kBucket, kTerms>(params, workspace, stream);
      }
    });
  });
}

template <int kArch>
cudaError_t RunBwdPath(const BwdParams& params, DType dtype, void* workspace, bool deterministic,
                       cudaStream_t stream) {
  return ByBucket<kArch, false>(HeadDimBucket(params.shape.head_dim), [&](auto bucket) {
    return ByTerms<kArch>(params, [&](auto terms) {
      constexpr int kBucket = decltype(bucket)::value;
      constexpr bool kTerms = decltype(terms)::value;
      if constexpr (kArch == 75) {  // float16 only (TensorCorePath)
        return RunBwd<kArch, __half, kBucket, kTerms>(params, workspace, deterministic, stream);
      } else {
        return dtype == DType::kBFloat16
                   ? RunBwd<kArch, __nv_bfloat16, kBucket, kTerms>(params, workspace,
                                                                   deterministic, stream)
                   : RunBwd<kArch, __half, kBucket, kTerms>(params, workspace, deterministic,
                                                            stream);
      }
    });
  });
}

template <int kArch>
cudaError_t RunJvpPath(const JvpParams& params, DType dtype, cudaStream_t stream) {
  static_assert(kArch == 75 || kArch == 80, "the JVP runs on mma.sync alone");
  return ByBucket<kArch, true>(HeadDimBucket(params.shape.head_dim), [&](auto bucket) {
    return ByTerms<kArch>(params, [&](auto terms) {
      constexpr int kBucket = decltype(bucket)::value;
      constexpr bool kTerms = decltype(terms)::value;
      if constexpr (kArch == 75) {  // float16 only (TensorCorePath)
        return RunJvp<kArch, __half, kBucket, kTerms>(params, stream);
      } else {
        return dtype == DType::kBFloat16
                   ? RunJvp<kArch, __nv_bfloat16, kBucket, kTerms>(params, stream)
                   : RunJvp<kArch, __half, kBucket, kTerms>(params, stream);
      }
    });
  });
}

// Bytes the tensor-core backward needs of the workspace (after delta).
size_t TensorCoreBwdWorkspaceBytes(const AttentionShape& shape, bool deterministic) {
  switch (HeadDimBucket(shape.head_dim)) {
#define JAX_FLASH_CASE(D) \
  case (D):               \
    return Lse2AndDqAccumBytes<(D)>(shape, deterministic);
    JAX_FLASH_FOR_EACH_BUCKET(JAX_FLASH_CASE)
#undef JAX_FLASH_CASE
    default:
      return 0;
  }
}

}  // namespace

// ===========================================================================
// THE ROUTING DECISION.

KernelPath FwdPath(const FwdParams& params, DType dtype) {
  if (!TensorCoresSupport(params, dtype)) return KernelPath::kExact;
  if (params.mask.block != nullptr && !TileMapHoldsBlockMask(params)) return KernelPath::kExact;
  const bool sm90 =
      Sm90Supports(params) && InSm90FwdBuckets(HeadDimBucket(params.shape.head_dim));
  return TensorCorePath(RoutingArch(), dtype, sm90);
}

// kSm90 runs on the sm_80 kernels where TMA cannot address Q, dO, K or V
// (fwd.cuh, bwd/run.cuh).
KernelPath BwdPath(const BwdParams& params, DType dtype, bool deterministic) {
  if (!TensorCoresSupport(params, dtype)) return KernelPath::kExact;
  // A reproducible dbias summed over CTAs needs a fixed-order reduction the
  // tensor-core kernels do not have yet; the exact dbias kernel has one. (No
  // dbias wanted: nothing is summed.)
  if (deterministic && params.dbias != nullptr && !DbiasHasOneWriter(params))
    return KernelPath::kExact;
  if (params.mask.block != nullptr && !TileMapHoldsBlockMask(params)) return KernelPath::kExact;
  const bool sm90 =
      Sm90Supports(params) && InSm90BwdBuckets(HeadDimBucket(params.shape.head_dim));
  return TensorCorePath(RoutingArch(), dtype, sm90);
}

// The forward-mode derivative: mma.sync on every sm_80+ GPU, Hopper included
// (no wgmma JVP yet), and on the Turing family (float16); dense mask,
// dropout and a block mask in the tile map included (kTerms), a bias not
// (the exact JVP kernel takes it).
KernelPath JvpPath(const JvpParams& params, DType dtype) {
  if (!TensorCoresSupport(params, dtype) || params.score.bias != nullptr ||
      (params.mask.block != nullptr && !TileMapHoldsBlockMask(params)))
    return KernelPath::kExact;
  return TensorCorePath(RoutingArch(), dtype, /*sm90_runs_it=*/false);
}
// ===========================================================================

size_t FwdWorkspaceBytes() { return sm90::PersistentScheduler::kWorkspaceBytes; }

cudaError_t LaunchFwd(const FwdParams& params, DType dtype, void* workspace,
                      cudaStream_t stream) {
  if (workspace == nullptr) return cudaErrorInvalidValue;
  switch (FwdPath(params, dtype)) {
#ifdef JAX_FLASH_HAS_SM80
    case KernelPath::kSm90: return RunFwdPath<90>(params, dtype, workspace, stream);
    case KernelPath::kSm80: return RunFwdPath<80>(params, dtype, workspace, stream);
#endif
#ifdef JAX_FLASH_HAS_SM75
    case KernelPath::kSm75: return RunFwdPath<75>(params, dtype, workspace, stream);
#endif
    default: break;
  }
  return ByDType(dtype, [&](auto tag) { return RunExactFwd<decltype(tag)>(params, stream); });
}

cudaError_t LaunchJvp(const JvpParams& params, DType dtype, cudaStream_t stream) {
  switch (JvpPath(params, dtype)) {
#ifdef JAX_FLASH_HAS_SM80
    case KernelPath::kSm80: return RunJvpPath<80>(params, dtype, stream);
#endif
#ifdef JAX_FLASH_HAS_SM75
    case KernelPath::kSm75: return RunJvpPath<75>(params, dtype, stream);
#endif
    default: break;
  }
  return ByDType(dtype, [&](auto tag) { return RunExactJvp<decltype(tag)>(params, stream); });
}

size_t BwdWorkspaceBytes(const AttentionShape& shape, DType dtype, bool deterministic) {
  size_t bytes = DeltaBytes(shape, dtype == DType::kFloat64 ? sizeof(double) : sizeof(float));
  // Enough for the tensor-core kernels whenever the shape alone allows them;
  // the buffers decide at launch (BwdPath), and the exact kernels need only
  // delta.
  if (TensorCoresSupport(shape, dtype)) {
    bytes += RoundUp(TensorCoreBwdWorkspaceBytes(shape, deterministic), kWorkspacePartAlignment);
  }
  return bytes > 0 ? bytes : kWorkspacePartAlignment;
}

cudaError_t LaunchBwd(const BwdParams& params, DType dtype, void* workspace, bool deterministic,
                      cudaStream_t stream) {
  BwdParams p = params;
  // The workspace starts with delta; the rest (if any) belongs to the
  // tensor-core kernels.
  p.delta = workspace;
  void* rest = static_cast<char*>(workspace) +
               DeltaBytes(p.shape, dtype == DType::kFloat64 ? sizeof(double) : sizeof(float));
  switch (BwdPath(p, dtype, deterministic)) {
#ifdef JAX_FLASH_HAS_SM80
    case KernelPath::kSm90: {
      // A problem with score terms that bwd/run.cuh declines mid-way (the
      // wgmma kernels after its TMA check): the exact backward computes
      // everything afresh.
      const cudaError_t err = RunBwdPath<90>(p, dtype, rest, deterministic, stream);
      if (err != cudaErrorNotSupported || !HasScoreTerms(p)) return err;
      break;
    }
    case KernelPath::kSm80: return RunBwdPath<80>(p, dtype, rest, deterministic, stream);
#endif
#ifdef JAX_FLASH_HAS_SM75
    case KernelPath::kSm75: return RunBwdPath<75>(p, dtype, rest, deterministic, stream);
#endif
    default: break;
  }
  // The exact backward is deterministic by construction, whatever was asked.
  return ByDType(dtype, [&](auto tag) { return RunExactBwd<decltype(tag)>(p, stream); });
}

}  // namespace jax_flash::cuda

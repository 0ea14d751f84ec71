// What the dispatch decides, for the kernel drivers in tests/gpu: which
// kernel family and arch path a problem takes (cuda/dispatch.cu is the one
// place that decides it; launch.h runs it).
#pragma once

#include "cuda/launch.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

enum class KernelPath {
  kExact,  // SIMT, IEEE arithmetic (simt/)
  kSm80,   // tensor cores through mma.sync (sm80/), every sm_80+ GPU
  kSm90,   // tensor cores through wgmma and TMA (sm90/), sm_90a builds on Hopper
  kSm75,   // float16 tensor cores through mma.sync m16n8k8 (sm80/ for compute_75), Turing
};

// The path LaunchFwd / LaunchBwd / LaunchJvp take for this problem on the current device.
KernelPath FwdPath(const FwdParams& params, DType dtype);
KernelPath BwdPath(const BwdParams& params, DType dtype, bool deterministic);
KernelPath JvpPath(const JvpParams& params, DType dtype);

}  // namespace jax_flash::cuda

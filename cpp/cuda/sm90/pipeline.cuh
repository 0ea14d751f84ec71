// The synchronisation of warp-specialized Hopper kernels (sm_90a): a ring of
// shared-memory stages guarded by mbarriers, named barriers for the order in
// which consumer warpgroups issue their GEMMs, and setmaxnreg to move
// registers from the producer warpgroup to the consumers.
//
// A stage's two barriers:
//   full:  the producer's one arrive.expect_tx, plus the TMA bytes; its phase
//          completes when the stage's data has landed.
//   empty: one arrival per consumer warp once that warp's warpgroup no longer
//          reads the stage (after the wgmma.wait_group that covers the GEMMs
//          reading it).
// Use k of a stage (k = 0, 1, ...) waits for phase k of full (parity k % 2);
// the producer, before its fill k, waits for phase k - 1 of empty, i.e. parity
// (k % 2) ^ 1: a fresh barrier counts as having completed the phase before
// phase 0, so the first fill of every stage passes at once. (Waits are
// tma.cuh's MbarrierWait. A variant that trapped after a few seconds of
// waiting, against hangs, made ptxas spill the consumers heavily and
// serialize their wgmmas (C7512): hangs are left to the drivers' timeouts.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm90/tma.cuh"

namespace jax_flash::cuda::sm90 {

// The named barrier ids of the warp-specialized forward with N consumer
// warpgroups (0 is __syncthreads'), laid out in one place: the ping-pong
// ring's turn of each warpgroup (mainloop_fwd_ws.cuh, PingPong), the tile
// index's full and empty per warpgroup (TileIndexHandoff), each
// warpgroup's out staging tile (epilogue_fwd.cuh), and every consumer
// thread's before out is staged over V (fwd_ws.cuh, FwdWsSmem::kOOverV).
template <int kConsumerWarpgroups>
struct FwdWsBarrierIds {
  static constexpr int kTurn = 1;
  static constexpr int kIndexFull = kTurn + kConsumerWarpgroups;
  static constexpr int kIndexEmpty = kIndexFull + kConsumerWarpgroups;
  static constexpr int kEpilogue = kIndexEmpty + kConsumerWarpgroups;
  static constexpr int kVRead = kEpilogue + kConsumerWarpgroups;
  static_assert(kVRead < 16, "16 named barriers per CTA");
};

// A position in a ring of kStages stages: the number of fills (producer) or
// uses (consumer) so far; its stage and the parity of that stage's use. One
// counter rather than (stage, phase): the consumers keep two positions live
// (K of block n, V of block n - 1), and registers are what they lack.
template <int kStages>
struct RingPos {
  uint32_t count = 0;
  __device__ __forceinline__ int stage() const { return static_cast<int>(count % kStages); }
  __device__ __forceinline__ uint32_t phase() const { return (count / kStages) & 1; }
  __device__ __forceinline__ void Advance() { ++count; }
};

// One arrival (count 1) of this thread.
__device__ __forceinline__ void ArriveBarrier(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Named barriers (bar.sync / bar.arrive with an id and a thread count): id 0
// is __syncthreads'; kernels number theirs from 1.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Registers per thread of this warpgroup from here on. Takes effect only in a
// kernel with a register cap at entry (__launch_bounds__(threads, 1)) and
// when every warp of the warpgroup executes it.
template <int kRegs>
__device__ __forceinline__ void SetMaxRegsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxRegsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace jax_flash::cuda::sm90

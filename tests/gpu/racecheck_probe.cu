// Does compute-sanitizer's racecheck follow a shared slot handed from one
// warp to two warpgroups through barriers? The sm90 ws forward hands its
// tile index over this way (sm90/mainloop_fwd_ws.cuh, TileIndexHandoff), and
// racecheck reports that slot's accesses as hazards. A producer warp hands 64
// indices to two consumer warpgroups through one shared slot:
//   mode 0: named barriers as TileIndexHandoff (producer: sync empty, store,
//           arrive full; consumers: sync full, load, arrive empty)
//   mode 1: mbarriers, the handoff before it (store, arrive full; wait full,
//           load, __syncwarp, lane 0 arrives empty)
//   mode 2: named barriers with bar.sync on both sides: race-free by any
//           reading of the PTX memory model
// Measured (H100, CUDA 13.0, 2026-11-24): racecheck reports hazards between
// the load and the store in all three modes, the control included, so it
// cannot tell a correct handoff between warps on a named barrier with a
// thread count from a racy one (cpp/cuda/NOTES_sm90_fwd.md).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe tests/gpu/racecheck_probe.cu
//   for m in 0 1 2; do compute-sanitizer --tool racecheck /tmp/probe $m; done
#include <cstdio>
#include <cstdint>
#include <cstdlib>
__device__ void BarSync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ void BarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ void MbInit(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(Smem(b)), "r"(n) : "memory");
}
__device__ void MbArrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(Smem(b)) : "memory");
}
__device__ void MbWait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred d;\nW_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}" ::"r"(Smem(b)),
      "r"(parity)
      : "memory");
}
__global__ void Handoff(int mode, int n, int* out) {
  __shared__ volatile int slot;
  __shared__ uint64_t full, empty;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    MbInit(&full, 1);
    MbInit(&empty, 8);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  if (warp >= 1 && warp < 4) return;  // the rest of the producer warpgroup
  if (warp == 0) {  // producer warp
    for (int k = 0; k <= n; ++k) {
      if (mode == 1) {
        if (k > 0) MbWait(&empty, (k - 1) & 1);
        if (lane == 0) { slot = k; MbArrive(&full); }
        continue;
      }
      if (k > 0 && mode != 2) { BarSync(3, 160); BarSync(4, 160); }
      if (lane == 0) slot = k;
      if (mode == 2) { BarSync(1, 160); BarSync(2, 160); }
      else { BarArrive(1, 160); BarArrive(2, 160); }
      if (mode == 2) { BarSync(3, 160); BarSync(4, 160); }
    }
    if (mode == 0) { BarSync(3, 160); BarSync(4, 160); }
    return;
  }
  const int wg = warp / 4 - 1;  // 0 or 1
  int sum = 0;
  for (int k = 0;; ++k) {
    int v;
    if (mode == 1) {
      MbWait(&full, k & 1);
      v = slot;
      __syncwarp();
      if (lane == 0) MbArrive(&empty);
    } else {
      BarSync(1 + wg, 160);
      v = slot;
      if (mode == 2) BarSync(3 + wg, 160); else BarArrive(3 + wg, 160);
    }
    if (v >= n) break;
    sum += v;
    for (int i = 0; i < 200; ++i) sum = sum * 3 + i;  // some work between takes
  }
  if (lane == 0) atomicAdd(out, sum & 1);
}
int main(int argc, char** argv) {
  int mode = atoi(argv[1]);
  int* out; cudaMalloc(&out, 4); cudaMemset(out, 0, 4);
  Handoff<<<4, 384>>>(mode, 64, out);
  cudaError_t e = cudaDeviceSynchronize();
  printf("mode %d: %s\n", mode, cudaGetErrorString(e));
  return 0;
}

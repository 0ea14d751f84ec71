// A persistent tile scheduler for the warp-specialized Hopper forward: one CTA
// per SM (at most one per tile), each taking tiles of one fixed order as it
// goes: its first is blockIdx.x, each next one the next not yet taken (an
// atomic counter in the workspace, asked when the CTA starts a tile), so a
// CTA's next tile is loaded while it still finishes the last one, and a CTA
// that drew short tiles takes more of them. Handed out round-robin instead
// (tile blockIdx.x + i * gridDim.x), the causal tiles left the CTAs
// unevenly loaded: the longest CTA had 1.10-1.15x the mean work at D = 128
// and 1.3-1.4x with the 64-key blocks of D = 256 (a model of the order;
// cpp/cuda/NOTES_sm90_fwd.md).
//
// The order: (batch, q head) pairs are cut into sections whose K and V fit
// in a share of L2 together, sections one after the other; inside a section
// query blocks go from the last to the first (with a causal mask the last
// see the most keys: longest first, the short ones fill the tail), and for
// each query block every (batch, head) of the section. The CTAs running at a
// time then share the K/V of a few heads instead of streaming every head's.
// Pairs go heads fastest, or batch fastest where a bias broadcasts over the
// batch (TileOrder::kBatchInner): the batch's CTAs then read each bias tile
// together, once from DRAM.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda/common/tile_scheduler.cuh"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda::sm90 {

struct PersistentScheduler {
  // The share of L2 (bytes) one section's K and V may take. 8 MB, against
  // FA3's 32 MB on a 50 MB L2: with 32 MB the non-causal forwards read K and
  // V from DRAM 1.7-2.7 times over (D = 64 S = 1k: 437 MB where 264 is
  // the minimum; D = 128 S = 16k: 729 against 271) at the same cycles per
  // call, which at the power limit costs 1-6% of the time (H200). Under a
  // causal mask 32 MB: there 8 MB was 2-5% slower at 2k-16k, 16 MB 1-3%
  // (cpp/cuda/NOTES_sm90_fwd_power.md, "K and V from DRAM once").
  // Tuning hook: -DJAX_FLASH_TUNE_FWD_SECTION_MB=<n> (both).
  static int64_t SectionBytes(bool causal) {
#ifdef JAX_FLASH_TUNE_FWD_SECTION_MB
    return int64_t{JAX_FLASH_TUNE_FWD_SECTION_MB} << 20;
#else
    return (causal ? 32ll : 8ll) << 20;
#endif
  }

  // Per-launch constants (plain ints: the tile count is checked to fit).
  struct Args {
    int m_blocks;             // query blocks per (batch, head)
    int tiles;                // m_blocks * pairs
    bool batch_inner;         // pairs batch fastest (b = pair % batch), else heads fastest
    FastDivisor inner;        // the pairs' inner dim: batch or q heads
    SectionedOrder order;
  };

  // False when the tile count does not fit an int.
  static bool MakeArgs(int64_t m_blocks, const AttentionShape& s, bool causal, TileOrder order,
                       Args* a) {
    const int64_t pairs = s.batch * s.num_heads_q;
    if (pairs <= 0) return false;  // the caller launches nothing then
    if (m_blocks * pairs > INT32_MAX / 2) return false;  // NextIndex's indices fit too
    // K and V bytes per q head: a GQA group shares them.
    const int64_t kv_bytes = 2 * s.seqlen_k * s.head_dim * 2 / s.group_size();
    const int64_t section = SectionedOrder::SectionPairs(SectionBytes(causal), kv_bytes, pairs);
    a->m_blocks = static_cast<int>(m_blocks);
    a->tiles = static_cast<int>(m_blocks * pairs);
    a->batch_inner = order == TileOrder::kBatchInner;
    a->inner = FastDivisor::Of(static_cast<int>(a->batch_inner ? s.batch : s.num_heads_q));
    a->order =
        SectionedOrder::Make(a->m_blocks, static_cast<int>(section), static_cast<int>(pairs));
    return true;
  }

  // The workspace (cuda::FwdWorkspaceBytes): the counter, padded to 16 bytes.
  static constexpr size_t kWorkspaceBytes = 16;

  static dim3 Grid(const Args& a, int sms) {
    return dim3(static_cast<unsigned>(a.tiles < sms ? a.tiles : sms));
  }

  // The counter NextIndex counts with: zero before every launch.
  static cudaError_t ResetCounter(int* counter, cudaStream_t stream) {
    return cudaMemsetAsync(counter, 0, sizeof(int), stream);
  }
  // The index of a CTA's next tile (at or past Args::tiles once all are
  // taken; each CTA asks once more than it has tiles, so the counter stays
  // below tiles + gridDim.x).
  __device__ __forceinline__ static int NextIndex(int* counter) {
    return static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
  }

  // Tile `index` of the order above; index < a.tiles.
  // (Host code too: tests/host/fast_divisor_check.cu walks it.)
  __host__ __device__ __forceinline__ static QueryBlockScheduler::Tile Get(const Args& a,
                                                                           int index) {
    const SectionedPosition at = a.order.At(index);
    const int outer = a.inner.Divide(at.pair);
    const int inner = at.pair - outer * a.inner.divisor;
    QueryBlockScheduler::Tile tile;
    tile.m_block = a.m_blocks - 1 - at.block;
    tile.b = a.batch_inner ? inner : outer;
    tile.h = a.batch_inner ? outer : inner;
    return tile;
  }
};

// The number of SMs of the current device (queried once per device).
inline int SmCount() {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device >= 0 && device < kCachedDevices && cache[device].load(std::memory_order_relaxed) > 0)
    return cache[device].load(std::memory_order_relaxed);
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms < 1)
    return 1;
  if (device >= 0 && device < kCachedDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace jax_flash::cuda::sm90

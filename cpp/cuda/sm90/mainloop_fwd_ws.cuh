// The warp-specialized Hopper forward's mainloop (FlashAttention-3's
// structure, our code): the producer's loads and the consumers' GEMMs and
// softmax for one tile of kBlockM query rows, all K/V blocks of its key range.
//
// Producer (warp 0, one lane issuing): per tile, Q by TMA once into a ring
// of kQStages buffers, then K and V of every block into the ring of kStages
// stages (sm90/pipeline.cuh), each behind its stage's empty barrier. With two
// Q buffers the next tile's Q is loaded as soon as this tile's last K/V load
// is issued, not after the consumers' last S GEMM of this tile: at tile
// boundaries the consumers then find Q there. The producer also picks the
// tiles (sm90/scheduler_persistent.cuh) and hands each tile's index to the
// consumers (TileIndexHandoff: a shared slot between two named barriers) as
// soon as the tile's Q stage is free, so that the consumers know the tile
// (and work out its key range) while its Q still loads. A tile with no key
// to see gets a Q stage without Q (full_q then completes on the producer's
// arrival alone), and an index past the last tile ends the consumers.
//
// Consumers (warpgroups 1.., 64 query rows each, all reading the same K/V
// stages), per tile, with P of block n - 1 kept in registers:
//   S_0 = Q K_0^T; P_0 = softmax(S_0)
//   for n = 1..: issue S_n = Q K_n^T, issue O += P_{n-1} V_{n-1};
//                wait S_n; release K_n; softmax(S_n) (O untouched);
//                wait O;   release V_{n-1}; O *= alpha if the max moved
//   O += P_last V_last
// so the tensor cores run this warpgroup's O += P V under its own softmax
// (intra-warpgroup overlap). Between the warpgroups, named barriers hand
// the right to issue GEMMs on (ping-pong; a ring with three): one issues its
// pair of GEMMs, then lets the next issue while it does its softmax, so one's
// softmax overlaps the others' GEMMs.
//
// A bias comes as tiles through TMA (sm90/bias_tile.cuh: float32, or the
// inputs' 16-bit type), one stage per consumer warpgroup (its 64 rows; 2 x 32
// KiB of float32 at kBlockN = 128, half that in 16 bits), loaded
// by the producer after K and released by that warpgroup alone, so neither
// waits for the other's reads. Its ring advances with the K/V ring (one use
// per key block), so the K/V ring's count gives its phase.
//
// Every score policy is common/score.cuh's (TransformAndMask), the softmax
// common/softmax.cuh's, the epilogue common/epilogue_fwd.cuh's: the semantics
// (masks, soft cap, NaN, rows that see nothing) are the other kernels'.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/dropout.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/fwd.cuh"
#include "cuda/common/score.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/sm90/bias_tile.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/scheduler_persistent.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace jax_flash::cuda::sm90 {

// The kernel's parameters: Q, K and V through TMA in boxes of 64 columns x
// kBlockM (Q) or kBlockN (K, V) rows; with a bias, its map in boxes of 64
// rows (one consumer warpgroup's); out in boxes of 64 x 64, stored by TMA
// where the staging tiles fit (FwdWsSmem::kStageO, sm90/epilogue_fwd.cuh).
struct FwdWsArgs {
  FwdArgs args;
  CUtensorMap q_map, k_map, v_map;
  CUtensorMap bias_map;
  CUtensorMap o_map;
  PersistentScheduler::Args sched;
  int* tile_counter;  // zeroed before the launch (PersistentScheduler::ResetCounter)
};

// Shared-memory addresses: Q (kBlockM rows), the K and V rings, where it fits
// (kOApart) each consumer warpgroup's out staging tile (64 rows), with a bias
// (Bias: its tile type, void without) its two warpgroup stages, then the
// barriers and the tile index (and barrier_o with kOOverV).
template <typename Traits, typename Bias>
struct FwdWsSmem {
  // Barriers: per Q stage full_q, empty_q; per K/V stage full_k, empty_k,
  // full_v, empty_v; per consumer warpgroup full_bias, empty_bias; then the
  // tile index (4 bytes, 16 kept); with kOOverV barrier_o.
  static constexpr int kKvBars = 16 * Traits::kQStages;
  static constexpr int kBiasBars = kKvBars + 32 * Traits::kStages;
  static constexpr int kTileIndex = kBiasBars + 16 * Traits::kConsumerWarpgroups;
  static constexpr int kBarrierO = kTileIndex + 16;
  static constexpr int kBiasBytes = Traits::kConsumerWarpgroups * kBiasTileBytes<Bias>;
  static constexpr int kOTileBytes = 64 * Traits::kSmemCols * 2;  // one warpgroup's rows
  static constexpr int kOBytes = Traits::kConsumerWarpgroups * kOTileBytes;
  // Out through staging tiles and TMA: apart from the rings where they fit
  // (D <= 192 but beside a float32 bias's stages at D = 96 / 128), else,
  // without a bias, over the V ring's first stages (FlashAttention-3's smem_o
  // over smem_v: D = 256), their order kept by barrier_o and the kVRead
  // barrier (tests/gpu/ws_pipeline_model.py, O_OVER_V; FwdWsKernel's
  // epilogue). The bias kernels keep the threads' stores: over V, the
  // D = 128 float32 one reloads a spilled register in its key loop (ptxas).
  static constexpr bool kOApart =
      Traits::kTileBytes + kOBytes + kBiasBytes + kBarrierO <= kMaxSmemBytes;
  static constexpr bool kOOverV = !kOApart && std::is_void_v<Bias> &&
                                  kOBytes <= Traits::kStages * Traits::kKvBytes;
  static constexpr bool kStageO = kOApart || kOOverV;
  static constexpr int kBarrierBytes = kBarrierO + (kOOverV ? 16 : 0);
  static constexpr int kBytes =
      Traits::kTileBytes + (kOApart ? kOBytes : 0) + kBiasBytes + kBarrierBytes;
  uint32_t q, k, v;  // tiles, 1024-byte aligned
  uint32_t o;        // with kStageO: one out staging tile per consumer warpgroup, 1024-byte aligned
  uint32_t bias;     // one Bias tile per consumer warpgroup
  uint32_t bars;
  __device__ __forceinline__ uint32_t full_q(int s) const { return bars + 16 * s; }
  __device__ __forceinline__ uint32_t empty_q(int s) const { return bars + 8 + 16 * s; }
  __device__ __forceinline__ uint32_t tile_index() const { return bars + kTileIndex; }
  // With kOOverV: every consumer warpgroup's store has read its out staging
  // tile (one arrival each, once per tile with keys).
  __device__ __forceinline__ uint32_t barrier_o() const { return bars + kBarrierO; }
  __device__ __forceinline__ uint32_t q_tile(int s) const { return q + s * Traits::kQBytes; }
  __device__ __forceinline__ uint32_t full_k(int s) const { return bars + kKvBars + 32 * s; }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return bars + kKvBars + 8 + 32 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return bars + kKvBars + 16 + 32 * s; }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return bars + kKvBars + 24 + 32 * s; }
  __device__ __forceinline__ uint32_t k_tile(int s) const { return k + s * Traits::kKvBytes; }
  __device__ __forceinline__ uint32_t v_tile(int s) const { return v + s * Traits::kKvBytes; }
  __device__ __forceinline__ uint32_t full_bias(int wg) const { return bars + kBiasBars + 16 * wg; }
  __device__ __forceinline__ uint32_t empty_bias(int wg) const {
    return bars + kBiasBars + 8 + 16 * wg;
  }
  __device__ __forceinline__ uint32_t bias_tile(int wg) const {
    return bias + wg * kBiasTileBytes<Bias>;
  }
  __device__ __forceinline__ uint32_t o_tile(int wg) const { return o + wg * kOTileBytes; }
  __device__ __forceinline__ static FwdWsSmem Carve(uint32_t smem_raw) {
    FwdWsSmem r;
    r.q = (smem_raw + kAtomBytes - 1) & ~(kAtomBytes - 1);
    r.k = r.q + Traits::kQStages * Traits::kQBytes;
    r.v = r.k + Traits::kStages * Traits::kKvBytes;
    r.o = kOOverV ? r.v : r.v + Traits::kStages * Traits::kKvBytes;
    r.bias = r.v + Traits::kStages * Traits::kKvBytes + (kOApart ? kOBytes : 0);
    r.bars = r.bias + kBiasBytes;
    return r;
  }

  // Thread 0, before the CTA barrier that precedes the role split.
  __device__ __forceinline__ void Init() const {
    for (int s = 0; s < Traits::kQStages; ++s) {
      MbarrierInit(full_q(s), 1);
      MbarrierInit(empty_q(s), Traits::kConsumerWarps);
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      MbarrierInit(full_k(s), 1);
      MbarrierInit(empty_k(s), Traits::kConsumerWarps);
      MbarrierInit(full_v(s), 1);
      MbarrierInit(empty_v(s), Traits::kConsumerWarps);
    }
    for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) {
      MbarrierInit(full_bias(wg), 1);
      MbarrierInit(empty_bias(wg), 4);  // the warpgroup's warps
    }
    if constexpr (kOOverV) MbarrierInit(barrier_o(), Traits::kConsumerWarpgroups);
    FenceBarrierInit();
  }
};

// ---- the tile index ---------------------------------------------------------------

// The producer warp hands each tile index to the consumer warpgroups through
// one shared slot between named barriers, as FlashAttention-3 does: the
// producer's lane 0 stores it and the warp arrives on each warpgroup's
// "full" barrier; a warpgroup syncs on its own, reads, and arrives on its
// "empty" barrier, on which the producer syncs (every warpgroup's) before its
// next store. A pair per warpgroup rather than one for all, so that neither
// waits at a tile boundary for the other to finish its tile (ping-pong lets
// one start the next tile's GEMMs during the other's last softmax).
// compute-sanitizer's racecheck reports the slot's accesses as hazards, as it
// does for a race-free handoff with bar.sync on both sides
// (tests/gpu/racecheck_probe.cu): it does not follow named barriers with a
// thread count.

// Barrier ids in registers, so ptxas reserves all 16 named barriers (one CTA
// per SM: nothing else wants them); immediate ids through a branch on the
// warpgroup made the consumers spill 200 B more at D = 128.
template <int kConsumerWarpgroups>
struct TileIndexHandoff {
  static constexpr int kThreads = 32 + 128;  // the producer warp and one warpgroup
  using Ids = FwdWsBarrierIds<kConsumerWarpgroups>;
  uint32_t slot;
  __device__ __forceinline__ static int FullBarrier(int wg) { return Ids::kIndexFull + wg; }
  __device__ __forceinline__ static int EmptyBarrier(int wg) { return Ids::kIndexEmpty + wg; }
  // The producer warp, every lane; `first`: no index handed over before.
  __device__ __forceinline__ void Give(int index, bool first, int lane) const {
    if (!first) WaitEmpty();
    if (lane == 0) asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slot), "r"(index) : "memory");
#pragma unroll
    for (int wg = 0; wg < kConsumerWarpgroups; ++wg) NamedBarrierArrive(FullBarrier(wg), kThreads);
  }
  // The producer warp, after giving the index that ends the consumers.
  __device__ __forceinline__ void Finish() const { WaitEmpty(); }
  // Every thread of consumer warpgroup wg.
  __device__ __forceinline__ int Take(int wg) const {
    NamedBarrierSync(FullBarrier(wg), kThreads);
    int index;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(index) : "r"(slot) : "memory");
    NamedBarrierArrive(EmptyBarrier(wg), kThreads);
    return index;
  }

 private:
  __device__ __forceinline__ void WaitEmpty() const {
#pragma unroll
    for (int wg = 0; wg < kConsumerWarpgroups; ++wg) NamedBarrierSync(EmptyBarrier(wg), kThreads);
  }
};

// ---- producer ------------------------------------------------------------------

// Which kernels count their tiles from the last row (kTilesFromLastRow) and
// how many rows before row 0 their first tile starts (TileRowShift,
// FwdBlock::Make's m_shift): the causal kernels count their tiles from the last row, so that
// a tile with fewer than kBlockM rows is the first, which sees the fewest
// keys; counted from row 0 it was the last, whose missing rows' warpgroups
// computed a whole row of blocks for nothing (192-row tiles: 2k ends in a
// tile of 128 rows, 4k in one of 64). A multiple of 16, so that a warp's 16
// rows stay one of dropout's 16-row call blocks (common/dropout.cuh) and lie
// on one side of row 0; the last tile may then end up to 15 rows past
// seqlen_q.
template <typename Traits>
inline constexpr bool kTilesFromLastRow = Traits::kMask == FwdWsMask::kCausal;

template <typename Traits>
__device__ __forceinline__ int64_t TileRowShift(const FwdParams& p) {
  if constexpr (kTilesFromLastRow<Traits>) {
    const int64_t tail = p.shape.seqlen_q % Traits::kBlockM;
    return tail == 0 ? 0 : (Traits::kBlockM - tail) & ~int64_t{15};
  } else {
    return 0;
  }
}

// The producer warp: picks this CTA's tiles and issues every load of them, in
// the consumers' order, from lane 0; every lane runs the loop (its barrier
// waits and the tile handoff's named barriers).
// Bias: the bias's tile type (void without a bias): its own instantiation
// of the kernel, so that the plain one keeps its registers.
template <typename T, typename Traits, typename Bias>
__device__ __forceinline__ void FwdWsProducer(const FwdWsArgs& a, const FwdWsSmem<Traits, Bias>& sm,
                                              int lane) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kColBlocks = Traits::kSmemCols / kSwizzleElems;
  const FwdParams& p = a.args.p;
  const int group = static_cast<int>(p.shape.group_size());
  const bool issuer = lane == 0;
  const TileIndexHandoff<Traits::kConsumerWarpgroups> handoff{sm.tile_index()};
  RingPos<Traits::kStages> kv;
  RingPos<Traits::kQStages> q;
  uint32_t keyed_tiles = 0;  // tiles with keys loaded so far: barrier_o's phases (kOOverV)
  for (int index = blockIdx.x, first = 1;; first = 0) {
    const bool done = index >= a.sched.tiles;
    // The tile's key range before the wait, off the path from the stage's
    // release to its Q load.
    const QueryBlockScheduler::Tile tile = PersistentScheduler::Get(a.sched, done ? 0 : index);
    FwdBlock<T> blk = FwdBlock<T>::template Make<kBlockM, kBlockN, /*kTileMap=*/true>(
        p, tile, TileRowShift<Traits>(p));
    blk.mask.dense = nullptr;  // a dense mask runs on sm90/fwd.cuh (RunFwd)
    // The Q stage: after both consumer warpgroups' last S GEMM of the tile
    // that used it before (the previous tile with one buffer).
    MbarrierWait(sm.empty_q(q.stage()), q.phase() ^ 1);
    handoff.Give(index, first, lane);
    if (done) {  // that index ends the consumers
      handoff.Finish();
      return;
    }
    // Asked now, used once this tile's loads are issued.
    int next = 0;
    if (issuer) next = PersistentScheduler::NextIndex(a.tile_counter);
    if (blk.n_begin >= blk.n_end) {  // nothing to load: a Q stage without Q
      if (issuer) ArriveBarrier(sm.full_q(q.stage()));
      q.Advance();
      index = __shfl_sync(0xffffffffu, next, 0);
      continue;
    }
    const int b = static_cast<int>(tile.b), h = static_cast<int>(tile.h), h_kv = h / group;
    if (issuer) {
      MbarrierArriveExpectTx(sm.full_q(q.stage()), Traits::kQBytes);
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb)
        TmaLoadBox(sm.q_tile(q.stage()) + cb * kBlockM * kSwizzleBytes, &a.q_map,
                   cb * kSwizzleElems, static_cast<int>(blk.m0), h, b, sm.full_q(q.stage()));
    }
    q.Advance();
    // With out staged over V (FwdWsSmem::kOOverV) the tile's first V load
    // waits until the last tile with keys has stored its out: phase
    // keyed_tiles - 1 of barrier_o, the one phase that can be pending (tiles
    // without keys do not stage their out).
    bool wait_o = FwdWsSmem<Traits, Bias>::kOOverV && keyed_tiles > 0;
    // The key blocks the consumers step through (FwdBlock::NextBlock).
    for (int64_t n = blk.n_begin; n < blk.n_end;
         n = blk.template NextBlock<kBlockN>(n + 1)) {
      const int row = static_cast<int>(n * kBlockN);
      MbarrierWait(sm.empty_k(kv.stage()), kv.phase() ^ 1);
      if (issuer) {
        MbarrierArriveExpectTx(sm.full_k(kv.stage()), Traits::kKvBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          TmaLoadBox(sm.k_tile(kv.stage()) + cb * kBlockN * kSwizzleBytes, &a.k_map,
                     cb * kSwizzleElems, row, h_kv, b, sm.full_k(kv.stage()));
      }
      if constexpr (!std::is_void_v<Bias>) {  // each warpgroup's rows, once it has read the last
        for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) {
          MbarrierWait(sm.empty_bias(wg), (kv.count & 1) ^ 1);
          if (issuer)
            Bias::Load(sm.bias_tile(wg), &a.bias_map, p.score, row,
                       static_cast<int>(blk.m0) + 64 * wg, h, b, sm.full_bias(wg));
        }
      }
      if (wait_o) {
        MbarrierWait(sm.barrier_o(), (keyed_tiles - 1) & 1);
        wait_o = false;
      }
      MbarrierWait(sm.empty_v(kv.stage()), kv.phase() ^ 1);
      if (issuer) {
        MbarrierArriveExpectTx(sm.full_v(kv.stage()), Traits::kKvBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          TmaLoadBox(sm.v_tile(kv.stage()) + cb * kBlockN * kSwizzleBytes, &a.v_map,
                     cb * kSwizzleElems, row, h_kv, b, sm.full_v(kv.stage()));
      }
      kv.Advance();
    }
    ++keyed_tiles;
    index = __shfl_sync(0xffffffffu, next, 0);
  }
}

// ---- consumers -----------------------------------------------------------------

// Ping-pong between the consumer warpgroups (a ring when there are three):
// warpgroup w waits on its turn's named barrier (FwdWsBarrierIds::kTurn + w)
// before issuing its GEMMs and, once they are issued, arrives on the next
// one's. Every
// warpgroup passes the same number of issue points per tile (they share the
// tile's key blocks), so the arrivals pair up; the last warpgroup arrives
// once up front (warpgroup 0 goes first) and warpgroup 0 takes that extra
// arrival back at the end. tests/gpu/ws_pipeline_model.py checks the
// protocol with two and three.
inline constexpr int kPingThreads = 256;

template <int kWarpgroups>
struct PingPong {
  static_assert(kWarpgroups == 2 || kWarpgroups == 3, "two or three consumer warpgroups");
  static constexpr int kPingBarrier = FwdWsBarrierIds<kWarpgroups>::kTurn;
  int wg;  // consumer warpgroup, 0 .. kWarpgroups - 1
  __device__ __forceinline__ void Start() const {
    if (wg == kWarpgroups - 1) NamedBarrierArrive(kPingBarrier + 0, kPingThreads);
  }
  // Immediate barrier ids (a branch on the warp-uniform wg): as registers,
  // ptxas spilled the two ids at D=128 and reloaded them before every turn.
  __device__ __forceinline__ void WaitTurn() const { Turn<0, /*kPass=*/false>(); }
  __device__ __forceinline__ void PassTurn() const { Turn<0, /*kPass=*/true>(); }
  __device__ __forceinline__ void Finish() const {
    if (wg == 0) NamedBarrierSync(kPingBarrier + 0, kPingThreads);
  }

 private:
  // Warpgroup wg's wait on its barrier, or its arrival on the next one's,
  // for wg >= kW (the last one without a test).
  template <int kW, bool kPass>
  __device__ __forceinline__ void Turn() const {
    constexpr int kId = kPingBarrier + (kPass ? (kW + 1) % kWarpgroups : kW);
    if constexpr (kW + 1 < kWarpgroups) {
      if (wg != kW) return Turn<kW + 1, kPass>();
    }
    if constexpr (kPass)
      asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kPingThreads) : "memory");
    else
      asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kPingThreads) : "memory");
  }
};

// A descriptor the compiler must treat as new on every use, so that the
// k-steps' descriptors (base + a constant) are formed next to their wgmmas
// instead of being hoisted out of the loop as 16 live registers per GEMM,
// which the consumers do not have to spare (they spilled).
__device__ __forceinline__ uint64_t OpaqueDescriptor(uint32_t addr, uint32_t leading_bytes) {
  uint64_t desc = SmemDescriptor(addr, leading_bytes, kAtomBytes);
  asm volatile("" : "+l"(desc));
  return desc;
}

// S = Q K^T (this warpgroup's 64 rows x kBlockN keys), both operands K-major
// swizzled tiles (GemmKMajor's k-steps from two base descriptors). Not
// committed.
template <typename T, typename Traits>
__device__ __forceinline__ void IssueQK(float (&s)[Traits::kBlockN / kMmaN][4], uint32_t q_rows,
                                        uint32_t k_tile) {
  const uint64_t desc_q = OpaqueDescriptor(q_rows, 0);
  const uint64_t desc_k = OpaqueDescriptor(k_tile, 0);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / kMmaK; ++kk)
    WgmmaSS<T, 0>(s, DescriptorPlus(desc_q, KMajorOffset<Traits::kBlockM>(kk)),
                  DescriptorPlus(desc_k, KMajorOffset<Traits::kBlockN>(kk)), kk > 0);
}

// O += P V for one block: P (this warpgroup's 64 rows x kBlockN keys) from
// registers, V (kBlockN x kHeadDim, MN-major, 64-column blocks kBlockN rows
// apart: one wgmma per k-step, or an n64 and an n32 one at D = 96) from
// shared memory. Issued and
// committed, not waited for; the caller fences O (FenceRegisters) before the
// wgmma.fence that opens the group: an instruction that defines O between
// that fence and these wgmmas makes ptxas serialize every wgmma (C7513).
template <typename T, typename Traits>
__device__ __forceinline__ void IssuePV(float (&o)[Traits::kHeadDim / kMmaN][4],
                                        const uint32_t (&p)[Traits::kBlockN / kMmaK][4],
                                        uint32_t v_tile) {
  const uint64_t desc_v = OpaqueDescriptor(v_tile, Traits::kBlockN * kSwizzleBytes);
#pragma unroll
  for (int ks = 0; ks < Traits::kBlockN / kMmaK; ++ks) {
    // k-step ks = keys 16ks..16ks+15: two 8-row groups into every column block.
    WgmmaRSColumns<T, Traits::kHeadDim>(o, p[ks], DescriptorPlus(desc_v, ks * 2 * kAtomBytes),
                                        Traits::kBlockN * kSwizzleBytes, 1);
  }
  WgmmaCommit();
}

// Soft cap and mask (score.cuh) and the softmax of key block n: S becomes P
// (float). Returns whether O must be rescaled by alpha.
template <typename T, typename Traits>
__device__ __forceinline__ bool ScoresToP(float (&s)[1][Traits::kBlockN / kMmaN][4],
                                          float (&row_m)[1][2], float (&row_l)[1][2],
                                          float (&alpha)[1][2], const FwdArgs& args,
                                          const FwdBlock<T>& blk, int64_t warp_row0, int64_t n,
                                          int g, int t) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  if constexpr (Traits::kLightMask) {
    SoftCap(s, args.softcap, args.scale_over_cap);
    MaskEndsFragment(s[0], blk.mask, warp_row0, n * kBlockN, g, t, -INFINITY);
  } else {
    TransformAndMask<kBlockM>(s, args.softcap, args.scale_over_cap, blk.mask, blk.m0, warp_row0,
                              n * kBlockN, g, t, blk.template BlockClass<kBlockN>(n));
  }
  return OnlineSoftmaxDeferRescale(s, row_m, row_l, alpha, args.scale_log2,
                                   args.rescale_margin);
}

// P packed to 16 bits as the A operand of O += P V (k-step ks: keys
// 16ks..16ks+15). Only once the previous O += P V, which reads p, is done.
template <typename T, int kNTiles>
__device__ __forceinline__ void PackP(uint32_t (&p)[kNTiles / 2][4],
                                      const float (&s)[1][kNTiles][4]) {
#pragma unroll
  for (int ks = 0; ks < kNTiles / 2; ++ks) PackA<T>(p[ks], s[0][2 * ks], s[0][2 * ks + 1]);
}

// One consumer warpgroup's work on one tile: O, m, l of this warp's 16 rows.
// `kv` and `q` carry the ring positions from tile to tile. kDropout: P is
// dropped after the softmax (l sums it before, as on every backend), from
// keep bits drawn once P is packed (DropPackedRows); the kernel scales O by
// 1 / (1 - rate) in its epilogue.
template <typename T, typename Traits, typename Bias, bool kDropout>
__device__ __forceinline__ void FwdWsConsumerTile(
    const FwdWsArgs& a, const FwdWsSmem<Traits, Bias>& sm, const FwdBlock<T>& blk,
    const PingPong<Traits::kConsumerWarpgroups>& ping,
    int consumer_warp, int lane, int g, int t, RingPos<Traits::kStages>& kv,
    RingPos<Traits::kQStages>& q,
    float (&o)[1][Traits::kHeadDim / kMmaN][4], float (&row_m)[1][2], float (&row_l)[1][2]) {
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kNTiles = kBlockN / kMmaN;
  const FwdArgs& args = a.args;
  // The ring positions are the same in every lane; broadcast, the compiler
  // knows it, and keeps the stages' addresses and barriers in uniform
  // registers (without: about 50 more R2UR per tile's code at D = 64, and
  // 12-28 B of spill in the light kernels).
  kv.count = __shfl_sync(0xffffffffu, kv.count, 0);
  q.count = __shfl_sync(0xffffffffu, q.count, 0);
  const int64_t m0 = blk.m0, n_begin = blk.n_begin, n_end = blk.n_end;
  const int64_t warp_row0 = m0 + consumer_warp * 16;
  // This warpgroup's 64 rows of Q: row 64 * wg of every column block.
  const int q_stage = q.stage();
  const uint32_t q_rows = sm.q_tile(q_stage) + ping.wg * 64 * kSwizzleBytes;
  // One arrival per warp on an empty barrier, once the warpgroup's wait for
  // the GEMMs that read the stage has returned.
  auto release = [&](uint32_t bar) {
    if (lane == 0) ArriveBarrier(bar);
  };
  // With a bias: x = scale * S + bias for the block whose K stage is kv's.
  auto add_bias = [&](float (&s)[1][kNTiles][4]) {
    if constexpr (!std::is_void_v<Bias>) {
      MbarrierWait(sm.full_bias(ping.wg), kv.count & 1);
      Bias::Add(s[0], sm.bias_tile(ping.wg), (consumer_warp % 4) * 16,
                static_cast<float>(args.p.score.scale), g, t);
      release(sm.empty_bias(ping.wg));
    }
  };

  const HeadDropout dropout = kDropout ? HeadDropout::For(args.p.dropout, args.p.shape.batch,
                                                          blk.b, blk.h)
                                       : HeadDropout{};
  uint32_t p[kBlockN / kMmaK][4];  // P, packed: the A operand of O += P V
  // P = kept ? P : 0 on the packed P of key block n (common/dropout.cuh).
  auto drop = [&](int64_t n) {
    if constexpr (kDropout) DropPackedRows(p, dropout, warp_row0, n * kBlockN, g, t);
  };

  MbarrierWait(sm.full_q(q_stage), q.phase());
  q.Advance();
  float alpha[1][2];
  // The key block after the current one (the producer's order).
  int64_t next = blk.template NextBlock<kBlockN>(n_begin + 1);
  {
    MbarrierWait(sm.full_k(kv.stage()), kv.phase());
    float s[1][kNTiles][4];
    ping.WaitTurn();
    WgmmaFence();
    IssueQK<T, Traits>(s[0], q_rows, sm.k_tile(kv.stage()));
    WgmmaCommit();
    ping.PassTurn();
    WgmmaWait<0>();
    FenceRegisters(s[0]);
    release(sm.empty_k(kv.stage()));
    if (next == n_end) release(sm.empty_q(q_stage));
    add_bias(s);
    // O is still 0: no rescale whatever the softmax says.
    ScoresToP<T, Traits>(s, row_m, row_l, alpha, args, blk, warp_row0, n_begin, g, t);
    PackP<T>(p, s);
    drop(n_begin);
  }
  RingPos<Traits::kStages> prev = kv;  // the stage of V for P
  kv.Advance();
  for (int64_t n = next; n < n_end; n = next) {
    next = blk.template NextBlock<kBlockN>(n + 1);
    MbarrierWait(sm.full_k(kv.stage()), kv.phase());
    MbarrierWait(sm.full_v(prev.stage()), prev.phase());
    float s[1][kNTiles][4];
    ping.WaitTurn();
    FenceRegisters(o[0]);
    WgmmaFence();
    IssueQK<T, Traits>(s[0], q_rows, sm.k_tile(kv.stage()));
    WgmmaCommit();
    IssuePV<T, Traits>(o[0], p, sm.v_tile(prev.stage()));
    ping.PassTurn();
    WgmmaWait<1>();  // S_n (O += P V may still run)
    FenceRegisters(s[0]);
    release(sm.empty_k(kv.stage()));
    if (next == n_end) release(sm.empty_q(q_stage));
    add_bias(s);
    const bool rescale =
        ScoresToP<T, Traits>(s, row_m, row_l, alpha, args, blk, warp_row0, n, g, t);
    WgmmaWait<0>();  // O += P_{n-1} V_{n-1}
    FenceRegisters(o[0]);
    release(sm.empty_v(prev.stage()));
    if (rescale) RescaleO(o, alpha);
    PackP<T>(p, s);
    drop(n);
    prev = kv;
    kv.Advance();
  }
  MbarrierWait(sm.full_v(prev.stage()), prev.phase());
  FenceRegisters(o[0]);
  WgmmaFence();
  IssuePV<T, Traits>(o[0], p, sm.v_tile(prev.stage()));
  WgmmaWait<0>();
  FenceRegisters(o[0]);
  release(sm.empty_v(prev.stage()));
}

}  // namespace jax_flash::cuda::sm90

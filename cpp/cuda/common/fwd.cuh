// What the two tensor-core forwards share (sm80/fwd.cuh on mma.sync,
// sm90/fwd.cuh on wgmma): the launch constants and grid, a CTA's inputs
// (FwdBlock, from its tile), and what a warp carries from the mainloop to the
// epilogue: O and the running softmax statistics of its rows, kMT m-tiles of
// 16 (rows g and g + 8 of each, common/fragment.cuh), as three arrays,
//   float o[kMT][kDTiles][4], row_m[kMT][2], row_l[kMT][2];
// row_m is the reference P is taken against (common/softmax.cuh), row_l a
// per-lane partial sum. (Arrays, not a struct: gathered into one struct they
// compiled to other register assignments.)
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "cuda/common/softmax.cuh"
#include "cuda/common/tile_map.cuh"
#include "cuda/common/tile_scheduler.cuh"
#include "cuda/common/views.cuh"
#include "jax_flash/mask.h"
#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Per-launch constants, computed once on the host.
struct FwdArgs {
  FwdParams p;
  float scale_log2;      // log2(e) * scale, or log2(e) when softcap is on (scale goes into tanh)
                         // or with a bias (the kernel forms x = scale * q.k + bias first)
  float softcap;         // 0 = off
  float scale_over_cap;  // scale / softcap (1 / softcap with a bias)
  float rescale_margin;  // kRescaleLog2 / scale_log2: the growth of a row max (score
                         // units) that moves the softmax's reference (common/softmax.cuh)
  TileOrder order;       // CTA order for a bias or dense mask (TermsTileOrder), in
                         // the kTerms kernels and the wgmma forwards
};

inline FwdArgs MakeFwdArgs(const FwdParams& params) {
  FwdArgs args;
  args.p = params;
  const float scale = static_cast<float>(params.score.scale);
  args.softcap = static_cast<float>(params.score.softcap);
  args.order = TermsTileOrder(params);
  // With a bias the kTerms kernels hold x = scale * q.k + bias (AddBias in
  // common/score.cuh), so scale leaves exp2 and tanh.
  const float pre = params.score.bias != nullptr ? 1.f : scale;
  if (args.softcap > 0.f) {
    args.scale_log2 = kLog2e;
    args.scale_over_cap = pre / args.softcap;
  } else {
    args.softcap = 0.f;
    args.scale_log2 = pre * kLog2e;
    args.scale_over_cap = 0.f;
  }
  // Here, not in the kernels: a float division in the ws forward's loop was
  // ~10 instructions and a MUFU.RCP per key block (ptxas kept it there).
  args.rescale_margin = kRescaleLog2 / args.scale_log2;
  return args;
}

// Launches a forward kernel over the tiles of QueryBlockScheduler (query
// blocks of kBlockM rows, q heads, batch) with kernel parameters `kargs`
// (FwdArgs, or an arch path's struct around them).
template <int kBlockM, typename Kernel, typename KernelArgs>
cudaError_t LaunchFwdGrid(Kernel kernel, int threads, size_t smem_bytes, const FwdParams& params,
                          const KernelArgs& kargs, cudaStream_t stream) {
  const int64_t m_blocks = CeilDiv(params.shape.seqlen_q, kBlockM);
  if (m_blocks == 0 || params.shape.num_heads_q == 0 || params.shape.batch == 0) return cudaSuccess;
  if (params.shape.num_heads_q > 65535 || params.shape.batch > 65535 || m_blocks > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  kernel<<<QueryBlockScheduler::Grid(m_blocks, params.shape), threads, smem_bytes, stream>>>(kargs);
  return cudaGetLastError();
}
template <int kBlockM, typename Kernel>
cudaError_t LaunchFwdGrid(Kernel kernel, int threads, size_t smem_bytes, const FwdParams& params,
                          cudaStream_t stream) {
  return LaunchFwdGrid<kBlockM>(kernel, threads, smem_bytes, params, MakeFwdArgs(params), stream);
}

// One CTA's problem: query rows [m0, m0 + kBlockM) of head h, batch b; its
// K/V rows; the key blocks [n_begin, n_end) that hold visible keys.
template <typename T>
struct FwdBlock {
  int64_t b, h, m0, n_begin, n_end;
  BatchMask mask;
  CellLine cells;  // the tile map's cells of this CTA's rows
  GmemRows<T> q, k, v;

  // kTileMap: the kernel steps with NextBlock and masks by BlockClass (the
  // wgmma kernels, the mma.sync kTerms ones), with this head's view of a
  // dense mask, tested in the partial cells; the others ignore the tile map
  // and keep their registers.
  // m_shift: the tiles start that many rows earlier (m0 below 0 for the
  // first: rows that do not exist, which load zeros, see no stored key and
  // are not written), so that the last ends at seqlen_q (the ws forward's
  // causal kernels: the partial tile is then the one with the fewest keys).
  template <int kBlockM, int kBlockN, bool kTileMap = false>
  __device__ __forceinline__ static FwdBlock Make(const FwdParams& p,
                                                  const QueryBlockScheduler::Tile& tile,
                                                  int64_t m_shift = 0) {
    FwdBlock r;
    const int64_t m_block = tile.m_block;
    r.h = tile.h;
    r.b = tile.b;
    const int64_t h_kv = r.h / p.shape.group_size();
    r.m0 = m_block * kBlockM - m_shift;
    const int64_t seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
    const int head_dim = static_cast<int>(p.shape.head_dim);
    r.mask = kTileMap ? BatchMask::For(p.mask, r.b, r.h, seqlen_q, seqlen_k)
                      : BatchMask::For(p.mask, r.b, seqlen_q, seqlen_k);
    r.q = GmemRows<T>::Head(p.q, p.q_strides, r.b, r.h, seqlen_q, head_dim);
    r.k = GmemRows<T>::Head(p.k, p.k_strides, r.b, h_kv, seqlen_k, head_dim);
    r.v = GmemRows<T>::Head(p.v, p.v_strides, r.b, h_kv, seqlen_k, head_dim);
    int64_t key_begin, key_end;
    // From row 0 where the tile starts before it: rows below 0 see no key of
    // their own (with a position offset KeyRange would give them some).
    r.mask.KeyRange(m_shift > 0 && r.m0 < 0 ? 0 : r.m0, r.m0 + kBlockM, &key_begin, &key_end);
    r.n_begin = key_begin / kBlockN;
    r.n_end = key_begin < key_end ? CeilDiv(key_end, kBlockN) : r.n_begin;
    r.cells = CellLine{};
    if constexpr (kTileMap) {
      r.cells = CellLine::AlongKeys<kBlockM, kBlockN>(r.mask, r.m0);
      r.n_begin = r.template NextBlock<kBlockN>(r.n_begin);  // n_end when all are empty
    }
    return r;
  }

  // The tile map's class of key block n (common/tile_map.cuh; partial
  // without one).
  template <int kBlockN>
  __device__ __forceinline__ CellClass BlockClass(int64_t n) const {
    return cells.template At<kBlockN>(n);
  }

  // The first key block at or after n that the tile map does not leave
  // empty, or n_end; n itself without a tile map. Kernels that step with it
  // skip the empty cells of segment ids; those that step by one compute
  // them, masked per element (the same result).
  template <int kBlockN>
  __device__ __forceinline__ int64_t NextBlock(int64_t n) const {
    return cells.template Next<kBlockN>(n, n_end);
  }
};

// O = 0, m = -inf, l = 0.
template <int kMT, int kDTiles>
__device__ __forceinline__ void InitFwdState(float (&o)[kMT][kDTiles][4], float (&row_m)[kMT][2],
                                             float (&row_l)[kMT][2]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) { row_m[mt][hr] = -INFINITY; row_l[mt][hr] = 0.f; }
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[mt][dt][r] = 0.f;
  }
}

}  // namespace jax_flash::cuda

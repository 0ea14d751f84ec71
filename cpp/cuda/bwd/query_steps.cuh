// The steps of a dK/dV CTA (one block of keys): (query head gi of the GQA
// group, query block mi) for the query blocks [m_begin, m_begin + m_count)
// that the band leaves (BatchMask::QueryRange) and the tile map does not
// leave empty (common/tile_map.cuh), every head of the group in turn. Steps
// are counted up front (the pipelines index stages and barrier phases by the
// step) and walked with counters, not divisions.
// kRotate: each head's walk starts at block `start` (from the caller's
// position among the key blocks, Make's rotate_num / rotate_den of the
// range) and wraps around, so that the CTAs of one head that run side by
// side add into different dQ rows instead of the same ones in lockstep
// (sm90/tile_size.h, BwdTile::rotate_steps). Without it start is first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/tile_map.cuh"
#include "jax_flash/mask.h"
#include "jax_flash/math.h"

namespace jax_flash::cuda {

template <int kBlockN, int kBlockM, bool kRotate = false>
struct QuerySteps {
  CellLine cells;   // the tile map's cells of this CTA's keys
  int64_t m_begin;  // first query block of the band's range
  int64_t m_count;  // query blocks in that range
  int64_t first;    // the first one the tile map leaves (m_count: none)
  int64_t start;    // each head's first step's block: first, or (kRotate) a later one
  int64_t count;    // steps: group x the blocks the tile map leaves

  // Keys [n0, n0 + kBlockN) of a problem with `group` q heads per kv head;
  // kRotate: the walk starts rotate_num / rotate_den of the way along the
  // range (0 / 1: at first).
  __device__ __forceinline__ static QuerySteps Make(const BatchMask& mask, int64_t n0,
                                                    int64_t group, int64_t rotate_num = 0,
                                                    int64_t rotate_den = 1) {
    QuerySteps r;
    int64_t q_begin, q_end;
    mask.QueryRange(n0, n0 + kBlockN, &q_begin, &q_end);
    r.m_begin = q_begin / kBlockM;
    r.m_count = q_begin < q_end ? CeilDiv(q_end, kBlockM) - r.m_begin : 0;
    r.cells = CellLine::AlongQueries<kBlockN, kBlockM>(mask, n0);
    r.first = r.Next(0);
    int64_t blocks = r.m_count;
    if (r.cells.cells != nullptr) {
      blocks = 0;
      for (int64_t mi = r.first; mi < r.m_count; mi = r.Next(mi + 1)) ++blocks;
    }
    r.count = group * blocks;
    r.start = r.first;
    if constexpr (kRotate) {
      if (rotate_num > 0 && r.m_count > 0) {
        // Any block will do, so float (a 64-bit division spilled registers).
        const float share = static_cast<float>(rotate_num) / static_cast<float>(rotate_den);
        const int64_t at = r.Next(static_cast<int64_t>(share * static_cast<float>(r.m_count)));
        if (at < r.m_count) r.start = at;
      }
    }
    return r;
  }

  // The tile map's class of step block mi (relative to m_begin).
  __device__ __forceinline__ CellClass Class(int64_t mi) const {
    return cells.template At<kBlockM>(m_begin + mi);
  }

  // The first block at or after mi that the tile map does not leave empty,
  // or m_count.
  __device__ __forceinline__ int64_t Next(int64_t mi) const {
    if (cells.cells == nullptr) return mi;
    while (mi < m_count && Class(mi) == kCellEmpty) ++mi;
    return mi < m_count ? mi : m_count;
  }

  // (gi, mi) becomes the next step (past the last: gi = group).
  template <typename Index>
  __device__ __forceinline__ void Advance(Index& gi, Index& mi) const {
    mi = static_cast<Index>(Next(mi + 1));
    if constexpr (kRotate) {
      // In Index's width: 32-bit copies live across the caller's loop.
      if (mi == static_cast<Index>(m_count)) mi = static_cast<Index>(first);  // wrap around
      if (mi == static_cast<Index>(start)) ++gi;  // back where this head began: the next head
    } else {
      if (mi == m_count) { mi = first; ++gi; }
    }
  }
};

}  // namespace jax_flash::cuda

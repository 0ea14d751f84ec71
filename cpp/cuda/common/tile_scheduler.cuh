// Which tile a CTA computes, and the grid that covers the tiles: the blockIdx
// mapping of every tensor-core kernel in one place. A persistent or
// warp-specialized kernel replaces a scheduler here, not its mainloop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Which index of a query-block grid varies fastest. A bias or dense mask
// that broadcasts over the batch (or the heads) is read by every batch's
// (head's) CTA of a query block: with that index innermost those CTAs run
// side by side and read each tile once from DRAM, the rest from L2.
enum class TileOrder : int {
  kQueryBlocksInner,  // query blocks, then heads, then batch (no shared term)
  kBatchInner,        // batch, then query blocks, then heads
  kHeadsInner,        // heads, then query blocks, then batch
};

// The order for a forward's score terms: the bias's broadcast decides (its
// float32 tiles are the larger reads), else the dense mask's.
inline TileOrder TermsTileOrder(const FwdParams& p) {
  auto order = [&](const DenseStrides& s) {
    if (p.shape.batch > 1 && s.batch == 0) return TileOrder::kBatchInner;
    if (p.shape.num_heads_q > 1 && s.head == 0) return TileOrder::kHeadsInner;
    return TileOrder::kQueryBlocksInner;
  };
  if (p.score.bias != nullptr) return order(p.score.bias_strides);
  if (p.mask.dense != nullptr) return order(p.mask.dense_strides);
  return TileOrder::kQueryBlocksInner;
}

// Blocks of query rows of one (query head, batch): the forwards and the
// deterministic dQ kernel. Grid (query blocks, q heads, batch); the last
// query blocks run first: with causal masking they see the most keys, so
// scheduling them first shortens the tail.
struct QueryBlockScheduler {
  struct Tile {
    int64_t m_block, h, b;
  };
  // Grid dimensions y and z: q heads and batch, at most 65535 each (the
  // dispatch checks it).
  static dim3 Grid(int64_t m_blocks, const AttentionShape& shape) {
    return dim3(static_cast<unsigned>(m_blocks), static_cast<unsigned>(shape.num_heads_q),
                static_cast<unsigned>(shape.batch));
  }
  __device__ __forceinline__ static Tile Get() {
    Tile tile;
    tile.m_block = gridDim.x - 1 - blockIdx.x;
    tile.h = blockIdx.y;
    tile.b = blockIdx.z;
    return tile;
  }
  // The same grid's tiles in `order` (the launch order of CTAs follows their
  // linear index, x fastest).
  __device__ __forceinline__ static Tile Get(TileOrder order) {
    if (order == TileOrder::kQueryBlocksInner) return Get();
    const int64_t m_blocks = gridDim.x, heads = gridDim.y, batch = gridDim.z;
    const int64_t linear = blockIdx.x + m_blocks * (blockIdx.y + heads * int64_t{blockIdx.z});
    const int64_t inner = order == TileOrder::kBatchInner ? batch : heads;
    const int64_t rest = linear / inner;
    Tile tile;
    tile.m_block = m_blocks - 1 - rest % m_blocks;
    if (order == TileOrder::kBatchInner) {
      tile.b = linear % inner;
      tile.h = rest / m_blocks;
    } else {
      tile.h = linear % inner;
      tile.b = rest / m_blocks;
    }
    return tile;
  }
};

// Blocks of keys of one (kv head, batch): the mma.sync dK/dV kernel.
// Grid (key blocks, kv heads, batch).
struct KeyBlockScheduler {
  struct Tile {
    int64_t n_block, h_kv, b;
  };
  static dim3 Grid(int64_t n_blocks, const AttentionShape& shape) {
    return dim3(static_cast<unsigned>(n_blocks), static_cast<unsigned>(shape.num_heads_kv),
                static_cast<unsigned>(shape.batch));
  }
  __device__ __forceinline__ static Tile Get() {
    Tile tile;
    tile.n_block = blockIdx.x;
    tile.h_kv = blockIdx.y;
    tile.b = blockIdx.z;
    return tile;
  }
};

// Position `index` of a sectioned order: `pairs` (batch, head) pairs cut
// into sections of section_pairs (the last may hold fewer), the sections one
// after the other, inside a section `blocks` block indices outer and the
// section's pairs inner. The persistent forward (sm90/scheduler_persistent.cuh)
// and KeyBlockSectionScheduler walk it; its divisors are fixed per launch.
struct SectionedPosition {
  int block, pair;
};

struct SectionedOrder {
  int pairs;                  // pairs in all
  FastDivisor per_section;    // blocks * section_pairs: positions per section
  FastDivisor section_width;  // section_pairs: pairs per section but the last
  FastDivisor last_width;     // the pairs of the last section

  // Pairs per section: as many as fit section_bytes at pair_bytes each, at
  // least one and at most `pairs` (host side, when the launch is set up).
  static int64_t SectionPairs(int64_t section_bytes, int64_t pair_bytes, int64_t pairs) {
    const int64_t n = pair_bytes > 0 ? section_bytes / pair_bytes : pairs;
    return n < 1 ? 1 : (n > pairs ? pairs : n);
  }

  // Host side; blocks * pairs < 2^31, 1 <= section_pairs <= pairs.
  static SectionedOrder Make(int blocks, int section_pairs, int pairs) {
    SectionedOrder o;
    o.pairs = pairs;
    o.per_section = FastDivisor::Of(blocks * section_pairs);
    o.section_width = FastDivisor::Of(section_pairs);
    const int rest = pairs % section_pairs;
    o.last_width = FastDivisor::Of(rest == 0 ? section_pairs : rest);
    return o;
  }

  __host__ __device__ __forceinline__ SectionedPosition At(int index) const {
    const int section = per_section.Divide(index);
    const int r = index - section * per_section.divisor;
    const int section_pairs = section_width.divisor;
    const int first_pair = section * section_pairs;
    const FastDivisor& width =
        pairs - first_pair < section_pairs ? last_width : section_width;
    const int block = width.Divide(r);
    return {block, first_pair + (r - block * width.divisor)};
  }
};

// Blocks of keys of the Hopper dK/dV kernels, in sections of (batch, kv
// head) pairs: a section's pairs hold Q, dO and the float32 dQ accumulator
// rows of their q heads in a share of L2 (SectionBytes), and the sections
// run one after the other; inside a section every pair's key block 0, then
// every pair's block 1, and so on: with a causal mask the first key blocks
// visit the most query blocks (longest first, the short ones fill the
// tail), and the CTAs running at a time read and add into the rows of a few
// heads, which stay in L2. (Every pair's block n side by side, the order
// before, streamed Q, dO and dQ from DRAM once more than about 50 heads'
// rows were in flight: S = 1k at B * S = 16k; cpp/cuda/NOTES_sm90_bwd.md.)
// A one-dimensional grid (at most 2^31 - 1 tiles).
struct KeyBlockSectionScheduler {
  // Bytes of rows a section holds: 16 MB (32 MB: 0-8% slower at S = 1k), and
  // 64 MB under a causal mask with 32 or more key blocks of 128 per pair:
  // there 16 MB was up to 18% slower (D = 96 at S = 4k: 2.62 against 2.22
  // ms) and never faster by more than 3%; with blocks of 64 keys (D > 128)
  // 64 MB was 2-4% slower (cpp/cuda/NOTES_sm90_bwd.md, item 11).
  static int64_t SectionBytes(int64_t n_blocks, int block_n, bool causal) {
#ifdef JAX_FLASH_TUNE_BWD_SECTION_MB
    return int64_t{JAX_FLASH_TUNE_BWD_SECTION_MB} << 20;
#else
    return (causal && block_n >= 128 && n_blocks >= 32 ? 64ll : 16ll) << 20;
#endif
  }

  // Per-launch constants (plain ints: the tile count is checked to fit).
  struct Args {
    int n_blocks;          // key blocks per (batch, kv head)
    int pairs;             // batch * heads_kv
    FastDivisor heads_kv;
    SectionedOrder order;
  };

  using Tile = KeyBlockScheduler::Tile;

  // False when the tile count does not fit a grid.
  static bool MakeArgs(int64_t n_blocks, int block_n, const AttentionShape& s, bool causal,
                       Args* a) {
    const int64_t pairs = s.batch * s.num_heads_kv;
    if (pairs <= 0) return false;  // the caller launches nothing then
    // Half the int range: the persistent kernel's next index, gridDim.x +
    // the counter, stays below tiles + gridDim.x (as PersistentScheduler).
    if (n_blocks * pairs > INT32_MAX / 2) return false;
    // Q, dO (16-bit) and the dQ accumulator (float32) of a pair's q heads.
    const int64_t pair_bytes = s.group_size() * s.seqlen_q * s.head_dim * (2 + 2 + 4);
    const int64_t section =
        SectionedOrder::SectionPairs(SectionBytes(n_blocks, block_n, causal), pair_bytes, pairs);
    a->n_blocks = static_cast<int>(n_blocks);
    a->pairs = static_cast<int>(pairs);
    a->heads_kv = FastDivisor::Of(static_cast<int>(s.num_heads_kv));
    a->order = SectionedOrder::Make(a->n_blocks, static_cast<int>(section), a->pairs);
    return true;
  }

  __host__ __device__ __forceinline__ static int Tiles(const Args& a) {
    return a.n_blocks * a.pairs;
  }
  static dim3 Grid(const Args& a) { return dim3(static_cast<unsigned>(Tiles(a))); }

  __device__ __forceinline__ static Tile Get(const Args& a) {
    return At(a, static_cast<int>(blockIdx.x));
  }

  // The tile at position `index` of the order (a persistent CTA walks
  // blockIdx.x, + gridDim.x, ...: the CTAs running at a time still take
  // consecutive positions).
  // (Host code too: tests/host/fast_divisor_check.cu walks it.)
  __host__ __device__ __forceinline__ static Tile At(const Args& a, int index) {
    const SectionedPosition at = a.order.At(index);
    Tile tile;
    tile.n_block = at.block;
    tile.b = a.heads_kv.Divide(at.pair);
    tile.h_kv = at.pair - static_cast<int>(tile.b) * a.heads_kv.divisor;
    return tile;
  }
};

}  // namespace jax_flash::cuda

// The backward's workspace: its layout, and the chunks a problem too large
// for one dQ accumulator runs in.
//
// The workspace is an extra result of the custom call, sized when the call is
// lowered by cuda::BwdWorkspaceBytes (launch.h), a function of the shape
// alone; from its start:
//   delta     D = rowsum(dO * O), (B, Hq, Sq) accumulation type   every family
//   counter   the persistent dK/dV kernel's tile counter (int)     tensor cores
//   lse2      lse in log2 units, (B, Hq, Sq) float32 of a chunk   tensor cores
//   dq_accum  float32 dQ (DqAccumLayout) of a chunk, fast mode    tensor cores
// each starting at a multiple of 256 bytes.
//
// Host and device: the kernels address the dQ accumulator through
// DqAccumLayout, the launchers size and split the workspace with the rest.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "jax_flash/math.h"
#include "jax_flash/params.h"

namespace jax_flash::cuda {

// Parts of the workspace start at multiples of this from its base.
inline constexpr size_t kWorkspacePartAlignment = 256;

inline size_t RoundUp(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// The persistent dK/dV kernel's tile counter (sm90/bwd.cuh), one part.
inline constexpr size_t kTileCounterBytes = kWorkspacePartAlignment;

// Bytes of delta, (B, Hq, Sq) elements of acc_bytes each.
inline size_t DeltaBytes(const AttentionShape& s, size_t acc_bytes) {
  return RoundUp(static_cast<size_t>(s.batch * s.num_heads_q * s.seqlen_q) * acc_bytes,
                 kWorkspacePartAlignment);
}

// The float32 dQ accumulator of the fast backward, without per-row padding.
// Each (batch, query head) has its kCols columns as two halves,
// [half][row][column] in groups of 16 rows (its rows rounded up to whole
// groups): within a group the rows and columns form 8 x 8 tiles, each 256
// contiguous bytes in row order, the tiles in [column tile][rows 0-7, then
// rows 8-15] order. That is the order of
// a warp's wgmma accumulator fragments (16 rows; a lane's pair at row g,
// columns 2t, 2t + 1, and the same at row g + 8), so the Hopper kernel
// stages a warpgroup's dQ part in shared memory in this order (a warp's
// 8-byte stores cover 256 contiguous bytes: no bank conflicts) and adds the
// part's rows of a half, one contiguous range, with one bulk reduction; the
// Ampere kernel's atomics and the conversion's 8-column groups are whole
// 32-byte sectors of a tile row. FlashAttention-3 stages dQ the same way;
// the rows padded by 8 floats that this replaced added 25% (D = 64) / 12.5%
// (D = 128) to every reduction, zeroing and conversion.
//
// Above 64 the halves cover the head dim rounded up to whole 64-column
// blocks: the Hopper kernel's dQ GEMMs read whole blocks of K, so a head dim
// of 96 has halves of 64 columns, the second one half padding. Columns past
// head_dim and rows past seqlen_q may hold anything (the Hopper kernel adds
// whole groups); nothing reads them.
template <int kHeadDim>
struct DqAccumLayout {
  static constexpr int kCols = kHeadDim > 64 ? (kHeadDim + 63) / 64 * 64 : kHeadDim;
  static constexpr int kHalf = kCols / 2;  // columns per half
  static constexpr int kGroupRows = 16;    // a warp's rows of a wgmma tile
  static_assert(kHalf % 8 == 0, "halves of whole 8-column tiles");
  // Rows of a (batch, head), rounded up to whole groups.
  __host__ __device__ static int64_t PaddedRows(int64_t seqlen_q) {
    return (seqlen_q + kGroupRows - 1) / kGroupRows * kGroupRows;
  }
  // The first element of half `half`'s rows from i0 (a multiple of
  // kGroupRows) of (batch, head) bh; rows i0.. of a half are contiguous.
  __host__ __device__ static int64_t HalfRows(int64_t bh, int64_t seqlen_q, int half,
                                              int64_t i0) {
    return ((bh * 2 + half) * PaddedRows(seqlen_q) + i0) * kHalf;
  }
  // The position of row r (0..15) and column c (0..kHalf-1) in a group.
  __host__ __device__ static constexpr int InGroup(int r, int c) {
    return ((c >> 3) * 2 + (r >> 3)) * 64 + (r & 7) * 8 + (c & 7);
  }
  // Where the Hopper kernel stages a warpgroup's accumulator fragment in a
  // part of 64 rows that starts at a group (sm90/epilogue_bwd.cuh): warp w's
  // rows 16w.., the lane's pair at row g + 8 hr (g < 8), columns 8 tile + 2t
  // (t < 4) and the next; `tile` counts the column tiles of both halves where
  // the part has both (the row split), the second half's 64 rows after the
  // first's. InGroup's order, so HalfRows(bh, sq, half, m) + the offset
  // within the half is Index(bh, sq, m + row, col) (tc_kernel_check checks).
  // Within a half it is PartIndex(16 warp + g + 8 hr, 8 tile + 2t), written
  // with the lane's fields apart: the compiler cannot know g < 8 and t < 4,
  // so PartIndex's divisions and masks would stay in the kernel's code.
  __host__ __device__ static int PartOffset(int warp, int g, int t, int tile, int hr) {
    constexpr int kHalfTiles = kHalf / 8;
    return (tile / kHalfTiles) * 64 * kHalf + warp * kGroupRows * kHalf +
           ((tile % kHalfTiles) * 2 + hr) * 64 + g * 8 + 2 * t;
  }
  // Row r and column c (0..kHalf-1) of a part of one half whose rows start
  // at a group.
  __host__ __device__ static constexpr int PartIndex(int r, int c) {
    return (r / kGroupRows) * kGroupRows * kHalf + InGroup(r % kGroupRows, c);
  }
  // Where the Hopper kernel stages dQ computed transposed (80-query steps,
  // sm90/epilogue_bwd.cuh): warp w's fragments hold columns 16w + 8 hc + g
  // of the part, n-tile nt the rows 8 nt + 2t + o (o = 0, 1). Their
  // PartIndex is TransposedLanePart(w, g, t) + o kTileRowFloats +
  // TransposedTilePart(nt, hc): the kernel keeps two base addresses and adds
  // constants.
  static constexpr int kTileRowFloats = 8;  // the next row of an 8 x 8 tile
  __host__ __device__ static int TransposedLanePart(int warp, int g, int t) {
    return PartIndex(2 * t, 16 * warp + g);
  }
  __host__ __device__ static constexpr int TransposedTilePart(int nt, int hc) {
    return PartIndex(8 * nt, 8 * hc);
  }
  // The preprocess's zeroing order (bwd/preprocess.cuh, ZeroDqAccumRows):
  // 16-byte piece n of a block of kRows rows (a multiple of kGroupRows, or
  // 8 rows from a group's start or middle) is piece n % 2 of row n / 2 %
  // kRows's 8-column chunk n / 2 / kRows, the chunks of both halves counted
  // together. In InGroup's order a half's rows of one chunk are contiguous
  // through a group, so consecutive pieces are consecutive 16 bytes there
  // and a warp's 32 pieces fill whole sectors (tests/gpu/dq_layout_check.h
  // checks, on the CPU in CI and in tc_kernel_check).
  struct Piece {
    int row, col, piece;  // row in the block, the chunk's first column, 16-byte piece 0 or 1
  };
  template <int kRows>
  static constexpr int kZeroPieces = 2 * kCols / 8 * kRows;
  template <int kRows>
  __host__ __device__ static constexpr Piece ZeroPiece(int n) {
    const int chunk = n / 2 / kRows;  // of both halves
    return {n / 2 % kRows, (chunk / (kHalf / 8)) * kHalf + 8 * (chunk % (kHalf / 8)), n % 2};
  }
  // Element (query i, column col) of (batch, head) bh; columns 8k..8k+7 of a
  // row are contiguous.
  __host__ __device__ static int64_t Index(int64_t bh, int64_t seqlen_q, int64_t i, int col) {
    const int half = col >= kHalf;
    return HalfRows(bh, seqlen_q, half, i / kGroupRows * kGroupRows) +
           InGroup(static_cast<int>(i % kGroupRows), col - half * kHalf);
  }
};

// The tensor-core kernels' part: [tile counter: kTileCounterBytes]
// [lse2: rows floats, padded to 256 bytes] [dq_accum: B * Hq *
// DqAccumLayout::PaddedRows(Sq) x kCols floats, fast mode only], rows =
// B * Hq * Sq of the chunk below (MakeBwdArgs, bwd/args.h).
inline size_t Lse2Bytes(const AttentionShape& shape) {
  const size_t rows = static_cast<size_t>(shape.batch * shape.num_heads_q * shape.seqlen_q);
  return (rows * sizeof(float) + 255) / 256 * 256;
}

// The fast (atomic) backward accumulates dQ in float32, 4 bytes per element
// of q (rows rounded up to 16, columns to the halves'): about a quarter of
// q, k, v, dout, out and the gradients together. A problem
// whose accumulator would exceed kMaxDqAccumBytes runs as consecutive chunks,
// runs of whole batch elements or else runs of KV heads (with their query
// heads) of one batch element, that reuse one accumulator of at most that
// size, the chunks as equal as whole batch elements or heads allow. Peak
// memory then stays near the inputs + outputs + gradients at long sequences
// (at most 1/8 more at S = 32k, D = 128, H = 16), and every chunk is still
// large enough to fill the GPU; one chunk, as the bench's 1k shapes were in
// a trial, saves a few percent of tail but holds about 0.3x of them.
// tests/gpu/run.sh also builds the kernel check with a tiny limit so that its
// small cases run chunked too.
#ifdef JAX_FLASH_MAX_DQ_ACCUM_BYTES
inline constexpr size_t kMaxDqAccumBytes = JAX_FLASH_MAX_DQ_ACCUM_BYTES;
#else
inline constexpr size_t kMaxDqAccumBytes = size_t{128} << 20;
#endif

struct BwdChunk {
  int64_t batches;   // batch elements per chunk (all of them: no chunking)
  int64_t kv_heads;  // KV heads per chunk; < num_heads_kv only when batches == 1
};

template <int kHeadDim>
BwdChunk ChunkFor(const AttentionShape& shape) {
  if (shape.batch == 0 || shape.num_heads_kv == 0 || shape.seqlen_q == 0)
    return {shape.batch, shape.num_heads_kv};
  using Layout = DqAccumLayout<kHeadDim>;
  const size_t per_kv_head = sizeof(float) * Layout::kCols *
                             static_cast<size_t>(Layout::PaddedRows(shape.seqlen_q)) *
                             static_cast<size_t>(shape.group_size());
  const size_t per_batch = per_kv_head * static_cast<size_t>(shape.num_heads_kv);
  if (per_batch * static_cast<size_t>(shape.batch) <= kMaxDqAccumBytes)
    return {shape.batch, shape.num_heads_kv};
  // As few chunks as the limit allows, of equal size: a last chunk of a
  // few heads would be a short wave of its own.
  auto even = [](int64_t n, int64_t most) { return CeilDiv(n, CeilDiv(n, most)); };
  if (per_batch <= kMaxDqAccumBytes)
    return {even(shape.batch, static_cast<int64_t>(kMaxDqAccumBytes / per_batch)),
            shape.num_heads_kv};
  const int64_t heads = static_cast<int64_t>(kMaxDqAccumBytes / per_kv_head);
  return {1, even(shape.num_heads_kv, heads > 0 ? heads : 1)};
}

// The shape of chunk (b0, hk0) of `chunk`, clipped at the problem's edges.
inline AttentionShape ChunkShape(const AttentionShape& shape, const BwdChunk& chunk, int64_t b0,
                                 int64_t hk0) {
  AttentionShape s = shape;
  s.batch = std::min(chunk.batches, shape.batch - b0);
  s.num_heads_kv = std::min(chunk.kv_heads, shape.num_heads_kv - hk0);
  s.num_heads_q = s.num_heads_kv * shape.group_size();
  return s;
}

// The same problem restricted to batch elements [b0, b0 + sub.batch) and KV
// heads [hk0, hk0 + sub.num_heads_kv): every pointer moved to the chunk's
// first element, strides kept. lse and delta are (B, Hq, Sq) rows; a chunk
// is either whole batch elements or one batch element, so its rows are
// contiguous there too.
template <typename T>
BwdParams ChunkParams(const BwdParams& p, const AttentionShape& sub, int64_t b0, int64_t hk0) {
  BwdParams c = p;
  c.shape = sub;
  const int64_t hq0 = hk0 * p.shape.group_size();
  c.q = static_cast<const T*>(p.q) + p.q_strides.offset(b0, 0, hq0);
  c.k = static_cast<const T*>(p.k) + p.k_strides.offset(b0, 0, hk0);
  c.v = static_cast<const T*>(p.v) + p.v_strides.offset(b0, 0, hk0);
  c.out = static_cast<T*>(p.out) + p.out_strides.offset(b0, 0, hq0);
  c.dout = static_cast<const T*>(p.dout) + p.dout_strides.offset(b0, 0, hq0);
  c.dq = static_cast<T*>(p.dq) + p.dq_strides.offset(b0, 0, hq0);
  c.dk = static_cast<T*>(p.dk) + p.dk_strides.offset(b0, 0, hk0);
  c.dv = static_cast<T*>(p.dv) + p.dv_strides.offset(b0, 0, hk0);
  const int64_t row0 = (b0 * p.shape.num_heads_q + hq0) * p.shape.seqlen_q;
  c.lse = static_cast<float*>(p.lse) + row0;
  c.delta = static_cast<float*>(p.delta) + row0;
  MaskParams& m = c.mask;
  if (m.q_seqlens != nullptr) m.q_seqlens += b0;
  if (m.kv_seqlens != nullptr) m.kv_seqlens += b0;
  if (m.q_segment_ids != nullptr) m.q_segment_ids += b0 * p.shape.seqlen_q;
  if (m.kv_segment_ids != nullptr) m.kv_segment_ids += b0 * p.shape.seqlen_k;
  // Broadcast dims have stride 0. Dropout keeps the whole problem's indices
  // through BwdArgs (its batch0, head0).
  if (m.dense != nullptr) m.dense += b0 * m.dense_strides.batch + hq0 * m.dense_strides.head;
  if (m.tile_map != nullptr)
    m.tile_map += b0 * m.tile_map_strides.batch + hq0 * m.tile_map_strides.head;
  // The bias likewise; dbias stays whole (the kernels index it with the
  // whole problem's batch and head, BwdArgs::batch0 and head0).
  if (c.score.bias != nullptr) {
    // The accumulation type: float64 for float64 inputs, else float32.
    const int64_t bytes = BiasElementBytes(p.score.bias_type, std::is_same_v<T, double> ? 8 : 4);
    c.score.bias = static_cast<const char*>(p.score.bias) +
                   (b0 * p.score.bias_strides.batch + hq0 * p.score.bias_strides.head) * bytes;
  }
  return c;
}

// Bytes of the tile counter, lse2 and dq_accum for the bucket's kernels.
// The fast mode takes the larger of its own layout and the deterministic
// one's: on Hopper it runs the deterministic structure above D = 128 and at
// D = 128 with a bias (sm90/bwd_routing.h, SeparateDq), on Turing mostly
// (bwd/run.cuh, TuringSeparateDq), and the size is fixed before the GPU is
// known.
template <int kHeadDim>
size_t Lse2AndDqAccumBytes(const AttentionShape& shape, bool deterministic) {
  if (deterministic) return kTileCounterBytes + Lse2Bytes(shape);
  const AttentionShape chunk = ChunkShape(shape, ChunkFor<kHeadDim>(shape), 0, 0);
  using Layout = DqAccumLayout<kHeadDim>;
  const size_t rows = static_cast<size_t>(chunk.batch * chunk.num_heads_q *
                                          Layout::PaddedRows(chunk.seqlen_q));
  const size_t fast = Lse2Bytes(chunk) + sizeof(float) * rows * Layout::kCols;
  return kTileCounterBytes + (fast > Lse2Bytes(shape) ? fast : Lse2Bytes(shape));
}

}  // namespace jax_flash::cuda

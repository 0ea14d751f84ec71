// Views of the (B, S, H, D) tensors and (B, H, S) row statistics that the
// kernels read. Element offsets are params.h's SeqStrides::offset and head
// groups AttentionShape::group_size (both host and device).
#pragma once

#include <cstdint>

#include "jax_flash/params.h"

namespace jax_flash::cuda {

// A 2-D view of one (batch, head) slice of a (B, S, H, D) tensor: rows are
// sequence positions, columns the head dim.
template <typename T>
struct GmemRows {
  const T* base;   // element (row 0, col 0)
  int64_t stride;  // elements between rows
  int64_t rows;    // valid rows (sequence length)
  int cols;        // valid columns (actual head_dim)

  // Rows [0, rows) x columns [0, cols) of head h, batch b of `tensor`.
  __device__ __forceinline__ static GmemRows Head(const void* tensor, const SeqStrides& strides,
                                                  int64_t b, int64_t h, int64_t rows, int cols) {
    return GmemRows{static_cast<const T*>(tensor) + strides.offset(b, 0, h), strides.row, rows,
                    cols};
  }
};

// Offset of row i of head h, batch b, in a (B, H, S) lse/delta array.
__host__ __device__ __forceinline__ int64_t RowStatOffset(const AttentionShape& s, int64_t b,
                                                          int64_t h, int64_t i) {
  return (b * s.num_heads_q + h) * s.seqlen_q + i;
}

}  // namespace jax_flash::cuda

"""The tile map: per cell of positions, what the segment ids, a mask and a block mask leave visible.

The cells are the block mask's, ``BLOCK_MASK_BLOCK`` query rows by as many
keys. A cell is empty (``CELL_EMPTY``) where no query's id equals any key's
(no pair of the mask is True), full (``CELL_FULL``) where all are equal (all
are True, in every head), partial (``CELL_PARTIAL``) otherwise; with both, the
lower class of the two (``combine``). The kernels take it as a hint (the ``tile_map`` operand,
cpp/ffi/contract.h; mask.h's CellClass): those that read it skip empty cells
and the per-element segment test in full ones, those that ignore it compute
the same result.

It is computed from each cell's range of ids, in O(Sq + Sk + R * C), never
from the (Sq, Sk) comparison: disjoint ranges share no id, and ranges that
are one and the same value are all equal. Any total order of the ids gives a
right map; sorted (packed) ids give the tightest one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jax_flash import _ffi

BLOCK_MASK_BLOCK = _ffi.BLOCK_MASK_BLOCK
CELL_EMPTY, CELL_PARTIAL, CELL_FULL = _ffi.CELL_EMPTY, _ffi.CELL_PARTIAL, _ffi.CELL_FULL


def _classes(any_visible, all_visible):
  """uint8 cell classes from whether some and whether every pair of each cell is visible."""
  tile_map = jnp.where(all_visible, CELL_FULL, jnp.where(any_visible, CELL_PARTIAL, CELL_EMPTY))
  return tile_map.astype(jnp.uint8)


def _whole_sequences(x, seq_dims):
  """`x` (segment ids or a mask) with its sequence dims `seq_dims` unsharded.

  Cells cut across those dims, which jax refuses to do to a dim sharded
  explicitly (AxisType.Explicit); gathering them costs little next to the
  attention they go with, whose tile map is whole on every device anyway.
  Arrays whose sequence dims are not sharded are returned as they are.
  """
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if all(spec[d] is None for d in seq_dims):
    return x
  whole = PartitionSpec(*(None if d in seq_dims else a for d, a in enumerate(spec)))
  return jax.sharding.reshard(x, sharding.update(spec=whole))


def _cell_ranges(ids):
  """(min, max) of the ids of each cell, (B, ceil(S / BLOCK_MASK_BLOCK)) each.

  The last cell is filled up with its last id (edge padding), which leaves
  its range as it is.
  """
  batch, length = ids.shape
  cells = -(-length // BLOCK_MASK_BLOCK)
  fill = cells * BLOCK_MASK_BLOCK - length
  if fill:
    # Spelled out rather than jnp.pad(mode="edge"), which also slices the
    # batch dim and so fails on a batch sharded explicitly.
    last = jnp.broadcast_to(ids[:, -1:], (batch, fill))
    ids = jnp.concatenate([ids, last], axis=1)
  ids = ids.reshape(batch, cells, BLOCK_MASK_BLOCK)
  return jnp.min(ids, axis=-1), jnp.max(ids, axis=-1)


def from_segment_ids(q_segment_ids, kv_segment_ids):
  """The tile map of segment ids: uint8 ``(B, 1, ceil(Sq / 128), ceil(Sk / 128))``.

  Args:
    q_segment_ids: integer ``(B, Sq)``.
    kv_segment_ids: integer ``(B, Sk)``, of a dtype comparable with the
      query's (query ``i`` sees key ``j`` only where the ids are equal).

  Returns:
    Per batch element and cell, ``CELL_EMPTY``, ``CELL_PARTIAL`` or
    ``CELL_FULL``; one head, which every head shares.
  """
  for name, ids in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
    if getattr(ids, "ndim", None) != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array of shape (batch, seq), got "
                      f"{getattr(ids, 'dtype', type(ids).__name__)} "
                      f"{tuple(getattr(ids, 'shape', ()))}")
  if q_segment_ids.shape[0] != kv_segment_ids.shape[0]:
    raise ValueError("q_segment_ids and kv_segment_ids must have the same batch, got shapes "
                     f"{tuple(q_segment_ids.shape)} and {tuple(kv_segment_ids.shape)}")
  q_ids, kv_ids = (_whole_sequences(jnp.asarray(x), (1,)) for x in (q_segment_ids, kv_segment_ids))
  if jax.typeof(kv_ids).sharding.spec != jax.typeof(q_ids).sharding.spec:
    # Explicit axes with the batch sharded one way for the queries and
    # another for the keys (gathered, with a warning, for the kernels):
    # compared cell by cell, the ids must agree first.
    kv_ids = jax.sharding.reshard(kv_ids, jax.typeof(q_ids).sharding)
  q_min, q_max = (x[:, :, None] for x in _cell_ranges(q_ids))
  kv_min, kv_max = (x[:, None, :] for x in _cell_ranges(kv_ids))
  overlap = (q_min <= kv_max) & (kv_min <= q_max)
  full = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
  return _classes(overlap, full)[:, None]


def _cells(length):
  """(cell size, cells, pairs in each cell) along a dim of `length`: one cell
  for a dim of 1 (broadcast), else cells of BLOCK_MASK_BLOCK, the last one
  short."""
  size = BLOCK_MASK_BLOCK if length > 1 else 1
  cells = -(-length // size)
  counts = np.full(cells, size, np.int32)
  if cells:  # none for a dim of 0 (an empty problem)
    counts[-1] = length - (cells - 1) * size
  return size, cells, counts


def from_mask(mask):
  """The tile map of a boolean mask ``(B', H', T', S')`` (a dim of 1 broadcasts).

  Returns:
    uint8 ``(B', 1, R, C)``, ``R = ceil(T' / 128)`` (1 where ``T' = 1``) and
    ``C`` likewise: ``CELL_EMPTY`` where no head sees any pair of the cell,
    ``CELL_FULL`` where every head sees every pair, ``CELL_PARTIAL``
    otherwise. One pass over the mask, in XLA: the visible pairs of each cell
    counted, against the number of its pairs.
  """
  if getattr(mask, "ndim", None) != 4 or mask.dtype != jnp.bool_:
    raise TypeError("mask must be a boolean array of rank 4, got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)} "
                    f"{tuple(getattr(mask, 'shape', ()))}")
  mask = _whole_sequences(mask, (2, 3))
  batch, heads, rows, cols = mask.shape
  row_size, row_cells, row_counts = _cells(rows)
  col_size, col_cells, col_counts = _cells(cols)
  padded = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, col_cells * col_size - cols)))
  # Each cell's visible pairs over all heads, one axis split at a time: jax
  # refuses a reshape that splits T and S together for a batch-sharded mask
  # under explicit axes, and a window sum (lax.reduce_window) fails for a
  # head-sharded one and is slow on GPUs. The first sum reads the mask once,
  # along its contiguous last axis; the heads are summed last, so that a
  # head-sharded mask all-reduces one int32 per cell.
  # Padding (False) counts nothing.
  per_row = padded.reshape(batch, heads, rows, col_cells, col_size).sum(
      axis=4, dtype=jnp.int32)  # (B', H', T, C)
  per_row = jnp.pad(per_row, ((0, 0), (0, 0), (0, row_cells * row_size - rows), (0, 0)))
  visible = per_row.reshape(batch, heads, row_cells, row_size, col_cells).sum(
      axis=(1, 3), dtype=jnp.int32)[:, None]
  pairs = heads * row_counts[:, None] * col_counts[None, :]  # (R, C), static
  return _classes(visible > 0, visible == pairs)


def from_block_mask(block_mask, seqlen_q, seqlen_k):
  """The tile map of a block mask ``(B', H', R', C')`` (a dim of 1 broadcasts;
  R' and C' may exceed the problem's cells): uint8 ``(B', 1, R, C)`` over the
  problem's cells (1 where the mask's dim is), ``CELL_FULL`` where every head
  sees the cell, ``CELL_EMPTY`` where none does, ``CELL_PARTIAL`` otherwise.

  Folded into the tile map, a block mask of one head is exact for the
  kernels that skip empty cells (the tensor-core ones, cuda/dispatch.cu); with several
  heads those kernels do not take it and the map stays a hint.
  """
  rows, cols = -(-seqlen_q // BLOCK_MASK_BLOCK), -(-seqlen_k // BLOCK_MASK_BLOCK)
  block_mask = block_mask[:, :, :rows, :cols]  # a dim of 1 stays 1
  return _classes(jnp.any(block_mask, axis=1, keepdims=True),
                  jnp.all(block_mask, axis=1, keepdims=True))


def combine(*tile_maps):
  """The tile map of several terms together: per cell the lowest class (empty if
  any term leaves it empty, full only where every term does), broadcast."""
  result = tile_maps[0]
  for tile_map in tile_maps[1:]:
    result = jnp.minimum(result, tile_map)
  return result

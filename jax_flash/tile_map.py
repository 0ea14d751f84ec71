"""The tile map: per cell of positions, what the segment ids leave visible there.

The cells are the block mask's, ``BLOCK_MASK_BLOCK`` query rows by as many
keys. A cell is empty (``CELL_EMPTY``) where no query's id equals any key's,
full (``CELL_FULL``) where all are equal, partial (``CELL_PARTIAL``)
otherwise. The kernels take it as a hint (the ``tile_map`` operand,
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
from jax.sharding import PartitionSpec

from jax_flash import _ffi

BLOCK_MASK_BLOCK = _ffi.BLOCK_MASK_BLOCK
CELL_EMPTY, CELL_PARTIAL, CELL_FULL = _ffi.CELL_EMPTY, _ffi.CELL_PARTIAL, _ffi.CELL_FULL


def _whole_sequence(ids):
  """The ids with their sequence dim unsharded.

  Cells cut across that dim, which jax refuses to do to a dim sharded
  explicitly (AxisType.Explicit); gathering the ids (B x S) costs little
  next to the attention they go with, whose tile map is whole on every
  device anyway. Other ids are returned as they are.
  """
  sharding = jax.typeof(ids).sharding
  spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
  if spec[1] is None:
    return ids
  return jax.sharding.reshard(ids, sharding.update(spec=PartitionSpec(spec[0], None)))


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
  q_min, q_max = (x[:, :, None] for x in _cell_ranges(_whole_sequence(jnp.asarray(q_segment_ids))))
  kv_min, kv_max = (x[:, None, :]
                    for x in _cell_ranges(_whole_sequence(jnp.asarray(kv_segment_ids))))
  overlap = (q_min <= kv_max) & (kv_min <= q_max)
  full = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
  tile_map = jnp.where(full, CELL_FULL, jnp.where(overlap, CELL_PARTIAL, CELL_EMPTY))
  return tile_map.astype(jnp.uint8)[:, None]

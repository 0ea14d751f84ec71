"""The tile map: per 128 x 128 cell, what the segment ids leave visible there.

from_segment_ids against the classes of the explicit (Sq, Sk) equality
matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.tile_map import CELL_EMPTY, CELL_FULL, CELL_PARTIAL, from_segment_ids

BLOCK = jax_flash.BLOCK_MASK_BLOCK


def exact_classes(q_ids, kv_ids):
  """The class of every cell from the (B, Sq, Sk) equality matrix, (B, 1, R, C)."""
  equal = q_ids[:, :, None] == kv_ids[:, None, :]
  rows, cols = -(-q_ids.shape[1] // BLOCK), -(-kv_ids.shape[1] // BLOCK)
  classes = np.empty((q_ids.shape[0], 1, rows, cols), np.uint8)
  for r in range(rows):
    for c in range(cols):
      cell = equal[:, r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK]
      classes[:, 0, r, c] = np.where(cell.all(axis=(1, 2)), CELL_FULL,
                                     np.where(cell.any(axis=(1, 2)), CELL_PARTIAL, CELL_EMPTY))
  return classes


def packed_ids(rng, batch, length, mean_segment):
  """Sorted ids that step by 0 or 1 (packing): each cell's ids are a whole
  range of integers, so ranges that overlap share an id."""
  return np.cumsum(rng.random((batch, length)) < 1 / mean_segment, axis=1).astype(np.int32)


def shuffled_ids(rng, batch, length, num_ids=5):
  """Runs of random lengths with ids in no order, repeating across the sequence."""
  runs = rng.integers(1, 200, size=(batch, length))
  ids = np.empty((batch, length), np.int32)
  for b in range(batch):
    values = np.repeat(rng.integers(0, num_ids, size=length), runs[b])[:length]
    ids[b] = values
  return ids


SIZES = [(1, 1), (17, 300), (127, 128), (128, 129), (129, 17), (300, 127), (300, 300)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SIZES, ids=lambda n: str(n))
def test_packed_ids_give_the_exact_classes(seqlen_q, seqlen_k):
  rng = np.random.default_rng(seqlen_q * 1000 + seqlen_k)
  q_ids = packed_ids(rng, 3, seqlen_q, 90)
  kv_ids = packed_ids(rng, 3, seqlen_k, 90)
  got = jax.jit(from_segment_ids)(q_ids, kv_ids)
  assert got.dtype == jnp.uint8
  assert got.shape == (3, 1, -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK))
  np.testing.assert_array_equal(np.asarray(got), exact_classes(q_ids, kv_ids))


@pytest.mark.parametrize("seqlen_q,seqlen_k", SIZES, ids=lambda n: str(n))
def test_any_ids_give_a_map_the_kernels_may_trust(seqlen_q, seqlen_k):
  """Ids in no order: a cell called empty has no equal pair, a cell is full
  exactly when every pair is equal (what lets a kernel skip the test)."""
  rng = np.random.default_rng(seqlen_q + seqlen_k)
  q_ids, kv_ids = shuffled_ids(rng, 3, seqlen_q), shuffled_ids(rng, 3, seqlen_k)
  got = np.asarray(from_segment_ids(q_ids, kv_ids))
  exact = exact_classes(q_ids, kv_ids)
  assert not np.any((got == CELL_EMPTY) & (exact != CELL_EMPTY))
  np.testing.assert_array_equal(got == CELL_FULL, exact == CELL_FULL)


def test_cells_of_aligned_segments():
  """Three segments of 128, 128 and 44 tokens against keys in two of 200 and
  60: every class, and the padded last cells keep their own range."""
  q_ids = np.repeat([0, 1, 2], [128, 128, 44])[None]
  kv_ids = np.repeat([1, 2], [200, 60])[None]
  want = [[CELL_EMPTY, CELL_EMPTY, CELL_EMPTY],
          [CELL_FULL, CELL_PARTIAL, CELL_EMPTY],
          [CELL_EMPTY, CELL_PARTIAL, CELL_FULL]]
  np.testing.assert_array_equal(np.asarray(from_segment_ids(q_ids, kv_ids))[0, 0], want)


def test_bad_ids_are_refused():
  with pytest.raises(TypeError, match=r"q_segment_ids must be an integer array"):
    from_segment_ids(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int32))
  with pytest.raises(TypeError, match=r"kv_segment_ids must be an integer array .*\(3,\)"):
    from_segment_ids(np.zeros((2, 3), np.int32), np.zeros((3,), np.int32))
  with pytest.raises(ValueError, match="the same batch"):
    from_segment_ids(np.zeros((2, 3), np.int32), np.zeros((1, 3), np.int32))

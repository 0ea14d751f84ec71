"""The tile map: per 128 x 128 cell, what the segment ids leave visible there.

from_segment_ids against the classes of the explicit (Sq, Sk) equality
matrix; flash_attention passes it to every call (forward, backward, forward
mode) when segment ids are given and an absent operand otherwise; the
handlers check it; the CPU kernels skip the cells it calls empty, so a map
read at the wrong place (a sequence shard, a vmapped batch) would give wrong
results, which the float64 reference would catch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash import _ffi, attention
from jax_flash.primitives import MASK_OPERANDS, flash_fwd_p, mask_operands
from jax_flash.sharding import partitioning
from jax_flash.tile_map import CELL_EMPTY, CELL_FULL, CELL_PARTIAL, from_segment_ids
from reference import Options, attention as dense_attention, make_inputs, visible_mask
from test_contract import _calls

BLOCK = jax_flash.BLOCK_MASK_BLOCK
_TILE_MAP = MASK_OPERANDS.index("tile_map")


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


# -- flash_attention passes it --------------------------------------------------


def _tile_map_types(text):
  """The tile_map operand's tensor type in every jax_flash call, by target."""
  types = {}
  for target, operands, _, _ in _calls(text):
    types.setdefault(target, set()).add(operands[_ffi.operands(target).index("tile_map")])
  return types


@pytest.mark.parametrize("with_segments", [True, False], ids=["segments", "none"])
def test_every_lowered_call_carries_the_tile_map(with_segments):
  q = jax.ShapeDtypeStruct((2, 300, 4, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((2, 140, 2, 8), jnp.float32)
  q_ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((2, 140), jnp.int32)

  def every_call(q, k, v, q_ids, kv_ids):
    ids = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids) if with_segments else {}
    f = lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True, **ids)
    tangent = jax.jvp(f, (q, k, v), (q, k, v))[1]
    grads = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
    return tangent, grads

  text = jax.jit(every_call).trace(q, k, k, q_ids, kv_ids).lower(
      lowering_platforms=("cpu",)).as_text()
  want = "tensor<2x1x3x2xui8>" if with_segments else "tensor<0xui8>"
  assert _tile_map_types(text) == {target: {want} for target in
                                   (_ffi.FWD_TARGET, _ffi.BWD_TARGET, _ffi.JVP_TARGET)}


@pytest.mark.parametrize("with_mask", [False, True], ids=["segments", "segments_and_mask"])
def test_flash_attention_passes_the_map_of_its_ids(monkeypatch, with_mask):
  """The ids' map, with a (batch..., T) batch shape flattened; with a dense
  mask no cell is full, since a full cell skips the mask's test too."""
  seen = []
  original = attention._attention
  monkeypatch.setattr(attention, "_attention",
                      lambda config, *ops: seen.append(ops) or original(config, *ops))
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 3, 260, 2, 8)))
  q_ids = packed_ids(rng, 6, 260, 100).reshape(2, 3, 260)
  mask = rng.random((260, 260)) > 0.1 if with_mask else None
  jax_flash.flash_attention(q, q, q, q_segment_ids=q_ids, kv_segment_ids=q_ids, mask=mask)
  flat = q_ids.reshape(6, 260)
  want = exact_classes(flat, flat)
  assert (want == CELL_FULL).any()
  if with_mask:
    want = np.minimum(want, CELL_PARTIAL)
  np.testing.assert_array_equal(np.asarray(seen[0][3 + _TILE_MAP]), want)


# -- the kernels read it --------------------------------------------------------

PARAMS = dict(scale=0.5, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
              dropout_rate=0.0, broadcast_dropout=False)


def test_the_cpu_kernels_skip_the_cells_it_calls_empty():
  """A map (a hint: here not derived from any ids) that calls cell (1, 0)
  empty hides exactly that block, as the kernels that read it do; under vmap
  its batch of 1 broadcasts over the batch of every example."""
  rng = np.random.default_rng(5)
  # On the CPU, whose kernels read the map; a GPU kernel may ignore it.
  cpu = jax.devices("cpu")[0]
  q, k, v = (jax.device_put(rng.standard_normal((3, 2, n, h, 8)), cpu)
             for n, h in ((200, 2), (150, 1), (150, 1)))
  tile_map = np.full((1, 1, 2, 2), CELL_PARTIAL, np.uint8)
  tile_map[0, 0, 1, 0] = CELL_EMPTY
  ops = mask_operands(q.dtype, tile_map=jax.device_put(tile_map, cpu))
  fwd = lambda q, k, v: flash_fwd_p.bind(q, k, v, *ops, **PARAMS, deterministic=False)[0]
  out = jax.jit(jax.vmap(fwd))(q, k, v)
  visible = np.ones((1, 1, 200, 150), bool)
  visible[..., 128:, :128] = False
  for n in range(3):
    want, _ = dense_attention(q[n], k[n], v[n], visible, Options(scale=0.5))
    np.testing.assert_allclose(np.asarray(out[n]), np.asarray(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["dtype", "cells", "batch", "heads"])
def test_the_handler_refuses_a_bad_tile_map(backend, case):
  q = jnp.zeros((2, 300, 2, 8))
  k = jnp.zeros((2, 130, 2, 8))
  bad, message = {
      "dtype": (np.zeros((1, 1, 3, 2), np.int32), "tile_map must be uint8"),
      "cells": (np.zeros((2, 1, 2, 2), np.uint8), "tile_map must be rank 4"),
      "batch": (np.zeros((3, 1, 3, 2), np.uint8), "tile_map must be rank 4"),
      # The kernels read one map for every head (a dK/dV block's GQA group).
      "heads": (np.zeros((2, 2, 3, 2), np.uint8), r"tile_map must have one head .*\(2, 2, 3, 2\)"),
  }[case]
  ops = mask_operands(q.dtype, tile_map=jnp.asarray(bad))
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(flash_fwd_p.bind(q, k, k, *ops, **PARAMS, deterministic=False))


def segment_problem(seed, batch=2, seqlen_q=300, seqlen_k=260):
  """Inputs with packed ids whose segments span several cells, and the options."""
  rng = np.random.default_rng(seed)
  inputs = make_inputs(rng, batch, seqlen_q, seqlen_k, 2, 1, 8)
  inputs.q_segments = packed_ids(rng, batch, seqlen_q, 70)
  inputs.kv_segments = packed_ids(rng, batch, seqlen_k, 60)
  assert (exact_classes(inputs.q_segments, inputs.kv_segments) == CELL_EMPTY).any()
  return inputs, Options(is_causal=True, with_segments=True)


def test_transforms_with_segments_spanning_cells(backend):
  """grad, jvp and vmap over the ids (a mapped tile map), against float64."""
  inputs, opts = segment_problem(7)
  q, k, v, dout = (jnp.asarray(x) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
  kwargs = opts.kwargs(inputs)
  flash = lambda q, k, v: jax_flash.flash_attention(q, k, v, **kwargs)
  dense = lambda q, k, v: dense_attention(q, k, v, visible_mask(opts, inputs), opts)[0]
  check = lambda got, want: np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                                       rtol=1e-9, atol=1e-11)
  vjp = lambda f, q, k, v: jax.vjp(f, q, k, v)[1](dout)
  for g, w in zip(jax.jit(vjp, static_argnums=0)(flash, q, k, v), vjp(dense, q, k, v)):
    check(g, w)
  tangents = (dout, k[:, ::-1], v)
  for g, w in zip(jax.jit(lambda *p: jax.jvp(flash, p, tangents))(q, k, v),
                  jax.jvp(dense, (q, k, v), tangents)):
    check(g, w)
  # One problem per batch element, vmapped over its ids.
  per_example = lambda q, k, v, a, b: jax_flash.flash_attention(
      q[None], k[None], v[None], is_causal=True, q_segment_ids=a[None], kv_segment_ids=b[None])[0]
  got = jax.jit(jax.vmap(per_example))(q, k, v, inputs.q_segments, inputs.kv_segments)
  check(got, dense(q, k, v))


def test_sequence_shards_read_the_whole_map_by_position():
  """Queries sharded over the sequence in chunks that are not whole cells:
  each device reads the whole map at its own positions (the CPU kernels skip
  what it calls empty, so reading it from row 0 would be wrong)."""
  cpus = jax.devices("cpu")
  if len(cpus) < 2:
    pytest.skip("needs 2 CPU devices")
  mesh = jax.make_mesh((2,), ("x",), devices=cpus[:2])
  inputs, opts = segment_problem(9, batch=1)  # 150 query rows per device
  opts = Options(with_segments=True)  # no band: the ids alone need positions
  kwargs = opts.kwargs(inputs)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax_flash.flash_attention(
      q, k, v, **kwargs))), argnums=(0, 1, 2)))
  q = jax.device_put(jnp.asarray(inputs.q), NamedSharding(mesh, P(None, "x")))
  got = f(q, jnp.asarray(inputs.k), jnp.asarray(inputs.v))
  assert got[0].sharding.spec[1] == "x"
  visible = visible_mask(opts, inputs)
  want = jax.grad(lambda *a: jnp.sum(jnp.sin(dense_attention(*a, visible, opts)[0])),
                  argnums=(0, 1, 2))(*map(jnp.asarray, (inputs.q, inputs.k, inputs.v)))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)


def test_ids_sharded_explicitly_over_the_sequence():
  """Explicit sharding refuses to cut a sharded dim into cells: the ids are
  gathered for the map (the call itself gathers the keys' side, as without)."""
  cpus = jax.devices("cpu")
  if len(cpus) < 2:
    pytest.skip("needs 2 CPU devices")
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=cpus[:2])
  inputs, opts = segment_problem(11, seqlen_k=300)
  q, k, v, q_ids, kv_ids = (
      jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "x")))
      for x in (inputs.q, inputs.k, inputs.v, inputs.q_segments, inputs.kv_segments))
  loss = lambda q, k, v: jnp.sum(jnp.sin(jax_flash.flash_attention(
      q, k, v, is_causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)))
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", partitioning.ShardingFallbackWarning)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  visible = visible_mask(opts, inputs)
  want = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(dense_attention(*a, visible, opts)[0])),
                            argnums=(0, 1, 2))(*map(jnp.asarray, (inputs.q, inputs.k, inputs.v)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)


def test_shard_map_over_the_batch():
  """Inside shard_map each device maps its own ids; the gradient type-checks."""
  cpus = jax.devices("cpu")
  if len(cpus) < 2:
    pytest.skip("needs 2 CPU devices")
  mesh = jax.make_mesh((2,), ("x",), devices=cpus[:2])
  inputs, opts = segment_problem(13)
  attend = jax.shard_map(
      lambda q, k, v, a, b: jax_flash.flash_attention(q, k, v, is_causal=True, q_segment_ids=a,
                                                      kv_segment_ids=b),
      mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x")))
  operands = [put(x) for x in (inputs.q, inputs.k, inputs.v)]
  ids = (put(inputs.q_segments), put(inputs.kv_segments))
  got = jax.jit(lambda *a: jax.vjp(lambda q, k, v: attend(q, k, v, *ids), *a)[1](
      put(inputs.dout)))(*operands)
  visible = visible_mask(opts, inputs)
  want = jax.vjp(lambda *a: dense_attention(*a, visible, opts)[0], *operands)[1](
      jnp.asarray(inputs.dout))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)


def exact_mask_classes(mask):
  """The class of every cell of a (B', H', T', S') mask, over its heads, (B', 1, R, C);
  a dim of 1 stays one cell."""
  batch, _, rows, cols = mask.shape
  row_block = BLOCK if rows > 1 else 1
  col_block = BLOCK if cols > 1 else 1
  row_cells, col_cells = -(-rows // row_block), -(-cols // col_block)
  classes = np.empty((batch, 1, row_cells, col_cells), np.uint8)
  for r in range(row_cells):
    for c in range(col_cells):
      cell = mask[:, :, r * row_block:(r + 1) * row_block, c * col_block:(c + 1) * col_block]
      classes[:, 0, r, c] = np.where(cell.all(axis=(1, 2, 3)), CELL_FULL,
                                     np.where(cell.any(axis=(1, 2, 3)), CELL_PARTIAL, CELL_EMPTY))
  return classes


@pytest.mark.parametrize("shape", [(2, 3, 300, 257), (1, 1, 129, 129), (3, 1, 1, 300),
                                   (1, 2, 17, 1), (2, 1, 256, 128)], ids=str)
@pytest.mark.parametrize("kind", ["causal", "padding", "random_blocks"])
def test_mask_gives_the_exact_classes(shape, kind):
  """Masks whose cells fall in every class: causal (empty above, full below
  the diagonal), padding (full, then partial, then empty), blocks of 64
  hidden, visible or random."""
  rng = np.random.default_rng(sum(shape))
  batch, heads, rows, cols = shape
  i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
  if kind == "causal":
    mask = np.broadcast_to(j <= i, shape)
  elif kind == "padding":
    mask = np.broadcast_to(j < rng.integers(0, cols + 1, size=(batch, 1, 1, 1)), shape)
  else:
    kinds = rng.integers(0, 3, size=(batch, heads, -(-rows // 64), -(-cols // 64)))
    kinds = kinds.repeat(64, axis=2)[:, :, :rows].repeat(64, axis=3)[:, :, :, :cols]
    mask = (kinds == 1) | ((kinds == 2) & (rng.random(shape) < 0.5))
  mask = np.ascontiguousarray(mask)
  got = jax.jit(jax_flash.tile_map.from_mask)(mask)
  assert got.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(got), exact_mask_classes(mask))


def test_segments_and_mask_combine_to_the_lower_class():
  """Per cell the lower of the two classes, which is a map the kernels may
  trust for both terms together: empty cells see no pair, full ones all."""
  rng = np.random.default_rng(7)
  q_ids, kv_ids = packed_ids(rng, 3, 400, 400), packed_ids(rng, 3, 300, 400)
  mask = np.broadcast_to(np.arange(300)[None, :] <= np.arange(400)[:, None], (3, 1, 400, 300))
  got = np.asarray(jax_flash.tile_map.combine(from_segment_ids(q_ids, kv_ids),
                                              jax_flash.tile_map.from_mask(mask)))
  np.testing.assert_array_equal(
      got, np.minimum(exact_classes(q_ids, kv_ids), exact_mask_classes(mask)))
  both = exact_mask_classes((q_ids[:, :, None] == kv_ids[:, None, :])[:, None] & mask)
  assert not np.any((got == CELL_EMPTY) & (both != CELL_EMPTY))
  assert not np.any((got == CELL_FULL) & (both != CELL_FULL))
  assert np.any(got == CELL_EMPTY) and np.any(got == CELL_FULL) and np.any(got == CELL_PARTIAL)


@pytest.mark.parametrize("shape", [(2, 1, 3, 4), (1, 3, 5, 6), (2, 2, 1, 4), (1, 1, 3, 1)],
                         ids=str)
def test_block_mask_cells(shape):
  """Visible in every head: full; in none: empty; in some: partial. Cells past
  the problem's (a larger mask) are cut; a dim of 1 stays one cell."""
  seqlen_q, seqlen_k = 300, 400  # 3 x 4 cells
  rng = np.random.default_rng(sum(shape))
  block_mask = rng.random(shape) < 0.5
  got = np.asarray(jax_flash.tile_map.from_block_mask(block_mask, seqlen_q, seqlen_k))
  cut = block_mask[:, :, :3, :4]
  want = np.where(cut.all(axis=1, keepdims=True), CELL_FULL,
                  np.where(cut.any(axis=1, keepdims=True), CELL_PARTIAL, CELL_EMPTY))
  assert got.dtype == np.uint8
  np.testing.assert_array_equal(got, want)

"""Many devices: sharded jit, shard_map (the offsets operand: test_offsets.py).

On four CPU devices (conftest.py sets --xla_force_host_platform_device_count):
the compiled program of batch-, head- and batch-x-head-sharded jit holds no
collective at all (each device runs its own shard, which the custom calls'
local shapes show), results equal the float64 reference, shardings are kept;
queries sharded over the sequence run locally; other shardings are gathered
with a warning and stay right; a sharded run drops what the unsharded one
does; shard_map forward and gradient type-check (check_vma=True).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash
from conftest import assert_flash_close
from jax_flash.sharding import partitioning
from reference import (Options, attention, make_inputs, one_hot_problem, recovered_mask,
                       visible_mask)
from reference import attention_and_grads as dense_attention_and_grads

# The float64 reference under jit: one compilation per shape instead of one
# per operation. (The plain same-dtype implementations stay eager: under jit
# XLA may keep excess precision, which would make them a different yardstick.)
attention_and_grads = jax.jit(dense_attention_and_grads, static_argnums=5)

COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                        r"(-start)?\(")


def collectives(compiled_text: str) -> set[str]:
  return {m.group(1) for m in COLLECTIVE.finditer(compiled_text)}


def kernel_result_shapes(compiled_text: str, target: str, index=0) -> list[tuple[int, ...]]:
  """The shape of result `index` of every custom call to `target` (per device)."""
  shapes = []
  for line in compiled_text.splitlines():
    if f'custom_call_target="{target}"' in line:
      results = line.split(" custom-call(", 1)[0]
      dims = re.findall(r"\w+\[([\d,]*)\]", results)[index]
      shapes.append(tuple(int(d) for d in dims.split(",") if d))
  return shapes


# -- many CPU devices ------------------------------------------------------------


@pytest.fixture(scope="module")
def devices():
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
  return cpus[:4]


def mesh_2x2(devices, axis_type=AxisType.Auto):
  return jax.make_mesh((2, 2), ("x", "y"), axis_types=(axis_type,) * 2, devices=devices)


def put(mesh, spec, *arrays):
  return [jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec)) for a in arrays]


def flash_and_grads(kwargs, with_bias=False):
  """jit of (out, dq, dk, dv[, dbias]) of flash_attention, like attention_and_grads;
  without with_bias, a bias is not differentiated."""
  def f(q, k, v, dout, bias):
    fn = lambda q, k, v, *b: jax_flash.flash_attention(q, k, v, bias=b[0] if b else bias,
                                                       **kwargs)
    out, vjp = jax.vjp(fn, q, k, v, *((bias,) if with_bias else ()))
    return (out,) + vjp(dout)
  return jax.jit(f)


def flash_and_grads_of(operands, **kwargs):
  """Like flash_and_grads, with the arrays of `operands` (a mask, segment
  ids, ...) arguments of the jitted function: as constants, XLA would fold
  their tile map and no sharding of theirs would reach the partitioner.
  Call it as f(q, k, v, dout, operands)."""
  @jax.jit
  def f(q, k, v, dout, operands):
    fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, **operands, **kwargs)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(dout)
  return f


def check_against_reference(got, inputs, opts, bias=None):
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                            visible_mask(opts, inputs), opts, bias=bias)
  ref = ref[:1] + ref[2:]  # no lse
  for name, g, r in zip(["out", "dq", "dk", "dv", "dbias"], got, ref):
    assert_flash_close(name, g, r, r, jnp.float64)


# (query spec, key/value spec, heads, kv heads): the three layouts,
# multi-query attention, and key/value heads split over part of the axes.
LOCAL_CASES = {
    "batch": (P(("x", "y")), P(("x", "y")), 8, 4),
    "heads": (P(None, None, ("x", "y")), P(None, None, ("x", "y")), 8, 4),
    "batch_x_heads": (P("x", None, "y"), P("x", None, "y"), 8, 2),
    "heads_x_batch": (P("y", None, "x"), P("y", None, "x"), 4, 2),
}


@pytest.mark.parametrize("case", list(LOCAL_CASES) + ["batch_x_heads_explicit"])
def test_sharded_jit_runs_each_shard_locally(devices, case):
  """Also with explicit sharding (jax.make_mesh's default axis type), there
  with a mask of several tiles (its tile map once reshaped T and S into
  cells, which jax refuses for a batch-sharded array under explicit axes)."""
  explicit = case.endswith("_explicit")
  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  q_spec, kv_spec, heads, kv_heads = LOCAL_CASES[case.removesuffix("_explicit")]
  mesh = mesh_2x2(devices, axis_type)
  seqlen = 160 if explicit else 37
  inputs = make_inputs(np.random.default_rng(1), 4, seqlen, seqlen, heads, kv_heads, 16)
  opts = Options(is_causal=True, window=(20, 3), softcap=4.0, with_lengths=True,
                 with_segments=True, mask_shape=(4, 1, seqlen, seqlen))
  kwargs = opts.kwargs(inputs)
  # Per-batch operands follow the query's batch sharding; without them the
  # compiled program would be allowed to slice them from replicated copies.
  batch_spec = P(q_spec[0])
  for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids",
               "mask"):
    kwargs[name], = put(mesh, batch_spec, kwargs[name])
  q, dout = put(mesh, q_spec, inputs.q, inputs.dout)
  k, v = put(mesh, kv_spec, inputs.k, inputs.v)
  f = flash_and_grads(kwargs)
  text = f.lower(q, k, v, dout, None).compile().as_text()
  assert collectives(text) == set(), collectives(text)
  local_q = NamedSharding(mesh, q_spec).shard_shape(q.shape)
  assert kernel_result_shapes(text, "jax_flash_fwd") == [local_q]
  assert kernel_result_shapes(text, "jax_flash_bwd") == [local_q]
  got = f(q, k, v, dout, None)
  for x, like in zip(got, (q, q, k, v)):
    assert x.sharding.is_equivalent_to(like.sharding, x.ndim)
  check_against_reference(got, inputs, opts)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_head_sharded_mask_sums_only_its_tile_map(devices, axis_type):
  """A mask with a head per query head, sharded over batch and heads, an
  argument of the jitted function: its tile map (one class per 128 x 128
  cell, over all heads) is the one thing summed across devices, an
  all-reduce of one int32 per cell; the kernels run on local shards. Under
  explicit axes the map once took a window sum, which jax refuses for a
  head-sharded array."""
  q_spec, kv_spec, heads, kv_heads = LOCAL_CASES["batch_x_heads"]
  mesh = mesh_2x2(devices, axis_type)
  seqlen = 160
  inputs = make_inputs(np.random.default_rng(6), 4, seqlen, seqlen, heads, kv_heads, 16)
  opts = Options(is_causal=True, mask_shape=(4, heads, seqlen, seqlen))
  mask, = put(mesh, P(q_spec[0], q_spec[2]), opts.kwargs(inputs)["mask"])
  q, dout = put(mesh, q_spec, inputs.q, inputs.dout)
  k, v = put(mesh, kv_spec, inputs.k, inputs.v)

  f = flash_and_grads_of({"mask": mask}, is_causal=True)
  text = f.lower(q, k, v, dout, {"mask": mask}).compile().as_text()
  assert collectives(text) == {"all-reduce"}
  local_batch = NamedSharding(mesh, q_spec).shard_shape(q.shape)[0]
  cells = -(-seqlen // jax_flash.BLOCK_MASK_BLOCK)
  reduced = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-reduce(?:-start)?\(", text)
  assert reduced == [("s32", f"{local_batch},{cells},{cells}")], reduced
  local_q = NamedSharding(mesh, q_spec).shard_shape(q.shape)
  assert kernel_result_shapes(text, "jax_flash_fwd") == [local_q]
  assert kernel_result_shapes(text, "jax_flash_bwd") == [local_q]
  check_against_reference(f(q, k, v, dout, {"mask": mask}), inputs, opts)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("heads", [4, 8])
def test_query_heads_over_more_devices_than_key_value_heads(devices, axis_type, heads):
  """Query heads over 4 devices, 2 key/value heads kept whole: no device can
  hold key/value heads split like its query heads, but each device's query
  heads share one, which it takes from K and V; dK and dV are its share in
  that head's place, summed over devices (one all-reduce). This once gathered
  the queries with a warning, and before that failed to compile
  (IndivisibleError: Shardy had split the axis between the key/value heads
  and their groups, a sub-axis on K, V and their gradients)."""
  mesh = jax.make_mesh((4,), ("y",), axis_types=(axis_type,), devices=devices)
  inputs = make_inputs(np.random.default_rng(7), 1, 24, 24, heads, 2, 8)
  opts = Options(is_causal=True, window=(9, 2))
  q, dout = put(mesh, P(None, None, "y"), inputs.q, inputs.dout)
  k, v = put(mesh, P(), inputs.k, inputs.v)
  f = flash_and_grads(opts.kwargs(inputs))
  with warnings.catch_warnings():
    warnings.simplefilter("error", partitioning.ShardingFallbackWarning)
    text = f.lower(q, k, v, dout, None).compile().as_text()
  assert collectives(text) == {"all-reduce"}
  assert kernel_result_shapes(text, "jax_flash_fwd") == [(1, 24, heads // 4, 8)]
  assert kernel_result_shapes(text, "jax_flash_bwd", 1) == [(1, 24, 1, 8)]  # dK: one head
  check_against_reference(f(q, k, v, dout, None), inputs, opts)


@pytest.mark.parametrize("case", ["batch_x_heads", "sequence"])
def test_sharded_jit_under_set_mesh(devices, case):
  """Explicit axes in the context (jax.set_mesh): the per-device program is
  traced with every axis manual, so none of its ops keeps a Sharding custom
  call that the compiled program cannot run (jax 0.11). Query positions
  (sequence) and a bias gradient summed over the batch (batch_x_heads) are
  computed in that program."""
  mesh = mesh_2x2(devices, AxisType.Explicit)
  inputs = make_inputs(np.random.default_rng(4), 4, 40, 40, 8, 2, 16)  # explicit: even shards
  opts = Options(is_causal=True, bias_shape=(1, 8, 40, 40))
  spec = P("x", None, "y") if case == "batch_x_heads" else P(None, ("x", "y"))
  q, k, v, dout = put(mesh, spec, inputs.q, inputs.k, inputs.v, inputs.dout)
  bias = opts.bias(inputs)
  f = flash_and_grads(opts.kwargs(inputs), with_bias=True)
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", partitioning.ShardingFallbackWarning)
    text = f.lower(q, k, v, dout, bias).compile().as_text()
    got = f(q, k, v, dout, bias)
  assert 'custom_call_target="Sharding"' not in text
  check_against_reference(got, inputs, opts, bias=bias)


def test_sharded_jit_compiled_under_another_mesh(devices):
  """Lowered for one mesh, compiled under jax.set_mesh of another (same axis
  names, other shape): the per-device program is the lowered mesh's, its
  psum over the batch axes included (with size-one axes dropped from types,
  the context mesh's size-one "y" would have been skipped: wrong dbias)."""
  mesh = mesh_2x2(devices)
  other = jax.make_mesh((4, 1), ("x", "y"), axis_types=(AxisType.Explicit,) * 2, devices=devices)
  inputs = make_inputs(np.random.default_rng(5), 4, 40, 40, 4, 4, 16)
  opts = Options(is_causal=True, bias_shape=(1, 4, 40, 40))
  q, k, v, dout = put(mesh, P("y", None, "x"), inputs.q, inputs.k, inputs.v, inputs.dout)
  bias = opts.bias(inputs)
  previous = jax.config.values["jax_remove_size_one_mesh_axis_from_type"]
  jax.config.update("jax_remove_size_one_mesh_axis_from_type", True)
  try:
    lowered = flash_and_grads(opts.kwargs(inputs), with_bias=True).lower(q, k, v, dout, bias)
    with jax.set_mesh(other):
      compiled = lowered.compile()
  finally:
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", previous)
  check_against_reference(compiled(q, k, v, dout, bias), inputs, opts, bias=bias)


@pytest.mark.parametrize("case", ["multi_query_heads", "broadcast_bias_batch",
                                  "broadcast_bias_not_differentiated"])
def test_sharded_gradients_sum_what_they_must(devices, case):
  """Key/value shared by sharded heads, or a bias broadcast over a sharded
  batch: their gradients are sums over devices (an all-reduce), and nothing
  is gathered. A bias that is not differentiated gets no gradient: nothing
  to sum."""
  mesh = mesh_2x2(devices)
  if case == "multi_query_heads":
    inputs = make_inputs(np.random.default_rng(2), 2, 29, 29, 4, 1, 16)
    q_spec, kv_spec, opts = P(None, None, ("x", "y")), P(), Options(is_causal=True)
  else:
    inputs = make_inputs(np.random.default_rng(3), 4, 29, 29, 2, 2, 16)
    q_spec, kv_spec, opts = P(("x", "y")), P(("x", "y")), Options(bias_shape=(1, 2, 29, 29))
  bias = opts.bias(inputs)
  with_bias = case == "broadcast_bias_batch"
  q, dout = put(mesh, q_spec, inputs.q, inputs.dout)
  k, v = put(mesh, kv_spec, inputs.k, inputs.v)
  f = flash_and_grads(opts.kwargs(inputs), with_bias=with_bias)
  text = f.lower(q, k, v, dout, bias).compile().as_text()
  assert collectives(text) == (set() if case.endswith("not_differentiated") else {"all-reduce"})
  if bias is not None:  # dbias (result 3): the bias's shape where it is computed, else (0,)
    assert kernel_result_shapes(text, "jax_flash_bwd", 3) == [bias.shape if with_bias else (0,)]
  got = f(q, k, v, dout, bias)
  assert len(got) == (5 if with_bias else 4)
  check_against_reference(got, inputs, opts, bias=bias)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("term", ["segments", "mask", "mask_keys"])
def test_sequence_sharded_terms_of_fewer_cells_than_shards(devices, axis_type, term):
  """Queries, their segment ids or the mask's rows sharded over the sequence
  in 4 shards of 40 rows, 2 cells of 128: the tile map is whole on every
  device. It once failed to compile: under automatic axes the sharding
  reached the cells as a sub-axis (IndivisibleError), under explicit axes
  the mask's reshape into cells was refused. A mask sharded over its keys
  (mask_keys), which the kernels need whole, is gathered with a warning."""
  mesh = jax.make_mesh((4,), ("y",), axis_types=(axis_type,), devices=devices)
  keys = 160 if term == "mask_keys" else 150
  inputs = make_inputs(np.random.default_rng(8), 1, 160, keys, 2, 1, 8)
  opts = (Options(with_segments=True) if term == "segments"
          else Options(is_causal=True, mask_shape=(1, 1, 160, keys)))
  kwargs = opts.kwargs(inputs)
  sequence = P(None, "y")
  q, dout = put(mesh, sequence, inputs.q, inputs.dout)
  k, v = put(mesh, P(), inputs.k, inputs.v)
  name = "q_segment_ids" if term == "segments" else "mask"
  spec = {"segments": sequence, "mask": P(None, None, "y"), "mask_keys": P(None, None, None, "y")}
  sharded, = put(mesh, spec[term], kwargs.pop(name))

  operands = {name: sharded}
  partitioning._warned.clear()
  with (pytest.warns(partitioning.ShardingFallbackWarning, match="mask") if term == "mask_keys"
        else contextlib.nullcontext()):
    got = flash_and_grads_of(operands, **kwargs)(q, k, v, dout, operands)
  check_against_reference(got, inputs, opts)


def test_segment_ids_of_differently_sharded_batches(devices):
  """Explicit axes, the queries' batch over "x" and the keys' over "y",
  segment ids sharded like each: gathered with a warning like q, k, v alone
  (the ids' tile map once refused to compare them)."""
  mesh = mesh_2x2(devices, AxisType.Explicit)
  inputs = make_inputs(np.random.default_rng(10), 4, 32, 32, 2, 2, 8)
  opts = Options(with_segments=True)
  kwargs = opts.kwargs(inputs)
  q, q_ids = put(mesh, P("x"), inputs.q, kwargs.pop("q_segment_ids"))
  k, v, kv_ids = put(mesh, P("y"), inputs.k, inputs.v, kwargs.pop("kv_segment_ids"))
  dout, = put(mesh, P("x"), inputs.dout)

  operands = {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
  partitioning._warned.clear()
  with pytest.warns(partitioning.ShardingFallbackWarning):
    got = flash_and_grads_of(operands)(q, k, v, dout, operands)
  check_against_reference(got, inputs, opts)


def test_sequence_sharded_queries_run_locally(devices):
  """Queries sharded over the sequence, keys and values whole: the forward
  runs locally (each shard told its rows' positions), dK and dV are sums."""
  mesh = mesh_2x2(devices)
  inputs = make_inputs(np.random.default_rng(4), 2, 40, 33, 4, 2, 16)
  opts = Options(is_causal=True, window=(9, 2), with_lengths=True)
  q, dout = put(mesh, P(None, ("x", "y")), inputs.q, inputs.dout)
  k, v = put(mesh, P(), inputs.k, inputs.v)
  kwargs = opts.kwargs(inputs)
  fwd = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, **kwargs))
  assert collectives(fwd.lower(q, k, v).compile().as_text()) == set()
  f = flash_and_grads(kwargs)
  assert collectives(f.lower(q, k, v, dout, None).compile().as_text()) == {"all-reduce"}
  check_against_reference(f(q, k, v, dout, None), inputs, opts)


@pytest.mark.parametrize("window", [(3, 3), (3, 0)], ids=str)
def test_query_shards_past_the_keys_under_a_left_window(devices, window):
  """Shards whose rows all lie past the keys' end by more than the window's
  left side see no key. Their key range was once (lo, lo) with lo past the
  keys, and the CPU kernel's loop over key blocks read the block holding lo
  (a crash, most runs); now it is empty, the rows output 0."""
  mesh = mesh_2x2(devices)
  rng = np.random.default_rng(17)
  q = jnp.asarray(rng.standard_normal((2, 256, 4, 8)))  # float64: the reference's dtype
  k, v = (jnp.asarray(rng.standard_normal((2, 16, 1, 8))) for _ in range(2))
  f = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, local_window_size=window))
  i, j = np.arange(256)[:, None], np.arange(16)[None, :]
  band = (i - window[0] <= j) & (j <= i + window[1])
  want = attention(q, k, v, jnp.asarray(band)[None, None], Options(window=window))[0]
  qs, = put(mesh, P(None, ("x", "y")), q)  # shards of 64 rows; keys whole
  for _ in range(5):  # the old read did not fault every time
    got = f(qs, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
  assert not np.asarray(got)[:, 64:].any()


def test_other_shardings_gather_with_a_warning(devices, monkeypatch):
  monkeypatch.setattr(partitioning, "_warned", set())
  mesh = mesh_2x2(devices)
  inputs = make_inputs(np.random.default_rng(5), 2, 36, 36, 2, 2, 16)
  opts = Options(is_causal=True)
  q, k, v, dout = put(mesh, P(None, "x"), inputs.q, inputs.k, inputs.v, inputs.dout)
  f = flash_and_grads(opts.kwargs(inputs))
  with pytest.warns(partitioning.ShardingFallbackWarning, match=r"gathers key P\(None, 'x'"):
    got = f(q, k, v, dout, None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once is enough
    f.lower(q, k, v, dout, None).compile()
  check_against_reference(got, inputs, opts)


@pytest.mark.parametrize("spec", [P("x", None, "y"), P(None, ("x", "y"))],
                         ids=["batch_x_heads", "sequence"])
def test_sharded_dropout_drops_what_the_unsharded_run_does(devices, spec):
  mesh = mesh_2x2(devices)
  q, k, v = one_hot_problem(4, 64, 32, 4, seed=12)  # sequence shards of 16 rows
  rng = jax.random.key(13)
  f = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True,
                                                        dropout_rate=0.3, dropout_rng=rng))
  whole = recovered_mask(f(q, k, v))
  qs, = put(mesh, spec, q)
  kv_spec = P(*spec[:1], None, *spec[2:3])  # keys: never over the sequence
  ks, vs = put(mesh, kv_spec, k, v)
  assert collectives(f.lower(qs, ks, vs).compile().as_text()) == set()
  np.testing.assert_array_equal(np.asarray(recovered_mask(f(qs, ks, vs))), np.asarray(whole))

  # Gradients against the dense reference with that mask.
  r = np.random.default_rng(14)
  v, dout = r.standard_normal(v.shape), r.standard_normal(q.shape)
  vs, = put(mesh, kv_spec, v)
  douts, = put(mesh, spec, dout)
  got = flash_and_grads(dict(is_causal=True, dropout_rate=0.3, dropout_rng=rng))(
      qs, ks, vs, douts, None)
  visible = jnp.tril(jnp.ones((64, 32), bool))[None, None]
  realised = 77 / 256  # 0.3 rounded to a multiple of 2^-8: the kernels draw 8-bit numbers
  dense = lambda q, k, v: attention(q, k, v, visible, Options(is_causal=True), keep=whole,
                                    dropout_rate=realised)[0]
  out, vjp = jax.vjp(dense, q, k, jnp.asarray(v))
  for name, g, ref in zip(["out", "dq", "dk", "dv"], got, (out,) + vjp(jnp.asarray(dout))):
    assert_flash_close(name, g, ref, ref, jnp.float64)


def test_dropout_on_query_shards_not_of_whole_draw_blocks_gathers_and_says_why(devices,
                                                                              monkeypatch):
  """Shards of 8 rows split dropout's 16-row blocks of draws: the queries are
  gathered (the mask stays the unsharded one) and the warning says why."""
  monkeypatch.setattr(partitioning, "_warned", set())
  mesh = mesh_2x2(devices)
  q, k, v = one_hot_problem(4, 32, 32, 4, seed=15)  # 4 sequence shards of 8 rows
  rng = jax.random.key(16)
  f = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, dropout_rate=0.3,
                                                        dropout_rng=rng))
  whole = recovered_mask(f(q, k, v))
  qs, = put(mesh, P(None, ("x", "y")), q)
  with pytest.warns(partitioning.ShardingFallbackWarning, match="multiple of 16 rows"):
    got = recovered_mask(f(qs, k, v))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(whole))


@pytest.mark.parametrize("layout", ["batch", "sequence"])
def test_shard_map_forward_and_gradient(devices, layout):
  """flash_attention inside shard_map with the default check_vma=True: the
  gradient's type matches the primal's. With sequence-sharded queries and
  whole keys/values (not causal: inside shard_map positions are the
  caller's business; ring_attention handles them), dK/dV sum over devices."""
  mesh = jax.make_mesh((4,), ("x",), devices=devices)
  inputs = make_inputs(np.random.default_rng(6), 4, 40, 40, 4, 2, 16)
  if layout == "batch":
    q_spec, kv_spec, opts = P("x"), P("x"), Options(is_causal=True, softcap=3.0)
  else:
    q_spec, kv_spec, opts = P(None, "x"), P(), Options(window=(1000, 1000))
  q, dout = put(mesh, q_spec, inputs.q, inputs.dout)
  k, v = put(mesh, kv_spec, inputs.k, inputs.v)
  kwargs = opts.kwargs(inputs)
  attend = jax.shard_map(lambda q, k, v: jax_flash.flash_attention(q, k, v, **kwargs),
                         mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)

  @jax.jit
  def f(q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out,) + vjp(dout)

  check_against_reference(f(q, k, v, dout), inputs, opts)


def shard_map_boundary_shapes(jaxpr) -> list[tuple]:
  """Shapes of the values entering or leaving every shard_map in `jaxpr`."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      shapes += [tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars)]
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if isinstance(inner, jax.extend.core.Jaxpr):
        shapes += shard_map_boundary_shapes(inner)
  return shapes


@pytest.mark.parametrize("attention", ["flash", "ring"])
def test_no_empty_array_crosses_shard_map(devices, attention):
  """Absent operands are 0-d (primitives.absent_operand): jax passes the
  constants of a shard_map body, and the residuals its gradient keeps, in
  and out of the manual computation, and XLA 0.11's CPU compiler crashed
  (segfault) on zero-sized ones there."""
  mesh = jax.make_mesh((4,), ("x",), devices=devices)
  spec = P(None, "x")
  fn = (jax_flash.flash_attention if attention == "flash" else
        lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="x", is_causal=True))
  attend = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
  q, = put(mesh, spec, np.zeros((2, 16, 2, 8), np.float32))
  jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(attend(q, q, q))))(q)
  shapes = shard_map_boundary_shapes(jaxpr.jaxpr)
  assert len(shapes) > 2 and all(math.prod(s) > 0 for s in shapes), shapes


def test_sharded_program_exports(devices):
  """jax.export cannot serialize the sharding rule (custom_partitioning runs
  Python): an exported sharded call lowers without it, XLA gathers, and the
  result stays exact after a serialization round trip."""
  pytest.importorskip("flatbuffers")
  mesh = jax.make_mesh((4,), ("x",), devices=devices)
  inputs = make_inputs(np.random.default_rng(15), 4, 21, 21, 2, 1, 8)
  opts = Options(is_causal=True)
  q, k, v = put(mesh, P("x"), inputs.q, inputs.k, inputs.v)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in ("jax_flash_fwd", "jax_flash_bwd")]
  causal = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True))
  # For the mesh's platform (CPU devices), not the default backend (a GPU, where there is one).
  exported = jax.export.deserialize(jax.export.export(
      causal, platforms=("cpu",), disabled_checks=checks)(q, k, v).serialize())
  out = exported.call(q, k, v)
  ref = attention(inputs.q, inputs.k, inputs.v, visible_mask(opts, inputs), opts)[0]
  assert_flash_close("out", out, ref, ref, jnp.float64)

"""ring_attention on four CPU devices (and on every GPU, given two or more)
against attention on the gathered sequence.

The float64 dense reference sees the whole sequence in order; the ring sees
it in chunks (contiguous or zigzag), forward and gradient. Plus the
compiled program (K/V travel by collective-permute, nothing is gathered),
the zigzag helpers, argument errors, and the multi-GPU benchmark script's
smoke run.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_flash
from conftest import assert_flash_close
from reference import Options, attention, make_inputs, visible_mask
from reference import attention_and_grads as dense_attention_and_grads

# The float64 reference under jit: one compilation per shape instead of one
# per operation. (The plain same-dtype implementations stay eager: under jit
# XLA may keep excess precision, which would make them a different yardstick.)
attention_and_grads = jax.jit(dense_attention_and_grads, static_argnums=5)

def devices_of(platform):
  try:
    return jax.devices(platform)
  except RuntimeError:
    return []


@pytest.fixture(scope="module")
def cpu_mesh():
  cpus = devices_of("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
  return jax.make_mesh((4,), ("seq",), devices=cpus[:4])


@pytest.fixture(scope="module", params=["cpu"] + (["gpu"] if len(devices_of("gpu")) > 1 else []))
def mesh(request, cpu_mesh):
  """Four CPU devices; and every GPU, when there are at least two."""
  if request.param == "cpu":
    return cpu_mesh
  gpus = devices_of("gpu")
  return jax.make_mesh((len(gpus),), ("seq",), devices=gpus)


def ring_and_grads(mesh, layout, spec=P(None, "seq"), axis_name="seq", manual_axes=None,
                   **kwargs):
  """jit of (out, dq, dk, dv) of ring_attention inside shard_map (manual over
  `manual_axes`, shard_map's axis_names; all of the mesh's by default)."""
  attend = jax.shard_map(
      lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name=axis_name, layout=layout,
                                               **kwargs),
      mesh=mesh, in_specs=spec, out_specs=spec,
      **({} if manual_axes is None else {"axis_names": manual_axes}))

  @jax.jit
  def f(q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out,) + vjp(dout)

  return f


def run_ring(mesh, inputs, layout, dtype, spec=P(None, "seq"), **kwargs):
  """The ring's (out, dq, dk, dv), tokens back in sequence order."""
  n = mesh.size
  order = lambda x: jax_flash.to_zigzag(x, n) if layout == "zigzag" else x
  unorder = lambda x: jax_flash.from_zigzag(x, n) if layout == "zigzag" else x
  args = [jax.device_put(order(jnp.asarray(x, dtype)), NamedSharding(mesh, spec))
          for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  return [unorder(x) for x in ring_and_grads(mesh, layout, spec, **kwargs)(*args)]


# (layout, chunk length per device, heads, kv heads, options): odd chunks,
# GQA and MQA, windows that cross one or several chunks.
CASES = {
    "contiguous": ("contiguous", 13, 4, 2, Options()),
    "contiguous_causal_mqa": ("contiguous", 13, 4, 1, Options(is_causal=True)),
    "contiguous_window_softcap": ("contiguous", 11, 2, 2,
                                  Options(window=(7, 3), softcap=2.0, scale=0.5)),
    "zigzag_causal": ("zigzag", 14, 4, 2, Options(is_causal=True)),
    "zigzag_causal_window": ("zigzag", 10, 4, 4, Options(is_causal=True, window=(9, 0))),
    "zigzag_window": ("zigzag", 6, 2, 1, Options(window=(4, 13))),
    "zigzag_plain": ("zigzag", 10, 2, 2, Options()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_attention_on_the_whole_sequence(mesh, case):
  layout, length, heads, kv_heads, opts = CASES[case]
  seqlen = mesh.size * length
  inputs = make_inputs(np.random.default_rng(len(case)), 2, seqlen, seqlen, heads, kv_heads, 16)
  got = run_ring(mesh, inputs, layout, jnp.float64, is_causal=opts.is_causal, scale=opts.scale,
                 local_window_size=opts.window, logits_soft_cap=opts.softcap)
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                            visible_mask(opts, inputs), opts)
  for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref[:1] + ref[2:]):
    assert_flash_close(f"{case} {name}", g, r, r, jnp.float64)


@pytest.mark.parametrize("case", ["contiguous_causal_mqa", "zigzag_causal_window",
                                  "contiguous_window_softcap"])
def test_ring_second_order(cpu_mesh, case):
  """grad of a function of the ring's gradient (wrt q, k and v): the ring's
  backward is made of the kernels' primitives, whose own derivatives (the
  blockwise formulation) carry the second order, as for flash_attention."""
  layout, length, heads, kv_heads, opts = CASES[case]
  n = cpu_mesh.size
  inputs = make_inputs(np.random.default_rng(11), 1, n * length, n * length, heads, kv_heads, 8)
  order = lambda x: jax_flash.to_zigzag(x, n) if layout == "zigzag" else x
  unorder = lambda x: jax_flash.from_zigzag(x, n) if layout == "zigzag" else x
  ring = jax.shard_map(
      lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="seq", layout=layout,
                                               is_causal=opts.is_causal, scale=opts.scale,
                                               local_window_size=opts.window,
                                               logits_soft_cap=opts.softcap),
      mesh=cpu_mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
  mask = visible_mask(opts, inputs)
  spec = NamedSharding(cpu_mesh, P(None, "seq"))
  shard = lambda x: jax.sharding.reshard(order(x), spec)
  attend = {"ring": lambda q, k, v: unorder(ring(shard(q), shard(k), shard(v))),
            "dense": lambda q, k, v: attention(q, k, v, mask, opts)[0]}

  def second(f):
    first = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * inputs.dout), argnums=(0, 1, 2))
    return jax.grad(lambda *a: sum(jnp.sum(g ** 2) for g in first(*a)), argnums=(0, 1, 2))

  args = (inputs.q, inputs.k, inputs.v)
  got = jax.jit(second(attend["ring"]))(*args)
  ref = second(attend["dense"])(*args)
  for name, g, r in zip(["d2q", "d2k", "d2v"], got, ref):
    assert_flash_close(f"{case} {name}", g, r, r, jnp.float64)


def test_ring_in_bfloat16_meets_the_flash_rule(mesh):
  """Partial results merge in float32: no worse than a plain bf16 attention."""
  opts = Options(is_causal=True)
  seqlen = 24 * mesh.size
  inputs = make_inputs(np.random.default_rng(7), 1, seqlen, seqlen, 4, 2, 32)
  got = run_ring(mesh, inputs, "zigzag", jnp.bfloat16, is_causal=True)
  visible = visible_mask(opts, inputs)
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout, visible, opts)
  plain = dense_attention_and_grads(*(jnp.asarray(x, jnp.bfloat16) for x in
                                (inputs.q, inputs.k, inputs.v, inputs.dout)), visible, opts)
  for name, g, r, p in zip(["out", "dq", "dk", "dv"], got, ref[:1] + ref[2:],
                           plain[:1] + plain[2:]):
    assert_flash_close(name, g, r, p, jnp.bfloat16)


def test_ring_with_data_parallel_batch(cpu_mesh):
  """Batch over one mesh axis, sequence over the other: the ring runs on
  each batch shard, and the gradient type-checks over both axes."""
  mesh = jax.make_mesh((2, 2), ("data", "seq"), devices=cpu_mesh.devices.flat)
  opts = Options(is_causal=True)
  inputs = make_inputs(np.random.default_rng(8), 2, 36, 36, 2, 1, 8)
  args = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data", "seq")))
          for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  got = ring_and_grads(mesh, "contiguous", P("data", "seq"), is_causal=True)(*args)
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                            visible_mask(opts, inputs), opts)
  for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref[:1] + ref[2:]):
    assert_flash_close(name, g, r, r, jnp.float64)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_ring_manual_over_the_sequence_alone(cpu_mesh, axis_type):
  """shard_map manual over "seq" only, the batch sharded over "data" outside
  it: under explicit axes the ring's accumulators once lacked the batch's
  sharding, and setting a step's rows into them failed to trace."""
  mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(axis_type,) * 2,
                       devices=cpu_mesh.devices.flat)
  check_ring_manual_over_the_sequence_alone(mesh)


def test_ring_manual_over_the_sequence_alone_in_a_mesh_context(cpu_mesh):
  """The same inside `with mesh:` (jax's older mesh context), which hands the
  partitioner the whole mesh while XLA partitions each "data" group of
  devices on its own: XLA once aborted the process (a failed check in
  spmd_partitioner_util.cc); the batch is now gathered, with the warning."""
  if not hasattr(Mesh, "__enter__"):
    pytest.skip("this jax has no `with mesh:` context")
  mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_mesh.devices.flat)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with mesh:
      check_ring_manual_over_the_sequence_alone(mesh)


def check_ring_manual_over_the_sequence_alone(mesh):
  opts = Options(is_causal=True)
  inputs = make_inputs(np.random.default_rng(9), 2, 36, 36, 2, 1, 8)
  args = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data", "seq")))
          for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  got = ring_and_grads(mesh, "contiguous", manual_axes={"seq"}, is_causal=True)(*args)
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout,
                            visible_mask(opts, inputs), opts)
  for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref[:1] + ref[2:]):
    assert_flash_close(name, g, r, r, jnp.float64)


def test_keys_and_values_travel_and_are_never_gathered(cpu_mesh):
  mesh = cpu_mesh
  inputs = make_inputs(np.random.default_rng(9), 1, 32, 32, 2, 2, 8)
  args = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "seq")))
          for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  text = ring_and_grads(mesh, "zigzag", is_causal=True).lower(*args).compile().as_text()
  ops = set(re.findall(r"\b(all-gather|all-to-all|all-reduce|collective-permute)(?:-start)?\(",
                       text))
  assert ops == {"collective-permute"}
  # 3 hops of (K, V) (the backward's are the forward's: XLA shares them in
  # one program) and 4 of (dK, dV).
  assert len(re.findall(r"\bcollective-permute(?:-start)?\(", text)) == 2 * (3 + 4)


def test_zigzag_helpers():
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3, 1)
  z = jax_flash.to_zigzag(x, 4)
  chunks = [int(c) for c in z[0, ::2, 0, 0] // 6]  # 8 chunks of 2 tokens
  assert chunks == [0, 7, 1, 6, 2, 5, 3, 4]
  np.testing.assert_array_equal(jax_flash.from_zigzag(z, 4), x)
  ids = jnp.arange(24).reshape(1, 24)
  np.testing.assert_array_equal(jax_flash.from_zigzag(jax_flash.to_zigzag(ids, 3, axis=-1), 3,
                                                      axis=-1), ids)
  with pytest.raises(ValueError, match="2 \\* num_devices = 8 equal chunks"):
    jax_flash.to_zigzag(jnp.zeros((1, 12, 1, 1)), 4)
  # Array-likes, as jnp's functions take them.
  np.testing.assert_array_equal(jax_flash.to_zigzag(np.asarray(x).tolist(), 4), z)


@pytest.mark.parametrize("fn", [jax_flash.to_zigzag, jax_flash.from_zigzag])
def test_zigzag_argument_errors(fn):
  """An axis outside the array once wrapped around (axis 4 of a 4-d array
  reordered its batch); num_devices 0 divided by zero."""
  x = jnp.zeros((4, 12, 1, 1))
  for axis in (4, -5):
    with pytest.raises(ValueError, match=f"axis {axis} is out of bounds .*\\(4, 12, 1, 1\\)"):
      fn(x, 2, axis=axis)
  with pytest.raises(TypeError, match="axis must be an int, got float"):
    fn(x, 2, axis=1.0)
  for n in (0, -2):
    with pytest.raises(ValueError, match=f"num_devices must be at least 1, got {n}"):
      fn(x, n)
  for n in (2.0, "2", True):
    with pytest.raises(TypeError, match="num_devices must be a static Python int"):
      fn(x, n)
  with pytest.raises(TypeError, match="num_devices must be a static Python int"):
    jax.jit(fn)(x, 2)
  np.testing.assert_array_equal(fn(x, np.int64(2), axis=np.int32(1)), fn(x, 2, axis=1))


def test_ring_argument_errors(cpu_mesh):
  mesh = cpu_mesh
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match="inside shard_map"):
    jax_flash.ring_attention(q, q, q, axis_name="seq")
  for name in (0, None, ()):
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
      jax_flash.ring_attention(q, q, q, axis_name=name)

  def call(q, k, **kwargs):
    return jax.shard_map(lambda q, k: jax_flash.ring_attention(q, k, k, axis_name="seq",
                                                               **kwargs),
                         mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))(q, k)

  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
  with pytest.raises(ValueError, match="even local sequence length"):
    call(put(jnp.zeros((1, 12, 2, 8))), put(jnp.zeros((1, 12, 2, 8))), layout="zigzag")
  with pytest.raises(ValueError, match="layout must be one of"):
    call(put(q), put(q), layout="striped")
  with pytest.raises(ValueError, match="same length"):
    call(put(q), put(jnp.zeros((1, 16, 2, 8))))
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    call(put(q), put(q), is_causal="yes")


def test_multi_gpu_bench_smoke(cpu_mesh, capsys, gpu_tool):
  """tests/gpu/multi_gpu_bench.py end to end with tiny shapes on CPU devices."""
  bench = gpu_tool("multi_gpu_bench")
  bench.main(["--smoke", "--platform", "cpu"])  # CPU devices also beside a GPU
  out = capsys.readouterr().out
  for row in ("data parallel", "ring", "transfers only", "no transfers"):
    assert row in out, out

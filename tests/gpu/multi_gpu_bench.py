"""Many GPUs: data-parallel scaling and ring attention, timed on two devices.

    python tests/gpu/multi_gpu_bench.py                # two GPUs (nvidia-h200-x2)
    python tests/gpu/multi_gpu_bench.py --smoke        # tiny shapes, any two devices

Every row is forward+backward (jax.vjp of the attention, the gradient of q,
k and v), median of --repeats runs after two warm-up runs, in one process,
so the ratios compare like with like:

* data parallel: flash_attention under jit with the batch sharded over two
  devices (per-device batch fixed) against one device; efficiency =
  time on 1 / time on 2 (1.0 = perfect scaling; the sharding rule runs each
  batch shard locally, so there is nothing to communicate).
* ring: one device runs flash_attention on the whole sequence; two run
  ring_attention (zigzag layout, causal) on halves of it; speed-up = time on
  1 / time on 2. Beside it the ring with its transfers removed (each device
  keeps its own K/V: the same kernels, wrong results) and the transfers
  alone (the same ppermutes, no kernels): the ring hides its communication
  when its time is close to the one without transfers.

On CPUs (--smoke, the test suite) it needs two devices, e.g.
XLA_FLAGS=--xla_force_host_platform_device_count=2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash.sharding import ring


def timed_ms(f, *args, repeats: int) -> float:
  for _ in range(2):  # compile, then warm up
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def fwd_bwd(attend):
  """jit of attention forward and the gradient of q, k, v for a cotangent."""
  @jax.jit
  def f(q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(dout)
  return f


def inputs(shape, kv_heads, dtype, sharding):
  keys = jax.random.split(jax.random.key(0), 4)
  kv_shape = shape[:-2] + (kv_heads, shape[-1])
  make = lambda key, s: jax.device_put(jax.random.normal(key, s, dtype), sharding)
  return (make(keys[0], shape), make(keys[1], kv_shape), make(keys[2], kv_shape),
          make(keys[3], shape))


def data_parallel(devices, args):
  batch, seqlen = args.dp_batch, args.dp_seqlen
  shape = (batch, seqlen, args.heads, args.head_dim)
  attend = fwd_bwd(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True))
  one = timed_ms(attend, *inputs(shape, args.heads, args.dtype, devices[0]),
                 repeats=args.repeats)
  mesh = jax.make_mesh((2,), ("data",), devices=devices[:2])
  two_shape = (2 * batch,) + shape[1:]
  two = timed_ms(attend, *inputs(two_shape, args.heads, args.dtype,
                                 NamedSharding(mesh, P("data"))), repeats=args.repeats)
  return dict(row="data parallel", batch_per_device=batch, seqlen=seqlen, one_ms=one,
              two_ms=two, efficiency=one / two)


def _transfers(num_devices, axis):
  """The ring's ppermutes without its kernels: (n-1) hops of K/V forward,
  (n-1) of K/V and n of float32 dK/dV backward."""
  perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]

  def move(q, k, v, dout):
    del q
    dk = dv = jnp.zeros(k.shape, jnp.float32)
    for _ in range(num_devices - 1):
      k, v = jax.lax.ppermute((k, v), axis, perm)
    for _ in range(num_devices - 1):
      k, v = jax.lax.ppermute((k, v), axis, perm)
    for _ in range(num_devices):
      dk, dv = jax.lax.ppermute((dk + 1, dv + 1), axis, perm)
    return dout, (k, v, dk, dv)

  return move


def ring_rows(devices, args, seqlen):
  shape = (1, seqlen, args.heads, args.head_dim)
  rows = []
  one = None
  if seqlen <= args.single_max:
    attend = fwd_bwd(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True))
    one = timed_ms(attend, *inputs(shape, args.kv_heads, args.dtype, devices[0]),
                   repeats=args.repeats)
  mesh = jax.make_mesh((2,), ("seq",), devices=devices[:2])
  spec = P(None, "seq")
  data = inputs(shape, args.kv_heads, args.dtype, NamedSharding(mesh, spec))
  data = [jax.device_put(jax_flash.to_zigzag(x, 2), NamedSharding(mesh, spec)) for x in data]

  def sharded(fn):
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)

  def ring_fn(transfer):
    return lambda q, k, v: ring._ring_attention(
        q, k, v, axis_name="seq", is_causal=True, scale=None, local_window_size=None,
        logits_soft_cap=None, layout="zigzag", transfer=transfer)

  two = timed_ms(fwd_bwd(sharded(ring_fn(True))), *data, repeats=args.repeats)
  quiet = timed_ms(fwd_bwd(sharded(ring_fn(False))), *data, repeats=args.repeats)
  move = jax.jit(jax.shard_map(_transfers(2, "seq"), mesh=mesh, in_specs=spec,
                               out_specs=(spec, (spec,) * 4)))
  moving = timed_ms(move, *data, repeats=args.repeats)
  rows.append(dict(row="ring", seqlen=seqlen, one_ms=one, two_ms=two,
                   speedup=None if one is None else one / two))
  rows.append(dict(row="ring, no transfers", seqlen=seqlen, two_ms=quiet))
  rows.append(dict(row="ring, transfers only", seqlen=seqlen, two_ms=moving,
                   hidden=max(0.0, min(1.0, 1 - (two - quiet) / moving))))
  return rows


def print_table(rows, header):
  print(header)
  print(f"{'':24} {'S':>8} {'1 device ms':>12} {'2 devices ms':>13} {'ratio':>12}")
  for r in rows:
    one = "" if r.get("one_ms") is None else f"{r['one_ms']:.2f}"
    if "efficiency" in r:
      ratio = f"eff {r['efficiency']:.3f}"
    elif r.get("speedup") is not None:
      ratio = f"{r['speedup']:.2f}x"
    elif "hidden" in r:
      ratio = f"hidden {r['hidden']:.2f}"
    else:
      ratio = ""
    print(f"{r['row']:24} {r['seqlen']:>8} {one:>12} {r['two_ms']:>13.2f} {ratio:>12}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, float32, 1 repeat")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dp-batch", type=int, default=4, help="per-device batch")
  parser.add_argument("--dp-seqlen", type=int, default=8192)
  parser.add_argument("--ring-seqlens", type=int, nargs="+", default=[131072, 262144])
  parser.add_argument("--single-max", type=int, default=262144,
                      help="longest sequence also timed on one device")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", help="also write the rows to this file")
  parser.add_argument("--platform", default=None,
                      help="devices of this platform (default: JAX's default backend)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.dtype, args.heads, args.kv_heads, args.head_dim = "float32", 2, 1, 16
    args.dp_batch, args.dp_seqlen, args.ring_seqlens, args.repeats = 2, 64, [128], 1
  args.dtype = jnp.dtype(args.dtype)
  devices = jax.devices(args.platform)
  if len(devices) < 2:
    raise SystemExit(f"needs two devices, found {devices}")
  header = (f"{devices[0].device_kind} x2, {args.dtype.name}, H={args.heads}, "
            f"Hkv={args.kv_heads}, D={args.head_dim}, causal, forward+backward; jax "
            f"{jax.__version__}, {datetime.date.today()}")
  rows = [data_parallel(devices, args)]
  for seqlen in args.ring_seqlens:
    rows += ring_rows(devices, args, seqlen)
  print_table(rows, header)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(header=header, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main()

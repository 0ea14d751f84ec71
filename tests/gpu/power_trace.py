"""Time per call against time under load, with the SM clock and power.

The kernels timed alone (`tc_kernel_check bench1_fwd`: 20 calls, ~60 ms of
work) ran at the top clock, 1980 MHz on an H200, while the jax bench's runs
of the same kernels (~200 ms of work per row) drew 600-650 W and ran at
1600-1900 MHz (cpp/cuda/NOTES_sm90_fwd_power.md, "The gap is the clock"). This
runs each implementation back to back for `--seconds`, samples the clock
and the power every 50 ms (nvidia-smi), and prints per implementation and
shape: the time per call in the first 50 ms and once settled (the last half),
the settled clock and power, and the energy per call, so that the time a
training loop sees and what a kernel's power costs it show beside each other.

  python tests/gpu/power_trace.py --head-dims 128 --seqlens 16384
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import threading
import time

import jax

import jax_flash
from jax_flash.bench import Case, grad_fn, make_inputs


class Sampler:
  """nvidia-smi's SM clock (MHz) and power (W), tagged with perf_counter."""

  def __init__(self, period_ms: int):
    self.samples: list[tuple[float, float, float]] = []
    self._proc = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self) -> None:
    for line in self._proc.stdout:
      try:
        clock, power = (float(x) for x in line.split(","))
      except ValueError:
        continue
      self.samples.append((time.perf_counter(), clock, power))

  def between(self, t0: float, t1: float) -> tuple[float, float]:
    window = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
    if not window:
      return float("nan"), float("nan")
    return statistics.mean(c for c, _ in window), statistics.mean(p for _, p in window)

  def stop(self) -> None:
    self._proc.terminate()


def attention(impl: str, causal: bool):
  if impl == "jax_flash":
    return functools.partial(jax_flash.dot_product_attention, is_causal=causal)
  return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                           implementation="cudnn")


def trace(fn, args, seconds: float, group_s: float = 0.005):
  """(end time, seconds per call) of groups of back-to-back calls for `seconds`."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  inner = max(1, round(group_s / (time.perf_counter() - t0)))
  points, start = [], time.perf_counter()
  while time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(inner)])
    t1 = time.perf_counter()
    points.append((t1, (t1 - t0) / inner))
  return start, points


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[16384])
  parser.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn"])
  parser.add_argument("--direction", choices=["fwd", "fwd_bwd"], default="fwd")
  parser.add_argument("--seconds", type=float, default=2.0)
  parser.add_argument("--rest", type=float, default=2.0, help="idle seconds before each trace")
  args = parser.parse_args(argv)
  sampler = Sampler(50)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.direction}")
  print("D     S  causal  impl        first ms  settled ms  ratio  MHz   W     mJ/call")
  try:
    for head_dim in args.head_dims:
      for seqlen in args.seqlens:
        for causal in (False, True):
          case = Case(batch=max(1, 16384 // seqlen), heads=2048 // head_dim, seqlen=seqlen,
                      head_dim=head_dim, dtype="bfloat16", causal=causal)
          inputs = make_inputs(case, 0)
          for impl in args.impls:
            fwd = attention(impl, causal)
            fn = jax.jit(fwd if args.direction == "fwd" else grad_fn(fwd))
            call_args = inputs[:3] if args.direction == "fwd" else inputs[:4]
            jax.block_until_ready(fn(*call_args))  # compile outside the trace
            time.sleep(args.rest)
            start, points = trace(fn, call_args, args.seconds)
            first = [s for t, s in points if t - start <= 0.05] or [points[0][1]]
            settled = [s for t, s in points if t - start >= args.seconds / 2]
            clock, power = sampler.between(start + args.seconds / 2, points[-1][0])
            f, s = 1e3 * statistics.median(first), 1e3 * statistics.median(settled)
            print(f"{head_dim:<3} {seqlen:>5}  {'yes' if causal else 'no':<6}  {impl:<10} "
                  f"{f:8.3f} {s:10.3f}  {s / f:5.2f}  {clock:4.0f}  {power:4.0f}  {power * s:8.1f}",
                  flush=True)
  finally:
    sampler.stop()


if __name__ == "__main__":
  main()

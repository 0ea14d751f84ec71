"""Benchmark jax_flash against jax.nn.dot_product_attention: ``python -m jax_flash.bench``.

On the default device, for each shape and mask, every implementation that can
run there (cudnn needs an NVIDIA GPU) runs forward and forward+backward; the
table gives time, TFLOP/s, speed-up over the alternatives measured in the same
process, compiled memory, and the forward output's max error against a float64
reference. A line on stderr says what each measurement is as it starts.

On a GPU each time is taken after half a second of back-to-back calls: the
device runs attention at its power limit, at a lower clock than a short run's
(GPU_SETTLE_S). ``--rounds N`` times every impl N times per shape, the impls
in a rotated order, and reports medians (run_case).

FLOP convention (FlashAttention papers): forward = 4*B*H*Sq*Sk*D, halved when
causal; backward = 2.5x forward, so forward+backward = 3.5x forward.

Presets: ``cpu`` (the CPU speed target's shapes), ``fa3`` (FlashAttention-3
paper shapes: B*S = 16k tokens, hidden 2048, bf16), ``memory`` (the memory
target's shape on this device) and ``quick`` (tiny). ``--memory`` also
measures the peak memory of one forward+backward of every (shape, impl), each
in a fresh process, before the timing. ``--features`` adds the problems users
run (``jax_flash.bench_features``). Every row is a plain dict (``--json``,
``jax_flash.plots``). Target verdicts are printed for the shapes the targets
are defined for; ``jax_flash.bench_report`` writes the header, tables and verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import bench_features

IMPLS = ("jax_flash", "xla", "cudnn")
MiB = 1 << 20
GiB = 1 << 30
# Float64 reference only where the dense B*H*Sq*Sk score tensor is affordable
# (it is computed in row blocks, but the time grows with it).
REFERENCE_MAX_SCORES = 1 << 28
REFERENCE_BLOCK_SCORES = 1 << 22  # scores per block of the reference: 32 MiB of float64
# Inputs larger than this do not sit in a GPU's L2 cache; smaller ones are
# rotated among ROTATE_SETS sets so repeated runs do not time the cache.
ROTATE_MAX_BYTES = 128 * MiB
ROTATE_SETS = 3
BWD_FLOP_FACTOR = 2.5  # FlashAttention convention: backward = 2.5x forward FLOPs.
# A GPU runs attention at its power limit, which takes a few hundred ms of
# calls to bring the clock down from the top; settled, calls are 10-20% slower
# (an H200: BENCHMARKS.md, twenty-fifth session). Each GPU measurement starts
# after this long of back-to-back calls, so every implementation is timed in
# the state a training loop runs in.
GPU_SETTLE_S = 0.5

PRESETS = {
    # The CPU speed target: jax_flash >= 1.5x xla (>= 2.5x causal), fwd and fwd+bwd.
    "cpu": dict(seqlens=[1024, 4096], head_dims=[64], batch=1, heads=8, dtype="float32"),
    # FlashAttention-3 paper: B*S = 16k tokens, hidden 2048 -> H = 2048 / D.
    "fa3": dict(seqlens=[512, 1024, 2048, 4096, 8192, 16384], head_dims=[64, 128, 256],
                batch=None, heads=None, dtype="bfloat16"),
    "quick": dict(seqlens=[128, 256], head_dims=[32], batch=1, heads=2, dtype="float32"),
}
# The memory targets' shapes, by platform (the "memory" preset): CPU fwd+bwd
# within 1 GiB beyond the inputs; GPU peak within 1.2x of inputs + outputs +
# gradients.
MEMORY_PRESETS = {
    "cpu": dict(seqlens=[16384], head_dims=[64], batch=1, heads=8, dtype="float32"),
    "gpu": dict(seqlens=[32768], head_dims=[128], batch=1, heads=16, dtype="bfloat16")}
FA3_TOKENS, FA3_HIDDEN = 16384, 2048
# A compiled call is not run when XLA's plan for it exceeds this share of the
# free memory: on a CPU it would swap or be killed, not fail.
MAX_SHARE_OF_FREE_MEMORY = 0.7
# The fields of a row filled by --memory (None without it).
MEMORY_FIELDS = ("memory_status", "runtime_peak", "runtime_beyond_inputs", "runtime_source")


def preset_shapes(name: str, platform: str) -> dict:
  return MEMORY_PRESETS["cpu" if platform == "cpu" else "gpu"] if name == "memory" \
      else PRESETS[name]


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  heads: int
  seqlen: int
  head_dim: int
  dtype: str
  causal: bool

  @property
  def shape(self):
    return (self.batch, self.seqlen, self.heads, self.head_dim)

  @property
  def fwd_flops(self) -> float:
    flops = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
    return flops / 2 if self.causal else flops

  @property
  def tensor_bytes(self) -> int:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  def label(self) -> str:
    return (f"B={self.batch} H={self.heads} S={self.seqlen} D={self.head_dim} {self.dtype} "
            f"causal={'yes' if self.causal else 'no'}")


# -- the implementations -------------------------------------------------------


CUDNN_DTYPES = ("float16", "bfloat16")  # of the bench's dtypes, those cuDNN attention takes


def why_unavailable(impl: str, platform: str, dtype: str) -> str | None:
  """Why `impl` cannot run this dtype on this platform at all, or None."""
  if impl == "cudnn" and platform != "gpu":
    return (f"jax.nn.dot_product_attention(implementation='cudnn') needs an NVIDIA GPU "
            f"(this run is on {platform})")
  if impl == "cudnn" and dtype not in CUDNN_DTYPES:
    return (f"jax.nn.dot_product_attention(implementation='cudnn') takes "
            f"{' or '.join(CUDNN_DTYPES)}, not {dtype} (--dtype)")
  if impl == "jax_flash" and platform != "cpu" and not jax_flash.build_info()["cuda"]:
    return "this jax_flash was built without CUDA kernels (README.md, Install)"
  return None


def grad_fn(fwd):
  """(q, k, v, dout, *extras) -> d/d(q, k, v) of sum(fwd(q, k, v, *extras) * dout)."""
  return lambda q, k, v, dout, *extras: jax.vjp(lambda q, k, v: fwd(q, k, v, *extras),
                                                q, k, v)[1](dout)


def compile_fn(fn, case: Case, num_args: int, extras=()):
  """fn for num_args arrays of the case's shape, then `extras` (arguments, not constants)."""
  spec = jax.ShapeDtypeStruct(case.shape, case.dtype)
  return jax.jit(fn).lower(*([spec] * num_args), *extras).compile()


def memory_of(compiled) -> dict | None:
  """Bytes XLA plans for one call: arguments, outputs, temporaries (FFI scratch excluded)."""
  try:
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
             m.alias_size_in_bytes)
    return dict(total=int(total), arguments=int(m.argument_size_in_bytes),
                outputs=int(m.output_size_in_bytes), temp=int(m.temp_size_in_bytes))
  except Exception:  # Not every backend implements it.
    return None


def free_memory_bytes(dev) -> int | None:
  if dev.platform == "cpu":
    try:
      return next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo")
                  if l.startswith("MemAvailable:"))
    except (OSError, StopIteration):
      return None
  stats = dev.memory_stats() or {}
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


def too_big(compiled) -> str | None:
  """A reason not to run `compiled` here (its plan exceeds the free memory), or None."""
  needed = (memory_of(compiled) or {}).get("total", 0)
  free = free_memory_bytes(jax.devices()[0])
  if free is not None and needed > MAX_SHARE_OF_FREE_MEMORY * free:
    return f"not run: needs ~{needed / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
  return None


def progress(case: "Case", impl: str, what: str) -> None:
  """One line on stderr as a measurement starts: a long shape shows what it is doing."""
  print(f"… {case.label()} | {impl} | {what}", file=sys.stderr, flush=True)


# -- inputs, reference, timing -------------------------------------------------


def make_inputs(case: Case, seed: int):
  """Fresh standard-normal q, k, v, dout on the default device (never zeros)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(k, case.shape, case.dtype) for k in keys)


def reference_fwd(q, k, v, causal: bool, bias=None, mask=None) -> np.ndarray:
  """Dense float64 softmax(q k^T / sqrt(D) + bias) v in numpy, in query-row blocks;
  bias, mask: (B|1, N|1, Sq, Sk) or None. Rows that see no key are NaN (jax_flash
  gives 0 there, jax.nn the mean of v): errors are taken over the other rows."""
  q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
  batch, seqlen_q, heads, head_dim = q.shape
  seqlen_k = k.shape[1]
  scale = 1.0 / math.sqrt(head_dim)
  out = np.empty(q.shape, np.float64)
  block = max(1, REFERENCE_BLOCK_SCORES // (heads * seqlen_k))
  for b in range(batch):
    qh, kh, vh = (x[b].transpose(1, 0, 2) for x in (q, k, v))  # (H, S, D)
    for r0 in range(0, seqlen_q, block):
      r1 = min(seqlen_q, r0 + block)
      s = qh[:, r0:r1] @ kh.transpose(0, 2, 1) * scale  # (H, rows, Sk)
      if bias is not None:
        s = s + bias[b % bias.shape[0], :, r0:r1]
      if causal:  # Top-left aligned, as in jax.nn: query i sees keys j <= i.
        s = np.where(np.arange(seqlen_k)[None, :] <= np.arange(r0, r1)[:, None], s, -np.inf)
      if mask is not None:
        s = np.where(mask[b % mask.shape[0], :, r0:r1], s, -np.inf)
      m = s.max(axis=-1, keepdims=True)
      p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
      with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: a row that sees nothing
        out[b, r0:r1] = ((p @ vh) / p.sum(axis=-1, keepdims=True)).transpose(1, 0, 2)
  return out


def errors(out: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
  """Max and relative (Frobenius) error over the rows the reference defines."""
  seen = ~np.isnan(reference)
  diff = out[seen] - reference[seen]
  norm = np.linalg.norm(reference[seen])
  rel = float(np.linalg.norm(diff) / norm) if norm else 0.0
  return float(np.max(np.abs(diff), initial=0.0)), rel


def time_call(fn, arg_sets, repeats: int | None, on_cpu: bool) -> tuple[float, int]:
  """Median seconds per call of an already compiled fn, and the samples taken.

  One warm-up call, one timed call to size the run, on a GPU GPU_SETTLE_S of
  back-to-back calls, then `repeats` samples; each sample runs `inner` calls
  back to back, rotating input sets, and blocks on all of them, so that short
  GPU kernels are not timed as host round trips.
  """
  jax.block_until_ready(fn(*arg_sets[0]))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[-1]))
  t_one = time.perf_counter() - t0
  if not on_cpu:
    settle(fn, arg_sets, t_one)
  budget_s, max_samples, min_sample_s = (3.0, 10, 0.05) if on_cpu else (1.0, 30, 0.005)
  if repeats is None:
    repeats = int(min(max_samples, max(3, budget_s // max(t_one, 1e-9))))
  inner = int(min(50, max(1, math.ceil(min_sample_s / max(t_one, 1e-9)))))
  samples = []
  for r in range(repeats):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[(r * inner + i) % len(arg_sets)]) for i in range(inner)]
    jax.block_until_ready(outs)
    samples.append((time.perf_counter() - t0) / inner)
    del outs
  return statistics.median(samples), repeats


def settle(fn, arg_sets, t_one: float, seconds: float | None = None) -> int:
  """Runs fn back to back for `seconds` (GPU_SETTLE_S), whole batches; returns the calls made."""
  seconds = GPU_SETTLE_S if seconds is None else seconds
  batch = int(min(50, max(1, math.ceil(0.02 / max(t_one, 1e-9)))))
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    jax.block_until_ready([fn(*arg_sets[(calls + i) % len(arg_sets)]) for i in range(batch)])
    calls += batch
  return calls


def short_error(e: Exception) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"{type(e).__name__}: {first}"[:100]


# -- one shape -----------------------------------------------------------------


def empty_row(case: Case, impl: str, feature: str, given: str | None, status="ok") -> dict:
  return dict(dataclasses.asdict(case), impl=impl, feature=feature, given=given, status=status,
              fwd_ms=None, fwdbwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None,
              fwdbwd_tflops=None, memory=None, memory_beyond_inputs=None, max_err=None,
              rel_err=None, repeats=None, fwd_vs_xla=None, fwdbwd_vs_xla=None,
              fwd_vs_cudnn=None, fwdbwd_vs_cudnn=None, fwd_vs_plain=None, fwdbwd_vs_plain=None,
              fwd_ms_rounds=None, fwdbwd_ms_rounds=None,
              **dict.fromkeys(MEMORY_FIELDS))


TIMED = {"fwd_ms": "forward", "fwdbwd_ms": "forward+backward"}  # row key: what it times


def prepare(row: dict, case: Case, fwd_of, extras, arg_sets, reference, what: str) -> dict:
  """Compiles one impl's forward (its error against `reference` into `row`) and
  forward+backward (its compiled memory into `row`).

  Returns {row key: (compiled fn, argument sets)} of what can be timed; where
  something cannot, row["status"] says why.
  """
  impl, timers = row["impl"], {}
  try:
    progress(case, impl, what + "forward: compile, error against float64")
    fwd = compile_fn(fwd_of, case, 3, extras)
    if reason := too_big(fwd):
      row["status"] = reason
      return timers
    out = np.asarray(jax.block_until_ready(fwd(*arg_sets[0][:3], *extras)))
    if reference is not None:
      row["max_err"], row["rel_err"] = errors(out.astype(np.float64), reference)
    del out
    timers["fwd_ms"] = fwd, [a[:3] + extras for a in arg_sets]
  except Exception as e:  # an unsupported shape or dtype, out of memory
    row["status"] = f"n/a ({short_error(e)})"
    return timers
  try:
    progress(case, impl, what + "forward+backward: compile")
    fwd_bwd = compile_fn(grad_fn(fwd_of), case, 4, extras)
    mem = memory_of(fwd_bwd)
    if mem:
      row["memory"], row["memory_beyond_inputs"] = mem["total"], mem["total"] - mem["arguments"]
    if reason := too_big(fwd_bwd):
      row["status"] = f"fwd only (fwd+bwd {reason})"
      return timers
    timers["fwdbwd_ms"] = fwd_bwd, [a + extras for a in arg_sets]
  except Exception as e:
    row["status"] = f"fwd only (fwd+bwd: {short_error(e)})"
  return timers


def run_case(case: Case, impls, repeats, seed: int, feature: str = "plain",
             rounds: int = 1) -> list[dict]:
  """One row per impl of `feature` ("plain", or one of jax_flash.bench_features) on `case`.

  Every impl is compiled and checked first; then each of `rounds` rounds times
  every impl's forward and forward+backward, the impls in an order rotated from
  round to round. A row's times are the medians over the rounds, its ratios
  the medians of the ratios within a round: impls timed side by side share the
  device's clock and temperature, which drift over minutes (a row of the same
  build has moved by 5-9% between runs on an H200).
  """
  on_cpu = jax.default_backend() == "cpu"
  what = "" if feature == "plain" else f"{feature}: "
  n_sets = ROTATE_SETS if 4 * case.tensor_bytes <= ROTATE_MAX_BYTES else 1
  arg_sets = [make_inputs(case, seed + i) for i in range(n_sets)]
  found, reference_ops, skipped = bench_features.problems(case, impls, feature)
  reference = None  # dropout has none; large shapes neither
  if reference_ops is not None and case.batch * case.heads * case.seqlen**2 <= REFERENCE_MAX_SCORES:
    progress(case, "numpy", f"{what}float64 reference forward")
    reference = reference_fwd(*arg_sets[0][:3], case.causal, **reference_ops)
  rows, timers = {}, {}
  for impl, (fwd_of, extras, given) in found.items():
    rows[impl] = empty_row(case, impl, feature, given)
    timers[impl] = prepare(rows[impl], case, fwd_of, extras, arg_sets, reference, what)
  times = {impl: {key: [] for key in t} for impl, t in timers.items()}
  names = [impl for impl in timers if timers[impl]]
  for r in range(rounds if names else 0):
    for impl in names[r % len(names):] + names[:r % len(names)]:
      for key, (fn, sets) in list(timers[impl].items()):
        round_of = f", round {r + 1} of {rounds}" if rounds > 1 else ""
        progress(case, impl, f"{what}{TIMED[key]}: time{round_of}")
        try:
          t, samples = time_call(fn, sets, repeats, on_cpu)
          times[impl][key].append(1e3 * t)
          if key == "fwd_ms":
            rows[impl]["repeats"] = samples
        except Exception as e:  # out of memory at run time
          if key == "fwd_ms":
            rows[impl]["status"] = f"n/a ({short_error(e)})"
            timers[impl], times[impl] = {}, {}
            break
          rows[impl]["status"] = f"fwd only (fwd+bwd: {short_error(e)})"
          del timers[impl][key], times[impl][key]
  for impl, row in rows.items():
    fill_times(row, case, times[impl])
  for row in rows.values():  # Ratios against the alternatives measured in this process.
    for base in ("xla", "cudnn"):
      for key in TIMED:
        ratios = bench_features.round_ratios(row, rows.get(base), key)
        row[f"{key[:-3]}_vs_{base}"] = statistics.median(ratios) if ratios else None
  return list(rows.values()) + [empty_row(case, impl, feature, None, f"not run: {why}")
                                for impl, why in skipped.items()]


def fill_times(row: dict, case: Case, times: dict) -> None:
  """A row's times (the medians of {row key: ms per round}), TF/s and times per round."""
  row["fwd_ms_rounds"], row["fwdbwd_ms_rounds"] = times.get("fwd_ms"), times.get("fwdbwd_ms")
  if times.get("fwd_ms"):
    row["fwd_ms"] = statistics.median(times["fwd_ms"])
    row["fwd_tflops"] = case.fwd_flops / row["fwd_ms"] * 1e3 / 1e12
  if times.get("fwd_ms") and times.get("fwdbwd_ms"):
    row["fwdbwd_ms"] = statistics.median(times["fwdbwd_ms"])
    row["fwdbwd_tflops"] = (1 + BWD_FLOP_FACTOR) * case.fwd_flops / row["fwdbwd_ms"] * 1e3 / 1e12
    row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    if row["bwd_ms"] > 0:
      row["bwd_tflops"] = BWD_FLOP_FACTOR * case.fwd_flops / row["bwd_ms"] * 1e3 / 1e12


# -- command line --------------------------------------------------------------


def _size(text: str) -> int:
  """'4096', '4k' or '16K' -> a positive int."""
  digits = text.strip().lower()
  kilo = digits.endswith("k")
  digits = digits[:-1] if kilo else digits
  if not digits.isdigit() or int(digits) < 1:
    raise argparse.ArgumentTypeError(f"expected a size of at least 1 such as 4096 or 4k, "
                                     f"got {text!r}")
  return int(digits) * (1024 if kilo else 1)


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
  return int(text)


def _impls(text: str) -> list[str]:
  impls = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in impls if s not in IMPLS]
  if bad or not impls:
    raise argparse.ArgumentTypeError(f"impls must be a comma list of {', '.join(IMPLS)}")
  return impls


def make_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jax_flash.bench",
      description="Benchmark jax_flash against jax.nn.dot_product_attention on the default "
                  "device: time, TFLOP/s, speed-ups, memory, error against float64.",
      epilog="A line on stderr names each measurement as it starts. Target verdicts are "
             "printed for the shapes the targets are defined for (the cpu preset on a CPU; "
             "the memory preset with --memory; on a GPU, bfloat16 at S=1k..16k: --features "
             "against cudnn and plain, D=96/192/256 plain against cudnn).")
  p.add_argument("--preset", choices=sorted([*PRESETS, "memory"]),
                 help="shapes to run: cpu (B=1 H=8 D=64 float32, S=1k 4k), fa3 (bfloat16, "
                      "S=512..16k, D=64 128 256, B=16k/S, H=2048/D), memory (CPU: S=16k B=1 H=8 "
                      "D=64 float32; GPU: S=32k B=1 H=16 D=128 bfloat16), quick (tiny); default: "
                      "memory with --memory, else fa3 on a GPU, cpu on a CPU")
  p.add_argument("--seqlens", nargs="+", type=_size, metavar="S",
                 help="sequence lengths, replacing the preset's, e.g. 1024 4k")
  p.add_argument("--head-dims", nargs="+", type=_positive, metavar="D",
                 help="head dimensions, replacing the preset's, e.g. 64 128")
  p.add_argument("--batch", type=_positive, help="batch size (fa3 default: 16384 // S)")
  p.add_argument("--heads", type=_positive, help="number of heads (fa3 default: 2048 // D)")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                 help="input dtype, replacing the preset's")
  p.add_argument("--causal", choices=["yes", "no", "both"], default="both",
                 help="causal mask, no mask, or each in turn (default: both)")
  p.add_argument("--impls", type=_impls, metavar="LIST",
                 help=f"comma list of {','.join(IMPLS)} (default: those that can run on the "
                      "device; cudnn needs an NVIDIA GPU and float16 or bfloat16)")
  features = list(bench_features.FEATURES)
  p.add_argument("--features", nargs="+", metavar="F", choices=["all", *features],
                 help=f"also measure these problems on each shape, after its plain rows: "
                      f"{' '.join(features)}, or all (bias: ALiBi (1,N,S,S); mask: causal as a "
                      "dense mask, causal shapes only; padding: Flax's padding mask; lengths: the "
                      "same as seq lengths; dropout 0.1, against jax_flash without; segments: 4 "
                      "packed sequences, jax.nn given the dense mask; block-sparse: local + "
                      "global 128 x 128 blocks, jax.nn given the dense mask)")
  p.add_argument("--repeats", type=_positive,
                 help="timed samples per measurement (default: by time, 3 to 30)")
  p.add_argument("--rounds", type=_positive, default=1,
                 help="measure every impl this many times per shape, the impls in a rotated "
                      "order each round; times are the medians, ratios the medians of each "
                      "round's ratios, and the table shows each round's (default: 1)")
  p.add_argument("--memory", action="store_true",
                 help="also measure the peak memory of one fwd+bwd of each shape and impl, in a "
                      "fresh process each, before the timing")
  p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
  p.add_argument("--plot", metavar="PATH",
                 help="also draw TFLOP/s and memory against sequence length (needs matplotlib)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
  return p


def parse_args(argv):
  p = make_parser()
  args = p.parse_args(argv)
  if args.features and "all" in args.features:
    args.features = list(bench_features.FEATURES)
  if args.dtype == "float64" and not jax.config.jax_enable_x64:
    p.error("--dtype float64 needs jax's 64-bit mode (JAX_ENABLE_X64=1); without it jax "
            "would compute in float32")
  for flag, path in (("--json", args.json), ("--plot", args.plot)):
    if path and (os.path.isdir(path) or not os.path.isdir(os.path.dirname(path) or ".")):
      p.error(f"{flag}: cannot write {path!r} (a directory, or its folder does not exist)")
  if args.plot:  # Before anything runs: the plot is drawn after the whole run.
    from jax_flash import plots
    try:
      plots.require_matplotlib()
    except ImportError as e:
      p.error(f"--plot: {e}")
  return args


def build_cases(args, platform: str) -> list[Case]:
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  name = args.preset or ("memory" if args.memory else "cpu" if platform == "cpu" else "fa3")
  preset = preset_shapes(name, platform)
  seqlens, head_dims = args.seqlens or preset["seqlens"], args.head_dims or preset["head_dims"]
  batch, heads = args.batch or preset["batch"], args.heads or preset["heads"]
  dtype = args.dtype or preset["dtype"]
  return [Case(batch=batch or max(1, FA3_TOKENS // s), heads=heads or max(1, FA3_HIDDEN // d),
               seqlen=s, head_dim=d, dtype=dtype, causal=c)
          for d in head_dims for s in seqlens for c in causals]


def choose_impls(requested, platform: str, dtype: str) -> list[str]:
  """The implementations to run: those requested (default: all) that can run here.

  One requested by name that cannot run here is named once, with the reason.
  """
  impls = []
  for impl in requested or IMPLS:
    reason = why_unavailable(impl, platform, dtype)
    if reason is None:
      impls.append(impl)
    elif requested:
      print(f"{impl}: not run: {reason}", flush=True)
  if not impls:
    raise SystemExit("none of the requested implementations can run here")
  return impls


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.memory:  # Children measure the device: the parent must not take its memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # Here, not at the top: bench_report builds on this module's Case and presets.
  from jax_flash import bench_report as report
  meta = report.header_info()
  platform = meta["platform"]
  cases = build_cases(args, platform)
  print(report.header_line(meta), flush=True)
  impls = choose_impls(args.impls, platform, cases[0].dtype)  # one dtype per run
  memory = {}
  if args.memory:  # First, while this process holds no device memory of its own.
    from jax_flash import bench_memory
    print("\n" + bench_memory.legend(platform), flush=True)
    for case in cases:
      for impl in impls:
        memory[case, impl] = bench_memory.measure(case, impl)
        print(bench_memory.line(case, impl, memory[case, impl]), flush=True)
  show_cudnn = "cudnn" in impls
  print("\n" + report.TIMING_LEGEND + ("\n" + bench_features.LEGEND if args.features else ""),
        flush=True)
  rows = []
  for i, case in enumerate(cases):  # Print each block as it is measured: fa3 takes minutes.
    plain = run_case(case, impls, args.repeats, seed=args.seed + 10 * i, rounds=args.rounds)
    for row in plain:
      row.update(memory.get((case, row["impl"]), {}))
    print(report.table_block(plain, show_cudnn), flush=True)
    rows += plain
    for feature in args.features or ():  # Same q, k, v as the plain rows (same seed).
      if not bench_features.applies(feature, case):
        continue  # mask: the causal mask as a dense mask, on causal shapes only
      case_rows = run_case(case, impls, args.repeats, seed=args.seed + 10 * i, feature=feature,
                           rounds=args.rounds)
      bench_features.add_plain_ratios(case_rows, plain)
      print(report.table_block(case_rows, show_cudnn), flush=True)
      rows += case_rows
  targets = report.format_targets(rows, platform)
  if targets:
    print(targets, flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  if args.plot:
    from jax_flash import plots
    plots.plot(rows, args.plot)
    print(f"plot written to {args.plot}")
  return rows


if __name__ == "__main__":
  main()

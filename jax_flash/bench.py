"""Benchmark jax_flash against jax.nn.dot_product_attention: ``python -m jax_flash.bench``.

On the default device, for each shape and mask, every implementation runs
forward and forward+backward; the table gives time, TFLOP/s, speed-up over
the alternatives measured in the same process, compiled memory, and the
forward output's max error against a float64 reference.

FLOP convention (FlashAttention papers): forward = 4*B*H*Sq*Sk*D, halved when
causal; backward = 2.5x forward, so forward+backward = 3.5x forward.

Presets: ``cpu`` (the CPU target of the issue), ``fa3`` (FlashAttention-3
paper shapes: B*S = 16k tokens, hidden 2048, bf16) and ``quick`` (tiny, for
tests). ``--memory`` measures the peak memory of one forward+backward in a
fresh process per implementation. Every row is a plain dict (``--json``), so
other tools (a later ``--plot``) can read the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

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

PRESETS = {
    # The CPU target: jax_flash >= 1.5x xla (>= 2.5x causal), fwd and fwd+bwd.
    "cpu": dict(seqlens=[1024, 4096], head_dims=[64], batch=1, heads=8, dtype="float32"),
    # FlashAttention-3 paper: B*S = 16k tokens, hidden 2048 -> H = 2048 / D.
    "fa3": dict(seqlens=[512, 1024, 2048, 4096, 8192, 16384], head_dims=[64, 128, 256],
                batch=None, heads=None, dtype="bfloat16"),
    "quick": dict(seqlens=[128, 256], head_dims=[32], batch=1, heads=2, dtype="float32"),
}
FA3_TOKENS, FA3_HIDDEN = 16384, 2048
# --memory targets: CPU fwd+bwd within 1 GiB beyond the inputs; GPU peak within
# 1.2x of inputs + outputs + gradients.
MEMORY_SHAPES = {"cpu": dict(seqlen=16384, batch=1, heads=8, head_dim=64, dtype="float32"),
                 "gpu": dict(seqlen=32768, batch=1, heads=16, head_dim=128, dtype="bfloat16")}
CPU_MEMORY_TARGET_BEYOND_INPUTS = 1 * GiB
GPU_MEMORY_TARGET_RATIO = 1.2
CPU_SPEEDUP_TARGET = {False: 1.5, True: 2.5}  # by causal


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


def attention_fn(impl: str, causal: bool):
  if impl == "jax_flash":
    return lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def fwd_bwd_fn(impl: str, causal: bool):
  """q, k, v, dout -> (dq, dk, dv): the gradient of sum(attention(q, k, v) * dout)."""
  fwd = attention_fn(impl, causal)
  return lambda q, k, v, dout: jax.vjp(fwd, q, k, v)[1](dout)


def compile_fn(fn, case: Case, num_args: int):
  spec = jax.ShapeDtypeStruct(case.shape, case.dtype)
  return jax.jit(fn).lower(*([spec] * num_args)).compile()


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


# -- inputs, reference, timing -------------------------------------------------


def make_inputs(case: Case, seed: int):
  """Fresh standard-normal q, k, v, dout on the default device (never zeros)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(k, case.shape, case.dtype) for k in keys)


def reference_fwd(q, k, v, causal: bool) -> np.ndarray:
  """Dense float64 softmax(q k^T / sqrt(D)) v in numpy, in query-row blocks."""
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
      if causal:  # Top-left aligned, as in jax.nn: query i sees keys j <= i.
        s = np.where(np.arange(seqlen_k)[None, :] <= np.arange(r0, r1)[:, None], s, -np.inf)
      p = np.exp(s - s.max(axis=-1, keepdims=True))
      p /= p.sum(axis=-1, keepdims=True)
      out[b, r0:r1] = (p @ vh).transpose(1, 0, 2)
  return out


def time_call(fn, arg_sets, repeats: int | None, on_cpu: bool) -> tuple[float, int]:
  """Median seconds per call of an already compiled fn, and the samples taken.

  One warm-up call, one timed call to size the run, then `repeats` samples;
  each sample runs `inner` calls back to back, rotating input sets, and
  blocks on all of them, so that short GPU kernels are not timed as host
  round trips.
  """
  jax.block_until_ready(fn(*arg_sets[0]))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[-1]))
  t_one = time.perf_counter() - t0
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


def short_error(e: Exception) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"{type(e).__name__}: {first}"[:100]


# -- one shape -----------------------------------------------------------------


def run_case(case: Case, impls, repeats, seed: int) -> list[dict]:
  on_cpu = jax.default_backend() == "cpu"
  n_sets = ROTATE_SETS if 4 * case.tensor_bytes <= ROTATE_MAX_BYTES else 1
  arg_sets = [make_inputs(case, seed + i) for i in range(n_sets)]
  reference = None
  if case.batch * case.heads * case.seqlen ** 2 <= REFERENCE_MAX_SCORES:
    reference = reference_fwd(*arg_sets[0][:3], case.causal)
  rows = []
  for impl in impls:
    row = dict(dataclasses.asdict(case), impl=impl, status="ok", fwd_ms=None, fwdbwd_ms=None,
               bwd_ms=None, fwd_tflops=None, bwd_tflops=None, fwdbwd_tflops=None,
               memory=None, memory_beyond_inputs=None, max_err=None, rel_err=None, repeats=None)
    rows.append(row)
    try:
      fwd = compile_fn(attention_fn(impl, case.causal), case, 3)
      out = np.asarray(jax.block_until_ready(fwd(*arg_sets[0][:3]))).astype(np.float64)
      if reference is not None:
        row["max_err"] = float(np.max(np.abs(out - reference)))
        row["rel_err"] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
      del out
      t, row["repeats"] = time_call(fwd, [a[:3] for a in arg_sets], repeats, on_cpu)
      row["fwd_ms"], row["fwd_tflops"] = 1e3 * t, case.fwd_flops / t / 1e12
      del fwd
    except Exception as e:  # cudnn on CPU, an unsupported shape or dtype, out of memory
      row["status"] = f"n/a ({short_error(e)})"
      continue
    try:
      fwd_bwd = compile_fn(fwd_bwd_fn(impl, case.causal), case, 4)
      mem = memory_of(fwd_bwd)
      if mem:
        row["memory"], row["memory_beyond_inputs"] = mem["total"], mem["total"] - mem["arguments"]
      t, _ = time_call(fwd_bwd, arg_sets, repeats, on_cpu)
      row["fwdbwd_ms"] = 1e3 * t
      row["fwdbwd_tflops"] = (1 + BWD_FLOP_FACTOR) * case.fwd_flops / t / 1e12
      bwd_s = t - row["fwd_ms"] / 1e3
      row["bwd_ms"] = 1e3 * bwd_s
      if bwd_s > 0:
        row["bwd_tflops"] = BWD_FLOP_FACTOR * case.fwd_flops / bwd_s / 1e12
      del fwd_bwd
    except Exception as e:
      row["status"] = f"fwd only (fwd+bwd: {short_error(e)})"
  for row in rows:  # Ratios against the alternatives measured in this process.
    for base in ("xla", "cudnn"):
      ref_row = next((r for r in rows if r["impl"] == base), None)
      for key in ("fwd_ms", "fwdbwd_ms"):
        ok = ref_row and ref_row[key] and row[key]
        row[f"{key[:-3]}_vs_{base}"] = ref_row[key] / row[key] if ok else None
  return rows


# -- printing ------------------------------------------------------------------


def fmt(x, digits: int = 3) -> str:
  """About `digits` significant digits, never scientific unless tiny or huge."""
  if x is None:
    return "–"
  if x == 0:
    return "0"
  if abs(x) < 1e-3 or abs(x) >= 1e7:
    return f"{x:.1e}"
  decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
  return f"{x:.{decimals}f}"


def header_info() -> dict:
  dev = jax.devices()[0]
  info = jax_flash.build_info()
  if info.get("cuda"):
    build = "cuda archs " + (",".join(info["cuda_archs"]) or "?")
  else:
    build = f"cpu march={info.get('cpu_march')} vector={info.get('cpu_vector_bytes')}B"
  kind = dev.device_kind
  if dev.platform == "cpu":
    try:
      model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                   if l.startswith("model name"))
      kind = f"{model}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
      pass
  return dict(device=kind, platform=dev.platform, jax=jax.__version__,
              jax_flash=info.get("version"), build=build,
              date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))


def header_lines(meta: dict) -> list[str]:
  return [f"jax_flash {meta['jax_flash']} ({meta['build']}) | jax {meta['jax']} | "
          f"{meta['platform']}: {meta['device']} | {meta['date']}"]


def table_columns(show_cudnn: bool):
  cols = [("impl", 10), ("fwd ms", 9), ("fwd TF/s", 9), ("f+b ms", 9), ("bwd ms", 9),
          ("bwd TF/s", 9), ("fwd×xla", 8), ("f+b×xla", 8)]
  if show_cudnn:
    cols += [("fwd×cudnn", 10), ("f+b×cudnn", 10)]
  return cols + [("mem MiB", 9), ("+in MiB", 9), ("max err", 9)]


def table_header(meta: dict) -> str:
  return "\n".join(header_lines(meta) + [
      "median times after warm-up; TF/s: fwd 4·B·H·S²·D (/2 causal), bwd 2.5× fwd; "
      "f+b = jit(grad) incl. fwd, bwd = f+b − fwd; ×impl = its time / this row's time;",
      "mem: XLA memory_analysis of jit(fwd+bwd) (arguments + outputs + temporaries, not run; "
      "FFI scratch not counted), +in = beyond inputs; max err: fwd output vs float64 numpy."])


def table_block(rows: list[dict], show_cudnn: bool) -> str:
  """The rows of one (shape, causal): a title line, column names, one line per impl."""
  cols = table_columns(show_cudnn)
  r0 = rows[0]
  case = Case(r0["batch"], r0["heads"], r0["seqlen"], r0["head_dim"], r0["dtype"], r0["causal"])
  lines = ["", f"{case.label()}   (fwd {fmt(case.fwd_flops / 1e9)} GFLOP)",
           "  " + " ".join(f"{name:>{w}}" if i else f"{name:<{w}}"
                           for i, (name, w) in enumerate(cols))]
  for r in rows:
    if not r["fwd_ms"]:
      lines.append(f"  {r['impl']:<10} {r['status']}")
      continue
    vals = [r["fwd_ms"], r["fwd_tflops"], r["fwdbwd_ms"], r["bwd_ms"], r["bwd_tflops"],
            r["fwd_vs_xla"], r["fwdbwd_vs_xla"]]
    if show_cudnn:
      vals += [r["fwd_vs_cudnn"], r["fwdbwd_vs_cudnn"]]
    vals += [m / MiB if m is not None else None
             for m in (r["memory"], r["memory_beyond_inputs"])]
    cells = [f"{r['impl']:<10}"] + [f"{fmt(v):>{w}}" for v, (_, w) in zip(vals, cols[1:])]
    err = f"{r['max_err']:.1e}" if r["max_err"] is not None else "–"
    note = "" if r["status"] == "ok" else "  " + r["status"]
    lines.append("  " + " ".join(cells) + f" {err:>9}" + note)
  return "\n".join(lines)


def format_cpu_targets(rows: list[dict]) -> str:
  """The issue's CPU target: jax_flash >= 1.5x xla without mask, >= 2.5x causal."""
  lines = []
  for r in rows:
    if r["impl"] != "jax_flash" or r["fwd_vs_xla"] is None:
      continue
    target = CPU_SPEEDUP_TARGET[r["causal"]]
    parts = []
    for name, key in (("fwd", "fwd_vs_xla"), ("fwd+bwd", "fwdbwd_vs_xla")):
      x = r[key]
      parts.append(f"{name} {fmt(x)}× {'ok' if x is not None and x >= target else 'MISS'}")
    lines.append(f"  S={r['seqlen']} causal={'yes' if r['causal'] else 'no':<3} "
                 f"(target ≥{target}×): " + ", ".join(parts))
  return "\nCPU target, jax_flash vs xla:\n" + "\n".join(lines) if lines else ""


# -- --memory: one forward+backward per fresh process ----------------------------


def _rss_bytes(field: str) -> int:
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(spec: dict) -> dict:
  """Runs in a fresh process: compile, place inputs, run fwd+bwd once, report peaks."""
  case = Case(**spec["case"])
  result = dict(dataclasses.asdict(case), impl=spec["impl"], status="ok")
  dev = jax.devices()[0]
  try:
    compiled = compile_fn(fwd_bwd_fn(spec["impl"], case.causal), case, 4)
  except Exception as e:
    return dict(result, status=f"n/a ({short_error(e)})")
  result["static"] = memory_of(compiled)
  rng = np.random.default_rng(0)  # Inputs from the host: no device temporaries.
  host = [rng.standard_normal(case.shape, np.float32).astype(case.dtype) for _ in range(4)]
  if dev.platform == "cpu":
    available = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo")
                     if l.startswith("MemAvailable:"))
  else:
    stats = dev.memory_stats() or {}
    available = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
  needed = (result["static"] or {}).get("total", 0)
  if needed > 0.7 * available:
    return dict(result, status=f"not run: needs ~{needed / GiB:.1f} GiB, "
                               f"{available / GiB:.1f} GiB available")
  args = [jax.device_put(x, dev) for x in host]
  del host
  jax.block_until_ready(args)
  if dev.platform == "cpu":
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # Resets VmHWM (peak RSS) to the current RSS.
    before = _rss_bytes("VmRSS")
    jax.block_until_ready(compiled(*args))
    result["runtime_beyond_inputs"] = _rss_bytes("VmHWM") - before
    result["runtime_source"] = "peak RSS growth during the call (VmHWM)"
  else:
    stats = dev.memory_stats()
    before, peak_before = stats["bytes_in_use"], stats["peak_bytes_in_use"]
    jax.block_until_ready(compiled(*args))
    peak = dev.memory_stats()["peak_bytes_in_use"]
    result["runtime_peak"] = peak
    result["runtime_beyond_inputs"] = peak - before
    result["runtime_source"] = "device peak_bytes_in_use"
    if peak == peak_before:  # Compile-time autotuning set the peak: an upper bound.
      result["runtime_source"] += " (upper bound: peak set before the call)"
  return result


def run_memory(cases, impls, meta) -> tuple[list[dict], str]:
  rows = []
  for case in cases:
    for impl in impls:
      spec = json.dumps(dict(case=dataclasses.asdict(case), impl=impl))
      proc = subprocess.run([sys.executable, "-m", "jax_flash.bench", "--memory-child", spec],
                            capture_output=True, text=True)
      marker = [l for l in proc.stdout.splitlines() if l.startswith("MEMORY_RESULT ")]
      if marker:
        rows.append(json.loads(marker[-1][len("MEMORY_RESULT "):]))
      else:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]
        rows.append(dict(dataclasses.asdict(case), impl=impl,
                         status=f"n/a (child exit {proc.returncode}: {tail})"))
  gpu = meta["platform"] != "cpu"
  lines = header_lines(meta) + [
      "peak memory of one jit(fwd+bwd) call, one fresh process per row; static = XLA "
      "memory_analysis (arguments + outputs + temporaries);",
      "runtime = " + ("device peak_bytes_in_use" if gpu else "peak RSS growth during the call")
      + "; ideal = q, k, v, dout + out + dq, dk, dv.",
      "target: " + (f"runtime peak ≤ {GPU_MEMORY_TARGET_RATIO}× ideal" if gpu else
                    f"runtime beyond inputs ≤ {CPU_MEMORY_TARGET_BEYOND_INPUTS / GiB:g} GiB")]
  for r in rows:
    case = Case(r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["dtype"], r["causal"])
    inputs, ideal = 4 * case.tensor_bytes, 8 * case.tensor_bytes
    static = (r.get("static") or {}).get("total")
    parts = [f"inputs {inputs / MiB:.0f} MiB", f"ideal {ideal / MiB:.0f} MiB",
             f"static {fmt(static / MiB if static else None)} MiB"]
    verdict = ""
    if gpu and r.get("runtime_peak") is not None:
      ratio = r["runtime_peak"] / ideal
      parts.append(f"runtime peak {r['runtime_peak'] / MiB:.0f} MiB = {ratio:.2f}× ideal")
      verdict = "ok" if ratio <= GPU_MEMORY_TARGET_RATIO else "MISS"
    elif r.get("runtime_beyond_inputs") is not None:
      beyond = r["runtime_beyond_inputs"]
      parts.append(f"runtime beyond inputs {beyond / MiB:.0f} MiB")
      verdict = "ok" if beyond <= CPU_MEMORY_TARGET_BEYOND_INPUTS else "MISS"
    if "upper bound" in r.get("runtime_source", ""):
      verdict += " (upper bound)"
    status = "" if r["status"] == "ok" else "  " + r["status"]
    lines.append(f"  {case.label()}  {r['impl']:<10} " + ", ".join(parts) +
                 (f"  {verdict}" if verdict else "") + status)
  return rows, "\n".join(lines)


# -- command line --------------------------------------------------------------


def _size(text: str) -> int:
  """'4096', '4k' or '16K' -> int."""
  text = text.strip().lower()
  return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def _impls(text: str) -> list[str]:
  impls = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in impls if s not in IMPLS]
  if bad or not impls:
    raise argparse.ArgumentTypeError(f"impls must be a comma list of {', '.join(IMPLS)}")
  return impls


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m jax_flash.bench", description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS),
                 help="shapes to run (default: fa3 on GPU, cpu on CPU)")
  p.add_argument("--seqlens", nargs="+", type=_size, help="sequence lengths, e.g. 1024 4k")
  p.add_argument("--head-dims", nargs="+", type=int)
  p.add_argument("--batch", type=int, help="batch (fa3 default: 16384 // S)")
  p.add_argument("--heads", type=int, help="heads (fa3 default: 2048 // D)")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"])
  p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
  p.add_argument("--impls", type=_impls, default=list(IMPLS),
                 help="comma list of jax_flash,xla,cudnn (default: all)")
  p.add_argument("--repeats", type=int, help="timed samples (default: by time, 3..30)")
  p.add_argument("--memory", action="store_true",
                 help="peak memory of fwd+bwd in a fresh process per impl (CPU: S=16k, "
                      "B=1, H=8, D=64; GPU: S=32k, B=1, H=16, D=128)")
  p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
  p.add_argument("--plot", metavar="PATH",
                 help="also draw TFLOP/s and memory against sequence length (needs matplotlib)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--memory-child", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def build_cases(args, platform: str) -> list[Case]:
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  if args.memory:
    shape = MEMORY_SHAPES["cpu" if platform == "cpu" else "gpu"]
    seqlens, head_dims = args.seqlens or [shape["seqlen"]], args.head_dims or [shape["head_dim"]]
    batch, heads = args.batch or shape["batch"], args.heads or shape["heads"]
    dtype = args.dtype or shape["dtype"]
    if args.causal == "both":
      causals = [False]
  else:
    preset = PRESETS[args.preset or ("cpu" if platform == "cpu" else "fa3")]
    seqlens, head_dims = args.seqlens or preset["seqlens"], args.head_dims or preset["head_dims"]
    batch, heads, dtype = args.batch or preset["batch"], args.heads or preset["heads"], \
        args.dtype or preset["dtype"]
  return [Case(batch=batch or max(1, FA3_TOKENS // s), heads=heads or max(1, FA3_HIDDEN // d),
               seqlen=s, head_dim=d, dtype=dtype, causal=c)
          for d in head_dims for s in seqlens for c in causals]


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.memory_child:
    print("MEMORY_RESULT " + json.dumps(memory_child(json.loads(args.memory_child))))
    return []
  if args.memory:  # Children measure the device: the parent must not take its memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  meta = header_info()
  cases = build_cases(args, meta["platform"])
  if args.memory:
    rows, text = run_memory(cases, args.impls, meta)
    print(text, flush=True)
  else:
    show_cudnn = meta["platform"] != "cpu" and "cudnn" in args.impls
    print(table_header(meta), flush=True)
    rows = []
    for i, case in enumerate(cases):  # Print each block as it is measured: fa3 takes minutes.
      case_rows = run_case(case, args.impls, args.repeats, seed=args.seed + 10 * i)
      print(table_block(case_rows, show_cudnn), flush=True)
      rows += case_rows
    if meta["platform"] == "cpu" and (args.preset or "cpu") == "cpu":
      print(format_cpu_targets(rows), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  if args.plot:
    from jax_flash import plots  # matplotlib only when asked for
    plots.plot(rows, args.plot)
    print(f"plot written to {args.plot}")
  return rows


if __name__ == "__main__":
  main()

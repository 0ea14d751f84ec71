"""The text of ``python -m jax_flash.bench``: its header, tables, legend and target verdicts.

Everything here presents rows that ``jax_flash.bench`` measured (plain dicts,
as ``--json`` writes them); nothing here measures. ``fmt`` and the header are
shared with ``jax_flash.bench_memory`` and ``jax_flash.bench_autodiff``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os

import jax

import jax_flash
from jax_flash import bench_features
from jax_flash.bench import PRESETS, GiB, MiB, Case, preset_shapes

# The targets, judged by format_targets on the shapes they are defined for
# (bench.PRESETS["cpu"], the "memory" preset).
CPU_MEMORY_TARGET_BEYOND_INPUTS = 1 * GiB
GPU_MEMORY_TARGET_RATIO = 1.2
CPU_SPEEDUP_TARGET = {False: 1.5, True: 2.5}  # by causal


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


def header_line(meta: dict) -> str:
  return (f"jax_flash {meta['jax_flash']} ({meta['build']}) | jax {meta['jax']} | "
          f"{meta['platform']}: {meta['device']} | {meta['date']}")


def _case_of(row: dict) -> Case:
  return Case(*(row[f.name] for f in dataclasses.fields(Case)))


def table_columns(show_cudnn: bool, show_plain: bool = False):
  """(name, width, row key) of the number columns."""
  cols = [("fwd ms", 9, "fwd_ms"), ("fwd TF/s", 9, "fwd_tflops"), ("f+b ms", 9, "fwdbwd_ms"),
          ("bwd ms", 9, "bwd_ms"), ("bwd TF/s", 9, "bwd_tflops"), ("fwd×xla", 8, "fwd_vs_xla"),
          ("f+b×xla", 8, "fwdbwd_vs_xla")]
  for base, shown in (("cudnn", show_cudnn), ("plain", show_plain)):
    if shown:
      cols += [(f"fwd×{base}", 10, f"fwd_vs_{base}"), (f"f+b×{base}", 10, f"fwdbwd_vs_{base}")]
  return cols + [("mem MiB", 9, "memory"), ("+in MiB", 9, "memory_beyond_inputs")]


TIMING_LEGEND = (
    "Timing: median times after warm-up; TF/s: fwd 4·B·H·S²·D (/2 causal), bwd 2.5× fwd; "
    "f+b = jit(grad) incl. fwd, bwd = f+b − fwd; ×impl = its time / this row's time;\n"
    "mem: XLA memory_analysis of jit(fwd+bwd) (arguments + outputs + temporaries, not run; "
    "FFI scratch not counted), +in = beyond inputs; max err: fwd output vs float64 numpy.")


def table_block(rows: list[dict], show_cudnn: bool) -> str:
  """The rows of one (shape, causal, feature): a title line, column names, one line per
  impl; under a feature, what each impl was given."""
  feature = rows[0].get("feature", "plain")
  cols = table_columns(show_cudnn, show_plain=feature != "plain")
  case = _case_of(rows[0])
  title = case.label()
  if feature != "plain":
    title += f" | {feature}: {bench_features.FEATURES[feature].summary}"
  lines = ["", f"{title}   (fwd {fmt(case.fwd_flops / 1e9)} GFLOP)",
           f"  {'impl':<10} " + " ".join(f"{name:>{w}}" for name, w, _ in cols) + "   max err"]
  for r in rows:
    if not r["fwd_ms"]:
      lines.append(f"  {r['impl']:<10} {r['status']}")
      continue
    cells = [fmt(r[key] / MiB if key.startswith("memory") and r[key] is not None else r[key])
             for _, _, key in cols]
    err = f"{r['max_err']:.1e}" if r["max_err"] is not None else "–"
    note = "" if r["status"] == "ok" else "  " + r["status"]
    lines.append(f"  {r['impl']:<10} " + " ".join(f"{c:>{w}}" for c, (_, w, _) in
                                                   zip(cells, cols)) + f" {err:>9}" + note)
  return "\n".join(lines + round_lines(rows) + bench_features.given_lines(rows))


def round_lines(rows: list[dict]) -> list[str]:
  """Each round's ratios of rows measured in several rounds (--rounds): how far one
  reading of a ratio moves."""
  lines = []
  for r in rows:
    parts = []
    for base in (b for b in rows if b["impl"] in ("xla", "cudnn") and b is not r):
      for name, key in (("fwd", "fwd_ms"), ("f+b", "fwdbwd_ms"), ("bwd", "bwd_ms")):
        ratios = bench_features.round_ratios(r, base, key)
        if ratios and len(ratios) > 1:
          parts.append(f"{name}×{base['impl']} " + " ".join(fmt(x) for x in ratios))
    if parts:
      lines.append(f"  {r['impl']} by round: " + ", ".join(parts))
  return lines


def _is_case(case: Case, shapes: dict) -> bool:
  return (case.seqlen in shapes["seqlens"] and case.head_dim in shapes["head_dims"] and
          (case.batch, case.heads, case.dtype) ==
          (shapes["batch"], shapes["heads"], shapes["dtype"]))


def format_targets(rows: list[dict], platform: str) -> str:
  """Verdicts for jax_flash, only on the shapes each target is defined for.

  CPU speed (the cpu preset's shapes): fwd and fwd+bwd >= 1.5x xla, >= 2.5x
  causal. Memory (the memory preset's shape, with --memory): CPU fwd+bwd within
  1 GiB beyond the inputs; GPU peak within 1.2x inputs + outputs + gradients.
  On a GPU also the feature and head-dim targets (bench_features.target_lines).
  """
  lines = []
  for r in rows:
    if r["impl"] != "jax_flash" or r.get("feature", "plain") != "plain":
      continue
    case = _case_of(r)
    if platform == "cpu" and _is_case(case, PRESETS["cpu"]) and r["fwd_vs_xla"] is not None:
      target = CPU_SPEEDUP_TARGET[case.causal]
      parts = [f"{name} {fmt(r[key])}× xla {'ok' if (r[key] or 0) >= target else 'MISS'}"
               for name, key in (("fwd", "fwd_vs_xla"), ("fwd+bwd", "fwdbwd_vs_xla"))]
      lines.append(f"  {case.label()}: " + ", ".join(parts) + f" (target ≥ {target}× xla)")
    if _is_case(case, preset_shapes("memory", platform)):
      if platform == "cpu" and r.get("runtime_beyond_inputs") is not None:
        beyond, target = r["runtime_beyond_inputs"], CPU_MEMORY_TARGET_BEYOND_INPUTS
        ok = "ok" if beyond <= target else "MISS"
        lines.append(f"  {case.label()}: fwd+bwd {beyond / MiB:.0f} MiB beyond the inputs {ok} "
                     f"(target ≤ {target / GiB:g} GiB)")
      elif platform != "cpu" and r.get("runtime_peak") is not None:
        ratio = r["runtime_peak"] / (8 * case.tensor_bytes)
        ok = "ok" if ratio <= GPU_MEMORY_TARGET_RATIO else "MISS"
        bound = " (upper bound)" if "upper bound" in r["runtime_source"] else ""
        lines.append(f"  {case.label()}: fwd+bwd peak {ratio:.2f}× ideal{bound} {ok} "
                     f"(target ≤ {GPU_MEMORY_TARGET_RATIO}× ideal)")
  if platform != "cpu":
    lines += bench_features.target_lines(rows, lambda r: _case_of(r).label())
  return "\nTargets, jax_flash:\n" + "\n".join(lines) if lines else ""

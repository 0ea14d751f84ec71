"""Forward mode and second order against jax.nn: ``python -m jax_flash.bench_autodiff``.

For each shape every implementation runs, under jit:
  fwd   the output
  jvp   jax.jvp: the output and its tangent along (dq, dk, dv)
  grad  jax.grad of sum(sin(out)) with respect to q, k, v
  hvp   jax.jvp of that grad: a Hessian-vector product (second order)
The table gives the median time, the speed-up over xla measured in this
process, and XLA's memory plan beyond the inputs (arguments + outputs +
temporaries - arguments; FFI scratch not counted). Timing and memory use
python -m jax_flash.bench's helpers.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import bench, bench_report

MODES = ("fwd", "jvp", "grad", "hvp")


def attention(impl: str, causal: bool):
  if impl == "jax_flash":
    return lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def mode_fn(mode: str, impl: str, causal: bool):
  """A function of (q, k, v, dq, dk, dv) for one mode."""
  f = attention(impl, causal)
  grad = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2))
  return {
      "fwd": lambda q, k, v, *t: f(q, k, v),
      "jvp": lambda q, k, v, *t: jax.jvp(f, (q, k, v), t),
      "grad": lambda q, k, v, *t: grad(q, k, v),
      "hvp": lambda q, k, v, *t: jax.jvp(grad, (q, k, v), t)[1],
  }[mode]


def run_case(case: bench.Case, impls, modes, repeats) -> list[dict]:
  on_cpu = jax.default_backend() == "cpu"
  keys = jax.random.split(jax.random.key(case.seqlen), 6)
  args = [jax.random.normal(key, case.shape, case.dtype) for key in keys]
  spec = jax.ShapeDtypeStruct(case.shape, case.dtype)
  rows = []
  for mode in modes:
    for impl in impls:
      row = dict(batch=case.batch, heads=case.heads, seqlen=case.seqlen,
                 head_dim=case.head_dim, dtype=case.dtype, causal=case.causal, impl=impl,
                 mode=mode, status="ok", ms=None, memory_beyond_inputs=None, vs_xla=None)
      rows.append(row)
      try:
        compiled = jax.jit(mode_fn(mode, impl, case.causal)).lower(*[spec] * 6).compile()
        memory = bench.memory_of(compiled)
        if memory:
          row["memory_beyond_inputs"] = memory["total"] - memory["arguments"]
        row["ms"] = 1e3 * bench.time_call(compiled, [args], repeats, on_cpu)[0]
      except Exception as e:  # cudnn on the CPU, out of memory
        row["status"] = f"n/a ({bench.short_error(e)})"
    xla = next((r for r in rows[-len(impls):] if r["impl"] == "xla" and r["ms"]), None)
    for r in rows[-len(impls):]:
      r["vs_xla"] = xla["ms"] / r["ms"] if xla and r["ms"] else None
  return rows


def table_block(case: bench.Case, rows: list[dict]) -> str:
  lines = ["", case.label(),
           f"  {'mode':<5} {'impl':<10} {'ms':>9} {'×xla':>6} {'+in MiB':>9}"]
  for r in rows:
    memory = r["memory_beyond_inputs"]
    lines.append(f"  {r['mode']:<5} {r['impl']:<10} {bench_report.fmt(r['ms']):>9} "
                 f"{bench_report.fmt(r['vs_xla']):>6} "
                 f"{bench_report.fmt(None if memory is None else memory / bench.MiB):>9}"
                 + ("" if r["status"] == "ok" else "  " + r["status"]))
  return "\n".join(lines)


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m jax_flash.bench_autodiff", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqlens", nargs="+", type=bench._size, default=[1024, 2048])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="float32",
                 choices=["float32", "bfloat16", "float16", "float64"])
  p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
  p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ",".join(MODES))
  p.add_argument("--impls", type=bench._impls, default=["jax_flash", "xla"],
                 help="comma list of jax_flash,xla,cudnn")
  p.add_argument("--repeats", type=int, default=None, help="timed samples (default: by time)")
  p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
  args = p.parse_args(argv)
  args.modes = args.modes.split(",")
  if not set(args.modes) <= set(MODES):
    p.error(f"--modes must be a comma list of {', '.join(MODES)}, got {args.modes}")
  return args


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  meta = bench_report.header_info()
  print(bench_report.header_line(meta))
  print("median ms under jit; ×xla = xla's time / this row's; +in MiB = XLA's plan beyond "
        "the inputs")
  causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  rows = []
  for seqlen in args.seqlens:
    for causal in causals:
      case = bench.Case(args.batch, args.heads, seqlen, args.head_dim, args.dtype, causal)
      case_rows = run_case(case, args.impls, args.modes, args.repeats)
      print(table_block(case, case_rows), flush=True)
      rows += case_rows
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])

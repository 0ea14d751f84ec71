"""``python -m jax_flash.bench --memory``: the peak memory of one forward+backward.

Each (shape, impl) runs in a fresh process (``python -m jax_flash.bench_memory
SPEC``, started by ``measure``), so that no earlier compilation, cache or
allocator pool counts: on a CPU the growth of the peak RSS during the call, on
a GPU the device allocator's peak. Its fields join the bench's row of the same
(shape, impl).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np

from jax_flash import bench_features
from jax_flash.bench import (MEMORY_FIELDS, MiB, Case, compile_fn, grad_fn, progress, short_error,
                             too_big)
from jax_flash.bench_report import fmt


def _rss_bytes(field: str) -> int:
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise RuntimeError(f"{field} not in /proc/self/status")


def child(spec: dict) -> dict:
  """Runs in a fresh process: compile, place inputs, run fwd+bwd once, report peaks."""
  case = Case(**spec["case"])
  dev = jax.devices()[0]
  try:
    (fwd, _, _), _ = bench_features.problem("plain", case, spec["impl"], {})
    compiled = compile_fn(grad_fn(fwd), case, 4)
  except Exception as e:
    return dict(memory_status=f"n/a ({short_error(e)})")
  if reason := too_big(compiled):
    return dict(memory_status=reason)
  rng = np.random.default_rng(0)  # Inputs from the host: no device temporaries.
  host = [rng.standard_normal(case.shape, np.float32).astype(case.dtype) for _ in range(4)]
  args = [jax.device_put(x, dev) for x in host]
  del host
  jax.block_until_ready(args)
  result = dict(memory_status="ok")
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


def measure(case: Case, impl: str) -> dict:
  """The MEMORY_FIELDS of (case, impl), measured by `child` in a fresh process."""
  progress(case, impl, "peak memory of one forward+backward, in a fresh process")
  spec = json.dumps(dict(case=dataclasses.asdict(case), impl=impl))
  proc = subprocess.run([sys.executable, "-m", "jax_flash.bench_memory", spec],
                        capture_output=True, text=True)
  marker = [l for l in proc.stdout.splitlines() if l.startswith("MEMORY_RESULT ")]
  if marker:
    return dict(dict.fromkeys(MEMORY_FIELDS), **json.loads(marker[-1][len("MEMORY_RESULT "):]))
  tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]
  return dict(dict.fromkeys(MEMORY_FIELDS),
              memory_status=f"n/a (child exit {proc.returncode}: {tail})")


def legend(platform: str) -> str:
  return ("Memory: peak of one jit(fwd+bwd) call, one fresh process per line; runtime = " +
          ("device peak_bytes_in_use" if platform != "cpu" else
           "peak RSS growth during the call") +
          "; ideal = q, k, v, dout + out + dq, dk, dv.")


def line(case: Case, impl: str, m: dict) -> str:
  ideal = 8 * case.tensor_bytes
  parts = [f"inputs {fmt(4 * case.tensor_bytes / MiB)} MiB", f"ideal {fmt(ideal / MiB)} MiB"]
  if m.get("runtime_peak") is not None:
    parts.append(f"runtime peak {fmt(m['runtime_peak'] / MiB)} MiB = "
                 f"{m['runtime_peak'] / ideal:.2f}× ideal")
  if m.get("runtime_beyond_inputs") is not None:
    parts.append(f"runtime beyond inputs {fmt(m['runtime_beyond_inputs'] / MiB)} MiB")
  if "upper bound" in (m.get("runtime_source") or ""):
    parts.append("upper bound (peak set before the call)")
  status = "" if m["memory_status"] == "ok" else "  " + m["memory_status"]
  return f"  {case.label()}  {impl:<10} " + ", ".join(parts) + status


if __name__ == "__main__":
  print("MEMORY_RESULT " + json.dumps(child(json.loads(sys.argv[1]))))

"""One call of each implementation on one problem, for a profiler to count.

At the GPU's power limit the time per call is the energy per call
(cpp/cuda/NOTES_sm90_fwd_power.md, "The gap is the clock"), so where jax_flash and
cuDNN are level, what decides is the work each does per FLOP: instructions by
pipe, shared-memory wavefronts, L2 and DRAM traffic. This compiles the
problem's forward (or forward+backward) for jax_flash and cuDNN, makes their
inputs, runs each once, and then once more between cuProfilerStart and
cuProfilerStop, so that a profiler started with --profile-from-start off sees
exactly those calls' kernels. tests/gpu/energy_compare.sh runs it under ncu
(`ncu --profile-from-start off --csv --metrics ...`, its metric list) and
sums the counters per implementation with tests/gpu/ncu_counters.py, which
tells the two apart by kernel name. The order of the calls is printed on
stderr. Shapes: the bench's fa3 preset's (FA3_TOKENS, FA3_HIDDEN).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import jax

import jax_flash
from jax_flash.bench import FA3_HIDDEN, FA3_TOKENS, Case, grad_fn, make_inputs


def cuda_profiler_range():
  """(start, stop) of the CUDA profiler on device 0's primary context (JAX's),
  or two no-ops where there is no CUDA driver (a CPU machine)."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return (lambda: None), (lambda: None)
  device, context = ctypes.c_int(), ctypes.c_void_p()
  # The profiler acts on the calling thread's current context; JAX runs on
  # the primary context but leaves none current on this thread.
  if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0) or
      cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) or
      cuda.cuCtxPushCurrent_v2(context)):
    sys.exit("profile_calls.py: could not make device 0's primary context current")
  return cuda.cuProfilerStart, cuda.cuProfilerStop


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("head_dim", type=int)
  parser.add_argument("seqlen", type=int)
  parser.add_argument("causal", type=int, choices=[0, 1])
  parser.add_argument("direction", choices=["fwd", "fwd_bwd"])
  parser.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn"])
  args = parser.parse_args(argv)
  case = Case(batch=max(1, FA3_TOKENS // args.seqlen), heads=max(1, FA3_HIDDEN // args.head_dim),
              seqlen=args.seqlen, head_dim=args.head_dim, dtype="bfloat16",
              causal=bool(args.causal))
  inputs = make_inputs(case, 0)
  call_args = inputs[:3] if args.direction == "fwd" else inputs
  compiled = {}
  for impl in args.impls:
    if impl == "jax_flash":
      fwd = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=case.causal)
    else:
      fwd = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                                         implementation="cudnn")
    fn = fwd if args.direction == "fwd" else grad_fn(fwd)
    compiled[impl] = jax.jit(fn).lower(*call_args).compile()
  for fn in compiled.values():  # first calls (allocations, plans) outside the profile
    jax.block_until_ready(fn(*call_args))
  start, stop = cuda_profiler_range()
  for impl, fn in compiled.items():
    print(f"calling {impl}: D={args.head_dim} S={args.seqlen} causal={args.causal} "
          f"{args.direction}", file=sys.stderr, flush=True)
    start()
    jax.block_until_ready(fn(*call_args))
    stop()


if __name__ == "__main__":
  main()

"""What the JAX path adds to a forward, against the kernel alone.

The thirteenth session measured jax_flash's forward through JAX ~7% slower
than the same kernel timed alone (`tc_kernel_check bench1_fwd`), at S = 1k
where the bench trails cuDNN most (cpp/cuda/NOTES_sm90_fwd.md, "Where the ws
forward's time goes at S = 1k"). This times the bench's forward (the fa3
preset's shapes: B·S = 16k tokens, H·D = 2048, bf16) for jax_flash and cuDNN
with the bench's three rotating input sets and with one set, so that the
cost of new buffer addresses per call (XLA re-recording a command buffer)
shows apart from the kernel's. Run it again with command buffers off to see
their share, and beside the kernel alone:

  python tests/gpu/jax_path_overhead.py
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python tests/gpu/jax_path_overhead.py
  build/tc_kernel_check bench1_fwd 64 1024 0   (tests/gpu/build.sh)
"""

from __future__ import annotations

import argparse
import functools
import os

import jax

import jax_flash
from jax_flash.bench import Case, make_inputs, time_call


def forward(impl: str, causal: bool):
  if impl == "jax_flash":
    return jax.jit(functools.partial(jax_flash.dot_product_attention, is_causal=causal))
  return jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                   implementation="cudnn"))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--tokens", type=int, default=16384, help="B·S of every shape")
  parser.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn"])
  parser.add_argument("--repeats", type=int, default=30)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print("D     S  causal  impl        3 sets ms  1 set ms")
  for head_dim in args.head_dims:
    for seqlen in args.seqlens:
      for causal in (False, True):
        case = Case(batch=max(1, args.tokens // seqlen), heads=2048 // head_dim, seqlen=seqlen,
                    head_dim=head_dim, dtype="bfloat16", causal=causal)
        sets = [make_inputs(case, seed)[:3] for seed in range(3)]
        for impl in args.impls:
          fn = forward(impl, causal)
          rotating, _ = time_call(fn, sets, args.repeats, on_cpu=False)
          one, _ = time_call(fn, sets[:1], args.repeats, on_cpu=False)
          print(f"{head_dim:<3} {seqlen:>5}  {'yes' if causal else 'no':<6}  {impl:<10} "
                f"{1e3 * rotating:9.3f} {1e3 * one:9.3f}")


if __name__ == "__main__":
  main()

"""The one table of what jax_flash supports.

Python validation reads it directly; CMake runs this file as a script at
configure time to generate ``jax_flash/supported.h`` for the C++ handlers and
the list of CUDA kernel instantiations. Change a limit here and both sides
follow. This module must import nothing beyond the standard library: the
build runs it before jax is importable.
"""

from __future__ import annotations

import argparse
import pathlib

# Input dtypes every backend accepts. Accumulation is float32, float64 for
# float64 inputs.
DTYPES = ("float32", "float64", "bfloat16", "float16")

# Head dimension range every backend accepts.
MIN_HEAD_DIM = 1
MAX_HEAD_DIM = 256

# CUDA kernels are compiled per head-dim bucket; a head dim is padded up to the
# smallest bucket that holds it.
CUDA_HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)

# dtypes that use tensor cores on CUDA; the others run an exact (no TF32)
# kernel.
CUDA_TENSOR_CORE_DTYPES = ("bfloat16", "float16")


def head_dim_bucket(head_dim: int) -> int:
  """The CUDA bucket a head dim is padded up to."""
  for bucket in CUDA_HEAD_DIM_BUCKETS:
    if head_dim <= bucket:
      return bucket
  raise ValueError(f"head_dim {head_dim} exceeds {CUDA_HEAD_DIM_BUCKETS[-1]}")


def _header() -> str:
  buckets = ", ".join(str(b) for b in CUDA_HEAD_DIM_BUCKETS)
  return f"""// Generated from jax_flash/_supported.py by CMake; do not edit.
#pragma once
#include <cstdint>

namespace jax_flash {{
inline constexpr int64_t kMinHeadDim = {MIN_HEAD_DIM};
inline constexpr int64_t kMaxHeadDim = {MAX_HEAD_DIM};
inline constexpr int kCudaHeadDimBuckets[] = {{{buckets}}};
}}  // namespace jax_flash
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--header", type=pathlib.Path, required=True,
                      help="where to write supported.h")
  args = parser.parse_args()
  args.header.parent.mkdir(parents=True, exist_ok=True)
  text = _header()
  # Rewrite only on change so that rebuilds stay incremental.
  if not args.header.exists() or args.header.read_text() != text:
    args.header.write_text(text)


if __name__ == "__main__":
  main()

"""The one table of what jax_flash supports.

Python validation reads it directly; CMake runs this file as a script at
configure time to generate ``jax_flash/supported.h`` for the C++ handlers and
the CUDA kernel instantiations. Change a limit here and both sides
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

# Head-dim buckets with a Hopper (sm_90a, wgmma) forward; on Hopper the other
# buckets run the sm_80 tensor-core kernels (tile shapes:
# cpp/cuda/sm90/tile_size.h).
CUDA_SM90_FWD_BUCKETS = (64, 96, 128, 192, 256)
# Of those, the buckets whose forward is the warp-specialized pipeline
# (cpp/cuda/sm90/fwd_ws.cuh: TMA producer, ping-pong consumers, persistent
# grid); the others run sm90/fwd.cuh. D=64 ran on mma.sync before: the wgmma
# forward without warp specialization measured 269-281 TFLOP/s against
# 315-323 (H100, cpp/cuda/NOTES_sm90_fwd.md). D=96: tiles of two 64-column blocks,
# columns 96-127 zero-filled by TMA. D=192 and 256: 64-key blocks, 3-24%
# faster than sm90/fwd.cuh alone (H100, S 1k-16k; BENCHMARKS.md).
CUDA_SM90_FWD_WS_BUCKETS = (64, 96, 128, 192, 256)
# Buckets with a Hopper backward, both modes (all GEMMs on wgmma;
# deterministic=True: the dK/dV kernel without dQ, then a wgmma dQ kernel
# over query blocks). H100, kernel alone, bf16, S 4k-16k, fast mode: 219-302
# TFLOP/s at D=64 and 242-363 at D=128 against 210-229 and 217-232 for
# mma.sync (cpp/cuda/NOTES.md). Above 128 the warpgroups split the head dim
# (cpp/cuda/sm90/mainloop_bwd_wide.cuh).
CUDA_SM90_BWD_BUCKETS = (64, 96, 128, 192, 256)

# The Turing family (sm_75, e.g. T4): the mma.sync kernels with tiles for 64 KiB
# of shared memory, m16n8k8 and synchronous copies, compiled for compute_75 (so
# a Hopper GPU can run them too, JIT-compiled by the driver, for testing).
# float16 only: Turing has no bfloat16 tensor cores, so bfloat16 runs the exact
# kernels there.
CUDA_SM75_BUCKETS = CUDA_HEAD_DIM_BUCKETS
CUDA_SM75_DTYPES = ("float16",)


# Arch paths whose kernels take the per-element score terms (a dense mask,
# dropout): each bucket then has a second instantiation, its kTerms kernels,
# in files of their own, so that the plain kernels compile to the code they
# had (nvcc optimizes a kernel differently when a second one shares its
# file; cpp/cuda/NOTES.md).
CUDA_TERMS_ARCHS = (75, 80)


def head_dim_bucket(head_dim: int) -> int:
  """The CUDA bucket a head dim is padded up to."""
  for bucket in CUDA_HEAD_DIM_BUCKETS:
    if head_dim <= bucket:
      return bucket
  raise ValueError(f"head_dim {head_dim} exceeds {CUDA_HEAD_DIM_BUCKETS[-1]}")


# Exact (SIMT, IEEE) CUDA kernels, used for float32/float64 and whatever the
# tensor-core kernels do not cover: compiled per head-dim tier (a head dim is
# padded up to its tier in shared memory; the tier bounds register use), one
# instantiation file per (direction, dtype) holding every tier.
CUDA_EXACT_HEAD_DIM_TIERS = (32, 64, 128, 256)


def _x_macro(name: str, values) -> str:
  entries = " ".join(f"X({v})" for v in values)
  return f"#define {name}(X) {entries}"


def _header() -> str:
  buckets = ", ".join(str(b) for b in CUDA_HEAD_DIM_BUCKETS)
  macros = "\n".join([
      _x_macro("JAX_FLASH_FOR_EACH_BUCKET", CUDA_HEAD_DIM_BUCKETS),
      _x_macro("JAX_FLASH_FOR_EACH_SM90_FWD_BUCKET", CUDA_SM90_FWD_BUCKETS),
      _x_macro("JAX_FLASH_FOR_EACH_SM90_FWD_WS_BUCKET", CUDA_SM90_FWD_WS_BUCKETS),
      _x_macro("JAX_FLASH_FOR_EACH_SM90_BWD_BUCKET", CUDA_SM90_BWD_BUCKETS),
      _x_macro("JAX_FLASH_FOR_EACH_SM75_BUCKET", CUDA_SM75_BUCKETS),
      _x_macro("JAX_FLASH_FOR_EACH_EXACT_TIER", CUDA_EXACT_HEAD_DIM_TIERS),
  ])
  return f"""// Generated from jax_flash/_supported.py by CMake; do not edit.
#pragma once
#include <cstdint>

namespace jax_flash {{
inline constexpr int64_t kMinHeadDim = {MIN_HEAD_DIM};
inline constexpr int64_t kMaxHeadDim = {MAX_HEAD_DIM};
inline constexpr int kCudaHeadDimBuckets[] = {{{buckets}}};
// The tensor-core kernels' largest head dim: their largest bucket.
inline constexpr int64_t kCudaTensorCoreMaxHeadDim = {CUDA_HEAD_DIM_BUCKETS[-1]};
}}  // namespace jax_flash

// X-macros over the compiled CUDA configurations: X(head dim) per entry.
{macros}
"""


# CUDA kernel instantiations: one .cu file per (direction, arch path, score
# terms or not, dtype, bucket) for the tensor-core kernels and per (direction, dtype) for the exact
# ones, so that a 2-core CI machine compiles them in parallel and a change to
# one kernel rebuilds only its own files. Each file holds one instantiation
# macro of cuda/kernels.h with template arguments only.
_CUDA_TYPES = {"float32": ("f32", "float"), "float64": ("f64", "double"),
               "bfloat16": ("bf16", "__nv_bfloat16"), "float16": ("fp16", "__half")}
# direction -> (header that defines it, instantiation macro)
_TC_DIRECTIONS = {"fwd": ("cuda/fwd.cuh", "JAX_FLASH_INSTANTIATE_FWD"),
                  "bwd": ("cuda/bwd/run.cuh", "JAX_FLASH_INSTANTIATE_BWD"),
                  "jvp": ("cuda/sm80/jvp.cuh", "JAX_FLASH_INSTANTIATE_JVP")}
_EXACT_DIRECTIONS = {"fwd": ("cuda/simt/fwd.cuh", "JAX_FLASH_INSTANTIATE_EXACT_FWD"),
                     "bwd": ("cuda/simt/bwd.cuh", "JAX_FLASH_INSTANTIATE_EXACT_BWD"),
                     "jvp": ("cuda/simt/jvp.cuh", "JAX_FLASH_INSTANTIATE_EXACT_JVP")}
# (direction, arch path) -> the buckets compiled for it. Arch path 80
# (mma.sync) runs on every sm_80+ GPU; 90 (wgmma, TMA) on sm_90a; 75 (the
# Turing family) is compiled for compute_75 alone (cmake/cuda_sources.cmake).
# The forward-mode derivative (jvp) runs on mma.sync: arch path 80 on every
# sm_80+ GPU, 75 on the Turing family.
_TC_BUCKETS = {("fwd", 80): CUDA_HEAD_DIM_BUCKETS, ("bwd", 80): CUDA_HEAD_DIM_BUCKETS,
               ("jvp", 80): CUDA_HEAD_DIM_BUCKETS,
               ("fwd", 90): CUDA_SM90_FWD_BUCKETS, ("bwd", 90): CUDA_SM90_BWD_BUCKETS,
               ("fwd", 75): CUDA_SM75_BUCKETS, ("bwd", 75): CUDA_SM75_BUCKETS,
               ("jvp", 75): CUDA_SM75_BUCKETS}
_TC_DTYPES = {75: CUDA_SM75_DTYPES, 80: CUDA_TENSOR_CORE_DTYPES, 90: CUDA_TENSOR_CORE_DTYPES}
# Directions whose instantiations take the kTerms argument (CUDA_TERMS_ARCHS).
_TERMS_DIRECTIONS = ("fwd", "bwd", "jvp")


def _instantiation(header: str, macro: str, args: str) -> str:
  return (f"// Generated from jax_flash/_supported.py; do not edit.\n"
          f"#include \"{header}\"\n\n{macro}({args})\n")


def cuda_sources() -> dict[str, str]:
  """File name -> text of every CUDA kernel instantiation."""
  files = {}
  for (direction, arch), buckets in _TC_BUCKETS.items():
    header, macro = _TC_DIRECTIONS[direction]
    has_terms = direction in _TERMS_DIRECTIONS
    for terms in (False, True) if has_terms and arch in CUDA_TERMS_ARCHS else (False,):
      variant = "_terms" if terms else ""
      for dtype in _TC_DTYPES[arch]:
        short, cuda_type = _CUDA_TYPES[dtype]
        for bucket in buckets:
          args = f"{arch}, {cuda_type}, {bucket}" + (f", {str(terms).lower()}" if has_terms else "")
          files[f"{direction}_sm{arch}{variant}_{short}_hd{bucket}.cu"] = _instantiation(
              header, macro, args)
  for direction, (header, macro) in _EXACT_DIRECTIONS.items():
    for dtype in DTYPES:
      short, cuda_type = _CUDA_TYPES[dtype]
      files[f"{direction}_exact_{short}.cu"] = _instantiation(header, macro, cuda_type)
  return files


def _write_if_changed(path: pathlib.Path, text: str) -> None:
  # Rewrite only on change so that rebuilds stay incremental.
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--header", type=pathlib.Path, required=True,
                      help="where to write supported.h")
  parser.add_argument("--cuda-sources", type=pathlib.Path, default=None,
                      help="folder for the CUDA kernel instantiation .cu files; "
                      "their paths are printed, one per line")
  args = parser.parse_args()
  _write_if_changed(args.header, _header())
  if args.cuda_sources is not None:
    for name, text in cuda_sources().items():
      _write_if_changed(args.cuda_sources / name, text)
      print(args.cuda_sources / name)


if __name__ == "__main__":
  main()

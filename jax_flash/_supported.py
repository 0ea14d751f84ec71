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

# Head-dim buckets with a Hopper (sm_90a, wgmma) forward; on Hopper the other
# buckets run the sm_80 tensor-core kernels. D=64 stays
# on those: its wgmma forward measured 269-281 TFLOP/s against 315-323 for
# mma.sync on an H100 (cpp/cuda/tc/NOTES.md).
CUDA_SM90_FWD_BUCKETS = (128,)
# Buckets with a Hopper backward (all five GEMMs on wgmma; the fast mode only,
# deterministic=True keeps the sm_80 kernels). H100, kernel alone, bf16,
# S 4k-16k: 219-302 TFLOP/s at D=64 and 242-363 at D=128 against 210-229 and
# 217-232 for mma.sync (cpp/cuda/tc/NOTES.md).
CUDA_SM90_BWD_BUCKETS = (64, 128)


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


# Tensor-core kernel instantiations: one .cu file per (direction, dtype,
# bucket), so a 2-core CI machine compiles them in parallel and a change to
# one kernel rebuilds only its own files. C++ element type per dtype name.
_TC_CUDA_TYPES = {"bfloat16": ("bf16", "__nv_bfloat16"), "float16": ("fp16", "__half")}
_TC_DIRECTIONS = {
    "fwd": ("tc/flash_fwd.cuh",
            "template cudaError_t RunFwd<{t}, {d}>(const FwdParams&, cudaStream_t);"),
    "bwd": ("tc/flash_bwd.cuh",
            "template cudaError_t RunBwd<{t}, {d}>(const BwdParams&, void*, bool, cudaStream_t);\n"
            "template size_t BwdWorkspaceBytes<{t}, {d}>(const AttentionShape&, bool);"),
    "fwd_sm90": ("tc/flash_fwd_sm90.cuh",
                 "template cudaError_t RunFwdSm90<{t}, {d}>(const FwdParams&, cudaStream_t);"),
    "bwd_sm90": ("tc/flash_bwd_sm90.cuh",
                 "template cudaError_t RunBwd<{t}, {d}, true>(const BwdParams&, void*, bool, "
                 "cudaStream_t);"),
}
# Which buckets each direction is compiled for.
_TC_BUCKETS = {"fwd": CUDA_HEAD_DIM_BUCKETS, "bwd": CUDA_HEAD_DIM_BUCKETS,
               "fwd_sm90": CUDA_SM90_FWD_BUCKETS, "bwd_sm90": CUDA_SM90_BWD_BUCKETS}


def tc_sources() -> dict[str, str]:
  """File name -> text of every tensor-core instantiation, plus the bucket list."""
  files = {}
  for direction, (header, template) in _TC_DIRECTIONS.items():
    for dtype in CUDA_TENSOR_CORE_DTYPES:
      short, cuda_type = _TC_CUDA_TYPES[dtype]
      for bucket in _TC_BUCKETS[direction]:
        body = template.format(t=cuda_type, d=bucket)
        files[f"flash_{direction}_{short}_hd{bucket}.cu"] = (
            f"// Generated from jax_flash/_supported.py; do not edit.\n"
            f"#include \"{header}\"\n\n"
            f"namespace jax_flash::cuda::tc {{\n{body}\n}}  // namespace jax_flash::cuda::tc\n")
  entries = " ".join(f"X({b})" for b in CUDA_HEAD_DIM_BUCKETS)
  sm90_entries = " ".join(f"X({b})" for b in CUDA_SM90_FWD_BUCKETS)
  sm90_bwd_entries = " ".join(f"X({b})" for b in CUDA_SM90_BWD_BUCKETS)
  files["tc_buckets.inc"] = (
      "// Generated from jax_flash/_supported.py; do not edit.\n"
      f"#define JAX_FLASH_TC_FOR_EACH_BUCKET(X) {entries}\n"
      f"#define JAX_FLASH_TC_FOR_EACH_SM90_FWD_BUCKET(X) {sm90_entries}\n"
      f"#define JAX_FLASH_TC_FOR_EACH_SM90_BWD_BUCKET(X) {sm90_bwd_entries}\n")
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
  parser.add_argument("--tc-sources", type=pathlib.Path, default=None,
                      help="folder for the tensor-core instantiation .cu files; "
                      "their paths are printed, one per line")
  args = parser.parse_args()
  _write_if_changed(args.header, _header())
  if args.tc_sources is not None:
    for name, text in tc_sources().items():
      _write_if_changed(args.tc_sources / name, text)
      if name.endswith(".cu"):
        print(args.tc_sources / name)


if __name__ == "__main__":
  main()

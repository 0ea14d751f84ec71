"""The fast backward's dQ accumulator layout, checked on the host.

DqAccumLayout (cpp/cuda/bwd/workspace.h) is __host__ __device__ code: where
the Hopper kernels stage and reduce dQ, where the preprocess zeroes it and
the conversion reads it. tests/host/dq_layout_check.cu runs
tests/gpu/dq_layout_check.h's checks (a bijection onto the allocation, the
staged fragments reaching their elements, the zeroing reaching exactly the
entries read, in whole sectors) for every head-dim bucket on the CPU. Needs
nvcc (the CUDA headers), not a GPU.
"""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_dq_accumulator_layout(tmp_path):
  # The buckets come from the generated header, as in the build.
  subprocess.run([sys.executable, str(ROOT / "jax_flash" / "_supported.py"), "--header",
                  str(tmp_path / "jax_flash" / "supported.h")], check=True, capture_output=True)
  exe = tmp_path / "dq_layout_check"
  subprocess.run(
      ["nvcc", "-std=c++17", "-O2", "-I", str(ROOT / "cpp" / "include"), "-I", str(ROOT / "cpp"),
       "-I", str(tmp_path), "-I", str(ROOT / "tests" / "gpu"), "-o", str(exe),
       str(ROOT / "tests" / "host" / "dq_layout_check.cu")],
      check=True, capture_output=True, text=True)
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.startswith("PASS dQ accumulator layout"), run.stdout

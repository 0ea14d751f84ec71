"""The persistent schedulers' tile-index decode, checked on the host.

FastDivisor (cpp/include/jax_flash/math.h) divides by a multiply-high and a
shift; SectionedOrder (cpp/cuda/common/tile_scheduler.cuh) walks the tile
order with it, and the forward's and the backward's schedulers decode their
tiles from it. All of it is __host__ __device__ code, so tests/host/
fast_divisor_check.cu runs it on the CPU against plain divisions. Needs
nvcc (the CUDA headers), not a GPU.
"""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
def test_fast_divisor_and_sectioned_order_match_plain_division(tmp_path):
  exe = tmp_path / "fast_divisor_check"
  subprocess.run(
      ["nvcc", "-std=c++17", "-O2", "-I", str(ROOT / "cpp" / "include"), "-I",
       str(ROOT / "cpp"), "-o", str(exe), str(ROOT / "tests" / "host" / "fast_divisor_check.cu")],
      check=True, capture_output=True, text=True)
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.strip() == "ok"

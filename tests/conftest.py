"""Shared test setup: float64 on, the backends to run on, the FlashAttention rule."""

from __future__ import annotations

import importlib.util
import os
import pathlib

# Four CPU devices for the many-device tests (test_sharding.py, test_ring.py);
# XLA reads this once, when jax starts, so it is set before jax is imported.
# Everything else runs on the first device as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

# On a GPU, XLA autotunes every new matrix product it compiles; the suite
# compiles hundreds of small programs, and autotuning made its GPU half about
# 3x slower (measured on an H100: 256 tests in 81 s without, over 230 s with).
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)  # float64 inputs and the float64 reference
# The references (tests/reference.py, jax.nn's xla path, Flax's attention) must
# compute float32 matrix products in float32: on GPUs XLA's default is TF32.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def gpu_tool():
  """Loads a script of tests/gpu (a folder of scripts, not a package) as a
  module: gpu_tool("ncu_counters")."""
  def load(name: str):
    path = pathlib.Path(__file__).parent / "gpu" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  return load


def available_backends() -> list[str]:
  backends = ["cpu"]
  try:
    if jax.devices("gpu"):
      backends.append("gpu")
  except RuntimeError:
    pass
  return backends


@pytest.fixture(params=available_backends())
def backend(request):
  """Runs the test on each available backend (CPU always, the GPU if there is one)."""
  with jax.default_device(jax.devices(request.param)[0]):
    yield request.param


# Tiny absolute slack, relative to the largest reference value, on top of the
# FlashAttention rule (see assert_flash_close). For float16 it is half an ulp
# of the largest value, one rounding of the result: the backward computes
# D = rowsum(dO * O) from the float16 output (as FlashAttention does), which
# the plain implementation's autodiff never rounds, and without this slack
# that alone tipped one case in a few hundred seeds over the 2x line. The
# bfloat16 slack stays well under one rounding, so a 1% scale error fails.
RELATIVE_ATOL = {
    np.dtype("float64"): 1e-12,
    np.dtype("float32"): 1e-6,
    np.dtype("float16"): 2.0**-11,
    np.dtype(jax.numpy.bfloat16): 1e-3,
}


def assert_flash_close(name: str, got, reference, plain, dtype) -> None:
  """The FlashAttention rule: |got - ref| <= 2 |plain - ref| + tiny atol.

  `reference` is the float64 dense result; `plain` is a dense implementation
  in the kernel's own dtype. Infinities (lse of rows that see nothing) must
  match exactly; NaN never passes.
  """
  got = np.asarray(got, np.float64)
  reference = np.asarray(reference, np.float64)
  plain = np.asarray(plain, np.float64)
  assert got.shape == reference.shape, f"{name}: shape {got.shape} != {reference.shape}"
  assert not np.isnan(got).any(), f"{name}: NaN in result"
  infinite = ~np.isfinite(reference)
  np.testing.assert_array_equal(got[infinite], reference[infinite], err_msg=f"{name}: infinities")
  finite = ~infinite
  if not finite.any():
    return
  err = np.max(np.abs(got[finite] - reference[finite]))
  plain_err = np.max(np.abs(plain[finite] - reference[finite]))
  atol = RELATIVE_ATOL[np.dtype(dtype)] * max(1.0, np.max(np.abs(reference[finite])))
  assert err <= 2 * plain_err + atol, (
      f"{name}: max error {err:.3g} > 2 x plain {np.dtype(dtype).name} error {plain_err:.3g} "
      f"+ atol {atol:.3g}")

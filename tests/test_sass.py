"""Checks on the compiled Hopper kernels' SASS (needs cuobjdump, from the CUDA toolkit).

"gpu" in the test's name puts it in the GPU suite (`pytest -k gpu`): it reads
the installed extension, so it runs wherever the toolkit is, with or without
a GPU.
"""
import shutil

import pytest

import jax_flash
from jax_flash import _jax_flash


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="needs cuobjdump (CUDA toolkit)")
def test_gpu_kernels_release_no_stage_with_shared_loads_in_flight(gpu_tool):
  """An mbarrier arrive that releases a TMA-filled stage while ld.shared from
  it are in flight lets the next TMA write race those loads (bias_tile.cuh)."""
  if "90a" not in jax_flash.build_info()["cuda_archs"]:
    pytest.skip("built without sm_90a kernels")
  checker = gpu_tool("sass_release_check")
  reports = checker.check_object(_jax_flash.__file__, "cuobjdump", arch="sm_90a")
  assert not reports, "\n".join(checker.format_report(*r) for r in reports[:5])

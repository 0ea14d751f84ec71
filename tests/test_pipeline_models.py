"""The Hopper kernels' synchronisation protocols, modelled on the CPU.

tests/gpu/ws_pipeline_model.py (the warp-specialized forward: its rings, the
tile handoff, ping-pong, and the out staging over V's stage 0 that a 128 x 176
tile needs, with the mutations it must reject) and
tests/gpu/bwd_ws_pipeline_model.py (the warp-specialized backward) run random
interleavings; a short form of each runs here, the long one by hand after a
change to a protocol.
"""
import pathlib
import subprocess
import sys

import pytest

GPU_TESTS = pathlib.Path(__file__).resolve().parent / "gpu"


@pytest.mark.parametrize("model, tile_lists", [("ws_pipeline_model.py", 200),
                                               ("bwd_ws_pipeline_model.py", 300)])
def test_pipeline_model(model, tile_lists):
  run = subprocess.run([sys.executable, str(GPU_TESTS / model), str(tile_lists)],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.startswith("ok:"), run.stdout

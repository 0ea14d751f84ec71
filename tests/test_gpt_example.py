"""The GPT example trains: a few tiny steps on the CPU and the loss falls."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from jax_flash.examples import gpt  # noqa: E402


@pytest.mark.parametrize("attention", ["jax_flash", "flax"])
def test_tiny_gpt_loss_falls(attention):
  start = time.perf_counter()
  with jax.default_device(jax.devices("cpu")[0]):
    result = gpt.main(["--steps", "25", "--layers", "1", "--log-every", "100",
                       "--attention", attention])
  losses = result["losses"]
  assert len(losses) == 25 and all(np.isfinite(losses))
  # Byte-level cross entropy starts near ln(256) = 5.5; a working model learns
  # the byte frequencies (about 3) within a few dozen steps.
  assert losses[0] > 5.0
  assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
  assert result["tokens_per_s"] > 0 and result["peak_bytes"] > 0
  assert time.perf_counter() - start < 30


def test_same_loss_with_either_attention():
  # Same seed, same data, same parameters: the two attentions compute the
  # same function, so the first losses agree to float32 rounding.
  kwargs = ["--steps", "3", "--layers", "1", "--log-every", "100"]
  with jax.default_device(jax.devices("cpu")[0]):
    flash = gpt.main(kwargs + ["--attention", "jax_flash"])["losses"]
    flax = gpt.main(kwargs + ["--attention", "flax"])["losses"]
  np.testing.assert_allclose(flash, flax, rtol=1e-4)


def test_d_model_must_divide_into_heads():
  with pytest.raises(SystemExit, match="multiple of --heads"):
    gpt.main(["--d-model", "30", "--heads", "4"])

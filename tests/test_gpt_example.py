"""The GPT example trains: a few tiny steps on the CPU and the loss falls."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from jax_flash.examples import gpt  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


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


# -- --attention cudnn -----------------------------------------------------------


@pytest.mark.skipif(ON_GPU, reason="checks the refusal where there is no GPU")
def test_cudnn_is_refused_at_once_without_a_gpu(capsys):
  start = time.perf_counter()
  with pytest.raises(SystemExit, match=r"^--attention cudnn cannot run here: jax\.nn\."
                     r"dot_product_attention\(implementation='cudnn'\) needs an NVIDIA GPU"):
    gpt.main(["--attention", "cudnn", "--dtype", "bfloat16"])
  assert "GPT:" not in capsys.readouterr().out  # nothing was built or trained
  assert time.perf_counter() - start < 5


def test_cudnn_refuses_float32_and_dropout_with_the_fix():
  with pytest.raises(SystemExit, match=r"bfloat16 or float16, not float32 \(--dtype bfloat16\)"):
    gpt.main(["--attention", "cudnn"])
  with pytest.raises(SystemExit, match="has no dropout.*use --dropout 0, or --attention jax_flash"):
    gpt.main(["--attention", "cudnn", "--dtype", "bfloat16", "--dropout", "0.1"])


def test_cudnn_attention_fn_refuses_dropout_that_flax_passes():
  # Flax passes only the arguments in the attention_fn's signature: dropout
  # must reach it, to be refused rather than silently left out.
  import flax.linen as nn
  layer = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                          attention_fn=gpt.cudnn_attention_fn)
  x = jnp.ones((1, 8, 16), jnp.bfloat16)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="cudnn attention: .* has no dropout"):
    layer.init(dict(params=key, dropout=key), x, deterministic=False)


def test_compare_runs_what_can_run_and_says_what_it_skipped(capsys):
  results = gpt.main(["--compare", "--steps", "2", "--layers", "1", "--seq-len", "16",
                      "--batch", "2", "--log-every", "100"])
  by_attention = {r["config"]["attention"]: r for r in results}
  assert list(by_attention) == list(gpt.ATTENTIONS)
  for attention in ("jax_flash", "flax"):
    r = by_attention[attention]
    assert len(r["losses"]) == 2 and r["step_s"] > 0, r
  skipped = by_attention["cudnn"]["skipped"]  # the tiny preset is float32
  assert "bfloat16 or float16, not float32" in skipped
  assert ("needs an NVIDIA GPU" in skipped) == (not ON_GPU)
  table = capsys.readouterr().out
  assert re.search(r"^jax_flash +[0-9.]+ ", table, re.M) and re.search(r"^flax +[0-9.]+ ", table,
                                                                       re.M)
  assert re.search(r"^cudnn +skipped: ", table, re.M)


def test_compare_rounds_rotate_the_order_and_report_the_median(monkeypatch, capsys):
  order = []
  step_ms = {"jax_flash": [30.0, 10.0, 20.0], "flax": [40.0, 60.0, 50.0]}

  def fake_child(argv, attention):
    order.append(attention)
    if attention == "cudnn":
      return dict(config=dict(attention=attention), skipped="no GPU here")
    step_s = step_ms[attention].pop(0) / 1e3
    return dict(config=dict(attention=attention), step_s=step_s, tokens_per_s=1.0 / step_s,
                peak_bytes=1 << 20, static_bytes=1 << 20, losses=[1.0])

  monkeypatch.setattr(gpt, "_run_child", fake_child)
  results = gpt.main(["--compare", "--rounds", "3", "--steps", "2"])
  # cuDNN's reason is the same every round: asked once.
  assert order == ["jax_flash", "flax", "cudnn", "flax", "jax_flash", "jax_flash", "flax"]
  by_attention = {r["config"]["attention"]: r for r in results}
  assert by_attention["jax_flash"]["step_s"] == pytest.approx(0.020)
  assert by_attention["flax"]["step_s"] == pytest.approx(0.050)
  table = capsys.readouterr().out
  assert re.search(r"^jax_flash +20\.0 +10\.0-30\.0 ", table, re.M), table
  assert re.search(r"^flax +50\.0 +40\.0-60\.0 .*speed 1\.00x", table, re.M), table
  assert re.search(r"^cudnn +skipped: no GPU here", table, re.M), table


def test_no_abbreviated_options():
  """--comp once passed for --compare and survived its removal from the child
  processes' command line, each child comparing again, without end."""
  with pytest.raises(SystemExit):
    gpt.parse_args(["--comp"])


def test_rounds_need_compare():
  with pytest.raises(SystemExit, match="--rounds 2 needs --compare"):
    gpt.main(["--rounds", "2"])
  with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
    gpt.main(["--compare", "--rounds", "0"])


@pytest.mark.skipif(not ON_GPU, reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_attention_fn_is_causal_attention():
  keys = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(key, (2, 128, 4, 64), jnp.bfloat16) for key in keys)
  out = gpt.cudnn_attention_fn(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  expected = jax.nn.dot_product_attention(*f32, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=3e-2)

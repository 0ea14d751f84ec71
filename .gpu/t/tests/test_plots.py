"""jax_flash.plots draws bench rows (synthetic here) without a display."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("matplotlib")

from jax_flash import plots  # noqa: E402


def _rows():
  rows = []
  for causal in (False, True):
    for seqlen in (512, 1024, 2048):
      for impl, speed in (("jax_flash", 2.0), ("xla", 1.0)):
        rows.append(dict(batch=1, heads=2, seqlen=seqlen, head_dim=64, dtype="float32",
                         causal=causal, impl=impl, status="ok",
                         fwd_tflops=speed * seqlen / 1024, fwdbwd_tflops=speed / 2,
                         memory=seqlen * (1 if impl == "jax_flash" else seqlen) * 1024,
                         # as --memory measures on a GPU; absent (None) on a CPU
                         runtime_peak=seqlen * 1000 if causal else None))
  # A row that failed (no numbers) and one not run (too big: no speed, no peak).
  rows.append(dict(batch=1, heads=2, seqlen=4096, head_dim=64, dtype="float32", causal=False,
                   impl="cudnn", status="n/a (no GPU)"))
  rows.append(dict(batch=1, heads=2, seqlen=4096, head_dim=64, dtype="float32", causal=True,
                   impl="xla", status="not run: needs ~9 GiB", memory=9 << 30))
  return rows


def _feature_rows():
  """--features rows: the same shapes as _rows's, a group of their own."""
  rows = []
  for seqlen in (512, 1024):
    rows.append(dict(batch=1, heads=2, seqlen=seqlen, head_dim=64, dtype="float32", causal=True,
                     impl="jax_flash", feature="dropout", status="ok", fwd_tflops=1.5,
                     fwdbwd_tflops=0.8, memory=seqlen * 1024))
    rows.append(dict(batch=1, heads=2, seqlen=seqlen, head_dim=64, dtype="float32", causal=True,
                     impl="xla", feature="dropout", status="not run: no dropout in jax.nn"))
  return rows


def test_plot_writes_a_png(tmp_path):
  path = tmp_path / "bench.png"
  fig = plots.plot(_rows(), str(path))
  assert path.stat().st_size > 10_000
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # One row of three panels (fwd, fwd+bwd, memory) per (head dim, causal), each with data.
  assert len(fig.axes) == 2 * 3
  assert not [ax.get_title() for ax in fig.axes if any(t.get_text() == "no data"
                                                       for t in ax.texts)]


def test_feature_rows_get_their_own_panels(tmp_path):
  rows = [dict(r, feature="plain") for r in _rows()] + _feature_rows()
  fig = plots.plot(rows, str(tmp_path / "bench.png"))
  titles = [ax.get_title() for ax in fig.axes]
  assert len(fig.axes) == 3 * 3  # plain: not causal, causal; dropout: causal
  assert titles[:3] == ["forward: head dim 64, not causal, float32",
                        "forward + backward: head dim 64, not causal, float32",
                        "memory of fwd+bwd: head dim 64, not causal, float32"]
  assert titles[6] == "forward: dropout, head dim 64, causal, float32"
  # The dropout group's bars are its own rows' numbers, not the plain rows'.
  heights = sorted(round(p.get_height(), 6) for p in fig.axes[6].patches if p.get_height())
  assert heights == [1.5, 1.5]


def test_cli_reads_the_bench_json(tmp_path):
  data = tmp_path / "bench.json"
  data.write_text(json.dumps(dict(meta=dict(device="test", platform="cpu"), rows=_rows())))
  out = tmp_path / "bench.svg"
  plots.main([str(data), str(out)])
  assert out.read_text().lstrip().startswith("<?xml")


def test_peak_memory_prefers_the_measured_peak():
  assert plots.peak_memory(dict(runtime_peak=5, memory=2)) == 5
  assert plots.peak_memory(dict(runtime_peak=None, memory=2)) == 2
  assert plots.peak_memory(dict(status="n/a")) is None


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match=r'pip install "\.\[plots\]"'):
    plots.plot(_rows(), str(tmp_path / "x.png"))


def test_rows_that_are_not_bench_rows_are_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="lacks"):
    plots.plot([dict(impl="x")], str(tmp_path / "x.png"))
  with pytest.raises(ValueError, match="no rows"):
    plots.plot([], str(tmp_path / "x.png"))

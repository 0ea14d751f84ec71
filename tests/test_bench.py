"""python -m jax_flash.bench runs end to end on tiny shapes and reports sane rows."""

import json
import sys

import jax
import pytest

from jax_flash import bench

PLATFORM = jax.default_backend()
on_cpu = pytest.mark.skipif(PLATFORM != "cpu", reason="checks what a CPU run shows")


def test_quick_preset_table_and_json(tmp_path, capsys):
  path = tmp_path / "rows.json"
  rows = bench.main(["--preset", "quick", "--seqlens", "64", "--head-dims", "16",
                     "--repeats", "3", "--json", str(path)])
  out = capsys.readouterr()
  table, progress = out.out, out.err

  data = json.loads(path.read_text())
  assert data["rows"] == rows
  assert data["meta"]["jax"] and data["meta"]["date"] and data["meta"]["device"]
  by_key = {(r["impl"], r["causal"]): r for r in rows}
  impls = [i for i in bench.IMPLS if bench.why_unavailable(i, PLATFORM) is None]
  assert set(by_key) == {(i, c) for i in impls for c in (False, True)}
  for causal in (False, True):
    for impl in ("jax_flash", "xla"):
      r = by_key[(impl, causal)]
      assert r["status"] == "ok", r
      assert (r["batch"], r["heads"], r["seqlen"], r["head_dim"]) == (1, 2, 64, 16)
      assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwd_tflops"] > 0
      assert r["fwdbwd_tflops"] > 0
      assert 0 <= r["max_err"] < 1e-5 and r["rel_err"] < 1e-5  # float32 vs float64
      assert r["memory"] > r["memory_beyond_inputs"] > 0
      assert all(r[k] is None for k in bench.MEMORY_FIELDS)  # no --memory
    assert by_key[("xla", causal)]["fwd_vs_xla"] == pytest.approx(1.0)
    assert by_key[("jax_flash", causal)]["fwd_vs_xla"] > 0

  assert "jax_flash" in table and "xla" in table and "fwd TF/s" in table
  assert "B=1 H=2 S=64 D=16 float32 causal=yes" in table
  assert "n/a" not in table and "Targets" not in table  # no target defined for this shape
  # One line as each measurement starts, naming the shape, the impl and what it measures.
  for causal in ("no", "yes"):
    for impl in ("jax_flash", "xla"):
      for what in ("forward: compile", "forward+backward: compile"):
        assert f"… B=1 H=2 S=64 D=16 float32 causal={causal} | {impl} | {what}" in progress


@on_cpu
def test_an_impl_that_cannot_run_here_is_named_once_and_skipped(capsys):
  rows = bench.main(["--preset", "quick", "--seqlens", "32", "--head-dims", "8", "--causal",
                     "both", "--impls", "xla,cudnn", "--repeats", "3"])
  table = capsys.readouterr().out
  assert {r["impl"] for r in rows} == {"xla"} and len(rows) == 2
  cudnn_lines = [line for line in table.splitlines() if "cudnn" in line]
  assert len(cudnn_lines) == 1 and cudnn_lines[0].startswith("cudnn: not run: "), cudnn_lines
  assert "NVIDIA GPU" in cudnn_lines[0]
  with pytest.raises(SystemExit, match="none of the requested"):
    bench.main(["--preset", "quick", "--impls", "cudnn"])


def test_a_plan_larger_than_the_free_memory_is_not_run(monkeypatch, capsys):
  monkeypatch.setattr(bench, "free_memory_bytes", lambda dev: 1)
  rows = bench.main(["--preset", "quick", "--seqlens", "32", "--head-dims", "8", "--causal",
                     "no", "--impls", "jax_flash"])
  assert rows[0]["status"].startswith("not run: needs ~") and rows[0]["fwd_ms"] is None
  assert "not run: needs" in capsys.readouterr().out


def test_memory_and_timing_in_one_run_both_causal(tmp_path, capsys):
  rows = bench.main(["--preset", "quick", "--seqlens", "48", "--head-dims", "8", "--causal",
                     "both", "--impls", "jax_flash", "--repeats", "3", "--memory"])
  out = capsys.readouterr()
  assert [r["causal"] for r in rows] == [False, True]
  for r in rows:
    assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0, r
    assert r["memory_status"] == "ok", r
    assert r["runtime_beyond_inputs"] >= 0 and r["runtime_source"]
    if PLATFORM != "cpu":
      assert r["runtime_peak"] > 0
  assert "Memory:" in out.out and "Timing:" in out.out
  for causal in ("no", "yes"):
    label = f"B=1 H=2 S=48 D=8 float32 causal={causal}"
    assert f"{label}  jax_flash  inputs" in out.out  # the memory table
    assert f"\n{label}   (fwd" in out.out  # the timing block
    assert f"… {label} | jax_flash | peak memory" in out.err


def test_memory_defaults_to_the_memory_targets_shape_and_keeps_both_causal():
  cases = bench.build_cases(bench.parse_args(["--memory"]), "cpu")
  assert [(c.seqlen, c.head_dim, c.batch, c.heads, c.dtype, c.causal) for c in cases] == [
      (16384, 64, 1, 8, "float32", False), (16384, 64, 1, 8, "float32", True)]
  cases = bench.build_cases(bench.parse_args(["--memory"]), "gpu")
  assert {(c.seqlen, c.head_dim, c.dtype) for c in cases} == {(32768, 128, "bfloat16")}
  assert len(cases) == 2
  # Options replace the preset's values, with or without --memory.
  args = bench.parse_args(["--memory", "--seqlens", "1k", "4k", "--head-dims", "64", "128",
                           "--dtype", "bfloat16"])
  cases = bench.build_cases(args, "cpu")
  assert len(cases) == 8 and {c.dtype for c in cases} == {"bfloat16"}


def _row(impl, causal, seqlen=1024, head_dim=64, dtype="float32", batch=1, heads=8, **kw):
  row = dict(batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim, dtype=dtype,
             causal=causal, impl=impl, fwd_vs_xla=None, fwdbwd_vs_xla=None)
  row.update(dict.fromkeys(bench.MEMORY_FIELDS), **kw)
  return row


def test_target_verdicts_only_where_a_target_is_defined():
  rows = [_row("jax_flash", False, fwd_vs_xla=2.0, fwdbwd_vs_xla=1.2),
          _row("jax_flash", True, seqlen=4096, fwd_vs_xla=3.0, fwdbwd_vs_xla=2.6),
          _row("jax_flash", False, seqlen=1000, fwd_vs_xla=9.0, fwdbwd_vs_xla=9.0),
          _row("jax_flash", False, head_dim=128, fwd_vs_xla=9.0, fwdbwd_vs_xla=9.0),
          _row("xla", False, fwd_vs_xla=1.0, fwdbwd_vs_xla=1.0),
          _row("jax_flash", True, seqlen=16384, runtime_beyond_inputs=161 << 20)]
  text = bench.format_targets(rows, "cpu")
  lines = text.strip().splitlines()[1:]
  assert lines == [
      "  B=1 H=8 S=1024 D=64 float32 causal=no: fwd 2.00× xla ok, fwd+bwd 1.20× xla MISS "
      "(target ≥ 1.5× xla)",
      "  B=1 H=8 S=4096 D=64 float32 causal=yes: fwd 3.00× xla ok, fwd+bwd 2.60× xla ok "
      "(target ≥ 2.5× xla)",
      "  B=1 H=8 S=16384 D=64 float32 causal=yes: fwd+bwd 161 MiB beyond the inputs ok "
      "(target ≤ 1 GiB)"]
  # No speed target on a GPU; its memory target is the peak against the ideal.
  gpu = _row("jax_flash", False, seqlen=32768, head_dim=128, heads=16, dtype="bfloat16",
             runtime_peak=int(1.1 * 8 * 32768 * 16 * 128 * 2), runtime_source="device peak")
  assert bench.format_targets(rows[:2] + [gpu], "gpu").strip().splitlines()[1:] == [
      "  B=1 H=16 S=32768 D=128 bfloat16 causal=no: fwd+bwd peak 1.10× ideal ok "
      "(target ≤ 1.2× ideal)"]
  assert bench.format_targets(rows[2:5], "cpu") == ""


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--preset", "quick", "--plot", str(tmp_path / "b.png")])
  assert exit_info.value.code == 2
  out = capsys.readouterr()
  assert 'pip install ".[plots]"' in out.err and "pip install matplotlib" in out.err
  assert "…" not in out.err and out.out == ""  # nothing was measured


def test_every_option_has_help():
  actions = [a for a in bench.make_parser()._actions if a.option_strings]
  assert len(actions) > 10
  for action in actions:
    assert action.help, f"{action.option_strings} has no help text"


def test_flop_convention():
  case = bench.Case(batch=2, heads=3, seqlen=128, head_dim=64, dtype="bfloat16", causal=False)
  assert case.fwd_flops == 4 * 2 * 3 * 128 * 128 * 64
  causal = bench.Case(2, 3, 128, 64, "bfloat16", True)
  assert causal.fwd_flops == case.fwd_flops / 2


def test_fa3_preset_shapes():
  args = bench.parse_args(["--preset", "fa3", "--causal", "no"])
  cases = bench.build_cases(args, "gpu")
  assert len(cases) == 18
  for c in cases:
    assert c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048
    assert c.dtype == "bfloat16" and not c.causal


def test_reference_matches_jax_nn():
  import numpy as np
  case = bench.Case(1, 2, 33, 8, "float32", True)
  q, k, v, _ = bench.make_inputs(case, seed=1)
  ref = bench.reference_fwd(q, k, v, causal=True)
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)

"""python -m jax_flash.bench runs end to end on tiny shapes and reports sane rows."""

import json
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import bench, bench_features, bench_report

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
  impls = [i for i in bench.IMPLS if bench.why_unavailable(i, PLATFORM, "float32") is None]
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


def test_cudnn_is_unavailable_for_dtypes_it_does_not_take():
  """The quick preset is float32: on a GPU, cuDNN is left out rather than a row of n/a."""
  why = bench.why_unavailable("cudnn", "gpu", "float32")
  assert why and "float32" in why and "--dtype" in why
  assert bench.why_unavailable("cudnn", "gpu", "bfloat16") is None
  assert bench.why_unavailable("jax_flash", "cpu", "float64") is None


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
  text = bench_report.format_targets(rows, "cpu")
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
  assert bench_report.format_targets(rows[:2] + [gpu], "gpu").strip().splitlines()[1:] == [
      "  B=1 H=16 S=32768 D=128 bfloat16 causal=no: fwd+bwd peak 1.10× ideal ok "
      "(target ≤ 1.2× ideal)"]
  assert bench_report.format_targets(rows[2:5], "cpu") == ""


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


def test_settle_runs_back_to_back_for_its_time_rotating_the_inputs():
  calls = []
  def fn(x):
    calls.append(float(x[0]))
    return x
  sets = [(jnp.full((2,), float(i)),) for i in range(3)]
  t0 = time.perf_counter()
  made = bench.settle(fn, sets, t_one=1e-3, seconds=0.05)
  assert time.perf_counter() - t0 >= 0.05
  assert made == len(calls) > 3 and set(calls) == {0.0, 1.0, 2.0}


def test_only_gpu_timing_settles(monkeypatch):
  settled = []
  monkeypatch.setattr(bench, "settle", lambda *args: settled.append(args))
  sets = [(jnp.ones((2,)),)]
  bench.time_call(lambda x: x, sets, repeats=3, on_cpu=True)
  assert not settled
  bench.time_call(lambda x: x, sets, repeats=3, on_cpu=False)
  assert len(settled) == 1


def test_rounds_rotate_the_impls_and_take_medians_of_each_rounds_ratios(monkeypatch, capsys):
  # Scripted times (ms), in the order the calls come: jax_flash first in rounds 1 and 3,
  # xla first in round 2. Per round (jax_flash fwd, f+b / xla fwd, f+b): 1, 3 / 2, 6;
  # 1, 3 / 4, 9; 2, 4 / 3, 10. The medians of each round's ratios (fwd 2, 4, 1.5 -> 2;
  # f+b 2, 3, 2.5 -> 2.5) differ from the ratios of the medians (3 and 3).
  script = iter([1.0, 3.0, 2.0, 6.0, 4.0, 9.0, 1.0, 3.0, 2.0, 4.0, 3.0, 10.0])
  monkeypatch.setattr(bench, "time_call", lambda *args: (next(script) / 1e3, 3))
  rows = bench.main(["--preset", "quick", "--seqlens", "32", "--head-dims", "8", "--causal",
                     "no", "--impls", "jax_flash,xla", "--rounds", "3"])
  out = capsys.readouterr()
  assert next(script, None) is None  # every impl timed fwd and f+b in each of 3 rounds
  flash, xla = rows
  assert (flash["impl"], xla["impl"]) == ("jax_flash", "xla")
  assert flash["fwd_ms_rounds"] == [1.0, 1.0, 2.0] and xla["fwdbwd_ms_rounds"] == [6.0, 9.0, 10.0]
  assert (flash["fwd_ms"], flash["fwdbwd_ms"], flash["bwd_ms"]) == (1.0, 3.0, 2.0)
  assert (xla["fwd_ms"], xla["fwdbwd_ms"]) == (3.0, 9.0)
  assert flash["fwd_vs_xla"] == 2.0 and flash["fwdbwd_vs_xla"] == 2.5
  # The backward by round: f+b less fwd, jax_flash 2, 2, 2 against xla 4, 5, 7.
  by_round = {key: bench_features.round_ratios(flash, xla, key)
              for key in ("fwd_ms", "fwdbwd_ms", "bwd_ms")}
  assert by_round == {"fwd_ms": [2.0, 4.0, 1.5], "fwdbwd_ms": [2.0, 3.0, 2.5],
                      "bwd_ms": [2.0, 2.5, 3.5]}
  assert xla["fwd_vs_xla"] == 1.0
  assert ("jax_flash by round: fwd×xla 2.00 4.00 1.50, f+b×xla 2.00 3.00 2.50, "
          "bwd×xla 2.00 2.50 3.50") in out.out
  assert "xla by round" not in out.out  # its ratios to itself say nothing
  label = "… B=1 H=2 S=32 D=8 float32 causal=no"
  order = [line for line in out.err.splitlines() if "forward: time, round" in line]
  assert order == [f"{label} | {impl} | forward: time, round {r} of 3"
                   for r, impl in ((1, "jax_flash"), (1, "xla"), (2, "xla"), (2, "jax_flash"),
                                   (3, "jax_flash"), (3, "xla"))]


@pytest.mark.parametrize("argv,message", [
    (["--seqlens", "0"], "--seqlens: expected a size of at least 1"),
    (["--seqlens", "-5"], "--seqlens: expected a size of at least 1"),
    (["--seqlens", "3.5k"], "--seqlens: expected a size of at least 1"),
    (["--head-dims", "0"], "--head-dims: expected a whole number of at least 1"),
    (["--batch", "0"], "--batch: expected a whole number of at least 1"),
    (["--heads", "-2"], "--heads: expected a whole number of at least 1"),
    (["--repeats", "0"], "--repeats: expected a whole number of at least 1"),
    (["--json", "/nonexistent-folder/x.json"], "--json: cannot write"),
])
def test_bad_sizes_and_paths_are_refused_before_anything_runs(capsys, argv, message):
  """Once tracebacks (a division by zero, an MLIR error), a preset's value in
  place of --batch 0, or a lost run when the JSON could not be written."""
  with pytest.raises(SystemExit):
    bench.parse_args(argv)
  assert message in capsys.readouterr().err


def test_float64_needs_x64(capsys):
  """Without 64-bit jax a float64 row would be float32 under a float64 label."""
  with jax.enable_x64(False):
    with pytest.raises(SystemExit):
      bench.parse_args(["--dtype", "float64"])
  assert "JAX_ENABLE_X64=1" in capsys.readouterr().err
  assert bench.parse_args(["--dtype", "float64"]).dtype == "float64"  # x64 on in the tests


def test_one_round_is_the_default_and_rounds_must_be_positive(capsys):
  assert bench.parse_args([]).rounds == 1
  for bad in ("0", "-1", "two"):
    with pytest.raises(SystemExit):
      bench.parse_args(["--rounds", bad])
    assert f"--rounds: expected a whole number of at least 1, got '{bad}'" in capsys.readouterr().err


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


# -- feature rows (--features) -------------------------------------------------


def test_every_feature_row_runs_and_matches_float64(tmp_path, capsys):
  path = tmp_path / "rows.json"
  rows = bench.main(["--preset", "quick", "--seqlens", "48", "--head-dims", "8", "--causal",
                     "both", "--impls", "jax_flash,xla", "--repeats", "3", "--features", "all",
                     "--json", str(path)])
  table = capsys.readouterr().out
  assert json.loads(path.read_text())["rows"] == rows
  features = list(bench.bench_features.FEATURES)
  by_key = {(r["feature"], r["causal"], r["impl"]): r for r in rows}
  expected = {(f, c, i) for f in ["plain"] + features for c in (False, True)
              for i in ("jax_flash", "xla") if c or f != "mask"}  # mask: causal only
  assert set(by_key) == expected and len(rows) == len(expected)
  for (feature, causal, impl), r in by_key.items():
    assert (r["batch"], r["heads"], r["seqlen"], r["head_dim"]) == (1, 2, 48, 8)
    if feature == "dropout" and impl == "xla":  # jax.nn has no dropout: said, not run
      assert r["status"] == "not run: jax.nn.dot_product_attention has no dropout", r
      assert r["fwd_ms"] is None
      continue
    assert r["status"] == "ok", r
    assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["memory"] > 0
    if feature == "dropout":  # no reference: the kernel draws the mask
      assert r["max_err"] is None
    else:  # float32 against float64, over the rows that see a key
      assert 0 <= r["max_err"] < 1e-5 and r["rel_err"] < 1e-5, r
    if feature == "plain":
      assert r["given"] is None and r["fwd_vs_plain"] is None
    else:
      plain = by_key[("plain", causal, impl)]
      assert r["fwd_vs_plain"] == pytest.approx(plain["fwd_ms"] / r["fwd_ms"])
      assert r["fwdbwd_vs_plain"] == pytest.approx(plain["fwdbwd_ms"] / r["fwdbwd_ms"])
      assert ("is_causal" in r["given"]) == (causal and feature != "mask")
  assert by_key[("mask", True, "xla")]["given"] == "mask (1, 1, 48, 48) bool"
  assert by_key[("segments", True, "jax_flash")]["given"].startswith(
      "q_segment_ids (1, 48) int32, kv_segment_ids (1, 48) int32")
  assert "as a dense mask: jax.nn has no segment ids" in by_key[("segments", False, "xla")][
      "given"]
  assert "B=1 H=2 S=48 D=8 float32 causal=yes | bias: ALiBi-style bias (1, N, S, S)" in table
  assert "fwd×plain" in table and "given to jax_flash, xla: bias (1, 2, 48, 48) float32" in table
  assert "Targets" not in table  # the feature targets are GPU targets


def test_feature_reference_matches_jax_nn_and_leaves_unseen_rows_out():
  import numpy as np
  from jax_flash import bench_features as bf
  case = bench.Case(3, 2, 37, 8, "float32", True)
  q, k, v, _ = bench.make_inputs(case, seed=2)
  for feature in ("bias", "mask", "padding", "lengths", "segments", "block-sparse"):
    ops = bf.FEATURES[feature].operands(case)
    ref = bench.reference_fwd(q, k, v, case.causal and bf.FEATURES[feature].uses_is_causal,
                              **bf.reference_operands(case, ops))
    nn_ops, _ = bf.jax_nn_operands(ops, case)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=case.causal and
                                       bf.FEATURES[feature].uses_is_causal, **nn_ops)
    seen = ~np.isnan(ref)
    np.testing.assert_allclose(np.asarray(out)[seen], ref[seen], atol=2e-5, err_msg=feature)
    if feature in ("padding", "lengths"):  # rows past each example's length see no key
      lengths = bf.padding_lengths(case)
      assert list(lengths) == [37 - 37 // 12, 37 - 2 * 37 // 12, 37 - 3 * 37 // 12]
      rows_seen = seen[:, :, 0, 0]
      assert (rows_seen == (np.arange(37)[None, :] < lengths[:, None])).all()
    else:
      assert seen.all()
  assert bf.packed_segment_ids(case)[0].tolist() == sorted(bf.packed_segment_ids(case)[0])
  assert len(set(bf.packed_segment_ids(case)[0].tolist())) == bf.PACKED_SEGMENTS


def test_block_sparse_feature_is_the_dense_mask_it_stands_for():
  import numpy as np
  from jax_flash import bench_features as bf
  case = bench.Case(1, 2, 300, 8, "float32", False)  # three cells of 128 a side
  ops = bf.FEATURES["block-sparse"].operands(case)
  np.testing.assert_array_equal(np.asarray(ops["block_mask"]),
                                [[[[1, 1, 0], [1, 1, 1], [1, 1, 1]]]])
  q, k, v, _ = bench.make_inputs(case, seed=3)
  nn_ops, note = bf.jax_nn_operands(ops, case)
  assert nn_ops["mask"].shape == (1, 1, 300, 300) and "as a dense mask" in note
  assert not np.asarray(nn_ops["mask"])[0, 0, :128, 256:].any()
  want = jax.nn.dot_product_attention(q, k, v, **nn_ops)
  np.testing.assert_allclose(np.asarray(jax_flash.flash_attention(q, k, v, **ops)),
                             np.asarray(want), atol=2e-5)


def _gpu_row(impl, feature="plain", causal=True, seqlen=2048, head_dim=128, fwd=1.0, fwdbwd=3.0,
             dtype="bfloat16", status="ok"):
  return dict(batch=4, heads=16, seqlen=seqlen, head_dim=head_dim, dtype=dtype, causal=causal,
              impl=impl, feature=feature, status=status, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
              bwd_ms=None if fwd is None or fwdbwd is None else fwdbwd - fwd,
              **dict.fromkeys(bench.MEMORY_FIELDS))


def test_feature_target_verdicts_on_a_gpu():
  label = "B=4 H=16 S=2048 D=128 bfloat16 causal=yes"
  rows = [_gpu_row("jax_flash", fwd=1.0, fwdbwd=3.0), _gpu_row("cudnn", fwd=0.6, fwdbwd=2.0),
          _gpu_row("jax_flash", "bias", fwd=1.0, fwdbwd=3.0),
          _gpu_row("cudnn", "bias", fwd=0.9, fwdbwd=2.0),
          _gpu_row("jax_flash", "dropout", fwd=1.1, fwdbwd=3.6),
          _gpu_row("cudnn", "dropout", fwd=None, fwdbwd=None, status="not run: no dropout"),
          _gpu_row("jax_flash", "segments", fwd=0.5, fwdbwd=2.5),
          _gpu_row("cudnn", "segments", fwd=2.0, fwdbwd=None, status="fwd only (OOM)"),
          _gpu_row("jax_flash", "padding", fwd=None, fwdbwd=None, status="n/a (Error: x)"),
          _gpu_row("cudnn", "padding", fwd=1.0, fwdbwd=3.0),
          # out of scope: float32, S=512, D=32; no cudnn row at all
          _gpu_row("jax_flash", "bias", dtype="float32"),
          _gpu_row("cudnn", "bias", dtype="float32"),
          _gpu_row("jax_flash", "mask", seqlen=512), _gpu_row("cudnn", "mask", seqlen=512),
          _gpu_row("jax_flash", "mask", head_dim=32), _gpu_row("cudnn", "mask", head_dim=32),
          _gpu_row("jax_flash", "mask", seqlen=4096),
          # the head-dim target: plain D=96, fwd and bwd against cudnn
          _gpu_row("jax_flash", head_dim=96, causal=False, fwd=1.0, fwdbwd=3.0),
          _gpu_row("cudnn", head_dim=96, causal=False, fwd=0.9, fwdbwd=2.3)]
  lines = bench_report.format_targets(rows, "gpu").strip().splitlines()
  assert lines[0] == "Targets, jax_flash:"
  assert lines[1:] == [
      f"  plain {label}: fwd 0.60× cudnn MISS, bwd 0.70× cudnn MISS "
      "(target ≥ 1.05× cudnn from S=2048)",
      f"  bias {label}: fwd 0.90× cudnn ok, fwd+bwd 0.67× cudnn MISS "
      "(target ≥ 0.8× cudnn given the same problem)",
      f"  dropout {label}: fwd 1.10× the time without dropout ok, fwd+bwd 1.20× the time "
      "without dropout MISS (target ≤ 1.15×)",
      f"  segments {label}: fwd 4.00× cudnn ok (target ≥ 0.8× cudnn given the same problem)",
      f"  segments {label}: fwd 0.83× the time of plain causal (cudnn) ok, fwd+bwd 1.25× the "
      "time of plain causal (cudnn) MISS (target < 1×: 4 packed sequences faster than plain "
      "causal, the fastest measured)",
      f"  padding {label}: fwd MISS (jax_flash: n/a (Error: x)), fwd+bwd MISS (jax_flash: n/a "
      "(Error: x)) (target ≥ 0.8× cudnn given the same problem)",
      "  plain B=4 H=16 S=2048 D=96 bfloat16 causal=no: fwd 0.90× cudnn ok, bwd 0.70× cudnn MISS "
      "(target ≥ 0.8× cudnn)"]
  assert bench_report.format_targets(rows, "cpu") == ""  # GPU targets


def test_pipeline_target_verdicts_on_a_gpu():
  # Issue 15: plain D=64/128/256 rows, >= 1.05x cudnn from S=2k, >= 0.95x at S=1k, and the
  # D=128 non-causal forward at S=16k in TF/s (649.7 is a miss, not "650"); not D=96, not
  # float32, not a feature row.
  def pair(seqlen, head_dim, causal, ours, theirs, dtype="bfloat16", tflops=None):
    mine = _gpu_row("jax_flash", seqlen=seqlen, head_dim=head_dim, causal=causal, fwd=ours[0],
                    fwdbwd=ours[1], dtype=dtype)
    mine["fwd_tflops"] = tflops
    return [mine, _gpu_row("cudnn", seqlen=seqlen, head_dim=head_dim, causal=causal,
                           fwd=theirs[0], fwdbwd=theirs[1], dtype=dtype)]
  rows = (pair(1024, 64, True, (1.0, 3.0), (0.96, 2.8)) +       # 0.96 / 0.92 at S=1k
          pair(4096, 256, False, (1.0, 3.0), (1.1, 3.1)) +       # 1.10 / 1.00 from 2k
          pair(16384, 128, False, (1.0, 3.0), (1.0, 3.0), tflops=649.7) +
          pair(4096, 96, False, (1.0, 3.0), (2.0, 6.0)) +        # D=96: issue 11's only
          pair(4096, 64, False, (1.0, 3.0), (2.0, 6.0), dtype="float32"))
  lines = bench_report.format_targets(rows, "gpu").strip().splitlines()[1:]
  assert lines == [
      "  plain B=4 H=16 S=1024 D=64 bfloat16 causal=yes: fwd 0.96× cudnn ok, bwd 0.92× cudnn "
      "MISS (target ≥ 0.95× cudnn at every S)",
      "  plain B=4 H=16 S=4096 D=256 bfloat16 causal=no: fwd 1.10× cudnn ok, bwd 1.00× cudnn "
      "ok (target ≥ 0.8× cudnn)",
      "  plain B=4 H=16 S=4096 D=256 bfloat16 causal=no: fwd 1.10× cudnn ok, bwd 1.00× cudnn "
      "MISS (target ≥ 1.05× cudnn from S=2048)",
      "  plain B=4 H=16 S=16384 D=128 bfloat16 causal=no: fwd 1.00× cudnn MISS, bwd 1.00× cudnn "
      "MISS (target ≥ 1.05× cudnn from S=2048)",
      "  plain B=4 H=16 S=16384 D=128 bfloat16 causal=no: fwd 649.7 TF/s MISS "
      "(target ≥ 650 TF/s on an H100)",
      "  plain B=4 H=16 S=4096 D=96 bfloat16 causal=no: fwd 2.00× cudnn ok, bwd 2.00× cudnn ok "
      "(target ≥ 0.8× cudnn)"]


def test_a_verdict_figure_that_would_round_onto_the_target_shows_more_digits():
  # 1.0499x against "at least 1.05x" is a miss; printed to 2 decimals it would read 1.05.
  mine = _gpu_row("jax_flash", seqlen=4096, head_dim=128, causal=False, fwd=1.0, fwdbwd=3.0)
  theirs = _gpu_row("cudnn", seqlen=4096, head_dim=128, causal=False, fwd=1.0499, fwdbwd=3.2)
  lines = bench_report.format_targets([mine, theirs], "gpu").strip().splitlines()[1:]
  assert lines == [
      "  plain B=4 H=16 S=4096 D=128 bfloat16 causal=no: fwd 1.0499× cudnn MISS, bwd 1.08× "
      "cudnn ok (target ≥ 1.05× cudnn from S=2048)"]


def test_verdicts_measured_in_rounds_take_the_median_of_each_rounds_ratio():
  # The times' medians say fwd 1.10x, bwd 1.00x; the rounds' ratios (paired within a round)
  # say 1.06 and 1.04, and the verdict gives their range.
  mine = _gpu_row("jax_flash", seqlen=4096, head_dim=128, causal=False, fwd=1.0, fwdbwd=3.0)
  theirs = _gpu_row("cudnn", seqlen=4096, head_dim=128, causal=False, fwd=1.1, fwdbwd=3.1)
  # Rounds of (fwd, f+b) ms: ratios fwd 1.02, 1.08, 1.06; bwd 1.01, 1.04, 1.07.
  mine["fwd_ms_rounds"], mine["fwdbwd_ms_rounds"] = [1.0] * 3, [3.0] * 3
  theirs["fwd_ms_rounds"] = [1.02, 1.08, 1.06]
  theirs["fwdbwd_ms_rounds"] = [1.02 + 2.02, 1.08 + 2.08, 1.06 + 2.14]
  lines = bench_report.format_targets([mine, theirs], "gpu").strip().splitlines()[1:]
  assert lines == [
      "  plain B=4 H=16 S=4096 D=128 bfloat16 causal=no: fwd 1.06× (1.02-1.08 by round) cudnn "
      "ok, bwd 1.04× (1.01-1.07 by round) cudnn MISS (target ≥ 1.05× cudnn from S=2048)"]

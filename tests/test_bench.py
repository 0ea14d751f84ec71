"""python -m jax_flash.bench runs end to end on tiny shapes and reports sane rows."""

import json

import pytest

from jax_flash import bench


def test_quick_preset_table_and_json(tmp_path, capsys):
  path = tmp_path / "rows.json"
  rows = bench.main(["--preset", "quick", "--seqlens", "64", "--head-dims", "16",
                     "--repeats", "3", "--json", str(path)])
  table = capsys.readouterr().out

  data = json.loads(path.read_text())
  assert data["rows"] == rows
  assert data["meta"]["jax"] and data["meta"]["date"] and data["meta"]["device"]
  by_key = {(r["impl"], r["causal"]): r for r in rows}
  assert set(by_key) == {(i, c) for i in bench.IMPLS for c in (False, True)}
  for causal in (False, True):
    for impl in ("jax_flash", "xla"):
      r = by_key[(impl, causal)]
      assert r["status"] == "ok", r
      assert (r["batch"], r["heads"], r["seqlen"], r["head_dim"]) == (1, 2, 64, 16)
      assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwd_tflops"] > 0
      assert r["fwdbwd_tflops"] > 0
      assert 0 <= r["max_err"] < 1e-5 and r["rel_err"] < 1e-5  # float32 vs float64
      assert r["memory"] > r["memory_beyond_inputs"] > 0
    assert by_key[("xla", causal)]["fwd_vs_xla"] == pytest.approx(1.0)
    assert by_key[("jax_flash", causal)]["fwd_vs_xla"] > 0
    cudnn = by_key[("cudnn", causal)]
    assert cudnn["status"] == "ok" or cudnn["status"].startswith("n/a")

  assert "jax_flash" in table and "xla" in table and "fwd TF/s" in table
  assert "B=1 H=2 S=64 D=16 float32 causal=yes" in table


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
  import jax
  import numpy as np
  case = bench.Case(1, 2, 33, 8, "float32", True)
  q, k, v, _ = bench.make_inputs(case, seed=1)
  ref = bench.reference_fwd(q, k, v, causal=True)
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)

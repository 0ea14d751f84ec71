"""tests/gpu/gpt_step_hlo.py: its HLO text parsing, and the GPT step it summarizes."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent / "gpu"))
import gpt_step_hlo  # noqa: E402


def test_parse_instruction():
  inst = gpt_step_hlo.parse_instruction(
      '  %flash_fwd.3 = (bf16[8,64,4,16]{3,2,1,0}, f32[8,4,64]{2,1,0}) custom-call(%a.1, '
      '%b, /*index=2*/%c), custom_call_target="jax_flash_fwd", backend_config={x = (1)}')
  assert inst.name == "flash_fwd.3"
  assert inst.opcode == "custom-call(jax_flash_fwd)"
  assert inst.operands == ["a.1", "b", "c"]
  assert gpt_step_hlo.type_bytes(inst.type) == 8 * 64 * 4 * 16 * 2 + 8 * 4 * 64 * 4
  root = gpt_step_hlo.parse_instruction(
      "  ROOT %f = f32[3]{0} fusion(%x), kind=kLoop, calls=%fused_computation.2")
  assert (root.name, root.opcode, root.operands) == ("f", "fusion(kLoop)", ["x"])
  assert gpt_step_hlo.parse_instruction("  }") is None


def test_summarize_sees_each_layers_attention_calls():
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  layers = 2
  got = {}
  for attention in ("jax_flash", "flax"):
    hlo, _ = gpt_step_hlo.compile_step("tiny", attention, 0.0, layers)
    got[attention] = gpt_step_hlo.summarize(hlo)
  flash, flax = got["jax_flash"], got["flax"]
  assert flash["counts"]["custom-call(jax_flash_fwd)"] == layers
  assert flash["counts"]["custom-call(jax_flash_bwd)"] == layers
  assert not any("jax_flash" in k for k in flax["counts"])
  assert not flax["neighbours"]
  # Every attention call has producers and users listed, and the forward's
  # results reach the backward.
  fwd_users = sum(v for k, v in flash["neighbours"].items()
                  if k.startswith("custom-call(jax_flash_fwd) ->"))
  assert fwd_users >= layers
  assert any(k.startswith("custom-call(jax_flash_bwd) <-") for k in flash["neighbours"])
  lines = gpt_step_hlo.table(got, "counts", "count by opcode", only_differing=True)
  assert any("custom-call(jax_flash_fwd)" in line for line in lines)

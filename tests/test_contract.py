"""Python's side of the FFI contract is C++'s (cpp/ffi/contract.h, exported as ffi_contract()).

The primitives take their operand names and their attributes' names and
types from the extension; these tests check what they actually lower to,
call by call, so that a list edited on one side only fails here (and the
handlers, which decode attributes into structs, would refuse the call).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, attention, primitives

CONTRACT = _ffi.CONTRACT
TARGETS = (_ffi.FWD_TARGET, _ffi.BWD_TARGET, _ffi.JVP_TARGET)
# How the lowering writes each C++ attribute type into the call's backend_config.
MLIR_ATTRIBUTE = {"double": r"[-+0-9.e]+ : f64", "int64_t": r"-?\d+ : i64", "bool": "true|false"}
MLIR_DTYPE = {"int32": "i32", "uint32": "ui32", "bool": "i1", "uint8": "ui8"}


def test_the_extension_exports_every_target():
  assert set(CONTRACT["ops"]) == set(TARGETS)
  for target in TARGETS:
    operands = _ffi.operands(target)
    assert operands[-len(primitives.MASK_OPERANDS):] == primitives.MASK_OPERANDS, target
    assert len(set(operands)) == len(operands), f"{target}: an operand named twice"


def test_the_primitives_parameters_are_the_attributes():
  """The attributes of every call are parameters the public API sets."""
  config = attention._Config(scale=1.0, softcap=0.0, is_causal=False, window_left=-1,
                             window_right=-1, dropout_rate=0.0, broadcast_dropout=False,
                             deterministic=False)
  names = {name for target in TARGETS for name, _, _ in CONTRACT["ops"][target]["attributes"]}
  assert names == set(config.fwd_params())


@pytest.mark.parametrize("layout_of,target", [
    (primitives._fwd_layout, _ffi.FWD_TARGET),
    (primitives._bwd_layout, _ffi.BWD_TARGET),
    (primitives._jvp_layout, _ffi.JVP_TARGET),
])
def test_sharding_roles_cover_every_operand(layout_of, target):
  q = jax.ShapeDtypeStruct((2, 10, 4, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((2, 12, 2, 8), jnp.float32)
  lse = jax.ShapeDtypeStruct((2, 4, 10), jnp.float32)
  absent = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in primitives.mask_operands(q.dtype)]
  per_row = {_ffi.FWD_TARGET: [q, k, k], _ffi.BWD_TARGET: [q, k, k, q, lse, q],
             _ffi.JVP_TARGET: [q, k, k, q, lse, q, k, k, absent[0]]}[target]
  params = dict(scale=1.0, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                dropout_rate=0.0, broadcast_dropout=False, deterministic=False)
  if target == _ffi.BWD_TARGET:
    params["bias_grad"] = True
  layout = layout_of(per_row + absent, params)
  assert len(layout.operand_names) == len(layout.operand_roles) == len(_ffi.operands(target))
  assert _ffi.operands(target)[layout.offsets_index] == "offsets"


def _calls(stablehlo: str):
  """(target, operand types, result types, backend_config text) of each jax_flash call."""
  for line in stablehlo.splitlines():
    found = re.search(r"custom_call @(jax_flash_\w+)\(", line)
    if not found:
      continue
    config = re.search(r"mhlo.backend_config = \{([^}]*)\}", line).group(1)
    signature = line.rsplit("} : (", 1)[1]
    operands, results = signature.split(") -> ", 1)
    yield (found.group(1), re.findall(r"tensor<[^>]*>", operands),
           re.findall(r"tensor<[^>]*>", results), config)


def _element_type(tensor: str) -> str:
  return tensor[len("tensor<"):-1].split("x")[-1]


def _every_call(q, k, v, bias, lengths):
  """Forward, forward mode and reverse mode, with a bias and lengths present."""
  def f(q, k, v, bias):
    return jax_flash.flash_attention(q, k, v, bias=bias, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths, is_causal=True)

  out = f(q, k, v, bias)
  tangent = jax.jvp(f, (q, k, v, bias), (q, k, v, bias))[1]
  grads = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3))(q, k, v, bias)
  return out, tangent, grads


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_lowered_calls_are_the_contracts(platform):
  if platform == "cuda" and not jax_flash.build_info()["cuda"]:
    pytest.skip("jax_flash was built without CUDA kernels")
  dtype = jnp.float32
  q = jax.ShapeDtypeStruct((2, 10, 4, 8), dtype)
  k = jax.ShapeDtypeStruct((2, 12, 2, 8), dtype)
  bias = jax.ShapeDtypeStruct((1, 4, 10, 12), dtype)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = jax.jit(_every_call).trace(q, k, k, bias, lengths).lower(
      lowering_platforms=(platform,)).as_text()
  seen = set()
  for target, operands, results, config in _calls(text):
    seen.add(target)
    op = CONTRACT["ops"][target]
    extra = CONTRACT["extra_results"].get(platform, {}).get(target, [])
    assert len(operands) == len(op["operands"]), (target, operands)
    assert len(results) == len(op["results"]) + len(extra), (target, results)
    for (name, want, _), tensor in zip(op["operands"] + op["results"] + extra,
                                       operands + results):
      # float32 inputs: "input" and "acc" are both f32 (so is either of "a|b").
      want = {{"input": "f32", "acc": "f32"}.get(kind, MLIR_DTYPE.get(kind))
              for kind in want.split("|")}
      assert _element_type(tensor) in want, f"{target}: {name} is {tensor}, not {want}"
    attrs = dict(re.findall(r"(\w+) = ([^,]+)", config))
    declared = {name: cpp_type for name, cpp_type, _ in op["attributes"]}
    assert set(attrs) == set(declared), target
    for name, value in attrs.items():
      assert re.fullmatch(MLIR_ATTRIBUTE[declared[name]], value), (target, name, value)
  assert seen == set(TARGETS)


def test_a_missing_parameter_is_named():
  q = jnp.zeros((1, 4, 1, 8))
  params = dict(scale=1.0, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                dropout_rate=0.0)  # no broadcast_dropout
  with pytest.raises(TypeError, match="broadcast_dropout"):
    jax.jit(lambda q: primitives.flash_fwd_p.bind(
        q, q, q, *primitives.mask_operands(q.dtype), **params)).lower(q)


def test_absent_operands_take_the_contracts_dtypes():
  for dtype, acc in ((np.float16, np.float32), (np.float64, np.float64)):
    ops = dict(zip(primitives.MASK_OPERANDS, primitives.mask_operands(dtype)))
    for name, x in ops.items():
      assert primitives.is_absent(x)
      first = _ffi.OPERAND_DTYPES[name].split("|")[0]  # of "a|b", the first when absent
      want = {"acc": acc, "input": dtype}.get(first, first)
      assert x.dtype == np.dtype(want), name
  with pytest.raises(TypeError, match="no mask operand named"):
    primitives.mask_operands(np.float32, biass=np.zeros(3))

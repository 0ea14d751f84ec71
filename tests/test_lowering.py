"""What the primitives lower to: the custom calls and, on CUDA, the workspace.

The CUDA backward takes its workspace (delta and the float32 dQ accumulator)
as an extra result of the custom call, so that XLA owns that memory and may
record the call into a CUDA graph. These tests lower for CUDA without a GPU
(CI compiles the CUDA kernels), and on a GPU check that XLA does record both
calls into command buffers.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import assert_flash_close
from jax_flash import _ffi, _supported
from reference import Options, attention_and_grads, make_inputs, visible_mask

needs_cuda_build = pytest.mark.skipif(not jax_flash.build_info()["cuda"],
                                      reason="jax_flash was built without CUDA kernels")


def _grad_fn(**kwargs):
  def loss(q, k, v):
    return jnp.sum(jax_flash.flash_attention(q, k, v, **kwargs).astype(jnp.float32) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _shapes(dtype, batch=2, seqlen_q=100, seqlen_k=77, heads_q=4, heads_kv=2, head_dim=64):
  q = jax.ShapeDtypeStruct((batch, seqlen_q, heads_q, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seqlen_k, heads_kv, head_dim), dtype)
  return q, kv, kv


def _custom_call_results(stablehlo: str, target: str) -> list[str]:
  """The result types of the one custom call to `target` in a StableHLO module."""
  calls = [line for line in stablehlo.splitlines() if f"custom_call @{target}(" in line]
  assert len(calls) == 1, f"expected one call to {target}, found {len(calls)}"
  signature = calls[0].rsplit("->", 1)[1]
  return re.findall(r"tensor<[^>]*>", signature)


@needs_cuda_build
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cuda_forward_returns_its_workspace(dtype):
  """The forward's last result is its workspace (the persistent scheduler's
  tile counter), the size the C++ side asks for, for every problem."""
  q, k, v = _shapes(dtype)
  lowered = jax.jit(functools.partial(jax_flash.dot_product_attention, is_causal=True)).trace(
      q, k, v).lower(lowering_platforms=("cuda",))
  results = _custom_call_results(lowered.as_text(), _ffi.FWD_TARGET)
  # out, lse, then the workspace.
  assert len(results) == 3, results
  nbytes = _ffi.cuda_fwd_workspace_bytes()
  assert 4 <= nbytes <= 1024
  assert results[-1] == f"tensor<{nbytes}xui8>"


@needs_cuda_build
@pytest.mark.parametrize("dtype,deterministic", [(jnp.bfloat16, False), (jnp.bfloat16, True),
                                                 (jnp.float32, False)])
def test_cuda_backward_returns_its_workspace(dtype, deterministic):
  q, k, v = _shapes(dtype)
  lowered = _grad_fn(deterministic=deterministic).trace(q, k, v).lower(
      lowering_platforms=("cuda",))
  results = _custom_call_results(lowered.as_text(), _ffi.BWD_TARGET)
  # dq, dk, dv, dbias (absent: (0,)), then the workspace.
  assert len(results) == 5, results
  nbytes = _ffi.cuda_bwd_workspace_bytes(q.shape, k.shape, dtype, deterministic)
  assert results[-1] == f"tensor<{nbytes}xui8>"
  batch, seqlen_q, heads_q, head_dim = q.shape
  rows = batch * seqlen_q * heads_q
  # delta (float32 per row) always; the tensor-core kernels (bf16) add their
  # log2-scaled lse per row and, unless deterministic, a float32 dQ accumulator
  # (bwd/workspace.h: the head-dim bucket's columns, 64-column blocks above 64,
  # of each query row rounded up to 16 rows per head).
  minimum = 4 * rows
  if dtype == jnp.bfloat16:
    bucket = _supported.head_dim_bucket(head_dim)
    cols = -(-bucket // 64) * 64 if bucket > 64 else bucket
    accum_rows = batch * heads_q * -(-seqlen_q // 16) * 16
    minimum += 4 * rows + (0 if deterministic else 4 * accum_rows * cols)
  assert minimum <= nbytes < minimum + 1024


def test_cpu_backward_has_no_workspace():
  q, k, v = _shapes(jnp.float32)
  lowered = _grad_fn().trace(q, k, v).lower(lowering_platforms=("cpu",))
  results = _custom_call_results(lowered.as_text(), _ffi.BWD_TARGET)
  assert len(results) == 4, results


def _calls(stablehlo: str, target: str) -> list[tuple[list[tuple[str, str]], list[str]]]:
  """For each call to `target`: (SSA name, type) of each operand, and the result types."""
  calls = []
  for line in stablehlo.splitlines():
    if f"custom_call @{target}(" not in line:
      continue
    names = line.split(f"@{target}(", 1)[1].split(")", 1)[0].split(", ")
    operands, results = line.rsplit("} : (", 1)[1].split(") -> ", 1)
    types = re.findall(r"tensor<[^>]*>", operands)
    calls.append((list(zip(names, types, strict=True)), re.findall(r"tensor<[^>]*>", results)))
  return calls


def _with_bias_every_call(q, k, v, bias):
  """Forward, forward mode (bias tangent too) and reverse mode (dbias too)."""
  f = lambda q, k, v, bias: jax_flash.flash_attention(q, k, v, bias=bias, is_causal=True)
  out = f(q, k, v, bias)
  tangent = jax.jvp(f, (q, k, v, bias), (q, k, v, bias))[1]
  grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 3))(q, k, v, bias)
  return out, tangent, grads


_BIAS_SHAPE = (1, 4, 100, 77)


def _bias_shapes(dtype, bias_dtype):
  return (*_shapes(dtype), jax.ShapeDtypeStruct(_BIAS_SHAPE, bias_dtype))


def _bias_operand(target, operands):
  return operands[_ffi.operands(target).index("bias")]


def test_cpu_converts_a_16bit_bias_just_before_the_call():
  """The CPU kernels read float32: a bfloat16 bias is converted in HLO right
  before each call (not earlier, as a pass of its own), dbias converted back."""
  text = jax.jit(_with_bias_every_call).trace(*_bias_shapes(jnp.bfloat16, jnp.bfloat16)).lower(
      lowering_platforms=("cpu",)).as_text()
  shape = "x".join(map(str, _BIAS_SHAPE))
  for target in (_ffi.FWD_TARGET, _ffi.JVP_TARGET, _ffi.BWD_TARGET):
    calls = _calls(text, target)
    assert calls, target
    for operands, _ in calls:
      name, tensor = _bias_operand(target, operands)
      assert tensor == f"tensor<{shape}xf32>", (target, tensor)
      convert = rf"{re.escape(name)} = stablehlo.convert %\S+ : \(tensor<{shape}xbf16>\)"
      assert re.search(convert, text), f"{target}: its bias {name} is not a converted bfloat16"
  assert _custom_call_results(text, _ffi.BWD_TARGET)[3] == f"tensor<{shape}xf32>"


@needs_cuda_build
@pytest.mark.parametrize("bias_dtype", [jnp.bfloat16, jnp.float32])
def test_cuda_calls_take_a_16bit_bias_as_it_is(bias_dtype):
  """On CUDA the kernels read a bfloat16 bias as it is: every call gets it
  unconverted, and no call has a result beyond the contract's (but the
  forward's and backward's workspaces)."""
  text = jax.jit(_with_bias_every_call).trace(*_bias_shapes(jnp.bfloat16, bias_dtype)).lower(
      lowering_platforms=("cuda",)).as_text()
  shape = "x".join(map(str, _BIAS_SHAPE))
  kind = "bf16" if bias_dtype == jnp.bfloat16 else "f32"
  for target in (_ffi.FWD_TARGET, _ffi.JVP_TARGET, _ffi.BWD_TARGET):
    extra = _ffi.CONTRACT["extra_results"]["cuda"].get(target, [])
    calls = _calls(text, target)
    assert calls, target
    for operands, results in calls:
      assert _bias_operand(target, operands)[1] == f"tensor<{shape}x{kind}>", target
      assert len(results) == len(_ffi.CONTRACT["ops"][target]["results"]) + len(extra), results
  # dbias in float32 as the kernels write it (the bias's gradient is cast after).
  assert _custom_call_results(text, _ffi.BWD_TARGET)[3] == f"tensor<{shape}xf32>"


# Run in a fresh process: XLA reads its flags once. The flags ask for command
# buffers for custom calls even in a graph this small; XLA then records each
# call that its handler declares compatible by tracing it on a capturing
# stream, which the handlers count (cuda_captured_calls). The process runs
# jax_flash only; this one compares its results with the float64 reference.
_COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                         "--xla_gpu_graph_min_graph_size=1")
_COMMAND_BUFFER_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import jax_flash
from jax_flash import _jax_flash

@jax.jit
def fwd_bwd(q, k, v, dout, bias):
  # deterministic: replays of the recorded graph must agree bit for bit.
  f = lambda q, k, v, bias: jax_flash.flash_attention(q, k, v, bias=bias, deterministic=True)
  out, vjp = jax.vjp(f, q, k, v, bias)
  return (out,) + tuple(g for g in vjp(dout) if g is not None)

results, replays_equal = {}, True
for n, path in enumerate(sys.argv[1:]):  # new buffers each time: the graph is updated
  inputs = np.load(path)
  args = [jnp.asarray(inputs[name], jnp.bfloat16) for name in ("q", "k", "v", "dout")]
  # A bfloat16 bias reaches the kernels as one: they read it as it is.
  bias = jnp.asarray(inputs["bias"], jnp.bfloat16) if "bias" in inputs else None
  first, second = fwd_bwd(*args, bias), fwd_bwd(*args, bias)
  replays_equal &= all(bool(jnp.array_equal(a, b)) for a, b in zip(first, second))
  for name, x in zip(("out", "dq", "dk", "dv", "dbias"), first):
    results[f"{n}_{name}"] = np.asarray(x, np.float32)
np.savez(sys.argv[1] + ".results.npz", **results)
print(json.dumps({"replays_equal": replays_equal,
                  "captured": dict(_jax_flash.cuda_captured_calls())}))
"""


@pytest.mark.skipif("gpu" not in [d.platform for d in jax.devices()], reason="needs a GPU")
@pytest.mark.parametrize("bias_shape", [None, (1, 4, 100, 77)], ids=["plain", "bf16_bias"])
def test_gpu_records_both_calls_into_command_buffers(tmp_path, bias_shape):
  cases = [make_inputs(np.random.default_rng(seed), 2, 100, 77, 4, 2, 64) for seed in (0, 1)]
  opts = Options(bias_shape=bias_shape)
  paths = []
  for n, inputs in enumerate(cases):
    paths.append(str(tmp_path / f"inputs{n}.npz"))
    bias = {} if bias_shape is None else {"bias": opts.bias(inputs)}
    np.savez(paths[-1], q=inputs.q, k=inputs.k, v=inputs.v, dout=inputs.dout, **bias)
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " +
                                    _COMMAND_BUFFER_FLAGS).strip(),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  result = subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_SCRIPT, *paths], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["captured"]["fwd"] >= 1 and report["captured"]["bwd"] >= 1, (
      f"a handler was never recorded into a CUDA graph: {report}")
  assert report["replays_equal"], report
  got = np.load(paths[0] + ".results.npz")
  names = ("out", "dq", "dk", "dv") + (() if bias_shape is None else ("dbias",))
  for n, inputs in enumerate(cases):
    mask = visible_mask(opts, inputs)
    bias = opts.bias(inputs)
    ref = attention_and_grads(*(jnp.asarray(x, jnp.float64)
                                for x in (inputs.q, inputs.k, inputs.v, inputs.dout)), mask, opts,
                              bias=None if bias is None else jnp.asarray(bias, jnp.float64))
    plain = attention_and_grads(*(jnp.asarray(x, jnp.bfloat16)
                                  for x in (inputs.q, inputs.k, inputs.v, inputs.dout)), mask, opts,
                                bias=None if bias is None else jnp.asarray(bias, jnp.bfloat16))
    for name, r, p in zip(names, ref[:1] + ref[2:], plain[:1] + plain[2:]):
      assert_flash_close(f"{n}_{name}", got[f"{n}_{name}"], r, p, jnp.bfloat16)

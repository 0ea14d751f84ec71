"""What the primitives lower to: the custom calls and, on CUDA, the workspace.

The CUDA backward takes its workspace (delta and the float32 dQ accumulator)
as an extra result of the custom call, so that XLA owns that memory and may
record the call into a CUDA graph. These tests lower for CUDA without a GPU
(CI compiles the CUDA kernels), and on a GPU check that XLA does record both
calls into command buffers.
"""

from __future__ import annotations

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
@pytest.mark.parametrize("dtype,deterministic", [(jnp.bfloat16, False), (jnp.bfloat16, True),
                                                 (jnp.float32, False)])
def test_cuda_backward_returns_its_workspace(dtype, deterministic):
  q, k, v = _shapes(dtype)
  lowered = _grad_fn(deterministic=deterministic).trace(q, k, v).lower(
      lowering_platforms=("cuda",))
  results = _custom_call_results(lowered.as_text(), _ffi.BWD_TARGET)
  # dq, dk, dv, dbias (absent: (0,)), bias_acc (absent: no bias), then the workspace.
  assert len(results) == 6, results
  assert results[4] == "tensor<0xf32>", results
  nbytes = _ffi.cuda_bwd_workspace_bytes(q.shape, k.shape, dtype, deterministic)
  assert results[-1] == f"tensor<{nbytes}xui8>"
  rows = q.shape[0] * q.shape[1] * q.shape[2]
  # delta (float32 per row) always; the tensor-core kernels (bf16) add their
  # log2-scaled lse per row and, unless deterministic, a float32 dQ accumulator
  # (the head-dim bucket's columns and 16 floats of padding per row).
  minimum = 4 * rows
  if dtype == jnp.bfloat16:
    accum_row = _supported.head_dim_bucket(q.shape[3]) + 16
    minimum += 4 * rows + (0 if deterministic else 4 * rows * accum_row)
  assert minimum <= nbytes < minimum + 1024


def test_cpu_backward_has_no_workspace():
  q, k, v = _shapes(jnp.float32)
  lowered = _grad_fn().trace(q, k, v).lower(lowering_platforms=("cpu",))
  results = _custom_call_results(lowered.as_text(), _ffi.BWD_TARGET)
  assert len(results) == 4, results


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
def fwd_bwd(q, k, v, dout):
  # deterministic: replays of the recorded graph must agree bit for bit.
  out, vjp = jax.vjp(lambda q, k, v: jax_flash.flash_attention(q, k, v, deterministic=True),
                     q, k, v)
  return (out,) + vjp(dout)

results, replays_equal = {}, True
for n, path in enumerate(sys.argv[1:]):  # new buffers each time: the graph is updated
  inputs = np.load(path)
  args = [jnp.asarray(inputs[name], jnp.bfloat16) for name in ("q", "k", "v", "dout")]
  first, second = fwd_bwd(*args), fwd_bwd(*args)
  replays_equal &= all(bool(jnp.array_equal(a, b)) for a, b in zip(first, second))
  for name, x in zip(("out", "dq", "dk", "dv"), first):
    results[f"{n}_{name}"] = np.asarray(x, np.float32)
np.savez(sys.argv[1] + ".results.npz", **results)
print(json.dumps({"replays_equal": replays_equal,
                  "captured": dict(_jax_flash.cuda_captured_calls())}))
"""


@pytest.mark.skipif("gpu" not in [d.platform for d in jax.devices()], reason="needs a GPU")
def test_gpu_records_both_calls_into_command_buffers(tmp_path):
  cases = [make_inputs(np.random.default_rng(seed), 2, 100, 77, 4, 2, 64) for seed in (0, 1)]
  paths = []
  for n, inputs in enumerate(cases):
    paths.append(str(tmp_path / f"inputs{n}.npz"))
    np.savez(paths[-1], q=inputs.q, k=inputs.k, v=inputs.v, dout=inputs.dout)
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
  opts = Options()
  for n, inputs in enumerate(cases):
    mask = visible_mask(opts, inputs)
    ref = attention_and_grads(*(jnp.asarray(x, jnp.float64)
                                for x in (inputs.q, inputs.k, inputs.v, inputs.dout)), mask, opts)
    plain = attention_and_grads(*(jnp.asarray(x, jnp.bfloat16)
                                  for x in (inputs.q, inputs.k, inputs.v, inputs.dout)), mask, opts)
    for name, r, p in zip(("out", "dq", "dk", "dv"), ref[:1] + ref[2:], plain[:1] + plain[2:]):
      assert_flash_close(f"{n}_{name}", got[f"{n}_{name}"], r, p, jnp.bfloat16)

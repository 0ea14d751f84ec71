"""jax.export: a jitted jax_flash call, serialized, runs in a fresh process after `import jax_flash`.

Deserializing lowers nothing, so the FFI handlers must be registered by the
import itself; the fresh process first checks that, without the import, XLA
indeed finds no handler (so the passing half cannot pass for another reason).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from conftest import assert_flash_close
from jax_flash import _ffi
from reference import Options, attention_and_grads, make_inputs, visible_mask

_FRESH_PROCESS = """
import json, sys
import jax, numpy as np

exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
inputs = np.load(sys.argv[2])
args = [inputs[name] for name in ("q", "k", "v", "dout")]
try:
  exported.call(*args)
  before_import = "ran"
except Exception as e:  # XLA: no FFI handler registered for jax_flash_fwd
  before_import = str(e)

import jax_flash
np.savez(sys.argv[2] + ".results.npz",
         **dict(zip(("out", "dq", "dk", "dv"), map(np.asarray, exported.call(*args)))))
print(json.dumps({"before_import": before_import}))
"""


def test_exported_call_runs_in_a_fresh_process(tmp_path):
  opts = Options(is_causal=True, window=(40, 3))
  inputs = make_inputs(np.random.default_rng(), 2, 67, 53, 4, 2, 40)

  def fwd_bwd(q, k, v, dout):
    attention = lambda q, k, v: jax_flash.flash_attention(
        q, k, v, is_causal=True, local_window_size=opts.window)
    out, vjp = jax.vjp(attention, q, k, v)
    return (out,) + vjp(dout)

  args = [jnp.asarray(x, jnp.float32) for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  checks = [jax.export.DisabledSafetyCheck.custom_call(target)
            for target in (_ffi.FWD_TARGET, _ffi.BWD_TARGET)]
  # With CUDA kernels built, one export for both platforms (README, Export); the
  # fresh process runs the one of its default device.
  platforms = ("cpu", "cuda") if jax_flash.build_info()["cuda"] else None
  exported = jax.export.export(jax.jit(fwd_bwd), platforms=platforms,
                               disabled_checks=checks)(*args)
  blob, data = tmp_path / "attention.jax_export", tmp_path / "inputs.npz"
  blob.write_bytes(exported.serialize())
  np.savez(data, **{name: np.asarray(x) for name, x in zip(("q", "k", "v", "dout"), args)})

  result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(blob), str(data)],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert _ffi.FWD_TARGET in report["before_import"], report

  got = np.load(str(data) + ".results.npz")
  mask = visible_mask(opts, inputs)
  ref = attention_and_grads(*(jnp.asarray(x, jnp.float64) for x in
                              (inputs.q, inputs.k, inputs.v, inputs.dout)), mask, opts)
  plain = attention_and_grads(*args, mask, opts)
  for name, r, p in zip(("out", "dq", "dk", "dv"), ref[:1] + ref[2:], plain[:1] + plain[2:]):
    assert_flash_close(name, got[name], r, p, jnp.float32)

"""End-to-end check of the CUDA exact kernels through JAX (jit, grad).

Run on a machine with a GPU after `pip install .`:
  python tests/gpu/jax_exact_check.py
Compares jax_flash.flash_attention on the GPU with a dense float64
reference, runs jax.test_util.check_grads in float64, and calls a jitted
function repeatedly (the forward may be recorded into a command buffer).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

jax.config.update("jax_enable_x64", True)

import jax_flash  # noqa: E402
from jax_flash import _ffi  # noqa: E402


def reference(q, k, v, *, causal=False, softcap=None, window=None):
  """Dense attention in float64 (B, S, H, D), GQA by repetition."""
  q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  i = jnp.arange(q.shape[1])[:, None]
  j = jnp.arange(k.shape[1])[None, :]
  visible = jnp.ones((q.shape[1], k.shape[1]), bool)
  if causal:
    visible &= j <= i
  if window is not None:
    visible &= (j >= i - window[0]) & (j <= i + window[1])
  s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = jnp.where(l > 0, p / jnp.where(l > 0, l, 1), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def rel_err(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def main() -> int:
  print("devices:", jax.devices())
  print("build_info:", _ffi.build_info())
  gpu = jax.devices("gpu")[0]
  rng = np.random.default_rng(0)
  failures = 0

  def check(name, err, tol):
    nonlocal failures
    ok = err <= tol
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})", flush=True)

  shapes = [(2, 17, 33, 4, 2, 40), (1, 127, 200, 6, 2, 72), (2, 64, 64, 2, 1, 256)]
  configs = [dict(), dict(causal=True), dict(softcap=3.0, window=(8, 4)),
             dict(causal=True, softcap=2.0)]
  for (B, Sq, Sk, Hq, Hkv, D) in shapes:
    q = rng.standard_normal((B, Sq, Hq, D))
    k = rng.standard_normal((B, Sk, Hkv, D))
    v = rng.standard_normal((B, Sk, Hkv, D))
    for cfg in configs:
      kw = dict(is_causal=cfg.get("causal", False), logits_soft_cap=cfg.get("softcap"),
                local_window_size=cfg.get("window"))
      ref_fn = lambda q, k, v: reference(q, k, v, **cfg)
      fn = lambda q, k, v: jax_flash.flash_attention(q, k, v, **kw)
      tag = f"B{B} Sq{Sq} Sk{Sk} H{Hq}/{Hkv} D{D} {cfg}"
      ref_out = ref_fn(q, k, v)
      ct = rng.standard_normal(ref_out.shape)
      ref_grads = jax.grad(lambda *a: jnp.sum(ref_fn(*a) * ct), argnums=(0, 1, 2))(q, k, v)
      for dtype, tol in ((jnp.float64, 1e-11), (jnp.float32, 2e-5), (jnp.bfloat16, 3e-2),
                         (jnp.float16, 4e-3)):
        args = [jax.device_put(jnp.asarray(x, dtype), gpu) for x in (q, k, v)]
        exact_args = [np.asarray(a, np.float64) for a in args]
        ref_out_d = ref_fn(*exact_args)
        out = jax.jit(fn)(*args)
        check(f"{jnp.dtype(dtype).name:8s} out  {tag}", rel_err(out, ref_out_d), tol)
        ref_g = jax.grad(lambda *a: jnp.sum(ref_fn(*a) * ct), argnums=(0, 1, 2))(*exact_args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float64) * ct),
                                 argnums=(0, 1, 2)))(*args)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
          check(f"{jnp.dtype(dtype).name:8s} {name}   {tag}", rel_err(g, r), tol * 2)
      del ref_grads

  # check_grads in float64 on the GPU (finite differences vs the VJP).
  q = jax.device_put(rng.standard_normal((1, 9, 2, 24)), gpu)
  k = jax.device_put(rng.standard_normal((1, 13, 1, 24)), gpu)
  v = jax.device_put(rng.standard_normal((1, 13, 1, 24)), gpu)
  for kw in (dict(), dict(is_causal=True), dict(logits_soft_cap=2.0, local_window_size=(3, 2))):
    try:
      check_grads(lambda q, k, v: jax_flash.flash_attention(q, k, v, **kw), (q, k, v),
                  order=1, modes=("rev",))
      print(f"ok   check_grads float64 {kw}")
    except AssertionError as e:
      failures += 1
      print(f"FAIL check_grads float64 {kw}: {e}")

  # Repeated jitted calls with fresh inputs (command buffers may replay).
  f = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True))
  for it in range(4):
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((2, 50, 4, 64)), jnp.float32), gpu)
               for _ in range(3))
    check(f"jit replay {it}", rel_err(f(q, k, v), reference(q, k, v, causal=True)), 2e-5)

  print(f"{failures} failures")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())

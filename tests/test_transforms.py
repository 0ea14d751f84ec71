"""jit, grad, vmap, checkpoint and their compositions, and check_grads in float64."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from reference import Options, attention, make_inputs, visible_mask

OPTION_KWARGS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(5, 2)),
    "softcap": dict(logits_soft_cap=1.5),
    "scale": dict(scale=0.7),
}


def inputs64(seed=0, shape=(2, 13, 11, 4, 2, 8)):
  rng = np.random.default_rng(seed)
  x = make_inputs(rng, *shape)
  return x, jnp.asarray(x.q), jnp.asarray(x.k), jnp.asarray(x.v)


@pytest.mark.parametrize("option", sorted(OPTION_KWARGS))
def test_check_grads_float64(backend, option):
  _, q, k, v = inputs64(1)
  f = functools.partial(jax_flash.flash_attention, **OPTION_KWARGS[option])
  check_grads(f, (q, k, v), order=1, modes=["rev"])


@pytest.mark.parametrize("mask_kind", ["lengths", "segments"])
def test_check_grads_float64_with_mask_operands(backend, mask_kind):
  x, q, k, v = inputs64(2)
  opts = Options(with_lengths=mask_kind == "lengths", with_segments=mask_kind == "segments")
  # Keep at least one visible key per batch so the function is smooth there.
  x.kv_lengths[:] = np.maximum(x.kv_lengths, 3)
  kwargs = opts.kwargs(x)
  f = lambda q, k, v: jax_flash.flash_attention(q, k, v, **kwargs)
  check_grads(f, (q, k, v), order=1, modes=["rev"])


def loss(q, k, v, **kwargs):
  return jnp.sum(jnp.sin(jax_flash.flash_attention(q, k, v, **kwargs)))


def test_jit_matches_eager(backend):
  _, q, k, v = inputs64(3)
  eager = jax_flash.flash_attention(q, k, v, is_causal=True)
  jitted = jax.jit(functools.partial(jax_flash.flash_attention, is_causal=True))(q, k, v)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_vmap_over_batch_like_axis(backend):
  _, q, k, v = inputs64(4, shape=(3, 9, 7, 2, 1, 8))
  f = functools.partial(jax_flash.flash_attention, is_causal=True)
  # Treat the batch axis as a vmapped axis of per-example (1, S, H, D) calls.
  batched = jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0]
  np.testing.assert_allclose(np.asarray(batched), np.asarray(f(q, k, v)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_axes", [0, (None, 0, 0)], ids=["all", "keys_only"])
def test_vmap_over_an_axis_of_size_zero(backend, in_axes):
  """As jax.nn: empty results, for the forward, its tangent and gradient;
  and jacrev of a call without query rows (a vmap over zero cotangents)."""
  _, q, k, v = inputs64(6, shape=(2, 5, 7, 2, 1, 8))
  empty = lambda x: x[None][:0]
  args = (q if in_axes != 0 else empty(q), empty(k), empty(v))
  f = functools.partial(jax_flash.flash_attention, is_causal=True)
  assert jax.vmap(f, in_axes)(*args).shape == (0,) + q.shape
  _, tangent = jax.vmap(lambda *a: jax.jvp(f, a, a), in_axes)(*args)
  assert tangent.shape == (0,) + q.shape
  loss = lambda q, k, v: f(q, k, v).sum()
  grads = jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes)(*args)
  assert [g.shape for g in grads] == [(0,) + x.shape for x in (q, k, v)]
  jac = jax.jacrev(f, argnums=(0, 1, 2))(q[:, :0], k, v)
  assert [j.shape for j in jac] == [q[:, :0].shape + x.shape for x in (q[:, :0], k, v)]


def test_vmap_over_query_only_folds_into_heads(backend):
  _, q, k, v = inputs64(5, shape=(2, 9, 7, 4, 2, 8))
  queries = jnp.stack([q, 2 * q, -q])  # (3, B, T, N, H)
  f = functools.partial(jax_flash.flash_attention, local_window_size=(2, 1))
  got = jax.vmap(f, in_axes=(0, None, None))(queries, k, v)
  want = jnp.stack([f(x, k, v) for x in queries])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
  jaxpr = str(jax.make_jaxpr(jax.vmap(f, in_axes=(0, None, None)))(queries, k, v))
  assert "flash_fwd" in jaxpr and "broadcast_in_dim" not in jaxpr  # K/V were not copied


def test_vmap_with_mapped_lengths_and_residual(backend):
  x, q, k, v = inputs64(6, shape=(2, 9, 7, 2, 2, 8))
  lengths = jnp.asarray([[3, 7], [7, 1]], jnp.int32)  # (vmapped, batch)
  f = lambda q, n: jax_flash.flash_attention(q, k, v, key_value_seq_lengths=n,
                                             return_residual=True)
  out, lse = jax.vmap(f, in_axes=(None, 0))(q, lengths)
  for i in range(2):
    o, l = f(q, lengths[i])
    np.testing.assert_allclose(np.asarray(out[i]), np.asarray(o), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(l), rtol=1e-12, atol=1e-12)


def test_grad_of_vmap_and_vmap_of_grad(backend):
  _, q, k, v = inputs64(7, shape=(2, 8, 8, 2, 1, 4))
  qs = jnp.stack([q, 0.5 * q])
  per_example = lambda q: loss(q, k, v, is_causal=True)
  vg = jax.jit(jax.vmap(jax.grad(per_example)))(qs)
  gv = jax.jit(jax.grad(lambda qs: jnp.sum(jax.vmap(per_example)(qs))))(qs)
  want = jnp.stack([jax.grad(per_example)(x) for x in qs])
  np.testing.assert_allclose(np.asarray(vg), np.asarray(want), rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(np.asarray(gv), np.asarray(want), rtol=1e-10, atol=1e-12)


def test_vmap_of_grad_wrt_shared_keys(backend):
  """Per-example dK when only the query is mapped: the backward must not sum over examples."""
  _, q, k, v = inputs64(8, shape=(1, 6, 6, 2, 2, 4))
  qs = jnp.stack([q, -q, 3 * q])
  grad_k = jax.grad(lambda k, q: loss(q, k, v), argnums=0)
  got = jax.vmap(grad_k, in_axes=(None, 0))(k, qs)
  want = jnp.stack([grad_k(k, x) for x in qs])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias_shape", [(1, 4, 13, 11), (2, 1, 13, 11), (13, 11), (4, 1, 11)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_vmap_over_a_bias_and_its_gradient(backend, bias_shape):
  """A mapped bias, broadcast over the batch or heads inside each example: the
  per-example bias gradient keeps the bias's shape (summed over what it
  broadcasts along), as the float64 reference's."""
  x, q, k, v = inputs64(12)
  biases = jnp.asarray(np.random.default_rng(12).standard_normal((3,) + bias_shape))
  visible = jnp.ones((1, 1, 13, 11), bool)
  value_and_grad = lambda f: jax.vmap(jax.value_and_grad(
      lambda b: jnp.sum(jnp.sin(f(b))) + jnp.sum(f(b) * x.dout)))(biases)
  got = value_and_grad(lambda b: jax_flash.flash_attention(q, k, v, bias=b))
  want = value_and_grad(lambda b: attention(q, k, v, visible, Options(), bias=b)[0])
  for a, b in zip(got, want):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


# -- the bias's gradient: computed only when the bias is differentiated -------


# The platforms whose lowering a test can inspect: CUDA's wherever it was built.
LOWERING_PLATFORMS = ("cpu", "cuda") if jax_flash.build_info()["cuda"] else ("cpu",)


def bwd_dbias_result(fn, *args, platform="cpu") -> str:
  """The dbias result type of the one backward call in fn's lowering."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  calls = [line for line in text.splitlines() if "custom_call @jax_flash_bwd(" in line]
  assert len(calls) == 1, calls
  return re.findall(r"tensor<[^>]*>", calls[0].rsplit("->", 1)[1])[3]


def causal_loss(attend):
  return lambda q, k, v, b: jnp.sum(jnp.sin(attend(q, k, v, b)))


def flash_causal(q, k, v, b):
  return jax_flash.flash_attention(q, k, v, bias=b, is_causal=True)


def dense_causal(x):
  visible = jnp.asarray(visible_mask(Options(is_causal=True), x))
  return lambda q, k, v, b: attention(q, k, v, visible, Options(is_causal=True), bias=b)[0]


@pytest.mark.parametrize("bias_shape", [(2, 4, 13, 11), (1, 1, 13, 11)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_grad_wrt_qkv_only_computes_no_dbias(backend, bias_shape):
  """grad with respect to q, k, v with a bias (a plain argument of the jitted
  function): the backward's dbias result is absent, and dq, dk, dv are the
  reference's; with respect to the bias too, dbias is computed and right."""
  x, q, k, v = inputs64(14)
  bias = jnp.asarray(np.random.default_rng(14).standard_normal(bias_shape))
  want = jax.grad(causal_loss(dense_causal(x)), argnums=(0, 1, 2, 3))(q, k, v, bias)
  for argnums in ((0, 1, 2), (0, 1, 2, 3)):
    grad = jax.jit(jax.grad(causal_loss(flash_causal), argnums=argnums))
    got = grad(q, k, v, bias)
    assert len(got) == len(argnums)
    for a, b in zip(got, want):
      assert a.shape == b.shape
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
    dbias = "x".join(map(str, bias_shape)) if 3 in argnums else "0"
    for platform in LOWERING_PLATFORMS:
      assert bwd_dbias_result(grad, q, k, v, bias, platform=platform) == f"tensor<{dbias}xf64>"


@pytest.mark.parametrize("argnums", [(0,), (0, 3)], ids=["q", "q_and_bias"])
def test_vmap_of_grad_with_a_bias_broadcast_over_batch_and_heads(backend, argnums):
  """Per-example gradients with one bias (1, 1, T, S) for every example and
  batch element: the folded backward sums dbias back to the bias's shape
  when it is asked for, and its absent dbias stays absent when it is not."""
  x, q, k, v = inputs64(15)
  queries = jnp.stack([q, -0.5 * q, 2 * q])
  bias = jnp.asarray(np.random.default_rng(15).standard_normal((1, 1, 13, 11)))
  per_example = lambda loss: jax.jit(jax.vmap(jax.grad(loss, argnums=argnums),
                                              in_axes=(0, None, None, None)))
  got = per_example(causal_loss(flash_causal))(queries, k, v, bias)
  dense_grad = jax.grad(causal_loss(dense_causal(x)), argnums=argnums)
  want = [jnp.stack(g) for g in zip(*(dense_grad(qx, k, v, bias) for qx in queries))]
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
  # The folded call's dbias is the folded bias's (batch 3 x 2), summed back afterwards.
  dbias = "6x1x13x11" if 3 in argnums else "0"
  assert bwd_dbias_result(per_example(causal_loss(flash_causal)), queries, k, v,
                          bias) == f"tensor<{dbias}xf64>"


def test_jvp_of_grad_wrt_qkv_with_a_moving_bias(backend):
  """Forward over reverse: the gradient with respect to q, k, v (dbias not
  computed), pushed forward along tangents of q, k, v and the bias."""
  x, q, k, v = inputs64(16, shape=(2, 9, 7, 2, 1, 4))
  rng = np.random.default_rng(16)
  bias = jnp.asarray(rng.standard_normal((2, 1, 9, 7)))
  primals = (q, k, v, bias)
  tangents = tuple(jnp.asarray(rng.standard_normal(p.shape)) for p in primals)
  jvp_of_grad = lambda loss: jax.jit(lambda p, t: jax.jvp(
      jax.grad(loss, argnums=(0, 1, 2)), p, t))
  got = jvp_of_grad(causal_loss(flash_causal))(primals, tangents)
  want = jvp_of_grad(causal_loss(dense_causal(x)))(primals, tangents)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_vmap_over_a_mask(backend):
  x, q, k, v = inputs64(13)
  masks = np.random.default_rng(13).random((3, 2, 1, 13, 11)) > 0.4
  masks[..., 0] = True
  got = jax.vmap(lambda m: jax_flash.flash_attention(q, k, v, mask=m))(jnp.asarray(masks))
  for m, g in zip(masks, got):
    want = attention(q, k, v, jnp.asarray(m), Options())[0]
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_checkpoint(backend):
  _, q, k, v = inputs64(9)
  f = lambda q, k, v: loss(q, k, v, is_causal=True)
  plain = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(plain, remat):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_residual_is_stop_gradient(backend):
  _, q, k, v = inputs64(10)
  g = jax.grad(lambda q: jnp.sum(jax_flash.flash_attention(q, k, v, return_residual=True)[1]))(q)
  assert float(jnp.abs(g).max()) == 0

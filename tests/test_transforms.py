"""jit, grad, vmap, checkpoint and their compositions, and check_grads in float64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from reference import Options, attention, make_inputs

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

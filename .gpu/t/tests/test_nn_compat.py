"""JAX's own tests of jax.nn.dot_product_attention, run against the drop-in.

The `testDotProductAttention*` cases of the jax repository's tests/nn_test.py,
re-expressed here: the same shapes, options and tolerances, with
jax_flash.dot_product_attention as the implementation under test and jax.nn's
XLA path as the reference (theirs compare cuDNN with XLA). Then the bias and
mask shapes jax.nn takes, what it refuses, and the one place jax_flash
differs on purpose.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import jax_flash

reference = partial(jax.nn.dot_product_attention, implementation="xla")


@pytest.fixture(autouse=True)
def on_each_backend(backend):
  """Every test runs on the CPU and, if there is one, the GPU."""
  return backend


def assert_close(got, want, tol):
  """jax's assertAllClose with atol = rtol = tol, in float32."""
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=tol, rtol=tol)


# -- testDotProductAttention ---------------------------------------------------

@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_dot_product_attention(dtype, group_num, use_vmap):
  B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
  keys = random.split(random.PRNGKey(0), 5)
  Q = random.normal(keys[0], (B, T, N, H), dtype)
  K = random.normal(keys[1], (B, S, N // G, H), dtype)
  V = random.normal(keys[2], (B, S, N // G, H), dtype)
  grad = random.normal(keys[3], (B, T, N, H), dtype)
  lse_grad = random.normal(keys[4], (B, T, N), dtype)
  bias, mask = None, None

  sdpa_ref = reference
  sdpa_ans = jax_flash.dot_product_attention
  sdpa_ref_lse = partial(reference, return_residual=True)
  sdpa_ans_lse = partial(jax_flash.dot_product_attention, return_residual=True)
  if use_vmap:  # 3-d inputs per example
    sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)

  # The reference runs without GQA: K and V repeated per group.
  K_ref = jnp.repeat(K, G, axis=2)
  V_ref = jnp.repeat(V, G, axis=2)
  out_ref, sdpa_vjp_ref = jax.vjp(sdpa_ref, Q, K_ref, V_ref, bias, mask)
  out_ans, sdpa_vjp_ans = jax.vjp(sdpa_ans, Q, K, V, bias, mask)
  out_ref_lse, sdpa_vjp_ref_lse = jax.vjp(sdpa_ref_lse, Q, K_ref, V_ref, bias, mask)
  out_ans_lse, sdpa_vjp_ans_lse = jax.vjp(sdpa_ans_lse, Q, K, V, bias, mask)

  dQ_ref, dK_ref, dV_ref = sdpa_vjp_ref(grad)[:3]
  dQ_ans, dK_ans, dV_ans = sdpa_vjp_ans(grad)[:3]
  dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
  dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)
  # Both return the residual under stop_gradient: lse_grad changes nothing.
  dQ_ref_lse, dK_ref_lse, dV_ref_lse = sdpa_vjp_ref_lse((grad, lse_grad))[:3]
  dQ_ans_lse, dK_ans_lse, dV_ans_lse = sdpa_vjp_ans_lse((grad, lse_grad))[:3]
  dK_ref_lse = dK_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)
  dV_ref_lse = dV_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)

  assert out_ans.dtype == out_ref.dtype and out_ans_lse[1].dtype == out_ref_lse[1].dtype
  for got, want in [(out_ans, out_ref), (dQ_ans, dQ_ref), (dK_ans, dK_ref), (dV_ans, dV_ref),
                    (out_ans_lse[0], out_ref_lse[0]), (out_ans_lse[1], out_ref_lse[1]),
                    (dQ_ans_lse, dQ_ref_lse), (dK_ans_lse, dK_ref_lse),
                    (dV_ans_lse, dV_ref_lse)]:
    assert_close(got, want, 0.01)


# -- testDotProductAttentionMask -----------------------------------------------

@pytest.mark.parametrize("mask_mode", [
    "bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
    ("bias", "causal"), ("causal", "sliding_window")],
    ids=lambda mode: mode if isinstance(mode, str) else "+".join(mode))
def test_dot_product_attention_mask(mask_mode):
  if isinstance(mask_mode, str):
    mask_mode = (mask_mode,)
  dtype = jnp.bfloat16
  B, S, T, N, H = 2, 128, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 5)
  Q = random.normal(keys[0], (B, T, N, H), dtype)
  K = random.normal(keys[1], (B, S, N, H), dtype)
  V = random.normal(keys[2], (B, S, N, H), dtype)
  grad = random.normal(keys[3], (B, T, N, H), dtype)
  bias, mask = None, None
  q_seqlen, kv_seqlen = None, None
  window_size = None

  is_causal = "causal" in mask_mode
  if "padding" in mask_mode:
    q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
    kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
  if "custom" in mask_mode:
    mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]  # a causal mask
  if "bias" in mask_mode:
    bias = random.normal(keys[4], (1, N, T, S), dtype)
  if "sliding_window" in mask_mode:
    window_size = (3, 2) if is_causal else (3, 0)

  def call(sdpa):
    return lambda q, k, v, b, m, qs, kvs: sdpa(
        q, k, v, b, m, is_causal=is_causal, query_seq_lengths=qs, key_value_seq_lengths=kvs,
        local_window_size=window_size)

  args = (Q, K, V, bias, mask, q_seqlen, kv_seqlen)
  out_ref, sdpa_vjp_ref = jax.vjp(call(reference), *args)
  out_ans, sdpa_vjp_ans = jax.vjp(call(jax_flash.dot_product_attention), *args)
  dQ_ref, dK_ref, dV_ref, dbias_ref = sdpa_vjp_ref(grad)[:4]
  dQ_ans, dK_ans, dV_ans, dbias_ans = sdpa_vjp_ans(grad)[:4]
  assert_close(out_ans, out_ref, 0.01)
  assert_close(dQ_ans, dQ_ref, 0.02)
  assert_close(dK_ans, dK_ref, 0.02)
  assert_close(dV_ans, dV_ref, 0.01)
  if bias is not None:
    assert dbias_ans.shape == bias.shape and dbias_ans.dtype == bias.dtype
    assert_close(dbias_ans, dbias_ref, 0.02)


# -- testDotProductAttentionFloat64MaskDebugInfs --------------------------------

@pytest.mark.parametrize("values", ["zeros", "random"])
def test_dot_product_attention_float64_mask_debug_infs(values):
  """A 1-d mask (S,) with 3-d inputs, under jax.debug_infs, warns about nothing.

  jax's test uses zeros (where any output is 0); random values also check the
  result against jax.nn.
  """
  T, S, K, N, H = 5, 7, 3, 6, 11
  make = jnp.zeros if values == "zeros" else (
      lambda shape, dtype, key=iter(random.split(random.PRNGKey(1), 3)): random.normal(
          next(key), shape, dtype))
  q, k, v = make((T, N, H), jnp.float64), make((S, K, H), jnp.float64), make((S, K, H),
                                                                             jnp.float64)
  mask = jnp.arange(S) <= S // 2
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with jax.debug_infs(True):
      out = jax_flash.dot_product_attention(q, k, v, mask=mask).block_until_ready()
  assert_close(out, reference(q, k, v, mask=mask), 1e-6)  # jax.nn's softmax is float32


# -- testDotProductAttentionBiasGradient ----------------------------------------

@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_dot_product_attention_bias_gradient(batch_size, use_vmap):
  dtype = jnp.bfloat16
  B, S, N, H = batch_size, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 2)
  x = random.normal(keys[0], (B, S, N, H), dtype)
  bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
  mask = jnp.ones((1, 1, S), dtype=jnp.bool_)  # 3-d: broadcast from the right

  def attention(x, bias, mask, sdpa):
    return sdpa(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

  attn_ref = partial(attention, sdpa=reference)
  attn_ans = partial(attention, sdpa=jax_flash.dot_product_attention)
  if use_vmap:  # 3-d inputs and a 3-d bias (N, S, S) per example
    attn_batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
    attn_batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
  else:
    attn_batched_ref, attn_batched_ans = attn_ref, attn_ans

  y_ref = jax.jit(attn_batched_ref)(x, bias, mask)
  y_ans = jax.jit(attn_batched_ans)(x, bias, mask)
  assert_close(y_ans, y_ref, 1e-2)  # jax's default tolerance for bfloat16

  def bwd(attn):  # (jax's test differentiates the unbatched function here too)
    return jax.jit(lambda x, bias, mask: jax.vjp(attn, x, bias, mask)[1](x))

  _, dbias_ref, _ = bwd(attn_ref)(x, bias, mask)
  _, dbias_ans, _ = bwd(attn_ans)(x, bias, mask)
  assert dbias_ans.shape == bias.shape and dbias_ans.dtype == bias.dtype
  assert_close(dbias_ans, dbias_ref, 0.1)


# -- testDotProductAttention_localWindowSizeWithoutMask ------------------------

def test_dot_product_attention_local_window_size_without_mask():
  dtype = jnp.float32
  B, S, T, N, H = 2, 128, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 3)
  Q = random.normal(keys[0], (B, T, N, H), dtype)
  K = random.normal(keys[1], (B, S, N, H), dtype)
  V = random.normal(keys[2], (B, S, N, H), dtype)
  large = jax_flash.dot_product_attention(Q, K, V, mask=None, local_window_size=(32, 32))
  small = jax_flash.dot_product_attention(Q, K, V, mask=None, local_window_size=(1, 1))
  assert not jnp.allclose(large, small)  # jax's test
  # Beyond jax's test: each one is jax.nn's.
  assert_close(large, reference(Q, K, V, local_window_size=(32, 32)), 1e-5)
  assert_close(small, reference(Q, K, V, local_window_size=(1, 1)), 1e-5)


# -- every bias and mask shape jax.nn takes ------------------------------------

B, T, S, N, K, H = 2, 9, 11, 4, 2, 8
# Shapes jax.nn accepts: at most 4 dims, padded with leading 1s, then
# broadcast to (B, N, T, S) (to (1, N, T, S) for 3-d inputs).
BATCHED_SHAPES = [(), (S,), (1, S), (T, 1), (T, S), (N, 1, 1), (N, T, S), (1, 1, S),
                  (B, 1, 1, S), (1, N, T, 1), (B, N, T, S)]
UNBATCHED_SHAPES = [(), (S,), (T, S), (N, 1, S), (N, T, S), (1, N, T, S), (1, 1, T, 1)]


# float32, whose precision jax.nn computes in (its softmax is float32 even for
# float64 inputs); a mistake in broadcasting is an O(1) error. (The gradient of
# a bias constant along keys is a sum that cancels to ~1e-7: hence the atol.)
TOL = dict(rtol=1e-5, atol=1e-5)


def shape_id(shape):
  return "x".join(map(str, shape)) or "scalar"


def problem(batched=True, seed=0):
  rng = np.random.default_rng(seed)
  lead = (B,) if batched else ()
  return (jnp.asarray(rng.standard_normal(lead + (T, N, H)), jnp.float32),
          jnp.asarray(rng.standard_normal(lead + (S, K, H)), jnp.float32),
          jnp.asarray(rng.standard_normal(lead + (S, K, H)), jnp.float32))


def random_bias_and_mask(shape, seed=1):
  rng = np.random.default_rng(seed)
  mask = rng.random(shape) > 0.3
  if shape:
    mask[..., 0] = True
  else:
    mask = np.asarray(True)  # every row sees a key: where none does, jax_flash differs on purpose
  return jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.asarray(mask)


def check_against_jax_nn(q, k, v, bias, mask, vmapped=False):
  """Output and the gradients of q and bias, against jax.nn."""
  def loss(sdpa):
    f = partial(sdpa, is_causal=True)
    if vmapped:
      f = jax.vmap(f, in_axes=(0, 0, 0, 0, None))
    return lambda q, bias: jnp.sum(jnp.sin(f(q, k, v, bias, mask)))
  ours = jax.value_and_grad(loss(jax_flash.dot_product_attention), argnums=(0, 1))(q, bias)
  theirs = jax.value_and_grad(loss(reference), argnums=(0, 1))(q, bias)
  for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("shape", BATCHED_SHAPES, ids=shape_id)
def test_bias_and_mask_shapes_with_4d_inputs(shape):
  q, k, v = problem()
  check_against_jax_nn(q, k, v, *random_bias_and_mask(shape))


@pytest.mark.parametrize("shape", UNBATCHED_SHAPES, ids=shape_id)
def test_bias_and_mask_shapes_with_3d_inputs(shape):
  q, k, v = problem(batched=False)
  check_against_jax_nn(q, k, v, *random_bias_and_mask(shape))


@pytest.mark.parametrize("bias_shape", [(N, T, S), (1, T, S), (S,)], ids=shape_id)
def test_bias_and_mask_under_vmap(bias_shape):
  """3-d inputs per example, a mapped bias (any of its shapes) and a shared mask."""
  q, k, v = problem()
  bias, _ = random_bias_and_mask((B,) + bias_shape)
  _, mask = random_bias_and_mask((1, T, S), seed=2)
  check_against_jax_nn(q, k, v, bias, mask, vmapped=True)


def test_bias_of_any_dtype_and_array_likes_as_jax_nn():
  """jax.nn adds an integer or boolean bias to its float logits, and takes lists."""
  q, k, v = problem()
  int_bias = jnp.asarray(np.random.default_rng(3).integers(-2, 3, (N, T, S)), jnp.int32)
  mask = [[True] * (S - 1) + [False]]  # a nested list, shape (1, S)
  for bias in (int_bias, int_bias > 0, np.asarray(int_bias).tolist()):
    np.testing.assert_allclose(
        np.asarray(jax_flash.dot_product_attention(q, k, v, bias, mask)),
        np.asarray(reference(q, k, v, bias, mask)), **TOL)


REFUSED = [
    # (case, bias, mask, jax.nn's exception, ours)
    ("bias of 5 dims", np.zeros((1, B, N, T, S)), None, ValueError, ValueError),
    ("mask of 5 dims", None, np.ones((1, 1, 1, 1, S), bool), ValueError, ValueError),
    ("bias keys", np.zeros((B, N, T, 5)), None, TypeError, ValueError),
    ("bias batch", np.zeros((3, N, T, S)), None, TypeError, ValueError),
    ("bias heads", np.zeros((B, 3, T, S)), None, AssertionError, ValueError),
    ("mask rows", None, np.ones((5, S), bool), TypeError, ValueError),
    ("mask heads", None, np.ones((3, T, S), bool), AssertionError, ValueError),
    ("mask dtype", None, np.ones((T, S), np.float32), ValueError, ValueError),
]


@pytest.mark.parametrize("bias,mask,theirs,ours", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refuses_what_jax_nn_refuses(bias, mask, theirs, ours):
  """Refused by both; where jax.nn's error comes from deep inside (a TypeError of
  its broadcasting add, an AssertionError), jax_flash raises a ValueError that
  names the argument and the shape it must broadcast to."""
  q, k, v = problem()
  with pytest.raises(theirs):
    reference(q, k, v, bias, mask)
  with pytest.raises(ours, match="bias" if bias is not None else "mask"):
    jax_flash.dot_product_attention(q, k, v, bias, mask)


# -- the difference on purpose --------------------------------------------------

def test_rows_that_see_no_key_output_zero_where_jax_nn_averages_values():
  """jax_flash's documented behaviour: a row that sees no key outputs 0, with a
  logsumexp of -inf and zero gradients; jax.nn gives it the mean of all values
  (softmax over uniformly large negative logits). Every other row agrees."""
  q, k, v = problem()
  mask = np.ones((B, 1, T, S), bool)
  mask[0, :, 3] = False                         # one row of batch element 0 sees nothing
  lengths = jnp.asarray([S, 0], jnp.int32)      # and no row of batch element 1 sees anything
  kwargs = dict(mask=jnp.asarray(mask), key_value_seq_lengths=lengths, return_residual=True)
  out, lse = jax_flash.dot_product_attention(q, k, v, **kwargs)
  their_out, their_lse = reference(q, k, v, **kwargs)
  empty = np.zeros((B, T), bool)
  empty[0, 3] = True
  empty[1] = True
  assert np.all(np.asarray(out)[empty] == 0)
  assert np.all(np.asarray(lse)[empty] == -np.inf)
  mean_v = np.repeat(np.asarray(v).mean(axis=1), N // K, axis=1)  # (B, N, H)
  np.testing.assert_allclose(np.asarray(their_out)[empty],
                             np.broadcast_to(mean_v[:, None], out.shape)[empty], **TOL)
  np.testing.assert_allclose(np.asarray(out)[~empty], np.asarray(their_out)[~empty], **TOL)
  np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(their_lse)[~empty], **TOL)
  dq = jax.grad(lambda q: jnp.sum(jax_flash.dot_product_attention(q, k, v, **kwargs)[0]))(q)
  assert np.all(np.asarray(dq)[empty] == 0)

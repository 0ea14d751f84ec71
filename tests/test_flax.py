"""jax_flash.flax.attention_fn inside Flax's modules equals Flax's own attention.

Each test builds a Flax attention module twice on the same parameters, once
with Flax's default attention_fn and once with jax_flash's, and compares the
outputs and the gradients (parameters and inputs) under jax.jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx.nn import attention as nnx_attention  # noqa: E402

import jax_flash  # noqa: E402
import jax_flash.flax as jf  # noqa: E402

TOLERANCE = {jnp.float32: dict(rtol=2e-5, atol=2e-6), jnp.float64: dict(rtol=1e-11, atol=1e-12)}
DTYPES = [jnp.float32, jnp.float64]
BATCH, LENGTH, FEATURES, HEADS = 2, 23, 24, 3  # odd length: partial blocks


def _kernel_accepts(**kwargs) -> bool:
  """Whether flash_attention takes these keyword arguments yet (dense masks and
  dropout arrive with a later kernel change; until then those tests skip)."""
  q = jnp.zeros((1, 4, 1, 8), jnp.float32)
  try:
    jax.eval_shape(functools.partial(jax_flash.flash_attention, **kwargs), q, q, q)
  except (TypeError, NotImplementedError):
    return False
  return True


HAS_MASK = _kernel_accepts(mask=jnp.ones((1, 1, 4, 4), bool))
HAS_BIAS = _kernel_accepts(bias=jnp.zeros((1, 1, 4, 4), jnp.float32))
HAS_DROPOUT = _kernel_accepts(dropout_rate=0.5, dropout_rng=jax.random.key(0))
needs_mask = pytest.mark.skipif(not HAS_MASK, reason="dense masks not in the kernels yet")
needs_bias = pytest.mark.skipif(not HAS_BIAS, reason="dense bias not in the kernels yet")
needs_dropout = pytest.mark.skipif(not HAS_DROPOUT, reason="dropout not in the kernels yet")


def _inputs(dtype, seed=0, shape=(BATCH, LENGTH, FEATURES)):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _assert_tree_close(got, want, dtype):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOLERANCE[dtype])


# -- linen ---------------------------------------------------------------------


def _linen_pair(dtype, *, flash_fn=jf.attention_fn, row_weights=None, **call_kwargs):
  """Outputs and gradients of jax_flash vs Flax in MultiHeadDotProductAttention.

  row_weights (B, T) weights each query row in the loss: rows that see no key
  differ on purpose (jax_flash outputs 0, Flax the mean of the values).
  """
  x = _inputs(dtype)
  def make(fn):
    kwargs = {} if fn is None else dict(attention_fn=fn)
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=dtype, param_dtype=dtype,
                                           **kwargs)
  params = make(None).init(jax.random.key(1), x)
  weights = jnp.ones(x.shape[:2], dtype) if row_weights is None else row_weights.astype(dtype)
  cotangent = _inputs(dtype, seed=2)

  def run(module, flash_call_kwargs):
    @jax.jit
    def loss_and_out(params, x):
      out = module.apply(params, x, **flash_call_kwargs)
      return jnp.sum(out * cotangent * weights[..., None]), out
    (_, out), grads = jax.value_and_grad(loss_and_out, argnums=(0, 1), has_aux=True)(params, x)
    return out * weights[..., None], grads

  flax_kwargs, flash_kwargs = call_kwargs.get("flax", {}), call_kwargs.get("flash", {})
  return run(make(flash_fn), flash_kwargs), run(make(None), flax_kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_causal_fast_path_matches_flax_causal_mask(dtype):
  causal = nn.make_causal_mask(jnp.ones((BATCH, LENGTH)))
  got, want = _linen_pair(dtype, flash_fn=jf.make_attention_fn(is_causal=True),
                          flax=dict(mask=causal))
  _assert_tree_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_no_mask(dtype):
  got, want = _linen_pair(dtype)
  _assert_tree_close(got, want, dtype)


@needs_mask
@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_dense_causal_mask(dtype):
  causal = nn.make_causal_mask(jnp.ones((BATCH, LENGTH)))
  got, want = _linen_pair(dtype, flash=dict(mask=causal), flax=dict(mask=causal))
  _assert_tree_close(got, want, dtype)


@needs_mask
@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_padding_mask_with_causal(dtype):
  # Batch element 0 has 17 real tokens, element 1 all 23: a (B, 1, T, S)
  # float mask from make_attention_mask, combined with the causal fast path.
  lengths = jnp.array([17, LENGTH])
  valid = jnp.arange(LENGTH)[None, :] < lengths[:, None]
  padding = nn.make_attention_mask(valid, valid)
  causal = nn.make_causal_mask(jnp.ones((BATCH, LENGTH)))
  got, want = _linen_pair(dtype, flash_fn=jf.make_attention_fn(is_causal=True),
                          row_weights=valid, flash=dict(mask=padding),
                          flax=dict(mask=nn.combine_masks(padding, causal)))
  _assert_tree_close(got, want, dtype)


# -- nnx -----------------------------------------------------------------------


def _flax_weights_attention(query, key, value, bias=None, mask=None, *, is_causal=False,
                            **unused):
  """nnx's attention through its explicit-weights path (einsum, softmax in dtype).

  nnx's default attention_fn hands dropout-free calls to
  jax.nn.dot_product_attention, which forms float64 logits in float32; this
  path keeps float64 exact, so it is the float64 reference.
  """
  weights = nnx_attention.dot_product_attention_weights(query, key, bias, mask,
                                                       is_causal=is_causal)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value)


def _nnx_pair(dtype, *, flash_fn=jf.attention_fn, **call_kwargs):
  x = _inputs(dtype)
  def make(fn):
    if fn is None and dtype == jnp.float64:
      fn = _flax_weights_attention
    kwargs = {} if fn is None else dict(attention_fn=fn)
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                  dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0),
                                  **kwargs)
  cotangent = _inputs(dtype, seed=2)

  def run(module):
    graphdef, state = nnx.split(module)

    @jax.jit
    def loss_and_out(state, x):
      out = nnx.merge(graphdef, state)(x, **call_kwargs)
      return jnp.sum(out * cotangent), out
    (_, out), grads = jax.value_and_grad(loss_and_out, argnums=(0, 1), has_aux=True)(state, x)
    return out, grads

  return run(make(flash_fn)), run(make(None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_is_causal_argument(dtype):
  got, want = _nnx_pair(dtype, is_causal=True)
  _assert_tree_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_make_attention_fn_causal(dtype):
  (got_out, _), _ = _nnx_pair(dtype, flash_fn=jf.make_attention_fn(is_causal=True))
  (want_out, _), _ = _nnx_pair(dtype, is_causal=True)
  np.testing.assert_allclose(got_out, want_out, **TOLERANCE[dtype])


@needs_mask
@pytest.mark.parametrize("dtype", DTYPES)
def test_nnx_dense_mask(dtype):
  causal = nnx.make_causal_mask(jnp.ones((BATCH, LENGTH)))
  got, want = _nnx_pair(dtype, mask=causal)
  _assert_tree_close(got, want, dtype)


# -- the function itself ---------------------------------------------------------


def _qkv(dtype, shape):
  keys = jax.random.split(jax.random.key(3), 3)
  return tuple(jax.random.normal(k, shape, dtype) for k in keys)


@pytest.mark.parametrize("batch_shape", [(), (2,), (2, 3)])
def test_any_number_of_batch_dimensions(batch_shape):
  q, k, v = _qkv(jnp.float64, batch_shape + (9, 2, 8))
  got = jf.make_attention_fn(is_causal=True)(q, k, v)
  want = _flax_weights_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(got, want, **TOLERANCE[jnp.float64])


@needs_mask
@pytest.mark.parametrize("batch_shape", [(2,), (2, 3)])
def test_mask_with_batch_dimensions_and_broadcasting(batch_shape):
  q, k, v = _qkv(jnp.float64, batch_shape + (9, 2, 8))
  # Per-batch-element key padding, broadcast over heads and query rows, with
  # the leading batch dimension of the mask left implicit where there are two.
  valid = jnp.arange(9) < 5 + jnp.arange(batch_shape[-1])[:, None]  # (batch[-1], S)
  mask = valid[:, None, None, :]  # (batch[-1], 1, 1, S)
  got = jf.attention_fn(q, k, v, mask=mask)
  want = nn.dot_product_attention(q, k, v, mask=mask)
  np.testing.assert_allclose(got, want, **TOLERANCE[jnp.float64])


@needs_bias
def test_bias():
  q, k, v = _qkv(jnp.float64, (2, 9, 2, 8))
  bias = jax.random.normal(jax.random.key(4), (1, 2, 9, 9), jnp.float64)
  got = jf.attention_fn(q, k, v, bias=bias)
  want = nn.dot_product_attention(q, k, v, bias=bias)
  np.testing.assert_allclose(got, want, **TOLERANCE[jnp.float64])


@needs_bias
def test_bias_of_any_numeric_dtype_as_flax():
  """Flax adds an integer or boolean bias to its float weights; so does attention_fn."""
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  int_bias = jnp.asarray(np.random.default_rng(5).integers(-2, 3, (1, 2, 9, 9)), jnp.int32)
  for bias in (int_bias, int_bias > 0):
    np.testing.assert_allclose(jf.attention_fn(q, k, v, bias=bias),
                               nn.dot_product_attention(q, k, v, bias=bias),
                               **TOLERANCE[jnp.float32])


def test_dtype_promotion():
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  out = jf.attention_fn(q, k.astype(jnp.float64), v, dtype=jnp.float32)
  assert out.dtype == jnp.float32
  out = jf.attention_fn(q, k, v, dtype=jnp.float64)
  assert out.dtype == jnp.float64


def test_dropout_off_when_deterministic():
  # deterministic=True or rate 0 ignore the dropout arguments, as in Flax:
  # these work even before the kernels have dropout.
  q, k, v = _qkv(jnp.float64, (2, 9, 2, 8))
  plain = jf.attention_fn(q, k, v)
  off = jf.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0),
                        deterministic=True)
  zero = jf.attention_fn(q, k, v, dropout_rate=0.0, dropout_rng=None)
  np.testing.assert_array_equal(off, plain)
  np.testing.assert_array_equal(zero, plain)


# -- errors --------------------------------------------------------------------


def test_sow_weights_is_a_clear_error():
  x = _inputs(jnp.float32)
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.attention_fn)
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="cannot sow attention weights"):
    layer.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_custom_einsum_is_a_clear_error():
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    jf.attention_fn(q, k, v, qk_attn_weights_einsum=jnp.einsum,
                    attn_weights_value_einsum=jnp.einsum)


def test_dropout_without_rng_is_a_clear_error():
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  with pytest.raises(ValueError, match="dropout_rng is required"):
    jf.attention_fn(q, k, v, dropout_rate=0.1, deterministic=False)


def test_mask_of_too_high_rank_is_a_clear_error():
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  with pytest.raises(ValueError, match="mask must be broadcastable"):
    jf.attention_fn(q, k, v, mask=jnp.ones((1, 2, 1, 9, 9), bool))


def test_make_attention_fn_checks_is_causal():
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    jf.make_attention_fn(is_causal="yes")
  with pytest.raises(TypeError, match="deterministic_backward must be a bool"):
    jf.make_attention_fn(deterministic_backward="no")
  # Its kernel options when it is made, not at the first call.
  with pytest.raises(ValueError, match="local_window_size must be non-negative"):
    jf.make_attention_fn(local_window_size=(-1, 3))
  with pytest.raises(TypeError, match="local_window_size must be None, an int, or a"):
    jf.make_attention_fn(local_window_size=2.5)
  for cap in (0.0, float("nan")):
    with pytest.raises(ValueError, match="logits_soft_cap must be"):
      jf.make_attention_fn(logits_soft_cap=cap)


@pytest.mark.parametrize("name, value, error, message", [
    ("is_causal", "no", TypeError, "is_causal must be a bool, got str"),
    ("deterministic", "yes", TypeError, "deterministic must be a bool, got str"),
    ("broadcast_dropout", "no", TypeError, "broadcast_dropout must be a bool, got str"),
    ("dropout_rate", "0.1", TypeError, "dropout_rate must be a float, got str"),
    ("dropout_rate", -0.1, ValueError, "dropout_rate must be in \\[0, 1\\), got -0.1"),
    ("dropout_rate", float("nan"), ValueError, "dropout_rate must be finite"),
])
def test_flags_and_rate_are_checked_not_converted(name, value, error, message):
  """Flags once went through bool() ("no" ran causal, deterministic="yes"
  skipped dropout), and a negative or NaN rate skipped dropout silently."""
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  kwargs = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0), deterministic=False)
  kwargs[name] = value
  with pytest.raises(error, match=message):
    jf.attention_fn(q, k, v, **kwargs)
  with pytest.raises(error, match=message):
    jf.make_attention_fn()(q, k, v, **kwargs)


def test_traced_flags_are_a_clear_error():
  q, k, v = _qkv(jnp.float32, (2, 9, 2, 8))
  key = jax.random.key(0)
  with pytest.raises(TypeError, match="dropout_rate must be a static Python value"):
    jax.jit(lambda r: jf.attention_fn(q, k, v, dropout_rate=r, dropout_rng=key))(0.1)
  with pytest.raises(TypeError, match="is_causal must be a static Python value"):
    jax.jit(lambda c: jf.attention_fn(q, k, v, is_causal=c))(True)


# -- dropout (needs the kernels' dropout) ----------------------------------------


@needs_dropout
@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_linen_dropout_reproducible_and_rng_dependent(broadcast_dropout):
  x = _inputs(jnp.float32)
  layer = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, dropout_rate=0.3, broadcast_dropout=broadcast_dropout,
      attention_fn=jf.make_attention_fn(is_causal=True))
  params = layer.init(jax.random.key(0), x, deterministic=True)

  @jax.jit
  def apply(params, rng):
    return layer.apply(params, x, deterministic=False, rngs=dict(dropout=rng))

  a = apply(params, jax.random.key(1))
  b = apply(params, jax.random.key(1))
  c = apply(params, jax.random.key(2))
  assert np.all(np.isfinite(a))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(
      layer.apply(p, x, deterministic=False, rngs=dict(dropout=jax.random.key(1))) ** 2)))(params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  # Off when deterministic: equal to the module without dropout.
  plain = layer.apply(params, x, deterministic=True)
  no_dropout = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, attention_fn=jf.make_attention_fn(is_causal=True)).apply(params, x)
  np.testing.assert_allclose(plain, no_dropout, rtol=1e-6, atol=1e-6)


@needs_dropout
def test_nnx_dropout_reproducible_and_rng_dependent():
  x = _inputs(jnp.float32)
  layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                 dropout_rate=0.3, rngs=nnx.Rngs(0),
                                 attention_fn=jf.attention_fn)
  a = layer(x, is_causal=True, deterministic=False, rngs=nnx.Rngs(1))
  b = layer(x, is_causal=True, deterministic=False, rngs=nnx.Rngs(1))
  c = layer(x, is_causal=True, deterministic=False, rngs=nnx.Rngs(2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


@needs_dropout
def test_dropout_keeps_the_mean():
  # Dropout scales kept weights by 1/(1-rate): averaged over many rngs the
  # output approaches the output without dropout. One example repeated over
  # the batch, each batch element with its own mask (broadcast_dropout=False).
  q, k, v = (jnp.tile(x, (1024, 1, 1, 1)) for x in _qkv(jnp.float32, (1, 16, 1, 8)))
  plain = jf.attention_fn(q[:1], k[:1], v[:1])
  dropped = jf.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0),
                            broadcast_dropout=False, deterministic=False)
  np.testing.assert_allclose(jnp.mean(dropped, axis=0, keepdims=True), plain, atol=0.1)

"""Dropout fused in the kernels: keep rate, reproducibility, and gradients.

The mask is recovered exactly by attending to one-hot values: with
V[j] = e_j (and head_dim >= Sk), output row i *is* row i of the dropped and
rescaled probabilities, so Z = (out != 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import dropout
from conftest import assert_flash_close
from reference import Options, attention, one_hot_problem, recovered_mask

RATE = 0.3
# The kernels draw 8-bit numbers: the rate they apply is RATE rounded to the
# nearest multiple of 2^-8 (0.3 * 256 = 76.8 -> 77), and kept values are
# scaled by 1 / (1 - that rate).
REALISED = 77 / 256


@pytest.fixture(autouse=True)
def on_each_backend(backend):
  """Every test runs on the CPU and, if there is one, the GPU."""
  return backend


def test_keep_rate_and_scaling():
  q, k, v = one_hot_problem()
  out = jax_flash.flash_attention(q, k, v, dropout_rate=RATE, dropout_rng=jax.random.key(0))
  keep = recovered_mask(out)
  assert abs(float(keep.mean()) - (1 - REALISED)) < 0.02  # 19200 draws: 5 sigma is 0.017
  # Kept entries are the softmax probabilities scaled by 1 / (1 - rate).
  probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
  np.testing.assert_allclose(np.asarray(jnp.transpose(out, (0, 2, 1, 3)))[np.asarray(keep)],
                             np.asarray(probs / (1 - REALISED))[np.asarray(keep)], rtol=1e-10)


def test_rate_is_rounded_to_a_multiple_of_2_to_the_minus_8():
  realised = dropout.realised_dropout_rate
  assert REALISED != RATE and abs(REALISED - RATE) <= 2.0**-9
  assert realised(RATE) == REALISED
  assert realised(0.1) == 26 / 256  # 25.6 -> 26
  assert realised(0.5) == 0.5 and realised(3 / 256) == 3 / 256  # multiples stay
  assert realised(1.4 / 256) == 1 / 256 and realised(1.6 / 256) == 2 / 256
  # Halves round up, as the kernels' DropoutParams::threshold does.
  assert realised(2.0**-9) == 2.0**-8 and realised(2.5 / 256) == 3 / 256
  assert realised(0.9999999) == 1 - 2.0**-8  # never 1: something is always kept
  assert (dropout.threshold(RATE), dropout.keep_scale(RATE)) == (77, 256 / 179)
  assert (dropout.threshold(0.9999999), dropout.threshold(2.0**-9)) == (255, 1)


def test_rate_applied_is_the_rounded_one():
  """The kernels apply the rounded rate: 1.4/256 and 2^-9 drop exactly what
  1/256 does, scaled alike; 0.1 drops what 26/256 does."""
  q, k, v = one_hot_problem()
  f = lambda rate: np.asarray(jax_flash.flash_attention(q, k, v, dropout_rate=rate,
                                                        dropout_rng=jax.random.key(0)))
  one_step = f(2.0**-8)
  assert 0 < int(np.sum(one_step == 0)) < 200  # about 19200 / 256 = 75 dropped
  np.testing.assert_array_equal(f(2.0**-9), one_step)
  np.testing.assert_array_equal(f(1.4 / 256), one_step)
  np.testing.assert_array_equal(f(0.1), f(26 / 256))


@pytest.mark.parametrize("rate", [2.0**-18, 2.0**-10, 0.99 * 2.0**-9])
def test_rate_that_would_round_to_zero_is_an_error(rate):
  """A rate in (0, 2^-9) would round to "no dropout": refused, not silently dropped."""
  q, k, v = one_hot_problem()
  message = r"dropout_rate must be 0 or at least 2\^-9 \(the kernels draw 8-bit numbers"
  with pytest.raises(ValueError, match=message):
    jax_flash.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match=message):  # also while tracing under jit
    jax.jit(lambda q: jax_flash.flash_attention(q, k, v, dropout_rate=rate,
                                                dropout_rng=jax.random.key(0))).lower(q)


def test_keep_fraction_is_the_rounded_rate():
  """Over 2^22 draws the dropped fraction at rate 0.1 is 26/256 = 0.1016, not
  0.1: sigma = 0.00015, and 0.1 lies 10.6 sigma away. Each of the 16 draws of
  a Philox call (8-bit bytes of its 4 words) keeps at the same rate."""
  batch, seqlen_q, heads, seqlen_k = 2, 2048, 8, 128
  rng = np.random.default_rng(11)
  q = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_q, heads, seqlen_k)), jnp.float32)
  k = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_k, heads, seqlen_k)), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(seqlen_k, dtype=jnp.float32)[None, :, None, :], k.shape)
  out = jax.jit(lambda q, k, v: jax_flash.flash_attention(
      q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(12)))(q, k, v)
  dropped = ~np.asarray(recovered_mask(out))
  p = 26 / 256
  sigma = np.sqrt(p * (1 - p) / dropped.size)
  assert abs(dropped.mean() - p) < 4 * sigma, (dropped.mean(), p, sigma)
  # Per position within a 16 x 16 block (i % 16, j % 16): 2^14 draws each.
  per_position = dropped.reshape(batch, heads, seqlen_q // 16, 16, seqlen_k // 16, 16).mean(
      axis=(0, 1, 2, 4))
  sigma = np.sqrt(p * (1 - p) / (dropped.size // 256))
  assert np.abs(per_position - p).max() < 5 * sigma, per_position


def test_same_key_same_mask_other_key_other_mask():
  q, k, v = one_hot_problem()
  f = jax.jit(lambda rng: jax_flash.flash_attention(q, k, v, dropout_rate=RATE, dropout_rng=rng))
  a, b, c = f(jax.random.key(1)), f(jax.random.key(1)), f(jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.mean(recovered_mask(a) != recovered_mask(c))) > 0.2


def test_mask_depends_only_on_key_and_position():
  """Different tilings, masks and batch layouts draw the same mask for the same element."""
  q, k, v = one_hot_problem(seqlen_q=130)
  rng = jax.random.key(3)
  full = recovered_mask(jax_flash.flash_attention(q, k, v, dropout_rate=RATE, dropout_rng=rng))
  causal = recovered_mask(jax_flash.flash_attention(q, k, v, is_causal=True, dropout_rate=RATE,
                                                    dropout_rng=rng))
  first_rows = recovered_mask(jax_flash.flash_attention(q[:, :50], k, v, dropout_rate=RATE,
                                                        dropout_rng=rng))
  visible = np.tril(np.ones((130, 64), bool))
  np.testing.assert_array_equal(np.asarray(causal)[..., visible], np.asarray(full)[..., visible])
  np.testing.assert_array_equal(np.asarray(first_rows), np.asarray(full)[:, :, :50])


def test_broadcast_dropout_shares_one_mask():
  q, k, v = one_hot_problem()
  keep = recovered_mask(jax_flash.flash_attention(q, k, v, dropout_rate=RATE,
                                                  dropout_rng=jax.random.key(4),
                                                  broadcast_dropout=True))
  np.testing.assert_array_equal(np.asarray(keep), np.broadcast_to(np.asarray(keep[:1, :1]),
                                                                  keep.shape))


def test_vmap_over_keys_is_exact():
  q, k, v = one_hot_problem(batch=2)
  keys = jax.random.split(jax.random.key(5), 3)
  f = lambda rng: jax_flash.flash_attention(q, k, v, dropout_rate=RATE, dropout_rng=rng)
  batched = jax.vmap(f)(keys)
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(f(keys[i])))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_gradients_match_dense_reference_with_the_same_mask(dtype, with_bias):
  """16-bit inputs without a bias run the tensor-core kernels on a GPU."""
  q, k, v = one_hot_problem(seed=6)
  rng = jax.random.key(6)
  keep = recovered_mask(jax_flash.flash_attention(q, k, v, dropout_rate=RATE, dropout_rng=rng))
  # Fresh values (not one-hot) and a bias, with the recovered mask.
  r = np.random.default_rng(7)
  v = jnp.asarray(r.standard_normal(v.shape))
  bias = jnp.asarray(r.standard_normal((1, 3, 50, 64)))
  if not with_bias:
    bias = jnp.zeros_like(bias)  # the same function; None below
  dout = jnp.asarray(r.standard_normal(q.shape))
  opts = Options(is_causal=True)
  visible = jnp.tril(jnp.ones((50, 64), bool))[None, None]

  def flash(q, k, v, bias):
    return jax_flash.flash_attention(q, k, v, bias=bias if with_bias else None, is_causal=True,
                                     dropout_rate=RATE, dropout_rng=rng)

  def dense(q, k, v, bias):
    return attention(q, k, v, visible, opts, bias=bias, keep=keep, dropout_rate=REALISED)[0]

  cast = lambda xs, t: [jnp.asarray(x, t) for x in xs]
  out, vjp = jax.vjp(jax.jit(flash), *cast((q, k, v, bias), dtype))
  got = (out,) + vjp(dout.astype(dtype))
  ref_out, ref_vjp = jax.vjp(dense, q, k, v, bias)
  ref = (ref_out,) + ref_vjp(dout)
  plain_out, plain_vjp = jax.vjp(dense, *cast((q, k, v, bias), dtype))
  plain = (plain_out,) + plain_vjp(dout.astype(dtype))
  names = ["out", "dq", "dk", "dv", "dbias"] if with_bias else ["out", "dq", "dk", "dv"]
  for name, g, rf, p in zip(names, got, ref, plain):
    assert_flash_close(name, g, rf, p, dtype)


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["mha", "gqa"])
def test_same_mask_on_both_platforms(backend, broadcast, dtype, kv_heads):
  """Both backends call HeadDropout::Keep: the same key gives the same mask, bit for bit.

  16-bit inputs take the GPU's tensor-core kernels (one Philox call per 16
  fragment elements, shared by two threads), float64 its exact kernels (one
  per element)."""
  if backend != "gpu":
    pytest.skip("needs a GPU")
  q, k, v = one_hot_problem(seqlen_q=70, kv_heads=kv_heads)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  keys = jax.random.split(jax.random.key(8), 2)  # one key per batch element (vmap)

  def keep_on(platform):
    device = jax.devices(platform)[0]
    args = [jax.device_put(x, device) for x in (q, k, v, keys)]
    f = jax.jit(jax.vmap(lambda q, k, v, rng: jax_flash.flash_attention(
        q[None], k[None], v[None], is_causal=True, dropout_rate=RATE, dropout_rng=rng,
        broadcast_dropout=broadcast)[0]))
    out = f(*args)
    assert out.devices() == {device}
    return np.asarray(recovered_mask(out))

  np.testing.assert_array_equal(keep_on("cpu"), keep_on("gpu"))


def test_same_mask_over_many_tiles_per_sm(backend):
  """More tiles than an H100 has SMs (256, two key blocks each): the
  persistent Hopper forward walks several tiles per CTA, its rings carrying
  on from tile to tile, and the mask is still the CPU's, bit for bit. Half
  the keys at a time take one-hot values (head_dim 128 < Sk)."""
  if backend != "gpu":
    pytest.skip("needs a GPU")
  batch, seqlen_q, seqlen_k, heads, dim = 4, 1024, 256, 8, 128
  rng = np.random.default_rng(9)
  q = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_q, heads, dim)), jnp.bfloat16)
  k = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_k, 2, dim)), jnp.bfloat16)
  key = jax.random.key(10)

  def keep_on(platform, half):
    device = jax.devices(platform)[0]
    eye = jnp.zeros((seqlen_k, dim)).at[half * dim:(half + 1) * dim].set(jnp.eye(dim))
    v = jnp.broadcast_to(eye[None, :, None, :], (batch, seqlen_k, 2, dim)).astype(jnp.bfloat16)
    args = [jax.device_put(x, device) for x in (q, k, v)]
    out = jax.jit(lambda q, k, v: jax_flash.flash_attention(
        q, k, v, dropout_rate=RATE, dropout_rng=key))(*args)
    return np.asarray(recovered_mask(out))

  for half in (0, 1):
    np.testing.assert_array_equal(keep_on("cpu", half), keep_on("gpu", half))

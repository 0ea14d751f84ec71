"""jax_flash against the float64 dense reference: outputs, lse and gradients.

Every dtype, odd sizes, GQA, Sq != Sk and every mask option, each compared
with the FlashAttention rule (conftest.assert_flash_close).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import assert_flash_close
from reference import Options, attention, attention_and_grads, make_inputs, visible_mask

DTYPES = [jnp.float64, jnp.float32, jnp.bfloat16, jnp.float16]

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim): odd sizes on purpose.
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 17, 17, 2, 2, 40),
    (1, 127, 33, 4, 2, 72),
    (2, 65, 130, 3, 1, 64),
    (1, 33, 70, 2, 2, 256),
    (1, 70, 90, 2, 1, 120),  # the 128 bucket, padded (on Hopper: the wgmma forward)
    (1, 90, 140, 2, 1, 176),  # the 192 bucket, padded (on Hopper: two 96-key blocks)
]

OPTIONS = {
    "plain": Options(),
    "causal": Options(is_causal=True),
    "window": Options(window=(9, 4)),
    "causal_window": Options(is_causal=True, window=(20, 0)),
    "lengths": Options(with_lengths=True),
    "segments": Options(with_segments=True),
    "softcap": Options(softcap=2.0, scale=0.9),
    "everything": Options(is_causal=True, window=(30, 5), softcap=5.0, with_lengths=True,
                          with_segments=True, scale=0.3),
    "bias": Options(bias_shape=(2, 4, 100, 77)),
    "bias_broadcast": Options(bias_shape=(1, 4, 1, 77)),
    "mask": Options(mask_shape=(2, 1, 100, 77)),
    "padding_mask": Options(mask_shape=(2, 1, 1, 77)),
    # Per-head mask with every other option (on a GPU: the tensor cores for
    # 16-bit inputs, with GQA).
    "mask_everything": Options(mask_shape=(2, 4, 100, 77), is_causal=True, window=(30, 5),
                               softcap=5.0, with_lengths=True, with_segments=True, scale=0.3),
    # (A bias constant along keys would not change the softmax: its exact
    # gradient is a sum whose terms cancel, a poor test of anything.)
    "bias_mask_softcap": Options(bias_shape=(4, 1, 77), mask_shape=(2, 4, 100, 77),
                                 softcap=3.0, is_causal=True),
    # Per-head bias with every other option (on a GPU: the tensor cores for
    # 16-bit inputs, dbias summed over the batch with GQA).
    "bias_everything": Options(bias_shape=(1, 4, 100, 77), is_causal=True, window=(30, 5),
                               softcap=5.0, with_lengths=True, with_segments=True, scale=0.3),
}


def run_flash(inputs, opts, dtype, **extra):
  """(out, lse, dq, dk, dv[, dbias]) from jax_flash, under jit, in `dtype`;
  `extra`: more keyword arguments of flash_attention (deterministic)."""
  q, k, v, dout = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
  kwargs = opts.kwargs(inputs)
  bias = opts.bias(inputs)
  bias = None if bias is None else jnp.asarray(bias, dtype)

  @jax.jit
  def fwd_bwd(q, k, v, bias, dout):
    def f(q, k, v, bias):
      return jax_flash.flash_attention(q, k, v, bias=bias, return_residual=True, **kwargs,
                                       **extra)
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    grads = vjp((dout, jnp.zeros_like(lse)))
    return (out, lse) + tuple(g for g in grads if g is not None)

  return fwd_bwd(q, k, v, bias, dout)


def check_against_reference(inputs, opts, dtype, check_grads=True, **extra):
  mask = visible_mask(opts, inputs)
  got = run_flash(inputs, opts, dtype, **extra)
  f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
  ref = attention_and_grads(f64(inputs.q), f64(inputs.k), f64(inputs.v), f64(inputs.dout), mask,
                            opts, bias=f64(opts.bias(inputs)))
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  plain = attention_and_grads(cast(inputs.q), cast(inputs.k), cast(inputs.v), cast(inputs.dout),
                              mask, opts, bias=cast(opts.bias(inputs)))
  names = ["out", "lse", "dq", "dk", "dv", "dbias"] if check_grads else ["out", "lse"]
  for name, g, r, p in zip(names, got, ref, plain):
    assert_flash_close(name, g, r, p, dtype if name != "lse" else jnp.float32
                       if dtype != jnp.float64 else jnp.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("option", ["plain", "causal", "everything"])
def test_shapes_and_dtypes(backend, dtype, shape, option):
  # A seed per case that is the same in every process (str hashes are not).
  rng = np.random.default_rng(zlib.crc32(repr((shape, option)).encode()))
  check_against_reference(make_inputs(rng, *shape), OPTIONS[option], dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_option(backend, dtype, option):
  rng = np.random.default_rng(7)
  check_against_reference(make_inputs(rng, 2, 100, 77, 4, 2, 48), OPTIONS[option], dtype)


# Each shape once, the two 16-bit dtypes in turn (the CPU half's time is jit compiles).
@pytest.mark.parametrize("shape,dtype", [(s, (jnp.bfloat16, jnp.float16)[i % 2])
                                         for i, s in enumerate(SHAPES[1:])],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else jnp.dtype(x).name)
def test_dense_mask_every_shape(backend, dtype, shape):
  """A (B, 1, T, S) mask with causal, every head-dim bucket (on a GPU: the tensor cores)."""
  rng = np.random.default_rng(zlib.crc32(repr(("mask", shape)).encode()))
  batch, seqlen_q, seqlen_k = shape[:3]
  opts = Options(mask_shape=(batch, 1, seqlen_q, seqlen_k), is_causal=True)
  check_against_reference(make_inputs(rng, *shape), opts, dtype)


# Each shape once, the two 16-bit dtypes in turn, a bias broadcast a different way each time.
@pytest.mark.parametrize("shape,dtype", [(s, (jnp.float16, jnp.bfloat16)[i % 2])
                                         for i, s in enumerate(SHAPES[1:])],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else jnp.dtype(x).name)
def test_bias_every_shape(backend, dtype, shape):
  """A bias with causal, every head-dim bucket (on a GPU: the tensor cores), with dbias."""
  rng = np.random.default_rng(zlib.crc32(repr(("bias", shape)).encode()))
  batch, seqlen_q, seqlen_k, heads = shape[:4]
  kinds = [(batch, heads, seqlen_q, seqlen_k), (1, heads, 1, seqlen_k), (batch, 1, 1, seqlen_k),
           (1, heads, seqlen_q, seqlen_k)]
  bias_shape = kinds[zlib.crc32(repr(shape).encode()) % len(kinds)]
  check_against_reference(make_inputs(rng, *shape), Options(bias_shape=bias_shape, is_causal=True),
                          dtype)


def test_bias_over_many_tiles_per_sm(backend):
  """A bias over more tiles than the GPU has SMs (512 tiles).

  On Hopper the warp-specialized forward reuses its TMA bias stages tile after
  tile; releasing a stage before the warp's reads of it were done once left a
  few dozen wrong elements per call at exactly this size (H100).
  """
  if backend != "gpu":
    pytest.skip("the tiles per SM of the CUDA kernels")
  rng = np.random.default_rng(31)
  check_against_reference(make_inputs(rng, 4, 1024, 1024, 16, 16, 128),
                          Options(bias_shape=(1, 16, 1024, 1024)), jnp.bfloat16, check_grads=False)


# (input dtype, bias dtype): a bias in the inputs' own 16-bit dtype reaches the
# kernels as it is on CUDA (the CPU lowering converts it in HLO before the
# call); any other is cast to float32 first.
BIAS_DTYPES = [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16),
               (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.float16)]


@pytest.mark.parametrize("dtype,bias_dtype", BIAS_DTYPES,
                         ids=lambda d: jnp.dtype(d).name)
def test_bias_dtypes_with_16bit_inputs(backend, dtype, bias_dtype):
  """out, lse and every gradient against the float64 reference, the bias's
  gradient in the bias's own dtype."""
  rng = np.random.default_rng(zlib.crc32(repr(("bias dtype", dtype, bias_dtype)).encode()))
  inputs = make_inputs(rng, 2, 37, 29, 4, 2, 24)
  opts = Options(bias_shape=(1, 4, 37, 29), is_causal=True)
  q, k, v, dout = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
  bias = jnp.asarray(opts.bias(inputs), bias_dtype)

  @jax.jit
  def fwd_bwd(q, k, v, bias, dout):
    f = lambda q, k, v, bias: jax_flash.flash_attention(q, k, v, bias=bias, is_causal=True,
                                                        return_residual=True)
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

  got = fwd_bwd(q, k, v, bias, dout)
  assert got[-1].dtype == bias_dtype and got[-1].shape == bias.shape
  mask = visible_mask(opts, inputs)
  f64 = lambda x: jnp.asarray(x, jnp.float64)
  ref = attention_and_grads(f64(inputs.q), f64(inputs.k), f64(inputs.v), f64(inputs.dout), mask,
                            opts, bias=f64(opts.bias(inputs)))
  cast = lambda x: jnp.asarray(x, dtype)
  plain = attention_and_grads(cast(inputs.q), cast(inputs.k), cast(inputs.v), cast(inputs.dout),
                              mask, opts, bias=cast(opts.bias(inputs)))
  for name, g, r, p in zip(["out", "lse", "dq", "dk", "dv", "dbias"], got, ref, plain,
                           strict=True):
    assert_flash_close(name, g, r, p, jnp.float32 if name == "lse" else dtype)


def test_vmap_of_grad_wrt_a_bfloat16_bias(backend):
  """Per-example queries and bfloat16 biases, K/V shared: the folded calls
  take the stacked bias as it is, and each gradient is bfloat16 and the
  reference's."""
  rng = np.random.default_rng(43)
  x = make_inputs(rng, 3, 21, 18, 2, 1, 16)  # the batch axis is vmap's
  opts = Options(bias_shape=(3, 2, 21, 18))
  dtype = jnp.bfloat16
  q, dout, bias = (jnp.asarray(a, dtype) for a in (x.q, x.dout, opts.bias(x)))
  k, v = jnp.asarray(x.k[0], dtype), jnp.asarray(x.v[0], dtype)

  def loss(q, bias, dout):  # one example: q (T, N, H), bias (N, T, S)
    out = jax_flash.flash_attention(q, k, v, bias=bias)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  dq, dbias = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(q, bias, dout)
  assert dbias.dtype == dtype and dbias.shape == bias.shape
  mask = visible_mask(opts, x)
  for n in range(3):
    one = lambda a, cast: cast(a[n:n + 1])
    shared = lambda a, cast: cast(a[:1])
    f64 = lambda a: jnp.asarray(a, jnp.float64)
    to_dtype = lambda a: jnp.asarray(a, dtype)
    ref, plain = (attention_and_grads(one(x.q, c), shared(x.k, c), shared(x.v, c),
                                      one(x.dout, c), mask[n:n + 1], opts,
                                      bias=one(opts.bias(x), c))
                  for c in (f64, to_dtype))
    assert_flash_close(f"{n} dq", dq[n][None], ref[2], plain[2], dtype)
    assert_flash_close(f"{n} dbias", dbias[n][None], ref[5], plain[5], dtype)


@pytest.mark.parametrize("path", ["sm80", "exact"])
def test_forced_kernel_path(backend, monkeypatch, path):
  """JAX_FLASH_FORCE_PATH (read at every launch) runs the sm80 kernels on Hopper, or the exact ones."""
  if backend != "gpu":
    pytest.skip("the switch chooses among CUDA kernels")
  monkeypatch.setenv("JAX_FLASH_FORCE_PATH", path)
  rng = np.random.default_rng(23)
  # D = 120: the 128 bucket, which has Hopper kernels in both directions.
  check_against_reference(make_inputs(rng, 2, 150, 170, 4, 2, 120), Options(is_causal=True),
                          jnp.bfloat16)


def test_long_sequence(backend):
  """S = 1000: many key and query blocks, partial last block."""
  rng = np.random.default_rng(3)
  check_against_reference(make_inputs(rng, 1, 1000, 1000, 2, 1, 32), Options(is_causal=True),
                          jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rows_that_see_nothing(backend, dtype):
  """Output 0, lse -inf, zero gradients, never NaN."""
  rng = np.random.default_rng(11)
  inputs = make_inputs(rng, 3, 20, 24, 2, 2, 16)
  inputs.kv_lengths[:] = [0, 5, 24]  # batch 0 sees no key at all
  inputs.q_lengths[:] = [20, 10, 20]  # rows 10.. of batch 1 are padding
  # window (0, 0) with causal leaves every row its diagonal only; a key
  # length of 5 then hides rows 5.. of batch 1.
  opts = Options(is_causal=True, window=(3, 0), with_lengths=True)
  out, lse, dq, dk, dv = run_flash(inputs, opts, dtype)
  for x in (out, dq, dk, dv):
    assert not jnp.isnan(x).any()
  np.testing.assert_array_equal(np.asarray(out[0], np.float64), 0)
  np.testing.assert_array_equal(np.asarray(out[1, 10:], np.float64), 0)
  assert np.all(np.isneginf(np.asarray(lse[0])))
  np.testing.assert_array_equal(np.asarray(dq[0], np.float64), 0)
  np.testing.assert_array_equal(np.asarray(dk[0], np.float64), 0)
  np.testing.assert_array_equal(np.asarray(dv[0], np.float64), 0)
  check_against_reference(inputs, opts, dtype)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
def test_soft_cap_far_past_the_cap(backend, dtype):
  """Logits hundreds of times the cap, where the cap does its work: finite
  gradients and tangents (the CPU's sech^2 from e^(2x) was inf / inf = NaN
  from x / cap ~ 44 in float32, ~355 in float64)."""
  rng = np.random.default_rng(13)
  inputs = make_inputs(rng, 1, 40, 50, 2, 1, 16)
  inputs.q *= 20  # logits of std ~20: up to ~800 times the cap
  opts = Options(softcap=0.1, is_causal=True)
  check_against_reference(inputs, opts, dtype)
  q, k, v = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v))
  f = lambda q, k, v: jax_flash.flash_attention(q, k, v, logits_soft_cap=0.1, is_causal=True)
  _, tangent = jax.jit(lambda *a: jax.jvp(f, a, a))(q, k, v)
  assert not jnp.isnan(tangent).any()


def test_segments_without_a_match(backend):
  rng = np.random.default_rng(5)
  inputs = make_inputs(rng, 1, 9, 9, 1, 1, 8)
  inputs.q_segments[:] = 1
  inputs.kv_segments[:] = 2
  out, lse, dq, dk, dv = run_flash(inputs, Options(with_segments=True), jnp.float32)
  assert float(jnp.abs(out).max()) == 0 and float(jnp.abs(dk).max()) == 0
  assert bool(jnp.all(jnp.isneginf(lse)))


def test_extra_batch_dimensions(backend):
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((2, 3, 11, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 3, 13, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 3, 13, 2, 16)), jnp.float32)
  lengths = jnp.asarray(rng.integers(1, 13, size=(2, 3)), jnp.int32)
  out = jax_flash.flash_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
  flat = jax_flash.flash_attention(q.reshape(6, 11, 4, 16), k.reshape(6, 13, 2, 16),
                                   v.reshape(6, 13, 2, 16), is_causal=True,
                                   key_value_seq_lengths=lengths.reshape(6))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(flat).reshape(out.shape))


# Head dims of four buckets (on Hopper: the wgmma dK/dV kernels without dQ,
# both layouts, then the wgmma dQ kernel); a dense mask with dropout and a
# bias (on a GPU: the mma.sync kernels' kTerms variant): a full bias gets
# dbias from one writer per element; one broadcast over the batch sums over
# CTAs, so it runs on the exact kernels on a GPU.
@pytest.mark.parametrize("head_dim,terms", [(64, "plain"), (80, "plain"), (176, "plain"),
                                            (256, "plain"), (64, "mask_dropout"), (64, "bias"),
                                            (64, "bias_broadcast")],
                         ids=["d64", "d80", "d176", "d256", "d64_mask_dropout", "d64_bias",
                              "d64_bias_broadcast"])
def test_deterministic_gradients(backend, head_dim, terms):
  rng = np.random.default_rng(13 + head_dim)
  inputs = make_inputs(rng, 2, 130, 130, 4, 2, head_dim)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (inputs.q, inputs.k, inputs.v))
  kwargs = {}
  if terms == "mask_dropout":
    kwargs = dict(mask=jnp.asarray(rng.random((2, 4, 130, 130)) > 0.3),
                  dropout_rate=0.1, dropout_rng=jax.random.key(1))
  bias_shape = {"bias": (2, 4, 130, 130), "bias_broadcast": (1, 4, 1, 130)}.get(terms, (1,))
  bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
  if terms.startswith("bias"):
    kwargs = dict(dropout_rate=0.1, dropout_rng=jax.random.key(2))
  grad = jax.jit(jax.grad(lambda q, k, v, b: jax_flash.flash_attention(
      q, k, v, bias=b if terms.startswith("bias") else None, is_causal=True, deterministic=True,
      **kwargs).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3)))
  first, second = grad(q, k, v, bias), grad(q, k, v, bias)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  if terms == "plain":
    check_against_reference(inputs, OPTIONS["causal"], jnp.bfloat16, deterministic=True)


def test_tolerance_catches_a_one_percent_scale_error(backend):
  """The comparison is sharp enough to fail a kernel whose scale is 1% off."""
  rng = np.random.default_rng(17)
  inputs = make_inputs(rng, 1, 64, 64, 2, 2, 32)
  opts = Options(scale=0.2)
  mask = visible_mask(opts, inputs)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (inputs.q, inputs.k, inputs.v))
  wrong = jax_flash.flash_attention(q, k, v, scale=0.2 * 1.01)
  f64 = lambda x: jnp.asarray(x, jnp.float64)
  ref, _ = attention(f64(inputs.q), f64(inputs.k), f64(inputs.v), mask, opts)
  plain, _ = attention(q, k, v, mask, opts)
  with pytest.raises(AssertionError, match="out: max error"):
    assert_flash_close("out", wrong, ref, plain, jnp.bfloat16)

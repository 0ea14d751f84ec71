"""block_mask: block-sparse attention against the float64 reference of the same dense mask.

A False cell of the block mask hides the 128 x 128 block of (query, key)
pairs it covers, exactly as a dense mask of False there would; the kernels
skip those tiles without reading them. Checked: forward and gradients
against the reference given the equivalent dense mask (odd sizes, GQA,
every other mask option, broadcast shapes), rows that see nothing, NaN
inside a hidden block, forward mode and second order (the blockwise JAX
code), vmap, jit, sequence sharding, and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash
from conftest import assert_flash_close
from jax_flash.attention import DTypeError
from jax_flash.primitives import flash_fwd_p, mask_operands
from reference import Options, attention, attention_and_grads, make_inputs, visible_mask

BLOCK = jax_flash.BLOCK_MASK_BLOCK
# The float64 reference under jit: one compilation per shape rather than one
# per operation. (The plain same-dtype implementations stay eager: under jit
# XLA may keep excess precision, which would make them another yardstick.)
reference_and_grads = jax.jit(attention_and_grads, static_argnums=5)


def cells(seqlen: int) -> int:
  return -(-seqlen // BLOCK)


def random_block_mask(rng, shape, seqlen_q, seqlen_k):
  """About a third of the cells False, and the first row of cells all False."""
  mask = rng.random(shape + (cells(seqlen_q), cells(seqlen_k))) > 0.35
  mask[..., 0, :] = False
  return mask


def expand(block_mask, seqlen_q, seqlen_k):
  """The dense mask (..., T, S) that a block mask stands for."""
  block_mask = np.asarray(block_mask)
  rows = np.arange(seqlen_q) // BLOCK if block_mask.shape[-2] != 1 else np.zeros(seqlen_q, int)
  cols = np.arange(seqlen_k) // BLOCK if block_mask.shape[-1] != 1 else np.zeros(seqlen_k, int)
  return block_mask[..., rows, :][..., cols]


def run(inputs, opts, dtype, block_mask, **extra):
  """(out, lse, dq, dk, dv) of flash_attention with this block mask, under jit."""
  q, k, v, dout = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
  kwargs = dict(opts.kwargs(inputs), **extra)

  @jax.jit
  def fwd_bwd(q, k, v, dout, block_mask):
    f = lambda q, k, v: jax_flash.flash_attention(q, k, v, block_mask=block_mask,
                                                  return_residual=True, **kwargs)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

  return fwd_bwd(q, k, v, dout, jnp.asarray(block_mask))


def check(inputs, opts, dtype, block_mask, **extra):
  batch, seqlen_q, heads = inputs.q.shape[:3]
  seqlen_k = inputs.k.shape[1]
  dense = np.broadcast_to(expand(block_mask, seqlen_q, seqlen_k),
                          (batch, heads, seqlen_q, seqlen_k))
  visible = visible_mask(opts, inputs) & dense
  got = run(inputs, opts, dtype, block_mask, **extra)
  f64 = lambda x: jnp.asarray(x, jnp.float64)
  ref = reference_and_grads(*map(f64, (inputs.q, inputs.k, inputs.v, inputs.dout)), visible, opts)
  cast = lambda x: jnp.asarray(x, dtype)
  plain = attention_and_grads(*map(cast, (inputs.q, inputs.k, inputs.v, inputs.dout)), visible,
                              opts)
  lse_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
  for name, g, r, p in zip(["out", "lse", "dq", "dk", "dv"], got, ref, plain):
    assert_flash_close(name, g, r, p, lse_dtype if name == "lse" else dtype)
  return got


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim): odd sizes, partial cells.
SHAPES = [(1, 1, 1, 1, 1, 8), (2, 130, 300, 4, 2, 16), (1, 300, 130, 3, 1, 24)]
OPTIONS = {
    "plain": Options(),
    "causal": Options(is_causal=True),
    "lengths_segments": Options(with_lengths=True, with_segments=True),
    "everything": Options(is_causal=True, window=(150, 20), softcap=3.0, with_lengths=True,
                          with_segments=True, scale=0.4),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("option,dtype", [(option, jnp.float32) for option in sorted(OPTIONS)] +
                         [("everything", jnp.bfloat16)], ids=lambda x: getattr(x, "__name__", x))
def test_matches_the_dense_mask_reference(backend, dtype, shape, option):
  rng = np.random.default_rng(sum(shape) + len(option))
  inputs = make_inputs(rng, *shape)
  check(inputs, OPTIONS[option], dtype, random_block_mask(rng, (shape[0], shape[3]), *shape[1:3]))


@pytest.mark.parametrize("mask_shape", [(1, 1), (4,), (1, 4), (2, 1)], ids=str)
def test_broadcast_shapes_and_a_dense_mask(backend, mask_shape):
  """Batch, head and cell dims of 1 broadcast; with a dense mask both apply."""
  rng = np.random.default_rng(3)
  inputs = make_inputs(rng, *SHAPES[1])  # (2, 130, 300, 4, 2, 16)
  block_mask = rng.random(mask_shape + (cells(130), cells(300))) > 0.3
  block_mask[..., 1, 0] = True
  if mask_shape == (2, 1):  # (B, 1, 1, C): one row of cells for every query block
    block_mask = block_mask[..., :1, :]
  check(inputs, Options(mask_shape=(2, 4, 130, 300)), jnp.float32, block_mask)


def test_rows_that_see_nothing(backend):
  """A row of cells all False: output 0, lse -inf, zero gradients, no NaN."""
  rng = np.random.default_rng(5)
  inputs = make_inputs(rng, *SHAPES[1])  # (2, 130, 300, 4, 2, 16)
  block_mask = np.ones((2, 4, 2, 3), bool)
  block_mask[:, :, 1] = False  # rows 128, 129 see nothing
  block_mask[1] = False  # batch element 1 sees nothing at all
  out, lse, dq, dk, dv = check(inputs, Options(), jnp.float32, block_mask)
  for x in (out, lse, dq, dk, dv):
    assert not np.isnan(np.asarray(x)).any()
  np.testing.assert_array_equal(np.asarray(out[0, 128:]), 0)
  np.testing.assert_array_equal(np.asarray(dq[0, 128:]), 0)
  assert np.all(np.isneginf(np.asarray(lse[0, 128:])))
  for x in (out[1], dq[1], dk[1], dv[1]):
    np.testing.assert_array_equal(np.asarray(x), 0)


@pytest.mark.parametrize("opts", [Options(), Options(is_causal=True), Options(window=(150, 40))],
                         ids=["plain", "causal", "window"])
def test_nan_in_a_hidden_block_is_never_read(backend, opts):
  """Keys 128..255 and query rows 128..255 are NaN; the cells that pair them
  with anything else are False, so everything else stays finite (jax.nn:
  a NaN reaches exactly the rows it touches). Windows and causal start the
  kernels' loops off block boundaries, which must not make a tile straddle."""
  rng = np.random.default_rng(7)
  inputs = make_inputs(rng, 1, 300, 300, 2, 1, 16)
  inputs.q[:, 128:256] = np.nan
  inputs.k[:, 128:256] = np.nan
  inputs.v[:, 128:256] = np.nan
  block_mask = np.array([[1, 0, 1], [0, 1, 0], [1, 0, 1]], bool)
  out, lse, dq, dk, dv = run(inputs, opts, jnp.float32, block_mask)
  outside = np.r_[0:128, 256:300]
  for x in (out, dq, dk, dv):
    assert np.isfinite(np.asarray(x)[:, outside]).all()
  assert np.isnan(np.asarray(out)[:, 128:256]).all()
  # The finite part is right: the reference on the rows and keys outside.
  visible = (visible_mask(opts, inputs) & expand(block_mask, 300, 300))[..., outside, :]
  visible = visible[..., outside]
  sub = [jnp.asarray(x[:, outside]) for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]
  ref = reference_and_grads(*sub, visible, opts)
  plain = attention_and_grads(*(x.astype(jnp.float32) for x in sub), visible, opts)
  for name, g, r, p in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, dq, dk, dv), ref, plain):
    assert_flash_close(name, np.asarray(g)[:, outside], r, p, jnp.float32)


def reference_fn(inputs, block_mask, opts):
  batch, seqlen_q, heads = inputs.q.shape[:3]
  visible = visible_mask(opts, inputs) & expand(block_mask, seqlen_q, inputs.k.shape[1])
  return lambda q, k, v: attention(q, k, v, visible, opts)[0]


def test_forward_mode_and_second_order(backend):
  """jvp (the JVP kernel), and grad of a jvp (the blockwise JAX code), in float64."""
  rng = np.random.default_rng(9)
  inputs = make_inputs(rng, 1, 150, 140, 2, 1, 8)
  block_mask = random_block_mask(rng, (1, 2), 150, 140)
  block_mask[0, 0, 0, 1] = True
  opts = Options(is_causal=True)
  flash = lambda q, k, v: jax_flash.flash_attention(q, k, v, block_mask=block_mask, is_causal=True)
  dense = reference_fn(inputs, block_mask, opts)
  primals = tuple(jnp.asarray(x) for x in (inputs.q, inputs.k, inputs.v))
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in primals)
  for f_got, f_want in ((flash, dense),):
    got = jax.jit(lambda p, t: jax.jvp(f_got, p, t))(primals, tangents)
    want = jax.jvp(f_want, primals, tangents)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)
    second = lambda f: jax.grad(lambda p: jnp.sum(jnp.sin(jax.jvp(f, p, tangents)[1])))(primals)
    for g, w in zip(jax.jit(lambda: second(f_got))(), second(f_want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-8, atol=1e-10)


# One block mask for every head ((B, 1, R, C) cells), in 16 bits at tensor-core head dims: on a
# GPU the kernels that skip the tile map's empty cells apply it (the wgmma ones on Hopper, the
# mma.sync kTerms ones on Ampere and Ada and, in float16, the Turing family's;
# cuda/dispatch.cu), each forced onto any newer GPU by JAX_FLASH_FORCE_PATH.
TENSOR_CORE_CASES = {
    "gqa": ((2, 300, 420, 4, 2, 64), Options(), {}),
    "causal_segments_deterministic": ((1, 520, 400, 2, 1, 128),
                                      Options(is_causal=True, with_segments=True),
                                      {"deterministic": True}),
    "window_lengths_d192": ((2, 260, 390, 2, 2, 192), Options(window=(150, 20), with_lengths=True),
                            {}),
}
FORCED_PATHS = ["default", "sm80", "sm75"]


def force_path(backend, monkeypatch, path):
  """The 16-bit dtype the path takes (float16 on the Turing family), with the path forced."""
  if path != "default":
    if backend != "gpu":
      pytest.skip("the switch chooses among CUDA kernels")
    monkeypatch.setenv("JAX_FLASH_FORCE_PATH", path)
  return jnp.float16 if path == "sm75" else jnp.bfloat16


@pytest.mark.parametrize("path", FORCED_PATHS)
@pytest.mark.parametrize("case", sorted(TENSOR_CORE_CASES))
def test_one_mask_for_every_head_in_16_bits(backend, monkeypatch, case, path):
  dtype = force_path(backend, monkeypatch, path)
  shape, opts, extra = TENSOR_CORE_CASES[case]
  rng = np.random.default_rng(sum(shape))
  inputs = make_inputs(rng, *shape)
  check(inputs, opts, dtype, random_block_mask(rng, (shape[0], 1), *shape[1:3]), **extra)


@pytest.mark.parametrize("path", FORCED_PATHS)
def test_forward_mode_in_16_bits(backend, monkeypatch, path):
  """jvp of one block mask for every head on the JVP kernels (mma.sync on every GPU)."""
  dtype = force_path(backend, monkeypatch, path)
  rng = np.random.default_rng(17)
  inputs = make_inputs(rng, 1, 300, 420, 4, 2, 64)
  block_mask = random_block_mask(rng, (1, 1), 300, 420)
  opts = Options(is_causal=True)
  flash = lambda q, k, v: jax_flash.flash_attention(q, k, v, block_mask=block_mask, is_causal=True)
  dense_jvp = jax.jit(lambda p, t: jax.jvp(reference_fn(inputs, block_mask, opts), p, t))
  primals = tuple(jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v))
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), dtype) for x in primals)
  got = jax.jit(lambda p, t: jax.jvp(flash, p, t))(primals, tangents)
  f64 = lambda xs: tuple(jnp.asarray(x, jnp.float64) for x in xs)
  ref = dense_jvp(f64(primals), f64(tangents))
  plain = dense_jvp(primals, tangents)
  for name, g, r, p in zip(["out", "out_dot"], got, ref, plain):
    assert_flash_close(name, g, r, p, dtype)


def test_vmap(backend):
  """vmap over the block masks alone, and over queries with a per-head mask."""
  rng = np.random.default_rng(11)
  inputs = make_inputs(rng, 2, 140, 200, 2, 1, 8)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (inputs.q, inputs.k, inputs.v))
  masks = jnp.asarray(random_block_mask(rng, (3, 2, 2), 140, 200))
  f = lambda q, k, v, m: jax_flash.flash_attention(q, k, v, block_mask=m, is_causal=True)
  got = jax.jit(jax.vmap(f, in_axes=(None, None, None, 0)))(q, k, v, masks)
  for n in range(3):
    np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(f(q, k, v, masks[n])))
  qs = jnp.stack([q, 2 * q])
  # A per-head mask (queries folded into the batch), one for every head
  # (mapped queries become extra heads).
  for mask in (masks[0], masks[0][:, :1]):
    got = jax.vmap(lambda q: f(q, k, v, mask))(qs)
    for n in range(2):
      np.testing.assert_allclose(np.asarray(got[n]), np.asarray(f(qs[n], k, v, mask)),
                                 rtol=1e-6, atol=1e-6)
  loss = lambda q, m: jnp.sum(f(q, k, v, m) ** 2)
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(q, masks)
  for n in range(3):
    np.testing.assert_allclose(np.asarray(grads[n]), np.asarray(jax.grad(loss)(q, masks[n])),
                               rtol=1e-5, atol=1e-6)


def test_sequence_shards_read_the_whole_mask_by_position():
  """Queries sharded over the sequence in chunks that are not whole cells:
  each device reads the whole block mask at its own positions."""
  cpus = jax.devices("cpu")
  if len(cpus) < 2:
    pytest.skip("needs 2 CPU devices")
  mesh = jax.make_mesh((2,), ("x",), devices=cpus[:2])
  rng = np.random.default_rng(13)
  inputs = make_inputs(rng, 1, 300, 260, 2, 2, 8)  # 150 query rows per device
  block_mask = random_block_mask(rng, (1, 2), 300, 260)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax_flash.flash_attention(
      q, k, v, block_mask=block_mask, is_causal=True))), argnums=(0, 1, 2)))
  q = jax.device_put(jnp.asarray(inputs.q), NamedSharding(mesh, P(None, "x")))
  got = f(q, jnp.asarray(inputs.k), jnp.asarray(inputs.v))
  assert got[0].sharding.spec[1] == "x"
  dense = reference_fn(inputs, block_mask, Options(is_causal=True))
  want = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums=(0, 1, 2))(
      *map(jnp.asarray, (inputs.q, inputs.k, inputs.v)))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)


def test_bad_block_masks_are_refused():
  q = jnp.zeros((2, 300, 4, 8))
  k = jnp.zeros((2, 130, 2, 8))
  with pytest.raises(DTypeError, match="block_mask must be a boolean array, got int32"):
    jax_flash.flash_attention(q, k, k, block_mask=jnp.ones((3, 2), jnp.int32))
  with pytest.raises(ValueError, match=r"block_mask must be broadcastable to \(2, 4, 3, 2\)"):
    jax_flash.flash_attention(q, k, k, block_mask=jnp.ones((2, 2), bool))
  with pytest.raises(ValueError, match="block_mask must have at most 4 dimensions"):
    jax_flash.dot_product_attention(q, k, k, block_mask=jnp.ones((1, 2, 4, 3, 2), bool))
  # The handler checks again: a direct call with cells too few, or not bool.
  for bad, message in ((np.ones((1, 1, 2, 2), bool), "block_mask must be rank 4"),
                       (np.ones((1, 1, 3, 2), np.int32), "block_mask must be bool")):
    ops = mask_operands(q.dtype, block_mask=jnp.asarray(bad))
    params = dict(scale=1.0, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                  dropout_rate=0.0, broadcast_dropout=False)
    with pytest.raises(Exception, match=message):
      jax.block_until_ready(flash_fwd_p.bind(q, k, k, *ops, **params))

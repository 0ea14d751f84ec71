"""The public API: jax.nn compatibility, clear errors for bad input, build info."""

from __future__ import annotations

import concurrent.futures
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, primitives
from jax_flash.primitives import flash_bwd_p, flash_fwd_p, mask_operands
from reference import Options, attention


def qkv(shape_q=(2, 10, 4, 8), shape_kv=(2, 12, 2, 8), dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(shape_q), dtype),
          jnp.asarray(rng.standard_normal(shape_kv), dtype),
          jnp.asarray(rng.standard_normal(shape_kv), dtype))


# -- drop-in for jax.nn.dot_product_attention ----------------------------------

JAX_NN_CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3),
    "window": dict(local_window_size=(3, 2)),
    "window_int": dict(local_window_size=4),
    "q_lengths": dict(query_seq_lengths=np.array([4, 10], np.int32)),
    "kv_lengths": dict(key_value_seq_lengths=np.array([7, 12], np.int32)),
    "causal_lengths": dict(is_causal=True, query_seq_lengths=np.array([10, 3], np.int32),
                           key_value_seq_lengths=np.array([12, 5], np.int32)),
}


@pytest.mark.parametrize("case", sorted(JAX_NN_CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_matches_jax_nn(backend, case, dtype):
  q, k, v = qkv(dtype=dtype)
  kwargs = JAX_NN_CASES[case]
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  ours, our_lse = jax_flash.dot_product_attention(q, k, v, return_residual=True, **kwargs)
  theirs, their_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
  assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
  assert our_lse.dtype == their_lse.dtype and our_lse.shape == their_lse.shape
  np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                             atol=tol, rtol=tol)
  # jax.nn's lse of padded query rows is an artefact of its large negative
  # fill; compare the rows that exist.
  rows = np.ones(our_lse.shape, bool)
  if "query_seq_lengths" in kwargs:
    rows = np.broadcast_to(
        np.arange(q.shape[1])[None, :, None] < kwargs["query_seq_lengths"][:, None, None],
        our_lse.shape)
  np.testing.assert_allclose(np.asarray(our_lse, np.float32)[rows],
                             np.asarray(their_lse, np.float32)[rows], atol=tol, rtol=tol)
  grads = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, **kwargs).astype(jnp.float32)
                                                      ** 2), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(grads(jax_flash.dot_product_attention), grads(jax.nn.dot_product_attention)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=5 * tol, rtol=5 * tol)


def test_unbatched_inputs_like_jax_nn(backend):
  q, k, v = qkv((10, 4, 8), (12, 4, 8))
  np.testing.assert_allclose(np.asarray(jax_flash.dot_product_attention(q, k, v, is_causal=True)),
                             np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                             atol=1e-5, rtol=1e-5)


def test_matches_jax_nn_with_bias_and_mask(backend):
  q, k, v = qkv()
  rng = np.random.default_rng(1)
  bias = jnp.asarray(rng.standard_normal((1, 4, 10, 12)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 10, 12)) > 0.3).at[:, :, :, 0].set(True)
  kwargs = dict(bias=bias, mask=mask, is_causal=True)
  np.testing.assert_allclose(np.asarray(jax_flash.dot_product_attention(q, k, v, **kwargs)),
                             np.asarray(jax.nn.dot_product_attention(q, k, v, **kwargs)),
                             atol=1e-5, rtol=1e-5)
  grad = lambda f: jax.grad(lambda q, b: jnp.sum(f(q, k, v, bias=b, mask=mask) ** 2),
                            argnums=(0, 1))(q, bias)
  for a, b in zip(grad(jax_flash.dot_product_attention), grad(jax.nn.dot_product_attention)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_numpy_float64_without_x64_is_float32_as_jax_computes_it(backend):
  """Without x64, jax computes NumPy float64 arrays in float32: the checks must
  see float32 too (they once saw float64: a scale past float32's range slipped
  through to NaN outputs, and the drop-in refused a traced float32 query beside
  NumPy float64 keys as mixed dtypes)."""
  rng = np.random.default_rng(7)
  qn, kn, vn = (rng.standard_normal((2, 9, 2, 8)) for _ in range(3))
  with jax.enable_x64(False):
    want = jax.nn.dot_product_attention(qn, kn, vn)
    got = jax_flash.dot_product_attention(qn, kn, vn)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    grad = lambda f: jax.grad(lambda q: f(q, kn, vn).sum())(qn)
    np.testing.assert_allclose(np.asarray(grad(jax_flash.dot_product_attention)),
                               np.asarray(grad(jax.nn.dot_product_attention)),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="largest float32"):
      jax_flash.flash_attention(qn, kn, vn, scale=1e39)


def test_drop_in_messages_give_the_shapes_as_passed(backend):
  """A 3-d query beside a 4-d key: the message shows (9, 4, 8), not the
  (1, 9, 4, 8) that the drop-in makes of it."""
  q, k, v = qkv((9, 4, 8), (2, 11, 2, 8))
  with pytest.raises(ValueError, match=r"query \(9, 4, 8\) and key \(2, 11, 2, 8\)"):
    jax_flash.dot_product_attention(q, k, v)


# -- bad input: Python errors before anything is lowered ------------------------

def _bad(**overrides):
  q, k, v = qkv()
  args = dict(query=q, key=k, value=v)
  args.update(overrides)
  return args


BAD_INPUTS = [
    ("rank", _bad(query=jnp.zeros((10, 8), jnp.float32)), ValueError, "query must have shape"),
    ("not an array", _bad(key=[[1.0]]), TypeError, "key must be an array"),
    ("int dtype", _bad(value=jnp.zeros((2, 12, 2, 8), jnp.int32)), TypeError, "value dtype"),
    ("mixed dtypes", _bad(key=jnp.zeros((2, 12, 2, 8), jnp.bfloat16)), TypeError, "same dtype"),
    ("k/v shapes", _bad(value=jnp.zeros((2, 11, 2, 8), jnp.float32)), ValueError, "key and value"),
    ("batch", _bad(key=jnp.zeros((3, 12, 2, 8), jnp.float32), value=jnp.zeros((3, 12, 2, 8), jnp.float32)), ValueError,
     "batch dimensions"),
    ("head_dim", _bad(key=jnp.zeros((2, 12, 2, 4), jnp.float32), value=jnp.zeros((2, 12, 2, 4), jnp.float32)), ValueError,
     "same head_dim"),
    ("head_dim range", _bad(query=jnp.zeros((2, 10, 4, 300), jnp.float32), key=jnp.zeros((2, 12, 2, 300), jnp.float32),
                            value=jnp.zeros((2, 12, 2, 300), jnp.float32)), ValueError, r"head_dim must be in"),
    ("gqa", _bad(key=jnp.zeros((2, 12, 3, 8), jnp.float32), value=jnp.zeros((2, 12, 3, 8), jnp.float32)), ValueError,
     "multiple"),
    ("scale nan", _bad(scale=float("nan")), ValueError, "scale must be finite"),
    ("scale type", _bad(scale="big"), TypeError, "scale must be a float"),
    ("cap inf", _bad(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be finite"),
    ("cap negative", _bad(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be > 0"),
    ("window negative", _bad(local_window_size=(-1, 2)), ValueError, "non-negative"),
    ("window type", _bad(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    ("causal type", _bad(is_causal="yes"), TypeError, "is_causal must be a bool"),
    ("lengths shape", _bad(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \(2,\)"),
    ("lengths dtype", _bad(key_value_seq_lengths=jnp.zeros((2,), jnp.float32)), TypeError,
     "key_value_seq_lengths must have an integer dtype"),
    ("segments alone", _bad(q_segment_ids=jnp.zeros((2, 10), jnp.int32)), ValueError,
     "given together"),
    ("segments shape", _bad(q_segment_ids=jnp.zeros((2, 12), jnp.int32),
                            kv_segment_ids=jnp.zeros((2, 12), jnp.int32)), ValueError,
     r"q_segment_ids must have shape \(2, 10\)"),
    ("segments dtype", _bad(q_segment_ids=jnp.zeros((2, 10), jnp.float32), kv_segment_ids=jnp.zeros((2, 12), jnp.float32)),
     TypeError, "integer dtype"),
    ("bias shape", _bad(bias=jnp.zeros((2, 4, 10, 5), jnp.float32)), ValueError,
     r"bias must be broadcastable to \(2, 4, 10, 12\)"),
    ("bias dtype", _bad(bias=jnp.zeros((10, 12), jnp.int32)), TypeError, "bias must be a floating"),
    ("mask dtype", _bad(mask=jnp.zeros((10, 12), jnp.float32)), TypeError, "mask must be a boolean"),
    ("mask rank", _bad(mask=jnp.zeros((1, 2, 4, 10, 12), bool)), ValueError, "at most 4"),
    ("dropout rate", _bad(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rate must be in \[0, 1\)"),
    ("dropout rate below 2^-9", _bad(dropout_rate=2.0**-10, dropout_rng=jax.random.key(0)),
     ValueError, r"dropout_rate must be 0 or at least 2\^-9"),
    ("dropout rng", _bad(dropout_rate=0.1), ValueError, "dropout_rng"),
    ("window above int64", _bad(local_window_size=10**30), ValueError,
     "local_window_size must fit in int64"),
    ("window pair above int64", _bad(local_window_size=(0, 2**63)), ValueError,
     "local_window_size must fit in int64"),
    ("window bool", _bad(local_window_size=True), TypeError, "local_window_size"),
    ("scale above float32", _bad(scale=1e39), ValueError, "scale must be at most"),
    ("cap above float32", _bad(logits_soft_cap=1e39), ValueError, "logits_soft_cap must be at most"),
    ("cap below float32 normals", _bad(logits_soft_cap=1e-40), ValueError,
     "logits_soft_cap must be >= "),
    ("segments int64 and uint64", _bad(q_segment_ids=np.zeros((2, 10), np.int64),
                                       kv_segment_ids=np.zeros((2, 12), np.uint64)), TypeError,
     "common integer type"),
    ("lengths beyond int64", _bad(query_seq_lengths=[2**70, 1]), TypeError,
     "query_seq_lengths must have an integer dtype"),
    ("deterministic type", _bad(deterministic="no"), TypeError, "deterministic must be a bool"),
] + [
    # Anything but one key: a jax.random.key(seed) or jax.random.PRNGKey(seed).
    (f"dropout rng {case}", _bad(dropout_rate=0.1, dropout_rng=rng), error,
     "dropout_rng must be one PRNG key, from jax.random.key")
    for case, rng, error in [
        ("int", 3, TypeError), ("str", "key", TypeError), ("float", jnp.zeros(2), TypeError),
        ("uint32 (3,)", jnp.zeros(3, jnp.uint32), TypeError),
        ("uint32 scalar", np.uint32(7), TypeError),
        ("typed batch", jax.random.split(jax.random.key(0), 2), ValueError),
        ("raw batch", jax.random.split(jax.random.PRNGKey(0), 2), ValueError),
    ]
]


@pytest.mark.parametrize("args,error,message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_before_lowering(args, error, message):
  with pytest.raises(error, match=message):
    jax_flash.flash_attention(**args)
  with pytest.raises(error, match=message):  # also while tracing under jit
    jax.jit(lambda: jax_flash.flash_attention(**args)).lower()


# -- static arguments given as tracers --------------------------------------------

STATIC_VALUES = {"scale": 0.5, "logits_soft_cap": 2.0, "local_window_size": (3, 2),
                 "dropout_rate": 0.1, "is_causal": True, "broadcast_dropout": True,
                 "deterministic": True, "return_residual": True}


@pytest.mark.parametrize("name", sorted(STATIC_VALUES))
def test_traced_static_argument_says_to_make_it_static(name):
  q, k, v = qkv()
  extra = dict(dropout_rng=jax.random.key(0)) if name == "dropout_rate" else {}
  value = STATIC_VALUES[name]
  f = lambda value: jax_flash.flash_attention(q, k, v, **extra, **{name: value})
  with pytest.raises(TypeError, match=rf"{name} must be a static Python value, got a traced "
                     rf"value.*static_argnames=\"{name}\""):
    jax.jit(f)(value)
  # What the message says works:
  jax.jit(jax_flash.flash_attention, static_argnames=name)(q, k, v, **extra, **{name: value})


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_static_argument_under_vmap_and_grad(transform):
  q, k, v = qkv()
  f = lambda s: jnp.sum(jax_flash.dot_product_attention(q, k, v, scale=s))
  with pytest.raises(TypeError, match="scale must be a static Python value"):
    (jax.vmap(f) if transform == "vmap" else jax.grad(f))(jnp.ones(2) if transform == "vmap"
                                                          else 0.5)


def test_concrete_arrays_are_static_values():
  q, k, v = qkv(dtype=jnp.float64)
  got = jax_flash.flash_attention(q, k, v, scale=jnp.float64(0.3), is_causal=jnp.bool_(True),
                                  local_window_size=(np.int64(3), jnp.int32(2)))
  want = dense(q, k, v, band(10, 12, causal=True, window=(3, 2)), Options(scale=0.3))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


# -- integer operands: exact for every integer dtype ------------------------------

def dense(q, k, v, visible, opts=Options(), bias=None):
  """The float64 dense output for a visibility mask broadcastable to (B, N, T, S)."""
  batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
  visible = np.broadcast_to(visible, (batch, 1, seqlen_q, seqlen_k))
  return attention(q, k, v, jnp.asarray(visible), opts, bias=bias)[0]


def band(seqlen_q, seqlen_k, causal=False, window=None):
  """(T, S) visibility from the definitions, in Python integers (no overflow)."""
  left, right = window if window is not None else (None, None)
  return np.array([[(not causal or j <= i) and (left is None or i - left <= j) and
                    (right is None or j <= i + right) for j in range(seqlen_k)]
                   for i in range(seqlen_q)])


def lengths_visible(q_lengths, kv_lengths, seqlen_q=10, seqlen_k=12):
  q_lengths = np.clip(np.asarray(q_lengths, object), 0, seqlen_q).astype(np.int64)
  kv_lengths = np.clip(np.asarray(kv_lengths, object), 0, seqlen_k).astype(np.int64)
  return ((np.arange(seqlen_q)[None, :, None] < q_lengths[:, None, None]) &
          (np.arange(seqlen_k)[None, None, :] < kv_lengths[:, None, None]))[:, None]


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32, np.int8],
                         ids=lambda d: np.dtype(d).name)
def test_lengths_of_any_integer_dtype_are_exact(backend, dtype):
  q, k, v = qkv(dtype=jnp.float64)
  info = np.iinfo(dtype)
  # int64: 2**32 + 2 once became 2 in the int32 cast.
  q_lengths = np.array([info.max, 7], dtype)
  kv_lengths = np.array([min(2**32 + 2, info.max) if info.bits > 8 else 5,
                         info.min if info.min < 0 else 11], dtype)
  want = dense(q, k, v, lengths_visible(q_lengths, kv_lengths))
  f = lambda a, b: jax_flash.flash_attention(q, k, v, query_seq_lengths=a,
                                             key_value_seq_lengths=b)
  for got in (f(q_lengths, kv_lengths), f(jnp.asarray(q_lengths), jnp.asarray(kv_lengths)),
              jax.jit(f)(q_lengths, kv_lengths)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


# Distinct ids, several of them equal modulo 2**32 (the int32 cast made them one).
ID_POOL = np.array([0, 2**32, 2**33 + 7, 7, -2**40, 2**63 - 1, -1, -2**63], np.int64)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32, np.int16],
                         ids=lambda d: np.dtype(d).name)
def test_segment_ids_of_any_integer_dtype_are_exact(backend, dtype):
  q, k, v = qkv(dtype=jnp.float64)
  rng = np.random.default_rng(5)
  q_ids = ID_POOL.astype(dtype)[rng.integers(0, len(ID_POOL), (2, 10))]
  kv_ids = ID_POOL.astype(dtype)[rng.integers(0, len(ID_POOL), (2, 12))]
  kv_ids[:, 0] = q_ids[:, 0]
  want = dense(q, k, v, (q_ids[:, :, None] == kv_ids[:, None, :])[:, None])
  f = lambda q, k, v, a, b: jax_flash.flash_attention(q, k, v, q_segment_ids=a,
                                                      kv_segment_ids=b)
  per_example = jax.vmap(lambda *args: f(*(x[None] for x in args))[0])
  for got in (f(q, k, v, q_ids, kv_ids), f(q, k, v, jnp.asarray(q_ids), jnp.asarray(kv_ids)),
              jax.jit(f)(q, k, v, q_ids, kv_ids), jax.jit(per_example)(q, k, v, q_ids, kv_ids)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_int64_host_ids_and_lengths_without_x64(backend):
  """With x64 off, jax would cast int64 numpy arrays to int32 silently."""
  q, k, v = qkv(dtype=jnp.float64)
  rng = np.random.default_rng(6)
  q_ids = ID_POOL[rng.integers(0, len(ID_POOL), (2, 10))]
  kv_ids = ID_POOL[rng.integers(0, len(ID_POOL), (2, 12))]
  kv_lengths = np.array([2**32 + 2, 2**40], np.int64)
  want = dense(q, k, v, (q_ids[:, :, None] == kv_ids[:, None, :])[:, None] &
               lengths_visible([10, 10], kv_lengths))
  with jax.enable_x64(False):
    got = jax_flash.flash_attention(*(jnp.asarray(np.asarray(x), jnp.float32) for x in (q, k, v)),
                                    q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                    key_value_seq_lengths=kv_lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [sys.maxsize, (0, sys.maxsize), (sys.maxsize, 0), (2, 2**62),
                                    (10, 12), (9, 11)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_windows_of_any_size_are_exact(backend, window, is_causal):
  q, k, v = qkv(dtype=jnp.float64)
  pair = window if isinstance(window, tuple) else (window, window)
  got = jax_flash.flash_attention(q, k, v, local_window_size=window, is_causal=is_causal)
  want = dense(q, k, v, band(10, 12, is_causal, pair))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_handler_clamps_windows(backend):
  """A direct primitive call with int64-max bounds: no overflow in i + right."""
  q, k, v = qkv(dtype=jnp.float64)
  operands = [q, k, v, *map(jnp.asarray, mask_operands(q.dtype))]
  big = np.iinfo(np.int64).max
  for left, right in [(big, big), (0, big), (big, 0)]:
    out, _ = flash_fwd_p.bind(*operands, **dict(FWD_PARAMS, scale=8**-0.5, window_left=left,
                                                window_right=right))
    want = dense(q, k, v, band(10, 12, window=(left, right)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12, atol=1e-12)


# -- empty problems -------------------------------------------------------------

@pytest.mark.parametrize("bias_shape", ["full", (1, 1, 1, 1), (1, 4, 1, 1), "keys"])
@pytest.mark.parametrize("empty", ["no rows", "no keys", "no batch"])
def test_empty_problems_with_a_bias(backend, empty, bias_shape):
  """Forward and gradient; the bias's gradient has the bias's shape (zeros)."""
  batch, seqlen_q, seqlen_k = {"no rows": (2, 0, 12), "no keys": (2, 10, 0),
                               "no batch": (0, 10, 12)}[empty]
  q, k, v = qkv((batch, seqlen_q, 4, 8), (batch, seqlen_k, 2, 8))
  shape = {"full": (batch, 4, seqlen_q, seqlen_k), "keys": (seqlen_k,)}.get(bias_shape, bias_shape)
  bias = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
  dout = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
  f = jax.jit(lambda q, k, v, b: jax_flash.flash_attention(q, k, v, bias=b, is_causal=True))
  out, vjp = jax.vjp(f, q, k, v, bias)
  grads = vjp(dout)
  # No keys: every row sees nothing and outputs 0; otherwise there is nothing.
  assert out.shape == q.shape and not np.asarray(out).any()
  for x, g in zip((q, k, v, bias), grads):
    assert g.shape == x.shape and g.dtype == x.dtype and not np.asarray(g).any()


@pytest.mark.parametrize("terms", ["mask", "mask and segment ids", "mask and block mask"])
@pytest.mark.parametrize("empty", ["no rows", "no keys", "no batch"])
def test_empty_problems_with_a_mask(backend, empty, terms):
  """A dense mask's tile map has no cells along an empty dim (it once indexed
  the last of none); with the other terms that make a tile map too."""
  batch, seqlen_q, seqlen_k = {"no rows": (2, 0, 12), "no keys": (2, 10, 0),
                               "no batch": (0, 10, 12)}[empty]
  q, k, v = qkv((batch, seqlen_q, 4, 8), (batch, seqlen_k, 2, 8))
  extra = dict(mask=jnp.ones((batch, 1, seqlen_q, seqlen_k), bool))
  if "segment" in terms:
    extra.update(q_segment_ids=jnp.zeros((batch, seqlen_q), jnp.int32),
                 kv_segment_ids=jnp.zeros((batch, seqlen_k), jnp.int32))
  if "block" in terms:
    extra.update(block_mask=jnp.ones((1, 1, 1, 1), bool))
  loss = lambda q: jnp.sum(jax_flash.flash_attention(q, k, v, **extra) ** 2)
  out = jax_flash.flash_attention(q, k, v, **extra)
  assert out.shape == q.shape and not np.asarray(out).any()
  assert jax.grad(loss)(q).shape == q.shape


@pytest.mark.parametrize("empty", ["no rows", "no keys", "no batch"])
def test_empty_problems_at_second_order(backend, empty):
  """Second order runs the blockwise JAX code, whose grouping of heads once
  reshaped an empty array with -1 (a division by zero)."""
  batch, seqlen_q, seqlen_k = {"no rows": (2, 0, 12), "no keys": (2, 10, 0),
                               "no batch": (0, 10, 12)}[empty]
  q, k, v = qkv((batch, seqlen_q, 4, 8), (batch, seqlen_k, 2, 8))
  loss = lambda q: jnp.sum(jax_flash.flash_attention(q, k, v, is_causal=True) ** 2)
  _, hvp = jax.jvp(jax.grad(loss), (q,), (jnp.ones_like(q),))
  assert hvp.shape == q.shape and not np.asarray(hvp).any()


# -- dropout keys -------------------------------------------------------------------

def test_typed_and_raw_keys_draw_the_same_mask(backend):
  q, k, v = qkv()
  f = lambda rng: jax_flash.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)
  typed = np.asarray(f(jax.random.key(3)))
  for raw in (jax.random.PRNGKey(3), np.asarray(jax.random.PRNGKey(3))):
    np.testing.assert_array_equal(np.asarray(f(raw)), typed)
  assert not np.array_equal(np.asarray(f(jax.random.key(4))), typed)
  keys = jax.random.split(jax.random.PRNGKey(3), 2)  # vmap over raw keys
  batched = jax.vmap(f)(keys)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(f(keys[i])))


# -- huge values, threads, repeated calls ----------------------------------------

def test_tiny_soft_cap_is_a_cap_not_off(backend):
  """1e-300 is a valid float64 cap (logits become about +-1e-300, near uniform
  attention); rounded to 0 it would have switched the cap off."""
  q, k, v = qkv(dtype=jnp.float64)
  got = jax_flash.flash_attention(q, k, v, logits_soft_cap=1e-300)
  want = dense(q, k, v, np.ones((10, 12), bool), Options(softcap=1e-300))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_concurrent_calls_from_threads(backend):
  """Calls from 8 Python threads at once (eager, jit and grad, several configs)
  give the reference's outputs, and gradients bitwise equal to a serial run."""
  q, k, v = qkv(dtype=jnp.float64)
  configs = [dict(is_causal=c, local_window_size=w) for c in (False, True)
             for w in (None, (2, 1), 3, (0, 5))]
  device = jax.config.jax_default_device

  def run(config):
    with jax.default_device(device):
      out = jax_flash.flash_attention(q, k, v, **config)
      grad = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(jax_flash.flash_attention(
          q, k, v, **config)))))(q)
      return np.asarray(out), np.asarray(grad)

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(run, configs))
  for config, (out, grad) in zip(configs, results):
    window = config["local_window_size"]
    window = (window, window) if isinstance(window, int) else window
    want = dense(q, k, v, band(10, 12, config["is_causal"], window))
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(grad, run(config)[1])


def test_repeated_calls_are_bitwise_identical(backend):
  q, k, v = qkv(dtype=jnp.bfloat16)
  rng = np.random.default_rng(7)
  bias = jnp.asarray(rng.standard_normal((1, 4, 10, 12)), jnp.float32)
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, 12)), axis=-1))
  kwargs = dict(is_causal=True, q_segment_ids=ids[:, :10], kv_segment_ids=ids,
                dropout_rate=0.2, dropout_rng=jax.random.key(1), deterministic=True)
  loss = lambda q, k, v, b: jnp.sum(jax_flash.flash_attention(q, k, v, bias=b, **kwargs)
                                    .astype(jnp.float32) ** 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  first = [np.asarray(x) for x in jax.tree.leaves(step(q, k, v, bias))]
  for _ in range(3):
    again = [np.asarray(x) for x in jax.tree.leaves(step(q, k, v, bias))]
    for a, b in zip(first, again):
      np.testing.assert_array_equal(a, b)
  eager = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
  for a, b in zip(first, jax.tree.leaves(eager)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_dot_product_attention_rejects_rank_5():
  q = jnp.zeros((1, 2, 10, 4, 8))
  with pytest.raises(ValueError, match=r"\(B, T, N, H\) or \(T, N, H\)"):
    jax_flash.dot_product_attention(q, q, q)


def test_dot_product_attention_rejects_an_implementation():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="implementation must be None"):
    jax_flash.dot_product_attention(q, k, v, implementation="cudnn")


# -- the C++ handlers validate too: errors, never a crash -----------------------

FWD_PARAMS = dict(scale=1.0, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                  dropout_rate=0.0, broadcast_dropout=False)


@pytest.mark.parametrize("case", ["lengths shape", "segment shape", "lengths dtype",
                                  "scale", "softcap", "one segment operand", "bias shape",
                                  "bias dtype", "16-bit bias, float32 inputs",
                                  "other 16-bit bias", "mask dtype", "dropout without key",
                                  "dropout key batch"])
def test_handler_rejects_bad_operands(backend, case):
  q, k, v = qkv(dtype=jnp.bfloat16 if case == "other 16-bit bias" else jnp.float32)
  ops = {}
  params = dict(FWD_PARAMS)
  if case == "lengths shape":
    ops["q_seqlens"] = np.zeros((5,), np.int32)
  elif case == "segment shape":
    ops["q_segment_ids"], ops["kv_segment_ids"] = (np.zeros((2, 3), np.int32),
                                                   np.zeros((2, 12), np.int32))
  elif case == "lengths dtype":
    ops["kv_seqlens"] = np.zeros((2,), np.float32)
  elif case == "scale":
    params["scale"] = float("inf")
  elif case == "softcap":
    params["softcap"] = -2.0
  elif case == "one segment operand":
    ops["q_segment_ids"] = np.zeros((2, 10), np.int32)
  elif case == "bias shape":
    ops["bias"] = np.zeros((2, 4, 10, 5), np.float32)
  elif case == "bias dtype":
    ops["bias"] = np.zeros((1, 1, 10, 12), np.float64)
  elif case == "16-bit bias, float32 inputs":
    ops["bias"] = jnp.zeros((1, 1, 10, 12), jnp.bfloat16)
  elif case == "other 16-bit bias":  # bfloat16 inputs take a float32 or bfloat16 bias
    ops["bias"] = np.zeros((1, 1, 10, 12), np.float16)
  elif case == "mask dtype":
    ops["mask"] = np.zeros((1, 1, 10, 12), np.int32)
  elif case == "dropout without key":
    params["dropout_rate"] = 0.5
  elif case == "dropout key batch":
    params["dropout_rate"] = 0.5
    ops["dropout_key"] = np.zeros((3, 2), np.uint32)
  operands = [q, k, v, *mask_operands(q.dtype, **ops)]
  # Shapes as Python writes tuples: (2,), not (2).
  message = {"lengths shape": r"jax_flash: q_seqlens must have shape \(2,\), got \(5,\)"}
  with pytest.raises(Exception, match=message.get(case, "jax_flash")):
    jax.block_until_ready(flash_fwd_p.bind(*map(jnp.asarray, operands), **params))


def call_mask_operands(dtype, **ops):
  """mask_operands as a direct custom call takes them: absent ones (0,)."""
  return [np.zeros((0,), x.dtype) if primitives.is_absent(x) else jnp.asarray(x)
          for x in mask_operands(dtype, **ops)]


def test_cpu_handler_rejects_a_16bit_bias():
  """The CPU kernels read a float32 bias and jax_flash's CPU lowering converts
  a 16-bit one before the call: only a direct custom call brings one."""
  q, k, v = qkv(dtype=jnp.bfloat16)
  bias = jnp.zeros((1, 4, 10, 12), jnp.bfloat16)
  call = jax.ffi.ffi_call(_ffi.FWD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                            jax.ShapeDtypeStruct((2, 4, 10), jnp.float32)))
  attributes = _ffi.attributes(_ffi.FWD_TARGET, FWD_PARAMS)
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(Exception, match="CPU kernels read the bias in float32, got bfloat16"):
      jax.block_until_ready(jax.jit(lambda *a: call(*a, **attributes))(
          q, k, v, *call_mask_operands(q.dtype, bias=bias)))


def test_bwd_handler_rejects_bad_dbias():
  """dbias is float32 for 16-bit inputs whatever the bias's dtype (the CPU
  call: the CUDA one also has the results its lowering sizes)."""
  q, k, v = qkv(dtype=jnp.bfloat16)
  lse = jnp.zeros((2, 4, 10), jnp.float32)
  bias = jnp.zeros((1, 4, 10, 12), jnp.float32)
  results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
  call = jax.ffi.ffi_call(_ffi.BWD_TARGET,
                          (*results, jax.ShapeDtypeStruct(bias.shape, jnp.bfloat16)))
  attributes = _ffi.attributes(_ffi.BWD_TARGET, dict(FWD_PARAMS, deterministic=False))
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(Exception, match="dbias must have the shape of bias and dtype float32"):
      jax.block_until_ready(jax.jit(lambda *a: call(*a, **attributes))(
          q, k, v, q, lse, q, *call_mask_operands(q.dtype, bias=bias)))


def test_bwd_handler_rejects_bad_lse(backend):
  q, k, v = qkv()
  bad_lse = jnp.zeros((2, 4, 10), jnp.float64)  # must be float32 for float32 inputs
  with pytest.raises(Exception, match="lse must be float32"):
    jax.block_until_ready(flash_bwd_p.bind(q, k, v, q, bad_lse, q,
                                           *map(jnp.asarray, mask_operands(q.dtype)),
                                           deterministic=False, bias_grad=False,
                                           **FWD_PARAMS))


def test_bwd_without_a_bias_gives_an_absent_dbias_even_if_asked(backend):
  """bias_grad=True with no bias: dbias is the absent (0,) result, also under vmap."""
  q, k, v = qkv()
  out, lse = flash_fwd_p.bind(q, k, v, *mask_operands(q.dtype), **FWD_PARAMS)
  bwd = lambda q, out, lse: flash_bwd_p.bind(q, k, v, out, lse, q, *mask_operands(q.dtype),
                                             deterministic=False, bias_grad=True, **FWD_PARAMS)
  assert bwd(q, out, lse)[3].shape == (0,)
  assert jax.vmap(bwd)(*(x[None] for x in (q, out, lse)))[3].shape == (1, 0)


def test_build_info():
  info = jax_flash.build_info()
  assert info["version"] == jax_flash.__version__
  assert info["jax_version"] == jax.__version__
  assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], list)
  assert info["max_head_dim"] == 256
  assert info["jaxlib_build_version"]

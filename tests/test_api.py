"""The public API: jax.nn compatibility, clear errors for bad input, build info."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.primitives import flash_bwd_p, flash_fwd_p


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
    ("dropout rng", _bad(dropout_rate=0.1), ValueError, "dropout_rng"),
]


@pytest.mark.parametrize("args,error,message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_before_lowering(args, error, message):
  with pytest.raises(error, match=message):
    jax_flash.flash_attention(**args)
  with pytest.raises(error, match=message):  # also while tracing under jit
    jax.jit(lambda: jax_flash.flash_attention(**args)).lower()


def test_dot_product_attention_rejects_rank_5():
  q = jnp.zeros((1, 2, 10, 4, 8))
  with pytest.raises(ValueError, match=r"\(B, T, N, H\) or \(T, N, H\)"):
    jax_flash.dot_product_attention(q, q, q)


def test_dot_product_attention_rejects_an_implementation():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="implementation must be None"):
    jax_flash.dot_product_attention(q, k, v, implementation="cudnn")


# -- the C++ handlers validate too: errors, never a crash -----------------------

NO = np.zeros((0,), np.int32)
NO_BIAS = np.zeros((0,), np.float32)
NO_MASK = np.zeros((0,), bool)
NO_KEY = np.zeros((0,), np.uint32)
FWD_PARAMS = dict(scale=1.0, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                  dropout_rate=0.0, broadcast_dropout=False)


@pytest.mark.parametrize("case", ["lengths shape", "segment shape", "lengths dtype",
                                  "scale", "softcap", "one segment operand", "bias shape",
                                  "bias dtype", "mask dtype", "dropout without key",
                                  "dropout key batch"])
def test_handler_rejects_bad_operands(backend, case):
  q, k, v = qkv()
  operands = [q, k, v, NO, NO, NO, NO, NO_BIAS, NO_MASK, NO_KEY]
  params = dict(FWD_PARAMS)
  if case == "lengths shape":
    operands[3] = np.zeros((5,), np.int32)
  elif case == "segment shape":
    operands[5], operands[6] = np.zeros((2, 3), np.int32), np.zeros((2, 12), np.int32)
  elif case == "lengths dtype":
    operands[4] = np.zeros((2,), np.float32)
  elif case == "scale":
    params["scale"] = float("inf")
  elif case == "softcap":
    params["softcap"] = -2.0
  elif case == "one segment operand":
    operands[5] = np.zeros((2, 10), np.int32)
  elif case == "bias shape":
    operands[7] = np.zeros((2, 4, 10, 5), np.float32)
  elif case == "bias dtype":
    operands[7] = np.zeros((1, 1, 10, 12), np.float64)
  elif case == "mask dtype":
    operands[8] = np.zeros((1, 1, 10, 12), np.int32)
  elif case == "dropout without key":
    params["dropout_rate"] = 0.5
  elif case == "dropout key batch":
    params["dropout_rate"] = 0.5
    operands[9] = np.zeros((3, 2), np.uint32)
  with pytest.raises(Exception, match="jax_flash"):
    jax.block_until_ready(flash_fwd_p.bind(*map(jnp.asarray, operands), **params))


def test_bwd_handler_rejects_bad_lse(backend):
  q, k, v = qkv()
  bad_lse = jnp.zeros((2, 4, 10), jnp.float64)  # must be float32 for float32 inputs
  with pytest.raises(Exception, match="lse must be float32"):
    jax.block_until_ready(flash_bwd_p.bind(q, k, v, q, bad_lse, q,
                                           *map(jnp.asarray, [NO] * 4 + [NO_BIAS, NO_MASK, NO_KEY]),
                                           deterministic=False, **FWD_PARAMS))


def test_build_info():
  info = jax_flash.build_info()
  assert info["version"] == jax_flash.__version__
  assert info["jax_version"] == jax.__version__
  assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], list)
  assert info["max_head_dim"] == 256
  assert info["jaxlib_build_version"]

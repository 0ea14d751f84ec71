"""NaN semantics, as jax.nn: a NaN reaches the rows it touches and is never turned into 0.

A NaN in q, k or the bias makes NaN exactly the logits it enters; every
query row with such a visible logit outputs NaN (and NaN logsumexp), every
other row is unchanged. A NaN in v reaches the output column it sits in, in
every row that sees its key. A row that sees no key still outputs 0.

Gradients: through the products (0 x NaN = NaN) a NaN can reach other rows and
keys of its tile, as it reaches every one in jax.nn's dense implementation, so
within the poisoned batch element the tests only ask that the gradients it
touches are NaN; the other batch element must be exact.

Head dims 64 and 128 run the tensor-core kernels for bfloat16/float16 on a GPU
(on Hopper: the wgmma forward at 128, the wgmma backward at 64 and 128), 40
the exact kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import assert_flash_close
from reference import Options, attention_and_grads, make_inputs, visible_mask

DTYPES = [jnp.float64, jnp.float32, jnp.bfloat16, jnp.float16]
BATCH, SEQ_Q, SEQ_K, HEADS, KV_HEADS = 2, 70, 90, 2, 1


def poisoned_inputs(where: str, head_dim: int, opts: Options, seed: int):
  """Inputs with one NaN in `where`; returns (inputs, bias, touched (B, N, T) rows)."""
  inputs = make_inputs(np.random.default_rng(seed), BATCH, SEQ_Q, SEQ_K, HEADS, KV_HEADS,
                       head_dim)
  bias = None
  visible = np.broadcast_to(visible_mask(opts, inputs), (BATCH, HEADS, SEQ_Q, SEQ_K))
  touched = np.zeros((BATCH, HEADS, SEQ_Q), bool)
  if where == "q":
    inputs.q[0, 37, 1, 3] = np.nan
    touched[0, 1, 37] = visible[0, 1, 37].any()
  elif where == "k":
    # Key 0: under the causal mask query 0 sees nothing else, so all of its
    # logits are NaN (the case that used to pass for "sees no key").
    inputs.k[0, 0, 0, 5] = np.nan
    touched[0] = visible[0, :, :, 0]
  elif where == "bias":
    bias = np.random.default_rng(seed + 1).standard_normal((BATCH, HEADS, SEQ_Q, SEQ_K))
    bias[0, 0, 5, 3] = np.nan   # visible with or without the causal mask
    bias[0, 1, 10, 60] = np.nan  # hidden by the causal mask
    touched[0, 0, 5] = visible[0, 0, 5, 3]
    touched[0, 1, 10] = visible[0, 1, 10, 60]
  elif where == "v":
    inputs.v[0, 20, 0, 2] = np.nan
    touched[0] = visible[0, :, :, 20]
  return inputs, bias, touched


def run(inputs, bias, opts, dtype):
  q, k, v, dout = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
  bias = None if bias is None else jnp.asarray(bias, dtype)
  kwargs = opts.kwargs(inputs)

  @jax.jit
  def fwd_bwd(q, k, v, bias, dout):
    def f(q, k, v, bias):
      return jax_flash.flash_attention(q, k, v, bias=bias, return_residual=True, **kwargs)
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    return (out, lse) + tuple(g for g in vjp((dout, jnp.zeros_like(lse))) if g is not None)

  return [np.asarray(x, np.float64) for x in fwd_bwd(q, k, v, bias, dout)]


def references(inputs, bias, opts, dtype):
  mask = visible_mask(opts, inputs)
  f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  ref = attention_and_grads(*(f64(x) for x in (inputs.q, inputs.k, inputs.v, inputs.dout)),
                            mask, opts, bias=f64(bias))
  plain = attention_and_grads(*(cast(x) for x in (inputs.q, inputs.k, inputs.v, inputs.dout)),
                              mask, opts, bias=cast(bias))
  return ([np.asarray(x, np.float64) for x in ref], [np.asarray(x, np.float64) for x in plain])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["q", "k", "bias", "v"])
def test_nan_reaches_exactly_the_rows_it_touches(backend, where, causal, head_dim, dtype):
  opts = Options(is_causal=causal)
  inputs, bias, touched = poisoned_inputs(where, head_dim, opts, seed=head_dim + causal)
  assert touched.any()
  got = run(inputs, bias, opts, dtype)
  ref, plain = references(inputs, bias, opts, dtype)
  out, lse = got[0], got[1]                           # (B, T, N, H), (B, T, N)
  rows = np.transpose(touched, (0, 2, 1))             # (B, T, N)

  if where == "v":
    # The poisoned column is NaN in every row that sees key 20; the other
    # columns of every row are exact, and so is the logsumexp.
    assert np.isnan(out[..., 2][rows]).all()
    others = np.delete(out, 2, axis=-1)
    assert_flash_close("out (other columns)", others, np.delete(ref[0], 2, axis=-1),
                       np.delete(plain[0], 2, axis=-1), dtype)
    assert_flash_close("lse", lse, ref[1], plain[1], dtype)
  else:
    assert np.isnan(out[rows]).all(), "a touched row must be NaN in every column"
    assert np.isnan(lse[rows]).all(), "a touched row's logsumexp must be NaN"
    assert_flash_close("out (untouched rows)", out[~rows], ref[0][~rows], plain[0][~rows], dtype)
    assert_flash_close("lse (untouched rows)", lse[~rows], ref[1][~rows], plain[1][~rows],
                       dtype)

  # Gradients: what the NaN touches is NaN; the other batch element is exact.
  dq, dk, dv = got[2], got[3], got[4]
  assert np.isnan(dq[rows]).any(axis=-1).all(), "dq of a touched row must hold NaN"
  kv_touched = np.einsum("bnt,bnts->bs", touched.astype(int),
                         np.broadcast_to(visible_mask(opts, inputs),
                                         (BATCH, HEADS, SEQ_Q, SEQ_K)).astype(int)) > 0
  assert np.isnan(dk[kv_touched]).any(axis=-1).all(), "dk of a key a NaN row sees"
  if where != "v":  # (a NaN value changes no probability: dv stays finite)
    assert np.isnan(dv[kv_touched]).any(axis=-1).all(), "dv of a key a NaN row sees"
  for name, g, r, p in zip(["dq", "dk", "dv"], got[2:5], ref[2:5], plain[2:5]):
    assert_flash_close(name + " (clean batch element)", g[1], r[1], p[1], dtype)
  if bias is not None:
    assert_flash_close("dbias (clean batch element)", got[5][1], ref[5][1], plain[5][1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_row_that_sees_nothing_outputs_zero_next_to_nan(backend, dtype):
  """Padding rows stay 0 (lse -inf) even when their own query or a value is NaN."""
  opts = Options(with_lengths=True)
  inputs = make_inputs(np.random.default_rng(7), BATCH, SEQ_Q, SEQ_K, HEADS, KV_HEADS, 64)
  inputs.q_lengths[:] = [60, SEQ_Q]
  inputs.kv_lengths[:] = [SEQ_K, SEQ_K]
  inputs.q[0, 65, 0, 1] = np.nan   # a padding row of batch element 0
  inputs.v[0, 4, 0, 0] = np.nan    # seen by every real row of batch element 0
  out, lse = run(inputs, None, opts, dtype)[:2]
  np.testing.assert_array_equal(out[0, 60:], 0.0)
  np.testing.assert_array_equal(lse[0, 60:], -np.inf)
  assert np.isnan(out[0, :60, :, 0]).all()
  assert np.isfinite(out[0, :60, :, 1:]).all() and np.isfinite(out[1]).all()

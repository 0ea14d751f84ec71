"""The offsets operand: a kernel told where its chunk sits in the whole problem.

What sharded calls and ring attention rely on: a chunk of queries and keys
with its global query and key positions (causal masks, windows, lengths),
batch and head indices (dropout) gives the rows of the whole problem,
against the float64 reference on the chunk's global positions, on every
backend; the dropout mask it draws is the whole problem's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import assert_flash_close
from jax_flash.primitives import absent_operand, flash_bwd_p, flash_fwd_p, mask_operands
from reference import Options, make_inputs, one_hot_problem, recovered_mask
from reference import attention_and_grads as dense_attention_and_grads

# The float64 reference under jit: one compilation per shape instead of one
# per operation. (The plain same-dtype implementations stay eager: under jit
# XLA may keep excess precision, which would make them a different yardstick.)
attention_and_grads = jax.jit(dense_attention_and_grads, static_argnums=5)

NO_INT = absent_operand(np.int32)


def chunk_operands(offsets, acc_dtype, q_lengths=NO_INT, kv_lengths=NO_INT,
                   dropout_key=absent_operand(np.uint32)):
  return [jnp.asarray(x) for x in mask_operands(
      acc_dtype, q_seqlens=q_lengths, kv_seqlens=kv_lengths, dropout_key=dropout_key,
      offsets=np.asarray(offsets, np.int32))]


def chunk_params(scale, causal=False, window=(-1, -1), dropout_rate=0.0):
  return dict(scale=scale, softcap=0.0, is_causal=causal, window_left=window[0],
              window_right=window[1], dropout_rate=dropout_rate, broadcast_dropout=False)


CHUNKS = {  # (query position, key position, causal, window, lengths)
    "causal": (40, 10, True, (-1, -1), False),
    "causal_behind": (5, 60, True, (-1, -1), False),  # most rows see no key of the chunk
    "window": (30, 24, False, (12, 3), False),
    "causal_window_lengths": (20, 30, True, (25, 0), True),
}


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(CHUNKS))
def test_offsets_place_a_chunk_in_the_sequence(backend, case, dtype):
  """A call on a chunk masks by global positions: causal, window, lengths."""
  q_pos, kv_pos, causal, window, lengths = CHUNKS[case]
  rng = np.random.default_rng(len(case))
  inputs = make_inputs(rng, 2, 45, 70, 4, 2, 64)
  # Lengths count from the start of the whole sequence.
  q_lengths = np.array([q_pos + 30, q_pos - 1], np.int32)
  kv_lengths = np.array([kv_pos + 50, kv_pos + 3], np.int32)
  i = q_pos + np.arange(45)[:, None]
  j = kv_pos + np.arange(70)[None, :]
  visible = np.ones((2, 45, 70), bool)
  if causal:
    visible &= j <= i
  if window[0] >= 0:
    visible &= (j >= i - window[0]) & (j <= i + window[1])
  if lengths:
    visible &= (i[None] < q_lengths[:, None, None]) & (j[None] < kv_lengths[:, None, None])
  visible = visible[:, None]
  scale = 0.125
  acc = np.float64 if dtype == jnp.float64 else np.float32
  ops = chunk_operands([q_pos, kv_pos, 0, 0], acc,
                       *((q_lengths, kv_lengths) if lengths else ()))
  params = chunk_params(scale, causal, window)
  q, k, v, dout = (jnp.asarray(x, dtype) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))

  @jax.jit
  def kernels(q, k, v, dout):
    out, lse = flash_fwd_p.bind(q, k, v, *ops, **params)
    dq, dk, dv, _ = flash_bwd_p.bind(q, k, v, out, lse, dout, *ops, deterministic=False,
                                     bias_grad=False, **params)
    return out, jnp.swapaxes(lse, 1, 2), dq, dk, dv

  got = kernels(q, k, v, dout)
  opts = Options(scale=scale)
  ref = attention_and_grads(inputs.q, inputs.k, inputs.v, inputs.dout, visible, opts)
  plain = dense_attention_and_grads(q, k, v, dout, visible, opts)
  for name, g, r, p in zip(["out", "lse", "dq", "dk", "dv"], got, ref, plain):
    assert_flash_close(f"{case} {name}", g, r, p, dtype)


def test_dropout_offsets_draw_the_global_mask(backend):
  """A chunk with batch, head, row and column offsets (positions in whole
  16 x 16 blocks of draws) drops exactly the elements of the whole problem
  it covers."""
  q, k, v = one_hot_problem(3, 50, 48, 3)
  rng = jax.random.key(11)
  whole = recovered_mask(jax_flash.flash_attention(q, k, v, dropout_rate=0.3, dropout_rng=rng))
  b, h, rows, cols = slice(1, 3), slice(1, 3), slice(16, 45), slice(32, 48)
  words = jax.random.bits(rng, (1, 2), jnp.uint32)  # as flash_attention draws them
  ops = chunk_operands([16, 32, 1, 1], np.float64, dropout_key=words)
  out, _ = jax.jit(lambda q, k, v: flash_fwd_p.bind(
      q, k, v, *ops, **chunk_params(0.2, dropout_rate=0.3)))(
          q[b, rows, h], k[b, cols, h], v[b, cols, h])
  # v rows are one-hot at columns 32..47 of the head dim: the chunk's keys.
  np.testing.assert_array_equal(np.asarray(recovered_mask(out))[..., cols],
                                np.asarray(whole)[b, h, rows, cols])


def test_handler_rejects_bad_offsets():
  q = jnp.zeros((1, 4, 1, 8))
  ops = chunk_operands([0, 0, 0], np.float64)
  with pytest.raises(Exception, match="offsets must be int32"):
    jax.block_until_ready(flash_fwd_p.bind(q, q, q, *ops, **chunk_params(1.0)))

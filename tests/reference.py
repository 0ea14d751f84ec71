"""Plain dense attention: the yardstick every kernel is compared with.

No tiling, no online softmax: the whole logits matrix, a boolean mask built
element by element from the same definitions as jax.nn, and a softmax whose
fully masked rows are 0. `attention` runs in any dtype: in float64 it is the
reference; in a kernel's own dtype it is the "plain same-dtype
implementation" whose error sets the FlashAttention tolerance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything that shapes the attention pattern; None/False means off."""
  scale: float | None = None
  is_causal: bool = False
  window: tuple[int, int] | None = None
  softcap: float | None = None
  with_lengths: bool = False
  with_segments: bool = False
  # Shape of a random dense bias / boolean mask, broadcastable to (B, N, T, S).
  bias_shape: tuple[int, ...] | None = None
  mask_shape: tuple[int, ...] | None = None

  def kwargs(self, inputs: "Inputs") -> dict:
    """Keyword arguments of jax_flash.flash_attention for these options."""
    kw = dict(scale=self.scale, is_causal=self.is_causal, local_window_size=self.window,
              logits_soft_cap=self.softcap)
    if self.with_lengths:
      kw.update(query_seq_lengths=inputs.q_lengths, key_value_seq_lengths=inputs.kv_lengths)
    if self.with_segments:
      kw.update(q_segment_ids=inputs.q_segments, kv_segment_ids=inputs.kv_segments)
    if self.mask_shape is not None:
      kw.update(mask=dense_mask(self, inputs))
    return kw

  def bias(self, inputs: "Inputs"):
    """The float64 bias of these options (None without one)."""
    if self.bias_shape is None:
      return None
    return np.random.default_rng(inputs.q.size).standard_normal(self.bias_shape)


@dataclasses.dataclass
class Inputs:
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  dout: np.ndarray
  q_lengths: np.ndarray
  kv_lengths: np.ndarray
  q_segments: np.ndarray
  kv_segments: np.ndarray


def make_inputs(rng: np.random.Generator, batch, seqlen_q, seqlen_k, heads, kv_heads,
                head_dim) -> Inputs:
  """Fresh float64 inputs plus random lengths and segment ids."""
  normal = lambda *shape: rng.standard_normal(shape)
  q = normal(batch, seqlen_q, heads, head_dim)
  k = normal(batch, seqlen_k, kv_heads, head_dim)
  v = normal(batch, seqlen_k, kv_heads, head_dim)
  dout = normal(batch, seqlen_q, heads, head_dim)
  q_lengths = rng.integers(0, seqlen_q + 1, size=batch).astype(np.int32)
  kv_lengths = rng.integers(0, seqlen_k + 1, size=batch).astype(np.int32)
  # Sorted ids, as packing produces: a few segments per sequence.
  q_segments = np.sort(rng.integers(0, 3, size=(batch, seqlen_q)), axis=-1).astype(np.int32)
  kv_segments = np.sort(rng.integers(0, 3, size=(batch, seqlen_k)), axis=-1).astype(np.int32)
  return Inputs(q, k, v, dout, q_lengths, kv_lengths, q_segments, kv_segments)


def dense_mask(opts: Options, inputs: Inputs) -> np.ndarray:
  """The random boolean mask of these options: about a quarter False, plus
  whole rows and a whole column block that are False."""
  rng = np.random.default_rng(inputs.q.size + 1)
  mask = rng.random(opts.mask_shape) > 0.25
  mask[..., :3, :] = False if mask.shape[-2] > 5 else mask[..., :3, :]
  if mask.shape[-1] > 70:
    mask[..., 64:, :64] = False  # a whole tile of nothing
  return mask


def visible_mask(opts: Options, inputs: Inputs) -> np.ndarray:
  """Boolean (B, 1 or N, T, S): may query i attend key j (jax.nn conventions)."""
  batch, seqlen_q = inputs.q.shape[:2]
  seqlen_k = inputs.k.shape[1]
  i = np.arange(seqlen_q)[:, None]
  j = np.arange(seqlen_k)[None, :]
  mask = np.ones((batch, seqlen_q, seqlen_k), bool)
  if opts.is_causal:
    mask &= j <= i
  if opts.window is not None:
    left, right = opts.window
    mask &= (j >= i - left) & (j <= i + right)
  if opts.with_lengths:
    mask &= (i[None] < inputs.q_lengths[:, None, None]) & (j[None] < inputs.kv_lengths[:, None, None])
  if opts.with_segments:
    mask &= inputs.q_segments[:, :, None] == inputs.kv_segments[:, None, :]
  mask = mask[:, None]
  if opts.mask_shape is not None:
    mask = mask & dense_mask(opts, inputs)
  return mask


def attention(q, k, v, mask, opts: Options, *, bias=None, keep=None, dropout_rate=0.0,
              compute_dtype=None):
  """Dense attention with jnp; returns (out, lse) with lse shaped (B, T, N).

  bias is added to the scaled logits; keep (boolean (B, N, T, S)) is a
  dropout mask applied to the probabilities, kept ones scaled by
  1 / (1 - dropout_rate).

  compute_dtype None: everything in the inputs' dtype, except that 16-bit
  inputs compute logits and softmax in float32 and round P to the input
  dtype before P @ V, which is what a plain bf16/fp16 implementation does.
  """
  dtype = q.dtype
  acc = jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype
  if compute_dtype is not None:
    acc = compute_dtype
  heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
  k = jnp.repeat(k, heads // kv_heads, axis=2)
  v = jnp.repeat(v, heads // kv_heads, axis=2)
  scale = opts.scale if opts.scale is not None else 1.0 / np.sqrt(head_dim)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST).astype(acc) * scale
  if bias is not None:
    logits = logits + bias.astype(acc)
  if opts.softcap is not None:
    logits = opts.softcap * jnp.tanh(logits / opts.softcap)
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)  # fully masked rows
  p = jnp.exp(logits - row_max)
  l = jnp.sum(p, axis=-1, keepdims=True)
  probs = jnp.where(l > 0, p / jnp.where(l > 0, l, 1), 0)
  if keep is not None:
    probs = jnp.where(keep, probs / (1 - dropout_rate), 0)
  out = jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype if compute_dtype is None else acc),
                   v.astype(v.dtype if compute_dtype is None else acc),
                   preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)) + row_max[..., 0],
                  -jnp.inf)
  return out.astype(dtype if compute_dtype is None else acc), jnp.swapaxes(lse, 1, 2)


def attention_and_grads(q, k, v, dout, mask, opts: Options, *, bias=None, compute_dtype=None):
  """(out, lse, dq, dk, dv[, dbias]) of the dense implementation, via jax.vjp."""
  def f(q, k, v, bias):
    return attention(q, k, v, mask, opts, bias=bias, compute_dtype=compute_dtype)[0]
  out, vjp = jax.vjp(f, q, k, v, bias)
  dq, dk, dv, dbias = vjp(dout.astype(out.dtype))
  lse = attention(q, k, v, mask, opts, bias=bias, compute_dtype=compute_dtype)[1]
  return (out, lse, dq, dk, dv) + (() if bias is None else (dbias,))


# -- dropout masks, recovered exactly -------------------------------------------
# Attending to one-hot values (V[j] = e_j) makes output row i the row i of
# the dropped probabilities, so the kept pairs are the non-zero outputs.


def one_hot_problem(batch=2, seqlen_q=50, seqlen_k=64, heads=3, seed=0, kv_heads=None):
  rng = np.random.default_rng(seed)
  kv_heads = heads if kv_heads is None else kv_heads
  q = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_q, heads, seqlen_k)))
  k = jnp.asarray(0.3 * rng.standard_normal((batch, seqlen_k, kv_heads, seqlen_k)))
  v = jnp.broadcast_to(jnp.eye(seqlen_k)[None, :, None, :], (batch, seqlen_k, kv_heads, seqlen_k))
  return q, k, v


def recovered_mask(out):
  """(B, N, T, S) kept elements, from an output computed with one-hot values."""
  return jnp.transpose(out != 0, (0, 2, 1, 3))

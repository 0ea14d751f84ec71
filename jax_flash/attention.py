"""Public attention functions: argument checking, layout, and the custom VJP.

Everything a user can get wrong is checked here, in Python, before anything
is traced into a primitive; the messages name the argument, what was
expected and what came.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _supported
from jax_flash.primitives import MASK_OPERANDS, accumulation_dtype, flash_bwd_p, flash_fwd_p

_NO_INT_OPERAND = np.zeros((0,), np.int32)
_NO_MASK = np.zeros((0,), np.bool_)
_NO_KEY = np.zeros((0,), np.uint32)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static settings of one attention call; hashable, so it keys a cache."""
  scale: float
  softcap: float  # 0.0 = off
  is_causal: bool
  window_left: int  # -1 = unbounded
  window_right: int  # -1 = unbounded
  dropout_rate: float  # 0.0 = off
  broadcast_dropout: bool
  deterministic: bool

  def fwd_params(self) -> dict[str, Any]:
    return dict(scale=self.scale, softcap=self.softcap, is_causal=self.is_causal,
                window_left=self.window_left, window_right=self.window_right,
                dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout)

  def bwd_params(self) -> dict[str, Any]:
    return dict(self.fwd_params(), deterministic=self.deterministic)


@functools.lru_cache(maxsize=None)
def _attention_with_vjp(config: _Config):
  """A custom_vjp function of (q, k, v, *mask operands) -> (out, lse)."""

  @jax.custom_vjp
  def attention(q, k, v, *mask_operands):
    return tuple(flash_fwd_p.bind(q, k, v, *mask_operands, **config.fwd_params()))

  def fwd(q, k, v, *mask_operands):
    out, lse = flash_fwd_p.bind(q, k, v, *mask_operands, **config.fwd_params())
    return (out, lse), (q, k, v, out, lse, mask_operands)

  def bwd(residuals, cotangents):
    q, k, v, out, lse, mask_operands = residuals
    dout, _ = cotangents  # lse is returned under stop_gradient: its cotangent is 0.
    dq, dk, dv, dbias = flash_bwd_p.bind(q, k, v, out, lse, dout.astype(q.dtype),
                                         *mask_operands, **config.bwd_params())
    cotangents = [None] * len(mask_operands)
    if mask_operands[MASK_OPERANDS.index("bias")].size:
      cotangents[MASK_OPERANDS.index("bias")] = dbias
    return (dq, dk, dv, *cotangents)

  attention.defvjp(fwd, bwd)
  return attention


# -- argument checking ---------------------------------------------------------


def _check_qkv(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim < 3:
      raise ValueError(f"{name} must have shape (batch..., seq, heads, head_dim) with at "
                       f"least 3 dimensions, got shape {x.shape}")
    if jnp.dtype(x.dtype).name not in _supported.DTYPES:
      raise TypeError(f"{name} dtype must be one of {', '.join(_supported.DTYPES)}, "
                      f"got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError("query, key and value must have the same dtype, got "
                    f"{query.dtype}, {key.dtype}, {value.dtype}")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape, got {key.shape} and "
                     f"{value.shape}")
  if query.ndim != key.ndim or query.shape[:-3] != key.shape[:-3]:
    raise ValueError("query and key must have the same batch dimensions, got query "
                     f"{query.shape} and key {key.shape} (layout: batch..., seq, heads, "
                     "head_dim)")
  head_dim = query.shape[-1]
  if key.shape[-1] != head_dim:
    raise ValueError(f"query and key must have the same head_dim, got {head_dim} and "
                     f"{key.shape[-1]}")
  if not _supported.MIN_HEAD_DIM <= head_dim <= _supported.MAX_HEAD_DIM:
    raise ValueError(f"head_dim must be in [{_supported.MIN_HEAD_DIM}, "
                     f"{_supported.MAX_HEAD_DIM}], got {head_dim}")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"the number of query heads ({num_heads}) must be a positive multiple "
                     f"of the number of key/value heads ({num_kv_heads})")


def _static_float(name: str, value, *, positive: bool = False) -> float:
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
    try:
      value = float(value)
    except jax.errors.ConcretizationTypeError:
      raise TypeError(f"{name} must be a static Python float, got a traced value") from None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  if positive and value <= 0:
    raise ValueError(f"{name} must be > 0, got {value}")
  return value


def _window(local_window_size) -> tuple[int, int]:
  if local_window_size is None:
    return -1, -1
  if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
    left = right = int(local_window_size)
  elif (isinstance(local_window_size, Sequence) and len(local_window_size) == 2 and
        all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
            for w in local_window_size)):
    left, right = (int(w) for w in local_window_size)
  else:
    raise TypeError("local_window_size must be None, an int, or a (left, right) pair of "
                    f"ints, got {local_window_size!r}")
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
  return left, right


def _int_operand(name: str, x, expected_shape: tuple[int, ...]):
  if x is None:
    return _NO_INT_OPERAND
  if not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  if tuple(x.shape) != expected_shape:
    raise ValueError(f"{name} must have shape {expected_shape}, got {tuple(x.shape)}")
  return jnp.asarray(x, jnp.int32)


def _dense_operand(name: str, x, batch_shape: tuple[int, ...], full: tuple[int, int, int]):
  """A bias or mask, broadcastable to (*batch_shape, N, T, S), as the kernels take it.

  Returns a 4-d array (B', N', T', S') with each dim 1 or the kernel's
  (B, N, T, S): leading batch dims are flattened (and spelled out if only
  some of them broadcast).
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  target = batch_shape + full
  if x.ndim > len(target):
    raise ValueError(f"{name} must have at most {len(target)} dimensions (broadcastable to "
                     f"{target}), got shape {tuple(x.shape)}")
  shape = (1,) * (len(target) - x.ndim) + tuple(x.shape)
  if any(d not in (1, t) for d, t in zip(shape, target)):
    raise ValueError(f"{name} must be broadcastable to {target} (batch..., heads, q_len, "
                     f"kv_len), got shape {tuple(x.shape)}")
  x = x.reshape(shape)
  lead = shape[:len(batch_shape)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + shape[len(batch_shape):])


# The kernels draw 16-bit numbers (cpp/include/jax_flash/dropout.h), so the
# rate they realise is a multiple of 2^-16; kept values are scaled by exactly
# 1 / (1 - that rate).
DROPOUT_RATE_STEP = 2.0**-16


def realised_dropout_rate(rate: float) -> float:
  """The dropout rate the kernels apply for `rate`: the nearest multiple of 2^-16 below 1."""
  steps = min(round(rate / DROPOUT_RATE_STEP), int(1 / DROPOUT_RATE_STEP) - 1)
  return steps * DROPOUT_RATE_STEP


def _dropout(dropout_rate, dropout_rng):
  """Checks dropout arguments; returns (rate, uint32 key words (1, 2) or absent)."""
  rate = _static_float("dropout_rate", dropout_rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  rate = realised_dropout_rate(rate)
  if rate == 0.0:
    return 0.0, _NO_KEY
  if dropout_rng is None:
    raise ValueError("dropout_rng (a jax.random key) is required when dropout_rate > 0")
  # Two 32-bit words from any key type (threefry, rbg, ...), traceable.
  return rate, jax.random.bits(dropout_rng, (1, 2), jnp.uint32)


# -- the functions -------------------------------------------------------------


def flash_attention(query, key, value, *, bias=None, mask=None,
                    scale: float | None = None, is_causal: bool = False,
                    local_window_size: int | tuple[int, int] | None = None,
                    query_seq_lengths=None, key_value_seq_lengths=None,
                    q_segment_ids=None, kv_segment_ids=None,
                    logits_soft_cap: float | None = None, dropout_rate: float = 0.0,
                    dropout_rng=None, broadcast_dropout: bool = False,
                    deterministic: bool = False, return_residual: bool = False):
  """Exact attention with the FlashAttention-2 algorithm; jax_flash's native API.

  Shapes use jax.nn's letters: query ``(..., T, N, H)``, key and value
  ``(..., S, K, H)``, where ``...`` are zero or more batch dimensions shared by
  all three and ``N`` is a multiple of ``K`` (grouped-query attention; K/V are
  never repeated in memory).

  Args:
    query, key, value: arrays of one dtype: float32, float64, bfloat16 or
      float16; head dim ``H`` from 1 to 256.
    bias: added to the scaled logits; broadcastable to ``(..., N, T, S)``.
      Differentiable: its gradient is summed over the broadcast dimensions.
    mask: boolean, broadcastable to ``(..., N, T, S)``; ``True`` = attend.
      Tiles where it is all False are skipped.
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as in
      jax.nn, also when ``T != S``).
    local_window_size: ``(left, right)`` or one int for both: query ``i``
      sees keys ``i - left <= j <= i + right``.
    query_seq_lengths, key_value_seq_lengths: integer arrays of the batch
      shape: rows ``i >= query_seq_lengths[b]`` output 0, keys
      ``j >= key_value_seq_lengths[b]`` are ignored.
    q_segment_ids, kv_segment_ids: integer arrays of shape ``(..., T)`` and
      ``(..., S)`` (give both): query ``i`` sees key ``j`` only if their ids
      are equal, for packed sequences.
    logits_soft_cap: if set, logits ``x`` become ``cap * tanh(x / cap)``
      after scaling and bias (Gemma 2 style).
    dropout_rate, dropout_rng: dropout on the attention probabilities, fused
      in the kernels: element ``(b, h, i, j)`` is kept with probability
      ``1 - dropout_rate`` (then scaled by ``1 / (1 - dropout_rate)``), as a
      function of the key and those indices alone, so forward, backward,
      CPU and GPU draw the same mask. The kernels draw 16-bit numbers, so
      the rate is rounded to a multiple of 2^-16 (``realised_dropout_rate``)
      and the scale uses the rounded rate. ``dropout_rng`` is a jax.random key.
    broadcast_dropout: one dropout mask for all batch elements and heads
      (Flax's ``broadcast_dropout``).
    deterministic: bitwise-reproducible gradients on GPUs (the CPU backward
      is always deterministic).
    return_residual: also return the logsumexp of the (scaled, capped,
      masked) logits, shaped ``(..., T, N)``, float32 (float64 for float64
      inputs), under ``stop_gradient``.

  Rows that see no key at all output 0, have logsumexp ``-inf`` and zero
  gradients.

  Returns:
    The output, shaped like ``query``; with ``return_residual``, a pair
    ``(output, logsumexp)``.
  """
  _check_qkv(query, key, value)
  head_dim = query.shape[-1]
  batch_shape = tuple(query.shape[:-3])
  seqlen_q, seqlen_k = query.shape[-3], key.shape[-3]
  scale = 1.0 / math.sqrt(head_dim) if scale is None else _static_float("scale", scale)
  softcap = 0.0 if logits_soft_cap is None else _static_float(
      "logits_soft_cap", logits_soft_cap, positive=True)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
  window_left, window_right = _window(local_window_size)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  dense_full = (query.shape[-2], seqlen_q, seqlen_k)
  acc_dtype = accumulation_dtype(query.dtype)
  if bias is None:
    kernel_bias = np.zeros((0,), acc_dtype)
  else:
    bias_dtype = getattr(bias, "dtype", None)
    if bias_dtype is None or not jnp.issubdtype(bias_dtype, jnp.floating):
      raise TypeError(f"bias must be a floating-point array, got {bias_dtype}")
    kernel_bias = _dense_operand("bias", bias, batch_shape, dense_full).astype(acc_dtype)
  if mask is None:
    kernel_mask = _NO_MASK
  else:
    if getattr(mask, "dtype", None) != jnp.bool_:
      raise TypeError(f"mask must be a boolean array, got {getattr(mask, 'dtype', type(mask))}")
    kernel_mask = _dense_operand("mask", mask, batch_shape, dense_full)
  dropout_rate, dropout_key = _dropout(dropout_rate, dropout_rng)
  config = _Config(scale=scale, softcap=softcap, is_causal=bool(is_causal),
                   window_left=window_left, window_right=window_right,
                   dropout_rate=dropout_rate, broadcast_dropout=bool(broadcast_dropout),
                   deterministic=bool(deterministic))

  # The kernels take exactly one batch dimension: flatten the batch shape.
  batch = math.prod(batch_shape)
  def to_kernel(x):
    return x if x.shape == (0,) else x.reshape((batch,) + x.shape[len(batch_shape):])
  kernel_mask = (
      to_kernel(_int_operand("query_seq_lengths", query_seq_lengths, batch_shape)),
      to_kernel(_int_operand("key_value_seq_lengths", key_value_seq_lengths, batch_shape)),
      to_kernel(_int_operand("q_segment_ids", q_segment_ids, batch_shape + (seqlen_q,))),
      to_kernel(_int_operand("kv_segment_ids", kv_segment_ids, batch_shape + (seqlen_k,))),
      kernel_bias, kernel_mask, dropout_key,
  )
  out, lse = _attention_with_vjp(config)(to_kernel(query), to_kernel(key), to_kernel(value),
                                         *kernel_mask)
  out = out.reshape(query.shape)
  if not return_residual:
    return out
  lse = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2))  # (B, N, T) -> (B, T, N)
  return out, lse.reshape(query.shape[:-1])


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: None = None, return_residual: bool = False,
                          dropout_rate: float = 0.0, dropout_rng=None,
                          broadcast_dropout: bool = False):
  """A drop-in for ``jax.nn.dot_product_attention`` backed by jax_flash.

  Same arguments, layout (``(B, T, N, H)`` or ``(T, N, H)``) and semantics
  as jax.nn: top-left causal mask, ``local_window_size`` as ``(left,
  right)``, query rows past ``query_seq_lengths`` output 0, ``scale``
  defaults to ``1 / sqrt(H)``, the residual is the logsumexp shaped
  ``(B, T, N)`` in the input dtype.

  One difference, on purpose: a query row that sees no key at all (for
  example ``key_value_seq_lengths == 0``, or a window that leaves the
  sequence, or a mask row that is all False) outputs 0 with a logsumexp of
  ``-inf``, where jax.nn averages all values. ``implementation`` exists for
  signature compatibility and must be None. Beyond jax.nn: ``dropout_rate``,
  ``dropout_rng`` and ``broadcast_dropout`` as in flash_attention.
  """
  if implementation is not None:
    raise ValueError("implementation must be None for jax_flash.dot_product_attention "
                     f"(it always uses jax_flash kernels), got {implementation!r}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if hasattr(x, "ndim") and x.ndim not in (3, 4):
      raise ValueError(f"{name} must have shape (B, T, N, H) or (T, N, H), got {x.shape}")
  unbatched = getattr(query, "ndim", 4) == 3
  if unbatched:  # jax.nn treats (T, N, H) as a batch of one.
    query, key, value = query[None], key[None], value[None]
  for name, x in (("bias", bias), ("mask", mask)):
    if x is not None and getattr(x, "ndim", 4) != 4:
      raise ValueError(f"{name} must be 4-d, broadcastable to (B, N, T, S), as in jax.nn; got "
                       f"shape {getattr(x, 'shape', None)}")
  out, lse = flash_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                             is_causal=is_causal, dropout_rate=dropout_rate,
                             dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
                             local_window_size=local_window_size,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths,
                             return_residual=True)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse.astype(key.dtype)) if return_residual else out

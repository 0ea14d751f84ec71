"""Public attention functions: argument checking, layout, and the call of the primitive.

Everything a user can get wrong is checked here, in Python, before anything
is traced into a primitive; the messages name the argument, what was
expected and what came.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _ffi, _supported, autodiff, dropout, tile_map  # noqa: F401 (autodiff: its rules)
from jax_flash.primitives import (absent_operand, accumulation_dtype, flash_fwd_p, keeps_16bit_bias,
                                  mask_operands, match_varying)

_NO_INT_OPERAND = absent_operand(np.int32)
_NO_MASK = absent_operand(np.bool_)
_NO_KEY = absent_operand(np.uint32)
_NO_TILE_MAP = absent_operand(np.uint8)


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
    """The forward's parameters; deterministic rides along for the backward
    that differentiating it binds (only the backward kernel reads it)."""
    return dict(scale=self.scale, softcap=self.softcap, is_causal=self.is_causal,
                window_left=self.window_left, window_right=self.window_right,
                dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
                deterministic=self.deterministic)

  def bwd_params(self, bias_grad: bool) -> dict[str, Any]:
    """The backward's parameters: the forward's, and whether to compute dbias."""
    return dict(self.fwd_params(), bias_grad=bias_grad)


def _attention(config: _Config, q, k, v, *mask_operands):
  """(out, lse) of the kernel-layout operands.

  Differentiable to any order in every mode through the primitives' own
  rules (autodiff.py): forward mode runs the JVP kernel, reverse mode the
  backward kernel.
  """
  return tuple(flash_fwd_p.bind(q, k, v, *mask_operands, **config.fwd_params()))


# -- argument checking ---------------------------------------------------------


class DTypeError(TypeError, ValueError):
  """An argument of the wrong dtype.

  A TypeError, as Python reports wrong types; also a ValueError, which is
  what jax.nn.dot_product_attention raises for dtypes, so that code written
  for either catches it.
  """


def _canonical(x):
  """A NumPy array as jax computes with it (float64 is float32 without x64),
  so that checks see the dtype the kernels get; anything else as it is."""
  return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def additive_bias(bias, query_dtype):
  """A bias as jax.nn and Flax add it: an array, cast to the logits' float
  dtype (float32, float64 for float64 queries) if it is not a float."""
  bias = jnp.asarray(bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    bias = bias.astype(jnp.promote_types(query_dtype, jnp.float32))
  return bias


def _check_qkv(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim < 3:
      raise ValueError(f"{name} must have shape (batch..., seq, heads, head_dim) with at "
                       f"least 3 dimensions, got shape {x.shape}")
    if jnp.dtype(x.dtype).name not in _supported.DTYPES:
      raise DTypeError(f"{name} dtype must be one of {', '.join(_supported.DTYPES)}, "
                      f"got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise DTypeError("query, key and value must have the same dtype, got "
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



# Static arguments become kernel attributes (compile-time values): a traced
# value (an argument of a jitted function, a vmapped or differentiated one)
# has no value to give them.
def _check_static(name: str, value) -> None:
  parts = value if isinstance(value, (tuple, list)) else (value,)
  if any(isinstance(part, jax.core.Tracer) for part in parts):
    raise TypeError(
        f"{name} must be a static Python value, got a traced value (was it an argument of a "
        f"jitted, vmapped or differentiated function?): pass it as a static argument, e.g. "
        f"jax.jit(f, static_argnames=\"{name}\"), or close over it")


def _static_bool(name: str, value) -> bool:
  _check_static(name, value)
  if isinstance(value, (jax.Array, np.ndarray)) and value.shape == () and value.dtype == bool:
    value = bool(value)
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
  return bool(value)


def _static_float(name: str, value, *, dtype=np.float64, positive: bool = False) -> float:
  """A finite Python float that stays finite (and, if positive, > 0) in `dtype`,
  the type the kernels compute it in."""
  _check_static(name, value)
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  finfo = np.finfo(dtype)
  if abs(value) > float(finfo.max):
    raise ValueError(f"{name} must be at most {float(finfo.max):.4g} in magnitude, the largest "
                     f"{finfo.dtype} (the kernels compute in {finfo.dtype}), got {value}")
  if positive and value <= 0:
    raise ValueError(f"{name} must be > 0, got {value}")
  if positive and value < float(finfo.smallest_normal):
    # Below the smallest normal number, arithmetic that flushes subnormals
    # to zero would read the value as 0.
    raise ValueError(f"{name} must be >= {float(finfo.smallest_normal):.4g}, the smallest "
                     f"normal {finfo.dtype} (the kernels compute in {finfo.dtype}), got {value}")
  return value


_INT64_MAX = np.iinfo(np.int64).max


def _window(local_window_size, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
  """(left, right), -1 for unbounded, clamped to the sequence lengths.

  A bound at least the length it limits admits every key (0 <= i < T,
  0 <= j < S), so clamping changes nothing, and it keeps i + right and
  i - left far from overflow in the kernels.
  """
  if local_window_size is None:
    return -1, -1
  _check_static("local_window_size", local_window_size)
  message = ("local_window_size must be None, an int, or a (left, right) pair of ints, got "
             f"{local_window_size!r}")
  if isinstance(local_window_size, Sequence) and not isinstance(local_window_size, str):
    if len(local_window_size) != 2:
      raise TypeError(message)
    bounds = tuple(local_window_size)
  else:
    bounds = (local_window_size, local_window_size)
  try:
    if any(isinstance(w, (bool, np.bool_)) for w in bounds):
      raise TypeError
    left, right = (operator.index(w) for w in bounds)
  except TypeError:
    raise TypeError(message) from None
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
  if max(left, right) > _INT64_MAX:
    raise ValueError(f"local_window_size must fit in int64 (at most 2**63 - 1), got "
                     f"{local_window_size!r}")
  return min(left, seqlen_q), min(right, seqlen_k)


def _integer_array(name: str, x, expected_shape: tuple[int, ...]):
  """x as an integer array of `expected_shape`: a jax array, or a numpy array
  for host values (which keeps 64-bit values exact when jax would truncate
  them to 32 bits)."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    x = np.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise DTypeError(f"{name} must have an integer dtype, got {x.dtype}")
  if tuple(x.shape) != expected_shape:
    raise ValueError(f"{name} must have shape {expected_shape}, got {tuple(x.shape)}")
  return x


def _fits_int32(dtype) -> bool:
  return np.can_cast(dtype, np.int32) or np.dtype(dtype) == np.uint32


def _lengths(name: str, x, batch_shape: tuple[int, ...], seq_len: int):
  """Sequence lengths as the kernels' int32 (B,).

  Clamped to [0, seq_len] in their own dtype first (what the kernels do with
  them anyway), so that the cast to int32 is exact for any integer dtype, on
  the host or traced.
  """
  if x is None:
    return _NO_INT_OPERAND
  x = _integer_array(name, x, batch_shape)
  xp = np if isinstance(x, np.ndarray) else jnp
  x = xp.clip(x, 0, seq_len).astype(np.int32)
  return jnp.asarray(x).reshape((math.prod(batch_shape),))


def _relabel(q_ids, kv_ids, xp):
  """int32 ids equal exactly where the given ids are: each id's rank among the
  distinct ids of its batch element (the kernels only compare ids)."""
  ids = xp.concatenate([q_ids, kv_ids], axis=-1)  # (B, T + S)
  if ids.shape[-1] == 0:
    return q_ids.astype(np.int32), kv_ids.astype(np.int32)
  order = xp.argsort(ids, axis=-1)
  sorted_ids = xp.take_along_axis(ids, order, axis=-1)
  starts = xp.concatenate([xp.zeros(ids.shape[:-1] + (1,), np.int32),
                           (sorted_ids[:, 1:] != sorted_ids[:, :-1]).astype(np.int32)], axis=-1)
  ranks = xp.take_along_axis(xp.cumsum(starts, axis=-1, dtype=np.int32),
                             xp.argsort(order, axis=-1), axis=-1)
  return ranks[:, :q_ids.shape[-1]], ranks[:, q_ids.shape[-1]:]


def _segment_ids(q_segment_ids, kv_segment_ids, batch_shape, seqlen_q, seqlen_k):
  """Segment ids as the kernels' int32 (B, T) and (B, S), exactly: ids of a
  wider type are relabelled (see _relabel) when they may not fit."""
  if q_segment_ids is None and kv_segment_ids is None:
    return _NO_INT_OPERAND, _NO_INT_OPERAND
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  q_ids = _integer_array("q_segment_ids", q_segment_ids, batch_shape + (seqlen_q,))
  kv_ids = _integer_array("kv_segment_ids", kv_segment_ids, batch_shape + (seqlen_k,))
  common = np.result_type(q_ids.dtype, kv_ids.dtype)
  if not jnp.issubdtype(common, jnp.integer):
    raise DTypeError("q_segment_ids and kv_segment_ids must have integer dtypes with a common "
                     f"integer type, got {q_ids.dtype} and {kv_ids.dtype}")
  batch = math.prod(batch_shape)
  q_ids = q_ids.reshape(batch, seqlen_q)
  kv_ids = kv_ids.reshape(batch, seqlen_k)
  on_host = isinstance(q_ids, np.ndarray) and isinstance(kv_ids, np.ndarray)
  if on_host:
    int32 = np.iinfo(np.int32)
    fits = all(x.size == 0 or (int32.min <= x.min() and x.max() <= int32.max)
               for x in (q_ids, kv_ids))
  else:
    fits = _fits_int32(common)
  if not fits:
    q_ids, kv_ids = _relabel(q_ids.astype(common), kv_ids.astype(common), np if on_host else jnp)
  # uint32 -> int32 wraps around, a bijection: equality is kept.
  return (jnp.asarray(q_ids).astype(np.int32), jnp.asarray(kv_ids).astype(np.int32))


def _tile_map(q_ids, kv_ids, mask, block_mask, seqlen_q, seqlen_k):
  """The kernels' tile map (tile_map.py) of the segment ids, the mask and the
  block mask, absent without any. Hopper's kernels take a dense mask only
  with it (testing the mask per element in partial cells), and every
  tensor-core kernel a block mask only through it (skipping its hidden
  cells, cuda/dispatch.cu).
  """
  maps = []
  if q_ids is not _NO_INT_OPERAND:
    maps.append(tile_map.from_segment_ids(q_ids, kv_ids))
  if mask is not _NO_MASK:
    maps.append(tile_map.from_mask(mask))
  if block_mask is not _NO_MASK:
    maps.append(tile_map.from_block_mask(block_mask, seqlen_q, seqlen_k))
  return tile_map.combine(*maps) if maps else _NO_TILE_MAP


def _dense_operand(name: str, x, batch_shape: tuple[int, ...], full: tuple[int, int, int],
                   dims: str = "q_len, kv_len"):
  """A bias or mask, broadcastable to (*batch_shape, N, T, S), as the kernels take it.

  Returns a 4-d array (B', N', T', S') with each dim 1 or the kernel's
  (B, N, T, S): leading batch dims are flattened (and spelled out if only
  some of them broadcast). `dims` names the last two in messages.
  """
  target = batch_shape + full
  if x.ndim > len(target):
    raise ValueError(f"{name} must have at most {len(target)} dimensions (broadcastable to "
                     f"{target}), got shape {tuple(x.shape)}")
  shape = (1,) * (len(target) - x.ndim) + tuple(x.shape)
  if any(d not in (1, t) for d, t in zip(shape, target)):
    raise ValueError(f"{name} must be broadcastable to {target} (batch..., heads, {dims}), "
                     f"got shape {tuple(x.shape)}")
  x = x.reshape(shape)
  lead = shape[:len(batch_shape)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + shape[len(batch_shape):])


def _bias(bias, batch_shape, full, dtype):
  """The bias as the kernels take it: in the inputs' 16-bit `dtype` if it has
  it (contract.h), any other floating bias in the accumulation dtype."""
  acc_dtype = accumulation_dtype(dtype)
  if bias is None:
    return absent_operand(acc_dtype)
  bias_dtype = getattr(bias, "dtype", None)
  if bias_dtype is None or not jnp.issubdtype(bias_dtype, jnp.floating):
    raise DTypeError(f"bias must be a floating-point array, got {bias_dtype or type(bias).__name__}")
  bias = _dense_operand("bias", bias, batch_shape, full)
  return bias if keeps_16bit_bias(dtype, bias_dtype) else bias.astype(acc_dtype)


def _mask(mask, batch_shape, full):
  if mask is None:
    return _NO_MASK
  if getattr(mask, "dtype", None) != jnp.bool_:
    raise DTypeError(f"mask must be a boolean array, got {getattr(mask, 'dtype', type(mask).__name__)}")
  return _dense_operand("mask", mask, batch_shape, full)


# Query rows and keys per cell of the block-sparse mask (block_mask): one
# value, set by the kernels (cpp/include/jax_flash/mask.h, kBlockMaskBlock).
BLOCK_MASK_BLOCK = _ffi.BLOCK_MASK_BLOCK


def _block_mask_shape(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
  """The last two dims of a full block_mask: ``ceil(T / 128), ceil(S / 128)``."""
  return -(-seqlen_q // BLOCK_MASK_BLOCK), -(-seqlen_k // BLOCK_MASK_BLOCK)


def _block_mask(block_mask, batch_shape, num_heads, seqlen_q, seqlen_k):
  if block_mask is None:
    return _NO_MASK
  if getattr(block_mask, "dtype", None) != jnp.bool_:
    raise DTypeError("block_mask must be a boolean array, got "
                     f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
  full = (num_heads,) + _block_mask_shape(seqlen_q, seqlen_k)
  return _dense_operand("block_mask", block_mask, batch_shape, full,
                        dims=f"ceil(q_len / {BLOCK_MASK_BLOCK}), ceil(kv_len / {BLOCK_MASK_BLOCK})")


_ONE_KEY = "one PRNG key, from jax.random.key(seed) or jax.random.PRNGKey(seed)"


def _one_key(rng):
  """A typed key array of shape () from a typed key or raw uint32 key data."""
  if not hasattr(rng, "dtype") or not hasattr(rng, "shape"):
    raise TypeError(f"dropout_rng must be {_ONE_KEY}, got {type(rng).__name__}")
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    key = rng
  elif rng.dtype == np.uint32:  # raw key data, as jax.random.PRNGKey returns
    try:
      key = jax.random.wrap_key_data(rng)
    except (TypeError, ValueError):
      raise TypeError(f"dropout_rng must be {_ONE_KEY}; as uint32 key data it must have the "
                      f"shape of jax.random.PRNGKey(0), got shape {tuple(rng.shape)}") from None
  else:
    raise DTypeError(f"dropout_rng must be {_ONE_KEY}, got an array of dtype {rng.dtype}")
  if key.shape != ():
    raise ValueError(f"dropout_rng must be {_ONE_KEY}, got a batch of keys of shape "
                     f"{tuple(key.shape)}: for one key per example, jax.vmap over the keys")
  return key


def _dropout(dropout_rate, dropout_rng):
  """Checks dropout arguments; returns (rate, uint32 key words (1, 2) or absent)."""
  rate = _static_float("dropout_rate", dropout_rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  if 0.0 < rate < dropout.RATE_STEP / 2:
    raise ValueError(f"dropout_rate must be 0 or at least 2^-9 (the kernels draw 8-bit numbers "
                     f"and round the rate to a multiple of 2^-8), got {rate}")
  rate = dropout.realised_dropout_rate(rate)
  key = None if dropout_rng is None else _one_key(dropout_rng)
  if rate == 0.0:
    return 0.0, _NO_KEY
  if key is None:
    raise ValueError(f"dropout_rng ({_ONE_KEY}) is required when dropout_rate > 0")
  # Two 32-bit words from any key type (threefry, rbg, ...), traceable.
  return rate, jax.random.bits(key, (1, 2), jnp.uint32)


# -- the functions -------------------------------------------------------------


def flash_attention(query, key, value, *, bias=None, mask=None, block_mask=None,
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
      Differentiable: its gradient is summed over the broadcast dimensions
      and has the bias's dtype. Added in the accumulation dtype; a bias in
      the inputs' bfloat16 or float16 dtype is read as it is on the GPU
      (half the bytes of float32), any other is cast to the accumulation
      dtype first.
    mask: boolean, broadcastable to ``(..., N, T, S)``; ``True`` = attend.
      Tiles where it is all False are skipped.
    block_mask: block-sparse attention: boolean, broadcastable to
      ``(..., N, ceil(T / 128), ceil(S / 128))`` (``BLOCK_MASK_BLOCK`` = 128
      query rows by 128 keys per cell). ``False`` hides every (query, key)
      pair of the block, exactly like a dense mask of False there, combined
      (and) with every other mask; hidden blocks are skipped without being
      read, so the cost follows the visible blocks.
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as in
      jax.nn, also when ``T != S``).
    local_window_size: ``(left, right)`` or one int for both, non-negative
      (any size up to ``2**63 - 1``): query ``i`` sees keys
      ``i - left <= j <= i + right``.
    query_seq_lengths, key_value_seq_lengths: arrays of the batch shape, of
      any integer dtype: rows ``i >= query_seq_lengths[b]`` output 0, keys
      ``j >= key_value_seq_lengths[b]`` are ignored. Values outside
      ``[0, seq_len]`` act as the nearest end (exactly, also for int64).
    q_segment_ids, kv_segment_ids: arrays of shape ``(..., T)`` and
      ``(..., S)`` (give both), of any integer dtype: query ``i`` sees key
      ``j`` only if their ids are equal, for packed sequences. Only equality
      matters; 64-bit ids are compared exactly.
    logits_soft_cap: if set, logits ``x`` become ``cap * tanh(x / cap)``
      after scaling and bias (Gemma 2 style).
    dropout_rate, dropout_rng: dropout on the attention probabilities, fused
      in the kernels: element ``(b, h, i, j)`` is kept with probability
      ``1 - dropout_rate`` (then scaled by ``1 / (1 - dropout_rate)``), as a
      function of the key and those indices alone, so forward, backward,
      CPU and GPU draw the same mask. The kernels draw 8-bit numbers (as
      FlashAttention-2), so the rate is rounded to the nearest multiple of
      2^-8 (``jax_flash.dropout.realised_dropout_rate``: 0.1 applies
      26/256 = 0.1016) and the scale uses the rounded rate; a rate in
      (0, 2^-9) is refused.
      ``dropout_rng`` is one key: ``jax.random.key(seed)`` or
      ``jax.random.PRNGKey(seed)`` (for one key per example, ``vmap`` over
      keys; a batch of keys is refused).
    broadcast_dropout: one dropout mask for all batch elements and heads
      (Flax's ``broadcast_dropout``).
    deterministic: bitwise-reproducible gradients on GPUs (the CPU backward
      is always deterministic).
    return_residual: also return the logsumexp of the (scaled, capped,
      masked) logits, shaped ``(..., T, N)``, float32 (float64 for float64
      inputs), under ``stop_gradient``.

  Rows that see no key at all output 0, have logsumexp ``-inf`` and zero
  gradients. Problems with no rows or no keys (``T == 0``, ``S == 0``, an
  empty batch) work, bias and its gradient included.

  ``scale``, ``is_causal``, ``local_window_size``, ``logits_soft_cap``,
  ``dropout_rate``, ``broadcast_dropout``, ``deterministic`` and
  ``return_residual`` are static: Python values, which select and configure
  the kernels (under ``jit``, mark them ``static_argnames``). ``scale`` and
  ``logits_soft_cap`` must be finite in the accumulation dtype (float32, or
  float64 for float64 inputs), and the cap at least its smallest normal
  number. Arrays may be traced. Bad input raises before anything is traced:
  ``ValueError`` for values and shapes, ``TypeError`` for types,
  ``DTypeError`` (a ``TypeError`` and a ``ValueError``) for dtypes.

  Returns:
    The output, shaped like ``query``; with ``return_residual``, a pair
    ``(output, logsumexp)``.
  """
  query, key, value = (_canonical(x) for x in (query, key, value))
  _check_qkv(query, key, value)
  head_dim = query.shape[-1]
  batch_shape = tuple(query.shape[:-3])
  seqlen_q, seqlen_k = query.shape[-3], key.shape[-3]
  acc_dtype = accumulation_dtype(query.dtype)
  scale = 1.0 / math.sqrt(head_dim) if scale is None else _static_float(
      "scale", scale, dtype=acc_dtype)
  softcap = 0.0 if logits_soft_cap is None else _static_float(
      "logits_soft_cap", logits_soft_cap, dtype=acc_dtype, positive=True)
  window_left, window_right = _window(local_window_size, seqlen_q, seqlen_k)
  dense_full = (query.shape[-2], seqlen_q, seqlen_k)
  dropout_rate, dropout_key = _dropout(dropout_rate, dropout_rng)
  config = _Config(scale=scale, softcap=softcap, is_causal=_static_bool("is_causal", is_causal),
                   window_left=window_left, window_right=window_right,
                   dropout_rate=dropout_rate,
                   broadcast_dropout=_static_bool("broadcast_dropout", broadcast_dropout),
                   deterministic=_static_bool("deterministic", deterministic))
  return_residual = _static_bool("return_residual", return_residual)

  # The kernels take exactly one batch dimension: flatten the batch shape.
  batch = math.prod(batch_shape)
  def to_kernel(x):
    return x.reshape((batch,) + x.shape[len(batch_shape):])
  q_ids, kv_ids = _segment_ids(q_segment_ids, kv_segment_ids, batch_shape, seqlen_q, seqlen_k)
  kernel_mask = dict(
      q_seqlens=_lengths("query_seq_lengths", query_seq_lengths, batch_shape, seqlen_q),
      kv_seqlens=_lengths("key_value_seq_lengths", key_value_seq_lengths, batch_shape, seqlen_k),
      q_segment_ids=q_ids, kv_segment_ids=kv_ids,
      bias=_bias(bias, batch_shape, dense_full, query.dtype),
      mask=_mask(mask, batch_shape, dense_full),
      block_mask=_block_mask(block_mask, batch_shape, query.shape[-2], seqlen_q, seqlen_k),
      dropout_key=dropout_key)
  # Derived from checked operands only (the ids are given together or not at all).
  kernel_mask["tile_map"] = _tile_map(q_ids, kv_ids, kernel_mask["mask"],
                                      kernel_mask["block_mask"], seqlen_q, seqlen_k)
  operands = match_varying(to_kernel(query), to_kernel(key), to_kernel(value),
                           *mask_operands(query.dtype, **kernel_mask))
  out, lse = _attention(config, *operands)
  out = out.reshape(query.shape)
  if not return_residual:
    return out
  lse = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2))  # (B, N, T) -> (B, T, N)
  return out, lse.reshape(query.shape[:-1])

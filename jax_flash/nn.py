"""jax.nn's ``dot_product_attention``, computed by jax_flash kernels: the
drop-in, a thin layer over :func:`jax_flash.flash_attention` that takes
jax.nn's arguments, layouts and array-likes (flax.py is the same for Flax).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash.attention import _check_qkv, _static_bool, additive_bias, flash_attention


def dot_product_attention(query, key, value, bias=None, mask=None, *, block_mask=None,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: None = None, return_residual: bool = False,
                          dropout_rate: float = 0.0, dropout_rng=None,
                          broadcast_dropout: bool = False):
  """A drop-in for ``jax.nn.dot_product_attention`` backed by jax_flash.

  Same arguments, layout (``(B, T, N, H)`` or ``(T, N, H)``, also under
  ``vmap``) and semantics as jax.nn: top-left causal mask,
  ``local_window_size`` as ``(left, right)`` or one int, query rows past
  ``query_seq_lengths`` output 0, ``scale`` defaults to ``1 / sqrt(H)``, the
  residual is the logsumexp shaped ``(B, T, N)`` in the input dtype.

  ``bias`` and ``mask`` take every shape jax.nn takes: at most 4
  dimensions, broadcastable from the right (numpy rules) to ``(B, N, T,
  S)``, or to ``(1, N, T, S)`` for 3-d inputs, e.g. a mask ``(1, 1, S)`` or
  ``(S,)``, or a 3-d bias ``(N, T, S)`` with 3-d inputs. Like jax.nn, a bias
  of any numeric dtype is added to the float32 (float64) logits, and mask
  and bias may be array-likes. The bias's gradient has the bias's shape,
  summed over the dimensions it broadcasts along.

  What jax.nn refuses is refused too: a bias or mask of more than 4
  dimensions, or not broadcastable (``ValueError``, where jax.nn raises
  ``ValueError``, ``TypeError`` or ``AssertionError``); a non-boolean mask, or
  q/k/v of different dtypes (``DTypeError``: both a ``TypeError`` and the
  ``ValueError`` jax.nn raises). Sequence lengths may have any integer dtype
  (jax.nn: int32 only).

  One difference, on purpose: a query row that sees no key at all (for
  example ``key_value_seq_lengths == 0``, or a window that leaves the
  sequence, or a mask row that is all False) outputs 0 with a logsumexp of
  ``-inf``, where jax.nn averages all values. ``implementation`` exists for
  signature compatibility and must be None. Beyond jax.nn: ``block_mask``
  (block-sparse attention, broadcastable to ``(B, N, ceil(T / 128),
  ceil(S / 128))``), ``dropout_rate``, ``dropout_rng`` and
  ``broadcast_dropout`` as in flash_attention.
  """
  if implementation is not None:
    raise ValueError("implementation must be None for jax_flash.dot_product_attention "
                     f"(it always uses jax_flash kernels), got {implementation!r}")
  # jax.nn takes array-likes (NumPy float64 as float32 without x64).
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must have shape (B, T, N, H) or (T, N, H), got {x.shape}")
  _check_qkv(query, key, value)  # here, so that messages give the shapes as passed
  return_residual = _static_bool("return_residual", return_residual)
  unbatched = query.ndim == 3
  if unbatched:  # jax.nn treats (T, N, H) as a batch of one.
    query, key, value = query[None], key[None], value[None]
  # jax.nn takes array-likes, and adds a bias of any dtype to its logits
  # (float32, float64 for float64 inputs); flash_attention's broadcasting
  # from the right to (B, N, T, S) is jax.nn's.
  if mask is not None:
    mask = jnp.asarray(mask)
  if bias is not None:
    bias = additive_bias(bias, query.dtype)
  out, lse = flash_attention(query, key, value, bias=bias, mask=mask, block_mask=block_mask,
                             scale=scale,
                             is_causal=is_causal, dropout_rate=dropout_rate,
                             dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
                             local_window_size=local_window_size,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths,
                             return_residual=True)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse.astype(key.dtype)) if return_residual else out

"""jax_flash as the attention of Flax's multi-head attention modules.

Pass :func:`attention_fn` where Flax takes an ``attention_fn``; nothing else in
the module changes::

    import flax.linen as nn
    import jax_flash.flax

    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=jax_flash.flax.attention_fn)

    from flax import nnx
    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
        attention_fn=jax_flash.flax.attention_fn)

A dense boolean ``mask`` (``True`` = attend, as in Flax) works, but the
kernel then reads it for every block. For causal self-attention without a
mask tensor, so that the kernel also skips the blocks above the diagonal,
use :func:`make_attention_fn`::

    causal_fn = jax_flash.flax.make_attention_fn(is_causal=True)
    layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=causal_fn)
    y = layer.apply(variables, x)              # no mask argument needed

This module does not import Flax: it only has to accept the arguments Flax
passes. Linen keeps the keyword arguments that appear in the attention
function's signature; nnx always passes the same set (``mask``, the
dropout arguments, ``dtype``, ``precision``, ``module`` and ``is_causal``).

Differences from Flax's own ``dot_product_attention``, on purpose:

* ``module`` (``sow_weights=True``): flash attention never forms the
  attention weights, so there is nothing to sow; a ValueError says so.
* ``precision`` and ``force_fp32_for_softmax`` are accepted and ignored: the
  kernels always accumulate ``q.k``, the softmax and ``P.v`` in float32
  (float64 for float64 inputs), at least what either setting asks for.
* Custom einsums (``einsum_dot_general``, ``qk_attn_weights_einsum``,
  ``attn_weights_value_einsum``, used for quantised attention) cannot run
  inside the kernel: NotImplementedError.
* A query row whose mask is all ``False`` outputs 0 (Flax outputs the mean of
  all values there, because it masks with the dtype's minimum, not -inf).
  Such rows are usually padding; weight them out of the loss.
* Dropout draws its mask inside the kernel from ``dropout_rng``: the same rng
  gives the same output, but not the same mask as Flax's
  ``jax.random.bernoulli`` draws. The kernels draw 8-bit numbers, so the rate
  is rounded to the nearest multiple of 2^-8 (0.1 applies 26/256) and a rate
  in (0, 2^-9) is a ValueError.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax.numpy as jnp

import jax_flash
from jax_flash.attention import _static_bool, _static_float, _window, additive_bias


def _promote(query, key, value, dtype, promote_dtype):
  """Cast q, k, v to one dtype the way Flax does before attention."""
  if promote_dtype is not None:  # nnx lets the module choose the promotion rule.
    return promote_dtype((query, key, value), dtype=dtype)
  if dtype is None:
    dtype = jnp.result_type(query, key, value)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _to_kernel_layout(name: str, x, batch_shape: tuple[int, ...], batch: int):
  """A Flax mask/bias, broadcastable to (*batch, N, T, S), as (B or 1, N|1, T|1, S|1).

  Flax allows any number of batch dimensions (and fewer dimensions than the
  full rank, by broadcasting); the kernel takes exactly one batch dimension.
  A mask shared by all batch elements stays shared (batch 1), so it is not
  copied B times.
  """
  rank = len(batch_shape) + 3
  if x.ndim > rank:
    raise ValueError(f"{name} must be broadcastable to (*batch, heads, q_length, kv_length) "
                     f"= rank {rank}, got shape {x.shape}")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  x_batch = x.shape[:len(batch_shape)]
  if all(d == 1 for d in x_batch):
    return x.reshape((1,) + x.shape[len(batch_shape):])
  try:
    x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
  except ValueError:
    raise ValueError(f"{name} batch dimensions {x_batch} do not broadcast to the "
                     f"query's batch shape {batch_shape}") from None
  return x.reshape((batch,) + x.shape[len(batch_shape):])


def _check_not_given(name: str, value, why: str):
  if value is not None:
    raise NotImplementedError(f"jax_flash.flax.attention_fn does not support `{name}` "
                              f"({why}); got {value!r}. Use Flax's default attention_fn.")


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None,
                 force_fp32_for_softmax: bool = False,
                 einsum_dot_general: Callable | None = None,
                 qk_attn_weights_einsum: Callable | None = None,
                 attn_weights_value_einsum: Callable | None = None,
                 promote_dtype: Callable | None = None, is_causal: bool = False):
  """Flax's ``dot_product_attention`` signature, computed by jax_flash kernels.

  Args:
    query, key, value: ``(*batch, T, N, H)``, ``(*batch, S, K, H)``; ``N`` a
      multiple of ``K``; any number of batch dimensions, including none.
    bias: added to the scaled logits; broadcastable to ``(*batch, N, T, S)``; of any
      numeric dtype, as in Flax (a non-float one is cast to float32).
    mask: bool, broadcastable to ``(*batch, N, T, S)``; ``False`` = masked out.
    broadcast_dropout: one dropout mask shared by all batch elements and heads.
    dropout_rng, dropout_rate, deterministic: dropout on the attention
      weights when ``not deterministic and dropout_rate > 0``.
    dtype: the dtype q, k, v are cast to (default: their common dtype).
    is_causal: causal mask without a mask tensor (nnx passes it; linen users
      use :func:`make_attention_fn`).
    precision, force_fp32_for_softmax: ignored (see the module docstring).
    module: must be None (the kernel never forms attention weights to sow).
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum,
      promote_dtype: see the module docstring.

  Returns:
    ``(*batch, T, N, H)`` in the promoted dtype.
  """
  return _attention(query, key, value, bias=bias, mask=mask,
                    broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                    dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
                    module=module, einsum_dot_general=einsum_dot_general,
                    qk_attn_weights_einsum=qk_attn_weights_einsum,
                    attn_weights_value_einsum=attn_weights_value_einsum,
                    promote_dtype=promote_dtype, is_causal=is_causal,
                    kernel_options={})


def make_attention_fn(*, is_causal: bool = False,
                      local_window_size: int | tuple[int, int] | None = None,
                      logits_soft_cap: float | None = None,
                      deterministic_backward: bool = False) -> Callable:
  """An :func:`attention_fn` with jax_flash options fixed, for ``attention_fn=``.

  Args:
    is_causal: query ``i`` sees keys ``j <= i`` with no mask tensor: the
      kernel skips the blocks above the diagonal (about half the work). It is
      combined (logical and) with any ``mask`` the module passes, and with
      nnx's per-call ``is_causal``.
    local_window_size: ``(left, right)`` or one int: query ``i`` sees keys
      ``i - left <= j <= i + right`` (sliding-window attention).
    logits_soft_cap: logits ``x`` become ``cap * tanh(x / cap)``.
    deterministic_backward: bitwise-reproducible gradients on GPUs (this is
      jax_flash's ``deterministic``; Flax's ``deterministic`` means "no
      dropout", so the names differ here).

  Returns:
    A function with :func:`attention_fn`'s signature.
  """
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
  # Checked now, where the mistake is made, and again by flash_attention at
  # each call (with the lengths the window is clamped to and the dtype).
  _window(local_window_size, 1, 1)
  if logits_soft_cap is not None:
    _static_float("logits_soft_cap", logits_soft_cap, positive=True)
  options = dict(local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                 deterministic=_static_bool("deterministic_backward", deterministic_backward))
  configured_causal = is_causal

  # Same signature as attention_fn (linen keeps only keyword arguments that
  # appear in it), with the options bound.
  @functools.wraps(attention_fn)
  def configured(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None,
                 force_fp32_for_softmax: bool = False,
                 einsum_dot_general: Callable | None = None,
                 qk_attn_weights_einsum: Callable | None = None,
                 attn_weights_value_einsum: Callable | None = None,
                 promote_dtype: Callable | None = None, is_causal: bool = False):
    return _attention(query, key, value, bias=bias, mask=mask,
                      broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                      dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
                      module=module, einsum_dot_general=einsum_dot_general,
                      qk_attn_weights_einsum=qk_attn_weights_einsum,
                      attn_weights_value_einsum=attn_weights_value_einsum,
                      promote_dtype=promote_dtype,
                      is_causal=_static_bool("is_causal", is_causal) or configured_causal,
                      kernel_options=options)

  configured.__doc__ = (f"jax_flash.flax.attention_fn with is_causal={is_causal}, "
                        + ", ".join(f"{k}={v!r}" for k, v in options.items()))
  return configured


def _attention(query, key, value, *, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
               deterministic, dtype, module, einsum_dot_general, qk_attn_weights_einsum,
               attn_weights_value_einsum, promote_dtype, is_causal, kernel_options):
  if module is not None:
    raise ValueError(
        "jax_flash.flax.attention_fn cannot sow attention weights (got module="
        f"{type(module).__name__}, i.e. sow_weights=True): flash attention never forms the "
        "weight matrix. Call the module with sow_weights=False, or use Flax's default "
        "attention_fn to inspect weights.")
  _check_not_given("einsum_dot_general", einsum_dot_general,
                   "the products run inside the kernel")
  _check_not_given("qk_attn_weights_einsum", qk_attn_weights_einsum,
                   "the products run inside the kernel")
  _check_not_given("attn_weights_value_einsum", attn_weights_value_einsum,
                   "the products run inside the kernel")

  query, key, value = _promote(query, key, value, dtype, promote_dtype)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise ValueError(f"{name} must have shape (*batch, length, heads, head_dim), "
                       f"got {x.shape}")
  batch_shape = tuple(query.shape[:-3])
  if tuple(key.shape[:-3]) != batch_shape or tuple(value.shape[:-3]) != batch_shape:
    raise ValueError(f"query, key and value must share batch dimensions, got {query.shape}, "
                     f"{key.shape}, {value.shape}")
  batch = math.prod(batch_shape)

  # The kernels take one batch dimension; Flax allows any number (or none).
  def flat(x):
    return x.reshape((batch,) + x.shape[len(batch_shape):])

  extra = {}
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:  # Flax masks may be float 0/1 (make_attention_mask's dtype).
      mask = mask != 0
    extra["mask"] = _to_kernel_layout("mask", mask, batch_shape, batch)
  if bias is not None:
    # A float bias keeps its own dtype: the kernels add it in float32
    # (float64), which a cast to a bfloat16 query would only round.
    extra["bias"] = _to_kernel_layout("bias", additive_bias(bias, query.dtype), batch_shape,
                                      batch)
  # Checked here, before `dropout_rate > 0` decides anything (Flax would skip
  # dropout for a negative or NaN rate without a word).
  dropout_rate = _static_float("dropout_rate", dropout_rate)
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if not _static_bool("deterministic", deterministic) and dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("dropout_rng is required when dropout_rate > 0 and not deterministic "
                       f"(dropout_rate={dropout_rate})")
    extra.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                 broadcast_dropout=_static_bool("broadcast_dropout", broadcast_dropout))

  out = jax_flash.flash_attention(flat(query), flat(key), flat(value),
                                  is_causal=_static_bool("is_causal", is_causal),
                                  **kernel_options, **extra)
  return out.reshape(query.shape[:-1] + value.shape[-1:])

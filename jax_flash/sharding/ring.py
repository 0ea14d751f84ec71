"""Ring attention: exact attention over a sequence sharded across a mesh axis.

Inside ``shard_map`` each of the N devices of ``axis_name`` holds one chunk
of the queries, keys and values. Key/value chunks travel around the ring
with ``ppermute`` (device i sends to i + 1), one hop per step, while the
device computes attention of its queries against the chunk it holds; the
transfer of the next chunk does not depend on that computation, so XLA runs
both at once. Each kernel call is told where its query and key chunks sit in
the whole sequence (the offsets operand), so causal and window masks are
right across chunks; partial results merge by their logsumexp. The backward
circulates K/V again, with dK/dV accumulating as they travel, and calls the
backward kernel with the final output and logsumexp, so every block sees
the global softmax.

Causal load balance: with chunks in sequence order the last device does N
times the work of the first. In the zigzag order (``to_zigzag``) the
sequence is cut into 2N chunks and device d holds chunks d and 2N-1-d: then
every device computes the same number of visible blocks at every step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import attention as _attention
from jax_flash.primitives import (accumulation_dtype, flash_bwd_p, flash_fwd_p, mask_operands,
                                  match_varying)

LAYOUTS = ("contiguous", "zigzag")


def _zigzag_order(num_devices, what) -> np.ndarray:
  if isinstance(num_devices, (bool, np.bool_)) or not isinstance(num_devices, (int, np.integer)):
    raise TypeError(f"{what}: num_devices must be a static Python int, got "
                    f"{type(num_devices).__name__} {num_devices!r}")
  if num_devices < 1:
    raise ValueError(f"{what}: num_devices must be at least 1, got {num_devices}")
  return np.array([c for d in range(num_devices) for c in (d, 2 * num_devices - 1 - d)])


def _reorder(x, order, axis, what):
  x = jnp.asarray(x)
  if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"{what}: axis must be an int, got {type(axis).__name__} {axis!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{what}: axis {axis} is out of bounds for an array of shape {x.shape} "
                     "(the sequence axis: -3 for (..., T, N, H), -1 for segment ids)")
  axis = axis % x.ndim
  chunks = len(order)
  if x.shape[axis] % chunks:
    raise ValueError(f"{what}: the sequence axis {axis} of shape {x.shape} must split into "
                     f"2 * num_devices = {chunks} equal chunks")
  shape = x.shape[:axis] + (chunks, x.shape[axis] // chunks) + x.shape[axis + 1:]
  x = x.reshape(shape)
  # Chunks keep the array's sharding (under explicit sharding jax asks for it).
  x = x.at[(slice(None),) * axis + (order,)].get(out_sharding=jax.typeof(x).sharding)
  return x.reshape(shape[:axis] + (-1,) + shape[axis + 2:])


def to_zigzag(x, num_devices: int, *, axis: int = -3):
  """Puts the tokens of ``x`` into zigzag order for ``ring_attention``.

  The sequence (axis ``axis``; -3 for ``(..., T, N, H)`` arrays, -1 for
  segment ids) is cut into ``2 * num_devices`` chunks and reordered so that
  sharding the result evenly over ``num_devices`` devices gives device
  ``d`` the chunks ``d`` and ``2 * num_devices - 1 - d``.
  """
  return _reorder(x, _zigzag_order(num_devices, "to_zigzag"), axis, "to_zigzag")


def from_zigzag(x, num_devices: int, *, axis: int = -3):
  """Undoes :func:`to_zigzag`: tokens back in sequence order."""
  return _reorder(x, np.argsort(_zigzag_order(num_devices, "from_zigzag")), axis,
                  "from_zigzag")


def ring_attention(query, key, value, *, axis_name, is_causal: bool = False,
                   scale: float | None = None,
                   local_window_size: int | tuple[int, int] | None = None,
                   logits_soft_cap: float | None = None, layout: str = "contiguous"):
  """Attention over a sequence sharded along the mesh axis ``axis_name``.

  Call it inside ``jax.shard_map`` with query, key and value sharded along
  their sequence axis over ``axis_name``: each device passes its own chunk,
  shaped like ``flash_attention``'s arguments ``(..., T, N, H)`` with the
  local ``T`` (the same for the query and the keys). The result is this
  device's chunk of the attention over the whole sequence, exactly as
  ``flash_attention`` on the gathered sequence computes it (same arguments
  and semantics: top-left causal mask, ``(left, right)`` windows, soft cap,
  grouped-query attention with K/V never repeated), forward and gradient.

  Args:
    axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
    layout: ``"contiguous"``: device ``d`` holds chunk ``d`` of the sequence.
      ``"zigzag"``: tokens were put in zigzag order with :func:`to_zigzag`,
      which balances causal work across devices (undo it on the result with
      :func:`from_zigzag`); the local ``T`` must be even.
  """
  return _ring_attention(query, key, value, axis_name=axis_name, is_causal=is_causal,
                         scale=scale, local_window_size=local_window_size,
                         logits_soft_cap=logits_soft_cap, layout=layout, transfer=True)


def _ring_attention(query, key, value, *, axis_name, is_causal, scale, local_window_size,
                    logits_soft_cap, layout, transfer):
  """ring_attention; transfer=False skips every ppermute (each device keeps
  its own chunk: wrong results, same computation), to time the transfers."""
  _attention._check_qkv(query, key, value)
  if query.shape[-3] != key.shape[-3]:
    raise ValueError("ring_attention needs query and key chunks of the same length, got "
                     f"query {query.shape} and key {key.shape} (layout: batch..., seq, heads, "
                     "head_dim)")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if layout == "zigzag" and query.shape[-3] % 2:
    raise ValueError("layout='zigzag' needs an even local sequence length (two chunks per "
                     f"device), got {query.shape[-3]}")
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError("ring_attention: axis_name must be a mesh axis name (a str) or a tuple of "
                    f"them, got {axis_name!r}")
  try:
    num_devices = jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(f"ring_attention must run inside shard_map (or another map) that binds "
                     f"axis_name={axis_name!r}") from None
  acc_dtype = accumulation_dtype(query.dtype)
  seqlen = num_devices * query.shape[-3]  # the whole sequence, which windows refer to
  window_left, window_right = _attention._window(local_window_size, seqlen, seqlen)
  config = _attention._Config(
      scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else _attention._static_float(
          "scale", scale, dtype=acc_dtype),
      softcap=0.0 if logits_soft_cap is None else _attention._static_float(
          "logits_soft_cap", logits_soft_cap, dtype=acc_dtype, positive=True),
      is_causal=_attention._static_bool("is_causal", is_causal), window_left=window_left,
      window_right=window_right, dropout_rate=0.0, broadcast_dropout=False,
      deterministic=False)
  axis_name = tuple(axis_name) if isinstance(axis_name, list) else axis_name
  batch_shape = query.shape[:-3]
  flat = lambda x: x.reshape((math.prod(batch_shape),) + x.shape[-3:])
  q, k, v = match_varying(flat(query), flat(key), flat(value))
  out = _ring(config, axis_name, num_devices, layout, transfer)(q, k, v)
  return out.reshape(query.shape)


def _calls(config, layout, step, me, num_devices, length):
  """(query rows, key rows, query position, key position) of one step's calls.

  Device `me` holds at this step the key/value chunk of device
  (me - step) mod N. One call covers the whole local block when positions
  cannot matter (no causal mask, no window) or the local order is the
  sequence order; in zigzag order, each device's two chunks are apart, so
  each pair of query and key chunks is its own call (a pair that sees
  nothing costs an empty kernel launch).
  """
  src = (me - step) % num_devices
  whole = slice(None)
  window = config.window_left >= 0 or config.window_right >= 0
  if layout == "contiguous":
    return [(whole, whole, me * length, src * length)]
  if not (config.is_causal or window) or (step == 0 and not window):
    # Both chunks of a device in increasing order: at step 0 the local causal
    # mask is the global one.
    return [(whole, whole, 0, 0)]
  half = length // 2

  def chunks(device):
    return [(slice(0, half), device * half),
            (slice(half, length), (2 * num_devices - 1 - device) * half)]

  return [(qs, ks, qp, kp) for qs, qp in chunks(me) for ks, kp in chunks(src)]


def _operands(query_position, key_position, acc_dtype):
  """MASK_OPERANDS of a chunk's call: nothing but its offsets."""
  offsets = jnp.stack([jnp.asarray(query_position, jnp.int32),
                       jnp.asarray(key_position, jnp.int32),
                       jnp.int32(0), jnp.int32(0)])
  return mask_operands(acc_dtype, offsets=offsets)


def _rows(x, rows, axis=1):
  """x's `rows` (a static slice) along `axis`."""
  return jax.lax.slice_in_dim(x, rows.start or 0, rows.stop, axis=axis)


def _set_rows(x, rows, value, axis=1):
  """x with its `rows` along `axis` replaced by `value`. Not x.at[].set: its
  scatter carries zero-sized index constants, which jax passes into
  shard_map's manual computation, and XLA 0.11's CPU compiler crashed on
  zero-sized arguments there."""
  return jax.lax.dynamic_update_slice_in_dim(x, value, rows.start or 0, axis)


def _add_rows(x, rows, value):
  return _set_rows(x, rows, _rows(x, rows) + value)


def _merge(out, lse, part_out, part_lse):
  """Combines two softmax-normalised partial results by their logsumexp."""
  new_lse = jnp.logaddexp(lse, part_lse)
  finite = jnp.where(jnp.isneginf(new_lse), 0, new_lse)  # rows that saw nothing yet
  weight = lambda l: jnp.swapaxes(jnp.exp(l - finite), 1, 2)[..., None]  # (B, T, H, 1)
  return out * weight(lse) + part_out.astype(out.dtype) * weight(part_lse), new_lse


@functools.lru_cache(maxsize=None)
def _ring(config, axis_name, num_devices, layout, transfer):
  """The custom-VJP ring attention of flattened (B, T, N, H) chunks."""
  ring_perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]

  def send(x):
    return jax.lax.ppermute(x, axis_name, ring_perm) if transfer else x

  def forward(q, k, v):
    me = jax.lax.axis_index(axis_name)
    length = q.shape[1]
    acc = accumulation_dtype(q.dtype)
    # Like q (zeros_like, full_like): under explicit axes not manual here
    # (a batch sharded over "data"), an accumulator must carry q's sharding
    # for the rows set into it.
    out = jnp.zeros_like(q, acc)
    lse = jnp.moveaxis(jnp.full_like(q[..., 0], -jnp.inf, acc), 1, 2)  # (B, N, T)
    for step in range(num_devices):
      # Issued before this step's kernels, which do not need it: it overlaps.
      following = send((k, v)) if step + 1 < num_devices else None
      for qs, ks, qp, kp in _calls(config, layout, step, me, num_devices, length):
        part_out, part_lse = flash_fwd_p.bind(
            _rows(q, qs), _rows(k, ks), _rows(v, ks), *_operands(qp, kp, acc),
            **config.fwd_params())
        merged = _merge(_rows(out, qs), _rows(lse, qs, 2), part_out, part_lse)
        out, lse = _set_rows(out, qs, merged[0]), _set_rows(lse, qs, merged[1], 2)
      if following is not None:
        k, v = following
    return out.astype(q.dtype), lse

  def backward(q, k, v, out, lse, dout):
    me = jax.lax.axis_index(axis_name)
    length = q.shape[1]
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (jnp.zeros_like(x, acc) for x in (q, k, v))
    for step in range(num_devices):
      following = send((k, v)) if step + 1 < num_devices else None
      for qs, ks, qp, kp in _calls(config, layout, step, me, num_devices, length):
        part_dq, part_dk, part_dv, _ = flash_bwd_p.bind(
            _rows(q, qs), _rows(k, ks), _rows(v, ks), _rows(out, qs), _rows(lse, qs, 2),
            _rows(dout, qs), *_operands(qp, kp, acc),
            **config.bwd_params(bias_grad=False))  # (ring attention takes no bias)
        dq = _add_rows(dq, qs, part_dq.astype(acc))
        dk = _add_rows(dk, ks, part_dk.astype(acc))
        dv = _add_rows(dv, ks, part_dv.astype(acc))
      # dK/dV travel with their chunk; after the last step one more hop
      # brings each chunk's sums home.
      dk, dv = send((dk, dv))
      if following is not None:
        k, v = following
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  @jax.custom_vjp
  def ring(q, k, v):
    return forward(q, k, v)[0]

  def ring_fwd(q, k, v):
    out, lse = forward(q, k, v)
    return out, (q, k, v, out, lse)

  def ring_bwd(residuals, dout):
    q = residuals[0]
    return backward(*residuals, dout.astype(q.dtype))

  ring.defvjp(ring_fwd, ring_bwd)
  return ring

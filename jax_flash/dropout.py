"""The kernels' dropout mask in JAX, bit for bit (cpp/include/jax_flash/dropout.h).

Element (b, h, i, j) is kept when draw j % 4 of Philox-4x32-10 at counter
(j // 4, i, head word, batch word) under the batch element's key is at least
``rate * 2**32``. The blockwise JAX formulation (blockwise.py) needs the very
mask the kernels drew, so this mirrors dropout.h exactly. Only uint32
arithmetic: the high half of a 32 x 32-bit product is assembled from 16-bit
halves, so it works with x64 off.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_MUL = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))
_WEYL = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))
_ROUNDS = 10
_LOW16 = np.uint32(0xFFFF)


def threshold(rate: float) -> int:
  """Kept when the draw is >= this (DropoutParams::threshold)."""
  t = rate * 4294967296.0
  return 0xFFFFFFFF if t >= 4294967295.0 else int(t)


def _mul_hi_lo(a: np.uint32, b):
  """(high, low) 32-bit words of the 64-bit product of constant a and uint32 b."""
  a_hi, a_lo = np.uint32(int(a) >> 16), np.uint32(int(a) & 0xFFFF)
  b_hi, b_lo = b >> 16, b & _LOW16
  lo_lo, hi_lo, lo_hi, hi_hi = b_lo * a_lo, b_lo * a_hi, b_hi * a_lo, b_hi * a_hi
  # Every partial product is < 2^32; the middle column's carry fits too.
  middle = (lo_lo >> 16) + (hi_lo & _LOW16) + (lo_hi & _LOW16)
  hi = hi_hi + (hi_lo >> 16) + (lo_hi >> 16) + (middle >> 16)
  return hi, b * a


def philox4x32(counter, key):
  """Philox-4x32-10 of four uint32 counter words and two key words (broadcasting)."""
  c0, c1, c2, c3 = counter
  k0, k1 = key
  for _ in range(_ROUNDS):
    hi0, lo0 = _mul_hi_lo(_MUL[0], c0)
    hi1, lo1 = _mul_hi_lo(_MUL[1], c2)
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0, k1 = k0 + _WEYL[0], k1 + _WEYL[1]
  return c0, c1, c2, c3


def keep_mask(keys, rate: float, broadcast: bool, batch: int, num_heads: int, rows, j0,
              num_cols: int):
  """Kept elements (B, Hq, len(rows), num_cols) of key columns j0 .. j0 + num_cols.

  keys: uint32 (Bkey, 2), Bkey dividing the batch; rows: int32 query indices;
  j0 (may be traced) and num_cols multiples of 4.
  """
  period = batch // keys.shape[0]
  b = np.arange(batch)
  key = keys[b // period]  # (B, 2)
  k0, k1 = (key[:, w].reshape(batch, 1, 1, 1) for w in (0, 1))
  zero = jnp.zeros((), jnp.uint32)
  batch_word = zero if broadcast else jnp.asarray(b % period, jnp.uint32).reshape(batch, 1, 1, 1)
  head_word = zero if broadcast else jnp.arange(num_heads, dtype=jnp.uint32).reshape(
      1, num_heads, 1, 1)
  row = jnp.asarray(rows, jnp.uint32).reshape(1, 1, -1, 1)
  group = (jnp.asarray(j0, jnp.uint32) >> 2) + jnp.arange(num_cols // 4, dtype=jnp.uint32)
  counter = [group.reshape(1, 1, 1, -1), row, head_word, batch_word]
  shape = (batch, num_heads, row.shape[2], num_cols // 4)
  draws = philox4x32([jnp.broadcast_to(c, shape) for c in counter], (k0, k1))
  # Column 4 g + t takes draw t of group g.
  draws = jnp.stack(draws, axis=-1).reshape(shape[:3] + (num_cols,))
  return draws >= np.uint32(threshold(rate))

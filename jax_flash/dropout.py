"""The kernels' dropout mask in JAX, bit for bit (cpp/include/jax_flash/dropout.h).

Element (b, h, i, j) is kept when its 8-bit draw is at least the rate's
8-bit threshold. A Philox-4x32-7 call gives 16 draws, those of the elements
(16 I + 8 a + 2 u + e, 16 J + 8 b + 2 v + c) for a, b, e, c in {0, 1}: counter
words {J, I, (4 u + v) << 24 | head, batch}, draw (a, e, b, c) = byte 2 e + c
of word 2 a + b.
The blockwise JAX formulation (blockwise.py) needs the very mask the kernels
drew, so this mirrors dropout.h exactly. Only uint32 arithmetic: the high
half of a 32 x 32-bit product is assembled from 16-bit halves, so it works
with x64 off.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_MUL = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))
_WEYL = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))
_ROUNDS = 7
_LOW16 = np.uint32(0xFFFF)
_BYTE = np.uint32(0xFF)
DRAW_RANGE = 1 << 8  # DropoutParams::kDrawRange
TILE = 16  # a call's draws lie in one 16 x 16 block of (i, j)


def threshold(rate: float) -> int:
  """Kept when the 8-bit draw is >= this (DropoutParams::threshold)."""
  t = rate * DRAW_RANGE + 0.5
  return DRAW_RANGE - 1 if t >= DRAW_RANGE - 1 else int(t)


# The rate the kernels realise is a multiple of this; kept values are scaled
# by exactly 1 / (1 - that rate).
RATE_STEP = 1.0 / DRAW_RANGE


def realised_dropout_rate(rate: float) -> float:
  """The dropout rate the kernels apply for `rate`: the nearest multiple of 2^-8 below 1.

  Halves round up, as DropoutParams::threshold does.
  """
  return threshold(rate) * RATE_STEP


def keep_scale(rate: float) -> float:
  """Kept elements are scaled by this (DropoutParams::keep_scale)."""
  return DRAW_RANGE / (DRAW_RANGE - threshold(rate))


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
  """Philox-4x32-7 of four uint32 counter words and two key words (broadcasting)."""
  c0, c1, c2, c3 = counter
  k0, k1 = key
  for _ in range(_ROUNDS):
    hi0, lo0 = _mul_hi_lo(_MUL[0], c0)
    hi1, lo1 = _mul_hi_lo(_MUL[1], c2)
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0, k1 = k0 + _WEYL[0], k1 + _WEYL[1]
  return c0, c1, c2, c3


def keep_mask(keys, rate: float, broadcast: bool, batch: int, num_heads: int, seqlen_q: int,
              j0, num_cols: int, *, row0=0, batch_offset=0, head_offset=0):
  """Kept elements (B, Hq, seqlen_q, num_cols) of rows row0 + i, key columns j0 + j.

  keys: uint32 (Bkey, 2), Bkey dividing the batch; row0, j0 and num_cols
  multiples of 16; batch_offset and head_offset are the global indices of
  batch element and head 0 (a shard's). Row, column and offsets may be
  traced. One Philox call per 16 elements, as the kernels.
  """
  period = batch // keys.shape[0]
  b = np.arange(batch)
  key = keys[b // period]  # (B, 2)
  # Axes of a call: (B, H, I, u, J, v).
  k0, k1 = (key[:, w].reshape(batch, 1, 1, 1, 1, 1) for w in (0, 1))
  num_i, num_j = -(-seqlen_q // TILE), num_cols // TILE
  zero = jnp.zeros((), jnp.uint32)
  as_word = lambda x: jnp.asarray(x).astype(jnp.uint32)
  batch_word = zero if broadcast else (as_word(b % period) + as_word(batch_offset)).reshape(
      batch, 1, 1, 1, 1, 1)
  head_word = zero if broadcast else (jnp.arange(num_heads, dtype=jnp.uint32) +
                                      as_word(head_offset)).reshape(1, num_heads, 1, 1, 1, 1)
  row_tile = ((as_word(row0) >> 4) + jnp.arange(num_i, dtype=jnp.uint32)).reshape(
      1, 1, num_i, 1, 1, 1)
  u = jnp.arange(4, dtype=jnp.uint32).reshape(1, 1, 1, 4, 1, 1)
  col_tile = ((as_word(j0) >> 4) +
              jnp.arange(num_j, dtype=jnp.uint32)).reshape(1, 1, 1, 1, num_j, 1)
  v = jnp.arange(4, dtype=jnp.uint32).reshape(1, 1, 1, 1, 1, 4)
  lane_and_head = (((u << 2) | v) << 24) | head_word
  shape = (batch, num_heads, num_i, 4, num_j, 4)
  words = philox4x32([jnp.broadcast_to(x, shape) for x in (col_tile, row_tile, lane_and_head,
                                                            batch_word)], (k0, k1))
  # Draw (a, e, b, c) of a call is byte 2 e + c of word 2 a + b.
  words = jnp.stack(words, axis=-1).reshape(shape + (2, 2))  # (..., a, b)
  draws = jnp.stack([(words >> np.uint32(8 * n)) & _BYTE for n in range(4)], axis=-1)
  draws = draws.reshape(shape + (2, 2, 2, 2))  # (B, H, I, u, J, v, a, b, e, c)
  # -> rows 16 I + 8 a + 2 u + e, columns 16 J + 8 b + 2 v + c.
  draws = jnp.transpose(draws, (0, 1, 2, 6, 3, 8, 4, 7, 5, 9))
  draws = draws.reshape(batch, num_heads, num_i * TILE, num_cols)[:, :, :seqlen_q]
  return draws >= np.uint32(threshold(rate))

"""Absent optional operands: how the primitives and the sharding rules tell
an operand that was not given (a module of its own, so that both can import
it: primitives.py imports sharding/partitioning.py)."""
from __future__ import annotations

import numpy as np


def absent_operand(dtype):
  """An absent optional operand: 0-d in jaxprs, shape (0,) in the call.

  Every operand that is present has a dimension, so a 0-d one says "absent";
  the lowering passes the call the (0,) it expects (contract.h). Not (0,)
  in jaxprs: under shard_map jax passes such constants (and residuals) into
  the manual computation as arguments, and XLA 0.11's CPU compiler crashed
  (segfault in its SPMD pipeline) on zero-sized arguments there.
  """
  return np.zeros((), dtype)


def is_absent(x) -> bool:
  return x.ndim == 0

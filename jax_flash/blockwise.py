"""Attention's derivatives in plain JAX, one block of keys at a time.

``jvp`` and ``bwd`` compute what the primitives flash_jvp_p and flash_bwd_p
compute, from the same operands (the forward's out and lse among them), with
the same semantics (masks, soft cap, bias, GQA, the kernels' dropout mask via
dropout.py). They serve twice:

* ``bwd`` as the part of the backward that an lse cotangent adds (one
  reaches the transpose only in second order, autodiff.py);
* as the second-order rules: the JVPs of flash_jvp_p and flash_bwd_p are
  ``jax.jvp`` of these functions, and JAX transposes those for reverse mode.

Given lse, P = exp(x - lse) is known block by block, so both are sums over
key blocks: a ``lax.scan`` whose step is a ``jax.checkpoint``ed function of
the block's start alone. Each step holds (B, H, Sq, block) tiles, never the
(Sq, Sk) matrix, and the checkpoint makes differentiating the scan save
nothing per step but its index (loop-invariant residuals are hoisted out of
the scan by JAX), so every order of derivative stays O(S * block) in memory
beyond the operands. Matrix products run in the accumulation dtype (float32,
float64 for float64) at the highest precision, so they are exact on
tensor-core GPUs too, and slower than fused kernels.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _ffi, dropout
from jax_flash.primitives import MASK_OPERANDS, is_absent, match_varying

BLOCK_N = 128  # keys per step: (B, H, Sq, 128) tiles
_BLOCK_MASK_BLOCK = _ffi.BLOCK_MASK_BLOCK
_HIGHEST = lax.Precision.HIGHEST


def _absent(x) -> bool:
  return x is None or is_absent(x)


def _acc_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _sum_to(x, shape):
  """Sums x over the axes where `shape` is 1 (the broadcast of a dense operand)."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


class _Problem:
  """One call's operands in the layouts the blocks use, and the score policies.

  Per-row tensors are grouped by KV head: q (B, Sq, Hkv, G, D), tiles
  (B, Hkv, G, Sq, n), row statistics (B, Hkv, G, Sq). Key-side tensors are
  padded to whole blocks (padded keys are hidden). Positions and indices are
  the chunk's (the offsets operand, mask.h's Offset), as in the kernels.
  """

  def __init__(self, q, k, mask_operands, params):
    # The tile map is a hint for skipping cells, which is not read here: these
    # formulations test every element, which is the same result.
    ops = dict(zip(MASK_OPERANDS, mask_operands, strict=True))
    self.q_seqlens, self.kv_seqlens, self.keys = (
        ops["q_seqlens"], ops["kv_seqlens"], ops["dropout_key"])
    q_seg, kv_seg, bias, mask, block_mask = (ops[name] for name in (
        "q_segment_ids", "kv_segment_ids", "bias", "mask", "block_mask"))
    # Query and key positions of row and key 0, global batch and head of element 0.
    offsets = ops["offsets"]
    self.q_position, self.kv_position, self.batch_offset, self.head_offset = (
        (0, 0, 0, 0) if _absent(offsets) else tuple(offsets[n] for n in range(4)))
    self.batch, self.seqlen_q, self.num_heads, self.head_dim = q.shape
    self.seqlen_k, self.num_kv_heads = k.shape[1], k.shape[2]
    self.group = self.num_heads // self.num_kv_heads
    self.acc = _acc_dtype(q.dtype)
    # Whole 16-column tiles of dropout draws (dropout.py) per block.
    self.block = min(BLOCK_N, max(dropout.TILE, -(-self.seqlen_k // dropout.TILE) * dropout.TILE))
    self.num_blocks = max(1, -(-self.seqlen_k // self.block))
    self.padded = self.num_blocks * self.block
    self.scale = params["scale"]
    self.softcap = params["softcap"]
    self.is_causal = params["is_causal"]
    self.window = (params["window_left"], params["window_right"])
    self.rate = params["dropout_rate"]
    self.broadcast_dropout = params["broadcast_dropout"]
    self.q_seg = None if _absent(q_seg) else q_seg[:, None, None, :, None]
    self.kv_seg = None if _absent(kv_seg) else self.pad_keys(kv_seg)
    self.bias_shape = None if _absent(bias) else bias.shape
    self.bias = None if _absent(bias) else self.dense(bias.astype(self.acc))
    self.mask = None if _absent(mask) else self.dense(mask)
    self.block_mask = None if _absent(block_mask) else self.block_rows(block_mask)

  # -- layouts ----------------------------------------------------------------

  def pad_keys(self, x, axis=1):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, self.padded - x.shape[axis])
    return jnp.pad(x, pad)

  def grouped(self, x):
    """(B, S, Hq, D) -> (B, S, Hkv, G, D), in the accumulation dtype."""
    return x.astype(self.acc).reshape(x.shape[:2] + (self.num_kv_heads, self.group,
                                                     x.shape[-1]))

  def rows(self, x):
    """(B, Hq, Sq) -> (B, Hkv, G, Sq)."""
    return x.reshape(x.shape[0], self.num_kv_heads, self.group, x.shape[-1])

  def ungroup_rows(self, x):
    return x.reshape(x.shape[0], self.num_heads, x.shape[-1])

  def dense(self, x):
    """A 4-d bias or mask (B', H', T', S') -> (B', Hkv|1, G|1, T', S'|padded)."""
    heads = (self.num_kv_heads, self.group) if x.shape[1] != 1 else (1, 1)
    x = x.reshape((x.shape[0],) + heads + x.shape[2:])
    return x if x.shape[-1] == 1 else self.pad_keys(x, axis=4)

  def block_rows(self, block_mask):
    """The block mask (B', H', R, C) -> (B', Hkv|1, G|1, Sq|1, C): each row's
    cells, by position (mask.h); cells past the mask's end are hidden."""
    heads = (self.num_kv_heads, self.group) if block_mask.shape[1] != 1 else (1, 1)
    x = block_mask.reshape((block_mask.shape[0],) + heads + block_mask.shape[2:])
    if x.shape[3] == 1:
      return x
    rows = (self.q_position + jnp.arange(self.seqlen_q)) // _BLOCK_MASK_BLOCK
    return jnp.take(x, rows, axis=3, mode="fill", fill_value=False)

  def block_cells(self, j0):
    """The block mask's cells of keys j0 .. j0 + block, (B', Hkv|1, G|1, Sq|1, block|1)."""
    x = self.block_mask
    if x.shape[4] == 1:
      return x
    cols = (self.kv_position + j0 + jnp.arange(self.block)) // _BLOCK_MASK_BLOCK
    return jnp.take(x, cols, axis=4, mode="fill", fill_value=False)

  def key_block(self, x, j0, axis=1):
    return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, j0, self.block, axis)

  # -- score policies ---------------------------------------------------------

  def visible(self, j0):
    """Boolean, broadcastable to (B, Hkv, G, Sq, n): may query i see key j."""
    i = jnp.arange(self.seqlen_q)[:, None]
    j = j0 + jnp.arange(self.block)[None, :]
    vis = j < self.seqlen_k
    diagonal = i + (self.q_position - self.kv_position)  # the key on row i's diagonal
    if self.is_causal:
      vis &= j <= diagonal
    left, right = self.window
    if left >= 0:
      vis &= j >= diagonal - left
    if right >= 0:
      vis &= j <= diagonal + right
    vis = vis[None, None, None]
    if not _absent(self.q_seqlens):  # lengths count from the start of the sequence
      vis &= i + self.q_position < self.q_seqlens[:, None, None, None, None]
    if not _absent(self.kv_seqlens):
      vis &= j + self.kv_position < self.kv_seqlens[:, None, None, None, None]
    if self.q_seg is not None:
      vis &= self.q_seg == self.key_block(self.kv_seg, j0)[:, None, None, None, :]
    if self.mask is not None:
      vis &= self.key_block(self.mask, j0, axis=4)
    if self.block_mask is not None:
      vis &= self.block_cells(j0)
    return vis

  def logits(self, qg, k_blk, j0):
    """(x, sech2): the logits as the kernels form them, and the soft cap's derivative."""
    x = jnp.einsum("bikgd,bjkd->bkgij", qg, k_blk, precision=_HIGHEST) * self.scale
    if self.bias is not None:
      x = x + self.key_block(self.bias, j0, axis=4)
    if not self.softcap:
      return x, None
    t = jnp.tanh(x / self.softcap)
    return self.softcap * t, 1 - t * t

  def probs(self, x, lse_rows, vis):
    """P = exp(x - lse) where visible, else 0; rows with lse = -inf are 0."""
    finite = lse_rows[..., None] != -jnp.inf
    ok = vis & finite
    z = jnp.where(ok, x - jnp.where(finite, lse_rows[..., None], 0), 0)
    return jnp.where(ok, jnp.exp(z), 0), ok

  def keep(self, j0):
    """The kernels' dropout mask for this block, or None without dropout."""
    if not self.rate:
      return None
    keep = dropout.keep_mask(self.keys, self.rate, self.broadcast_dropout, self.batch,
                             self.num_heads, self.seqlen_q, j0 + self.kv_position, self.block,
                             row0=self.q_position, batch_offset=self.batch_offset,
                             head_offset=self.head_offset)
    return keep.reshape(self.batch, self.num_kv_heads, self.group, self.seqlen_q, self.block)

  def drop(self, x, keep):
    """Dropout as the forward applied it: kept elements scaled by 1 / (1 - rate)."""
    if keep is None:
      return x
    return jnp.where(keep, x * jnp.asarray(dropout.keep_scale(self.rate), self.acc), 0)

  # -- the loop over key blocks -----------------------------------------------

  def scan(self, step, init, operands):
    """Runs carry, y = carry + inc, y for inc, y = step(j0) over the key blocks.

    The carry starts varying over the manual axes (shard_map) of `operands`,
    as the increments computed from them do.
    """
    leaves, tree = jax.tree.flatten(init)
    leaves = match_varying(*leaves, *[x for x in operands if x is not None])[:len(leaves)]
    init = jax.tree.unflatten(tree, leaves)
    step = jax.checkpoint(step, prevent_cse=False)

    def body(carry, j0):
      inc, y = step(j0)
      return jax.tree.map(jnp.add, carry, inc), y

    starts = jnp.arange(self.num_blocks, dtype=jnp.int32) * self.block
    return lax.scan(body, init, starts)

  def unblock(self, ys, axis):
    """Stacked per-block results (nb, ..., n at `axis`, ...) -> (..., Sk, ...)."""
    ys = jnp.moveaxis(ys, 0, axis)
    shape = ys.shape[:axis] + (self.padded,) + ys.shape[axis + 2:]
    return lax.slice_in_dim(ys.reshape(shape), 0, self.seqlen_k, axis=axis)


def jvp(*operands, **params):
  """flash_jvp_p's operands -> (out_dot, lse_dot); see JvpParams in params.h."""
  (q, k, v, out, lse), tangents, mask_operands = operands[:5], operands[5:9], operands[9:]
  q_dot, k_dot, v_dot, bias_dot = (None if _absent(t) else t for t in tangents)
  pb = _Problem(q, k, mask_operands, params)
  if pb.bias is None:
    bias_dot = None
  qg = pb.grouped(q)
  kp, vp = pb.pad_keys(k.astype(pb.acc)), pb.pad_keys(v.astype(pb.acc))
  q_dot = None if q_dot is None else pb.grouped(q_dot)
  k_dot = None if k_dot is None else pb.pad_keys(k_dot.astype(pb.acc))
  v_dot = None if v_dot is None else pb.pad_keys(v_dot.astype(pb.acc))
  bias_dot = None if bias_dot is None else pb.dense(bias_dot.astype(pb.acc))
  lse_rows = pb.rows(lse.astype(pb.acc))
  has_ds = q_dot is not None or k_dot is not None or bias_dot is not None

  def step(j0):
    k_blk, v_blk = pb.key_block(kp, j0), pb.key_block(vp, j0)
    x, sech2 = pb.logits(qg, k_blk, j0)
    vis = pb.visible(j0)
    probs, ok = pb.probs(x, lse_rows, vis)
    keep = pb.keep(j0)
    acc = jnp.zeros(qg.shape, pb.acc)
    lse_inc = jnp.zeros(lse_rows.shape, pb.acc)
    if has_ds:
      ds = jnp.zeros_like(x)
      if q_dot is not None:
        ds = ds + jnp.einsum("bikgd,bjkd->bkgij", q_dot, k_blk, precision=_HIGHEST)
      if k_dot is not None:
        ds = ds + jnp.einsum("bikgd,bjkd->bkgij", qg, pb.key_block(k_dot, j0), precision=_HIGHEST)
      ds = ds * pb.scale
      if bias_dot is not None:
        ds = ds + pb.key_block(bias_dot, j0, axis=4)
      if sech2 is not None:
        ds = ds * sech2
      pds = jnp.where(ok, probs * ds, 0)  # hidden keys: exactly 0, whatever the tangents
      lse_inc = jnp.sum(pds, axis=-1)
      acc = acc + jnp.einsum("bkgij,bjkd->bikgd", pb.drop(pds, keep), v_blk, precision=_HIGHEST)
    if v_dot is not None:
      acc = acc + jnp.einsum("bkgij,bjkd->bikgd", pb.drop(probs, keep), pb.key_block(v_dot, j0),
                             precision=_HIGHEST)
    return (acc, lse_inc), None

  init = (jnp.zeros(qg.shape, pb.acc), jnp.zeros(lse_rows.shape, pb.acc))
  (acc, lse_dot), _ = pb.scan(step, init, operands)
  acc = acc.reshape(q.shape)
  lse_dot = pb.ungroup_rows(lse_dot)
  # out = Pd V, so the softmax's -lse_dot P term of the output is -lse_dot out.
  out_dot = acc - jnp.swapaxes(lse_dot, 1, 2)[..., None] * out.astype(pb.acc)
  return out_dot.astype(q.dtype), lse_dot.astype(lse.dtype)


def bwd(*operands, bias_grad, lse_cotangent=None, **params):
  """flash_bwd_p's operands -> (dq, dk, dv, dbias), honouring an lse cotangent.

  dS = P o (dP - D + lse_cotangent) with D = rowsum(dout o out); dout may be
  absent (0-d) when only lse has a cotangent. dbias is absent ((0,)) without
  a bias or without bias_grad, and in the accumulation dtype, as flash_bwd_p's.
  """
  params.pop("deterministic", None)
  (q, k, v, out, lse, dout), mask_operands = operands[:6], operands[6:]
  pb = _Problem(q, k, mask_operands, params)
  dout = None if _absent(dout) else dout
  qg = pb.grouped(q)
  kp, vp = pb.pad_keys(k.astype(pb.acc)), pb.pad_keys(v.astype(pb.acc))
  lse_rows = pb.rows(lse.astype(pb.acc))
  delta = jnp.zeros(lse_rows.shape, pb.acc)
  if dout is not None:
    doutg = pb.grouped(dout)
    delta = jnp.einsum("bikgd,bikgd->bkgi", doutg, pb.grouped(out), precision=_HIGHEST)
  if not _absent(lse_cotangent):
    delta = delta - pb.rows(lse_cotangent.astype(pb.acc))
  bias_per_key = pb.bias is not None and pb.bias.shape[-1] != 1
  dbias_shape = None
  if pb.bias is not None and bias_grad:
    dbias_shape = pb.bias.shape[:4] + (pb.block if bias_per_key else 1,)

  def step(j0):
    k_blk, v_blk = pb.key_block(kp, j0), pb.key_block(vp, j0)
    x, sech2 = pb.logits(qg, k_blk, j0)
    probs, ok = pb.probs(x, lse_rows, pb.visible(j0))
    keep = pb.keep(j0)
    dp = 0
    dv_blk = jnp.zeros(k_blk.shape, pb.acc)
    if dout is not None:
      dp = pb.drop(jnp.einsum("bikgd,bjkd->bkgij", doutg, v_blk, precision=_HIGHEST), keep)
      dv_blk = jnp.einsum("bkgij,bikgd->bjkd", pb.drop(probs, keep), doutg, precision=_HIGHEST)
    ds = jnp.where(ok, probs * (dp - delta[..., None]), 0)
    if sech2 is not None:
      ds = ds * sech2
    dq_inc = jnp.einsum("bkgij,bjkd->bikgd", ds, k_blk, precision=_HIGHEST) * pb.scale
    dk_blk = jnp.einsum("bkgij,bikgd->bjkd", ds, qg, precision=_HIGHEST) * pb.scale
    dbias = None if dbias_shape is None else _sum_to(ds, dbias_shape)
    inc = (dq_inc, None if bias_per_key else dbias)
    return inc, (dk_blk, dv_blk, dbias if bias_per_key else None)

  init = (jnp.zeros(qg.shape, pb.acc),
          None if bias_per_key or dbias_shape is None else jnp.zeros(dbias_shape, pb.acc))
  (dq, dbias_sum), (dk, dv, dbias_blocks) = pb.scan(step, init, (*operands, lse_cotangent))
  dq = dq.reshape(q.shape).astype(q.dtype)
  dk = pb.unblock(dk, 1).astype(k.dtype)
  dv = pb.unblock(dv, 1).astype(v.dtype)
  # In the accumulation dtype, as flash_bwd_p's (primitives.py).
  if dbias_shape is None:
    dbias = jnp.zeros((0,), pb.acc)
  else:
    dbias = pb.unblock(dbias_blocks, 4) if bias_per_key else dbias_sum
    dbias = dbias.reshape(pb.bias_shape).astype(pb.acc)
  return dq, dk, dv, dbias

"""Autodiff rules of the primitives: every JAX transformation, to any order.

* flash_fwd_p's JVP is flash_jvp_p (a fused kernel on the CPU), linear in
  the tangents of q, k, v and the bias. Symbolic zero tangents are passed as
  absent (0-d) operands, so the kernel skips their products. The bias's
  tangent (and so dbias) is in the accumulation dtype, whatever the bias's
  (a 16-bit bias is one too, contract.h): the JVP casts it, and the transpose
  of that cast gives reverse mode a cotangent of the bias's own dtype.
* flash_jvp_p's transpose is the backward kernel flash_bwd_p, so reverse
  mode (``grad``, ``vjp``) runs exactly the forward and backward kernels: the
  JVP is linearised and transposed away, never run. The backward computes
  dbias only when the bias is differentiated (its tangent operand is then an
  undefined primal, not an absent zero). An lse cotangent reaches
  the transpose only in second order (the public API returns lse under
  stop_gradient, but the JVP of flash_bwd_p uses the tangent of lse, so its
  transpose sends one back); that part is added exactly by the blockwise
  backward (dS = P o (dP - D + lse_cotangent)).
* flash_jvp_p's and flash_bwd_p's own JVPs (second order) are ``jax.jvp`` of
  their blockwise JAX formulations (blockwise.py); their primal outputs
  still come from the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from jax_flash import blockwise
from jax_flash.primitives import (MASK_OPERANDS, absent_operand, accumulation_dtype, flash_bwd_p,
                                  flash_fwd_p, flash_jvp_p, is_absent)

_NUM_MASK = len(MASK_OPERANDS)
_BIAS = MASK_OPERANDS.index("bias")
# The bias's among flash_jvp_p's tangent operands (q_dot, k_dot, v_dot, bias_dot).
_BIAS_DOT = 3


def _absent_like(x):
  return absent_operand(x.dtype)


def _tangent_operand(tangent, primal):
  """A tangent as the JVP primitive takes it: absent when zero."""
  if type(tangent) is ad.Zero or primal.size == 0 or is_absent(primal):
    return _absent_like(primal)
  return tangent


def _fwd_jvp(primals, tangents, **params):
  q, k, v, *mask_operands = primals
  out, lse = flash_fwd_p.bind(*primals, **params)
  bias = mask_operands[_BIAS]
  operands = [_tangent_operand(t, x) for t, x in zip(tangents[:3], (q, k, v))]
  operands.append(_tangent_operand(tangents[3 + _BIAS], bias).astype(accumulation_dtype(q.dtype)))
  out_dot, lse_dot = flash_jvp_p.bind(q, k, v, out, lse, *operands, *mask_operands, **params)
  return (out, lse), (out_dot, lse_dot)


def _jvp_transpose(cotangents, q, k, v, out, lse, *rest, **params):
  tangents, mask_operands = rest[:4], rest[4:]
  assert not any(ad.is_undefined_primal(x) for x in (q, k, v, out, lse, *mask_operands)), (
      "flash_jvp is linear in its tangent operands only")
  out_ct, lse_ct = cotangents
  # A bias with a symbolic zero tangent (not differentiated) came as an
  # absent operand: its gradient would be thrown away, so it is not computed.
  bias_grad = ad.is_undefined_primal(tangents[_BIAS_DOT])
  grads = None
  if type(out_ct) is not ad.Zero:
    grads = flash_bwd_p.bind(q, k, v, out, lse, out_ct.astype(q.dtype), *mask_operands,
                             bias_grad=bias_grad, **params)
  if type(lse_ct) is not ad.Zero:
    extra = blockwise.bwd(q, k, v, out, lse, _absent_like(q), *mask_operands,
                          bias_grad=bias_grad, lse_cotangent=lse_ct, **params)
    grads = extra if grads is None else [g + e for g, e in zip(grads, extra)]
  results = [None] * 5
  for tangent, grad in zip(tangents, grads or [None] * 4):
    results.append(grad if ad.is_undefined_primal(tangent) else None)
  return results + [None] * _NUM_MASK


def _differentiable(x, tangent) -> bool:
  return (type(tangent) is not ad.Zero and x.size > 0 and not is_absent(x) and
          jnp.issubdtype(x.dtype, jnp.inexact))


def _blockwise_jvp(fn, primals, tangents, params):
  """Tangents of fn(*primals, **params) (a blockwise formulation) by jax.jvp.

  Operands with zero tangents (and the integer ones) are closed over, so
  jax.jvp sees only those that move.
  """
  which = [i for i, (x, t) in enumerate(zip(primals, tangents)) if _differentiable(x, t)]

  def moving(*xs):
    args = list(primals)
    for i, x in zip(which, xs):
      args[i] = x
    return fn(*args, **params)

  _, tangents_out = jax.jvp(moving, [primals[i] for i in which], [tangents[i] for i in which])
  return list(tangents_out)


def _second_order_jvp(prim, fn):
  def rule(primals, tangents, **params):
    return prim.bind(*primals, **params), _blockwise_jvp(fn, primals, tangents, params)

  return rule


ad.primitive_jvps[flash_fwd_p] = _fwd_jvp
ad.primitive_transposes[flash_jvp_p] = _jvp_transpose
ad.primitive_jvps[flash_jvp_p] = _second_order_jvp(flash_jvp_p, blockwise.jvp)
ad.primitive_jvps[flash_bwd_p] = _second_order_jvp(flash_bwd_p, blockwise.bwd)

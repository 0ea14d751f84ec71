"""The JAX primitives behind jax_flash: ``flash_fwd_p``, ``flash_jvp_p``, ``flash_bwd_p``.

Each has an abstract evaluation (shapes, dtypes and, under shard_map, the
varying manual axes of the results), a lowering to the XLA FFI custom call of
its platform wrapped in a sharding rule (jax_flash/sharding/partitioning.py:
sharded inputs run locally on each device), and a batching rule that folds
vmapped axes into the kernel's batch (or, for a forward vmapped over the query
alone, into its heads) so that ``vmap`` never loops. Their autodiff rules
(the forward's JVP is ``flash_jvp_p``, whose transpose is ``flash_bwd_p``)
are in autodiff.py.

Operands, results and attributes are the custom calls' (cpp/ffi/contract.h,
read through _ffi.CONTRACT), except that an absent optional operand is 0-d
here and shape ``(0,)`` only in the call (absent_operand says why); every op
ends with the MASK_OPERANDS (lengths, segment ids, bias, mask, block mask,
tile map, dropout key, offsets). The primitives'
parameters are the calls' attributes (scale, softcap, is_causal,
window_left, window_right, dropout_rate, broadcast_dropout, deterministic);
only the backward's call takes deterministic, the forward and the JVP carry
it for the backward that their derivatives bind. The backward has one more,
``bias_grad``: whether to compute dbias. Without it, dbias is an absent
``(0,)`` result, which is how the call tells the kernels to skip it
(contract.h); reverse mode asks for it only when the bias is differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_flash import _ffi
from jax_flash._absent import absent_operand, is_absent
from jax_flash.sharding import partitioning

flash_fwd_p = Primitive("flash_fwd")
flash_fwd_p.multiple_results = True
flash_bwd_p = Primitive("flash_bwd")
flash_bwd_p.multiple_results = True
flash_jvp_p = Primitive("flash_jvp")
flash_jvp_p.multiple_results = True

# Where each platform's handler lives. Lowering rules exist for both; a
# platform whose handler was not compiled in fails at lowering with an error
# that says so (see _ffi._require_cuda_build) or at compile time with
# XLA's "no registered implementation" error, which build_info() explains.
_LOWERING_PLATFORMS = ("cpu", "cuda")

MASK_OPERANDS = _ffi.MASK_OPERANDS
_BIAS, _KEY, _OFFSETS = (MASK_OPERANDS.index(name) for name in ("bias", "dropout_key", "offsets"))


def accumulation_dtype(dtype) -> np.dtype:
  """float64 inputs accumulate (and return lse) in float64, the rest in float32."""
  return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


_16_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def keeps_16bit_bias(dtype, bias_dtype) -> bool:
  """Whether a bias of `bias_dtype` goes to the calls on inputs of `dtype` as
  it is, not in the accumulation dtype: the inputs' own 16-bit dtype
  (contract.h). The CUDA kernels read it as it is (half the bytes of a
  float32 copy); the CPU lowering converts it just before its call."""
  return np.dtype(bias_dtype) == np.dtype(dtype) and np.dtype(dtype) in _16_BIT


def mask_operands(dtype, **present) -> tuple:
  """The MASK_OPERANDS of a call on inputs of `dtype`: those given by name,
  the others absent (absent_operand, in the dtype contract.h gives them; of
  two, "a|b", the first)."""
  unknown = set(present) - set(MASK_OPERANDS)
  if unknown:
    raise TypeError(f"jax_flash: no mask operand named {sorted(unknown)}; they are {MASK_OPERANDS}")
  dtypes = {"acc": accumulation_dtype(dtype), "input": np.dtype(dtype)}
  absent = {name: kind.split("|")[0] for name, kind in _ffi.OPERAND_DTYPES.items()}
  return tuple(present[name] if name in present else
               absent_operand(dtypes.get(absent[name], absent[name]))
               for name in MASK_OPERANDS)


# -- abstract evaluation -------------------------------------------------------


def _varying(avals) -> frozenset:
  """Manual mesh axes (shard_map) that any operand varies over."""
  return frozenset().union(*(a.mat.varying for a in avals))


def _result(like, avals, shape=None, dtype=None, dims=None):
  """A result typed like the operand `like`, with its dims permuted by `dims`
  (None in `dims`: a new dim, not sharded).

  It varies over every manual axis (shard_map) that some operand varies
  over: dropping that type is what made gradients under shard_map fail.
  """
  varying = _varying(avals)
  sharding = like.sharding
  if dims is not None:
    spec = tuple(sharding.spec) + (None,) * like.ndim
    sharding = sharding.update(spec=PartitionSpec(*(None if d is None else spec[d]
                                                    for d in dims)))
  if varying and sharding.mesh.empty:
    sharding = NamedSharding(jax.sharding.get_abstract_mesh(),
                             PartitionSpec(*(None,) * len(shape or like.shape)))
  return like.update(shape=shape, dtype=dtype, sharding=sharding,
                     manual_axis_type=like.mat.update(varying=varying))


def _fwd_abstract_eval(q, k, v, *mask_operands, **params):
  del params
  avals = (q, k, v, *mask_operands)
  batch, seqlen_q, num_heads, _ = q.shape
  out = _result(q, avals)
  lse = _result(q, avals, (batch, num_heads, seqlen_q), accumulation_dtype(q.dtype), (0, 2, 1))
  return out, lse


def _bwd_abstract_eval(q, k, v, out, lse, dout, *mask_operands, bias_grad, **params):
  del params
  avals = (q, k, v, out, lse, dout, *mask_operands)
  bias = mask_operands[_BIAS]
  # In the accumulation dtype whatever the bias's (contract.h): reverse mode
  # casts it to the bias's dtype (autodiff.py).
  acc = accumulation_dtype(q.dtype)
  dbias = (_result(bias, avals, dtype=acc) if _computes_dbias(bias, bias_grad) else
           _result(bias, avals, (0,), acc, dims=(None,)))
  return (*(_result(x, avals) for x in (q, k, v)), dbias)


def _computes_dbias(bias, bias_grad) -> bool:
  """Whether the backward's dbias has the bias's shape (else absent, (0,))."""
  return bias_grad and not is_absent(bias)


def _jvp_abstract_eval(q, k, v, out, lse, *operands, **params):
  del params
  avals = (q, k, v, out, lse, *operands)
  return _result(out, avals), _result(lse, avals)


flash_fwd_p.def_abstract_eval(_fwd_abstract_eval)
flash_bwd_p.def_abstract_eval(_bwd_abstract_eval)
flash_jvp_p.def_abstract_eval(_jvp_abstract_eval)


def match_varying(*arrays):
  """Casts arrays to vary over the same manual axes (inside shard_map).

  Call it on a primitive's operands before any autodiff rule sees them:
  then every gradient has the type of its primal (an operand replicated over
  an axis gets, through pcast's transpose, its gradient summed over it).
  """
  avals = [jax.typeof(x) for x in arrays]
  varying = _varying(avals)
  return [x if a.mat.varying == varying else
          jax.lax.pcast(x, tuple(sorted(varying - a.mat.varying)), to="varying")
          for x, a in zip(arrays, avals)]


# -- eager execution: compile the primitive on its own, once per parameters ----


@functools.lru_cache(maxsize=None)
def _jitted(prim: Primitive, params: tuple):
  return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _impl(prim, *args, **params):
  return _jitted(prim, tuple(sorted(params.items())))(*args)


flash_fwd_p.def_impl(functools.partial(_impl, flash_fwd_p))
flash_bwd_p.def_impl(functools.partial(_impl, flash_bwd_p))
flash_jvp_p.def_impl(functools.partial(_impl, flash_jvp_p))


# -- lowering ------------------------------------------------------------------


def _lowering(target):
  lower = jax.ffi.ffi_lowering(target)

  def rule(ctx, *args, **params):
    # Absent operands (0-d) reach the call as the (0,) it expects.
    absent = [is_absent(a) for a in ctx.avals_in]
    if any(absent):
      args = [mlir.ir_constant(np.zeros((0,), a.dtype)) if gone else x
              for x, a, gone in zip(args, ctx.avals_in, absent)]
      ctx = ctx.replace(avals_in=[a.update(shape=(0,)) if gone else a
                                  for a, gone in zip(ctx.avals_in, absent)])
    return lower(ctx, *args, **_ffi.attributes(target, params))

  return rule


def _cpu_lowering(target):
  """The CPU call; a 16-bit bias is converted to the accumulation dtype first.

  The CPU kernels read the bias in the accumulation dtype (the CUDA kernels
  read a 16-bit one as it is), so the call gets a converted copy: `kernel`
  bound again on it, in HLO before the call.
  Returns a rule maker, given the kernel primitive (see _define_lowering).
  """
  lower = _lowering(target)
  bias_index = _ffi.operands(target).index("bias")

  def make(kernel):
    def rule(ctx, *args, **params):
      dtype = ctx.avals_in[0].dtype
      acc = accumulation_dtype(dtype)
      # Any other dtype goes to the handler as it is, which refuses it.
      if not keeps_16bit_bias(dtype, ctx.avals_in[bias_index].dtype):
        return lower(ctx, *args, **params)

      def widened(*operands):
        operands = list(operands)
        operands[bias_index] = operands[bias_index].astype(acc)
        return kernel.bind(*operands, **params)

      return mlir.lower_fun(widened, multiple_results=True)(ctx, *args)

    return rule

  return make


def _cuda_workspace_lowering(target, workspace_bytes):
  """The CUDA forward and backward have one more result than the primitive:
  their workspace.

  The forward keeps its persistent scheduler's tile counter there; the
  backward delta = rowsum(dout * out) and the tensor-core kernels' float32 dQ
  accumulator. As a result of the call (rather than scratch from XLA's
  ScratchAllocator, which is returned when the handler returns), XLA owns it
  for as long as the call may run, which is what lets the handler be
  recorded into a CUDA graph. Its size comes from the C++ side, which alone
  knows the kernels' needs: `workspace_bytes(q_aval, k_aval, params)`.
  """
  lower = _lowering(target)

  def rule(ctx, *args, **params):
    q, k = ctx.avals_in[:2]
    workspace = jax.core.ShapedArray((workspace_bytes(q, k, params),), np.uint8)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    return lower(ctx, *args, **params)[:-1]

  return rule


_CUDA_WORKSPACE_BYTES = {
    _ffi.FWD_TARGET: lambda q, k, params: _ffi.cuda_fwd_workspace_bytes(),
    _ffi.BWD_TARGET: lambda q, k, params: _ffi.cuda_bwd_workspace_bytes(
        q.shape, k.shape, q.dtype, params["deterministic"]),
}


def _platform_rules(target):
  """Rule makers (kernel primitive -> lowering rule) by platform."""
  if target in _CUDA_WORKSPACE_BYTES:
    cuda = _cuda_workspace_lowering(target, _CUDA_WORKSPACE_BYTES[target])
  else:
    cuda = _lowering(target)
  return {"cpu": _cpu_lowering(target), "cuda": lambda kernel: cuda}


# -- sharding: what each operand and result dimension is -----------------------


_QUERY_ROLES = ("b", "s", "h", "d")
_KEY_ROLES = ("b", "t", "k", "d")
_DENSE_ROLES = ("b", "h", "s", "t")  # a bias or mask, broadcastable to (B, Hq, Sq, Sk)

# The operands' names in sharding warnings, where the contract's are terse.
_READABLE = {"q": "query", "k": "key", "v": "value"}

# Roles (see sharding/partitioning.py) of each mask operand's dimensions.
# The block mask's and the tile map's cells are indexed by position (mask.h):
# a sequence shard reads the whole of them, told its place by the offsets.
_CELL_ROLES = ("b", "h", None, None)
_MASK_ROLES = {"q_seqlens": ("b",), "kv_seqlens": ("b",), "q_segment_ids": ("b", "s"),
               "kv_segment_ids": ("b", "t"), "bias": _DENSE_ROLES, "mask": _DENSE_ROLES,
               "block_mask": _CELL_ROLES, "tile_map": _CELL_ROLES, "dropout_key": (None, None),
               "offsets": (None,)}
if set(_MASK_ROLES) != set(MASK_OPERANDS):
  raise ImportError(f"jax_flash: primitives.py gives sharding roles to {sorted(_MASK_ROLES)}, "
                    f"but the extension's mask operands are {sorted(MASK_OPERANDS)}: the "
                    "package and its compiled extension disagree (reinstall it)")


def _mask_roles(mask_operands) -> list[tuple]:
  """Roles of the MASK_OPERANDS' dimensions (none along broadcast ones)."""
  return [() if is_absent(x) else
          tuple(None if x.shape[i] == 1 else r for i, r in enumerate(_MASK_ROLES[name]))
          for name, x in zip(MASK_OPERANDS, mask_operands)]


# With dropout, a chunk's positions are multiples of the 16 x 16 blocks of
# draws (cpp/include/jax_flash/dropout.h).
DROPOUT_BLOCK = 16


def _layout(name, target, per_row_roles, result_roles, mask_operands, params):
  mask_roles = _mask_roles(mask_operands)
  window = params["window_left"] >= 0 or params["window_right"] >= 0
  dropout = params["dropout_rate"] > 0
  # Lengths count from the start of the sequence, cells are in positions: a
  # query shard reading them must be told where it starts.
  by_position = [not is_absent(mask_operands[MASK_OPERANDS.index(operand)])
                 for operand in ("q_seqlens", "block_mask", "tile_map")]
  return partitioning.Layout(
      name=name,
      operand_names=tuple(_READABLE.get(name, name) for name in _ffi.operands(target)),
      operand_roles=per_row_roles + tuple(mask_roles),
      result_roles=result_roles(mask_roles),
      offsets_index=len(per_row_roles) + _OFFSETS,
      needs_positions=params["is_causal"] or window or dropout or any(by_position),
      needs_ids=dropout,
      batch_shardable=not dropout or mask_operands[_KEY].shape[:1] == (1,),
      position_multiple=DROPOUT_BLOCK if dropout else 1)


def _fwd_layout(avals_in, params):
  return _layout("flash_attention (forward)", _ffi.FWD_TARGET,
                 (_QUERY_ROLES, _KEY_ROLES, _KEY_ROLES),
                 lambda mask_roles: (_QUERY_ROLES, ("b", "h", "s")), avals_in[3:], params)


def _tangent_roles(tangent, roles):
  """A tangent's roles: its primal's, per dimension (1 where it broadcasts), or absent."""
  if is_absent(tangent):
    return ()
  return tuple(None if tangent.shape[i] == 1 else r for i, r in enumerate(roles))


def _jvp_layout(avals_in, params):
  q_dot, k_dot, v_dot, bias_dot = avals_in[5:9]
  return _layout("flash_attention (forward mode)", _ffi.JVP_TARGET,
                 (_QUERY_ROLES, _KEY_ROLES, _KEY_ROLES, _QUERY_ROLES, ("b", "h", "s"),
                  _tangent_roles(q_dot, _QUERY_ROLES), _tangent_roles(k_dot, _KEY_ROLES),
                  _tangent_roles(v_dot, _KEY_ROLES), _tangent_roles(bias_dot, _DENSE_ROLES)),
                 lambda mask_roles: (_QUERY_ROLES, ("b", "h", "s")), avals_in[9:], params)


def _bwd_layout(avals_in, params):
  return _layout("flash_attention (backward)", _ffi.BWD_TARGET,
                 (_QUERY_ROLES, _KEY_ROLES, _KEY_ROLES, _QUERY_ROLES, ("b", "h", "s"),
                  _QUERY_ROLES),
                 lambda mask_roles: (_QUERY_ROLES, _KEY_ROLES, _KEY_ROLES,
                                     mask_roles[_BIAS] if _computes_dbias(
                                         avals_in[6 + _BIAS], params["bias_grad"]) else (None,)),
                 avals_in[6:], params)


def _define_lowering(prim, abstract_eval, target, layout_of):
  """Lowers `prim` through the sharding rule to a kernel primitive of its own.

  The kernel primitive (same operands, same abstract evaluation) lowers to
  the FFI call `target` of each platform; `prim` lowers to its
  custom-partitioned call, which runs it on each device's shard. Any new
  primitive over the same operands reuses this with its own layout.
  """
  kernel = Primitive(prim.name + "_kernel")
  kernel.multiple_results = prim.multiple_results
  kernel.def_abstract_eval(abstract_eval)
  rules = _platform_rules(target)
  for platform in _LOWERING_PLATFORMS:
    mlir.register_lowering(kernel, rules[platform](kernel), platform=platform)
  mlir.register_lowering(prim, partitioning.sharded_lowering(prim, kernel, layout_of))
  return kernel


_define_lowering(flash_fwd_p, _fwd_abstract_eval, _ffi.FWD_TARGET, _fwd_layout)
_define_lowering(flash_bwd_p, _bwd_abstract_eval, _ffi.BWD_TARGET, _bwd_layout)
# The JVP is a fused kernel on both platforms (on CUDA: tensor cores for
# bf16/fp16 without a bias (float16 on Turing), the exact kernel otherwise).
_jvp_kernel = _define_lowering(flash_jvp_p, _jvp_abstract_eval, _ffi.JVP_TARGET, _jvp_layout)


# -- batching ------------------------------------------------------------------


# How batching rules mark an operand that vmap does not map (jax uses None).
_NOT_MAPPED = None


# Operands broadcastable over the batch like a dense bias (4-d, batch dim 1 or B).
_DENSE_OPERANDS = ("bias", "mask", "bias_dot", "block_mask", "tile_map")


def _fold_into_batch(args, dims, axis_size, batch, target):
  """Moves every vmapped axis to the front and merges it with the batch axis.

  `batch` is the kernel batch of one example; the operands are those of the
  custom call `target` (their names say which are dense, _DENSE_OPERANDS).
  Unbatched operands are broadcast, absent optional operands stay absent.
  Returns the folded operands and, for the bias, whether its batch dim was 1
  (so that dbias can be summed back).
  """
  folded = []
  bias_was_broadcast = False
  for x, d, name in zip(args, dims, _ffi.operands(target), strict=True):
    if name == "offsets":
      # One chunk's offsets hold for every example folded into its batch.
      if d is not _NOT_MAPPED:
        raise NotImplementedError(
            "jax_flash: vmap over the offsets operand (one position per mapped example) is "
            "not supported; map over the batch instead")
      folded.append(x)
      continue
    if is_absent(x) and d is _NOT_MAPPED:
      folded.append(x)
      continue
    x = jnp.broadcast_to(x[None], (axis_size,) + x.shape) if d is _NOT_MAPPED else (
        jnp.moveaxis(x, d, 0))
    if name in _DENSE_OPERANDS:
      # A dense operand may broadcast over the batch (dim 1); the folded
      # batch is axis_size * batch, so spell the batch out first.
      if name == "bias":
        bias_was_broadcast = x.shape[1] == 1 and batch > 1
      x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
    folded.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
  return folded, bias_was_broadcast


def _unfold_batch(x, axis_size, batch):
  """(axis_size * batch, ...) -> (axis_size, batch, ...): spelled out, so that
  an axis of size 0 (vmap over nothing, jacrev of an empty output) works."""
  return x.reshape((axis_size, batch) + x.shape[1:])


def _axis_size(args, dims):
  return next(x.shape[d] for x, d in zip(args, dims) if d is not _NOT_MAPPED)


def _example_batch(x, d):
  """The kernel batch of one example of a (possibly mapped) per-row tensor."""
  return x.shape[1] if d == 0 else x.shape[0]


def _fwd_batch_rule(args, dims, **params):
  q_dim = dims[0]
  axis_size = _axis_size(args, dims)
  if (q_dim is not _NOT_MAPPED and all(d is _NOT_MAPPED for d in dims[1:]) and
      params["dropout_rate"] == 0):
    # Only the query is mapped: the mapped copies share K/V, so they become
    # extra query heads of each KV group (placing the mapped axis right after
    # the head axis keeps the GQA grouping head // group_size intact). Not
    # with dropout, whose mask depends on the head index, nor with a dense
    # bias or mask, a block mask or a tile map that varies per head.
    dense = [args[3 + MASK_OPERANDS.index(name)]
             for name in ("bias", "mask", "block_mask", "tile_map")]
    if all(is_absent(x) or x.shape[1] == 1 for x in dense):
      q = jnp.moveaxis(args[0], q_dim, 3)  # (B, Sq, Hq, V, D)
      batch, seqlen_q, num_heads, _, head_dim = q.shape
      q = q.reshape(batch, seqlen_q, num_heads * axis_size, head_dim)
      out, lse = flash_fwd_p.bind(q, *args[1:], **params)
      out = jnp.moveaxis(out.reshape(batch, seqlen_q, num_heads, axis_size, head_dim), 3, 0)
      lse = jnp.moveaxis(lse.reshape(batch, num_heads, axis_size, seqlen_q), 2, 0)
      return (out, lse), (0, 0)
  batch = _example_batch(args[0], q_dim)
  folded, _ = _fold_into_batch(args, dims, axis_size, batch, _ffi.FWD_TARGET)
  out, lse = flash_fwd_p.bind(*folded, **params)
  return (_unfold_batch(out, axis_size, batch), _unfold_batch(lse, axis_size, batch)), (0, 0)


def _bwd_batch_rule(args, dims, **params):
  axis_size = _axis_size(args, dims)
  batch = _example_batch(args[0], dims[0])
  folded, bias_was_broadcast = _fold_into_batch(args, dims, axis_size, batch, _ffi.BWD_TARGET)
  dq, dk, dv, dbias = flash_bwd_p.bind(*folded, **params)
  grads = [_unfold_batch(g, axis_size, batch) for g in (dq, dk, dv)]
  if dbias.shape == (0,):  # no bias, or its gradient not asked for (bias_grad): absent per example
    dbias = jnp.zeros((axis_size, 0), dbias.dtype)
  else:
    dbias = _unfold_batch(dbias, axis_size, batch)
    if bias_was_broadcast:
      dbias = jnp.sum(dbias, axis=1, keepdims=True)
  return (*grads, dbias), (0, 0, 0, 0)


def _jvp_batch_rule(args, dims, **params):
  axis_size = _axis_size(args, dims)
  batch = _example_batch(args[0], dims[0])
  folded, _ = _fold_into_batch(args, dims, axis_size, batch, _ffi.JVP_TARGET)
  out_dot, lse_dot = flash_jvp_p.bind(*folded, **params)
  return ((_unfold_batch(out_dot, axis_size, batch), _unfold_batch(lse_dot, axis_size, batch)),
          (0, 0))


batching.primitive_batchers[flash_fwd_p] = _fwd_batch_rule
batching.primitive_batchers[flash_bwd_p] = _bwd_batch_rule
batching.primitive_batchers[flash_jvp_p] = _jvp_batch_rule

"""Sharding rules for the attention primitives: every device runs its own shard.

Without a rule XLA treats a custom call as opaque and gathers its operands
onto every device. Here each primitive lowers through
``jax.experimental.custom_partitioning``: a Shardy rule (for propagation)
and a ``partition`` callback that picks the local problem and lowers the
kernel on each device's shard.

Each operand and result dimension has a *role*:
  b batch, s query sequence, t key sequence, h query heads, k key/value
  heads, d head dim, None anything else (a broadcast dim, a key's words).
The plan shards b, h (with k when the key/value heads split evenly, else
k/v stay whole and each device takes the head its query heads share) and
s; t and d are never sharded
(a kernel needs every key of its rows; ring attention covers a sharded key
sequence). A local call differs from its slice of the whole problem only in
where it sits, which the offsets operand (mask.h's Offset) tells the kernel:
query position (causal, window, lengths, dropout rows) and global batch and
head indices (dropout). Results lacking a sharded role are sums over it
(dK, dV over query rows and heads of a group; a broadcast bias's gradient),
so they are reduced with psum. Shardings the plan cannot use are resharded
(gathered) with a one-time warning that names them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch, sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from jax_flash._absent import is_absent

Role = str | None

# Offsets operand entries (cpp/include/jax_flash/mask.h, enum Offset).
QUERY_POSITION, KEY_POSITION, BATCH_OFFSET, HEAD_OFFSET = range(4)
NUM_OFFSETS = 4


class ShardingFallbackWarning(UserWarning):
  """A jax_flash primitive got shardings it cannot run locally and gathers."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """What the partitioner needs to know about one primitive call (static).

  operand_roles / result_roles: one role per dimension of each array.
  offsets_index: the operand that holds the offsets (maybe absent: _absent.py).
  needs_positions: the result depends on query positions (causal, window,
    lengths, dropout), so a sequence shard must be told its position.
  needs_ids: dropout: shards must be told their global batch and head.
  batch_shardable: False when per-example dropout keys (vmap over keys) make
    a batch shard's keys depend on its place; then the batch stays whole.
  position_multiple: a sequence shard's query position must be a multiple
    of this (16 with dropout: whole blocks of draws, dropout.h).
  """
  name: str
  operand_names: tuple[str, ...]
  operand_roles: tuple[tuple[Role, ...], ...]
  result_roles: tuple[tuple[Role, ...], ...]
  offsets_index: int
  needs_positions: bool
  needs_ids: bool
  batch_shardable: bool = True
  position_multiple: int = 1

  def size(self, shapes, role: str) -> int:
    """The size of a role's dimension (1 if no operand has it)."""
    for shape, roles in zip(shapes, self.operand_roles):
      if role in roles:
        return shape[roles.index(role)]
    return 1


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Mesh axes per sharded role. kv_heads is a prefix of heads: the key/value
  heads split over it, and the query heads of one key/value head over the
  rest (all of heads when they split evenly; none with one key/value head)."""
  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  seq: tuple[str, ...] = ()
  kv_heads: tuple[str, ...] = ()

  def axes(self, role: Role) -> tuple[str, ...]:
    return {"b": self.batch, "s": self.seq, "h": self.heads, "k": self.kv_heads}.get(role, ())


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _dims_axes(sharding, ndim: int) -> list[tuple[str, ...]] | None:
  """Mesh axes sharding each dim, or None for a sharding without a spec."""
  spec = sharding if isinstance(sharding, P) else getattr(sharding, "spec", None)
  if spec is None:
    return None if sharding is not None else [()] * ndim
  entries = list(spec) + [None] * (ndim - len(spec))
  return [_axes(e) for e in entries[:ndim]]


def _spec(dims_axes: Sequence[tuple[str, ...]]) -> P:
  return P(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims_axes))


def _decoded(sharding, hlo, mesh, ndim: int):
  """An operand's sharding (`hlo`: as XLA's HloSharding) as a NamedSharding
  of `mesh`, where it is one.

  The partitioner is handed XLA's shardings undecoded (decode_shardings=
  False), since jax's own decoding raises IndivisibleError for a sub-axis:
  a sharding that propagation gives a reshaped operand, e.g. the cells of a
  tile map whose ids or mask are sharded in more shards than there are cells
  (160 positions over 4 devices: 2 cells). Such a sharding is left as it is
  (no spec): the plan takes nothing from it and reshards the operand.
  """
  if isinstance(sharding, NamedSharding) or mesh.empty:
    return sharding
  try:
    # jax's decoder (private; what decode_shardings=True calls).
    spec, = sharding_impls.parse_flatten_op_sharding(hlo, mesh)
  except (ValueError, NotImplementedError, AssertionError, StopIteration):
    # IndivisibleError (a ValueError) for a sub-axis; the others for
    # shardings jax's decoder does not handle (several subgroup kinds, a
    # maximal sharding): all of them are resharded.
    return sharding
  return NamedSharding(mesh, P(*spec, *((None,) * (ndim - len(spec)))))


def _make_plan(layout: Layout, mesh, shapes, shardings) -> _Plan:
  """The shardings every device can run on its own shard, from the operands'."""
  incoming = [_dims_axes(s, len(shape)) for s, shape in zip(shardings, shapes)]
  used: set[str] = set()

  def candidates(role):
    for dims, roles in zip(incoming, layout.operand_roles):
      if dims is None:
        continue
      for axes, r in zip(dims, roles):
        if r == role and axes and not used.intersection(axes):
          yield axes

  def pick(roles, fits):
    for role in roles:
      for axes in candidates(role):
        n = math.prod(mesh.shape[a] for a in axes)
        if fits(n):
          used.update(axes)
          return axes
    return ()

  num_heads, num_kv_heads = layout.size(shapes, "h"), layout.size(shapes, "k")

  def kv_prefix(axes):
    """The prefix of the heads' axes that key/value heads split over, or None.

    Each device needs whole key/value heads whose query heads it holds:
    either the key/value heads split like the query heads, or each device's
    query heads belong to one key/value head (the prefix splits the
    key/value heads one per device, the rest splits their groups).
    """
    sizes = [mesh.shape[a] for a in axes]
    if num_kv_heads % math.prod(sizes) == 0:
      return axes
    for p in range(len(axes)):
      if math.prod(sizes[:p]) == num_kv_heads:
        return axes[:p]
    return None

  batch = pick("b", lambda n: layout.size(shapes, "b") % n == 0) if layout.batch_shardable else ()
  heads = pick("hk", lambda n: num_heads % n == 0)
  kv_heads = kv_prefix(heads) if heads else ()
  if kv_heads is None and math.prod(mesh.shape[a] for a in heads) % num_kv_heads == 0:
    # Query heads over more devices than there are key/value heads, along
    # one axis (4 over 2): each device's query heads still share one
    # key/value head, which it takes from whole K and V (_local_fn).
    kv_heads = ()
  if kv_heads is None:
    used.difference_update(heads)
    heads, kv_heads = (), ()
  seqlen = layout.size(shapes, "s")
  seq = pick("s", lambda n: seqlen % n == 0 and (seqlen // n) % layout.position_multiple == 0)
  return _Plan(batch=batch, heads=heads, seq=seq, kv_heads=kv_heads)


def _planned_specs(plan: _Plan, roles_list) -> list[P]:
  return [_spec([plan.axes(r) for r in roles]) for roles in roles_list]


_warned: set[str] = set()


def _warn_gathers(layout: Layout, shapes, shardings, specs) -> None:
  """One warning per distinct set of operands the plan reshards with communication."""
  moved = []
  for name, shape, sharding, spec in zip(layout.operand_names, shapes, shardings, specs):
    if name == "tile_map":
      # jax_flash's own (tile_map.py), one byte per 128 x 128 cell: a
      # sequence sharding of the ids or mask it comes from may reach its
      # cells, and gathering them is nothing to warn the caller about.
      continue
    have = _dims_axes(sharding, len(shape))
    want = _dims_axes(spec, len(shape))
    if have is None:
      if not sharding.is_fully_replicated:
        moved.append(f"{name} (sharding {sharding}) -> {spec}")
    elif any(h and h != w for h, w in zip(have, want)):
      moved.append(f"{name} {_spec(have)} -> {spec}")
  if not moved:
    return
  rows = (f" in shards of a multiple of {layout.position_multiple} rows (dropout draws whole "
          "blocks)" if layout.position_multiple > 1 else "")
  message = (f"jax_flash: {layout.name} cannot run on these shardings without communication, "
             f"so XLA gathers {'; '.join(moved)}. Each device runs its own shard when inputs "
             "are sharded evenly over batch dims and/or heads (key/value heads with their "
             f"query heads), or queries over the sequence{rows} with keys and values whole; a "
             "sharded key sequence needs jax_flash.ring_attention (see README, 'Many GPUs').")
  if message not in _warned:
    _warned.add(message)
    warnings.warn(message, ShardingFallbackWarning, stacklevel=2)


def _per_device(fn, mesh):
  """`fn` traced as the program of one device of `mesh`: all its axes manual.

  jax traces the partition callback's function under whatever abstract mesh
  is current when XLA runs the callback: the caller's (jax.set_mesh), or
  none, and not necessarily `mesh`. With explicit axes there, jax 0.11 wraps
  every op of the function in a Sharding custom call that no partitioner
  removes once the callback has run ("No registered implementation for
  untyped custom call to Sharding"), and psum takes the axes it may skip
  from that mesh. The function is one device's program of `mesh`, as a
  shard_map body is.
  """
  manual = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})

  def traced(*args):
    # Through the empty mesh: use_abstract_mesh refuses to swap a current
    # mesh for one of another size.
    with jax.sharding.use_abstract_mesh(AbstractMesh((), ())), \
        jax.sharding.use_abstract_mesh(manual):
      return fn(*args)

  return traced


def _local_fn(local_prim, layout: Layout, params: dict, plan: _Plan, local_shapes, mesh):
  """Runs on each device's shard: offsets for its place, the kernel, sums."""
  query_rows = layout.size(local_shapes, "s")
  batch = layout.size(local_shapes, "b")
  heads = layout.size(local_shapes, "h")
  shifts = {QUERY_POSITION: (plan.seq, query_rows)} if layout.needs_positions else {}
  if layout.needs_ids:
    shifts.update({BATCH_OFFSET: (plan.batch, batch), HEAD_OFFSET: (plan.heads, heads)})
  shifts = {i: v for i, v in shifts.items() if v[0]}

  def index(axes):
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0])

  # K and V whole while their query heads are split (_make_plan): each
  # device computes with the one key/value head its query heads share, and
  # its share of dK / dV goes back in that head's place before the sum.
  num_kv_heads = layout.size(local_shapes, "k")
  shared_kv = bool(plan.heads) and not plan.kv_heads and num_kv_heads > 1
  devices_per_kv_head = math.prod(mesh.shape[a] for a in plan.heads) // num_kv_heads

  def fn(*args):
    args = list(args)
    if shared_kv:
      kv_head = index(plan.heads) // devices_per_kv_head
      args = [x if "k" not in roles or is_absent(x) else
              jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=roles.index("k"))
              for x, roles in zip(args, layout.operand_roles)]
    if shifts:
      offsets = args[layout.offsets_index]
      offsets = jnp.zeros((NUM_OFFSETS,), jnp.int32) if is_absent(offsets) else offsets
      for i, (axes, size) in shifts.items():
        offsets = offsets.at[i].add(index(axes).astype(jnp.int32) * size)
      args[layout.offsets_index] = offsets
    results = local_prim.bind(*args, **params)
    summed = []
    for result, roles in zip(results, layout.result_roles):
      if shared_kv and "k" in roles and result.size:
        axis = roles.index("k")
        whole = jnp.zeros(result.shape[:axis] + (num_kv_heads,) + result.shape[axis + 1:],
                          result.dtype)
        result = jax.lax.dynamic_update_slice_in_dim(whole, result, kv_head, axis)
      missing = [a for role in ("b", "h", "s") for a in plan.axes(role)
                 if not any(a in plan.axes(r) for r in roles)]
      if missing and result.size and jnp.issubdtype(result.dtype, jnp.floating):
        result = jax.lax.psum(result, tuple(missing))
      summed.append(result)
    return tuple(summed)

  return _per_device(fn, mesh)


def _result_shardings(layout, mesh, plan):
  return tuple(NamedSharding(mesh, s) for s in _planned_specs(plan, layout.result_roles))


def _mesh_and_operands(mesh, arg_shapes):
  """The mesh to plan on, the operands' shapes and their decoded shardings.

  Inside a shard_map manual over some of the mesh's axes, XLA partitions
  each group of devices that the manual axes leave (the other axes'
  devices) on its own, while jax hands over the whole mesh of the caller's
  context (`with mesh:`); shardings over a group decoded against it are
  wrong (XLA aborted on them). Where the operands' devices are not the
  mesh's, the plan has no mesh: it gathers, with the warning.
  """
  shapes = [a.shape for a in arg_shapes]
  hlo = [a.sharding._to_xla_hlo_sharding(len(a.shape)) for a in arg_shapes]
  if any(h.is_tiled() and h.num_devices() != mesh.size for h in hlo):
    mesh = jax.sharding.Mesh(np.empty((), object), ())  # jax's empty mesh
  return mesh, shapes, [_decoded(a.sharding, h, mesh, len(a.shape))
                        for a, h in zip(arg_shapes, hlo)]


def _infer(local_prim, layout, params, mesh, arg_shapes, result_shape):
  del local_prim, params, result_shape
  mesh, shapes, shardings = _mesh_and_operands(mesh, arg_shapes)
  return _result_shardings(layout, mesh, _make_plan(layout, mesh, shapes, shardings))


def _partition(local_prim, layout, params, mesh, arg_shapes, result_shape):
  del result_shape
  mesh, shapes, shardings = _mesh_and_operands(mesh, arg_shapes)
  plan = _make_plan(layout, mesh, shapes, shardings)
  specs = _planned_specs(plan, layout.operand_roles)
  _warn_gathers(layout, shapes, shardings, specs)
  arg_shardings = tuple(NamedSharding(mesh, s) for s in specs)
  local_shapes = [s.shard_shape(shape) for s, shape in zip(arg_shardings, shapes)]
  fn = _local_fn(local_prim, layout, dict(params), plan, local_shapes, mesh)
  return mesh, fn, _result_shardings(layout, mesh, plan), arg_shardings


def _shardy_rule(local_prim, layout, params, mesh, operand_types, result_types):
  """The Einsum-like rule Shardy propagates with: one factor per role.

  Query heads are the compound factor (g r) of key/value heads g and the
  group r, so that a sharding of the heads goes to g, splitting query and
  key/value heads together (with one key/value head, h and g are apart).
  Only where g can take every axis of the mesh whole: an axis that g takes
  in part (4 devices over 2 key/value heads) becomes a sub-axis on K, V and
  their gradients, which the plan can only gather (_decoded); without the
  compound the plan still splits K and V where they divide.
  """
  del local_prim, params, result_types
  shapes = [tuple(t.shape) for t in operand_types]
  num_heads, num_kv_heads = layout.size(shapes, "h"), layout.size(shapes, "k")
  group = num_heads // num_kv_heads if num_kv_heads else 1
  # (Shardy allows no factor of size 1 in a compound.)
  compound = group > 1 and num_kv_heads > 1 and num_kv_heads % math.prod(mesh.shape.values()) == 0
  factors = {"b": "b", "s": "s", "t": "t", "d": "d", "k": "g",
             "h": "(g r)" if compound else "h" if group > 1 else "g"}
  fresh = iter(f"x{i}" for i in range(10_000))

  def mapping(roles):
    return " ".join(factors[r] if r else next(fresh) for r in roles)

  rule = (", ".join(map(mapping, layout.operand_roles)) + " -> " +
          ", ".join(map(mapping, layout.result_roles)))
  return rule, ({"r": group} if compound else {})


def _local_call(local_prim, layout, params, *args):
  del layout
  return tuple(local_prim.bind(*args, **dict(params)))


_partitioned_call = custom_partitioning(_local_call, static_argnums=(0, 1, 2))
_partitioned_call.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                                sharding_rule=_shardy_rule, decode_shardings=False)


def sharded_lowering(prim, local_prim, layout_of: Callable[..., Layout]):
  """A lowering rule for `prim`, whose kernel is `local_prim`.

  `layout_of(avals_in, params)` describes the call (see Layout). The
  primitive lowers to the custom-partitioned call of `local_prim`, which on
  one device (or inside shard_map) is `local_prim` itself.
  """
  # The partitioner needs the device assignment while lowering; jax hands it
  # over only for primitives that say so (custom_partitioning's own does,
  # but it is hidden inside this lowering rule). No public API says this.
  dispatch.prim_requires_devices_during_lowering.add(prim)

  def rule(ctx, *args, **params):
    if ctx.module_context.lowering_parameters.for_export:
      # jax.export cannot serialize custom_partitioning (its callbacks are
      # Python): an exported sharded program has no rule, so XLA gathers.
      return mlir.lower_fun(lambda *a: local_prim.bind(*a, **params),
                            multiple_results=True)(ctx, *args)
    layout = layout_of(ctx.avals_in, params)
    static = tuple(sorted(params.items()))
    call = functools.partial(_partitioned_call, local_prim, layout, static)
    return mlir.lower_fun(lambda *a: call(*a), multiple_results=True)(ctx, *args)

  return rule

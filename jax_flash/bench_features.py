"""Feature rows of ``python -m jax_flash.bench --features ...``: the problems users run.

A feature is one attention problem beyond plain attention, measured on each
shape of the run right after the plain rows of that shape, in the same
process. Every implementation that can express the problem is given the same
arrays (the same bias, the same mask); what each one was given is part of its
row (``given``). On a CPU the rows compare jax_flash with xla; on a GPU with
cudnn too.

===========  =====================================================================
feature      the problem (``+ is_causal`` on causal shapes, unless said)
===========  =====================================================================
bias         ALiBi-style bias ``(1, N, S, S)`` in the input dtype
mask         the causal mask as a dense ``(B, 1, S, S)`` boolean with
             ``is_causal=False``, as Flax's ``make_causal_mask`` passes it
             (causal shapes only)
padding      a padding mask ``(B, 1, S, S)``, as Flax's ``make_attention_mask``
             of per-example valid lengths (``padding_lengths``)
lengths      the same padding as ``query_seq_lengths``/``key_value_seq_lengths``
dropout      dropout 0.1: jax_flash only (``jax.nn.dot_product_attention`` has no
             dropout), compared with jax_flash's plain row of the same shape
segments     4 packed sequences: jax_flash gets ``q_segment_ids``/
             ``kv_segment_ids``; xla and cudnn get the equivalent dense mask
             ``(B, 1, S, S)`` (jax.nn has no segment ids)
block-sparse a local + global block pattern (``block_sparse_mask``: each block of
             128 queries sees its own and the neighbouring key blocks and the
             first): jax_flash gets the ``block_mask`` ``(1, 1, S/128, S/128)``,
             xla and cudnn the equivalent dense mask ``(1, 1, S, S)``
===========  =====================================================================

The GPU targets of issues 11 and 15 are checked by ``target_lines`` on the rows.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

DROPOUT_RATE = 0.1
PACKED_SEGMENTS = 4


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _alibi(heads: int, seqlen: int, dtype: str):
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
  pos = jnp.arange(seqlen)
  distance = jnp.abs(pos[:, None] - pos[None, :]).astype(jnp.float32)
  return (-slopes[:, None, None] * distance)[None].astype(dtype)  # one fused kernel


def alibi_bias(case):
  """(1, N, S, S): -slope_h * |i - j|, slopes 2^(-8 h / N), in the input dtype."""
  return _alibi(case.heads, case.seqlen, case.dtype)


def padding_lengths(case) -> np.ndarray:
  """Valid tokens per example: from S - S/(4B) down to 3S/4 (never all of S at B=1)."""
  return np.array([case.seqlen - (b + 1) * case.seqlen // (4 * case.batch)
                   for b in range(case.batch)], np.int32)


def packed_segment_ids(case) -> np.ndarray:
  """(B, S) int32: PACKED_SEGMENTS sequences of equal length, one after the other."""
  ids = np.arange(case.seqlen) * PACKED_SEGMENTS // case.seqlen
  return np.broadcast_to(ids.astype(np.int32), (case.batch, case.seqlen))


def block_sparse_mask(case) -> np.ndarray:
  """(1, 1, R, R), R = ceil(S / 128): cell (i, j) is visible when |i - j| <= 1
  (a local band of blocks) or j == 0 (a global first block), as in BigBird's
  and Longformer's sparse patterns."""
  cells = -(-case.seqlen // jax_flash.BLOCK_MASK_BLOCK)
  i, j = np.arange(cells)[:, None], np.arange(cells)[None, :]
  return ((np.abs(i - j) <= 1) | (j == 0))[None, None]


def dense_of_block_mask(block_mask: np.ndarray, seqlen: int) -> np.ndarray:
  """The dense mask (..., S, S) a block mask stands for."""
  cell = np.arange(seqlen) // jax_flash.BLOCK_MASK_BLOCK
  return np.asarray(block_mask)[..., cell, :][..., cell]


def _valid_mask(lengths: np.ndarray, seqlen: int) -> np.ndarray:
  """(B, 1, S, S): Flax's make_attention_mask(valid, valid) of valid = t < length."""
  valid = np.arange(seqlen)[None, :] < lengths[:, None]
  return valid[:, None, :, None] & valid[:, None, None, :]


@dataclasses.dataclass(frozen=True)
class Feature:
  summary: str  # the problem in words: the title of its block
  operands: Callable  # case -> jax_flash keyword arguments (arrays)
  static: dict = dataclasses.field(default_factory=dict)  # static keyword arguments
  uses_is_causal: bool = True  # False: the causal mask is in the operands
  causal_only: bool = False


FEATURES = {
    "bias": Feature("ALiBi-style bias (1, N, S, S)", lambda c: dict(bias=alibi_bias(c))),
    "mask": Feature(
        "causal as a dense (B, 1, S, S) mask (Flax's make_causal_mask)",
        lambda c: dict(mask=jnp.asarray(np.broadcast_to(
            np.tril(np.ones((c.seqlen, c.seqlen), bool)), (c.batch, 1, c.seqlen, c.seqlen)))),
        uses_is_causal=False, causal_only=True),
    "padding": Feature(
        "padding mask (B, 1, S, S), lengths 3S/4..S (Flax's make_attention_mask)",
        lambda c: dict(mask=jnp.asarray(_valid_mask(padding_lengths(c), c.seqlen)))),
    "lengths": Feature(
        "that padding as query_seq_lengths, key_value_seq_lengths",
        lambda c: dict(query_seq_lengths=jnp.asarray(padding_lengths(c)),
                       key_value_seq_lengths=jnp.asarray(padding_lengths(c)))),
    "dropout": Feature(
        f"dropout {DROPOUT_RATE} (jax.nn has none: see ×plain)",
        lambda c: dict(dropout_rng=jax.random.key(1)), static=dict(dropout_rate=DROPOUT_RATE)),
    "segments": Feature(
        f"{PACKED_SEGMENTS} packed sequences (segment ids)",
        lambda c: dict(q_segment_ids=jnp.asarray(packed_segment_ids(c)),
                       kv_segment_ids=jnp.asarray(packed_segment_ids(c)))),
    "block-sparse": Feature(
        "local + global 128 x 128 blocks (block_mask)",
        lambda c: dict(block_mask=jnp.asarray(block_sparse_mask(c)))),
}
PLAIN = Feature("plain attention (is_causal on causal shapes)", lambda c: {})


LEGEND = (
    "Features: each block is one problem given to every impl that can take it (given: what "
    "each got); TF/s count the plain problem's FLOPs;\n×plain = the same impl's time on the "
    "plain problem of the shape / this row's time; max err over the rows that see a key.")


def applies(name: str, case) -> bool:
  return case.causal or not FEATURES[name].causal_only


def round_ratios(row: dict, base: dict | None, key: str) -> list[float] | None:
  """base's time / row's time on `key` (fwd_ms, fwdbwd_ms or bwd_ms) round by round
  (bench --rounds: the impls of a round run side by side); bwd_ms is f+b less fwd
  within a round. None where either lacks a time of some round or one is not positive."""
  def per_round(r):
    fwd, both = r.get("fwd_ms_rounds"), r.get("fwdbwd_ms_rounds")
    if key != "bwd_ms":
      return r.get(f"{key}_rounds")
    return [b - f for f, b in zip(fwd, both)] if fwd and both and len(fwd) == len(both) else None
  mine, theirs = per_round(row), per_round(base) if base else None
  if not (mine and theirs and len(mine) == len(theirs) and min(mine + theirs) > 0):
    return None
  return [b / m for b, m in zip(theirs, mine)]


def add_plain_ratios(rows: list[dict], plain: list[dict]) -> None:
  """fwd_vs_plain, fwdbwd_vs_plain: the same impl's plain time / the row's time."""
  for row in rows:
    base = next((r for r in plain if r["impl"] == row["impl"]), None)
    for key in ("fwd_ms", "fwdbwd_ms"):
      if base and base[key] and row[key]:
        row[f"{key[:-3]}_vs_plain"] = base[key] / row[key]


def given_lines(rows: list[dict]) -> list[str]:
  """What each impl was given, the impls given the same on one line."""
  given: dict[str, list[str]] = {}
  for r in rows:
    if r.get("given"):
      given.setdefault(r["given"], []).append(r["impl"])
  return [f"  given to {', '.join(impls)}: {text}" for text, impls in given.items()]


def jax_nn_operands(ops: dict, case) -> tuple[dict | None, str]:
  """ops (of `case`) as jax.nn.dot_product_attention arguments, or (None, why it cannot
  take them)."""
  if "dropout_rng" in ops:
    return None, "jax.nn.dot_product_attention has no dropout"
  out, note = {}, ""
  for name, x in ops.items():
    if name == "q_segment_ids":
      q_ids, kv_ids = ops["q_segment_ids"], ops["kv_segment_ids"]
      out["mask"] = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
      note = " (the segments as a dense mask: jax.nn has no segment ids)"
    elif name == "block_mask":
      out["mask"] = jnp.asarray(dense_of_block_mask(x, case.seqlen))
      note = " (the block mask as a dense mask: jax.nn has no block_mask)"
    elif name != "kv_segment_ids":
      out[name] = x
  return out, note


def describe(kwargs: dict, static: dict, causal: bool, note: str = "") -> str:
  """What an implementation was given, e.g. 'bias (1, 8, 64, 64) float32, is_causal'."""
  parts = [f"{name} {tuple(x.shape)} {x.dtype}" if name != "dropout_rng" else "dropout_rng"
           for name, x in kwargs.items()]
  parts += [f"{name}={value}" for name, value in static.items()]
  return ", ".join(parts + (["is_causal"] if causal else [])) + note


def problem(name: str, case, impl: str, ops: dict):
  """(fwd(q, k, v, *extras), extras, given) of `impl` on the feature ("plain" or one
  of FEATURES), or (None, why it cannot take it)."""
  feature = PLAIN if name == "plain" else FEATURES[name]
  causal = case.causal and feature.uses_is_causal
  if impl == "jax_flash":
    kwargs, static, note = ops, feature.static, ""
  else:
    kwargs, note = jax_nn_operands(ops, case)
    if kwargs is None:
      return None, note
    static = {}
  names = tuple(kwargs)

  def fwd(q, k, v, *extras):
    given = dict(zip(names, extras), is_causal=causal, **static)
    if impl == "jax_flash":
      return jax_flash.flash_attention(q, k, v, **given)
    return jax.nn.dot_product_attention(q, k, v, implementation=impl, **given)

  given = None if name == "plain" else describe(kwargs, static, causal, note)
  return (fwd, tuple(kwargs.values()), given), None


def problems(case, impls, name: str):
  """impl -> (fwd(q, k, v, *extras), extras, given) for the impls that can take the
  feature; the float64 reference's bias and mask (None: no reference); and
  impl -> why, for those that cannot."""
  ops = (PLAIN if name == "plain" else FEATURES[name]).operands(case)
  found, skipped = {}, {}
  for impl in impls:
    found[impl], why = problem(name, case, impl, ops)
    if found[impl] is None:
      del found[impl]
      skipped[impl] = why
  return found, reference_operands(case, ops), skipped


def reference_operands(case, ops: dict) -> dict | None:
  """numpy bias and mask (B|1, N|1, S, S) for the float64 reference, or None for
  no reference (dropout: its mask is drawn inside the kernel)."""
  if "dropout_rng" in ops:
    return None
  kwargs, _ = jax_nn_operands(ops, case)  # segments and block mask as a dense mask
  ref = {}
  if "bias" in kwargs:
    ref["bias"] = np.asarray(kwargs["bias"]).astype(np.float64)
  if "mask" in kwargs:
    ref["mask"] = np.asarray(kwargs["mask"])
  if "query_seq_lengths" in kwargs:
    ref["mask"] = _valid_mask(np.asarray(kwargs["query_seq_lengths"]), case.seqlen)
  return ref


# -- targets (issue 11; GPU, bf16, S from 1k to 16k) ---------------------------

TARGET_DTYPE = "bfloat16"
TARGET_SEQLENS = (1024, 16384)  # inclusive range
FEATURE_TARGET_HEAD_DIMS = (64, 128, 256)
VS_CUDNN_TARGET = 0.8  # the VS_CUDNN_FEATURES; and D=96/192/256 plain, fwd and bwd
VS_CUDNN_FEATURES = ("bias", "mask", "padding", "segments", "block-sparse")
HEAD_DIM_TARGET_HEAD_DIMS = (96, 192, 256)
DROPOUT_TIME_TARGET = 1.15  # at most this times the time of the same call without dropout

# -- targets (issue 15, the FA3-class pipeline; GPU, bf16, plain rows) -----------

PIPELINE_HEAD_DIMS = (64, 128, 256)
PIPELINE_VS_CUDNN_TARGET = 1.05  # fwd and bwd, from S = PIPELINE_TARGET_FROM_SEQLEN
PIPELINE_TARGET_FROM_SEQLEN = 2048
PIPELINE_VS_CUDNN_FLOOR = 0.95  # fwd and bwd, every S of the range (1k included)
PIPELINE_FWD_TFLOPS_TARGET = 650  # D=128 non-causal forward at PIPELINE_TFLOPS_SEQLEN, on an H100
PIPELINE_TFLOPS_SEQLEN = 16384


def _in_scope(row, head_dims) -> bool:
  return (row["dtype"] == TARGET_DTYPE and row["head_dim"] in head_dims and
          TARGET_SEQLENS[0] <= row["seqlen"] <= TARGET_SEQLENS[1])


def _shape_key(row) -> tuple:
  return tuple(row[k] for k in ("batch", "heads", "seqlen", "head_dim", "dtype", "causal"))


def _part(what: str, row: dict, base: dict | None, key: str, *, speed: bool,
          ok: Callable[[float], bool], against: str) -> str | None:
  """One measurement of a verdict line: `row` (jax_flash) against `base` on `key`.

  speed: base time / row time (higher is better), else row time / base time.
  Measured in rounds (bench --rounds), a speed is the median of the rounds'
  ratios (the impls of a round run side by side), their range given. None
  where base has no time (nothing to compare with) or a time is not positive
  (a backward below the timing noise); MISS where only jax_flash has none (it
  failed or was not run).
  """
  if not base or base.get(key) is None:
    return None
  if row.get(key) is None:
    return f"{what} MISS (jax_flash: {row['status']})"
  if base[key] <= 0 or row[key] <= 0:
    return None
  value = base[key] / row[key] if speed else row[key] / base[key]
  spread = ""
  by_round = round_ratios(row, base, key) if speed else None
  if by_round and len(by_round) > 1:
    value = statistics.median(by_round)
    spread = f" ({min(by_round):.2f}-{max(by_round):.2f} by round)"
  return f"{what} {_figure(value, ok)}×{spread} {against} {'ok' if ok(value) else 'MISS'}"


def _figure(value: float, ok: Callable[[float], bool], decimals: int = 2) -> str:
  """value to `decimals` decimals, or to as many more as it takes for the printed figure to
  get the verdict printed beside it: 1.0499 against a 1.05 target reads 1.0499, not 1.05."""
  for digits in range(decimals, decimals + 5):
    text = f"{value:.{digits}f}"
    if ok(float(text)) == ok(value):
      return text
  return repr(value)


def _line(head: str, parts, target: str) -> list[str]:
  parts = [p for p in parts if p]
  return [f"{head}: " + ", ".join(parts) + f" ({target})"] if parts else []


def target_lines(rows: list[dict], label: Callable[[dict], str]) -> list[str]:
  """Verdict lines of the GPU targets, only for rows in their scope.

  Issue 11: bias, mask, padding, segments: jax_flash fwd and fwd+bwd >= 0.8x
  cudnn on the same problem; dropout: at most 1.15x the time of jax_flash
  without dropout; segments, causal: faster than the fastest plain causal row
  of the shape; plain D=96/192/256: fwd and bwd >= 0.8x cudnn.
  Issue 15, plain D=64/128/256: fwd and bwd >= 1.05x cudnn from S=2k, >= 0.95x
  at every S; the D=128 non-causal forward at S=16k >= 650 TF/s (an H100's).
  """
  index = {(_shape_key(r), r.get("feature", "plain"), r["impl"]): r for r in rows}
  lines = []
  for r in rows:
    feature = r.get("feature", "plain")
    if r["impl"] != "jax_flash":
      continue
    shape = _shape_key(r)
    head = f"  {feature} {label(r)}"
    cudnn = index.get((shape, feature, "cudnn"))
    at_least = dict(speed=True, ok=lambda x: x >= VS_CUDNN_TARGET, against="cudnn")
    if feature == "plain" and _in_scope(r, HEAD_DIM_TARGET_HEAD_DIMS):
      lines += _line(head, [_part("fwd", r, cudnn, "fwd_ms", **at_least),
                            _part("bwd", r, cudnn, "bwd_ms", **at_least)],
                     f"target ≥ {VS_CUDNN_TARGET}× cudnn")
    if feature == "plain" and _in_scope(r, PIPELINE_HEAD_DIMS):
      lines += _pipeline_lines(head, r, cudnn)
    if not _in_scope(r, FEATURE_TARGET_HEAD_DIMS):
      continue
    if feature in VS_CUDNN_FEATURES:
      lines += _line(head, [_part("fwd", r, cudnn, "fwd_ms", **at_least),
                            _part("fwd+bwd", r, cudnn, "fwdbwd_ms", **at_least)],
                     f"target ≥ {VS_CUDNN_TARGET}× cudnn given the same problem")
    if feature == "dropout":
      plain = index.get((shape, "plain", "jax_flash"))
      at_most = dict(speed=False, ok=lambda x: x <= DROPOUT_TIME_TARGET,
                     against="the time without dropout")
      lines += _line(head, [_part("fwd", r, plain, "fwd_ms", **at_most),
                            _part("fwd+bwd", r, plain, "fwdbwd_ms", **at_most)],
                     f"target ≤ {DROPOUT_TIME_TARGET}×")
    if feature == "segments" and r["causal"]:
      plains = [p for (s, f, _), p in index.items() if s == shape and f == "plain"]
      parts = []
      for what, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
        timed = [p for p in plains if p.get(key)]
        fastest = min(timed, key=lambda p: p[key]) if timed else None
        parts.append(_part(what, r, fastest, key, speed=False, ok=lambda x: x < 1.0,
                           against=f"the time of plain causal ({fastest['impl']})"
                           if fastest else ""))
      lines += _line(head, parts, f"target < 1×: {PACKED_SEGMENTS} packed sequences faster "
                     "than plain causal, the fastest measured")
  return lines


def _pipeline_lines(head: str, row: dict, cudnn: dict | None) -> list[str]:
  """Issue 15's verdicts on one plain jax_flash row in its scope."""
  if row["seqlen"] >= PIPELINE_TARGET_FROM_SEQLEN:
    target = PIPELINE_VS_CUDNN_TARGET
    text = f"target ≥ {target}× cudnn from S={PIPELINE_TARGET_FROM_SEQLEN}"
  else:
    target = PIPELINE_VS_CUDNN_FLOOR
    text = f"target ≥ {target}× cudnn at every S"
  at_least = dict(speed=True, ok=lambda x: x >= target, against="cudnn")
  lines = _line(head, [_part("fwd", row, cudnn, "fwd_ms", **at_least),
                       _part("bwd", row, cudnn, "bwd_ms", **at_least)], text)
  tflops = row.get("fwd_tflops")
  if (row["head_dim"] == 128 and not row["causal"] and
      row["seqlen"] == PIPELINE_TFLOPS_SEQLEN and tflops is not None):
    def reaches(tf: float) -> bool:
      return tf >= PIPELINE_FWD_TFLOPS_TARGET
    lines.append(f"{head}: fwd {_figure(tflops, reaches, 0)} TF/s "
                 f"{'ok' if reaches(tflops) else 'MISS'} "
                 f"(target ≥ {PIPELINE_FWD_TFLOPS_TARGET} TF/s on an H100)")
  return lines

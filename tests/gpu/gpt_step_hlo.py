"""The GPT example's training step as XLA optimizes it, one attention beside another.

jax_flash's and cuDNN's attention kernels are timed apart by the bench; in the
GPT-3-small step they were level (thirtieth session), though jax_flash's
kernels are faster alone. What else differs is what XLA builds around each
custom call: copies and transposes of q, k, v or their gradients, fusions
split by the call, scratch. This compiles the example's train step
(`jax_flash.examples.gpt`, the same model, optimizer and data) for each
attention and prints, side by side:

* the entry computation's instructions by opcode (fusions by kind,
  custom calls by target) and the bytes their results take, so that an extra
  copy or transpose per layer shows as a count that differs by the layer count;
* for each attention custom call, the opcodes that produce its operands and
  that use its results (through get-tuple-element);
* XLA's cost analysis (flops, bytes accessed) and memory plan (temporaries).

  python tests/gpu/gpt_step_hlo.py --preset gpt3-small               # jax_flash, cudnn (a GPU)
  python tests/gpu/gpt_step_hlo.py --preset tiny --attentions jax_flash flax --dump /tmp/hlo

--dump DIR writes each optimized module as DIR/<attention>.hlo.txt. Nothing
runs but the compiler; on a CPU only jax_flash and flax compile (cuDNN needs
a GPU).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import re
import sys

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Custom-call targets of attention: jax_flash's and cuDNN's fused attention.
ATTENTION_TARGET = re.compile(r"jax_flash|cudnn.*(fmha|attention)|__cudnn\$fmha", re.I)


@dataclasses.dataclass
class Instruction:
  name: str
  type: str      # the result type, e.g. bf16[8,2048,12,64]{3,2,1,0} or a tuple of them
  opcode: str    # 'fusion(kLoop)' and 'custom-call(target)' carry their kind / target
  operands: list[str]


def _closing(text: str, start: int) -> int:
  """Index just past the parenthesis that closes the one at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced parentheses in {text[:80]!r}")


def parse_instruction(line: str) -> Instruction | None:
  """One HLO text line `[ROOT] %name = type opcode(operands), attrs` (None: not one)."""
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
  if not m:
    return None
  rest = line[m.end():]
  end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
  type_, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  args_end = _closing(rest, op.end() - 1)
  operands = re.findall(r"%([\w.\-]+)", rest[op.end():args_end - 1])
  attrs = rest[args_end:]
  opcode = op.group(1)
  if opcode == "fusion":
    kind = re.search(r"kind=(\w+)", attrs)
    opcode += f"({kind.group(1) if kind else '?'})"
  elif opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', attrs)
    opcode += f"({target.group(1) if target else '?'})"
  return Instruction(m.group(1), type_, opcode, operands)


def entry_instructions(hlo: str) -> list[Instruction]:
  """The instructions of the module's ENTRY computation, in order."""
  lines = hlo.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
  out = []
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    inst = parse_instruction(line)
    if inst:
      out.append(inst)
  return out


def type_bytes(type_: str) -> int:
  """Bytes of a result type, tuples summed (layouts and tuple nesting ignored)."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", type_):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES.get(dtype, 0)
  return total


def summarize(hlo: str) -> dict:
  """Opcode counts and bytes, and each attention call's neighbours, of one module."""
  insts = entry_instructions(hlo)
  by_name = {i.name: i for i in insts}
  users = collections.defaultdict(list)
  for i in insts:
    for o in i.operands:
      users[o].append(i)
  counts, nbytes = collections.Counter(), collections.Counter()
  for i in insts:
    counts[i.opcode] += 1
    nbytes[i.opcode] += type_bytes(i.type)

  def consumers(name):  # through get-tuple-element and bitcasts, one level each
    out = []
    for u in users[name]:
      if u.opcode in ("get-tuple-element", "bitcast"):
        out += [f"{u.opcode}->{v.opcode}" for v in users[u.name]] or [u.opcode]
      else:
        out.append(u.opcode)
    return out

  neighbours = collections.Counter()
  for i in insts:
    if i.opcode.startswith("custom-call") and ATTENTION_TARGET.search(i.opcode):
      for o in i.operands:
        producer = by_name.get(o)
        if producer and producer.opcode != "constant":
          neighbours[f"{i.opcode} <- {producer.opcode}"] += 1
      for c in consumers(i.name):
        neighbours[f"{i.opcode} -> {c}"] += 1
  return dict(counts=counts, bytes=nbytes, neighbours=neighbours, instructions=len(insts))


def compile_step(preset: str, attention: str, dropout: float, layers: int | None):
  """The example's train step for `attention`, compiled: (optimized HLO text, compiled)."""
  import jax
  from jax_flash.examples import gpt

  settings = dict(gpt.PRESETS[preset])
  if layers:
    settings["layers"] = layers
  config = gpt.Config(**settings, attention=attention, dropout=dropout)
  reasons = gpt.why_not(config)
  if reasons:
    raise SystemExit(f"{attention}: " + "; ".join(reasons))
  model = gpt.GPT(config)
  inputs, targets = next(gpt.batches(gpt.load_tokens(config.seq_len + 1), config))
  rng = jax.random.key(config.seed)
  params = model.init(rng, inputs)
  optimizer = gpt.make_optimizer(config)
  opt_state = optimizer.init(params)
  compiled = gpt.make_train_step(model, optimizer).lower(
      params, opt_state, inputs, targets, rng).compile()
  return compiled.as_text(), compiled


def _costs(compiled) -> dict:
  out = {}
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["flops"] = cost.get("flops", 0.0)
    out["bytes accessed"] = cost.get("bytes accessed", 0.0)
  except Exception:  # not every backend has it
    pass
  try:
    out["temp bytes"] = compiled.memory_analysis().temp_size_in_bytes
  except Exception:
    pass
  return out


def table(summaries: dict[str, dict], key: str, title: str, only_differing: bool) -> list[str]:
  names = list(summaries)
  rows = sorted(set().union(*(s[key] for s in summaries.values())))
  width = max([len(r) for r in rows] + [20])
  lines = [title, "  " + " " * width + "".join(f"{n:>16s}" for n in names)]
  for r in rows:
    values = [summaries[n][key].get(r, 0) for n in names]
    if only_differing and len(set(values)) == 1:
      continue
    lines.append(f"  {r:{width}s}" + "".join(f"{v:>16,}" for v in values))
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="gpt3-small", help="jax_flash.examples.gpt's preset")
  p.add_argument("--attentions", nargs="+", default=["jax_flash", "cudnn"])
  p.add_argument("--dropout", type=float, default=0.0)
  p.add_argument("--layers", type=int, help="override the preset's layer count")
  p.add_argument("--all", action="store_true", help="every opcode, not only those that differ")
  p.add_argument("--dump", type=pathlib.Path, help="write DIR/<attention>.hlo.txt")
  args = p.parse_args(argv)
  summaries, costs = {}, {}
  for attention in args.attentions:
    hlo, compiled = compile_step(args.preset, attention, args.dropout, args.layers)
    if args.dump:
      args.dump.mkdir(parents=True, exist_ok=True)
      (args.dump / f"{attention}.hlo.txt").write_text(hlo)
    summaries[attention] = summarize(hlo)
    costs[attention] = _costs(compiled)
  print(f"GPT train step, preset {args.preset}"
        + (f", {args.layers} layers" if args.layers else "")
        + f", dropout {args.dropout}: the entry computation's instructions")
  print("  " + ", ".join(f"{n} {s['instructions']}" for n, s in summaries.items()))
  for line in (table(summaries, "counts", "count by opcode", not args.all)
               + table(summaries, "bytes", "result bytes by opcode", not args.all)
               + table(summaries, "neighbours", "around the attention calls", False)):
    print(line)
  print("XLA's estimates")
  for n, c in costs.items():
    print(f"  {n}: " + ", ".join(f"{k} {v:,.0f}" for k, v in c.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())

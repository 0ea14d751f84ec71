"""Where a kernel's warps stall, from an Nsight Compute source export.

    ncu --section SourceCounters --section WarpStateStats --import-source yes \
        -k KERNEL --launch-count 1 -o x ./driver ...
    ncu -i x.ncu-rep --page source --csv --print-source sass > x.csv
    python3 tests/gpu/ncu_stalls.py x.csv [--top N] [--class COUNT] [--mix]

Prints the stall reasons over all samples, then the samples grouped by how
many times each instruction ran (warp-level "Instructions Executed"): in a
tiled kernel that count tells the code's place, e.g. once per key block of a
tile, once per tile, once per tile with a masked block (tiles x blocks x
warps, tiles x warps, ...), so the groups split the time between the main
loop and the per-tile costs without reading the SASS. --class COUNT lists
one group's opcode mix, its contiguous address ranges and its hottest
instructions. --mix lists the whole kernel's executed instructions by opcode
(warp-level, each instruction's count summed), to set one kernel's mix
beside another's (ours and cuDNN's on the same problem: which opcodes ours
executes more of per FLOP).
"""
import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path):
  rows = list(csv.reader(open(path)))
  header = rows[1]  # rows[0] names the kernel
  col = {h: i for i, h in enumerate(header)}
  data = [r for r in rows[2:] if len(r) >= len(header)]
  reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  return data, col, reasons


def count(r, col, name):
  return int(r[col[name]] or 0)


def opcode(source):
  words = source.strip().split()
  op = words[1] if words[0].startswith("@") else words[0]
  return op.split(".")[0]


def opcode_mix(data, col):
  """Executed warp-level instructions per opcode over the whole kernel."""
  mix = collections.Counter()
  for r in data:
    if r[1].strip():
      mix[opcode(r[1])] += count(r, col, EXECUTED)
  return mix


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv")
  parser.add_argument("--top", type=int, default=12, help="groups (or instructions) to list")
  parser.add_argument("--class", dest="cls", type=int, help="an execution count to detail")
  parser.add_argument("--mix", action="store_true", help="the kernel's executed opcode mix")
  args = parser.parse_args(argv)
  data, col, reasons = load(args.csv)
  if args.mix:
    mix = opcode_mix(data, col)
    executed = sum(mix.values()) or 1
    print(f"{executed} warp instructions executed; by opcode:")
    for op, n in mix.most_common(args.top):
      print(f"  {op:10s} {n:14d} {100 * n / executed:5.1f}%")
    return
  total = sum(count(r, col, SAMPLES) for r in data) or 1
  pct = lambda n: f"{100 * n / total:5.1f}%"

  by_reason = collections.Counter()
  for r in data:
    for h in reasons:
      by_reason[h] += count(r, col, h)
  print(f"{total} samples; by reason:")
  for h, n in by_reason.most_common(args.top):
    print(f"  {h[6:]:20s} {pct(n)}")

  if args.cls is None:
    samples, instrs = collections.Counter(), collections.Counter()
    for r in data:
      samples[count(r, col, EXECUTED)] += count(r, col, SAMPLES)
      instrs[count(r, col, EXECUTED)] += 1
    print("by execution count (the instruction ran this many times, warp-level):")
    for executed, n in samples.most_common(args.top):
      print(f"  {executed:10d}  {instrs[executed]:5d} instructions  {pct(n)}")
    return

  group = [r for r in data if count(r, col, EXECUTED) == args.cls]
  ops, ops_samples = collections.Counter(), collections.Counter()
  for r in group:
    ops[opcode(r[1])] += 1
    ops_samples[opcode(r[1])] += count(r, col, SAMPLES)
  print(f"execution count {args.cls}: {len(group)} instructions, "
        f"{pct(sum(ops_samples.values()))} of the samples; opcodes by samples:")
  for op, n in ops_samples.most_common(args.top):
    print(f"  {op:10s} {ops[op]:5d} instructions {pct(n)}")
  print("address ranges (instructions that never ran do not break a range):")
  ranges, current = [], None
  for r in data:
    executed = count(r, col, EXECUTED)
    if executed == args.cls:
      if current is None:
        current = [r[0], r[0], 0, 0]
      current[1] = r[0]
      current[2] += 1
      current[3] += count(r, col, SAMPLES)
    elif executed and current is not None:
      ranges.append(current)
      current = None
  if current is not None:
    ranges.append(current)
  for first, last, n, s in sorted(ranges, key=lambda x: -x[3])[:args.top]:
    print(f"  {first}..{last}  {n:5d} instructions {pct(s)}")
  print("hottest instructions:")
  for r in sorted(group, key=lambda r: -count(r, col, SAMPLES))[:args.top]:
    main_reason = max(reasons, key=lambda h: count(r, col, h))[6:]
    print(f"  {r[0]} {pct(count(r, col, SAMPLES))} {main_reason:14s} {r[1].strip()[:80]}")


if __name__ == "__main__":
  main()

"""Compares two SASS snapshots (tests/gpu/sass_snapshot.sh) kernel by kernel.

A kernel's code is its instruction stream from cuobjdump -sass, instruction
text and encoding (the encoding carries the scheduling control bits), with
symbol names replaced by a placeholder: a kernel moved to another file or
namespace, or renamed, compares equal when its machine code is. Kernels are
matched per architecture as multisets of code, so renames need no table;
the kernels left over on either side are paired by their demangled names
(after --rename substitutions) and printed with instruction counts,
registers and spills from ptxas -v.

  python tests/gpu/sass_compare.py BASE NEW [--rename OLD=NEW ...] [--list]

Exit status 0 when every kernel is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import pathlib
import re
import subprocess
import sys

_SYMBOL = re.compile(r"_Z\w+")
_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_ENCODING_TAIL = re.compile(r"^\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


class Kernel:
  def __init__(self, unit: str, arch: str, mangled: str, lines: list[str]):
    self.unit, self.arch, self.mangled = unit, arch, mangled
    self.lines = lines
    self.digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    self.instructions = sum(1 for line in lines if not line.startswith("+"))
    self.name = mangled
    self.regs = self.stack = self.spill_stores = self.spill_loads = None


def _split(path: pathlib.Path, unit: str, arch: str) -> list[Kernel]:
  kernels, name, lines = [], None, []
  for raw in path.read_text().splitlines():
    m = _FUNCTION.match(raw)
    if m:
      if name is not None:
        kernels.append(Kernel(unit, arch, name, lines))
      name, lines = m.group(1), []
      continue
    if name is None:
      continue
    m = _INSTR.match(raw)
    if m:
      lines.append(f"{_SYMBOL.sub('SYM', m.group(1))} {m.group(2)}")
      continue
    m = _ENCODING_TAIL.match(raw)
    if m and lines:
      lines.append(f"+{m.group(1)}")
  if name is not None:
    kernels.append(Kernel(unit, arch, name, lines))
  return kernels


def _ptxas(path: pathlib.Path) -> dict[str, dict[str, int]]:
  info: dict[str, dict[str, int]] = collections.defaultdict(dict)
  current = None
  for line in path.read_text().splitlines() if path.exists() else []:
    if m := _PTXAS_ENTRY.search(line):
      current = m.group(1)
    elif m := _PTXAS_FUNC.search(line):
      current = m.group(1)
    elif (m := _PTXAS_SPILL.search(line)) and current:
      info[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
    elif (m := _PTXAS_REGS.search(line)) and current:
      info[current]["regs"] = int(m.group(1))
  return info


def _demangle(names: list[str]) -> dict[str, str]:
  if not names:
    return {}
  out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                       check=True).stdout.splitlines()
  return dict(zip(names, out))


def load(snapshot: pathlib.Path) -> list[Kernel]:
  kernels = []
  for sass in sorted((snapshot / "sass").glob("*.sass")):
    unit, arch = sass.name[: -len(".sass")].rsplit(".", 1)
    ptxas = _ptxas(snapshot / "ptxas" / f"{unit}.{arch}.log")
    for k in _split(sass, unit, arch):
      for key, value in ptxas.get(k.mangled, {}).items():
        setattr(k, key, value)
      kernels.append(k)
  names = _demangle(sorted({k.mangled for k in kernels}))
  for k in kernels:
    k.name = names.get(k.mangled, k.mangled)
  return kernels


def _short(name: str) -> str:
  name = re.sub(r"\bjax_flash::cuda::", "", name)
  name = re.sub(r"\(anonymous namespace\)::", "", name)
  return re.sub(r"\(.*\)$", "", name)


def _describe(k: Kernel) -> str:
  spill = f"{k.spill_stores}/{k.spill_loads}" if k.spill_stores is not None else "?"
  return f"{k.instructions} instr, {k.regs} regs, spill st/ld {spill} B"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("base", type=pathlib.Path)
  parser.add_argument("new", type=pathlib.Path)
  parser.add_argument("--rename", action="append", default=[],
                      help="OLD=NEW regex substitution on base kernel names, for pairing")
  parser.add_argument("--list", action="store_true", help="print every kernel")
  parser.add_argument("--subset", action="store_true",
                      help="NEW holds only some units: check that each of its kernels is in BASE")
  args = parser.parse_args()
  base, new = load(args.base), load(args.new)
  renames = [tuple(r.split("=", 1)) for r in args.rename]

  def key(k: Kernel, renamed: bool) -> str:
    name = _short(k.name)
    if renamed:
      for old, replacement in renames:
        name = re.sub(old, replacement, name)
    return f"{k.arch} {name}"

  status = 0
  for arch in sorted({k.arch for k in base} | {k.arch for k in new}):
    b = [k for k in base if k.arch == arch]
    n = [k for k in new if k.arch == arch]
    left = collections.Counter(k.digest for k in b)
    right = collections.Counter(k.digest for k in n)
    same = left & right
    print(f"sm_{arch}: {sum(same.values())} of {len(b)} base kernels identical in the new build "
          f"({len(n)} kernels there)")
    if args.list:
      for k in sorted(b, key=lambda k: (k.unit, k.name)):
        print(f"  {k.digest} {k.unit}: {_short(k.name)} [{_describe(k)}]")
    pool = collections.Counter(same)
    only_base, only_new = [], []
    for k in b:
      if pool[k.digest] > 0:
        pool[k.digest] -= 1
      else:
        only_base.append(k)
    pool = collections.Counter(same)
    for k in n:
      if pool[k.digest] > 0:
        pool[k.digest] -= 1
      else:
        only_new.append(k)
    if args.subset:  # only what NEW has counts
      new_names = {key(k, False) for k in n}
      only_base = [k for k in only_base if key(k, True) in new_names]
    if not only_base and not only_new:
      continue
    status = 1
    by_name = collections.defaultdict(list)
    for k in only_new:
      by_name[key(k, False)].append(k)
    for k in sorted(only_base, key=lambda k: k.name):
      partners = by_name.get(key(k, True))
      if partners:
        other = partners.pop(0)
        print(f"  CHANGED {k.unit} -> {other.unit}: {_short(k.name)}\n"
              f"      base {_describe(k)}\n       new {_describe(other)}")
      else:
        print(f"  ONLY IN BASE {k.unit}: {_short(k.name)} [{_describe(k)}]")
    for rest in by_name.values():
      for k in rest:
        print(f"  ONLY IN NEW {k.unit}: {_short(k.name)} [{_describe(k)}]")
  return status


if __name__ == "__main__":
  sys.exit(main())

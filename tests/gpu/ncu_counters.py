"""Sums ncu's counters per implementation from `profile_calls.py`'s profile.

  python tests/gpu/ncu_counters.py ncu.csv

ncu.csv is `ncu --csv --metrics ...` of tests/gpu/profile_calls.py (its header
has the command). Kernels are grouped by name: jax_flash's (its
namespaces, OURS), cuDNN's (names with cudnn or sdpa), and the rest
(input generation, XLA's fusions), listed one by one so that a conversion
around a call can be given to its side by hand. For each group and metric the
sum over the group's kernels, and the ratio of cuDNN's to ours; with
gpu__time_duration.sum among the metrics, each kernel's time too (where a
side's time goes: the backward's preprocess and dQ conversion against its
main kernel, say; under ncu's locked clocks, so as shares, not as times).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


# jax_flash's namespaces as ncu prints them: it drops outer namespaces of some
# names (jax_flash::cuda::sm90::FwdWsKernel came out as sm90::FwdWsKernel in
# one profile and jax_flash::FwdWsKernel in another).
OURS = re.compile(r"(^|[\s<(,])(jax_flash|cuda|sm90|sm80|simt)::")
DURATION = "gpu__time_duration.sum"


def group_of(name: str) -> str:
  if "cudnn" in name.lower() or "sdpa" in name.lower():
    return "cudnn"
  if OURS.search(name):
    return "jax_flash"
  return "other"


def read(path: str):
  """{(id, kernel name): {metric: value}} from ncu's --csv details page."""
  with open(path, newline="") as f:
    lines = [line for line in f if line.startswith('"')]  # drop ncu's own log lines
  kernels: dict[tuple[str, str], dict[str, float]] = collections.OrderedDict()
  for row in csv.DictReader(lines):
    try:
      value = float(row["Metric Value"].replace(",", ""))
    except ValueError:
      continue
    kernels.setdefault((row["ID"], row["Kernel Name"]), {})[row["Metric Name"]] = value
  return kernels


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv")
  args = parser.parse_args(argv)
  kernels = read(args.csv)
  if not kernels:
    sys.exit(f"{args.csv}: no metric rows (was it written with ncu --csv?)")
  totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for (kid, name), metrics in kernels.items():
    group = group_of(name)
    totals[group].update(metrics)
    if group == "other":
      print(f"other: kernel {kid} {name[:100]}")
  metrics = sorted({m for values in kernels.values() for m in values})
  print(f"{'metric':<52} {'jax_flash':>14} {'cudnn':>14} {'cudnn/ours':>10}")
  for metric in metrics:
    ours, theirs = totals["jax_flash"][metric], totals["cudnn"][metric]
    ratio = f"{theirs / ours:10.3f}" if ours else f"{'-':>10}"
    print(f"{metric:<52} {ours:14.4g} {theirs:14.4g} {ratio}")
  if DURATION in metrics:
    print(f"\n{DURATION} per kernel (share of its side):")
    for (kid, name), values in kernels.items():
      group = group_of(name)
      if group != "other" and DURATION in values:
        share = values[DURATION] / totals[group][DURATION]
        print(f"  {group:<9} {values[DURATION]:12.4g} {share:6.1%}  {kid} {name[:90]}")


if __name__ == "__main__":
  main()

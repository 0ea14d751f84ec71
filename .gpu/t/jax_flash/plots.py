"""Figures of ``python -m jax_flash.bench`` results, in the FlashAttention papers' style.

``plot(rows, path)`` draws, for each (feature, head dim, causal, dtype)
measured (feature: "plain", or a problem of ``--features``), one row of
panels: forward TFLOP/s, forward+backward TFLOP/s (grouped bars: sequence
length on x, one bar per implementation) and peak memory against
sequence length (measured with ``--memory``, else XLA's plan). ``rows`` are
the bench's row dicts (``main(argv)`` returns them; ``--json PATH`` writes
``{"meta": ..., "rows": [...]}``, which is accepted too).

From the command line::

    python -m jax_flash.bench --preset quick --json bench.json
    python -m jax_flash.plots bench.json bench.png

matplotlib is imported only when drawing (the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys

MiB = 1 << 20
# Panels: (title, key of the row, y label). TFLOP/s follow the papers'
# convention, computed by the bench (causal counts half the FLOPs).
SPEED_PANELS = (("forward", "fwd_tflops", "TFLOP/s"),
                ("forward + backward", "fwdbwd_tflops", "TFLOP/s"))
# Fixed colours so one implementation looks the same in every panel and figure.
COLOURS = {"jax_flash": "tab:blue", "xla": "tab:orange", "cudnn": "tab:green"}


def _rows_of(rows_or_json) -> list[dict]:
  if isinstance(rows_or_json, dict):  # the --json file: {"meta": ..., "rows": [...]}
    rows_or_json = rows_or_json.get("rows", [])
  rows = list(rows_or_json)
  for i, r in enumerate(rows):
    missing = [k for k in ("impl", "seqlen", "head_dim", "causal") if k not in r]
    if missing:
      raise ValueError(f"rows[{i}] lacks {missing}: expected jax_flash.bench rows, got "
                       f"keys {sorted(r)}")
  return rows


def peak_memory(row: dict) -> float | None:
  """The best memory number a row has: the peak --memory measured, else XLA's plan."""
  for value in (row.get("runtime_peak"), row.get("memory")):
    if value:
      return float(value)
  return None


def require_matplotlib() -> None:
  """Raises ImportError, saying how to install it, where matplotlib is missing."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise ImportError('jax_flash.plots needs matplotlib: pip install matplotlib (or, in the '
                      'jax_flash checkout, pip install ".[plots]")') from None


def _feature(row) -> str:
  return row.get("feature") or "plain"  # rows written before --features have none


def _groups(rows):
  """(feature, head_dim, causal, dtype) -> rows: plain first, then the features in
  the order they were measured."""
  features = ["plain"] + [f for f in dict.fromkeys(map(_feature, rows)) if f != "plain"]
  groups: dict[tuple, list[dict]] = {}
  for r in sorted(rows, key=lambda r: (features.index(_feature(r)), r["head_dim"], r["causal"],
                                       str(r.get("dtype")))):
    groups.setdefault((_feature(r), r["head_dim"], r["causal"], r.get("dtype")), []).append(r)
  return groups


def _impls(rows) -> list[str]:
  seen = []
  for r in rows:
    if r["impl"] not in seen:
      seen.append(r["impl"])
  return seen


def _bars(ax, rows, key, impls, label):
  """Grouped bars: one group per sequence length, one bar per implementation."""
  # Only lengths and implementations with a number in this panel: rows that
  # failed or were not run leave no empty slots.
  rows = [r for r in rows if r.get(key)]
  impls = [i for i in impls if any(r["impl"] == i for r in rows)]
  seqlens = sorted({r["seqlen"] for r in rows})
  width = 0.8 / max(1, len(impls))
  drawn = False
  for j, impl in enumerate(impls):
    by_len = {r["seqlen"]: r.get(key) for r in rows if r["impl"] == impl}
    xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(seqlens))]
    values = [by_len.get(s) or 0.0 for s in seqlens]  # missing/failed: an empty slot
    bars = ax.bar(xs, values, width, label=impl, color=COLOURS.get(impl, f"C{j}"))
    for bar, value in zip(bars, values):
      if value:
        drawn = True
        ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value),
                    ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(seqlens)), [_length(s) for s in seqlens])
  ax.set_xlabel("sequence length")
  ax.set_ylabel(label)
  if rows:  # Headroom above the tallest bar for its label and the legend.
    ax.set_ylim(0, 1.3 * max(r[key] for r in rows))
  if not drawn:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _memory(ax, rows, impls):
  drawn, lengths = False, set()
  for j, impl in enumerate(impls):
    points = sorted((r["seqlen"], peak_memory(r)) for r in rows if r["impl"] == impl)
    points = [(s, m / MiB) for s, m in points if m]
    if points:
      drawn = True
      lengths.update(s for s, _ in points)
      ax.plot(*zip(*points), marker="o", label=impl, color=COLOURS.get(impl, f"C{j}"))
  ax.set_xscale("log", base=2)
  ax.set_xticks(sorted(lengths), [_length(s) for s in sorted(lengths)])
  ax.minorticks_off()
  ax.set_xlabel("sequence length")
  ax.set_ylabel("peak MiB (measured, else XLA plan)")
  if drawn:
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    ax.set_yscale("log")
    # Plain numbers (0.5, 3, 1000), not 3x10^0, on the log axis.
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
  else:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _length(n: int) -> str:
  return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(rows, path: str, *, title: str | None = None):
  """Draws the bench rows to ``path`` (any format matplotlib writes: .png, .pdf, .svg).

  Returns the matplotlib Figure.
  """
  require_matplotlib()
  from matplotlib.figure import Figure  # No pyplot: no GUI backend, no global state.
  rows = _rows_of(rows)
  if not rows:
    raise ValueError("no rows to plot")
  groups = _groups(rows)
  impls = _impls(rows)
  fig = Figure(figsize=(15, 3.6 * len(groups)), layout="constrained")
  axes = fig.subplots(len(groups), 3, squeeze=False)
  for (feature, head_dim, causal, dtype), ax_row in zip(groups, axes):
    group = groups[(feature, head_dim, causal, dtype)]
    name = ("" if feature == "plain" else f"{feature}, ") + (
        f"head dim {head_dim}, {'causal' if causal else 'not causal'}") + (
        f", {dtype}" if dtype else "")
    for ax, (panel, key, label) in zip(ax_row, SPEED_PANELS):
      _bars(ax, group, key, impls, label)
      ax.set_title(f"{panel}: {name}", fontsize=10)
    _memory(ax_row[2], group, impls)
    ax_row[2].set_title(f"memory of fwd+bwd: {name}", fontsize=10)
  for ax in axes[0]:  # A legend on every top panel: each may show different impls.
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, loc="upper left")
  if title:
    fig.suptitle(title)
  fig.savefig(path, dpi=120)
  return fig


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m jax_flash.plots",
                              description="Plot the rows of `python -m jax_flash.bench --json`.")
  p.add_argument("json", help="file written by python -m jax_flash.bench --json")
  p.add_argument("out", help="image to write, e.g. bench.png")
  args = p.parse_args(argv)
  with open(args.json) as f:
    data = json.load(f)
  meta = data.get("meta", {}) if isinstance(data, dict) else {}
  title = None
  if meta.get("device"):  # the bench's header: which machine and build the numbers are from
    title = (f"jax_flash {meta.get('jax_flash', '')} on {meta['device']} "
             f"({meta.get('platform', '')}), jax {meta.get('jax', '')}, {meta.get('date', '')}")
  plot(data, args.out, title=title)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main(sys.argv[1:])

"""What a benchmark run shows and writes: progress, a table, JSON and a plot
per family.

rich (progress bar, tables) and matplotlib (plots) come with the `bench`
extra; without them the run prints plain-text tables and draws no plot.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
from pathlib import Path

EXTRA = 'the bench extra adds them: pip install ".[bench]" in the source tree'
RATE_FORMAT = {"GB/s": ".0f", "TFLOP/s": ".1f", "ms": ".2f"}
TIME_UNITS = ("ms",)  # units whose rate is a time (lower is faster); harness.TIME_UNITS


def missing_extras() -> list[str]:
  """Which of the `bench` extra's packages are not installed."""
  return [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]


def extras_note() -> str | None:
  """One line naming what is missing without the `bench` extra, or None."""
  missing = missing_extras()
  if not missing:
    return None
  lost = (["plain-text tables"] if "rich" in missing else []) + (
      ["no plots"] if "matplotlib" in missing else [])
  return f"{' and '.join(missing)} not installed ({', '.join(lost)}); {EXTRA}"


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


# The table.


def table(result: dict, columns=()) -> tuple[str, list[str], list[list[str]], list[str]]:
  """(title, headers, cells, notes) of a family's result: one line per case
  and mode, each implementation's rate, ours' fraction of the ceiling (where
  the family has one), ours' GB/s and fraction of the copy bandwidth where
  rows give them, the family's own `columns` ((header, impl, row key,
  format) each), ours' ratio to each peer (its rate over theirs; for a time
  unit, shown as the peer's time over ours) and ours' correctness error."""
  unit, rows = result["unit"], result["rows"]
  timed = unit in TIME_UNITS
  ceiling_name = result.get("ceiling")
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  peers = [i for i in impls if i != "ours"]
  lines: dict[tuple[str, str], dict[str, dict]] = {}
  for r in rows:
    lines.setdefault((r["case"], r["mode"]), {})[r["impl"]] = r
  spec = RATE_FORMAT.get(unit, ".1f")
  bandwidth = any(r.get("gbps") is not None for r in rows)
  headers = (["case", "mode"] + [f"{i} {unit}" for i in impls]
             + ([f"ours % {ceiling_name}"] if ceiling_name else [])
             + (["ours GB/s", "ours % copy"] if bandwidth else [])
             + [c[0] for c in columns]
             + [f"{p} / ours" if timed else f"ours / {p}" for p in peers] + ["error"])
  cells = []
  for (case, mode), by_impl in lines.items():
    ours = by_impl.get("ours", {})
    fraction = ours.get("fraction")
    error = _fmt(ours.get("error"), ".1e") + (" NO" if ours.get("ok") is False else "")
    cells.append([case, mode]
                 + [_fmt(by_impl.get(i, {}).get("rate"), spec) for i in impls]
                 + ([_fmt(None if fraction is None else 100 * fraction, ".0f")]
                    if ceiling_name else [])
                 + ([_fmt(ours.get("gbps"), ".0f"),
                     _fmt(None if ours.get("copy_fraction") is None
                          else 100 * ours["copy_fraction"], ".0f")] if bandwidth else [])
                 + [_fmt(by_impl.get(impl, {}).get(key), fmt)
                    for _, impl, key, fmt in columns]
                 + [_fmt(ours.get("ratio", {}).get(p), ".2f") for p in peers] + [error])
  title = f"{result['family']} on {result['device']}: {unit}"
  if ceiling_name:
    ceiling = result["ceilings"][ceiling_name]
    title += (f"; ceiling {ceiling['value']:{spec}} {ceiling['unit']} ({ceiling['what']})")
  notes = (["X / ours: X's time over ours' (> 1: ours is faster)"] if timed and peers else [])
  return title, headers, cells, notes + _notes(rows)


def _notes(rows: list[dict]) -> list[str]:
  """The references ours was checked against, failures grouped by reason, wrong results."""
  notes = []
  refs = list(dict.fromkeys(r["reference"] for r in rows if r["impl"] == "ours" and r["reference"]))
  if refs:
    notes.append(f"error: max |ours - ref| / (1 + max |ref|) over every output, ref = "
                 f"{' or '.join(refs)}; NO: above the tolerance")
  groups: dict[tuple[str, str], list[str]] = {}
  for r in rows:
    if r["failure"]:
      groups.setdefault((r["impl"], r["failure"]), []).append(f"{r['case']} {r['mode']}")
  for (impl, reason), where in groups.items():
    shown = ", ".join(where[:4]) + (f" (+{len(where) - 4} more)" if len(where) > 4 else "")
    notes.append(f"{impl} did not run ({len(where)}x): {reason} [{shown}]")
  return notes


def plain_table(title: str, headers: list[str], cells: list[list[str]], notes: list[str]) -> str:
  widths = [max(len(row[j]) for row in [headers] + cells) for j in range(len(headers))]

  def line(row):
    return "  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                     for j, (c, w) in enumerate(zip(row, widths))).rstrip()
  return "\n".join([title, line(headers), *map(line, cells), *notes])


def step_summary(rows: list[dict]) -> str:
  """One line for a finished case and mode: each implementation's rate, ours' ratios."""
  if not rows:
    return "not run"
  parts = []
  for r in rows:
    if r["rate"] is None:
      parts.append(f"{r['impl']} -")
    else:
      parts.append(f"{r['impl']} {r['rate']:{RATE_FORMAT.get(r['unit'], '.1f')}} {r['unit']}")
  ours = next((r for r in rows if r["impl"] == "ours"), None)
  if ours and ours["ratio"]:
    timed = ours["unit"] in TIME_UNITS
    parts.append(" ".join(f"{p}/ours {x:.2f}" if timed else f"ours/{p} {x:.2f}"
                          for p, x in ours["ratio"].items()))
  if ours and ours["error"] is not None:
    parts.append(f"error {ours['error']:.1e}{' NO' if ours['ok'] is False else ''}")
  return ", ".join(parts)


# JSON and the plot.


def write_json(result: dict, path: Path) -> Path:
  """The result as JSON, one row a line."""
  head = json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1)
  rows = ",\n".join(f"  {json.dumps(r)}" for r in result["rows"])
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(f'{head[:-2]},\n "rows": [\n{rows}\n ]\n}}\n')
  return path


def plot(family, result: dict, path: Path) -> Path | None:
  """One panel per `family.plot_point` panel: each implementation's rate
  against the family's x (evenly spaced, in order), the ceiling dotted."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  points: dict[str, dict[tuple[str, str], dict[float, float]]] = {}
  for r in result["rows"]:
    point = family.plot_point(r) if r["rate"] is not None else None
    if point is not None:
      panel, x, variant = point
      points.setdefault(panel, {}).setdefault((r["impl"], variant), {})[x] = r["rate"]
  if not points:
    return None
  impls = list(dict.fromkeys(impl for series in points.values() for impl, _ in series))
  variants = sorted({v for series in points.values() for _, v in series}, key=bool)  # "" solid
  ncols = min(3, len(points))
  nrows = math.ceil(len(points) / ncols)
  fig = Figure(figsize=(4.6 * ncols, 3.4 * nrows + 0.6))
  axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
  ceiling = result["ceilings"][result["ceiling"]] if result.get("ceiling") else None
  timed = result["unit"] in TIME_UNITS
  handles = {}
  for ax, (panel, series) in zip(axes, points.items()):
    xs = sorted({x for pts in series.values() for x in pts})
    for (impl, variant), pts in series.items():
      label = f"{impl} {variant}".strip()
      handles[label], = ax.plot([xs.index(x) for x in sorted(pts)], [pts[x] for x in sorted(pts)],
                                color=f"C{impls.index(impl)}", marker="o", markersize=3,
                                linestyle=("-", "--", ":", "-.")[variants.index(variant) % 4])
    if ceiling is not None:
      handles[f"{result['ceiling']} ceiling"] = ax.axhline(ceiling["value"], color="0.5",
                                                           linestyle=":", linewidth=1)
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels([f"{x:g}" for x in xs], fontsize=7, rotation=45 if len(xs) > 6 else 0)
    values = [v for pts in series.values() for v in pts.values()]
    if timed and max(values) > 10 * min(values):  # times of different cases span decades
      ax.set_yscale("log")
    else:
      ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel(family.plot_x, fontsize=8)
    ax.set_ylabel(result["unit"], fontsize=8)
  for ax in axes[len(points):]:
    ax.set_visible(False)
  fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles),
             fontsize=8, frameon=False)
  fig.suptitle(f"{result['family']}: {result['device']}, jax {result['jax']}, "
               f"{result['date'][:10]}", fontsize=11)
  fig.tight_layout(rect=(0, 0.6 / (3.4 * nrows + 0.6), 1, 0.95))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path


# Reporters: rich where it is installed, plain text otherwise.


class _PlainProgress:
  """One line per finished case and mode; tables as plain text."""

  def __init__(self, reporter: Reporter, totals):
    self.reporter, self.totals = reporter, dict(totals)
    self.count = {name: 0 for name in self.totals}
    self.current = ""

  def note(self, text: str):
    self.reporter.print(text)

  def start(self, family: str, what: str):
    self.current = what

  def done(self, family: str, rows: list[dict]):
    self.count[family] += 1
    n = self.totals[family]
    self.reporter.print(f"[{family} {self.count[family]:{len(str(n))}}/{n}] {self.current}: "
                        f"{step_summary(rows)}")

  def table(self, family, result: dict):
    self.reporter.print_table(result, family.columns)


class _RichProgress(_PlainProgress):
  """A live bar per family (on a terminal)."""

  def __init__(self, reporter: Reporter, totals, bar):
    super().__init__(reporter, totals)
    self.bar = bar
    self.tasks = {name: bar.add_task(name, total=n) for name, n in self.totals.items()}

  def start(self, family: str, what: str):
    super().start(family, what)
    self.bar.update(self.tasks[family], description=f"{family}: {what}")

  def done(self, family: str, rows: list[dict]):
    self.count[family] += 1
    self.bar.update(self.tasks[family], advance=1,
                    description=family if self.count[family] == self.totals[family]
                    else f"{family}: {self.current}")


class Reporter:
  """Prints a run's header, progress, tables and summary; writes its files.

  fancy/plots: use rich / draw plots (default: where the package is installed).
  """

  def __init__(self, *, fancy: bool | None = None, plots: bool | None = None, stream=None):
    missing = missing_extras()
    self.stream = stream or sys.stdout
    self.fancy = "rich" not in missing if fancy is None else fancy
    self.plots = "matplotlib" not in missing if plots is None else plots
    self.console = None
    if self.fancy:
      from rich.console import Console  # pylint: disable=g-import-not-at-top
      self.console = Console(file=self.stream, highlight=False)
      if not self.console.is_terminal:  # a log: wide enough for every column
        self.console = Console(file=self.stream, highlight=False, width=200)

  def print(self, text: str):
    if self.console is not None:
      self.console.print(text, markup=False)
    else:
      print(text, file=self.stream, flush=True)

  def header(self, env: dict):
    self.print(f"device: {env['device']} ({env['platform']}); jax {env['jax']}, jaxlib "
               f"{env['jaxlib']}, jax_dnn {env['jax_dnn']} (kernels: {env['kernels']}), "
               f"cudnn {env['cudnn']}")

  @contextlib.contextmanager
  def progress(self, totals):
    """Yields what the run loop reports to: note, start, done, table."""
    if self.console is None or not self.console.is_terminal:
      yield _PlainProgress(self, totals)
      return
    from rich import progress  # pylint: disable=g-import-not-at-top
    columns = (progress.TextColumn("{task.description}"), progress.BarColumn(),
               progress.MofNCompleteColumn(), progress.TimeElapsedColumn())
    with progress.Progress(*columns, console=self.console) as bar:
      yield _RichProgress(self, totals, bar)

  def print_table(self, result: dict, columns=()):
    title, headers, cells, notes = table(result, columns)
    if self.console is None:
      self.print("\n" + plain_table(title, headers, cells, notes) + "\n")
      return
    from rich.table import Table  # pylint: disable=g-import-not-at-top
    self.print("\n" + title)
    t = Table()
    for j, h in enumerate(headers):
      t.add_column(h, justify="left" if j < 2 else "right", no_wrap=True)
    for row in cells:
      t.add_row(*row)
    self.console.print(t)
    for note in notes:
      self.print(note)

  def write(self, family, result: dict, out) -> list[Path]:
    """<out>/<family>.json, and <out>/<family>.png when plots are on."""
    out = Path(out)
    paths = [write_json(result, out / f"{family.name}.json")]
    if self.plots:
      png = plot(family, result, out / f"{family.name}.png")
      if png is not None:
        paths.append(png)
    return paths

  def summary(self, bad: list[dict], written: list[Path]):
    if written:
      self.print(f"wrote {', '.join(map(str, written))}")
    for r in bad:
      why = r["failure"] or f"error {r['error']:.1e} against {r['reference']}"
      self.print(f"FAILED: ours, {r['case']} {r['mode']}: {why}")

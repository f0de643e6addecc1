"""The report: the tables, the run's description, results.json, results.csv and the plot, and ``merge`` of runs on
different engines."""

from __future__ import annotations

import csv
import importlib
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
from mpi4py import MPI

import tensorplay_p2p as tp

from .._src import engine
from ._config import Config
from ._patterns import PATTERNS
from ._timing import COMM, Pattern, Result, say

SERIES_COLORS = {
    "tensorplay": "tab:blue",
    "tensorplay[checked]": "tab:red",
    "tensorplay[isend]": "tab:purple",
    "tensorplay[plan]": "tab:cyan",
    "mpi4py": "tab:orange",
    "gloo": "tab:green",
}
ENGINE_STYLES = {"compiled": "-", "python": "--"}  # merged runs: a series' line style says its engine


def format_size(pattern: Pattern, size: int) -> str:
    """1 B, 8 KiB, 16 MiB; or 64^2 for a halo edge."""
    if pattern.ndim:
        return f"{size}^{pattern.ndim}"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def format_figure(value: float) -> str:
    """Three or more significant digits, no exponent."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if value < 1 else f"{value:.2f}"


def format_rows(title: str, header: list[str], rows: list[list[str]], markdown: bool) -> str:
    """A titled table of ``rows`` under ``header``: Markdown (a ``###`` heading), or right-aligned text (``##``)."""
    if markdown:
        lines = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"]
        lines += [f"| {' | '.join(row)} |" for row in rows]
        return f"### {title}\n\n" + "\n".join(lines)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    text = [" ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in [header, *rows]]
    return f"## {title}\n" + "\n".join(text)


def headline(pattern: Pattern, result: Result) -> float:
    """The figure a pattern is judged by: time in us, or bandwidth in MB/s."""
    return result.bandwidth_mbps if pattern.headline == "bandwidth" else result.time_us


def progress_line(pattern: Pattern, size: int, rows: list[Result]) -> str:
    """One measurement, for the progress display."""
    unit = "MB/s" if pattern.headline == "bandwidth" else "us"
    figures = ", ".join(f"{r.series} {format_figure(headline(pattern, r))}" for r in rows)
    return f"{pattern.name} {format_size(pattern, size)}: {figures} ({unit})"


@dataclass(frozen=True)
class Column:
    """A table column: one figure (``headline``, ``rate`` or a ratio attribute) of one series."""

    title: str
    series: str
    figure: str


def cell(pattern: Pattern, column: Column, result: Result) -> float | None:
    """The column's figure for ``result`` (None when it is another series' or absent)."""
    if result.series != column.series:
        return None
    if column.figure == "headline":
        return headline(pattern, result)
    if column.figure == "rate":
        return result.message_rate / 1e6
    return cast("float | None", getattr(result, column.figure))


def table_columns(pattern: Pattern, rows: list[Result]) -> list[Column]:
    """Columns after the size: each series' figure (and message rate), then tensorplay's ratios."""
    names = list(dict.fromkeys(r.series for r in rows))
    columns = [Column(n, n, "headline") for n in names]
    if pattern.show_rate:
        columns += [Column(f"{n} Mmsg/s", n, "rate") for n in names]
    for other in ("mpi4py", "C", "gloo"):
        if other in names:
            columns += [Column(f"{n}/{other}", n, f"ratio_vs_{other}") for n in names if n.startswith("tensorplay")]
    return columns


def format_table(pattern: Pattern, rows: list[Result]) -> str:
    """One pattern's table: a row per size, a column per series and ratio."""
    better = "higher is better" if pattern.headline == "bandwidth" else "lower is better"
    unit = "bandwidth, MB/s" if pattern.headline == "bandwidth" else "median time, us"
    title = f"## {pattern.name} ({pattern.iteration}; {unit}; ratio = tensorplay / other, {better})"
    columns = table_columns(pattern, rows)
    header = ["size"] + [c.title for c in columns]
    lines = [header]
    for size in dict.fromkeys(r.size for r in rows):
        at_size = [r for r in rows if r.size == size]
        cells = [format_size(pattern, size)]
        for column in columns:
            value = next((v for v in (cell(pattern, column, r) for r in at_size) if v is not None), None)
            cells.append("-" if value is None else format_figure(value))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    body = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join([title, *body])


def format_report(results: list[Result]) -> str:
    """Every pattern's table."""
    tables = []
    for name, pattern in PATTERNS.items():
        rows = [r for r in results if r.pattern == name]
        if rows:
            tables.append(format_table(pattern, rows))
    return "\n\n".join(tables) if tables else "no results (see the messages above)"


def describe_run(config: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """Where and how the figures were taken (collective: gathers host names)."""
    hosts = COMM.allgather(MPI.Get_processor_name())
    import mpi4py

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["python", "-m", "tensorplay_p2p.bench", *(sys.argv[1:] if argv is None else argv)],
        "ranks": COMM.Get_size(),
        "hosts": sorted(set(hosts)),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "tensorplay_p2p": tp.__version__,
        "engine": engine.name,
        "engine_reason": engine.reason,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }


def write_json(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    """Every figure, with the run's description."""
    document = {"meta": meta, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def write_csv(path: Path, results: list[Result]) -> None:
    """Every figure, one row per series, pattern and size."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def write_plot(path: Path, results: list[Result]) -> bool:
    """Latency or bandwidth against size, a panel per pattern, a line per series; False without matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        say(f"matplotlib is not installed: skipping {path.name} (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    names = [name for name in PATTERNS if any(r.pattern == name for r in results)]
    columns = min(2, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = pyplot.subplots(rows, columns, figsize=(6.5 * columns, 4.5 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        plot_pattern(ax, PATTERNS[name], [r for r in results if r.pattern == name])
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True


def plot_pattern(ax: Any, pattern: Pattern, rows: list[Result]) -> None:
    """One panel: the pattern's headline figure against size on log axes, a line per series."""
    for name in dict.fromkeys(r.series for r in rows):
        mine = [r for r in rows if r.series == name]
        sizes, figures = [r.size for r in mine], [headline(pattern, r) for r in mine]
        series, _, engine_name = name.partition(" (")
        ax.plot(
            sizes,
            figures,
            marker="o",
            markersize=3,
            label=name,
            color=SERIES_COLORS.get(series),
            linestyle=ENGINE_STYLES.get(engine_name.rstrip(")"), "-"),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"interior edge (cells, {pattern.ndim}-D)" if pattern.ndim else "message size (bytes)")
    ax.set_ylabel("bandwidth (MB/s)" if pattern.headline == "bandwidth" else "time (us)")
    ax.set_title(f"{pattern.name}: {pattern.iteration}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()


def write_outputs(out: Path, meta: dict[str, Any], results: list[Result], plot: bool) -> list[Path]:
    """results.json, results.csv and (with matplotlib) results.png under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv"]
    write_json(written[0], meta, results)
    write_csv(written[1], results)
    if plot and results and write_plot(out / "results.png", results):
        written.append(out / "results.png")
    return written


def merge(directories: Sequence[Path]) -> tuple[dict[str, Any], list[Result]]:
    """Runs on different engines as one report: each run's tensorplay series named by its engine (with its ratios,
    measured against that run's mpi4py and gloo), and the other series as the first run measured them."""
    documents = [json.loads((d / "results.json").read_text()) for d in directories]
    results: list[Result] = []
    for n, document in enumerate(documents):
        name = document["meta"].get("engine", "python")
        for row in document["results"]:
            result = Result(**row)
            if result.impl == "tensorplay":
                results.append(replace(result, series=f"{result.series} ({name})"))
            elif n == 0:
                results.append(result)
    meta = {"merged": [document["meta"] for document in documents]}
    return meta, results

"""What every benchmark returns, and how the runner turns it into ``docs/benchmarks.md`` and plots.

A benchmark measures each figure several times and keeps every sample (:class:`Stat`): the
document shows the median with the min and max, so a reader sees how much the machine moved. A
ratio is a :class:`Stat` too, made of per-round ratios of runs taken seconds apart in the same
run (a busy neighbour slows both sides alike), never of two medians from different hours.

Everything here is plain data that round-trips through JSON: the runner starts each benchmark in
its own process (``python -m bench.<name> --json PATH``) and reads its :class:`Section` back.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from models import strict_json

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
IMAGES = DOCS / "img"
BEGIN = "<!-- bench:begin (written by `make bench`; edit outside these markers) -->"
END = "<!-- bench:end -->"


@dataclass
class Stat:
    """Repeated measurements of one figure, in ``unit`` ("images/s", "s", "x", "MB", ...)."""

    samples: list[float]
    unit: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def format(self) -> str:
        """``12.3 s (11.9 to 13.0, n=3)``: the median, then the range of the samples."""
        if len(self.samples) == 1:
            return f"{_number(self.samples[0])}{_unit(self.unit)} (n=1)"
        return (
            f"{_number(self.median)}{_unit(self.unit)} "
            f"({_number(self.min)} to {_number(self.max)}, n={len(self.samples)})"
        )


def _unit(unit: str) -> str:
    return unit if unit in ("x", "%") else f" {unit}" if unit else ""


def _number(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


Cell = str | float | int | Stat


@dataclass
class Table:
    """A Markdown table; a :class:`Stat` cell shows median (min to max, n)."""

    columns: list[str]
    rows: list[list[Cell]]
    title: str = ""

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""] if self.title else []
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + " --- |" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(_cell(value) for value in row) + " |")
        return "\n".join(lines)


def _cell(value: Cell) -> str:
    if isinstance(value, Stat):
        return value.format()
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, int):
        return f"{value:,}"
    return value


@dataclass
class Series:
    """One line of a plot: ``y`` (with its spread) against ``x``."""

    label: str
    x: list[float]
    y: list[Stat]


@dataclass
class Plot:
    """A small line plot, written to ``docs/img/<file>``; several panels side by side."""

    file: str
    title: str
    x_label: str
    panels: list[tuple[str, list[Series]]]  # (y label, lines)


@dataclass
class Section:
    """One benchmark's results: what ran, its tables and plots, and figures others refer to."""

    key: str
    title: str
    command: str
    text: list[str] = field(default_factory=list)  # paragraphs, Markdown
    tables: list[Table] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    # Named figures the runner combines across sections (e.g. training FLOP/s vs the peak).
    figures: dict[str, Stat] = field(default_factory=dict)
    seconds: float = 0.0
    # When and how it ran: set by run_main, shown beside the command.
    date: str = ""  # UTC
    mode: str = ""  # quick or full
    load: str = ""  # 1-minute load average before -> after

    def to_json(self) -> str:
        return strict_json.dumps(asdict(self), indent=1)  # NaN as null: a JSON file

    @classmethod
    def from_json(cls, text: str) -> Section:
        data = json.loads(text)

        def stat(d: dict[str, Any]) -> Stat:
            return Stat(**d)

        def cell(value: Any) -> Cell:
            return stat(value) if isinstance(value, dict) else value

        return cls(
            key=data["key"],
            title=data["title"],
            command=data["command"],
            text=data["text"],
            tables=[
                Table(t["columns"], [[cell(v) for v in row] for row in t["rows"]], t["title"])
                for t in data["tables"]
            ],
            plots=[
                Plot(
                    p["file"],
                    p["title"],
                    p["x_label"],
                    [
                        (label, [Series(s["label"], s["x"], [stat(y) for y in s["y"]]) for s in ss])
                        for label, ss in p["panels"]
                    ],
                )
                for p in data["plots"]
            ],
            figures={k: stat(v) for k, v in data["figures"].items()},
            seconds=data["seconds"],
            date=data.get("date", ""),
            mode=data.get("mode", ""),
            load=data.get("load", ""),
        )

    def markdown(self) -> str:
        when = "; ".join(
            part
            for part in (
                f"{self.seconds:.0f} s",
                self.mode,
                f"{self.date} UTC" if self.date else "",
                f"load average {self.load}" if self.load else "",
            )
            if part
        )
        parts = [f"## {self.title}", f"Command: `{self.command}` ({when})."]
        parts += self.text
        parts += [table.markdown() for table in self.tables]
        parts += [f"![{plot.title}](img/{plot.file})" for plot in self.plots]
        return "\n\n".join(parts)


def write_json(section: Section, path: Path | None) -> None:
    """Print the section as Markdown; with ``path``, also write it as JSON for the runner."""
    print()
    print(section.markdown())
    if path is not None:
        atomic_write(path, section.to_json())


def atomic_write(path: Path, text: str | bytes) -> None:
    """Write ``path`` whole or not at all: a stopped benchmark never leaves half a document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def draw(plot: Plot, folder: Path = IMAGES) -> Path:
    """Draw ``plot`` as a PNG: each panel a line per series, the min-max range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plot.panels), figsize=(4.2 * len(plot.panels), 3.4))
    axes = [axes] if len(plot.panels) == 1 else list(axes)
    for ax, (y_label, lines) in zip(axes, plot.panels, strict=True):
        for line in lines:
            medians = [y.median for y in line.y]
            spread = [
                [m - y.min for m, y in zip(medians, line.y, strict=True)],
                [y.max - m for m, y in zip(medians, line.y, strict=True)],
            ]
            ax.errorbar(line.x, medians, yerr=spread, marker="o", capsize=3, label=line.label)
        ax.set_xlabel(plot.x_label)
        ax.set_ylabel(y_label)
        ax.set_xticks(sorted({x for line in lines for x in line.x}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(plot.title, fontsize="medium")
    fig.tight_layout()
    path = folder / plot.file
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def no_cuda_here(module: str) -> bool:
    """True (having said so) where there is no CUDA GPU: a GPU benchmark then skips itself, and
    ``python -m bench`` keeps its last results."""
    import torch

    if torch.cuda.is_available():
        return False
    print(
        f"bench.{module}: skipped, no CUDA GPU here (`python -m bench.{module} --device cpu "
        "--quick` checks the script on the CPU)."
    )
    return True


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def memory_gb() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    return 0.0


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of ``names`` (distribution names), without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"Python": platform.python_version()}
    for name in names:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB.

    ``VmHWM`` is the high-water mark of this process's own memory map, which ``exec`` starts
    afresh. ``ru_maxrss`` is not: Linux carries it across ``exec``, so a child of a big parent
    would report at least the parent's size.
    """
    import resource

    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def replace_generated(document: str, generated: str) -> str:
    """``document`` with the text between the markers replaced (or appended, markers and all)."""
    block = f"{BEGIN}\n\n{generated.strip()}\n\n{END}"
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return document.rstrip() + "\n\n" + block + "\n"


def run_main(run: Any, description: str, argv: list[str] | None = None) -> int:
    """The command line every benchmark shares: ``[--full] [--json PATH]``.

    ``run(full, work)`` gets a temporary folder that is removed afterwards and returns its
    :class:`Section`; the section is printed as Markdown and, with ``--json``, saved for the
    runner (``python -m bench``), which writes ``docs/benchmarks.md``.
    """
    import argparse
    import time

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--full", action="store_true", help="real sizes and more repeats (default: the quick run)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here, as JSON")
    args = parser.parse_args(argv)
    from datetime import UTC, datetime

    began, date = time.perf_counter(), datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    load_before = f"{os.getloadavg()[0]:.2f}"
    print(f"load average {load_average()}; {'full' if args.full else 'quick'} run", flush=True)
    with tempfile.TemporaryDirectory(prefix="imageops-bench-") as tmp:
        section = run(args.full, Path(tmp))
    section.seconds = time.perf_counter() - began
    section.date, section.mode = date, "full" if args.full else "quick"
    section.load = f"{load_before} before, {os.getloadavg()[0]:.2f} after"
    write_json(section, args.json)
    return 0

"""Run every benchmark and write the results into docs/benchmarks.md, with plots in docs/img/.

Usage: ``python -m bench [--full] [--only NAME ...] [--no-write]`` (``make bench``, ``make bench
FULL=1``). The quick default takes about 25 minutes on 2 cores; ``--full`` uses real sizes and
more repeats. Each benchmark runs in a process of its own (a fresh interpreter: no imports, threads
or memory carried from one to the next) and hands back its figures as JSON; the runner adds the
machine, the versions, the date and the hardware-ceiling table, then replaces the generated part
of docs/benchmarks.md (between its markers), leaving the hand-written notes around it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import (
    DOCS,
    ROOT,
    Section,
    Stat,
    Table,
    atomic_write,
    cpu_name,
    draw,
    memory_gb,
    replace_generated,
    usable_cores,
    versions,
)

# In this order: the ceiling first, so nothing else warms or loads the machine before it.
# The GPU ones last: they are skipped (with a message) on machines without a CUDA GPU.
BENCHMARKS = (
    "ceiling", "convert_speed", "train_speed", "score_speed", "fixed_costs", "scale",
    "accuracy", "orchestration", "scale_out", "score_cluster", "gpu_train", "gpu_score",
)  # fmt: skip
PACKAGES = (
    "torch", "torchvision", "onnxruntime", "Pillow", "numpy",
    "prefect", "mlflow", "dvc", "optuna",
)  # fmt: skip
DOCUMENT = DOCS / "benchmarks.md"
RECORD = DOCS / "benchmarks.json"  # every section's figures, so `--only` keeps the others


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--full", action="store_true", help="real sizes and more repeats (default: quick)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
        help=f"run only these ({', '.join(BENCHMARKS)}); the others keep their last results",
    )  # fmt: skip
    parser.add_argument(
        "--no-write", action="store_true", help="print the results; leave docs/ unchanged"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="run nothing: rewrite docs/benchmarks.md from the last results (docs/benchmarks.json)",
    )
    return parser.parse_args(argv)


def run_one(name: str, full: bool, scratch: Path) -> Section | None:
    """``python -m bench.<name>`` in a fresh interpreter; its output streams through.

    None when the benchmark skipped itself (it exits 0 without results, having said why: the GPU
    benchmark on a machine without a GPU); its last results are then kept.
    """
    out = scratch / f"{name}.json"
    command = [sys.executable, "-m", f"bench.{name}", "--json", str(out)]
    if full:
        command.append("--full")
    print(f"\n=== bench.{name} ===", flush=True)
    done = subprocess.run(command, cwd=ROOT, check=False)
    if done.returncode == 0 and not out.exists():
        return None
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"bench.{name} failed (exit {done.returncode}); see its output above")
    return Section.from_json(out.read_text())


def ceiling_table(sections: list[Section]) -> Table | None:
    """Every section's FLOP/s (figures named ``flops/<precision>/<what>``) as % of the peak."""
    peaks = {
        key.split("/", 1)[1]: stat
        for section in sections
        for key, stat in section.figures.items()
        if key.startswith("peak/")
    }
    rows: list[list[str | float | int | Stat]] = []
    for section in sections:
        for key, stat in section.figures.items():
            if not key.startswith("flops/"):
                continue
            _, precision, what = key.split("/", 2)
            gflops = Stat([v / 1e9 for v in stat.samples], "GFLOP/s")
            peak = peaks.get(precision)
            # The ceiling is the best the machine did: a window a neighbour slowed is not it.
            share = Stat([100 * v / peak.max for v in stat.samples], "%") if peak else "no peak"
            rows.append([what, precision, gflops, share])
    if not rows:
        return None
    return Table(
        ["work", "computes in", "achieved", "of the best matmul window in that precision"], rows
    )


def machine_lines(sections: list[Section]) -> list[str]:
    import torch

    found = versions(PACKAGES)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    modes = sorted({section.mode for section in sections if section.mode})
    dates = sorted(section.date for section in sections if section.date)
    return [
        f"- Date: {dates[0]} to {dates[-1]} (UTC); mode: {' and '.join(modes)} "
        "(each section says its own)"
        if dates
        else "- Date: unknown",
        f"- Machine: {cpu_name()}, {usable_cores()} usable cores, {memory_gb():.0f} GB memory, "
        f"GPU: {gpu}; torch uses {torch.get_num_threads()} threads",
        "- Versions: " + ", ".join(f"{name} {v}" for name, v in found.items()),
        f"- All sections together took {sum(s.seconds for s in sections) / 60:.1f} minutes",
    ]


def render(sections: list[Section]) -> str:
    parts = [
        "# Results",
        "\n".join(machine_lines(sections)),
        "Each figure is the median of repeated runs, with the min and max and the number of "
        "runs (n). Each ratio is the median of per-round ratios of runs taken one right after "
        "the other in the same benchmark, so a busy neighbour slows both sides alike.",
    ]
    table = ceiling_table(sections)
    for section in sections:
        parts.append(section.markdown())
        if section.key == "ceiling" and table is not None:
            parts.append(
                "What the other benchmarks below achieved, against that ceiling (a training step "
                "counts 3x the forward FLOPs of `torch.utils.flop_counter`):"
            )
            parts.append(table.markdown())
    return "\n\n".join(parts)


def previous_sections() -> dict[str, Section]:
    """The last results of every benchmark, from docs/benchmarks.json (none if it is missing)."""
    if not RECORD.exists():
        return {}
    return {
        data["key"]: Section.from_json(json.dumps(data))
        for data in json.loads(RECORD.read_text())["sections"]
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    names = () if args.render else args.only or BENCHMARKS
    with tempfile.TemporaryDirectory(prefix="imageops-bench-") as scratch:
        ran = {name: run_one(name, args.full, Path(scratch)) for name in names}
    print(f"\nthese benchmarks: {time.perf_counter() - started:.0f} s")
    fresh = {name: section for name, section in ran.items() if section is not None}
    skipped = {_key(name) for name, section in ran.items() if section is None}
    previous = previous_sections()
    kept = (
        previous
        if args.only or args.render
        else {key: section for key, section in previous.items() if key in skipped}
    )
    by_key = {**kept, **{section.key: section for section in fresh.values()}}
    sections = sorted(by_key.values(), key=lambda s: _order(s.key))
    document = render(sections)
    print(f"\n{document}\n")
    if args.no_write:
        return 0
    for section in fresh.values():
        for plot in section.plots:
            print(f"drew {draw(plot).relative_to(ROOT)}")
    record = {"sections": [json.loads(section.to_json()) for section in sections]}
    atomic_write(RECORD, json.dumps(record, indent=1) + "\n")
    old = DOCUMENT.read_text() if DOCUMENT.exists() else "# Benchmarks\n"
    atomic_write(DOCUMENT, replace_generated(old, document))
    print(f"wrote {DOCUMENT.relative_to(ROOT)} and {RECORD.relative_to(ROOT)}")
    return 0


def _key(name: str) -> str:
    """A benchmark's section key: its module name without ``_speed``."""
    return name.removesuffix("_speed")


def _order(key: str) -> int:
    """Sections in BENCHMARKS order."""
    keys = [_key(name) for name in BENCHMARKS]
    return keys.index(key) if key in keys else len(keys)


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark report's plumbing (no benchmark runs here: tests never time anything).

`make bench` hands every section across a process boundary as JSON and rewrites only the generated
part of docs/benchmarks.md; both must hold, or a run would lose figures or the hand-written notes.
"""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import BENCHMARKS, ceiling_table
from bench.report import BEGIN, END, Plot, Section, Series, Stat, Table, draw, replace_generated


def _section() -> Section:
    rate = Stat([10.0, 12.0, 11.0], "images/s")
    return Section(
        key="train",
        title="Training",
        command="python -m bench.train_speed",
        text=["A paragraph."],
        tables=[Table(["loop", "images/s", "note"], [["ours", rate, 3]], title="T")],
        plots=[
            Plot(
                "bench-x.png", "x", "processes", [("images/s", [Series("a", [1, 2], [rate, rate])])]
            )
        ],
        figures={"flops/bf16/training": Stat([2e11, 3e11], "FLOP/s")},
        seconds=12.5,
        date="2026-11-22 22:00",
        mode="quick",
    )


def test_a_section_survives_the_trip_through_json() -> None:
    section = _section()
    again = Section.from_json(section.to_json())
    assert again == section
    assert again.tables[0].rows[0][1].median == 11.0


def test_a_figure_shows_its_median_and_its_range() -> None:
    assert Stat([3.0, 1.0, 2.0], "s").format() == "2.00 s (1.00 to 3.00, n=3)"
    assert Stat([1.5], "x").format() == "1.50x (n=1)"
    markdown = _section().markdown()
    assert "| ours | 11.0 images/s (10.0 to 12.0, n=3) | 3 |" in markdown
    assert "(12 s; quick; 2026-11-22 22:00 UTC)" in markdown


def test_only_the_generated_part_of_the_document_is_replaced() -> None:
    document = f"# Benchmarks\n\nintro\n\n{BEGIN}\n\nold figures\n\n{END}\n\n## Notes\n\nby hand\n"
    updated = replace_generated(document, "new figures")
    assert "old figures" not in updated and "new figures" in updated
    assert updated.startswith("# Benchmarks\n\nintro") and updated.endswith("## Notes\n\nby hand\n")
    # A document without the markers gets them appended, its text kept.
    assert replace_generated("# mine\n", "x").startswith("# mine\n")


def test_throughput_is_set_against_the_peak_of_its_precision() -> None:
    peak = Section("ceiling", "c", "c", figures={"peak/bf16": Stat([1e12], "FLOP/s")})
    table = ceiling_table([peak, _section()])
    assert table is not None
    work, precision, achieved, share = table.rows[0]
    assert achieved.samples == [200.0, 300.0]  # GFLOP/s
    assert (work, precision) == ("training", "bf16")
    assert share.samples == [20.0, 30.0]  # percent of 1 TFLOP/s


def test_every_benchmark_module_has_a_run_function() -> None:
    import importlib

    for name in BENCHMARKS:
        assert callable(importlib.import_module(f"bench.{name}").run), name


def test_a_plot_is_written_as_png(tmp_path: Path) -> None:
    path = draw(_section().plots[0], folder=tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

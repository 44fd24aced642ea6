"""Every hostile input of the corpus, run as a user runs it: ``imageops ...`` through the CLI.

The CLI runs in this process (``app.cli.main`` with ``sys.argv`` set) for speed; it is the
same entry point the console script calls. Each case must end in its report or in its named error
with a "what to do" hint; never a traceback, never a file outside the destination, and after a
failure no new output at all.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_inputs import CASES, OTHER_PARTS, PICKLE_MARKER, STEPS, Case, Inputs, markdown
from projects import use_project

from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shared_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """One project (MLflow store, run folders) for every case: setting one up costs seconds."""
    with pytest.MonkeyPatch.context() as patch:
        yield use_project(tmp_path_factory.mktemp("hostile") / "project", patch)


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path below ``folder`` with its size and modification time."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def _under(path: str, dest: str) -> bool:
    return path == dest or path.startswith(dest + "/")


def _run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, BaseException | None]:
    """Run ``imageops argv`` in this process; the exit status and the error that caused it."""
    from app.cli import main

    monkeypatch.setattr(sys, "argv", ["imageops", *argv])
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, exc.__context__
    return 0, None


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * c.slow) for c in CASES]
)
def test_hostile_input(
    case: Case,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    shared_project: Settings,
    digits_raw: Path,
    digits_split: tuple[Path, Path],
    exported_model: Path,
) -> None:
    inputs = Inputs(tmp_path, digits_raw, *digits_split, exported_model)
    inputs.out.mkdir()
    run = case.build(inputs)
    for key, value in run.env.items():
        monkeypatch.setenv(key, value)
    dest = str(run.dest.relative_to(tmp_path))
    dest_existed = run.dest.exists()
    before, around = _tree(tmp_path), sorted(p.name for p in tmp_path.parent.iterdir())
    capsys.readouterr()

    code, error = _run_cli(run.argv, monkeypatch)

    stdout, stderr = capsys.readouterr()
    shown = f"exit {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert "Traceback" not in stdout + stderr, shown
    after = _tree(tmp_path)
    assert [p for p in after if p not in before and not _under(p, dest)] == [], shown
    # Outside dest nothing may go, but a killed run's leftovers beside it (which must go).
    removed = [str(p.relative_to(tmp_path)) for p in run.removed]
    kept = [p for p in before if not any(_under(p, r) for r in [dest, *removed])]
    assert [p for p in kept if p not in after] == [], shown
    assert [p for p in removed if p in after] == [], shown
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == around
    for path in run.forbidden:
        assert not path.exists(), path
    assert not any(p.name == PICKLE_MARKER for p in tmp_path.rglob("*")), "a pickle was loaded"
    assert not (shared_project.project_root / PICKLE_MARKER).exists()

    if case.expect.startswith("ok:"):
        assert code == 0, shown
        for part in case.expect.removeprefix("ok:").split(";"):
            assert part.strip() in stdout, (part, shown)
        assert (run.dest / run.made).is_file(), shown
        return
    assert code == 2, shown
    assert type(error).__name__ == case.expect, (error, shown)
    assert case.says.lower() in stderr.lower(), shown
    if case.step == "cli":  # the parser's own message: what is wrong, and where help is
        assert "--help" in stderr, shown
        return
    assert f"error: {case.expect}: " in stderr and "what to do:" in stderr, shown
    new_in_dest = [p for p in after if _under(p, dest) and before.get(p) != after[p]]
    if dest_existed:  # an input folder the step writes into: left as it was
        assert new_in_dest == [], shown
    else:  # nothing, or only empty folders: no half output that looks whole
        assert all((tmp_path / p).is_dir() for p in new_in_dest), (new_in_dest, shown)


def test_the_corpus_covers_every_step() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.step for c in CASES} == set(STEPS)


def test_reliability_doc_lists_every_case() -> None:
    doc = (REPO / "docs" / "reliability.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert missing == [], "run: python -m tests.hostile_inputs --write docs/reliability.md"
    assert doc.startswith(markdown()), "run: python -m tests.hostile_inputs --write ..."
    assert OTHER_PARTS in doc

"""DVC experiments on a project imageops versioned: the `dvc` commands work and no data is lost.

`dvc exp run` runs an untargeted `dvc checkout`, which deletes every folder DVC once checked out
whose .dvc file it cannot see; it skips .dvc files in folders git ignores. data/.gitignore must
therefore leave the data set folders visible, and the outputs dvc.yaml keeps out of the cache
(metrics, plots) must reach git, or experiments show `!` for them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from projects import dvc

from tasks.data.convert import convert
from tasks.data.split import split
from tasks.data.versioning import uncommitted, version
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("images", "train", "val")


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout


def _git_project(project: Settings, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The project folder as a git repository with the project's own ignore files, committed."""
    for var in ("GIT_AUTHOR", "GIT_COMMITTER"):  # DVC's experiment commits need an identity too
        monkeypatch.setenv(f"{var}_NAME", "imageops tests")
        monkeypatch.setenv(f"{var}_EMAIL", "tests@example.org")
    root = project.project_root
    git("init", "-q", cwd=root)
    (root / "data").mkdir()
    for name in (".gitignore", "params.yaml", "data/.gitignore", "data/README.md"):
        shutil.copy(ROOT / name, root / name)
    git("add", "-A", cwd=root)
    git("commit", "-q", "-m", "project", cwd=root)
    return root


def _tree_md5(folder: Path) -> str:
    """One hash over every file's relative path and content: equal means nothing changed."""
    digest = hashlib.md5()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert files, f"{folder} is empty"
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def test_the_data_gitignore_hides_data_but_not_pointers_or_uncached_outputs(
    tmp_path: Path,
) -> None:
    # git's own matcher, as DVC asks it: folders with a trailing slash.
    git("init", "-q", cwd=tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(ROOT / "data/.gitignore", tmp_path / "data/.gitignore")

    def ignored(path: str) -> bool:
        done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=tmp_path)
        assert done.returncode in (0, 1), done
        return done.returncode == 0

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    uncached, cached = [], []
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for out in stage.get(kind, []):
                path, options = next(iter(out.items())) if isinstance(out, dict) else (out, {})
                (uncached if options.get("cache") is False else cached).append(path)
    assert uncached == ["data/repro/scored.metrics.json", "data/repro/scored.confusion.png"]
    for path in uncached:  # git holds them: experiments and `dvc metrics diff` read them there
        assert not ignored(path), path
    for path in cached:  # DVC holds them
        assert ignored(path), path
    for dataset in ("digits", "repro"):
        assert not ignored(f"data/{dataset}/"), dataset  # else DVC skips its .dvc files
        assert not ignored(f"data/{dataset}/images.dvc")
        for part in PARTS:
            assert ignored(f"data/{dataset}/{part}/") and ignored(f"data/{dataset}/{part}/1.png")
    # Raw sources are versioned like a data set (the pipeline versions its source).
    assert not ignored("data/raw/") and not ignored("data/raw/digits.dvc")
    assert ignored("data/raw/digits/") and ignored("data/raw/digits/3/1.png")
    assert ignored("data/digits.zip") and ignored("data/digits/notes.txt")


def test_dvc_checkout_and_gc_keep_a_versioned_data_set(
    project: Settings, monkeypatch: pytest.MonkeyPatch, digits_split: tuple[Path, Path]
) -> None:
    # What deleted data/<data set>/*: DVC did not see its .dvc files under data/.gitignore.
    root = _git_project(project, monkeypatch)
    data = root / "data/digits"
    data.mkdir()
    shutil.copytree(digits_split[1], data / "val")
    before = _tree_md5(data / "val")
    md5 = version(data / "val", project)
    # The pipeline versions its raw source too (make run failed while data/raw/ was ignored).
    raw = root / "data/raw/digits"
    shutil.copytree(digits_split[1], raw)
    version(raw, project)
    raw_before = _tree_md5(raw)

    checkout = dvc("checkout", cwd=root)
    assert checkout.returncode == 0, checkout.stderr
    assert _tree_md5(data / "val") == before and _tree_md5(raw) == raw_before
    gc = dvc("gc", "--workspace", "--force", cwd=root)
    assert gc.returncode == 0, gc.stderr
    assert (root / ".dvc/cache/files/md5" / md5[:2] / md5[2:]).is_file()  # the listing survived gc
    listed = dvc("ls", "--dvc-only", ".", "data/digits", cwd=root)
    assert listed.returncode == 0 and listed.stdout.split() == ["val"], listed


def test_imageops_version_names_the_files_to_commit_and_its_command_commits_them(
    project: Settings, monkeypatch: pytest.MonkeyPatch, digits_split: tuple[Path, Path]
) -> None:
    root = _git_project(project, monkeypatch)
    shutil.copytree(digits_split[1], root / "data/digits/val")

    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "version", "data/digits/val"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(".dir") and "commit the data versions" in lines[1], done.stdout
    command = lines[2].strip()
    assert command.startswith("git add ") and "data/digits/val.dvc" in command, command
    # core.autostage (set when imageops created the DVC repository) staged them already.
    staged = git("diff", "--cached", "--name-only", cwd=root).split()
    assert sorted(staged) == [".dvc/.gitignore", ".dvc/config", ".dvcignore",
                              "data/digits/val.dvc"]  # fmt: skip
    assert "autostage = true" in (root / ".dvc/config").read_text().lower()

    subprocess.run(command, shell=True, cwd=root, check=True, capture_output=True)

    assert git("status", "--porcelain", cwd=root) == ""
    assert uncommitted([root / "data/digits/val"], project) == []
    shown = git("show", "--name-only", "--format=%s", "HEAD", cwd=root).split("\n", 1)
    assert shown[0] == "Version data/digits/val" and "data/digits/val.dvc" in shown[1]


@pytest.mark.slow
def test_dvc_experiments_compare_runs_and_keep_every_data_set(
    project: Settings,
    monkeypatch: pytest.MonkeyPatch,
    digits_raw: Path,
    exported_model: Path,
) -> None:
    root = _git_project(project, monkeypatch)
    # dvc.yaml's own split, score and evaluate stages (the ones before them train for minutes):
    # their inputs data/repro/images and data/repro/model are versioned data here.
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    dvc_yaml = {"stages": {name: stages[name] for name in ("split", "score", "evaluate")}}
    (root / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    git("add", "dvc.yaml", cwd=root)
    git("commit", "-q", "-m", "pipeline", cwd=root)

    # What `imageops run` leaves: data/<data set>/{images,train,val}, each versioned.
    data = root / "data/digits"
    convert(digits_raw, data / "images")
    split(data / "images", data / "train", data / "val", fraction=0.8, seed=1)
    shutil.copytree(data / "images", root / "data/repro/images")
    shutil.copytree(exported_model, root / "data/repro/model")
    versioned = [data / part for part in PARTS]
    versioned += [root / "data/repro/images", root / "data/repro/model"]
    for path in versioned:
        version(path, project)
    hashes = {path: _tree_md5(path) for path in versioned}

    # The case that lost the data: `dvc exp run` (every stage, no target) before the pointers
    # are committed (core.autostage staged them; the experiment leaves them untracked).
    first = dvc("exp", "run", cwd=root)
    assert first.returncode == 0, first.stdout + first.stderr
    for path, digest in hashes.items():
        assert _tree_md5(path) == digest, f"{path} changed or vanished"

    # Commit what imageops names, then what the run left for git: the lock file and the metrics
    # and plot dvc.yaml keeps out of the cache. `git add -A` picks up those and no data.
    to_commit = uncommitted(versioned, project)
    assert {f"data/digits/{part}.dvc" for part in PARTS} <= set(to_commit), to_commit
    git("add", *to_commit, cwd=root)
    git("add", "-A", cwd=root)
    staged = git("diff", "--cached", "--name-only", cwd=root).split()
    assert sorted(staged) == sorted([*to_commit, "dvc.lock", "data/repro/scored.metrics.json",
                                     "data/repro/scored.confusion.png"])  # fmt: skip
    git("commit", "-q", "-m", "data set digits, baseline (split 0.9)", cwd=root)
    assert uncommitted(versioned, project) == []

    exp = dvc("exp", "run", "-S", "split.fraction=0.8", cwd=root)

    assert exp.returncode == 0, exp.stdout + exp.stderr
    for path, digest in hashes.items():
        assert _tree_md5(path) == digest, f"{path} changed or vanished"
    assert len(list((root / "data/repro/val").rglob("*.png"))) == 18  # 20% of 3 x 30

    shown = dvc("exp", "show", "--json", cwd=root)
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)  # the workspace, the baseline commit and its experiment
    experiments = [e for row in rows for e in (row.get("experiments") or [])]
    assert len(experiments) == 1 and experiments[0]["name"] in exp.stdout, rows
    baseline = next(row for row in rows if row.get("experiments"))
    for rev, fraction, images in ((baseline, 0.9, 9), (experiments[0]["revs"][0], 0.8, 18)):
        # an error or a missing file here is what `dvc exp show` prints as "!"
        assert not rev.get("error"), rev
        assert rev["data"]["params"]["params.yaml"]["data"]["split"]["fraction"] == fraction
        metrics = rev["data"]["metrics"]["data/repro/scored.metrics.json"]
        assert not metrics.get("error") and metrics["data"]["images"] == images, metrics

    params = dvc("params", "diff", "--json", cwd=root)
    assert params.returncode == 0, params.stderr
    change = json.loads(params.stdout)["params.yaml"]["split.fraction"]
    assert (change["old"], change["new"]) == (0.9, 0.8)

    show = dvc("metrics", "show", cwd=root)
    assert show.returncode == 0 and "!" not in show.stdout, show.stdout
    assert "data/repro/scored.metrics.json" in show.stdout and "18" in show.stdout, show.stdout
    diff = dvc("metrics", "diff", "--json", cwd=root)
    assert diff.returncode == 0, diff.stderr
    images = json.loads(diff.stdout)["data/repro/scored.metrics.json"]["images"]
    assert (images["old"], images["new"]) == (9, 18)

    html = dvc("plots", "show", cwd=root)
    assert html.returncode == 0, html.stderr
    page = (root / "dvc_plots/index.html").read_text()
    assert "scored.confusion.png" in page
    assert "dvc_plots" not in git("status", "--porcelain", cwd=root)  # the root .gitignore

    # Back to the baseline, as git and DVC users do: the data sets are still whole.
    git("reset", "-q", "--hard", cwd=root)
    checkout = dvc("checkout", cwd=root)
    assert checkout.returncode == 0, checkout.stderr
    assert len(list((root / "data/repro/val").rglob("*.png"))) == 9
    for path, digest in hashes.items():
        assert _tree_md5(path) == digest, f"{path} changed or vanished"

"""Score Image Model with real ONNX Runtime on real digit scans: table, formats, bad input."""

from __future__ import annotations

import logging
import os
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
import torch
from hostile_inputs import hostile_onnx
from model_helpers import copy_model
from prefect_runs import task_runs_of
from torchvision.transforms import v2

from models.atomic import write_json
from models.directory import ONNX, read_model_info
from models.transform_spec import TransformSpec
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import build_transform
from tasks.inference.score import ShardedScoring, score, score_in_shards
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
)

pytest_plugins = ["model_fixtures"]

PROBS = ["Scored Probabilities_0", "Scored Probabilities_1", "Scored Probabilities_2"]
ERR = "Scoring Error"


def _read_csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(
        path,
        dtype={"path": str, "category": str, "Scored Labels": str, ERR: str},
        keep_default_na=False,
        na_values={p: [""] for p in PROBS},
    )


def _plain_folder(src: Path, dest: Path, count: int = 5) -> list[str]:
    """Copy ``count`` scans into nested sub-folders of ``dest``; return their relative paths."""
    files = sorted(src.rglob("*.png"))[:count]
    rels = []
    for i, path in enumerate(files):
        rel = Path(f"batch{i % 2}") / "nested" / path.name if i % 2 else Path(path.name)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest / rel)
        rels.append(rel.as_posix())
    return sorted(rels)


def test_labeled_directory_gives_the_score_image_model_table(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    val = digits_split[1]
    manifest = read_manifest(val)
    out = score(exported_model, val, tmp_path / "scores.csv", batch_size=4, threads=1)

    table = _read_csv(out)
    assert list(table.columns) == ["id", "path", "category", ERR, *PROBS, "Scored Labels"]
    assert (table[ERR] == "").all()
    assert len(table) == len(manifest.images)
    assert table["id"].tolist() == list(range(len(manifest.images)))
    truth = {e.path: manifest.classes[e.label] for e in manifest.images}
    assert table["category"].tolist() == [truth[p] for p in table["path"]]
    np.testing.assert_allclose(table[PROBS].sum(axis=1), 1.0, atol=1e-9)
    assert ((table[PROBS] >= 0) & (table[PROBS] <= 1)).all().all()
    argmax = np.array(["0", "1", "2"])[table[PROBS].to_numpy().argmax(axis=1)]
    assert table["Scored Labels"].tolist() == argmax.tolist()

    # Independently: the same images through the inference transform and ORT, softmax by hand.
    info = read_model_info(exported_model)
    transform = build_transform(info.transform, "inference")
    batch = torch.stack([transform(load_rgb(val / p)) for p in table["path"][:3]]).numpy()
    session = ort.InferenceSession(str(exported_model / ONNX), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": batch})
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(table[PROBS].to_numpy()[:3], expected, atol=1e-6)


def test_two_batches_at_once_give_the_table_one_run_gives(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """On a CPU with two threads or more, score keeps two batches in the session at once, one
    thread each (docs/scoring.md#readers): the rows come in the images' order with the labels and,
    to float rounding, the probabilities of one run at a time on one thread; a corrupt image is
    still its own row."""
    from tasks.inference.score.session import runs_at_once

    assert (runs_at_once(1), runs_at_once(2), runs_at_once(16)) == (1, 2, 2)
    folder = tmp_path / "photos"
    _plain_folder(digits_split[0], folder, count=23)
    (folder / "k-broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    one = _read_csv(score(exported_model, folder, tmp_path / "one.csv", batch_size=4, threads=1))
    two = _read_csv(score(exported_model, folder, tmp_path / "two.csv", batch_size=4, threads=2))
    assert len(one) == 24 and one["id"].tolist() == list(range(24))
    assert two[["id", "path", ERR, "Scored Labels"]].equals(
        one[["id", "path", ERR, "Scored Labels"]]
    )
    assert one[ERR].str.len().gt(0).sum() == 1
    np.testing.assert_allclose(two[PROBS].to_numpy(), one[PROBS].to_numpy(), atol=1e-6)


def test_parquet_holds_the_same_table_as_csv(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    val = digits_split[1]
    csv = _read_csv(score(exported_model, val, tmp_path / "s.csv", batch_size=5))
    parquet = pd.read_parquet(score(exported_model, val, tmp_path / "s.parquet", batch_size=7))
    assert list(parquet.columns) == list(csv.columns)
    assert parquet["id"].dtype == np.int64
    pd.testing.assert_frame_equal(parquet, csv, check_exact=False, atol=1e-9)


def test_plain_folder_is_scored_unlabeled_and_a_corrupt_image_is_a_reported_row(
    exported_model: Path,
    digits_raw: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = tmp_path / "photos"
    good = _plain_folder(digits_raw, folder)
    (folder / "batch1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (folder / "notes.txt").write_text("not an image")
    shutil.copyfile(folder / good[0], folder / ".hidden.png")

    with caplog.at_level(logging.WARNING, logger="tasks.inference.score"):
        out = score(exported_model, folder, tmp_path / "plain.parquet", batch_size=2)

    table = pd.read_parquet(out)
    assert list(table.columns) == ["id", "path", ERR, *PROBS, "Scored Labels"]  # no category
    assert sorted(table["path"]) == sorted([*good, "batch1/broken.png"])
    assert table["id"].tolist() == list(range(len(good) + 1))
    broken = table[table["path"] == "batch1/broken.png"].iloc[0]
    assert "UnidentifiedImageError" in broken[ERR]
    assert broken[PROBS].isna().all() and broken["Scored Labels"] == ""
    fine = table[table["path"] != "batch1/broken.png"]
    assert (fine[ERR] == "").all()
    np.testing.assert_allclose(fine[PROBS].sum(axis=1), 1.0, atol=1e-9)
    assert any("batch1/broken.png" in r.getMessage() for r in caplog.records)


def test_nan_and_infinite_scores_are_error_rows_that_evaluate_leaves_out(
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 43: NaN scores were labeled class 0 with no error, and evaluate of such a table
    failed. The model returns NaN for the first image of each batch and +inf for the second;
    each such image is logged with its reason, in the images' order."""
    from tasks.inference.evaluate import table_metrics

    model = hostile_onnx(copy_model(exported_model, tmp_path / "model"), "nan-rows")
    with caplog.at_level(logging.WARNING, logger="tasks.inference.score"):
        out = score(model, digits_split[1], tmp_path / "scores.csv", batch_size=4, threads=1)

    table = _read_csv(out)
    place = table["id"] % 4  # the image's row in its batch
    assert (table.loc[place == 0, ERR] == "NonFiniteScores: the model returned NaN").all()
    infinite = "NonFiniteScores: the model returned an infinite score"
    assert (table.loc[place == 1, ERR] == infinite).all()
    bad = place < 2
    assert table.loc[bad, PROBS].isna().all().all()
    assert (table.loc[bad, "Scored Labels"] == "").all()
    assert (table.loc[~bad, ERR] == "").all()
    np.testing.assert_allclose(table.loc[~bad, PROBS].sum(axis=1), 1.0, atol=1e-9)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Cannot score")]
    lost = zip(table.loc[bad, "path"], table.loc[bad, ERR], strict=True)
    assert warned == [f"Cannot score {path}: {reason}" for path, reason in lost]

    metrics = table_metrics(out).metrics
    assert (metrics["images"], metrics["unscored_images"]) == ((~bad).sum(), bad.sum())
    # A table scored before the fix: the same rows without a reason, labeled "0".
    old = table.assign(**{ERR: table[ERR].where(~bad, "")})
    old.loc[bad, "Scored Labels"] = "0"
    old.to_csv(tmp_path / "old.csv", index=False)
    again = table_metrics(tmp_path / "old.csv").metrics
    assert {k: again[k] for k in ("images", "unscored_images", "accuracy")} == {
        k: metrics[k] for k in ("images", "unscored_images", "accuracy")
    }


def test_failed_scoring_leaves_no_partial_file(exported_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "all-bad"
    folder.mkdir()
    for name in ("a.png", "b.jpg", "c.png"):
        (folder / name).write_bytes(b"garbage")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = out_dir / "scores.csv"
    dest.write_text("previous results\n")

    with pytest.raises(NoUsableImagesError, match="None of the 3 image"):
        score(exported_model, folder, dest, batch_size=2)

    assert dest.read_text() == "previous results\n"  # the old table is untouched
    assert sorted(p.name for p in out_dir.iterdir()) == ["scores.csv"]  # no temp file left


def test_bad_arguments_and_mismatched_model_are_refused_up_front(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    val = digits_split[1]
    with pytest.raises(InvalidParameterError, match="batch_size must be >= 1, got 0"):
        score(exported_model, val, tmp_path / "s.csv", batch_size=0)
    with pytest.raises(InvalidParameterError, match=r"\.csv or \.parquet"):
        score(exported_model, val, tmp_path / "s.xlsx")

    model_dir = copy_model(exported_model, tmp_path / "four-classes")
    info = read_model_info(model_dir)
    info = info.model_copy(update={"classes": [*info.classes, "3"]})
    write_json(model_dir / "model.json", info.model_dump(mode="json"))
    with pytest.raises(InvalidModelDirectoryError, match=r"returns 3 scores.*lists 4 classes"):
        score(model_dir, val, tmp_path / "s.csv")
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_shards_merge_into_the_table_one_pass_writes(
    exported_model: Path, digits_raw: Path, tmp_path: Path, suffix: str
) -> None:
    folder = tmp_path / "photos"
    _plain_folder(digits_raw, folder, count=11)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    whole = score(exported_model, folder, tmp_path / f"whole{suffix}", batch_size=4)

    sharded = score_in_shards(
        exported_model, folder, tmp_path / f"sharded{suffix}", shard_images=5, batch_size=2
    )  # 12 images: shards of 4 (ceil(12 / 5) = 3 shards)

    read = pd.read_parquet if suffix == ".parquet" else _read_csv
    pd.testing.assert_frame_equal(read(sharded), read(whole), check_exact=False, atol=1e-9)
    assert read(sharded)["id"].tolist() == list(range(12))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["photos", f"whole{suffix}", f"sharded{suffix}"]
    )  # no shard folder left behind


@pytest.mark.slow
def test_in_a_flow_the_shards_are_parallel_prefect_tasks(
    prefect_api: None, exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    from prefect import flow

    from flows.score import score_in_flow

    folder = tmp_path / "photos"
    _plain_folder(digits_raw, folder, count=9)
    whole = score(exported_model, folder, tmp_path / "whole.csv")

    @flow(name="score-in-shards")
    def sharded_flow() -> Path:
        return score_in_flow(
            ShardedScoring(exported_model, folder, tmp_path / "sharded.csv", shard_images=3)
        )

    state = sharded_flow(return_state=True)
    pd.testing.assert_frame_equal(_read_csv(state.result()), _read_csv(whole), atol=1e-9)
    task_runs = task_runs_of(state.state_details.flow_run_id, want=3)
    shards = [r for r in task_runs if r.name.startswith("score")]
    assert len(shards) == 3
    assert all(r.state_type.value == "COMPLETED" for r in shards)
    # Submitted together to the flow's thread pool: at least two shards ran at the same time.
    spans = sorted((r.start_time, r.end_time) for r in shards)
    assert any(later[0] < earlier[1] for earlier, later in pairwise(spans))


def test_all_shards_unreadable_is_a_clear_error_and_writes_nothing(
    exported_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "all-bad"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.png").write_bytes(b"garbage")
    with pytest.raises(NoUsableImagesError, match="None of the 4 image"):
        score_in_shards(exported_model, folder, tmp_path / "out.csv", shard_images=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all-bad"]


def test_any_file_name_reads_back_the_same_with_pandas_and_the_csv_module(
    exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    """Names with a carriage return, a newline, a tab, quotes and commas are written quoted
    where they must be; a name that is not UTF-8 is an error row (BadFileName) under its name
    with ``\\xNN`` escapes, and every other image is scored: the table is always written."""
    import csv
    import os

    names = ["a\rb.png", "c\nd.png", "e\tf.png", 'q"uote,comma.png', " lead.png", "plain.png"]
    folder = tmp_path / "photos"
    folder.mkdir()
    scans = sorted(digits_raw.rglob("*.png"))
    for name, scan in zip(names, scans, strict=False):
        shutil.copyfile(scan, folder / name)
    shutil.copyfile(scans[-1], os.fsdecode(os.fsencode(folder) + b"/caf\xe9.png"))  # Latin-1

    out = score(exported_model, folder, tmp_path / "scores.csv", batch_size=4, threads=1)

    expected = sorted([*names, "caf\\xe9.png"])
    table = _read_csv(out)
    with open(out, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(table["path"]) == expected
    assert sorted(row["path"] for row in rows) == expected
    assert table[ERR].tolist() == [row[ERR] for row in rows]
    errors = dict(zip(table["path"], table[ERR], strict=True))
    assert errors.pop("caf\\xe9.png").startswith("BadFileName: the name is not UTF-8")
    assert set(errors.values()) == {""}  # every other name was scored


def test_a_scored_labeled_set_with_newlines_in_names_evaluates_row_for_row(
    exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    """The issue's failure: a `\\r` in a name split a row in two and evaluate then failed."""
    from tasks.data.convert import convert
    from tasks.inference.evaluate import compute_metrics, table_metrics

    raw = tmp_path / "raw"
    for label in ("0", "1", "2"):
        (raw / label).mkdir(parents=True)
        for i, scan in enumerate(sorted((digits_raw / label).glob("*.png"))[:2]):
            shutil.copyfile(scan, raw / label / (f"{label}\r{i}.png" if i else f"{label}\n{i}.png"))
    images = tmp_path / "images"
    manifest = convert(raw, images, workers=1)
    assert len(manifest.images) == 6 and not manifest.skipped

    out = score(exported_model, images, tmp_path / "scores.csv", batch_size=4, threads=1)

    table = _read_csv(out)
    assert sorted(table["path"]) == sorted(e.path for e in manifest.images)
    assert table["category"].tolist() == [p.split("/")[0] for p in table["path"]]
    # every row is one image with its true class, whole or a chunk at a time
    assert sum(map(sum, table_metrics(out).confusion)) == 6
    assert table_metrics(out).metrics == compute_metrics(table).metrics


class _NotingReaders:
    """A first step for a transform, noting in ``folder`` the pid of each process that ran it,
    with the environment's IMAGEOPS_READER_MARK and the folder it ran in."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, image: object) -> object:
        seen = f"{os.environ.get('IMAGEOPS_READER_MARK')} {os.getcwd()}"
        (self.folder / str(os.getpid())).write_text(seen)
        return image


def test_reader_processes_decode_in_order_and_as_one_process_does(
    digits_raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches are decoded by reader processes (issue 45: threads did not scale), whole batches
    each, ahead of the session: tensors, errors and log lines come in the images' order, equal to
    the one-process path's and to the bit what the transform gives image by image (its closing
    normalisation runs once per batch), and torch's thread setting is as it was. The readers see
    the scoring process's environment and folder as they are now, not the fork server's from its
    start (S3 keys set later were not found)."""
    from tasks.inference.score.images import list_images
    from tasks.inference.score.readers import read_batches
    from tasks.shared.fork_server import start_fork_server

    start_fork_server()  # as an earlier scoring or training in this process did
    monkeypatch.setenv("IMAGEOPS_READER_MARK", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)

    folder = tmp_path / "photos"
    _plain_folder(digits_raw, folder, count=9)
    for name in ("a-broken.png", "m-broken.png"):
        (folder / name).write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    refs, _ = list_images(folder)
    transform = build_transform(TransformSpec(resize_size=16, center_crop_size=16), "inference")
    pids = tmp_path / "pids"
    pids.mkdir()
    before = torch.get_num_threads()
    noting = v2.Compose([_NotingReaders(pids), *transform.transforms])
    with read_batches(refs, 4, noting, 2) as batches:
        read = list(batches)
    with read_batches(refs, 4, transform, 0) as batches:
        alone = list(batches)
    assert torch.get_num_threads() == before
    readers = {int(p.name) for p in pids.iterdir()}
    assert len(readers) == 2 and os.getpid() not in readers  # a batch each, in turn
    seen = {p.read_text() for p in pids.iterdir()}
    assert seen == {f"set-after-the-server-started {tmp_path}"}
    assert [start for start, *_ in read] == [0, 4, 8]
    assert [ref.path for _, batch, *_ in read for ref in batch] == [r.path for r in refs]
    for (_, batch, images, kept, errors), (*_, images_alone, kept_alone, errors_alone) in zip(
        read, alone, strict=True
    ):
        for i, ref in enumerate(batch):
            assert ("broken" in ref.path) == (i not in kept) == bool(errors[i])
        expected = np.stack([transform(load_rgb(batch[i].file)).numpy() for i in kept])
        assert np.array_equal(images, expected) and np.array_equal(images_alone, expected)
        assert (kept, errors) == (kept_alone, errors_alone)


def test_a_new_reader_opens_every_format_without_importing_all_of_pillow(
    digits_raw: Path, tmp_path: Path
) -> None:
    """A fresh process (a reader, a loader worker) opens each format scoring reads without Pillow
    importing every plugin it has: that took 0.24 s, at 64 px most of a reader's start."""
    import subprocess
    import sys

    from PIL import Image
    from server_processes import base_env

    from tasks.data.imageformat import PIL_FORMATS

    scan = next(digits_raw.rglob("*.png"))
    files = []
    for name in PIL_FORMATS:
        files.append(tmp_path / f"scan.{name.lower()}")
        Image.open(scan).convert("RGB").save(files[-1], format=name)
    check = (
        "import sys\n"
        "from tasks.data.imagedir import load_rgb\n"
        f"sizes = {{load_rgb(path).size for path in {[str(f) for f in files]}}}\n"
        "print(sizes, sorted(m for m in sys.modules if m.endswith('ImagePlugin')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], env=base_env(), capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith(f"{ {Image.open(scan).size} }") and "PdfImagePlugin" not in out, out


def test_a_script_without_a_main_guard_scores_with_its_readers(
    exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    """A user's script that calls score() at its top level (no ``if __name__ == "__main__":``)
    scores: the reader processes do not import the script again (they ran it, and every reader
    died: "DataLoader worker exited unexpectedly")."""
    import subprocess
    import sys

    from server_processes import base_env

    folder = tmp_path / "photos"
    _plain_folder(digits_raw, folder, count=6)
    script = tmp_path / "score_photos.py"
    script.write_text(
        "from tasks.inference.score import score\n"
        f"score({str(exported_model)!r}, {str(folder)!r}, {str(tmp_path / 'out.csv')!r},"
        " batch_size=2, threads=2)\n"
        "print('scored')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], env=base_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("scored") == 1  # the top level ran once, not again in a reader
    assert len(pd.read_csv(tmp_path / "out.csv")) == 6


def test_shards_scored_in_turn_share_one_session_per_model_file(
    exported_model: Path, tmp_path: Path
) -> None:
    from tasks.inference.score import inference_session, sessions_reused

    onnx_path = tmp_path / ONNX
    shutil.copy2(exported_model / ONNX, onnx_path)
    assert inference_session(onnx_path) is not inference_session(onnx_path)  # outside a block
    with sessions_reused():
        first = inference_session(onnx_path)
        assert inference_session(onnx_path) is first
        assert inference_session(onnx_path, threads=1) is not first  # other settings
        onnx_path.write_bytes(onnx_path.read_bytes())  # rewritten: another model, maybe
        again = inference_session(onnx_path)
        assert again is not first
        assert inference_session(onnx_path) is again
    assert inference_session(onnx_path) is not again  # the block's sessions are gone with it

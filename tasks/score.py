"""Score Image Model: run a model's ``model.onnx`` over a folder of images, in batches.

The images go through the inference mode of the transform spec the model was trained with
(:func:`tasks.transform.build_transform`), so scoring sees exactly what training validated on.
Images are read, scored and written a batch at a time: memory stays flat however large the
folder, and the table grows on disk in a temporary file that replaces ``dest`` only when every
batch is done. An image that does not load is skipped and logged; it never fails the batch.

The output is the Score Image Model table: ``id``, ``path``, ``category`` (the true class, only
when the input is labeled), one ``Scored Probabilities_<class>`` column per class (softmax), then
``Scored Labels``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from models.atomic import atomic_file
from models.directory import ONNX, ModelInfo, read_model_info
from tasks.errors import InvalidModelDirectoryError, InvalidParameterError, NoUsableImagesError
from tasks.export import INPUT_NAME, OUTPUT_NAME
from tasks.imagedir import IMAGE_EXTENSIONS, MANIFEST, is_image_file, load_rgb, read_manifest
from tasks.step import step, step_logger
from tasks.transform import build_transform, input_size

PROBABILITY_PREFIX = "Scored Probabilities_"
LABEL_COLUMN = "Scored Labels"
OUTPUT_SUFFIXES = (".csv", ".parquet")
ROW_GROUP_ROWS = 16_384


@dataclass(frozen=True)
class ImageRef:
    """One image to score: where it is, how the table names it, its true class if known."""

    file: Path
    path: str
    category: str | None


def list_images(images: Path) -> tuple[list[ImageRef], bool]:
    """The images to score, in a stable order, and whether they are labeled.

    An ImageDirectory is read from its manifest (labeled ones carry the true class); any other
    folder is walked recursively for image extensions, hidden files left out, and is unlabeled.
    """
    images = Path(images)
    if not images.is_dir():
        raise NoUsableImagesError(
            f"{images} is not a folder.", "Pass an ImageDirectory or a folder of images."
        )
    if (images / MANIFEST).is_file():
        manifest = read_manifest(images)
        refs = [
            ImageRef(
                file=images / entry.path,
                path=entry.path,
                category=manifest.classes[entry.label] if manifest.labeled else None,
            )
            for entry in manifest.images
        ]
        return refs, manifest.labeled
    files = sorted(
        p
        for p in images.rglob("*")
        if p.is_file()
        and is_image_file(p)
        and not any(part.startswith(".") for part in p.relative_to(images).parts)
    )
    return [
        ImageRef(file=p, path=p.relative_to(images).as_posix(), category=None) for p in files
    ], False


def default_threads() -> int:
    """The cores this process may run on (the container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def inference_session(onnx_path: Path, threads: int | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session tuned for batch scoring.

    All graph optimisations; intra-op threads = the cores we may use (ORT's default can count the
    host's cores inside a container); CUDA first when this onnxruntime build has it, CPU always
    as the fallback.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads or default_threads()
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(onnx_path), sess_options=options, providers=providers)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def _check_model(session: ort.InferenceSession, info: ModelInfo, onnx_path: Path) -> None:
    """Refuse a model.json that does not describe this model.onnx, before any image is read."""
    (inp,) = session.get_inputs()
    (out,) = session.get_outputs()
    side = input_size(info.transform)
    hint = "Export the model again so model.onnx and model.json agree."
    if inp.shape[1:] != [3, side, side]:
        raise InvalidModelDirectoryError(
            f"{onnx_path} takes input {inp.shape}, but model.json's transform makes "
            f"{side}x{side} images.",
            hint,
        )
    if out.shape[-1] != len(info.classes):
        raise InvalidModelDirectoryError(
            f"{onnx_path} returns {out.shape[-1]} scores, but model.json lists "
            f"{len(info.classes)} classes.",
            hint,
        )


def _batches(refs: list[ImageRef], size: int) -> Iterator[list[ImageRef]]:
    for start in range(0, len(refs), size):
        yield refs[start : start + size]


class _TableWriter:
    """Appends batches to a CSV or Parquet file, so no more than one batch is ever held."""

    def __init__(self, path: Path, parquet: bool, columns: list[str], labeled: bool) -> None:
        self.path, self.parquet, self.columns = path, parquet, columns
        self._parquet: pq.ParquetWriter | None = None
        self._pending: list[pd.DataFrame] = []
        self._csv = None
        if parquet:
            fields = [pa.field("id", pa.int64()), pa.field("path", pa.string())]
            if labeled:
                fields.append(pa.field("category", pa.string()))
            fields += [
                pa.field(c, pa.float64()) for c in columns if c.startswith(PROBABILITY_PREFIX)
            ]
            fields.append(pa.field(LABEL_COLUMN, pa.string()))
            self.schema = pa.schema(fields)
            self._parquet = pq.ParquetWriter(str(path), self.schema)
        else:
            self._csv = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115
            pd.DataFrame(columns=columns).to_csv(self._csv, index=False)

    def write(self, frame: pd.DataFrame) -> None:
        if self._parquet is None:
            frame.to_csv(self._csv, header=False, index=False)
            return
        # Rows (not images) are buffered into row groups of a useful size: one tiny row group
        # per batch would make the file slow to read.
        self._pending.append(frame)
        if sum(len(f) for f in self._pending) >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._parquet is not None and self._pending:
            frame = pd.concat(self._pending, ignore_index=True)
            self._pending = []
            table = pa.Table.from_pandas(frame, schema=self.schema, preserve_index=False)
            self._parquet.write_table(table)

    def close(self) -> None:
        if self._parquet is not None:
            self._flush()
            self._parquet.close()
        if self._csv is not None:
            self._csv.flush()
            os.fsync(self._csv.fileno())
            self._csv.close()


def _progress(total: int) -> contextlib.AbstractContextManager:
    """A rich progress bar when a person is watching stderr; nothing in logs and CI."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def score(
    model: Path,
    images: Path,
    dest: Path,
    *,
    batch_size: int = 64,
    threads: int | None = None,
) -> Path:
    """Score ``images`` with the exported ModelDirectory ``model``; write the table to ``dest``.

    ``images``: an ImageDirectory (labeled: the true ``category`` is passed through) or any folder
    of images (searched recursively). ``dest`` ends in ``.csv`` or ``.parquet``. ``threads``:
    ONNX Runtime intra-op threads (default: the cores available). Returns ``dest``, written
    atomically. Raises NoUsableImagesError when no image could be scored.
    """
    model, images, dest = Path(model), Path(images), Path(dest)
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}.")
    if threads is not None and threads < 1:
        raise InvalidParameterError(
            f"threads must be >= 1 (or unset for all cores), got {threads}."
        )
    if dest.suffix.lower() not in OUTPUT_SUFFIXES:
        raise InvalidParameterError(
            f"dest must end in .csv or .parquet, got {dest.name!r}.",
            "Name the scored table scores.csv or scores.parquet.",
        )
    info = read_model_info(model)
    onnx_path = model / ONNX
    if not onnx_path.is_file():
        raise InvalidModelDirectoryError(
            f"{model} has no {ONNX}.", "Run the export step first (tasks.export.export_onnx)."
        )
    refs, labeled = list_images(images)
    if not refs:
        raise NoUsableImagesError(
            f"No image found in {images}.",
            f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
        )
    session = inference_session(onnx_path, threads)
    _check_model(session, info, onnx_path)
    log = step_logger(__name__)
    if labeled:
        unknown = sorted({r.category for r in refs} - set(info.classes))
        if unknown:
            log.warning("Classes the model does not know (always scored wrong): %s", unknown)

    transform = build_transform(info.transform, "inference")
    prob_columns = [f"{PROBABILITY_PREFIX}{c}" for c in info.classes]
    columns = ["id", "path", *(["category"] if labeled else []), *prob_columns, LABEL_COLUMN]
    classes = np.asarray(info.classes, dtype=object)
    scored, skipped = 0, 0
    with atomic_file(dest) as tmp, _progress(len(refs)) as progress:
        bar = progress.add_task("Scoring", total=len(refs)) if progress else None
        writer = _TableWriter(tmp, dest.suffix.lower() == ".parquet", columns, labeled)
        try:
            for batch in _batches(refs, batch_size):
                tensors, kept = [], []
                for ref in batch:
                    try:
                        tensors.append(transform(load_rgb(ref.file)).numpy())
                    except Exception as exc:  # one bad file must not sink the other images
                        skipped += 1
                        log.warning("Skipped %s: %s: %s", ref.path, type(exc).__name__, exc)
                        continue
                    kept.append(ref)
                if kept:
                    (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: np.stack(tensors)})
                    probs = _softmax(logits)
                    data = {
                        "id": np.arange(scored, scored + len(kept), dtype=np.int64),
                        "path": [r.path for r in kept],
                        "category": [r.category for r in kept],
                    }
                    data |= {col: probs[:, i] for i, col in enumerate(prob_columns)}
                    data[LABEL_COLUMN] = classes[probs.argmax(axis=1)]
                    writer.write(pd.DataFrame({c: data[c] for c in columns}, columns=columns))
                    scored += len(kept)
                if bar is not None:
                    progress.advance(bar, len(batch))
        finally:
            writer.close()
        if not scored:
            raise NoUsableImagesError(
                f"None of the {len(refs)} image(s) in {images} could be read; nothing scored.",
                "Check the files open in an image viewer (the log names each one).",
            )
    log.info("Scored %d image(s) into %s (%d skipped)", scored, dest, skipped)
    return dest


score_task = step(score, name="score")

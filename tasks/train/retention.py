"""What training leaves on disk once a run is done, and what of it may go.

A FINISHED run is never continued (:func:`tasks.train.mlflow_run.resume_or_create_run`), so its
checkpoint and best weights are dead weight: the model folder holds the best weights and MLflow the
metrics, curves and logs. They are removed as the run ends (:func:`discard_checkpoints`) unless
``IMAGEOPS_KEEP_CHECKPOINTS`` is set; FAILED and KILLED runs keep them to resume. ``imageops gc``
also removes whole FINISHED run folders and old outputs folders, never one a launcher holds.
Details: docs/training.md#disk-space.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from models.atomic import remove_leftovers
from models.locks import acquire
from tasks.data.datasets import dataset_in_use
from tasks.shared.errors import InvalidParameterError, ObjectStoreError, RegistryUnreachableError
from tasks.shared.reclaim import Reclaimable, disk_size, newest_change, trash
from tasks.shared.settings import Settings, redact_uri
from tasks.shared.step import step_logger
from tasks.train.params import RunConfig
from tasks.train.run_folder import BEST_WEIGHTS, CHECKPOINT
from tasks.train.run_lock import LAUNCH_LOCK, in_training
from tasks.train.tracker import transient

RUN_FOLDER = "run folder"
OUTPUTS = "outputs"
# flows/pipeline.py names its outputs folder <UTC time>-<data set>-<flow run id[:8]>.
_PIPELINE_OUTPUTS = re.compile(r"^\d{8}-\d{6}-(?P<dataset>.+)-[0-9a-f]{8}$")


def discard_checkpoints(run_id: str, run_dir: Path, settings: Settings) -> int:
    """Remove a FINISHED run's checkpoint and best weights, here and in the checkpoint store.

    Returns the bytes freed in the run folder. Call it only once MLflow has the run FINISHED.
    A store that does not answer is a warning, not an error: the training itself succeeded.
    """
    from tasks.train.checkpoint_store import discard_stored_checkpoint  # boto3: on first use

    if settings.keep_checkpoints:
        return 0
    # The checkpoint first: a folder with best weights and no checkpoint starts over; the other
    # way round a resume would find a checkpoint whose best weights are gone.
    names = [CHECKPOINT, BEST_WEIGHTS]
    freed = 0
    for name in names:
        path = run_dir / name
        freed += disk_size(path)
        path.unlink(missing_ok=True)
        remove_leftovers(path)  # the temporary file of a write that was killed
    log = step_logger(__name__)
    try:
        discard_stored_checkpoint(run_id, names, settings)
    except ObjectStoreError as exc:
        log.warning("the stored checkpoint of finished run %s stays: %s", run_id, exc.message)
    if freed:
        log.info(
            "run %s is FINISHED: removed its checkpoint and best weights (%.1f MB); set "
            "IMAGEOPS_KEEP_CHECKPOINTS=true to keep them",
            run_id,
            freed / 1e6,
        )
    return freed


def _tracking_down(settings: Settings, exc: Exception) -> RegistryUnreachableError:
    return RegistryUnreachableError(
        f"MLflow at {redact_uri(settings.tracking_uri)} did not answer: {redact_uri(str(exc))}",
        "Check that the tracking server runs and IMAGEOPS_MLFLOW_TRACKING_URI, then run "
        "`imageops gc` again; nothing was removed.",
    )


def _run_folders(settings: Settings) -> Iterator[Path]:
    if not settings.runs_dir.is_dir():
        return
    for entry in sorted(settings.runs_dir.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith("."):
            yield entry


def finished_run_folders(settings: Settings) -> list[Reclaimable]:
    """The run folders of FINISHED MLflow runs that no launcher holds.

    A run MLflow does not know (another tracking server's) and every unfinished run is kept: an
    unfinished one resumes from its folder.
    """
    folders = list(_run_folders(settings))
    if not folders:  # then no MLflow store to open (or, on a new project, to create)
        return []
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    found = []
    for run_dir in folders:
        if in_training(run_dir):
            continue
        try:
            status = client.get_run(run_dir.name).info.status
        except MlflowException as exc:
            if transient(exc):
                raise _tracking_down(settings, exc) from None
            continue
        except OSError as exc:
            raise _tracking_down(settings, exc) from None
        if status != "FINISHED":
            continue
        found.append(
            Reclaimable.at(
                RUN_FOLDER,
                run_dir,
                "its MLflow run is FINISHED (its logs and curves are in MLflow)",
                partial(remove_run_folder, run_dir),
            )
        )
    return found


def remove_run_folder(run_dir: Path) -> bool:
    """Remove ``run_dir`` holding its launch lock; False (kept) when a launcher holds it now."""
    busy = InvalidParameterError(f"{run_dir} is being trained.")
    try:
        lock = acquire(run_dir / LAUNCH_LOCK, 0, busy)
    except InvalidParameterError:
        return False
    try:
        trash(run_dir)
    finally:
        lock.release()
    return True


def _outputs_in_training(settings: Settings) -> set[Path]:
    """The outputs folders that a run being trained now writes its model into."""
    from tasks.train.request import CONFIG  # here: it imports torchvision, rarely needed

    root = settings.outputs_dir.resolve()
    busy = set()
    for run_dir in _run_folders(settings):
        if not in_training(run_dir) or not (run_dir / CONFIG).is_file():
            continue
        try:
            out = RunConfig.load(run_dir / CONFIG).out.resolve()
        except (OSError, ValueError):
            continue
        if out.is_relative_to(root) and out != root:
            busy.add(root / out.relative_to(root).parts[0])
    return busy


def _pipeline_running(settings: Settings, folder: Path) -> bool:
    """A pipeline's outputs folder (``<time>-<data set>-<id>``) while a run holds its data set.

    The pipeline holds the data set from convert to its last step, so its outputs are in use
    even when no training runs. Another run of the same data set keeps it too: on the safe side.
    """
    match = _PIPELINE_OUTPUTS.match(folder.name)
    return match is not None and dataset_in_use(settings, match["dataset"])


def old_outputs(settings: Settings, older_than_s: float) -> list[Reclaimable]:
    """The outputs folders unchanged for ``older_than_s`` seconds that no run writes to.

    A registered version never needs them: registering copies the model into MLflow's artifact
    store. Kept: the folder a run being trained writes its model into, a pipeline's while it holds
    its data set, and any folder changed within ``older_than_s`` (a train flow still exporting).
    """
    root = settings.outputs_dir
    if not root.is_dir():
        return []
    busy = _outputs_in_training(settings)
    now = time.time()
    found = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink() or entry.name.startswith("."):
            continue
        if entry.resolve() in busy or _pipeline_running(settings, entry):
            continue
        age = now - newest_change(entry)
        if age < older_than_s:
            continue
        found.append(
            Reclaimable.at(
                OUTPUTS,
                entry,
                f"unchanged for {age / 86400:.1f} days",
                partial(_remove_outputs, entry, settings),
            )
        )
    return found


def _remove_outputs(folder: Path, settings: Settings) -> bool:
    if folder.resolve() in _outputs_in_training(settings) or _pipeline_running(settings, folder):
        return False
    trash(folder)
    return True

"""A training as a person watching the Prefect UI sees it: its own lines as they happen, a
progress artifact that moves, and an end line in words.

torchrun's output goes to the console and to torchrun.log (:func:`tasks.train.torchrun.run_torchrun`
copies it line by line); inside a Prefect run each line of rank 0 that tells where training stands
(its start, a few progress lines per epoch, each epoch's summary, early stopping, the model written)
is logged to the run too, and moves the run's ``training-progress`` artifact. Outside a Prefect run
nothing more happens: the console already shows every line. Details: docs/training.md#watching.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any
from uuid import UUID

from tasks.shared.step import in_prefect_run, step_logger

PROGRESS_KEY = "training-progress"  # the progress artifact's key (the Artifacts page lists it)

# "<time> rank 0 INFO <message>": the worker's log format (tasks.train.worker).
_RANK_0 = re.compile(r" rank 0 INFO (.*)$")
# What a person watching is told: the start, progress lines, epoch lines, why it stops, the model.
_SHOWN = re.compile(r"^(training |resumed |epoch \d+/\d+|early stop|pruned|wrote the model)")
_STEP = re.compile(r"^epoch (\d+)/(\d+) \[(\d+)/(\d+)\]")  # a progress line inside an epoch
_EPOCH = re.compile(r"^epoch (\d+)/(\d+): train loss")  # an epoch's summary: the epoch is done


def progress_of(message: str) -> float | None:
    """Percent of the training done that a rank-0 line reports, or None if it reports none."""
    step = _STEP.match(message)
    if step:
        epoch, epochs, done, steps = map(int, step.groups())
        return 100.0 * (epoch - 1 + done / max(steps, 1)) / max(epochs, 1)
    end = _EPOCH.match(message)
    if end:
        epoch, epochs = map(int, end.groups())
        return 100.0 * epoch / max(epochs, 1)
    return None


class TrainingWatch:
    """Called with each line torchrun prints (from the thread that copies them)."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter, artifact: UUID | None) -> None:
        self.log = log
        self.artifact = artifact
        self.shown = 0.0  # the progress the artifact shows
        self.lock = threading.Lock()

    @classmethod
    def start(cls, what: str) -> TrainingWatch | None:
        """A watch for the training of ``what`` in this Prefect run (its progress artifact at 0%),
        or None outside one."""
        if not in_prefect_run():
            return None
        from prefect.artifacts import create_progress_artifact

        log = step_logger(__name__)
        try:
            artifact = create_progress_artifact(
                0.0, key=PROGRESS_KEY, description=f"Training {what}: epochs done, in percent."
            )
        except Exception as exc:  # the API is away: the training goes on, its lines still logged
            log.warning("no progress artifact for this training: %s", exc)
            artifact = None
        return cls(log, artifact)

    def __call__(self, line: str) -> bool:
        """Log ``line`` to the run if it tells where training stands; returns whether it did."""
        found = _RANK_0.search(line.rstrip("\n"))
        if found is None or not _SHOWN.match(found.group(1)):
            return False
        message = found.group(1)
        self.log.info(message)
        progress = progress_of(message)
        if progress is not None:
            self.move(progress)
        return True

    def move(self, progress: float) -> None:
        """Show ``progress`` (percent) on the artifact. A failed update loses the artifact's
        step, never the training: the Prefect API may be restarting."""
        with self.lock:
            if self.artifact is None or progress <= self.shown:
                return
            from prefect.artifacts import update_progress_artifact

            try:
                update_progress_artifact(self.artifact, round(progress, 1))
            except Exception as exc:  # the API is away; the log line says it, training goes on
                self.log.debug("progress artifact not updated: %s", exc)
                return
            self.shown = progress


def finished_line(result: dict[str, Any]) -> str:
    """The end of a training in words: the epoch kept and its figures, rounded."""
    metrics = result.get("metrics", {})
    parts = [
        f"{label} {metrics[key]:.2%}" if percent else f"{label} {metrics[key]:.4g}"
        for key, label, percent in (
            ("val/top1", "validation top-1", True),
            ("val/top5", "top-5", True),
            ("val/loss", "validation loss", False),
            ("train/loss", "training loss", False),
        )
        if key in metrics
    ]
    trained = result.get("epochs_trained")
    epochs = f" of {trained} trained" if trained else ""
    how = " (stopped early)" if result.get("stopped_early") else ""
    how = " (pruned)" if result.get("pruned") else how
    return (
        f"training finished{how}: kept epoch {result.get('best_epoch', '?')}{epochs}, "
        + ", ".join(parts)
    )

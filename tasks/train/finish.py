"""Rank 0's last job: the best weights become the ModelDirectory; the curves and the summary go
to the run folder, for the launcher to send to MLflow (it outlasts a tracking outage)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from models.atomic import write_json
from models.directory import ModelInfo, save_model_directory
from tasks.shared.errors import TrainingFailedError
from tasks.train.curves import plot_curves
from tasks.train.params import RunConfig
from tasks.train.progress import Progress
from tasks.train.run_folder import CURVES, RESULT

log = logging.getLogger("imageops.train")


def write_model(
    config: RunConfig,
    model: nn.Module,
    best_state: dict[str, torch.Tensor] | None,
    progress: Progress,
    result: dict[str, Any],
) -> None:
    """Write ``config.out`` from the best weights, then the curves and ``result.json``."""
    if best_state is None:
        raise TrainingFailedError(
            f"No best weights in {config.run_dir} to write the model from.",
            "Start a new run; this run folder is incomplete.",
        )
    model.load_state_dict(best_state)
    params = config.params
    info = ModelInfo(
        architecture=config.architecture,
        classes=config.classes,
        transform=config.transform,
        train_params={
            **params.model_dump(mode="json"),
            "world_size": config.world_size,
            "device": config.device,
            "effective_learning_rate": params.learning_rate * config.world_size,
        },
        metrics={**result["metrics"], "epochs_trained": progress.epoch},
        data_version=dict(config.data_version),
        mlflow_run_id=config.mlflow_run_id,
        best_epoch=progress.best_epoch,
    )
    save_model_directory(config.out, model, info)
    log.info("wrote the model of epoch %d to %s", progress.best_epoch, config.out)
    plot_curves(progress.history, config.run_dir / CURVES)
    write_json(config.run_dir / RESULT, result)

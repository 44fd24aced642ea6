"""Train PyTorch Model: Azure's refusals before anything starts, real torchrun runs on gloo
tracked in a real MLflow (SQLite), reproducibility, and the pieces a resumed run relies on."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file
from training_runs import FAST, PRE, run_train

from models.directory import load_model_directory
from models.untrained import MODEL_JSON, resnet, write_untrained
from models.zoo import PretrainedWeightsMissingError
from tasks.data.convert import convert
from tasks.data.imagedir import read_manifest
from tasks.shared import faults
from tasks.shared.errors import (
    InvalidDatasetError,
    InvalidImageDirectoryError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    NotLabeledDatasetError,
    TrainingFailedError,
)
from tasks.shared.file_hash import file_sha256
from tasks.shared.settings import Settings
from tasks.train.checkpoint import load_checkpoint, save_checkpoint
from tasks.train.data import ManifestImageFolder
from tasks.train.failure import read_failures, record_failure
from tasks.train.launch import TrainResult, train
from tasks.train.loop import METRICS
from tasks.train.params import TrainParams
from tasks.train.request import TrainRequest
from tasks.train.run_folder import CHECKPOINT
from tasks.train.run_lock import output_lock
from tasks.train.torchrun import run_torchrun, torchrun_command

pytest_plugins = ["training_runs"]


def assert_nothing_started(settings: Settings) -> None:
    """No run folder and no MLflow store: the refusal came before any process or run."""
    assert not settings.runs_dir.exists()
    assert not (settings.home_dir / "mlflow.db").exists()


# --- Azure's refusals, all before torchrun starts ----------------------------------------


def test_unlabeled_training_data_is_refused(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for image in sorted((digits_split[0] / "0").iterdir())[:10]:
        shutil.copy(image, flat / image.name)
    convert(flat, tmp_path / "unlabeled")
    with pytest.raises(NotLabeledDatasetError, match="not labeled"):
        run_train(project, untrained, (tmp_path / "unlabeled", digits_split[1]), tmp_path / "out")
    assert_nothing_started(project)


def test_validation_with_other_classes_is_refused(
    project: Settings,
    untrained: Path,
    digits_raw: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    two = tmp_path / "two"
    for label in ("0", "1"):
        shutil.copytree(digits_raw / label, two / label)
    convert(two, tmp_path / "val2")
    with pytest.raises(InvalidDatasetError, match=r"only in training: \['2'\]"):
        run_train(project, untrained, (digits_split[0], tmp_path / "val2"), tmp_path / "out")
    assert_nothing_started(project)


@pytest.mark.parametrize(
    "model_json",
    [
        None,
        '{"format": "imageops.UntrainedModelDirectory", '
        '"family": "resnet", "arch": "resnet9000", '
        '"pretrained": false}',
    ],
    ids=["empty", "unknown"],
)
def test_a_bad_model_directory_is_refused(
    model_json: str | None, project: Settings, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    if model_json:
        (folder / MODEL_JSON).write_text(model_json)
    with pytest.raises(InvalidModelDirectoryError):
        run_train(project, folder, digits_split, tmp_path / "out")
    assert_nothing_started(project)


def test_a_batch_larger_than_the_training_set_is_refused(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    images = len(read_manifest(digits_split[0]).images)
    with pytest.raises(InvalidParameterError) as err:
        run_train(project, untrained, digits_split, tmp_path / "out", batch_size=images + 1)
    assert f"batch_size = {images + 1}" in str(err.value)
    assert f"({images} images)" in str(err.value)
    assert_nothing_started(project)


def test_a_second_training_into_an_output_being_written_is_refused(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two `imageops train` into one folder: the later is refused while the first holds it
    (both used to end well, the first's model silently replaced)."""
    out = tmp_path / "out"
    # the lock the first training holds until it ends
    with output_lock(out, project), pytest.raises(InvalidParameterError) as err:
        run_train(project, untrained, digits_split, out)
    assert f"{out.resolve()} is being written by another training" in err.value.message
    assert "another output folder" in err.value.hint
    assert_nothing_started(project)


def test_a_bad_parameter_is_refused_naming_value_and_range(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError, match=r"epochs = 0, expected an integer > 0"):
        run_train(project, untrained, digits_split, tmp_path / "out", epochs=0)
    # A plain dict (as a form or a CLI sends it) is checked the same way.
    with pytest.raises(InvalidParameterError, match=r"epochs = 0"):
        TrainRequest(
            model=untrained,
            train_data=digits_split[0],
            val_data=digits_split[1],
            out=tmp_path / "out",
            params={"epochs": 0},
        )
    assert_nothing_started(project)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError, match=r"device = 'cuda'.*\(0 GPUs\)"):
        run_train(project, untrained, digits_split, tmp_path / "out", device="cuda")
    assert_nothing_started(project)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_more_processes_than_gpus_is_refused(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    gpus = torch.cuda.device_count()
    with pytest.raises(InvalidParameterError) as err:
        run_train(
            project,
            untrained,
            digits_split,
            tmp_path / "out",
            device="cuda",
            nproc_per_node=gpus + 1,
        )
    assert f"nproc_per_node = {gpus + 1}" in str(err.value)
    assert f"the {gpus} GPU(s)" in str(err.value)
    assert_nothing_started(project)


def test_missing_pretrained_weights_are_refused_before_start(
    project: Settings,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("https_proxy", "HTTPS_PROXY"):  # no network, deterministically
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    pretrained = write_untrained(resnet("resnet18", pretrained=True), tmp_path / "pretrained")
    with pytest.raises(PretrainedWeightsMissingError, match=str(project.torch_home)):
        run_train(project, pretrained, digits_split, tmp_path / "out")
    assert_nothing_started(project)


# --- parameters -------------------------------------------------------------------------------


def test_parameter_defaults_are_the_seeds() -> None:
    """The Azure design's defaults, with the recipe fields filled by `--recipe azure` (the
    default recipe is modern: tests/test_recipes.py)."""
    assert TrainParams(recipe="azure").resolved().model_dump() == {
        "epochs": 5,
        "batch_size": 16,
        "recipe": "azure",
        "optimizer": "sgd",
        "schedule": "poly",
        "warmup_epochs": 0,
        "learning_rate": 0.001,
        "momentum": 0.9,
        "weight_decay": 0.0001,
        "decay_norm_and_bias": True,
        "mixup_alpha": 0.0,
        "cutmix_alpha": 0.0,
        "accumulation_steps": 1,
        "ema_decay": 0.0,
        "clip_grad_norm": 0.0,
        "class_weights": "none",
        "head_only_epochs": 0,
        "backbone_lr_scale": 1.0,
        "label_smoothing": 0.0,
        "seed": 1,
        "patience": 3,
        "print_frequency": 10,
        "nodes": 1,
        "nproc_per_node": 1,
        "device": "auto",
        "precision": "auto",
        "num_workers": None,
        "compile": False,  # measured slower on CPU (docs/training.md): off
        "cluster": None,  # torchrun on this machine
        "cluster_timeout_s": 180,  # waits of minutes, not torch's 10
        "rdzv_timeout_s": 180,
    }
    schema = TrainParams.model_json_schema()["properties"]  # what the Prefect form shows
    assert all(field.get("title") and field.get("description") for field in schema.values())


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("epochs", 0, "an integer > 0"),
        ("batch_size", -1, "an integer > 0"),
        ("warmup_epochs", -1, "an integer from 0 to 10000"),
        ("learning_rate", 0.0, "a finite number > 0"),
        ("learning_rate", math.nan, "a finite number > 0"),
        ("momentum", 1.0, "a finite number >= 0 and < 1"),
        ("weight_decay", -0.1, "a finite number >= 0"),
        ("patience", 0, "an integer > 0"),
        ("print_frequency", 0, "an integer > 0"),
        ("nodes", 0, "an integer >= 1"),
        ("nproc_per_node", 0, "an integer >= 1"),
        ("device", "tpu", "one of 'auto', 'cpu', 'cuda'"),
        ("precision", "fp8", "one of 'auto', 'fp32', 'bf16', 'fp16'"),
        ("epochs", 2.5, "an integer > 0"),
    ],
)
def test_out_of_range_values_name_parameter_value_and_range(
    name: str, value: object, expected: str
) -> None:
    with pytest.raises(InvalidParameterError) as err:
        TrainParams.checked(**{name: value})
    assert f"{name} = {value!r}, expected {expected}" in str(err.value)


def test_unknown_parameters_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match=r"unknown parameter 'epoch'.*Known parameters"):
        TrainParams.checked(epoch=3)


# --- the pieces a worker and a resumed run rely on --------------------------------------------


def test_checkpoint_loads_with_weights_only_and_refuses_another_job(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / CHECKPOINT,
        {
            "config_digest": "abc",
            "config": {"params": {"epochs": 2}, "classes": ["a", "b"]},
            "epoch": 1,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "progress": {"history": [{"val/loss": 0.5}], "best_val_loss": math.inf},
        },
    )
    state = load_checkpoint(path, "abc")
    assert state is not None and state["epoch"] == 1
    assert torch.equal(state["model"]["weight"], model.weight)
    restored = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    restored.load_state_dict(state["optimizer"])
    assert load_checkpoint(tmp_path / "none.pt", "abc") is None
    with pytest.raises(TrainingFailedError, match="different training configuration"):
        load_checkpoint(path, "another job")
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary file left

    # Truncated (a full disk, a copy cut short) or overwritten: named, with the way to start over.
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"", b"not a checkpoint at all"):
        path.write_bytes(damaged)
        with pytest.raises(TrainingFailedError) as refused:
            load_checkpoint(path, "abc")
        assert f"The checkpoint {path} cannot be read" in refused.value.message
        assert f"rm {path}" in refused.value.hint and "afresh" in refused.value.hint


def test_image_folder_follows_the_manifest(digits_split: tuple[Path, Path], tmp_path: Path) -> None:
    root = shutil.copytree(digits_split[1], tmp_path / "val")
    manifest = read_manifest(root)
    stray = root / "1" / "stray.png"
    shutil.copy(root / manifest.images[0].path, stray)  # not in the manifest: not read
    data = ManifestImageFolder(root, manifest)
    assert data.class_to_idx == {"0": 0, "1": 1, "2": 2}
    assert len(data) == len(manifest.images)
    assert all(Path(p) != stray for p, _ in data.samples)
    (root / manifest.images[-1].path).unlink()
    with pytest.raises(InvalidImageDirectoryError, match="no longer matches its manifest"):
        ManifestImageFolder(root, manifest)


def test_worker_errors_cross_the_process_boundary_as_themselves(tmp_path: Path) -> None:
    record_failure(tmp_path, 1, 0, RuntimeError("segfault-ish"))
    record_failure(tmp_path, 0, 0, InvalidDatasetError("bad data", "fix it"))
    first, second = read_failures(tmp_path)
    error = first.as_error()
    assert isinstance(error, InvalidDatasetError) and str(error) == "bad data fix it"
    assert second.as_error() is None  # not a user error: the launcher quotes the log instead


def test_a_timeout_stops_the_whole_process_tree(tmp_path: Path) -> None:
    # A child in a session of its own, like torchrun's workers: killpg alone would miss it.
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(TrainingFailedError, match="longer than timeout_s"):
        run_torchrun([sys.executable, "-c", script], {}, tmp_path, timeout_s=3)
    assert time.monotonic() - start < 30
    grandchild = int((tmp_path / "torchrun.log").read_text().split()[0])
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == "zombie"


# --- real torchrun runs -----------------------------------------------------------------------


def assert_a_whole_two_process_run(project: Settings, result: TrainResult, epochs: int) -> None:
    """What a 2-process gloo run of ``epochs`` epochs leaves: a ModelDirectory that predicts, one
    MLflow run (not one per rank) with every metric of every epoch, params, both ranks' logs and
    the curves, and no checkpoint left. Call it before any other run of the project."""
    model, info = load_model_directory(result.model_dir)
    assert info.classes == ["0", "1", "2"]
    assert info.mlflow_run_id == result.run_id
    assert info.train_params["world_size"] == 2
    assert info.train_params["effective_learning_rate"] == pytest.approx(0.02)
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 16, 16)).shape == (1, 3)

    client = MlflowClient(project.tracking_uri)
    experiment = client.get_experiment_by_name(project.mlflow_experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [result.run_id]  # one run, not one per rank
    run = runs[0]
    assert run.info.status == "FINISHED"
    for name in METRICS:
        history = client.get_metric_history(result.run_id, name)
        assert sorted(m.step for m in history) == list(range(1, epochs + 1)), name
        assert all(math.isfinite(m.value) for m in history)
    top1 = {m.step: m.value for m in client.get_metric_history(result.run_id, "val/top1")}
    # the best epoch's model was kept (MLflow holds 7 significant digits: tracking.logged_value)
    assert result.metrics["val/top1"] == pytest.approx(max(top1.values()), rel=1e-6)
    assert top1[info.best_epoch] == pytest.approx(result.metrics["val/top1"], rel=1e-6)
    assert run.data.params["epochs"] == str(epochs)
    assert run.data.params["batch_size"] == "8"
    assert run.data.params["world_size"] == "2"
    logs = {Path(a.path).name for a in client.list_artifacts(result.run_id, "logs")}
    assert {"rank_0.log", "rank_1.log"} <= logs
    assert "training_curves.png" in {a.path for a in client.list_artifacts(result.run_id)}

    assert result.run_dir == project.runs_dir / result.run_id
    assert "rank 1 " in (result.run_dir / "rank_1.log").read_text()
    # FINISHED: nothing resumes it, so its checkpoint and best weights are gone (retention).
    assert not (result.run_dir / CHECKPOINT).exists()
    assert (result.run_dir / "result.json").is_file()


@pytest.mark.slow
def test_same_seed_gives_the_same_model_even_across_a_crash(
    project: Settings,
    untrained: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first run is also the plain two-process gloo run: what it leaves is checked in full.
    # OMP_NUM_THREADS unset, as on a user's machine (the suite sets it): one compute thread per
    # process, as torchrun gives, without torchrun's banner saying so on every launch.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ddp = {"seed": 7, "epochs": 3, "nproc_per_node": 2}
    first = run_train(project, untrained, digits_split, tmp_path / "a", **ddp)
    assert_a_whole_two_process_run(project, first, epochs=3)
    assert "OMP_NUM_THREADS" not in (first.run_dir / "torchrun.log").read_text()
    assert ", 1 compute threads," in (first.run_dir / "rank_1.log").read_text()
    # The second run's rank 1 kills itself (SIGKILL, as an OOM kill would) right after epoch 1's
    # checkpoint: rank 0 is left waiting in epoch 2's first collective, torchrun restarts both
    # workers, and they resume from the checkpoint; reseeding per epoch makes the rest draw what
    # it would have.
    trace = tmp_path / "trace"
    monkeypatch.setenv(faults.FAULT, "train.epoch_end:rank=1:epoch=1:attempt=0:kill")
    monkeypatch.setenv(faults.TRACE, str(trace))
    second = run_train(project, untrained, digits_split, tmp_path / "b", **ddp)
    # Killed at the point and nowhere else; the restart (attempt 1) trained epochs 2 and 3 only.
    ended = sorted(
        (e["attempt"], e["epoch"], e["rank"]) for e in faults.reached(trace, "train.epoch_end")
    )
    assert ended == [(a, e, r) for a, e in [("0", "1"), ("1", "2"), ("1", "3")] for r in "01"]
    assert "resumed from the checkpoint after epoch" in (second.run_dir / "rank_0.log").read_text()
    assert first.run_id != second.run_id
    # Throughput is the one metric that depends on the machine, not on the seed.
    same = [k for k in first.metrics if "images_per_sec" not in k]
    assert {k: first.metrics[k] for k in same} == {k: second.metrics[k] for k in same}
    a = load_file(str(first.model_dir / "model.safetensors"))
    b = load_file(str(second.model_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Issue 46: same command, same model, bit for bit: the weights files' sha256 are equal, and
    # each run says why it trains in its precision (what the hardware is, never a timing).
    weights = [file_sha256(r.model_dir / "model.safetensors")[1] for r in (first, second)]
    assert weights[0] == weights[1]
    for result in (first, second):
        log = (result.run_dir / "rank_0.log").read_text()
        assert "precision auto: fp32 (inputs of 16 px, under 64: float32 is faster there)" in log
    client = MlflowClient(project.tracking_uri)
    steps = [m.step for m in client.get_metric_history(second.run_id, "val/loss")]
    assert len(steps) == len(set(steps))  # a resumed epoch is not logged twice


def test_a_finished_command_returns_its_exit_code_and_its_output_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # c10d's warning when reverse DNS of a peer fails (a container, a network namespace): it goes
    # on with the numeric address, so the line is dropped, from the console and the log.
    c10d = (
        "[W1128 17:13:20.414607939 socket.cpp:207] [c10d] The hostname of the client socket "
        "cannot be retrieved. err=-3"
    )
    script = f"import sys; print({c10d!r}, file=sys.stderr, flush=True); print('hi')"
    code = run_torchrun([sys.executable, "-c", script], {}, tmp_path, timeout_s=None)
    assert code == 0
    assert (tmp_path / "torchrun.log").read_text() == "hi\n"
    assert "c10d" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_crash_in_a_worker_quotes_its_log(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    train_data = shutil.copytree(digits_split[0], tmp_path / "train")
    broken = train_data / read_manifest(train_data).images[0].path
    broken.write_bytes(b"not a png any more")  # after conversion: only the worker finds out
    with pytest.raises(TrainingFailedError) as err:
        request = TrainRequest(
            model=untrained,
            train_data=train_data,
            val_data=digits_split[1],
            out=tmp_path / "model",
            params=FAST,
            transform=PRE,
            max_restarts=0,
        )
        train(request, project)
    message = str(err.value)
    assert "rank 0 failed with UnidentifiedImageError" in message
    assert "Last lines of" in message and "rank_0.log" in message
    assert str(project.runs_dir) in message  # names the folder with every rank's log
    assert not (tmp_path / "model").exists()
    # The MLflow run says FAILED and keeps the ranks' logs. (A diverging loss, the other way a
    # training fails, is the hostile-input case train-nan-loss, through the CLI.)
    client = MlflowClient(project.tracking_uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name(project.mlflow_experiment).experiment_id]
    )
    assert run.info.status == "FAILED"
    logs = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "logs")}
    assert "rank_0.log" in logs


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a hostname of its own",
)
def test_one_machine_workers_meet_whatever_the_hostname(tmp_path: Path) -> None:
    """A host whose name does not resolve (a container or a network namespace without an
    /etc/hosts line): the workers meet at 127.0.0.1; at the hostname they waited for ever."""
    request = TrainRequest(model=Path("m"), train_data=Path("t"), val_data=Path("v"),
                           out=Path("o"), params=TrainParams(nproc_per_node=2))  # fmt: skip
    command = torchrun_command(request, tmp_path / "config.json", "run")
    launcher = command[: command.index("-m", 2)]  # torchrun and its options, not the worker
    script = tmp_path / "meet.py"
    script.write_text(
        "import sys, torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\n"
        "open(f'{sys.argv[1]}/met_{d.get_rank()}', 'w').close()\n"
    )  # a file per rank: a rank's stdout can be lost when torchrun stops the group
    met = tmp_path / "met"
    met.mkdir()
    launch = shlex.join([*launcher, str(script), str(met)])
    shell = f"hostname unresolvable-{uuid.uuid4().hex[:8]} && exec {launch}"
    done = subprocess.run(
        ["unshare", "--uts", "sh", "-c", shell], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in met.iterdir()) == ["met_0", "met_1"]

"""The tuning spec: what it accepts, what it refuses (and why), and how it maps to Optuna.

No training here: the spec, the grid, the samplers and the study bookkeeping are checked on
their own (Optuna in memory or on a journal file, MLflow on SQLite).
"""

from __future__ import annotations

import os
import socket
import statistics
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from pydantic import Field

import tasks.tune.tunable as tunable_module
from tasks.shared.errors import InvalidParameterError, InvalidTuningSpecError, TuningFailedError
from tasks.shared.settings import Settings
from tasks.train.loop import EPOCH_METRICS
from tasks.train.params import TrainParams
from tasks.tune.parameters import PARAMETER_TYPES
from tasks.tune.search import make_sampler, suggest
from tasks.tune.spec import TuningSpec, tunable
from tasks.tune.study import OWNER, open_study
from tasks.tune.trial import measure

ROOT = Path(__file__).resolve().parents[1]
LR = {"name": "learning_rate", "type": "double", "min": 1e-4, "max": 0.1, "scale": "log"}
BATCH = {"name": "batch_size", "type": "discrete", "values": [8, 16, 32]}


def spec_with(*parameters: dict[str, Any], **fields: Any) -> TuningSpec:
    return TuningSpec.checked(parameters=list(parameters), **fields)


def test_the_example_spec_file_is_a_valid_study() -> None:
    spec = TuningSpec.from_yaml(ROOT / "tuning.yaml")
    assert spec.study_name == "digits-resnet18"
    assert (spec.metric, spec.goal, spec.algorithm) == ("val/top1", "maximize", "bayesian")
    by_name = spec.by_name()
    assert by_name["learning_rate"].min == pytest.approx(1e-4)  # 1e-4 reads as a number
    assert by_name["weight_decay"].values == [0.01, 0.05, 0.1]  # AdamW's (modern)
    assert by_name["weight_decay"].parent == "warmup_epochs"
    assert spec.train.epochs == 5


def test_the_spec_is_the_flow_form_with_a_title_for_every_field() -> None:
    from flows.tune import tune_flow

    schema = tune_flow.parameters.model_dump()
    assert {"spec", "train_data", "val_data", "transform", "trial_deployment"} <= set(
        schema["properties"]
    )
    for model in (TuningSpec, *PARAMETER_TYPES):
        fields = model.model_json_schema()["properties"]
        assert all(field.get("title") for field in fields.values()), model
    assert TuningSpec().check() == TuningSpec()  # the form's defaults are a valid study


@pytest.mark.parametrize(
    ("parameters", "fields", "message"),
    [
        ([LR], {"algorithm": "grid"}, "cannot enumerate the double parameter 'learning_rate'"),
        (
            [{"name": "momentum", "type": "double", "min": 0, "max": 0.9, "scale": "log"}],
            {},
            "has a log scale, which needs values > 0; its minimum is 0",
        ),
        (
            [{"name": "epochs", "type": "integer", "min": 0, "max": 3, "scale": "reverse_log"}],
            {},
            "reverse_log scale, which needs values > 0",
        ),
        (
            [LR, {**BATCH, "parent": "batch", "parent_values": [8]}],
            {},
            "names the parent 'batch', which is not a parameter declared before it",
        ),
        (
            [LR, {**BATCH, "parent": "learning_rate", "parent_values": [0.01]}],
            {},
            "names the double parameter 'learning_rate' as its parent",
        ),
        (
            [
                {**BATCH, "parent": "warmup_epochs", "parent_values": [1]},
                {"name": "warmup_epochs", "type": "integer", "min": 0, "max": 2},
            ],
            {},
            "which is not a parameter declared before it",
        ),
        (
            [BATCH, {**LR, "parent": "batch_size", "parent_values": [64]}],
            {},
            "parent_values [64] are not values of 'batch_size'",
        ),
        ([{**LR, "name": "lr"}], {}, "'lr' is not a training parameter that can be tuned"),
        ([{**BATCH, "name": "nodes"}], {}, "'nodes' cannot vary between trials: a trial trains"),
        ([{**LR, "name": "batch_size"}], {}, "integer training parameter: it cannot be a double"),
        ([{**LR, "type": "integer", "min": 1, "max": 3}], {}, "takes fractions"),
        ([{**BATCH, "values": [16, 8]}], {}, "its values must increase"),
        ([{**BATCH, "values": [0, 8]}], {}, "value = 0 is out of range; batch_size takes an integ"),
        # A range is checked against its field's limits (pydantic's gt/ge/lt/le), named.
        (
            [{**LR, "min": 0, "scale": "linear"}],
            {},
            "'learning_rate': min = 0.0 is out of range; learning_rate takes a finite number > 0",
        ),
        (
            [{"name": "momentum", "type": "double", "min": 0.5, "max": 1}],
            {},
            "'momentum': max = 1.0 is out of range; momentum takes a finite number >= 0 and < 1",
        ),
        (
            [{"name": "patience", "type": "integer", "min": 0, "max": 3}],
            {},
            "'patience': min = 0 is out of range; patience takes an integer > 0",
        ),
        (
            [{"name": "num_workers", "type": "discrete", "values": [-1, 2]}],
            {},
            "value = -1 is out of range; num_workers takes an integer >= 0, or empty",
        ),
        ([{**LR, "name": "print_frequency"}], {}, "integer training parameter: it cannot be a"),
        (
            [{"name": "precision", "type": "categorical", "values": ["fp32", "fp8"]}],
            {},
            "value = 'fp8' is out of range; precision takes one of 'auto', 'fp32', 'bf16', 'fp16'",
        ),
        (
            [{"name": "device", "type": "discrete", "values": [1, 2]}],
            {},
            "'device' takes one of 'auto', 'cpu', 'cuda': it must be categorical",
        ),
        (
            [{"name": "pretrained", "type": "categorical", "values": ["yes", False]}],
            {},
            "'pretrained' is true or false; got 'yes'",
        ),
        (
            [
                {
                    "name": "architecture",
                    "type": "categorical",
                    "values": ["resnet18", "densenet121"],
                },
                {"name": "zero_init_residual", "type": "categorical", "values": [True, False]},
            ],
            {},
            "zero_init_residual applies to ResNets only, and trials may train ['densenet121']",
        ),
        ([LR], {"memory_efficient": True}, "memory_efficient applies to DenseNets only"),
        ([{**LR, "min": 0.1, "max": 0.01}], {}, "min = 0.1 must be below max = 0.01"),
        ([{**BATCH, "type": "categorical", "scale": "log"}], {}, "its values have no scale"),
        ([{"name": "architecture", "type": "discrete", "values": [1, 2]}], {}, "categorical"),
        (
            [{"name": "architecture", "type": "categorical", "values": ["resnet9000"]}],
            {},
            "'resnet9000' is not an architecture",
        ),
        ([LR, LR], {}, "tuned twice"),
        ([BATCH], {"algorithm": "grid", "max_trial_count": 2}, "The grid has 3 points"),
        ([LR], {"metric": "accuracy"}, "not a metric the training run reports"),
        ([LR], {"train": {"nodes": 2, "cluster": "h:6379"}}, "a trial trains on one node"),
        ([LR], {"study_name": "../escape"}, "not a usable study name"),
        ([{**LR, "type": "float"}], {}, "parameters[0]"),  # structure: pydantic's check
        ([LR], {"max_trial_count": 0}, "max_trial_count = 0, expected an integer > 0"),
    ],
)
def test_an_invalid_spec_is_refused_saying_why(
    parameters: list[dict], fields: dict, message: str
) -> None:
    with pytest.raises(InvalidTuningSpecError) as err:
        spec_with(*parameters, **fields)
    assert message in str(err.value)
    assert isinstance(err.value, InvalidParameterError)  # refused like any bad parameter


def test_a_bad_file_names_itself_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "tuning.yaml"
    path.write_text("metric: val/top1\nparameter: []\n")
    with pytest.raises(InvalidTuningSpecError, match=r"tuning\.yaml: .*unknown parameter"):
        TuningSpec.from_yaml(path)


def test_a_grid_enumerates_children_only_under_their_parents_values() -> None:
    spec = spec_with(
        {"name": "architecture", "type": "categorical", "values": ["resnet18", "resnet34"]},
        {"name": "epochs", "type": "integer", "min": 2, "max": 4, "scale": "reverse_log",
         "parent": "architecture", "parent_values": ["resnet34"]},
        {"name": "learning_rate", "type": "discrete", "values": [0.01, 0.1]},
        algorithm="grid",
        max_trial_count=8,
    )  # fmt: skip
    points = [spec.training_values(p) for p in spec.grid()]
    assert len(points) == spec.grid_size() == 2 * (1 + 3)
    assert {(p["architecture"], p.get("epochs")) for p in points} == {
        ("resnet18", None),
        ("resnet34", 2),
        ("resnet34", 3),
        ("resnet34", 4),
    }
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)  # none twice


def test_the_sampled_values_follow_type_scale_and_parent() -> None:
    spec = spec_with(
        {"name": "momentum", "type": "double", "min": 0.5, "max": 0.99, "scale": "reverse_log"},
        {"name": "batch_size", "type": "integer", "min": 4, "max": 64, "scale": "log"},
        {"name": "warmup_epochs", "type": "discrete", "values": [0, 1, 2]},
        {"name": "weight_decay", "type": "double", "min": 1e-5, "max": 1e-3, "scale": "log",
         "parent": "warmup_epochs", "parent_values": [1, 2]},
        algorithm="random",
    )  # fmt: skip
    study = optuna.create_study(sampler=make_sampler(spec, 0))
    drawn = []
    for _ in range(200):
        trial = study.ask()
        values = spec.training_values(suggest(trial, spec))
        study.tell(trial, 0.0)
        assert 0.5 <= values["momentum"] <= 0.99
        assert isinstance(values["batch_size"], int) and 4 <= values["batch_size"] <= 64
        assert ("weight_decay" in values) == (values["warmup_epochs"] in (1, 2))
        TrainParams.checked(**{k: v for k, v in values.items()})  # trainable as drawn
        drawn.append(values)
    # reverse_log: denser near max; log: denser near min.
    assert statistics.median(v["momentum"] for v in drawn) > (0.5 + 0.99) / 2
    assert statistics.median(v["batch_size"] for v in drawn) < (4 + 64) / 2


def test_a_continued_study_draws_new_points() -> None:
    spec = spec_with(LR, algorithm="random", seed=3)

    def first_draw(trials_so_far: int) -> float:
        study = optuna.create_study(sampler=make_sampler(spec, trials_so_far))
        return suggest(study.ask(), spec)["learning_rate"]

    assert first_draw(0) == first_draw(0)  # seeded
    assert first_draw(0) != first_draw(2)  # a flow continuing after 2 trials


@pytest.mark.parametrize(
    ("measurement", "goal", "expected"),
    [("best", "maximize", 0.9), ("best", "minimize", 0.5), ("last", "maximize", 0.7)],
)
def test_a_trial_value_is_its_best_or_last_epoch(
    measurement: str, goal: str, expected: float
) -> None:
    spec = spec_with(LR, measurement=measurement, goal=goal)
    history = [{"epoch": 1.0, "val/top1": 0.5}, {"epoch": 2.0, "val/top1": 0.9},
               {"epoch": 3.0, "val/top1": 0.7}]  # fmt: skip
    assert measure(history, spec) == expected


@pytest.mark.parametrize(
    ("parameter", "recorded"),
    [
        (LR, {**LR, "values": None}),
        (BATCH, {**BATCH, "min": None, "max": None, "scale": "linear"}),
        (
            {"name": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
            {"name": "precision", "type": "categorical", "values": ["fp32", "bf16"],
             "min": None, "max": None, "scale": "linear"},
        ),
    ],
)  # fmt: skip
def test_each_parameter_type_records_every_field_so_a_study_started_earlier_continues(
    parameter: dict[str, Any], recorded: dict[str, Any]
) -> None:
    # The identity a stored study is compared with was one model's dump with every field.
    unset = {"parent": None, "parent_values": None}
    assert spec_with(parameter).identity()["parameters"] == [{**unset, **recorded}]


def test_a_study_started_with_another_search_space_is_not_continued(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from flows.config import DEMO_TRANSFORM

    spec = spec_with(LR, study_name="same-name")
    open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=project)
    journal = project.home_dir / "tuning" / "same-name.journal"
    assert journal.is_file()
    # The counts may change; the search space may not.
    open_study(
        spec.model_copy(update={"max_trial_count": 20}),
        *digits_split,
        transform=DEMO_TRANSFORM,
        settings=project,
    )
    other = spec_with({**LR, "max": 0.5}, study_name="same-name")
    with pytest.raises(InvalidTuningSpecError, match=r"another setup \(differs in: parameters\)"):
        open_study(other, *digits_split, transform=DEMO_TRANSFORM, settings=project)


def test_a_study_a_live_flow_is_tuning_is_refused(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from flows.config import DEMO_TRANSFORM

    spec = spec_with(LR, study_name="busy")
    study = open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=project)
    parent = psutil.Process(os.getppid())  # alive, on this host, not this process
    owner = {"host": socket.gethostname(), "pid": parent.pid, "started": parent.create_time()}
    study.optuna.set_user_attr(OWNER, owner)
    with pytest.raises(InvalidParameterError, match=f"process {parent.pid} on this machine"):
        open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=project)


def test_a_spec_file_with_fields_replaced_is_checked_again() -> None:
    from flows.tune import tune_spec_file

    spec = tune_spec_file(ROOT / "tuning.yaml", study_name="other", max_trial_count=3)
    assert (spec.study_name, spec.max_trial_count, spec.parallel_trial_count) == ("other", 3, 2)
    with pytest.raises(InvalidTuningSpecError, match="not a usable study name"):
        tune_spec_file(ROOT / "tuning.yaml", study_name="no spaces please")


def test_an_invalid_spec_given_to_the_flow_is_refused_before_any_trial(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from flows.config import DEMO_TRANSFORM

    # Built without its checks, as a form or a caller may build it: the study refuses it.
    spec = TuningSpec(study_name="never", algorithm="grid", parameters=[LR])
    with pytest.raises(InvalidTuningSpecError, match="cannot enumerate the double"):
        open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=project)
    assert not (project.home_dir / "tuning").exists()
    assert not (project.home_dir / "mlflow.db").exists()


def test_at_scale_the_study_lives_in_a_database_the_workers_report_to(
    project: Settings,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.config import DEMO_TRANSFORM
    from tasks.train.params import TrialHook
    from tasks.tune.pruning import TrialReporter

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    monkeypatch.setenv("IMAGEOPS_TUNING_STORAGE", url)  # what a worker's environment carries
    settings = Settings()
    spec = spec_with(LR, study_name="db", early_stopping=True, early_stopping_min_trials=1)
    study = open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=settings)
    assert study.job.storage is None  # the URL (it may hold a password) stays out of configs
    assert not (settings.home_dir / "tuning" / "db.journal").exists()

    def hook(number: int) -> TrialHook:
        return TrialHook(
            storage=None, study_name="db", trial_number=number, metric="val/top1",
            early_stopping=True, min_trials=1, min_epochs=1,
        )  # fmt: skip

    # What rank 0 of a training worker does after each epoch: report, then ask.
    good = study.ask()
    assert TrialReporter(hook(good.number)).report({"val/top1": 0.9}, 1) is False  # nobody yet
    study.optuna.tell(good.number, 0.9)
    poor = study.ask()
    assert TrialReporter(hook(poor.number)).report({"val/top1": 0.2}, 1) is True  # below median
    stored = optuna.load_study(study_name="db", storage=url).trials
    assert [t.intermediate_values for t in stored] == [{1: 0.9}, {1: 0.2}]


# --- what may be tuned: every training parameter, every reported metric ------------------------


def test_every_training_parameter_but_where_it_runs_is_tunable_read_from_train_params() -> None:
    model = {"architecture", "pretrained", "memory_efficient", "zero_init_residual"}
    placement = {"nodes", "cluster", "cluster_timeout_s", "rdzv_timeout_s"}
    assert set(tunable()) == (set(TrainParams.model_fields) - placement) | model


def test_a_field_added_to_the_training_parameters_is_tunable_within_its_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Extended(TrainParams):  # a field the tuning code has never heard of
        label_smoothing: float = Field(0.0, ge=0, lt=1, title="Label smoothing")

    monkeypatch.setattr(tunable_module, "TrainParams", Extended)
    spec = spec_with({"name": "label_smoothing", "type": "double", "min": 0.0, "max": 0.2})
    assert spec.trial_params({"label_smoothing": 0.1}) == Extended(label_smoothing=0.1)
    with pytest.raises(InvalidTuningSpecError) as err:
        spec_with({"name": "label_smoothing", "type": "double", "min": 0.1, "max": 1.0})
    assert "max = 1.0 is out of range; label_smoothing takes a finite number >= 0 and < 1" in str(
        err.value
    )


def test_parameters_once_refused_are_tuned_and_reach_the_trial(tmp_path: Path) -> None:
    from tasks.train.build_model import build_model

    spec = spec_with(
        {"name": "print_frequency", "type": "integer", "min": 1, "max": 5},
        {"name": "patience", "type": "discrete", "values": [1, 2]},
        {"name": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
        {"name": "device", "type": "categorical", "values": ["cpu", "auto"]},
        {"name": "num_workers", "type": "categorical", "values": [0, 1]},
        {"name": "nproc_per_node", "type": "integer", "min": 1, "max": 2},
        {"name": "architecture", "type": "categorical", "values": ["resnet18", "densenet121"]},
        {"name": "memory_efficient", "type": "categorical", "values": [True, False],
         "parent": "architecture", "parent_values": ["densenet121"]},
        {"name": "pretrained", "type": "categorical", "values": [False]},
        algorithm="random",
    )  # fmt: skip
    study = optuna.create_study(sampler=make_sampler(spec, 0))
    seen: dict[str, set] = {}
    for number in range(30):
        trial = study.ask()
        values = spec.training_values(suggest(trial, spec))
        study.tell(trial, 0.0)
        params = spec.trial_params(values)
        for name, value in values.items():
            if name in TrainParams.model_fields:
                assert getattr(params, name) == value, name
            seen.setdefault(name, set()).add(value)
        choice = spec.trial_model(values)
        assert choice.memory_efficient is values.get("memory_efficient", False)
        # Every trial's network can be built: the DenseNet option only on DenseNets.
        model = build_model(choice, tmp_path / str(number))
        assert model.memory_efficient is choice.memory_efficient
    assert seen["precision"] == {"fp32", "bf16"} and seen["memory_efficient"] == {True, False}
    assert all(isinstance(v, bool) for v in seen["memory_efficient"])  # not 0 and 1


@pytest.mark.parametrize("metric", EPOCH_METRICS)
def test_every_metric_the_training_reports_can_be_optimised(metric: str) -> None:
    assert spec_with(LR, metric=metric).metric == metric


def test_the_metrics_are_what_an_epoch_reports_and_others_are_refused_listing_them() -> None:
    from tasks.train.loop import TOP1, TOP5, VAL_LOSS, TrainStats, epoch_metrics

    stats = TrainStats(
        loss=1.0, images=8, images_per_sec=2.0, lr=0.1, images_per_sec_per_process=1.0
    )
    reported = epoch_metrics(stats, {VAL_LOSS: 1.0, TOP1: 0.5, TOP5: 1.0})
    assert tuple(reported) == EPOCH_METRICS
    with pytest.raises(InvalidTuningSpecError) as err:
        spec_with(LR, metric="val/accuracy")
    assert "'val/accuracy' is not a metric the training run reports" in err.value.message
    assert all(name in err.value.hint for name in EPOCH_METRICS)


def test_max_failed_trial_count_0_lets_no_trial_fail(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from flows.config import DEMO_TRANSFORM

    spec = spec_with(LR, study_name="strict", max_failed_trial_count=0, max_trial_count=5)
    study = open_study(spec, *digits_split, transform=DEMO_TRANSFORM, settings=project)
    assert study.can_ask(running=0)
    failed = study.ask()
    study.settle(failed.number, "TrainingDivergedError: the loss became nan")
    assert not study.can_ask(running=0)  # the first failure ends the study: no new trial
    with pytest.raises(
        TuningFailedError, match="1 trials failed, more than max_failed_trial_count = 0"
    ):
        study.raise_if_failed()

"""A training watched from the Prefect UI (issue 47): rank 0's lines logged to the run as they come,
the progress artifact moving with them, the end line in words. The whole path, with torchrun, is
in tests/test_pipeline.py; here the watch itself, against a real Prefect API."""

from __future__ import annotations

from prefect import flow
from prefect_runs import artifacts_of, info_logs_sent, log_messages_of

from tasks.train.watch import PROGRESS_KEY, TrainingWatch, finished_line, progress_of

LINES = [
    "2026-11-29 19:35:12,452 rank 0 INFO training resnet18 on 72 images, validating on 18\n",
    "2026-11-29 19:35:12,522 rank 0 INFO epoch 1/2: first batch after 0.07 s\n",
    "2026-11-29 19:35:13,761 rank 0 INFO epoch 1/2 [5/10] loss 4.3376 (mean 4.3808) 55.1 img/s\n",
    "2026-11-29 19:35:13,761 rank 1 INFO epoch 1/2 [5/10] loss 4.1 (mean 4.3808) 55.1 img/s\n",
    "2026-11-29 19:35:14,265 rank 0 INFO epoch 1/2: train loss 4.3808, val loss 0.9, top-1 0.33\n",
    "[W socket.cpp:663] [c10d] The client socket has failed to connect\n",
]


def test_rank_0_lines_tell_how_far_training_is() -> None:
    assert progress_of("epoch 1/2 [5/10] loss 4.3376") == 25.0
    assert progress_of("epoch 1/2: train loss 4.3808, val loss 0.9") == 50.0
    assert progress_of("epoch 2/2 [10/10] loss 1.0") == 100.0
    assert progress_of("epoch 1/2: first batch after 0.07 s") is None
    assert progress_of("training resnet18 on 72 images") is None


def test_the_watch_logs_rank_0s_progress_and_moves_the_artifact(prefect_api: None) -> None:
    seen: list[tuple[bool, float]] = []

    @flow(name="watched-training")
    def watched() -> object:
        watch = TrainingWatch.start("resnet18, 2 epochs")
        assert watch is not None
        for line in LINES:
            handed = watch(line)
            (artifact,) = artifacts_of(watch_run(), PROGRESS_KEY)
            seen.append((handed, float(artifact.data)))
        return watch_run()

    def watch_run() -> object:
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        return context.flow_run.id

    with info_logs_sent():
        run_id = watched()
    # Rank 0's start, progress and epoch lines are logged (the console shows them through the
    # run's logger); rank 1's and torchrun's own are not; the artifact moves with the epochs.
    assert seen == [
        (True, 0.0),
        (True, 0.0),
        (True, 25.0),
        (False, 25.0),
        (True, 50.0),
        (False, 50.0),
    ]
    messages = log_messages_of(
        run_id, lambda got: any(m.startswith("epoch 1/2: train") for m in got)
    )
    assert "epoch 1/2 [5/10] loss 4.3376 (mean 4.3808) 55.1 img/s" in messages
    assert not any("rank 1" in m or "socket" in m for m in messages)


def test_outside_a_prefect_run_nothing_is_watched() -> None:
    assert TrainingWatch.start("resnet18, 2 epochs") is None


def test_the_end_line_is_in_words_and_rounded() -> None:
    result = {
        "metrics": {
            "val/top1": 0.972972972972973,
            "val/top5": 1.0,
            "val/loss": 0.027681401349539423,
            "train/loss": 1.7910209527382484,
        },
        "best_epoch": 4,
        "epochs_trained": 5,
        "stopped_early": True,
    }
    assert finished_line(result) == (
        "training finished (stopped early): kept epoch 4 of 5 trained, validation top-1 97.30%, "
        "top-5 100.00%, validation loss 0.02768, training loss 1.791"
    )


def test_one_epoch_is_said_in_the_singular() -> None:
    """The training's run name and its progress label (tasks.train.launch): "1 epoch", not
    "1 epochs" (the label said "resnet18, 1 epoch epochs" for a while)."""
    from tasks.train.launch import epochs_text, training_run_name

    assert [epochs_text(n) for n in (1, 2)] == ["1 epoch", "2 epochs"]
    assert training_run_name("resnet18", 1) == "training-resnet18-1-epoch"
    assert training_run_name("resnet18", 5) == "training-resnet18-5-epochs"

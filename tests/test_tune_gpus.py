"""GPU slots for parallel tuning trials: each GPU to one trial at a time, given back after.

The allocator is tested with the GPUs it is given (this machine has none); the GPU run of a study
is in tests/test_tune.py (skipped without CUDA).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from tasks.shared.errors import InvalidTuningSpecError
from tasks.train.params import TrainParams
from tasks.tune.gpus import (
    GpuSlots,
    check_study_gpus,
    device_names,
    gpu_environment,
    gpus_for,
    most_gpus,
)
from tasks.tune.spec import TuningSpec

WAIT_S = 10.0


def started(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_trials_running_together_get_disjoint_gpus() -> None:
    slots = GpuSlots(["0", "1", "2", "3"])
    with slots.take(2) as first, slots.take(1) as second, slots.take(1) as third:
        assert len(first) == 2 and len(second) == len(third) == 1
        assert sorted(first + second + third) == ["0", "1", "2", "3"]  # none twice
        assert slots.free == 0
    assert slots.free == 4


def test_a_trial_waits_until_enough_gpus_are_free() -> None:
    slots = GpuSlots(["0", "1"])
    got: list[tuple[str, ...]] = []
    holding = slots.take(2)
    held = holding.__enter__()

    def second_trial() -> None:
        with slots.take(1) as gpus:
            got.append(gpus)

    thread = started(second_trial)
    time.sleep(0.3)
    assert got == [] and thread.is_alive()  # waiting: both GPUs are taken
    holding.__exit__(None, None, None)
    thread.join(WAIT_S)
    assert got and got[0][0] in held  # one of the GPUs just given back


def test_gpus_come_back_when_a_trial_fails() -> None:
    slots = GpuSlots(["0", "1"])
    with pytest.raises(RuntimeError, match="diverged"), slots.take(2):
        raise RuntimeError("diverged")
    assert slots.free == 2
    with slots.take(2) as gpus:  # at once: nothing is left held
        assert gpus == ("0", "1")


def test_a_trial_needing_more_gpus_than_the_machine_has_is_refused_not_left_waiting() -> None:
    with pytest.raises(InvalidTuningSpecError) as err, GpuSlots(["0", "1"]).take(3, "Trial 4"):
        pass
    assert "Trial 4 needs 3 GPUs, and this machine has 2" in err.value.message
    assert "at most 2 processes per trial on GPU" in err.value.hint
    with pytest.raises(InvalidTuningSpecError, match="this machine has 0"), GpuSlots([]).take(1):
        pass


def test_a_cpu_trial_takes_no_gpu_and_never_waits() -> None:
    slots = GpuSlots(["0"])
    with slots.take(1), slots.take(0) as none:
        assert none == ()
    with GpuSlots([]).take(0) as none:
        assert none == ()


def test_trials_are_served_in_the_order_they_asked() -> None:
    # A trial waiting for 2 GPUs is not overtaken by a later one that needs only 1.
    slots = GpuSlots(["0", "1"])
    order: list[str] = []
    first = slots.take(2)
    first.__enter__()

    def trial(name: str, count: int) -> Callable[[], None]:
        def run() -> None:
            with slots.take(count):
                order.append(name)
                time.sleep(0.1)

        return run

    big = started(trial("big", 2))
    time.sleep(0.2)
    small = started(trial("small", 1))
    time.sleep(0.2)
    assert order == []
    first.__exit__(None, None, None)
    big.join(WAIT_S)
    small.join(WAIT_S)
    assert order == ["big", "small"]


def test_many_threads_never_share_a_gpu() -> None:
    slots = GpuSlots(["0", "1", "2"])
    held: set[str] = set()
    lock = threading.Lock()
    clashes: list[str] = []
    rng = random.Random(0)
    counts = [rng.choice([1, 2, 3]) for _ in range(24)]

    def trial(count: int) -> None:
        with slots.take(count) as gpus:
            with lock:
                clashes.extend(g for g in gpus if g in held)
                held.update(gpus)
            time.sleep(0.01)
            with lock:
                held.difference_update(gpus)

    threads = [started(lambda c=c: trial(c)) for c in counts]
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    assert clashes == [] and slots.free == 3


def test_gpus_are_named_as_cuda_visible_devices_named_them() -> None:
    assert device_names(2, None) == ["0", "1"]
    assert device_names(2, "2,5") == ["2", "5"]  # a worker started on GPUs 2 and 5 lends those
    assert device_names(1, "GPU-6f1c,GPU-77aa") == ["GPU-6f1c"]
    assert device_names(0, "3") == []
    assert gpu_environment(("2", "5")) == {"CUDA_VISIBLE_DEVICES": "2,5"}
    assert gpu_environment(()) == {}  # a CPU trial's environment is left alone


@pytest.mark.parametrize(
    ("device", "visible", "expected"),
    [("cuda", 4, 2), ("auto", 4, 2), ("auto", 0, 0), ("cpu", 4, 0)],
)
def test_a_trial_takes_a_gpu_per_process_only_on_cuda(
    device: str, visible: int, expected: int
) -> None:
    assert gpus_for(TrainParams(device=device, nproc_per_node=2), visible) == expected


def spec(*parameters: dict, **train: object) -> TuningSpec:
    return TuningSpec.checked(parameters=list(parameters), train=train)


NPROC = {"name": "nproc_per_node", "type": "integer", "min": 1, "max": 4}


def test_a_study_whose_trials_need_more_gpus_than_the_machine_has_is_refused() -> None:
    with pytest.raises(InvalidTuningSpecError) as err:
        check_study_gpus(spec(NPROC, device="cuda"), GpuSlots(["0", "1"]))
    assert "device = 'cuda' and nproc_per_node = 4: 4 GPUs each, and this machine has 2" in str(
        err.value
    )
    devices = {"name": "device", "type": "categorical", "values": ["cpu", "cuda"]}
    with pytest.raises(InvalidTuningSpecError, match="this machine has 0"):
        check_study_gpus(spec(devices), GpuSlots([]))
    check_study_gpus(spec(NPROC, device="cuda"), GpuSlots(["0", "1", "2", "3"]))
    check_study_gpus(spec(NPROC, device="auto"), GpuSlots([]))  # auto without GPUs: CPU
    check_study_gpus(spec(NPROC, device="cpu"), GpuSlots(["0"]))


def test_processes_tuned_only_for_cpu_trials_need_no_gpus() -> None:
    study = spec(
        {"name": "device", "type": "categorical", "values": ["cpu", "cuda"]},
        {**NPROC, "parent": "device", "parent_values": ["cpu"]},
        nproc_per_node=1,
    )
    assert most_gpus(study, 1) == (1, "cuda")  # a cuda trial keeps train's nproc_per_node
    check_study_gpus(study, GpuSlots(["0"]))

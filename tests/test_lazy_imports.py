"""What a command imports before it does anything: the heavy libraries only where it uses them.

torch, MLflow, Prefect, ONNX Runtime and pandas each cost up to seconds to import. `imageops
--help` needs none of them, `evaluate` needs pandas (MLflow only when it logs), and scoring needs
neither Prefect nor MLflow (nor onnx, the exporter's library). What each costs in seconds is
measured by bench/fixed_costs.py; these tests only say which modules are loaded, in a fresh
interpreter each (sys.modules here holds everything the suite imported).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib, sys
def absent(after, *names):
    for module in after.split():
        importlib.import_module(module)
    loaded = sorted(n for n in names if n in sys.modules)
    assert not loaded, f"importing {after} loaded {loaded}"
"""


def _run(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow  # a fresh interpreter importing torch (and, in the other case, MLflow)
@pytest.mark.parametrize(
    "code",
    [
        # --help and evaluate: the command line, then evaluate's module.
        "absent('app.cli', 'torch', 'torchvision', 'mlflow', 'prefect', 'onnxruntime', 'onnx', "
        "'pandas', 'matplotlib', 'sklearn')\n"
        "absent('tasks.inference.evaluate', 'torch', 'torchvision', 'prefect', 'onnxruntime', "
        "'onnx', 'matplotlib', 'mlflow')",
        # score, from a ModelDirectory: the modules the command uses, then export's.
        "absent('tasks.inference.score.batches tasks.inference.score.shards "
        "tasks.registry.model_uri', 'prefect', 'mlflow', 'onnx')\n"
        "absent('tasks.inference.export', 'prefect', 'mlflow', 'onnx', 'onnxscript')",
        # A cluster node's actor: started for every job, before anything else can go on (its
        # torchrun's workers import torch themselves).
        "absent('tasks.train.cluster_node', 'torch', 'torchvision', 'mlflow', 'dvc', 'prefect')",
    ],
    ids=["help-and-evaluate", "score-and-export", "cluster-node"],
)
def test_a_command_imports_only_what_it_uses(code: str) -> None:
    _run(code)


@pytest.mark.slow  # a fresh interpreter importing Prefect, torch and MLflow
def test_a_flow_still_gets_real_prefect_tasks() -> None:
    """The tasks are made on first use: asking for one imports Prefect and returns a Task."""
    _run(
        "absent('tasks.registry.promote tasks.inference.score', 'prefect')\n"
        "from prefect import Task\n"
        "from tasks.registry.promote import promote_task\n"
        "from tasks.inference.score import score_task\n"
        "from tasks.data.convert import convert_task\n"
        "import tasks.registry.promote as module\n"
        "assert isinstance(promote_task, Task) and isinstance(score_task, Task)\n"
        "assert isinstance(convert_task, Task) and module.promote_task is promote_task\n"
        "assert promote_task.name == 'promote' and promote_task.retries == 2\n"
        "try:\n"
        "    module.no_such_task\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_task' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown name must raise AttributeError')"
    )


@pytest.mark.slow  # a fresh interpreter importing torch, torchvision, then compiling
def test_torchvision_imports_without_dynamo_which_still_works_after() -> None:
    """The loader fork server's modules (and score's) import torchvision without TorchDynamo
    (models.torchvision_import); what torchvision had decorated or imported from it works, and
    torch.compile gets the real TorchDynamo."""
    _run(
        "absent('tasks.train.data tasks.data.transform', 'torch._dynamo')\n"
        "import torch, torchvision\n"
        "from torchvision import tv_tensors\n"
        "from torchvision.ops import roi_align\n"
        "boxes = torch.tensor([[0, 0, 0, 4, 4.0]])\n"
        "assert roi_align(torch.rand(1, 3, 8, 8), boxes, (2, 2)).shape == (1, 3, 2, 2)\n"
        "like = tv_tensors.Image(torch.rand(3, 4, 4))\n"
        "assert type(tv_tensors.wrap(torch.rand(3, 4, 4), like=like)) is tv_tensors.Image\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "assert torch.compile(lambda t: t * 2 + 1)(torch.ones(2)).tolist() == [3.0, 3.0]\n"
        "import torch._dynamo.utils as utils\n"
        "assert type(utils).__name__ == 'module' and utils.is_compile_supported('cpu')\n"
        "assert torch.compiler.disable.__module__ == 'torch.compiler'"
    )


@pytest.mark.slow  # a fresh interpreter importing torch, then TorchDynamo
def test_dynamo_imported_while_the_stand_in_is_in_place_gets_its_real_utils() -> None:
    """A torchvision that imports TorchDynamo itself (another version) gets the real one: the
    stand-in hands over every name asked of it."""
    _run(
        "import tasks, torch\n"
        "from models.torchvision_import import _DynamoUtilsStandIn\n"
        "sys.modules['torch._dynamo.utils'] = _DynamoUtilsStandIn('torch._dynamo.utils')\n"
        "import torch._dynamo\n"
        "assert not isinstance(sys.modules['torch._dynamo.utils'], _DynamoUtilsStandIn)\n"
        "assert torch.compile(lambda t: t - 1)(torch.ones(2)).tolist() == [0.0, 0.0]"
    )

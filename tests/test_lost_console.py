"""A flow run whose worker died: its console is a broken pipe, its work must go on.

The process below loses the reader of its stdout and stderr first, as a flow run of a SIGKILLed
Prefect worker does, then prints and logs through Prefect's console handler (rich, which turns a
broken pipe into SystemExit). Importing ``flows`` is what a flow run does first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = """
import sys, traceback
sys.stdin.readline()  # the reader of our output is gone by now
try:
    from prefect.logging import get_logger
    {setup}
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect"):
        get_logger(name).warning("a line after the reader left")
    print("a print after the reader left")
    sys.stdout.flush()
    outcome = "survived"
except BaseException:
    outcome = traceback.format_exc()
open(sys.argv[1], "w").write(outcome)
"""


def lost_console(setup: str, result: Path) -> str:
    child = subprocess.Popen(
        [sys.executable, "-c", CODE.format(setup=setup), str(result)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdout.close()  # the worker dies: nobody reads the flow run's output any more
    child.stdin.write(b"go\n")
    child.stdin.close()
    child.wait(timeout=120)
    return result.read_text()


@pytest.mark.parametrize("setup", ["import flows", "import flows.train"])
def test_a_flow_run_prints_and_logs_on_after_its_reader_is_gone(setup: str, tmp_path: Path) -> None:
    assert lost_console(setup, tmp_path / "outcome") == "survived"


def test_without_the_wrapper_the_lost_console_breaks_the_process(tmp_path: Path) -> None:
    """The check above can fail: the same process without it dies on the broken pipe."""
    assert "BrokenPipeError" in lost_console("pass", tmp_path / "outcome")

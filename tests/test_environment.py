"""The environment runs this checkout: every subprocess the suite starts imports these files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_subprocess_outside_the_checkout_imports_this_checkouts_packages(tmp_path: Path) -> None:
    # `-I`: neither the working folder nor PYTHONPATH on sys.path, as for `imageops`, torchrun's
    # workers and the Prefect worker's flow runs. A cached environment whose editable install
    # pointed at an older clone once ran that clone's code in every such subprocess.
    packages = "app, flows, models, tasks"
    code = f"import {packages}; print(*(m.__file__ for m in ({packages})))"
    found = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    folders = {Path(f).resolve().parents[1] for f in found.stdout.split()}
    assert folders == {ROOT}, f"the environment runs {folders}, not {ROOT}: run `make install`"

"""The git commit a run or a registered version was made from, recorded beside it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_revision(root: Path) -> str:
    """The commit checked out at ``root`` ("unknown" outside a git repository or without git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"

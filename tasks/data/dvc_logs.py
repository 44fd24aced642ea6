"""DVC's own loggers, kept quiet and writing where this process writes now.

Importing dvc gives its loggers handlers of their own at INFO: a step reports what it did itself.
"""

from __future__ import annotations

import logging
import sys


def quiet_dvc_logs() -> None:
    """Importing dvc sets its loggers to INFO with handlers of their own, which would print every
    "git add ..." hint twice inside a Prefect run; a step reports what it did itself.

    Those handlers keep the stderr of the moment dvc was imported: where it has been closed
    since (a replaced stderr), a warning of DVC's would fail the step; it goes to today's.
    """
    for name in ("dvc", "dvc_data", "dvc_objects"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one first

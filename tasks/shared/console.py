"""A process outlives whoever reads its output: writes to a lost console are dropped, not raised.

A Prefect process worker starts each flow run with its output in a pipe. Killed under a running
flow, the worker takes the pipe's reading end with it, and every later ``print``, log line or
MLflow notice (MLflow prints a run's link when it ends it) raises BrokenPipeError in the flow
run: a training that finished would then fail to record its end. With :func:`survive_lost_console`
the first failed write turns that stream off; the log files keep every line.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class _Survivor:
    """A text stream that stops writing, silently, once its reader is gone."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # EPIPE, or a stream already closed
                self.lost = True
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self.lost = True

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer...
        return getattr(self._stream, name)


def survive_lost_console() -> None:
    """Wrap this process's stdout and stderr (once; later calls change nothing)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Survivor):
            setattr(sys, name, _Survivor(stream))

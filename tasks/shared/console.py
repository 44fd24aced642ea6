"""A process outlives whoever reads its output: writes to a lost console are dropped, not raised.

A Prefect process worker starts each flow run with its output in a pipe. Killed under a running
flow, the worker takes the pipe's reading end with it, and every later ``print`` or log line
raises BrokenPipeError in the flow run; Prefect's console log handler (rich) even turns it into
SystemExit, so a training that finished would end the flow run Crashed. With
:func:`survive_lost_console` the first failed write turns that stream off, for ``sys.stdout`` and
``sys.stderr`` and for the log handlers that already hold them; the log files (and Prefect's API
log) keep every line.
"""

from __future__ import annotations

import logging
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
    """Wrap this process's stdout and stderr, and point the log handlers that write to them at
    the wrappers (once; later calls only catch up with handlers added since)."""
    wrapped: dict[int, _Survivor] = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            continue
        if not isinstance(stream, _Survivor):
            stream = _Survivor(stream)
            setattr(sys, name, stream)
        wrapped[id(stream._stream)] = stream
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if not isinstance(handler, logging.StreamHandler):
                continue
            survivor = wrapped.get(id(handler.stream))
            if survivor is not None:
                handler.setStream(survivor)  # type: ignore[arg-type]
            console = getattr(handler, "console", None)  # rich's, in Prefect's handler
            survivor = wrapped.get(id(getattr(console, "file", None)))
            if console is not None and survivor is not None:
                console.file = survivor

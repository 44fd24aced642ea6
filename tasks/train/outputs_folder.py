"""A flow run's outputs folder: the same request run again after a stop continues in its folder.

A training's identity (its job key) includes the folder its model goes to, so a stopped
``imageops run`` rerun into a new time-stamped folder would train afresh. Until a request
finishes, its folder is recorded under the project's home (``<home>/unfinished/``, keyed by the
request's sha256); the same request run again gets that folder back and its training resumes
from its checkpoint. A run of the same request going on right now holds the record's lock, so a
second one at the same time gets a folder of its own instead of writing into the first's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from models.atomic import write_json
from models.locks import acquire
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings


@contextmanager
def outputs_folder(settings: Settings, fresh: str, request: str) -> Iterator[Path]:
    """The outputs folder for ``request`` (its parameters as JSON): an unfinished run's of the same
    request, else ``<outputs>/<fresh>``. Leaving the block normally finishes the request."""
    digest = hashlib.sha256(request.encode()).hexdigest()[:32]
    record = settings.home_dir / "unfinished" / f"{digest}.json"
    busy = InvalidParameterError(f"request {digest} is being run right now.")
    try:
        lock = acquire(settings.home_dir / "locks" / f"outputs-{digest}.lock", 0, busy)
    except InvalidParameterError:  # the same request runs now: this is a run of its own
        yield settings.outputs_dir / fresh
        return
    try:
        folder = _recorded(record) or settings.outputs_dir / fresh
        write_json(record, {"outputs": str(folder.resolve())})
        yield folder
        record.unlink(missing_ok=True)
    finally:
        lock.release()


def _recorded(record: Path) -> Path | None:
    """The folder an unfinished run of the request wrote to, while it still exists."""
    try:
        folder = Path(json.loads(record.read_text())["outputs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder if folder.is_dir() else None

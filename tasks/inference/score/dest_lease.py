"""One scoring writes a table at a time: a lease on ``dest``, taken before anything is written.

Two scorings into one ``dest`` at once would mix (on S3, each one's parts under the prefix and
its ``_SUCCESS`` over the other's) or silently replace each other (a file here). As DVC's
repository lock and Hadoop's output committers do, the second is refused at once, with
DestinationBusyError naming the holder (host, pid, flow run, since when) and what to do; it
writes nothing.

- A table here: ``.<name>.writer`` beside it, ``flock``ed, with the holder's record inside. The
  kernel frees it however the holder ends, so a killed scoring never blocks the next.
- An ``s3://`` prefix: ``_temporary/_lease/<generation>`` objects, each made with
  ``If-None-Match: *``, so of two scorings making the same one, S3 lets only one. The highest
  generation holds the prefix; its holder writes it again every ``LEASE_S / 5`` seconds. A lease
  that was not renewed for ``LEASE_S`` seconds (by S3's clock), or whose holder is gone (its
  process ended, seen on its own machine; or it is an earlier try of the same Prefect flow run),
  is taken over by making the next generation: of two takers, one wins. The holder checks that it
  still holds the lease before it publishes and before it writes the marker.

What no lease can promise without the store's help: a holder stalled for longer than
``LEASE_S`` between that check and its last write could still write after a taker. Details:
docs/scoring.md#one-writer-per-table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from models.atomic import temp_stem
from models.locks import lock_fd
from tasks.inference.score.s3_images import list_objects
from tasks.shared.errors import DestinationBusyError
from tasks.shared.holders import running_here, this_process
from tasks.shared.object_store import S3Url, s3_error, s3_request, shared_client

LEASE_S = 300.0  # a lease not renewed for this long is taken over (its holder renews 5 times)
TEMPORARY = "_temporary"  # under an S3 prefix: what its writer has not published yet
LEASES = "_lease"  # under TEMPORARY: the lease's generations
WRITER = "writer"  # a local table's lock file: .<name>.writer
_TAKE_TRIES = 5  # S3: list, read the holder, make the next generation; again if another made it
_RACED = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}

LOGGER = logging.getLogger(__name__)


class DestLease:
    """A held lease on a table (a local one: the kernel's lock, which cannot be lost)."""

    def check(self) -> None:
        """Raise DestinationBusyError when another scoring has taken the table over."""


@contextlib.contextmanager
def holding_dest(dest: Path | S3Url) -> Iterator[DestLease]:
    """Hold the lease on ``dest`` for the block; DestinationBusyError at once when another
    scoring holds it."""
    if isinstance(dest, S3Url):
        lease = _S3Lease(dest)
        lease.take()
        try:
            yield lease
        finally:
            lease.release()
    else:
        with _local_lease(Path(dest)) as lease:
            yield lease


def _record() -> dict[str, Any]:
    """What a lease says of its holder: this process, its flow run, since when, its deadline."""
    return {
        **this_process(),
        "flow_run": _flow_run(),
        "since": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "lease_s": LEASE_S,
    }


def _flow_run() -> dict[str, str] | None:
    """The Prefect flow run this scoring runs in (its id and name), if any. Prefect is asked only
    when it is loaded: a flow run has loaded it, a plain ``imageops score`` has not."""
    if "prefect" not in sys.modules:
        return None
    from prefect.runtime import flow_run

    return {"id": str(flow_run.id), "name": str(flow_run.name)} if flow_run.id else None


def _holder(record: dict[str, Any]) -> str:
    """The holder as a person can find it: pid and host, flow run, since when."""
    if not record:
        return "a scoring whose lease cannot be read"
    words = f"pid {record.get('pid', '?')} on {record.get('host', '?')}"
    run = record.get("flow_run")
    if run:
        words += f" (flow run {run.get('name')!r}, {run.get('id')})"
    return f"{words}, writing since {record.get('since', '?')}"


def _busy(dest: Path | S3Url, holder: str, hint: str) -> DestinationBusyError:
    return DestinationBusyError(
        f"{dest} is being written by another scoring: {holder}.",
        f"Wait for it to end, or score into another dest. {hint}",
    )


# --- a table here -------------------------------------------------------------------------------


@contextlib.contextmanager
def _local_lease(dest: Path) -> Iterator[DestLease]:
    """``flock`` on ``.<name>.writer`` beside ``dest``, the holder's record in it; removed when
    released (before its lock goes, so no one locks a file that is no longer there), with the
    folders made for it if they stayed empty."""
    path = dest.parent / f"{temp_stem(dest.name)}.{WRITER}"
    made = [folder for folder in [dest.parent, *dest.parent.parents] if not folder.exists()]
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:  # its folder is not there (or went with a lease just released)
            dest.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            if not lock_fd(fd, wait=False):
                holder = _holder(_read_record(fd))
                raise _busy(dest, holder, f"Its hold ends with its process ({path}).")
            with contextlib.suppress(FileNotFoundError):  # removed by the holder we waited for
                if os.path.samestat(os.fstat(fd), os.lstat(path)):
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record()).encode(), 0)
        yield DestLease()
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        for folder in made:  # deepest first; one holding anything stays
            with contextlib.suppress(OSError):
                folder.rmdir()


def _read_record(fd: int) -> dict[str, Any]:
    """The holder's record in a lock file or lease ({} when it is being written or unreadable)."""
    try:
        record = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


# --- an S3 prefix -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Generation:
    """A lease generation as read: its object, its holder's record, seconds since it was
    written (by S3's clock)."""

    url: S3Url
    record: dict[str, Any]
    age_s: float

    @property
    def number(self) -> int:
        return int(self.url.name)


class _S3Lease(DestLease):
    """The lease on an S3 prefix: the generation this scoring made, renewed by a thread."""

    def __init__(self, dest: S3Url) -> None:
        self.dest = dest
        self.folder = dest / TEMPORARY / LEASES
        self.record = _record()
        self.held: S3Url | None = None
        self.lost = False
        self.lost_to: _Generation | None = None  # the newer generation, when one was there
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewing: threading.Thread | None = None

    def take(self) -> None:
        """Make the first generation, or the next one over a lease that may be taken over."""
        current = None
        for _ in range(_TAKE_TRIES):
            current = self._current()
            number = 1
            if current is not None:
                why = _takeable(current, self.record)
                if why is None:
                    raise self._refusal(current)
                number = current.number + 1
            url = self.folder / f"{number:010d}"
            if not self._make(url):
                continue  # another scoring made it first: read who
            self.held = url
            if current is not None:
                LOGGER.warning("Took %s over from %s: %s", self.dest, _holder(current.record), why)
            self._remove_older()
            self._renewing = threading.Thread(
                target=self._renew_until_released, name="score-lease", daemon=True
            )
            self._renewing.start()
            return
        raise self._refusal(current)

    def check(self) -> None:
        """Renew now; DestinationBusyError when another scoring took the prefix over."""
        if not self._renew():
            holder = _holder(self.lost_to.record) if self.lost_to else "another scoring"
            raise DestinationBusyError(
                f"{self.dest} was taken over by {holder} while this scoring wrote it: this "
                f"scoring's lease was not renewed for {LEASE_S:.0f} s. Nothing was published.",
                "Check that machine's clock and load (a stopped process holds no lease), then "
                "score again once the other scoring has ended; the parts already scored are kept.",
            )

    def release(self) -> None:
        """Stop renewing and remove this scoring's generation (a taker's is left alone)."""
        self._stop.set()
        if self._renewing is not None:
            self._renewing.join()
        if self.held is not None:
            with contextlib.suppress(Exception):  # an unreachable S3: it runs out instead
                s3_request(
                    "write", self.held, "delete_object", Bucket=self.held.bucket, Key=self.held.key
                )

    def _refusal(self, current: _Generation | None) -> DestinationBusyError:
        holder = "another scoring" if current is None else _holder(current.record)
        if current is not None:
            holder += f", its lease renewed {current.age_s:.0f} s ago"
        return _busy(
            self.dest,
            holder,
            "A scoring stopped hard frees it at once on its own machine, elsewhere "
            f"{LEASE_S:.0f} s after its last renewal; to free it at once, delete "
            f"{self.folder}/ once you are sure that scoring is gone.",
        )

    def _numbers(self) -> list[S3Url]:
        """The generations there, oldest first."""
        keys = [obj["Key"] for obj in list_objects(self.folder, "write under")]
        return [S3Url(self.folder.bucket, key) for key in sorted(keys)]

    def _current(self) -> _Generation | None:
        """The newest generation and its holder (None: no lease); again if it goes meanwhile."""
        from botocore.exceptions import BotoCoreError, ClientError

        for _ in range(_TAKE_TRIES):
            generations = self._numbers()
            if not generations:
                return None
            url = generations[-1]
            try:
                answer = shared_client().get_object(Bucket=url.bucket, Key=url.key)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    continue  # released between the listing and the read
                raise s3_error(exc, "read", url) from exc
            except BotoCoreError as exc:
                raise s3_error(exc, "read", url) from exc
            with answer["Body"] as body:
                try:
                    record = json.loads(body.read())
                except ValueError:
                    record = {}
            date = answer["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
            now = parsedate_to_datetime(date) if date else datetime.now(UTC)
            age = (now - answer["LastModified"]).total_seconds()
            return _Generation(url, record if isinstance(record, dict) else {}, age)
        return None

    def _make(self, url: S3Url) -> bool:
        """Write generation ``url`` if no one has: False when another scoring made it first."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            shared_client().put_object(
                Bucket=url.bucket,
                Key=url.key,
                Body=json.dumps(self.record).encode(),
                ContentType="application/json",
                IfNoneMatch="*",
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _RACED:
                return False
            raise s3_error(exc, "write under", self.folder) from exc
        except BotoCoreError as exc:
            raise s3_error(exc, "write under", self.folder) from exc
        return True

    def _remove_older(self) -> None:
        """Remove the generations this one replaced (leftovers of scorings taken over)."""
        for url in self._numbers():
            if url.name < self.held.name:
                s3_request("write", url, "delete_object", Bucket=url.bucket, Key=url.key)

    def _renew(self) -> bool:
        """Write this scoring's generation again, unless a newer one was made (or it is gone):
        then False, for good."""
        with self._lock:
            if self.lost or self.held is None:
                return False
            generations = self._numbers()
            if self.held not in generations or generations[-1] != self.held:
                self.lost, self.lost_to = True, self._current()
                return False
            s3_request(
                "write",
                self.held,
                "put_object",
                Bucket=self.held.bucket,
                Key=self.held.key,
                Body=json.dumps(self.record).encode(),
                ContentType="application/json",
            )
            return True

    def _renew_until_released(self) -> None:
        while not self._stop.wait(LEASE_S / 5):
            try:
                if not self._renew():
                    LOGGER.warning("Lost the lease on %s to another scoring", self.dest)
                    return
            except Exception as exc:  # S3 away for a moment: the next renewal may reach it
                LOGGER.warning("Could not renew the lease on %s: %s", self.dest, exc)


def _takeable(current: _Generation, mine: dict[str, Any]) -> str | None:
    """Why the lease ``current`` may be taken over by the scoring ``mine``; None: it may not."""
    try:
        deadline = float(current.record.get("lease_s", LEASE_S))
    except (TypeError, ValueError):
        deadline = LEASE_S
    if current.age_s > deadline:
        return f"its lease was not renewed for {current.age_s:.0f} s"
    if running_here(current.record) is False:
        return "its process has ended"
    run, own = current.record.get("flow_run"), mine.get("flow_run")
    if run and own and run.get("id") == own.get("id"):
        return "it was an earlier try of this flow run"
    return None

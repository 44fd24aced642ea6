"""``imageops team join``: a GPU machine joins the team with the server machine's join file.

The join file (``<home>/team/team.env`` of the server machine, mode 0600) holds every variable a
worker machine needs. Before starting anything, every server is asked whether it answers and takes
the file's credentials, so an error names the server and its address. Then a Ray worker node and a
Prefect worker that runs only what the project registered (``app.checked_worker``) run with those
variables until Ctrl-C or SIGTERM.
Details: docs/stack.md#the-team-stack-imageops-team.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from app.stack import Services, _tool, stop_leader_first
from app.team import (
    BUCKET,
    CHECK_TIMEOUT_S,
    JOIN_DIR,
    JOIN_VARIABLES,
    RAY_STOP_TIMEOUT_S,
    START_TIMEOUT_S,
    _tcp_open,
    ray_temp_dir,
)
from app.work_pools import POOLS
from tasks.shared import servers
from tasks.shared.errors import (
    TeamAuthError,
    TeamJoinFileError,
    TeamStackError,
    TeamUnreachableError,
)
from tasks.shared.log_tail import tail
from tasks.shared.private_folders import private_folder
from tasks.shared.settings import Settings


def read_join_file(path: Path) -> dict[str, str]:
    """The join file's variables; refused when missing, unreadable, open to others or short."""
    copy = (
        "Copy it from the server machine (`scp SERVER:PROJECT/.imageops/team/team.env .`) and "
        f"`chmod 600 {path}`."
    )
    if not path.is_file():
        raise TeamJoinFileError(f"The join file {path} does not exist.", copy)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TeamJoinFileError(
            f"The join file {path} may be read by others (mode {mode:o}); it holds the team's "
            "passwords.",
            f"`chmod 600 {path}`, then run the command again.",
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise TeamJoinFileError(f"Cannot read the join file {path}: {exc.strerror}.", copy) from exc
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not match:
            raise TeamJoinFileError(f"{path}, line {number}: not NAME=value: {line[:40]!r}.", copy)
        try:
            words = shlex.split(match.group(2))
        except ValueError as exc:
            raise TeamJoinFileError(f"{path}, line {number}: {exc}.", copy) from exc
        values[match.group(1)] = " ".join(words)
    missing = [name for name in JOIN_VARIABLES if not values.get(name)]
    if missing:
        raise TeamJoinFileError(f"The join file {path} lacks {', '.join(missing)}.", copy)
    return values


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: the one the server's machines reach."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))  # UDP: nothing is sent, the kernel only picks the route
        return sock.getsockname()[0]


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_servers(values: dict[str, str], pool: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Every server of the join file answers and takes its credentials, else one clear error."""
    import httpx
    from botocore.exceptions import BotoCoreError, ClientError

    from tasks.shared.object_store import s3_client

    again = "Copy the join file again from the server machine (it changes when secrets rotate)."

    def unreachable(what: str, where: str, exc: object) -> TeamUnreachableError:
        return TeamUnreachableError(
            f"The {what} at {where} does not answer: {exc}.",
            f"Check that `imageops team server` runs on the server machine and that this "
            f"machine reaches {where} (route, firewall).",
        )

    api = values["PREFECT_API_URL"]
    user, _, password = values["PREFECT_API_AUTH_STRING"].partition(":")
    try:
        httpx.get(f"{api}/health", timeout=timeout_s).raise_for_status()
        answer = httpx.get(f"{api}/work_pools/{pool}", auth=(user, password), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise unreachable("Prefect server", api, exc) from exc
    if answer.status_code == 401:
        raise TeamAuthError(
            f"The Prefect server at {api} refused the join file's PREFECT_API_AUTH_STRING (401).",
            again,
        )
    if answer.status_code == 404:
        raise TeamStackError(
            f"The Prefect server at {api} has no work pool {pool!r}.",
            f"Join one of {', '.join(POOLS)} (--pool), which `imageops team server` creates.",
        )

    mlflow = values["IMAGEOPS_MLFLOW_TRACKING_URI"]
    login = (values["MLFLOW_TRACKING_USERNAME"], values["MLFLOW_TRACKING_PASSWORD"])
    try:
        answer = httpx.get(
            f"{mlflow}/api/2.0/mlflow/experiments/search",
            params={"max_results": 1}, auth=login, timeout=timeout_s,
        )  # fmt: skip
    except httpx.HTTPError as exc:
        raise unreachable("MLflow server", mlflow, exc) from exc
    if answer.status_code in (401, 403):
        raise TeamAuthError(
            f"The MLflow server at {mlflow} refused the join file's MLFLOW_TRACKING_USERNAME / "
            f"MLFLOW_TRACKING_PASSWORD ({answer.status_code}).",
            again,
        )

    endpoint = values["IMAGEOPS_S3_ENDPOINT_URL"]
    client = s3_client(
        endpoint, values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"],
        timeout_s=timeout_s, attempts=1,
    )  # fmt: skip
    try:
        client.head_bucket(Bucket=BUCKET)
    except ClientError as exc:
        raise TeamAuthError(
            f"The S3 server at {endpoint} refused the join file's AWS_ACCESS_KEY_ID / "
            f"AWS_SECRET_ACCESS_KEY for bucket {BUCKET!r}: {exc}.",
            again,
        ) from exc
    except BotoCoreError as exc:
        raise unreachable("S3 server", endpoint, exc) from exc

    ray = values["IMAGEOPS_RAY_ADDRESS"]
    if not _tcp_open(*_split_address(ray), timeout_s=timeout_s):
        raise unreachable("Ray head", ray, "no connection")


class TeamMember(Services):
    """A GPU machine in the team: a Ray worker node and a Prefect worker, until Ctrl-C."""

    command = "imageops team join"

    def __init__(
        self,
        settings: Settings,
        join_file: Path,
        *,
        node_ip: str | None = None,
        pool: str = "local",
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        super().__init__(settings.home_dir / JOIN_DIR, settings.project_root)
        if pool not in POOLS:
            raise TeamStackError(
                f"Unknown work pool {pool!r}.", f"Use one of {', '.join(POOLS)} (--pool)."
            )
        self.settings, self.join_file, self.pool = settings, join_file, pool
        self.num_cpus, self.num_gpus, self.say = num_cpus, num_gpus, say
        self.values = read_join_file(join_file)
        self.ray_address = self.values["IMAGEOPS_RAY_ADDRESS"]
        self.node_ip = node_ip or address_towards(*_split_address(self.ray_address))
        self.worker_name = f"{socket.gethostname()}-{self.node_ip}"

    def environment(self) -> dict[str, str]:
        """The Ray node's and the Prefect worker's (and so every flow run's) environment."""
        v = self.values
        settings = Settings(
            project_root=self.settings.project_root,
            home=self.settings.home_dir,
            mlflow_tracking_uri=v["IMAGEOPS_MLFLOW_TRACKING_URI"],
            prefect_api_url=v["IMAGEOPS_PREFECT_API_URL"],
            dvc_remote_url=v["IMAGEOPS_DVC_REMOTE_URL"],
            s3_endpoint_url=v["IMAGEOPS_S3_ENDPOINT_URL"],
            checkpoint_url=v["IMAGEOPS_CHECKPOINT_URL"],
            registered_model_name=self.settings.registered_model_name,
            mlflow_experiment=self.settings.mlflow_experiment,
        )
        # The join file's last: its Prefect auth string, not a local stack's (Settings).
        return dict(os.environ) | settings.environment() | v | {"RAY_USAGE_STATS_ENABLED": "0"}

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Check every server, then start the Ray node and the Prefect worker."""
        check_servers(self.values, self.pool)
        # Owner-only before Ray starts: it makes its sessions 0777 (app.team.ray_temp_dir).
        private_folder(self.settings.home_dir)
        private_folder(self.dir)
        env = self.environment()
        try:
            args = [_tool("ray"), "start", "--address", self.ray_address,
                    "--node-ip-address", self.node_ip, "--disable-usage-stats",
                    "--temp-dir", str(ray_temp_dir(self.dir / "ray")), "--block"]  # fmt: skip
            if self.num_cpus is not None:
                args += ["--num-cpus", str(self.num_cpus)]
            if self.num_gpus is not None:
                args += ["--num-gpus", str(self.num_gpus)]
            ray = self._launch(
                "ray-worker", args, env,
                stopper=lambda p: stop_leader_first(p, signal.SIGTERM, RAY_STOP_TIMEOUT_S),
            )  # fmt: skip
            self._wait_ray(ray.log, timeout_s)
            self._launch(
                "prefect-worker",
                [sys.executable, "-m", "app.checked_worker", "--pool", self.pool,
                 "--name", self.worker_name],
                env,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _wait_ray(self, log: Path | None, timeout_s: float) -> None:
        assert log is not None

        def started() -> bool:
            text = log.read_text(errors="replace") if log.is_file() else ""
            if "InvalidAuthToken" in text or "AuthenticationError" in text:
                raise TeamAuthError(
                    f"The Ray head at {self.ray_address} refused the join file's RAY_AUTH_TOKEN.",
                    "Copy the join file again from the server machine.",
                )
            self.check_alive()
            return "Ray runtime started" in text

        if not servers.wait_until(started, timeout_s, interval_s=0.5):
            raise TeamUnreachableError(
                f"This machine's Ray node ({self.node_ip}) did not join the Ray head at "
                f"{self.ray_address} within {timeout_s:.0f} s. End of {log}:\n{tail(log)}",
                "Check that the head reaches this machine at --node-ip (Ray connects both "
                "ways) and that no firewall is in between.",
            )

"""``imageops team join``: a GPU machine joins the team with the server machine's join file.

The join file (``<home>/team/team.env`` of the server machine, mode 0600; on the GPU machine
``~/.config/imageops/team.env`` by default, outside any checkout) holds every variable a worker
machine needs. Before starting anything, every server is asked whether it answers and takes the
file's credentials (the Ray head's token too), so an error names the server and its address. Then
a Ray worker node and a Prefect worker that runs only what the project registered
(``app.checked_worker``) run with those variables until Ctrl-C or SIGTERM; one that exits is
started again, with back-off, once the servers answer.
Details: docs/stack.md#the-team-stack-imageops-team.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.ray_head import RayHeadRefused, RayHeadUnanswered, cluster_metadata, version_mismatch
from app.stack import Services, _Service, _tool, stop_leader_first
from app.team import (
    BUCKET,
    CHECK_TIMEOUT_S,
    JOIN_DIR,
    JOIN_FILE,
    JOIN_VARIABLES,
    RAY_STOP_TIMEOUT_S,
    START_TIMEOUT_S,
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

BACKOFF_MAX_S = 30.0  # a service that keeps exiting is started again at most this far apart
HEALTHY_S = 60.0  # one that ran this long before it exited starts its back-off anew
WAIT_S = 5.0  # how often a server that does not answer is asked again


def default_join_file() -> Path:
    """Where the join file goes: the user's configuration folder, outside every checkout (it
    holds the team's passwords; in a checkout, `git add -A` would commit them)."""
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "imageops" / JOIN_FILE


def read_join_file(path: Path) -> dict[str, str]:
    """The join file's variables; refused when missing, unreadable, open to others or short."""
    copy = (
        f"Copy it from the server machine (`mkdir -p {path.parent} && scp "
        f"SERVER:PROJECT/.imageops/team/team.env {path}`) and `chmod 600 {path}`."
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
    """Every server of the join file answers and takes its credentials, else one clear error.

    The Ray head first: one gRPC call (``app.ray_head``: milliseconds, where Ray's own client
    took seconds to import), which also gives its versions (a node of another Ray or Python
    would not join); a wrong token is refused before S3's client is imported.
    """
    ray = values["IMAGEOPS_RAY_ADDRESS"]
    try:
        metadata = cluster_metadata(ray, values["RAY_AUTH_TOKEN"], timeout_s)
    except RayHeadRefused:
        raise TeamAuthError(
            f"The Ray head at {ray} refused the join file's RAY_AUTH_TOKEN.", AGAIN
        ) from None
    except RayHeadUnanswered as exc:
        raise _unreachable("Ray head", ray, exc) from None
    mismatch = version_mismatch(metadata)
    if mismatch:
        raise TeamStackError(
            f"The Ray head at {ray} runs another version: {mismatch}.",
            "Install the project's lock on every machine (`make install`).",
        )
    _check_http_servers(values, pool, timeout_s)


AGAIN = "Copy the join file again from the server machine (it changes when secrets rotate)."


def _unreachable(what: str, where: str, exc: object) -> TeamUnreachableError:
    return TeamUnreachableError(
        f"The {what} at {where} does not answer: {exc}.",
        f"Check that `imageops team server` runs on the server machine and that this "
        f"machine reaches {where} (route, firewall).",
    )


def _check_http_servers(values: dict[str, str], pool: str, timeout_s: float) -> None:
    """Prefect, MLflow and S3 answer and take the join file's credentials."""
    import httpx
    from botocore.exceptions import BotoCoreError, ClientError

    from tasks.shared.object_store import s3_client

    api = values["PREFECT_API_URL"]
    user, _, password = values["PREFECT_API_AUTH_STRING"].partition(":")
    try:
        httpx.get(f"{api}/health", timeout=timeout_s).raise_for_status()
        answer = httpx.get(f"{api}/work_pools/{pool}", auth=(user, password), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable("Prefect server", api, exc) from exc
    if answer.status_code == 401:
        raise TeamAuthError(
            f"The Prefect server at {api} refused the join file's PREFECT_API_AUTH_STRING (401).",
            AGAIN,
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
        raise _unreachable("MLflow server", mlflow, exc) from exc
    if answer.status_code in (401, 403):
        raise TeamAuthError(
            f"The MLflow server at {mlflow} refused the join file's MLFLOW_TRACKING_USERNAME / "
            f"MLFLOW_TRACKING_PASSWORD ({answer.status_code}).",
            AGAIN,
        )

    endpoint = values["IMAGEOPS_S3_ENDPOINT_URL"]
    client = s3_client(
        endpoint, values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"],
        timeout_s=timeout_s, attempts=1,
    )  # fmt: skip
    try:
        client.head_bucket(Bucket=BUCKET)
    except ClientError as exc:
        # A server that is starting answers 503 or "no such bucket" for a moment: not a refusal.
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (401, 403):
            raise _unreachable("S3 server", endpoint, exc) from exc
        raise TeamAuthError(
            f"The S3 server at {endpoint} refused the join file's AWS_ACCESS_KEY_ID / "
            f"AWS_SECRET_ACCESS_KEY for bucket {BUCKET!r}: {exc}.",
            AGAIN,
        ) from exc
    except BotoCoreError as exc:
        raise _unreachable("S3 server", endpoint, exc) from exc


class TeamMember(Services):
    """A GPU machine in the team: a Ray worker node and a Prefect worker, until Ctrl-C.

    ``serve_forever`` starts either again when it exits (``supervise``), the other one running on.
    """

    command = "imageops team join"

    def __init__(
        self,
        settings: Settings,
        join_file: Path | None = None,
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
        self.join_file = join_file or default_join_file()
        self.settings, self.pool = settings, pool
        self.num_cpus, self.num_gpus, self.say = num_cpus, num_gpus, say
        self.values = read_join_file(self.join_file)
        self.attempts: dict[str, int] = {}  # restarts in a row, per service
        self.ray: _Service | None = None  # the Ray node, once started
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
            self.ray = self._launch(
                "ray-worker", args, env,
                stopper=lambda p: stop_leader_first(p, signal.SIGTERM, RAY_STOP_TIMEOUT_S),
            )  # fmt: skip
            self._wait_ray(timeout_s)
            self._launch(
                "prefect-worker",
                [sys.executable, "-m", "app.checked_worker", "--pool", self.pool,
                 "--name", self.worker_name],
                env,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _wait_ray(self, timeout_s: float) -> None:
        """Until this start of the Ray node has joined: its own lines decide, not an earlier
        start's (the log is appended to)."""
        ray = self.ray
        assert ray is not None and ray.process is not None

        def started() -> bool:
            text = self.output(ray)
            if "InvalidAuthToken" in text:
                raise TeamAuthError(
                    f"The Ray head at {self.ray_address} refused the join file's RAY_AUTH_TOKEN.",
                    AGAIN,
                )
            if ray.process.poll() is not None:
                raise TeamStackError(
                    f"The Ray node exited with code {ray.process.returncode} before it joined. "
                    f"End of {ray.log}:\n{tail(ray.log, offset=ray.offset) or '(empty)'}",
                    f"Fix what its log says, then run `{self.command}` again.",
                )
            return "Ray runtime started" in text

        if not servers.wait_until(started, timeout_s, interval_s=0.5):
            raise TeamUnreachableError(
                f"This machine's Ray node ({self.node_ip}) did not join the Ray head at "
                f"{self.ray_address} within {timeout_s:.0f} s. End of {ray.log}:\n"
                f"{tail(ray.log, offset=ray.offset)}",
                "Check that the head reaches this machine at --node-ip (Ray connects both "
                "ways) and that no firewall is in between.",
            )

    # --- supervision -----------------------------------------------------------------------

    def watch(self) -> None:
        """Until Ctrl-C (or SIGTERM): a service that exits is started again."""
        self.supervise()

    def supervise(self) -> None:
        """Start again what has exited, after a back-off and once the servers answer.

        The back-off doubles per exit in a row (1, 2, 4 ... 30 s) and starts anew after a run of
        ``HEALTHY_S``. A Prefect worker's leftovers (flow runs it started: a training's driver)
        run on, and so does the Ray node, which that driver may use; a dead Ray node's leftovers
        are stopped first. A server that does not answer (a restart of the server machine) is
        waited for; one that refuses the join file's credentials ends the join (TeamAuthError).
        """
        dead = [s for s in self.services if s.process is not None and s.process.poll() is not None]
        if not dead:
            return
        pauses = []
        for service in dead:
            assert service.process is not None
            healthy = time.monotonic() - service.started_at >= HEALTHY_S
            attempt = 1 if healthy else self.attempts.get(service.name, 0) + 1
            self.attempts[service.name] = attempt
            pause = min(2.0 ** (attempt - 1), BACKOFF_MAX_S)
            self.say(
                f"{service.name} exited with code {service.process.returncode}; restarting in "
                f"{pause:.0f} s (attempt {attempt})"
            )
            pauses.append(pause)
        time.sleep(max(pauses))
        self._wait_for_servers()
        for service in dead:  # in start order: the Ray node before the worker
            self._restart(service)

    def _wait_for_servers(self) -> None:
        """Until every server answers; said once, however often the reason changes while the
        server machine restarts (one server, then another, does not answer yet)."""
        waited = False
        while True:
            try:
                check_servers(self.values, self.pool)
            except TeamUnreachableError as exc:
                if not waited:
                    self.say(f"waiting: {exc.message} Asking again every {WAIT_S:.0f} s.")
                    waited = True
                time.sleep(WAIT_S)
            else:
                if waited:
                    self.say("the servers answer again")
                return

    def _restart(self, service: _Service) -> None:
        if service is not self.ray:
            self.restart(service, keep_group=True)
            self.say(f"{service.name} restarted")
            return
        self.restart(service, keep_group=False)
        try:
            self._wait_ray(START_TIMEOUT_S)
        except TeamAuthError:
            raise
        except TeamStackError:  # exited or did not join: the next round tries again
            lines = self.output(service).strip().splitlines()
            self.say(f"{service.name} did not join: {lines[-1] if lines else '(no output)'}")
            assert service.process is not None
            servers.stop(service.process)
            return
        self.say(f"{service.name} restarted: this machine's Ray node is back in the cluster")

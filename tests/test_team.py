"""The team stack for real: the docs' commands as written (docs/team.md), every login, and no job
variable that runs a caller's command.

One stack for the module. The team page's block "On the server machine" runs in a project folder of
its own with ``SERVER`` = 10.231.9.1, an address this test gives the test machine on a veth pair;
the block "On each GPU machine" runs in another folder, inside a network namespace of its own
(its own network stack at 10.231.9.2: another machine as far as the servers know). Without root
or ``ip``, both run on 127.0.0.1. Traffic goes only to those addresses and loopback, and the
namespace and veth are deleted at the end, even when a test fails. The last test stops both
commands as a person would (Ctrl-C, SIGTERM) and checks that nothing they started is left.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from file_modes import open_to_others
from server_processes import LONG_WAIT, PROMPT_WORKER, base_env

from app.mlflow_ui import REMEMBER_MODEL_VIEW
from app.ray_head import version_mismatch
from app.stack import Services, kept_secret
from app.team import JOIN_VARIABLES, TeamServer
from app.team_join import check_servers, default_join_file, read_join_file
from app.work_pools import base_job_template
from tasks.shared import servers
from tasks.shared.errors import TeamAuthError, TeamJoinFileError, TeamUnreachableError
from tasks.shared.log_tail import read_from
from tasks.shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TEAM_PAGE = ROOT / "docs" / "team.md"  # the README's team section, moved to the docs site
ACTIVATE = ". .venv/bin/activate"  # the README's line that puts `imageops` on PATH
SUBNET = "10.231.9"  # this test's own addresses: .1 the server machine, .2 the GPU machine
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0


# --- the team page's commands (docs/team.md, the README's before the docs site) ------------


def readme_commands(heading: str) -> list[str]:
    """The command lines of the first ```bash block under the team page's heading ``## heading``."""
    text = TEAM_PAGE.read_text()
    start = text.index(f"\n## {heading}\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block under '## {heading}' in {TEAM_PAGE.relative_to(ROOT)}"
    lines = [line.split(" #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def readme_join_variables() -> list[str]:
    """The variables the team page lists, one ``- `NAME`: what`` line each."""
    text = TEAM_PAGE.read_text()
    assert text.startswith("# A team on several machines\n")
    return re.findall(r"^- `([A-Z0-9_]+)`: ", text, re.M)


def test_readme_lists_every_variable_of_the_join_file() -> None:
    assert readme_join_variables() == list(JOIN_VARIABLES)
    assert readme_commands("On the server machine") == [
        ACTIVATE,
        "imageops team server --host SERVER",
    ]
    assert readme_commands("On each GPU machine")[-2:] == [ACTIVATE, "imageops team join"]


def run_readme_line(
    line: str, server_ip: str, server_dir: Path, cwd: Path, env: dict[str, str]
) -> None:
    """A README line that is not ``imageops``, as a shell runs it (``~`` is ``env``'s HOME).

    ``scp`` is the one step a test cannot take as written: it copies. The environment's
    activation is this test's own Python, which runs ``imageops`` (``_as_run``).
    """
    if line == ACTIVATE:
        return
    line = line.replace("SERVER:", "").replace("PROJECT", str(server_dir))
    line = re.sub(r"^scp ", "cp ", line).replace("SERVER", server_ip)
    subprocess.run(["bash", "-c", line], cwd=cwd, env=env, check=True, timeout=30)


def test_following_the_readme_leaves_the_join_file_out_of_git(tmp_path: Path) -> None:
    """Issue 44, finding 4: the README copied the join file, with every password of the team,
    into the checkout, where `git add -A` staged it. Its place now is ~/.config/imageops, and a
    `team.env` in a checkout (where an old README put it) is ignored."""
    checkout, home, server_dir = tmp_path / "checkout", tmp_path / "home", tmp_path / "server"
    for folder in (checkout, home, server_dir / ".imageops" / "team"):
        folder.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    shutil.copyfile(ROOT / ".gitignore", checkout / ".gitignore")
    secret = "".join(f"{k}=secret\n" for k in JOIN_VARIABLES)
    (server_dir / ".imageops" / "team" / "team.env").write_text(secret)
    env = _environment() | {"HOME": str(home)}
    env.pop("XDG_CONFIG_HOME", None)
    for line in readme_commands("On each GPU machine"):
        if not line.startswith("imageops "):
            run_readme_line(line, "127.0.0.1", server_dir, checkout, env)
    joined = home / ".config" / "imageops" / "team.env"
    assert joined.read_text() == secret and joined.stat().st_mode & 0o777 == 0o600
    (checkout / "team.env").write_text(secret)  # where the README said to put it before
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True, env=env)
    staged = subprocess.run(
        ["git", "diff", "--cached", "--name-only"], cwd=checkout, check=True, env=env,
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert staged == [".gitignore"]
    with pytest.MonkeyPatch.context() as patch:  # the command's default: that same file
        patch.setenv("HOME", str(home))
        patch.delenv("XDG_CONFIG_HOME", raising=False)
        assert default_join_file() == joined


# --- two machines ---------------------------------------------------------------------------


@dataclass
class Network:
    server_ip: str
    gpu_ip: str
    namespace: str | None  # the GPU machine's network namespace; None: both on loopback

    def on_gpu_machine(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args] if self.namespace else args


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """10.231.9.1 here and 10.231.9.2 in a namespace of its own, joined by a veth pair."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        yield Network("127.0.0.1", "127.0.0.1", None)
        return
    tag = f"{os.getpid() % 100000}"
    namespace, here, there = f"imageops-team-{tag}", f"itm{tag}a", f"itm{tag}b"
    try:
        _ip("netns", "add", namespace)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", namespace)
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", namespace, "addr", "add", f"{SUBNET}.2/24", "dev", there)
        _ip("-n", namespace, "link", "set", there, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield Network(f"{SUBNET}.1", f"{SUBNET}.2", namespace)
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("link", "del", here)  # takes its peer in the namespace with it
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("netns", "del", namespace)


@dataclass
class Team:
    network: Network
    server_dir: Path
    gpu_dir: Path
    server: subprocess.Popen
    logs: Path
    gpu_env: dict[str, str] = field(default_factory=dict)  # the GPU machine's shell
    join: subprocess.Popen | None = None
    values: dict[str, str] = field(default_factory=dict)

    @property
    def join_logs(self) -> Path:
        return self.gpu_dir / ".imageops" / "team-join" / "logs"

    def report(self) -> str:
        logs = [self.logs / "server.log", self.logs / "join.log"]
        logs += sorted((self.server_dir / ".imageops" / "team" / "logs").glob("*.log"))
        logs += sorted(self.join_logs.glob("*.log"))
        return "\n".join(
            f"----- {p} -----\n{p.read_text(errors='replace')[-2500:]}" for p in logs if p.is_file()
        )

    def wait(self, what: str, ready: Callable[[], Any], timeout_s: float) -> Any:
        def attempt() -> Any:
            for name, proc in (("team server", self.server), ("team join", self.join)):
                if proc is not None and proc.poll() is not None:
                    pytest.fail(f"{name} exited ({proc.returncode}) waiting for {what}\n"
                                f"{self.report()}")  # fmt: skip
            with contextlib.suppress(httpx.HTTPError, OSError):
                return ready()
            return None

        result = servers.wait_until(attempt, timeout_s, **LONG_WAIT)
        if not result:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.report()}")
        return result

    def prefect(self) -> httpx.Client:
        user, _, password = self.values["PREFECT_API_AUTH_STRING"].partition(":")
        return httpx.Client(
            base_url=self.values["PREFECT_API_URL"], auth=(user, password), timeout=30
        )


def _environment() -> dict[str, str]:
    """A person's shell: no Prefect, MLflow or imageops settings; this checkout on PYTHONPATH."""
    env = base_env()
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *extra])
    env.pop("RAY_ADDRESS", None)
    return env


def _as_run(line: str, network: Network) -> list[str]:
    """A README ``imageops`` line, ``SERVER`` filled in, run by this checkout's CLI."""
    words = shlex.split(line.replace("SERVER", network.server_ip))
    assert words[0] == "imageops", line
    return [sys.executable, "-m", "app.cli", *words[1:]]


def _start(args: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("ab") as sink:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _start_server(network: Network, server_dir: Path, logs: Path) -> subprocess.Popen:
    """The README's line "On the server machine", in ``server_dir`` (its home: its secrets)."""
    (line,) = [line for line in readme_commands("On the server machine") if line != ACTIVATE]
    return _start(_as_run(line, network), server_dir, logs / "server.log", _environment())


@pytest.fixture(scope="module")
def team(network: Network) -> Iterator[Team]:
    """The README's two blocks running: the server machine's command, then the GPU machine's."""
    # Not under pytest's tmp_path: PostgreSQL runs as `postgres` when we are root, and must
    # enter the project folder.
    root = Path(tempfile.mkdtemp(prefix="imageops-team-"))
    root.chmod(0o755)
    server_dir, gpu_dir, logs = root / "server-machine", root / "gpu-machine", root / "logs"
    gpu_home = root / "gpu-home"  # the GPU machine's user's home: the join file goes there
    for folder in (server_dir, gpu_dir, logs, gpu_home):
        folder.mkdir(mode=0o755)
    env = _environment()
    server = _start_server(network, server_dir, logs)
    # Prefect's own setting passes through the join to its worker.
    gpu_env = env | PROMPT_WORKER | {"HOME": str(gpu_home), "COLUMNS": "200"}
    gpu_env.pop("XDG_CONFIG_HOME", None)
    team = Team(network, server_dir, gpu_dir, server, logs, gpu_env)
    try:
        team.wait(
            "the team server to be ready",
            lambda: "ready;" in (logs / "server.log").read_text(),
            START_TIMEOUT_S,
        )
        for line in readme_commands("On each GPU machine"):
            if line.startswith("imageops "):
                join_log = logs / "join.log"
                args = network.on_gpu_machine(_as_run(line, network))
                team.join = _start(args, gpu_dir, join_log, gpu_env)
                joined = lambda log=join_log: "joined;" in log.read_text()  # noqa: E731
                team.wait("the GPU machine to join", joined, 120)
            else:
                run_readme_line(line, network.server_ip, server_dir, gpu_dir, gpu_env)
        team.values = read_join_file(gpu_home / ".config" / "imageops" / "team.env")
        yield team
    finally:
        for proc, sig in ((team.join, signal.SIGINT), (team.server, signal.SIGTERM)):
            if proc is not None and proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        print(team.report())  # shown by pytest only when a test failed
        for link in (
            server_dir / ".imageops" / "team" / "ray",
            gpu_dir / ".imageops" / "team-join" / "ray",
        ):
            if link.is_symlink():  # Ray's short session folder (app.team.ray_temp_dir)
                shutil.rmtree(link.resolve(), ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


# --- logins -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_server_answers_only_with_the_join_files_logins(team: Team) -> None:
    v = team.values
    assert v["IMAGEOPS_PREFECT_API_URL"] == f"http://{team.network.server_ip}:4200/api"
    assert v["IMAGEOPS_RAY_ADDRESS"] == f"{team.network.server_ip}:6379"

    # Prefect: 401 without the auth string; with it, the API and the `prefect` command work.
    api = v["PREFECT_API_URL"]
    assert httpx.post(f"{api}/work_pools/filter", json={}, timeout=10).status_code == 401
    with team.prefect() as client:
        pools = client.post("/work_pools/filter", json={}).raise_for_status().json()
    assert {pool["name"] for pool in pools} >= {"local", "gpu-docker", "gpu-k8s"}
    env = _environment() | v
    listed = subprocess.run(
        [Path(sys.executable).with_name("prefect"), "deployment", "ls"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert listed.returncode == 0 and "imageops-train-model/train" in listed.stdout, listed
    refused = subprocess.run(
        [Path(sys.executable).with_name("prefect"), "deployment", "ls"],
        env=env | {"PREFECT_API_AUTH_STRING": "imageops:wrong"}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr

    # MLflow: 401 without credentials; with them, a run whose artifact lands in S3.
    uri = v["IMAGEOPS_MLFLOW_TRACKING_URI"]
    search = f"{uri}/api/2.0/mlflow/experiments/search"
    assert httpx.get(search, params={"max_results": 1}, timeout=10).status_code == 401
    wrong = ("admin", "wrong")
    assert httpx.get(search, params={"max_results": 1}, auth=wrong, timeout=10).status_code == 401
    # The UI's page, behind the login, opens in the model view (app/mlflow_ui.py's team_app)
    login = (v["MLFLOW_TRACKING_USERNAME"], v["MLFLOW_TRACKING_PASSWORD"])
    page = httpx.get(f"{uri}/", auth=login, timeout=30)
    assert page.status_code == 200 and REMEMBER_MODEL_VIEW.decode() in page.text, page.text[:300]
    assert httpx.get(f"{uri}/", timeout=10).status_code == 401
    script = (
        "import mlflow, sys\n"
        "mlflow.set_tracking_uri(sys.argv[1])\n"
        "mlflow.set_experiment('team-check')\n"
        "with mlflow.start_run() as run:\n"
        "    mlflow.log_param('lr', 0.01)\n"
        "    mlflow.log_text('hello', 'note.txt')\n"
        "print(mlflow.get_run(run.info.run_id).data.params['lr'])\n"
        "print(mlflow.artifacts.load_text(run.info.artifact_uri + '/note.txt'))\n"
    )
    logged = subprocess.run(
        [sys.executable, "-c", script, uri], env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert logged.returncode == 0, logged.stderr[-3000:]
    assert logged.stdout.split()[-2:] == ["0.01", "hello"]

    # S3: the join file's keys read the bucket (MLflow's artifact is there); no keys: refused.
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from tasks.shared.object_store import s3_client

    endpoint = v["IMAGEOPS_S3_ENDPOINT_URL"]
    client = s3_client(endpoint, v["AWS_ACCESS_KEY_ID"], v["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="imageops").get("Contents", [])]
    assert any(k.startswith("mlartifacts/") and k.endswith("/note.txt") for k in keys), keys
    import boto3

    anonymous = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
    )  # fmt: skip
    with pytest.raises(ClientError, match="AccessDenied"):
        anonymous.list_objects_v2(Bucket="imageops")
    forged = s3_client(endpoint, v["AWS_ACCESS_KEY_ID"], "not-the-secret-key", attempts=1)
    with pytest.raises(ClientError):
        forged.list_objects_v2(Bucket="imageops")
    # SeaweedFS's master, volume server and filer take no login: they stay on loopback.
    (weed,) = [
        p for p in psutil.Process(team.server.pid).children(recursive=True) if p.name() == "weed"
    ]
    listening = {
        (c.laddr.ip, c.laddr.port) for c in weed.net_connections("tcp") if c.status == "LISTEN"
    }
    exposed = {port for ip, port in listening if ip != "127.0.0.1"}
    if team.network.namespace:  # S3, and the S3 gateway's gRPC port (-s3.ip.bind binds both)
        assert 8333 in exposed and len(exposed) == 2, listening


@pytest.mark.slow
def test_the_gpu_machine_is_a_ray_node_and_a_prefect_worker(team: Team) -> None:
    v, gpu_ip = team.values, team.network.gpu_ip
    env = _environment() | v
    ray = Path(sys.executable).with_name("ray")
    status = subprocess.run(
        [ray, "status", "--address", v["IMAGEOPS_RAY_ADDRESS"]],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr[-2000:]
    assert len(re.findall(r"^ 1 node_", status.stdout, re.M)) == 2, status.stdout
    script = (
        "import json, ray, sys\n"
        "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
        "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))\n"
    )
    nodes = subprocess.run(
        [sys.executable, "-c", script, v["IMAGEOPS_RAY_ADDRESS"]],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert nodes.returncode == 0, nodes.stderr[-2000:]
    if team.network.namespace:
        assert gpu_ip in json.loads(nodes.stdout.splitlines()[-1])
    no_token = subprocess.run(
        [ray, "status", "--address", v["IMAGEOPS_RAY_ADDRESS"]],
        env=env | {"RAY_AUTH_TOKEN": "0" * 64}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert no_token.returncode != 0 and "InvalidAuthToken" in no_token.stdout + no_token.stderr

    with team.prefect() as client:
        workers = team.wait(
            "the GPU machine's Prefect worker",
            lambda: [
                w for w in client.post("/work_pools/local/workers/filter", json={}).json()
                if w["status"] == "ONLINE" and w["name"].endswith(f"-{gpu_ip}")
            ],
            60,
        )  # fmt: skip
    assert len(workers) == 1


@pytest.mark.slow
def test_secrets_are_owner_only_and_kept_for_the_next_start(team: Team) -> None:
    home = team.server_dir / ".imageops" / "team"
    secret_files = sorted((home / "secrets").iterdir())
    assert len(secret_files) >= 8
    assert (home / "secrets").stat().st_mode & 0o777 == 0o700
    for path in [*secret_files, home / "team.env", home / "mlflow-auth.ini"]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    # What a restart uses: the same secrets, so the same join file.
    settings = Settings(project_root=team.server_dir, home=team.server_dir / ".imageops")
    again = TeamServer(settings, host=team.network.server_ip, say=lambda _: None)
    assert again.join_variables() == read_join_file(home / "team.env")
    assert team.values == read_join_file(home / "team.env")


@pytest.mark.slow
def test_the_teams_state_is_open_to_no_other_user(team: Team) -> None:
    """PostgreSQL's data, the S3 volumes, both Ray nodes' sessions (0777 sockets: Ray's own
    mode), logs and secrets: nothing another local user may read or write (issue 43, finding 5).
    As root, PostgreSQL's account passes through the two folders above its data, and only it."""
    server, gpu = team.server_dir / ".imageops", team.gpu_dir / ".imageops"
    assert open_to_others(server) == []
    assert open_to_others(gpu) == []
    assert list((server / "team" / "s3").glob("*.dat"))
    sessions = [*server.glob("team/ray/temp/session_*"), *gpu.glob("team-join/ray/temp/session_*")]
    assert len(sessions) >= 2 and all(s.stat().st_mode & 0o777 == 0o777 for s in sessions)
    if os.geteuid() == 0:
        postgres = pwd.getpwnam("postgres")
        for folder in (server, server / "team"):
            assert folder.stat().st_mode & 0o777 == 0o710, folder
            assert folder.stat().st_gid == postgres.pw_gid, folder
        assert (server / "team" / "postgres").stat().st_uid == postgres.pw_uid


@pytest.mark.slow
def test_no_job_variable_runs_a_callers_command(team: Team) -> None:
    """The finding of issue 25: a POST with job_variables.command ran a shell command."""
    marker = Path(tempfile.gettempdir()) / f"imageops-pwned-{uuid.uuid4().hex}"
    hostile = {
        "command": f"touch {marker}",
        "env": {"BROWSER": f"touch {marker}.env #%s", "PYTHONWARNINGS": "all:0:antigravity.x:0:0"},
        "working_dir": str(marker.parent),
    }
    with team.prefect() as client:
        deployment = client.get("/deployments/name/imageops-train-model/train").json()
        for name, value in hostile.items():
            refused = client.post(
                f"/deployments/{deployment['id']}/create_flow_run",
                json={"job_variables": {name: value}},
            )
            assert refused.status_code == 422, refused.text
            assert name in refused.text
        # Without a deployment Prefect 3.8 does not check job variables: the worker must still
        # run only its own command, in its own environment.
        flow = client.post("/flows/", json={"name": "team-hostile"}).json()
        run = client.post(
            "/flow_runs/",
            json={"flow_id": flow["id"], "work_pool_name": "local", "job_variables": hostile,
                  "state": {"type": "SCHEDULED"}},
        ).raise_for_status().json()  # fmt: skip
        final = team.wait(
            "the worker to take the hostile flow run",
            lambda: (
                (s := client.get(f"/flow_runs/{run['id']}").json()["state"])["type"]
                in ("COMPLETED", "FAILED", "CRASHED")
                and s
            ),
            120,
        )
    assert final["type"] == "CRASHED"  # the GPU machine's worker refuses a run without deployment
    assert "has no deployment" in final["message"]
    assert not marker.exists() and not Path(f"{marker}.env").exists()


@pytest.mark.slow
def test_the_auth_string_does_not_change_what_the_gpu_machines_worker_runs(team: Team) -> None:
    """Issue 43: the join file's auth string PATCHed a command into the pool's template, and the
    GPU machine's worker ran it. Now that worker refuses the run, naming the change."""
    marker = Path(tempfile.gettempdir()) / f"imageops-pwned-{uuid.uuid4().hex}"
    hostile = base_job_template("local")
    hostile["job_configuration"]["command"] = f"touch {marker}"
    with team.prefect() as client:
        promote = client.get("/deployments/name/imageops-promote/promote").json()
        try:
            client.patch(
                "/work_pools/local", json={"base_job_template": hostile}
            ).raise_for_status()
            run = client.post(f"/deployments/{promote['id']}/create_flow_run", json={})
            run_id = run.raise_for_status().json()["id"]
            final = team.wait(
                "the worker to take the run",
                lambda: (
                    (s := client.get(f"/flow_runs/{run_id}").json()["state"])["type"]
                    in ("COMPLETED", "FAILED", "CRASHED")
                    and s
                ),
                120,
            )
        finally:
            client.patch(
                "/work_pools/local", json={"base_job_template": base_job_template("local")}
            ).raise_for_status()
    assert final["type"] == "CRASHED", final
    assert "job_configuration.command added" in final["message"], final["message"]
    assert not marker.exists()


@pytest.mark.slow
def test_join_names_the_server_that_refuses_or_does_not_answer(team: Team) -> None:
    v = team.values
    check_servers(v, "local")  # what `team join` checked before starting
    ip = team.network.server_ip
    cases: list[tuple[dict[str, str], type[Exception], str]] = [
        ({"PREFECT_API_AUTH_STRING": "imageops:wrong"}, TeamAuthError, "Prefect server at"),
        ({"MLFLOW_TRACKING_PASSWORD": "wrong"}, TeamAuthError, "MLflow server at"),
        ({"AWS_SECRET_ACCESS_KEY": "wrong"}, TeamAuthError, "S3 server at"),
        ({"RAY_AUTH_TOKEN": "0" * 64}, TeamAuthError, "Ray head at .* RAY_AUTH_TOKEN"),
        ({"PREFECT_API_URL": f"http://{ip}:1/api"}, TeamUnreachableError, f"Prefect.*{ip}:1"),
        ({"IMAGEOPS_MLFLOW_TRACKING_URI": f"http://{ip}:1"}, TeamUnreachableError, "MLflow"),
        ({"IMAGEOPS_S3_ENDPOINT_URL": f"http://{ip}:1"}, TeamUnreachableError, f"S3.*{ip}:1"),
        ({"IMAGEOPS_RAY_ADDRESS": f"{ip}:1"}, TeamUnreachableError, f"Ray head at {ip}:1"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            check_servers(v | change, "local", timeout_s=3)


def test_a_join_file_open_to_others_missing_or_short_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "team.env"
    with pytest.raises(TeamJoinFileError, match="does not exist"):
        read_join_file(path)
    path.write_text("".join(f"{k}=x\n" for k in JOIN_VARIABLES))
    path.chmod(0o644)
    with pytest.raises(TeamJoinFileError, match="chmod 600"):
        read_join_file(path)
    path.chmod(0o600)
    assert read_join_file(path) == dict.fromkeys(JOIN_VARIABLES, "x")
    path.write_text("IMAGEOPS_PREFECT_API_URL=http://x/api\n")
    with pytest.raises(TeamJoinFileError, match="lacks PREFECT_API_URL"):
        read_join_file(path)


def test_join_says_which_server_does_not_answer(tmp_path: Path) -> None:
    """The command as a person runs it: exit 2, the server and its address, no traceback."""
    from projects import imageops

    values = dict.fromkeys(JOIN_VARIABLES, "x") | {
        "IMAGEOPS_RAY_ADDRESS": "127.0.0.1:1",  # asked first; nothing listens on port 1
        "PREFECT_API_URL": "http://127.0.0.1:1/api",
    }
    path = tmp_path / "team.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(0o600)
    result = imageops("team", "join", "--env", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "TeamUnreachableError: The Ray head at 127.0.0.1:1 does not answer" in result.stderr
    assert "Traceback" not in result.stderr
    path.chmod(0o640)
    result = imageops("team", "join", "--env", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "chmod 600" in result.stderr


def test_a_ray_head_of_another_ray_or_python_is_named() -> None:
    """The check that `ray status` made (a node of another version does not join), from the
    head's cluster metadata as its GCS keeps it, by Ray's rule: Ray and Python up to the patch."""
    ray = importlib.metadata.version("ray")
    python = ".".join(map(str, sys.version_info[:3]))
    assert version_mismatch({"ray_version": ray, "python_version": python}) is None
    assert version_mismatch({}) is None  # a head that keeps none: Ray checks nothing either
    other = version_mismatch({"ray_version": "2.9.0", "python_version": python})
    assert (
        other
        == f"the head runs Ray 2.9.0 on Python {python}, this machine Ray {ray} on Python {python}"
    )
    assert version_mismatch({"ray_version": ray, "python_version": "3.10.1"})


def test_a_kept_secret_is_made_once_and_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "s"
    first = kept_secret(path, lambda: uuid.uuid4().hex)
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    assert kept_secret(path, lambda: "another") == first
    assert path.stat().st_mode & 0o777 == 0o600


# --- supervision (issue 44) -------------------------------------------------------------------


def _child(team: Team, marker: str) -> psutil.Process:
    """The one live process under ``team join`` with ``marker`` in its command line or name."""
    assert team.join is not None
    found = []
    for process in psutil.Process(team.join.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            named = marker in " ".join(process.cmdline()) or process.name() == marker
            if named and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    assert len(found) == 1, found
    return found[0]


def _active_ray_nodes(team: Team) -> int:
    """How many nodes the Ray head counts as active (`ray status`, as a person asks)."""
    status = subprocess.run(
        [Path(sys.executable).with_name("ray"), "status", "--address",
         team.values["IMAGEOPS_RAY_ADDRESS"]],
        env=_environment() | team.values, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    return len(re.findall(r"^ 1 node_", status.stdout.partition("Pending:")[0], re.M))


def _join_says(team: Team, offset: int, what: str, timeout_s: float = 120) -> str:
    """What ``team join`` printed since ``offset``, once it has said ``what``."""
    log = team.logs / "join.log"
    said = lambda: what in (text := read_from(log, offset)) and text  # noqa: E731
    return team.wait(f"team join to say {what!r}", said, timeout_s)


@pytest.mark.slow
def test_a_wrong_ray_token_is_one_error_before_anything_starts(team: Team) -> None:
    """Issue 44, finding 3: the Ray token was judged from the whole ray-worker.log, so an
    earlier join's "Ray runtime started" printed `joined` for a wrong token, which failed 25 s
    later with a traceback. Now the head is asked first: one TeamAuthError line within 5 s,
    and nothing started."""
    ray_log = team.join_logs / "ray-worker.log"
    assert "Ray runtime started" in ray_log.read_text()  # the running join's start
    size = ray_log.stat().st_size
    wrong = team.gpu_dir / "wrong.env"
    wrong.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in team.values.items()))
    wrong.write_text(wrong.read_text().replace(team.values["RAY_AUTH_TOKEN"], "0" * 64))
    wrong.chmod(0o600)

    def join(join_file: Path) -> tuple[subprocess.CompletedProcess, float]:
        """`imageops team join --env join_file` on the GPU machine, and how long it took."""
        args = [sys.executable, "-m", "app.cli", "team", "join", "--env", str(join_file)]
        t0 = time.monotonic()
        done = subprocess.run(
            team.network.on_gpu_machine(args), cwd=team.gpu_dir, env=team.gpu_env,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        return done, time.monotonic() - t0

    refused, took = join(wrong)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    head = team.values["IMAGEOPS_RAY_ADDRESS"]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: TeamAuthError: The Ray head at {head} refused the join file's RAY_AUTH_TOKEN."
    ], refused.stderr
    assert "joined" not in refused.stdout and "Traceback" not in refused.stderr
    assert ray_log.stat().st_size == size  # no Ray node was started
    # As the user waits: the interpreter and the command's imports (timed alone by the same
    # command refusing a join file that does not exist: 5 to 6 s at a load of 5, 10 to 11 s at
    # 8 to 10, when the whole refusal took 0.3 s more), then the head's answer to one gRPC call,
    # where `ray status` took 2.4 s on a quiet machine.
    missing, imports = join(team.gpu_dir / "no-such.env")
    assert "TeamJoinFileError" in missing.stderr, missing.stderr
    print(f"refused in {took:.1f} s; the command's start alone: {imports:.1f} s")
    assert took < max(5.0, imports + 2.0)
    check_servers(team.values, "local")  # the right file right after: every server takes it


@pytest.mark.slow
def test_a_killed_prefect_worker_is_restarted_and_the_ray_node_stays(team: Team) -> None:
    """Issue 44, findings 1 and 6: a SIGKILLed worker ended `team join`, and took the Ray node
    (a training's driver's) with it."""
    worker, raylet = _child(team, "app.checked_worker"), _child(team, "raylet")
    offset = (team.logs / "join.log").stat().st_size
    worker_log = team.join_logs / "prefect-worker.log"
    worker_offset = worker_log.stat().st_size
    worker.kill()
    said = _join_says(team, offset, "prefect-worker restarted")
    assert "prefect-worker exited with code -9; restarting in 1 s (attempt 1)" in said, said
    assert "ray-worker" not in said
    assert raylet.is_running() and _child(team, "raylet").pid == raylet.pid
    assert _child(team, "app.checked_worker").pid != worker.pid
    team.wait(
        "the new worker to start",
        lambda: re.search(r"Worker .* started", read_from(worker_log, worker_offset)),
        120,
    )


@pytest.mark.slow
def test_a_dead_ray_node_is_restarted_and_rejoins(team: Team) -> None:
    """Issue 44, findings 3 and 6: a lost Ray node ended `team join`, and a start read the
    whole ray-worker.log: a bad token's lines there refused every later start. Here the log
    holds such a line, the raylet is SIGKILLed, and the node comes back from its own lines."""
    ray_log = team.join_logs / "ray-worker.log"
    with ray_log.open("a") as log:  # what a start with a wrong token left
        log.write("gcs_client.cc:210: Unauthenticated: RPC error: InvalidAuthToken\n")
    worker, raylet = _child(team, "app.checked_worker"), _child(team, "raylet")
    offset = (team.logs / "join.log").stat().st_size
    raylet.kill()
    # A Ray node takes 20 s to start here, and one on 2 cores under a load of 8 may miss Ray's own
    # 30 s for its raylet to register: `team join` then tries again, and so the wait is long.
    said = _join_says(team, offset, "ray-worker restarted", timeout_s=300)
    assert re.search(r"ray-worker exited with code \S+; restarting in 1 s \(attempt 1\)", said)
    assert "prefect-worker" not in said and worker.is_running()
    assert _child(team, "raylet").pid != raylet.pid
    # The head and this machine's new node; the dead one is gone.
    team.wait("the Ray node to rejoin", lambda: _active_ray_nodes(team) == 2, 120)


def test_a_restarted_service_leaves_its_group_running_until_the_stop(tmp_path: Path) -> None:
    """A Prefect worker's flow runs are in its process group: restarting the worker leaves
    them running (a training's driver among them); stopping the join stops them."""
    services = Services(tmp_path, tmp_path)
    child = tmp_path / "child"
    service = services._launch(
        "worker", ["sh", "-c", f"sleep 300 & echo $! > {child}; exec sleep 300"], base_env()
    )
    assert servers.wait_until(lambda: child.is_file() and child.read_text().strip(), 30, 0.1)
    flow_run = psutil.Process(int(child.read_text()))
    assert service.process is not None
    service.process.kill()
    service.process.wait()
    services.restart(service, keep_group=True)
    assert flow_run.is_running() and flow_run.status() != psutil.STATUS_ZOMBIE
    assert service.process.poll() is None
    services.stop()
    gone, _ = psutil.wait_procs([flow_run], timeout=5)
    assert gone or flow_run.status() == psutil.STATUS_ZOMBIE
    assert service.process.poll() is not None


@pytest.mark.slow
def test_a_server_restart_is_waited_out(team: Team) -> None:
    """Issue 44, finding 6: a restart of the server machine ended `team join` 60 s later with
    a Ray traceback. Here the team server stops as a reboot stops it (SIGTERM) and starts again
    from the same folder (the same secrets, the same join file): the join waits, says so once,
    and its Ray node and Prefect worker are back once the servers answer. Before the last test:
    that one stops the server started here."""
    assert team.join is not None
    join_log, server_log = team.logs / "join.log", team.logs / "server.log"
    offset = join_log.stat().st_size
    t0 = time.monotonic()
    team.server.send_signal(signal.SIGTERM)
    assert team.server.wait(STOP_TIMEOUT_S) == 0, team.report()

    def waiting() -> bool:  # the servers are down: only the join has to be running
        if team.join is not None and team.join.poll() is not None:
            pytest.fail(f"team join exited ({team.join.returncode})\n{team.report()}")
        return "waiting: " in read_from(join_log, offset)

    # A Ray node gives up on a lost head after 60 s (Ray's gcs_rpc_server_reconnect_timeout_s).
    assert servers.wait_until(waiting, 180, **LONG_WAIT), team.report()
    noticed = time.monotonic() - t0
    server_offset = server_log.stat().st_size
    team.server = _start_server(team.network, team.server_dir, team.logs)
    ready = lambda: "ready;" in read_from(server_log, server_offset)  # noqa: E731
    team.wait("the team server to be ready again", ready, START_TIMEOUT_S)
    t1, since = time.monotonic(), datetime.now(UTC)
    _join_says(team, offset, "the servers answer again", 60)
    team.wait("the Ray node to rejoin the new head", lambda: _active_ray_nodes(team) == 2, 300)
    with team.prefect() as client:

        def worker_online() -> bool:  # a heartbeat since the restart, not the old record's
            workers = client.post("/work_pools/local/workers/filter", json={}).json()
            return any(
                w["status"] == "ONLINE" and w["name"].endswith(f"-{team.network.gpu_ip}")
                and w["last_heartbeat_time"]
                and datetime.fromisoformat(w["last_heartbeat_time"]) > since
                for w in workers
            )  # fmt: skip

        team.wait("the Prefect worker to be online again", worker_online, 120)
    said = read_from(join_log, offset)
    assert said.count("waiting: ") == 1 and "Traceback" not in said, said
    print(f"waiting after {noticed:.0f} s; back {time.monotonic() - t1:.0f} s after the restart")


# --- stopping -------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_everything(team: Team) -> None:
    assert team.join is not None
    started = [
        p for proc in (team.join, team.server)
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    ]  # fmt: skip
    assert len(started) > 10  # PostgreSQL, SeaweedFS, MLflow, Prefect, two Ray nodes, a worker
    t0 = time.monotonic()
    team.join.send_signal(signal.SIGINT)  # Ctrl-C
    assert team.join.wait(STOP_TIMEOUT_S) == 0, team.report()
    team.server.send_signal(signal.SIGTERM)
    assert team.server.wait(STOP_TIMEOUT_S) == 0, team.report()
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, [p.pid for p in alive]
    ip = team.network.server_ip
    for port in (4200, 5000, 8333, 5432, 6379):
        assert servers.port_free(ip, port), port

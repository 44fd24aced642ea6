"""Screenshots of the stack as a person sees it, taken by headless Chromium into ``docs/img/``.

What it does, end to end, in a fresh temporary project folder (or ``--project DIR``):

1. writes the digits sample (``imageops sample digits data/raw/digits``) and starts
   ``imageops serve`` (Prefect server with UI, MLflow server, promotion receiver, worker) on
   free ports;
2. starts one ``pipeline`` deployment run through the Prefect REST API with a small
   configuration (2 epochs, one training process) and waits until it is COMPLETED;
3. drives Chromium (Debian's ``chromium``, through Playwright) and saves:

   - ``prefect-train-run-form.png``: the train deployment's custom run form with its typed
     fields (Epochs, Batch size, Learning rate, ... with their descriptions);
   - ``prefect-pipeline-run.png``: the finished (Completed) pipeline run, its task graph and
     its Artifacts tab;
   - ``prefect-pipeline-run-artifact.png``: the finished pipeline run's ``pipeline-summary``
     artifact (metrics and links to the MLflow run and registered version);
   - ``mlflow-model-champion.png``: the MLflow registered model, its version with the
     ``champion`` and ``challenger`` aliases;

4. stops the stack (Ctrl-C, then a kill of what is left), whatever happened.

Every screenshot is checked for the text it must show, and written atomically. The Prefect
pages are those of the UI that ``/`` opens (V2 in Prefect 3.8).

Run it from the repository root, in the project's environment plus Playwright (no browser
download: it uses ``/usr/bin/chromium``)::

    pip install playwright
    python docs/screenshots.py                  # -> docs/img/*.png, 3 to 5 minutes on 2 cores
    python docs/screenshots.py --out /tmp/img --project /tmp/shots-project
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "imageops-classifier"
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking switches Chromium keeps dialling Google services, which a
# closed network refuses; none of it is needed to render two local web UIs.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1000}
FORM_VIEWPORT = {"width": 1400, "height": 1400}
# Small enough to finish in a minute or two on two CPU cores; the rest is the demo's defaults.
PIPELINE_CONFIG: dict[str, Any] = {
    "train": {"epochs": 2, "nproc_per_node": 1, "batch_size": 32, "learning_rate": 0.05},
}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

T = TypeVar("T")


class ScreenshotError(RuntimeError):
    """Something the screenshots need did not happen; the message says what and shows logs."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """A running ``imageops serve`` and where to reach it."""

    process: subprocess.Popen[bytes]
    log: Path
    project: Path
    prefect: str
    mlflow: str

    @property
    def api(self) -> str:
        return f"{self.prefect}/api"

    def report(self, chars: int = 3000) -> str:
        """The tail of the serve output and of every service log, for an error message."""
        logs = [self.log, *sorted((self.project / ".imageops" / "stack" / "logs").glob("*.log"))]
        return "\n".join(
            f"----- {path.name} -----\n{path.read_text(errors='replace')[-chars:]}"
            for path in logs
            if path.is_file()
        )

    def wait(self, what: str, ready: Callable[[], T | None], timeout_s: float) -> T:
        """Poll ``ready`` until it returns something truthy; fail if the stack dies or time out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ScreenshotError(f"imageops serve exited waiting for {what}\n{self.report()}")
            try:
                if result := ready():
                    return result
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ScreenshotError(
            f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.report()}"
        )

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        answer = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        if answer.is_error:
            raise ScreenshotError(f"POST {path}: {answer.status_code} {answer.text}")
        return answer

    def deployment_id(self, name: str) -> str:
        found = self.post("/deployments/filter", {"deployments": {"name": {"any_": [name]}}})
        matches = found.json()
        if len(matches) != 1:
            raise ScreenshotError(f"expected one deployment named {name!r}, found {len(matches)}")
        return matches[0]["id"]


def _write_sample(project: Path) -> None:
    """The digits demo data where the pipeline's default ``source`` looks (data/raw/digits)."""
    sample = project / "data" / "raw" / "digits"
    if sample.is_dir() and any(sample.iterdir()):
        return
    subprocess.run(
        [sys.executable, "-m", "app.cli", "sample", "digits", str(sample)],
        cwd=project,
        env=_environment(project),
        check=True,
    )


def _environment(project: Path, **extra: str) -> dict[str, str]:
    """This environment without settings that would point the stack elsewhere, plus its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "IMAGEOPS_"))
    }
    pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env | {
        "PYTHONPATH": pythonpath,
        "IMAGEOPS_PROJECT_ROOT": str(project),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        **extra,
    }


@contextmanager
def served(project: Path, timeout_s: float = 300.0) -> Iterator[Stack]:
    """``imageops serve`` with its UI on free ports until the block ends; always stopped."""
    ports = {"prefect": _free_port(), "mlflow": _free_port(), "receiver": _free_port()}
    prefect = f"http://127.0.0.1:{ports['prefect']}"
    log = project / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve",
             "--prefect-port", str(ports["prefect"]), "--mlflow-port", str(ports["mlflow"]),
             "--receiver-port", str(ports["receiver"])],
            cwd=project, env=_environment(project),
            stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    stack = Stack(
        process,
        log,
        project,
        prefect=prefect,
        mlflow=f"http://127.0.0.1:{ports['mlflow']}",
    )
    try:
        print(f"starting imageops serve in {project} (log: {log})", flush=True)
        stack.wait("`imageops serve` to say ready", lambda: "ready" in log.read_text(), timeout_s)
        print(f"stack ready: Prefect {stack.prefect}, MLflow {stack.mlflow}", flush=True)
        yield stack
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C (the stack stops its services in order); SIGTERM, then SIGKILL, if it lingers.

    The services run in sessions of their own, so whatever outlives ``imageops serve`` is
    found among the processes it started (listed before it is stopped) and killed by id.
    """
    import psutil

    try:
        started = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    # A shell that starts this script in the background ignores SIGINT for it and its
    # children; then `imageops serve` stops on SIGTERM, which it takes as Ctrl-C too.
    for stop in (signal.SIGINT, signal.SIGTERM):
        if process.poll() is None:
            process.send_signal(stop)
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its own session: only what it started
    process.wait()
    _, alive = psutil.wait_procs(started, timeout=5)
    for leftover in alive:
        with suppress(psutil.NoSuchProcess):
            leftover.kill()
    print("stack stopped", flush=True)


def run_pipeline(stack: Stack, timeout_s: float) -> str:
    """Start one pipeline run as the UI's Run button would; its id once COMPLETED."""
    deployment = stack.deployment_id("pipeline")
    created = stack.post(
        f"/deployments/{deployment}/create_flow_run", {"parameters": {"config": PIPELINE_CONFIG}}
    ).json()
    run_id: str = created["id"]
    print(f"pipeline run {created['name']} ({run_id}) started", flush=True)

    def finished() -> dict[str, Any] | None:
        run = httpx.get(f"{stack.api}/flow_runs/{run_id}", timeout=10).json()
        return run if run["state_type"] in TERMINAL else None

    run = stack.wait("the pipeline run to finish", finished, timeout_s)
    if run["state_type"] != "COMPLETED":
        raise ScreenshotError(
            f"pipeline run {run['name']} ended {run['state_type']}: "
            f"{run['state'].get('message')}\n{stack.report()}"
        )
    print(f"pipeline run {run['name']} COMPLETED", flush=True)
    return run_id


def _still(page: Any, timeout_s: float = 20.0, interval_s: float = 0.5) -> bytes:
    """A screenshot of ``page`` once three in a row (a second) are the same: animations done.

    The run graph, for one, is drawn on a canvas that pans and zooms into place after the page's
    text is there. A page that never stops changing is taken as it is after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last, same = page.screenshot(), 0
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        shot = page.screenshot()
        same = same + 1 if shot == last else 0
        if same == 2:
            return shot
        last = shot
    print(f"warning: {page.url} still changing after {timeout_s:.0f} s; taken as is", flush=True)
    return last


def _save(png: bytes, target: Path) -> None:
    """Write ``png`` to a temporary name next to ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.stem}.tmp{target.suffix}")
    try:
        temporary.write_bytes(png)
        temporary.replace(target)
    finally:
        temporary.unlink(missing_ok=True)
    print(f"saved {target} ({len(png) // 1024} KiB)", flush=True)


def _expect_text(page: Any, texts: list[str], where: str, timeout_ms: float = 60_000) -> None:
    """Wait until every one of ``texts`` is visible on ``page``; fail naming what is missing."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for text in texts:
        try:
            page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=timeout_ms)
        except PlaywrightTimeout as exc:
            raise ScreenshotError(
                f"{where}: {text!r} did not appear on {page.url} within {timeout_ms / 1000:.0f} s"
            ) from exc


def _prefect_ui(stack: Stack) -> str:
    """The base URL of the UI a person lands on (Prefect serves V1 and V2; ``/`` picks one)."""
    settings = httpx.get(f"{stack.prefect}/ui-settings", timeout=10).json()
    base = settings.get(f"{settings.get('default_ui', 'v1')}_base_url") or "/"
    return stack.prefect + base.rstrip("/")


def take_screenshots(stack: Stack, pipeline_run: str, out: Path) -> list[Path]:
    """The pages, each checked for what it must show; the files written."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    ui = _prefect_ui(stack)
    train = stack.deployment_id("train")
    artifacts = stack.post(
        "/artifacts/filter",
        {
            "artifacts": {"key": {"any_": ["pipeline-summary"]}},
            "flow_runs": {"id": {"any_": [pipeline_run]}},
        },
    ).json()
    if not artifacts:
        raise ScreenshotError(f"the pipeline run {pipeline_run} has no pipeline-summary artifact")
    written: list[Path] = []

    def save(page: Any, name: str) -> None:
        # The expected text is there; let late requests and fonts settle (MLflow polls, so the
        # network may never go idle: that wait is a courtesy, not a condition).
        with suppress(PlaywrightTimeout):
            page.wait_for_load_state("networkidle", timeout=5_000)
        page.evaluate("document.fonts.ready")
        _save(_still(page), out / name)
        written.append(out / name)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(viewport=VIEWPORT, color_scheme="light")
            # MLflow opens its assistant panel over half the page on a browser's first visit.
            context.add_init_script(
                "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
            )
            page = context.new_page()

            # The train deployment's custom run form: typed fields with their descriptions,
            # from the page header down past the training parameters (a taller window for it).
            page.set_viewport_size(FORM_VIEWPORT)
            page.goto(f"{ui}/deployments/deployment/{train}/run")
            _expect_text(page, ["Epochs", "Batch size", "Learning rate"], "train run form")
            rate = page.locator("label", has_text=re.compile(r"^Learning rate\b")).first
            try:
                expect(rate).to_be_in_viewport(timeout=10_000)
            except AssertionError as exc:
                raise ScreenshotError(
                    f"train run form: the Learning rate field is below the {FORM_VIEWPORT} window"
                ) from exc
            save(page, "prefect-train-run-form.png")
            page.set_viewport_size(VIEWPORT)

            # The finished pipeline run: Completed, its task graph and its artifacts.
            # Its graph is drawn from the graph endpoint's answer, after the page's text.
            with page.expect_response(re.compile(r"/api/flow_runs/[^/]+/graph"), timeout=60_000):
                page.goto(f"{ui}/runs/flow-run/{pipeline_run}?tab=Artifacts")
            _expect_text(page, ["Completed", "pipeline-summary"], "pipeline run")
            save(page, "prefect-pipeline-run.png")

            # Its pipeline-summary artifact: metrics and links to MLflow.
            page.goto(f"{ui}/artifacts/artifact/{artifacts[0]['id']}")
            _expect_text(
                page, ["@champion", "MLflow run", "accuracy", "f1_macro"], "pipeline artifact"
            )
            save(page, "prefect-pipeline-run-artifact.png")

            # The registered model in MLflow with its champion (and challenger) alias.
            page.goto(f"{stack.mlflow}/#/models/{MODEL}")
            _expect_text(page, ["Version 1", "@ champion", "@ challenger"], "MLflow model")
            save(page, "mlflow-model-champion.png")
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start the imageops stack, run the pipeline once and save screenshots of "
        "the Prefect and MLflow UIs, taken by headless Chromium.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "img",
        help="Folder the PNGs go to (default: docs/img of this repository).",
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=None,
        help="Project folder the stack runs in and keeps (default: a fresh temporary folder, "
        "removed afterwards). Reusing one adds another pipeline run and model version.",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="Seconds to wait for the pipeline run to finish (default: 900).",
    )
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).is_file():
        parser.error(f"{CHROMIUM} not found: install Debian's chromium package")

    started = time.monotonic()
    temporary = args.project is None
    project = Path(tempfile.mkdtemp(prefix="imageops-shots-")) if temporary else args.project
    project = project.resolve()
    project.mkdir(parents=True, exist_ok=True)
    try:
        _write_sample(project)
        with served(project) as stack:
            run = run_pipeline(stack, args.timeout)
            take_screenshots(stack, run, args.out.resolve())
    except (ScreenshotError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if temporary:
            shutil.rmtree(project, ignore_errors=True)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

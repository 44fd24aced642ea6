"""The MLflow server of ``imageops serve``: MLflow's own app, its UI opening in the model view.

MLflow 3's UI shows its GenAI view (traces, judges, an assistant panel) unless the page's
address asks for the other one (``?workflowType=machine_learning``: imageops's own links carry it,
tasks.shared.tracking.ui_url) or the browser remembers a choice. MLflow's links drop the
address's part, and the browser remembers nothing until a person flips the switch, so a person
who opened a run or the registry from an imageops link landed in the GenAI view. This app is
MLflow's, with one change to the page it serves: where the browser remembers no choice, the
model view is remembered (and the assistant panel is not opened by itself). A person's own
switch to GenAI is remembered by MLflow and wins.

``mlflow server --app-name imageops`` runs it (the ``mlflow.app`` entry point in pyproject.toml);
``app`` is built when the server asks for it, so the stack imports this module cheaply. The team
server's MLflow (``imageops-team``, :func:`team_app`) is MLflow's basic-auth app with the same
change.
"""

from __future__ import annotations

import sys
from typing import Any

# What the page remembers where the browser remembers nothing yet, in MLflow's own key and value
# format (its useLocalStorage hook: key + "_v" + version, the value as JSON): the model view, and
# the assistant panel not opened by itself on a first visit (it squeezed the runs table).
REMEMBERED = {
    "mlflow.workflowType_v1": '"machine_learning"',
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
}
_SETS = "".join(
    f"localStorage.getItem('{key}')===null&&localStorage.setItem('{key}','{value}');"
    for key, value in REMEMBERED.items()
)
REMEMBER_MODEL_VIEW = f"<script>try{{{_SETS}}}catch(e){{}}</script>".encode()


def server_args(logins: bool = False) -> list[str]:
    """``mlflow server``'s ``--app-name imageops`` (``imageops-team`` with ``logins``: MLflow's
    basic-auth) where this environment's install registered it; MLflow's own app otherwise,
    said once (an install made before the entry point existed)."""
    from importlib.metadata import entry_points

    name = "imageops-team" if logins else "imageops"
    if any(e.name == name for e in entry_points(group="mlflow.app")):
        return ["--app-name", name]
    print(
        "note: MLflow's UI may open in its GenAI view: this environment's imageops install "
        "predates app/mlflow_ui.py; `pip install -e .` registers it.",
        file=sys.stderr,
    )
    return ["--app-name", "basic-auth"] if logins else []


def _model_view_by_default(response: Any) -> Any:
    """The UI's page (index.html, served for every UI route) with the remembered choice set
    before MLflow's scripts read it; every other response as it was."""
    from flask import request

    if request.method != "GET" or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # a file response: read it to change it
    page = response.get_data()
    if b"<head>" in page and REMEMBER_MODEL_VIEW not in page:
        response.set_data(page.replace(b"<head>", b"<head>" + REMEMBER_MODEL_VIEW, 1))
        response.headers.pop("ETag", None)  # a cached copy of the unchanged page is not this
    return response


def team_app() -> Any:
    """``mlflow server --app-name imageops-team``: MLflow's basic-auth app (the team's logins,
    its factory as ``--app-name basic-auth`` runs it) with the page's change hooked in first."""
    from mlflow.server import app as flask_app
    from mlflow.server.auth import create_app

    flask_app.after_request(_model_view_by_default)
    return create_app(flask_app)


def __getattr__(name: str) -> Any:
    """``app``: MLflow's ASGI app over its Flask app, the page's change hooked in first."""
    if name != "app":
        raise AttributeError(name)
    from mlflow.server import app as flask_app

    flask_app.after_request(_model_view_by_default)
    from mlflow.server.fastapi_app import app

    globals()["app"] = app
    return app

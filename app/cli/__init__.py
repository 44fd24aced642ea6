"""The ``imageops`` command line: one subcommand per pipeline step, and ``run`` for the whole flow.

Step subcommands call the plain step functions (no Prefect API needed); ``run`` runs the Prefect
flow. Heavy libraries are imported inside each command, after the settings have been exported to
the environment, so ``--help`` is quick and Prefect and MLflow see our locations. A module per
stage registers its commands on :data:`app` when imported here.
"""

# The import order is the order of the commands in --help: the pipeline's order.
# isort: off
from app.cli import data, training, inference, registry, pipeline, cluster, team, housekeeping  # noqa: F401

# isort: on
from app.cli.root import app, main

__all__ = ["app", "main"]

"""The application: what a person starts, on top of the flows.

- ``cli``: the ``imageops`` command line, one subcommand per step and ``run`` for the whole flow.
- ``stack`` and ``temporary_api``: ``imageops serve`` (Prefect server and worker, MLflow, the
  webhook receiver, every deployment) and the Prefect API a lone command starts for itself.
- ``webhook``: MLflow's registry webhook, verified, becomes the Prefect promotion event.
- ``deployments`` and ``work_pools``: register ``deployments/prefect.yaml`` and the work pools.
"""

"""Tune Model Hyperparameters (the Vertex AI way) on Optuna; each trial a real training run.

- ``spec``: :class:`~tasks.tune.spec.TuningSpec`, the study a person asks for (tuning.yaml, the
  tune flow's form); ``spec_checks``: what cannot make a study, refused before any trial.
- ``parameters``: one tuned parameter by type (double, integer, categorical, discrete).
- ``tunable``: what may be tuned, each parameter against the training field it sets.
- ``storage``: where studies live (a journal file per study, or a database) and their folders.
- ``search``: the spec in Optuna's terms: samplers, the pruner, one trial's parameters.
- ``study``: open or continue a study, ask and count; ``resume``: continue one (same setup,
  one flow at a time, interrupted trials again); ``records``: what a study records and hands a
  trial; ``parent_run``: the study's MLflow run.
- ``trial``: one trial: train with its parameters (tasks.train), report, tell the study.
- ``gpus``: this machine's GPUs, lent to the trials running on it, each to one at a time.
- ``pruning``: what a training worker uses to report each epoch and hear whether to stop.
- ``report``: the trials table and plot, to Prefect and MLflow.

Nothing is imported here: a training worker imports ``pruning`` alone. Running trials in
parallel (Prefect tasks, deployments) is the tune flow's wiring (flows.tune).
"""

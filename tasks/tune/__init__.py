"""Tune Model Hyperparameters (the Vertex AI way) on Optuna; each trial a real training run.

One job per module: ``spec`` and ``spec_checks`` (the study asked for, refused before any trial),
``parameters``, ``tunable``, ``storage``, ``search``, ``study``, ``resume``, ``records``,
``parent_run``, ``trial``, ``gpus``, ``pruning``, ``report``. Nothing is imported here: a training
worker imports ``pruning`` alone. Details: docs/tuning.md#the-package.
"""

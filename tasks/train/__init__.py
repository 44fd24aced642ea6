"""Train PyTorch Model: DDP training launched through torchrun, tracked in MLflow.

``launch`` (the step: one TrainRequest in, a TrainResult out) puts in order ``request``,
``mlflow_run``, ``run_lock``, ``rendezvous`` and ``torchrun``; ``worker`` (the torchrun entry) runs
the epochs over ``build``, ``progress``, ``finish``, ``loop`` and the pieces they share. Nothing is
imported here, so a worker loads torch and its own modules only, never Prefect or MLflow.
Details: docs/training.md#the-package.
"""

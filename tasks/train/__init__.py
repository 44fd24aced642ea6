"""Train PyTorch Model: DDP training launched through torchrun, tracked in MLflow.

- ``params``: Azure's parameters (:class:`~tasks.train.params.TrainParams`) and the resolved
  run configuration the workers read.
- ``launch``: :func:`~tasks.train.launch.train` and ``train_task``, the step flows call: takes one
  :class:`~tasks.train.request.TrainRequest`, checks the inputs, opens the MLflow run (or
  continues the unfinished one of the same request), runs torchrun for one node, returns a
  ``TrainResult``; ``open_run`` opens a multi-node job's run. It puts in order the jobs of
  ``request`` (the request model; every input checked, the run configuration resolved),
  ``mlflow_run`` (which run to train in; its last records and status, outlasting an MLflow
  outage), ``run_lock`` (the run's lock while a launcher trains it), ``rendezvous`` (where a
  multi-node job's agents meet, which came) and ``torchrun`` (the process tree, its log, its
  error).
- ``worker``: the torchrun entry (``python -m tasks.train.worker``) and its epoch loop, over
  ``build`` (datasets, loaders, model, optimizer), ``progress`` (best epoch, early stop, pruning,
  checkpoint state, resume) and ``finish`` (rank 0 writes the ModelDirectory and the summary);
  ``loop``: one epoch and one evaluation; ``schedule``: warm-up then polynomial decay;
  ``distributed``: ranks, process group, reductions; ``data``, ``checkpoint``, ``curves``,
  ``failure``: the pieces they share.

Nothing is imported here, so a worker loads torch and its own modules only, never Prefect or
MLflow (rank 0 imports MLflow when it needs it).
"""

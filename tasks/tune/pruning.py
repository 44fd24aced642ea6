"""The training side of a tuning trial: report each epoch's metric, hear whether to stop.

Imported by rank 0 of a training worker whose run is a trial (``RunConfig.tuning``). It opens
the study where the flow left it (a journal file, or the database of the settings), reports the
epoch's metric as the trial's intermediate value and asks the study's pruner. The worker shares
the answer with every rank (tasks.train.worker).
"""

from __future__ import annotations

import optuna

from tasks.train.params import TrialHook
from tasks.tune.search import make_pruner
from tasks.tune.storage import open_storage, quiet_optuna


class TrialReporter:
    """Rank 0's link to its trial: :meth:`report` after every epoch."""

    def __init__(self, hook: TrialHook) -> None:
        quiet_optuna()
        self.hook = hook
        storage = open_storage(hook.storage)
        study = optuna.load_study(
            study_name=hook.study_name,
            storage=storage,
            # Never samples here; the pruner must be the flow's, to judge alike.
            sampler=optuna.samplers.RandomSampler(),
            pruner=make_pruner(hook.early_stopping, hook.min_trials, hook.min_epochs),
        )
        study_id = storage.get_study_id_from_name(hook.study_name)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, hook.trial_number)
        self.trial = optuna.trial.Trial(study, trial_id)

    def report(self, metrics: dict[str, float], epoch: int) -> bool:
        """Report ``metrics[hook.metric]`` for ``epoch``; True when the trial should stop.

        A resumed run reports its epochs again; Optuna keeps the first value of a step.
        """
        self.trial.report(float(metrics[self.hook.metric]), epoch)
        return self.hook.early_stopping and bool(self.trial.should_prune())

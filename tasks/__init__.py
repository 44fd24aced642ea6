"""Pipeline steps grouped by stage: plain functions that do the work, each also a Prefect task.

``data`` (convert, split, transform, versioning), ``train`` (build the model, DDP training),
``registry`` (register, promote, model URIs), ``inference`` (export, quantize, score, evaluate),
``tune`` (hyperparameter tuning) and ``shared`` (errors, settings, MLflow wiring, locks, the step
wrapper). The plain function is what tests, DVC stages and torchrun workers call; the ``*_task``
beside it (a retryable Prefect task) is what flows call. Submitting them is the flows' job.
"""

# models' import sets up torchvision's import without TorchDynamo (models.torchvision_import):
# some steps import torchvision before anything of models.
import models  # noqa: F401

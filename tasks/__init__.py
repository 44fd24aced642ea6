"""Pipeline steps: plain functions that do the work, each wrapped by a retryable Prefect task.

A module per step (convert, split, versioning, train, export, registry, score, evaluate). The plain
function is what tests, DVC stages and torchrun workers call; the ``*_task`` beside it is what
flows call.
"""

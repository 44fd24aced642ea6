"""What every stage uses: errors, settings, MLflow wiring, project locks, the Prefect step wrapper,
server processes, parent death and the fault-injection points."""

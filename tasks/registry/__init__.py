"""The MLflow model registry: register a version, promote it by alias, resolve ``models:/`` URIs,
and the Prefect event a promotion emits."""

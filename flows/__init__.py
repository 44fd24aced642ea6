"""Prefect flows (composition only) and the ``imageops`` command line."""

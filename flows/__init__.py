"""Prefect flows only: they wire the steps of ``tasks`` and submit them; ``config`` is their form.

The command line, the local stack and the webhook receiver that start these flows are in ``app``.
"""

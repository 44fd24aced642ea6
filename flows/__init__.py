"""Prefect flows only: they wire the steps of ``tasks`` and submit them; ``config`` is their form.

The command line, the local stack and the webhook receiver that start these flows are in ``app``.
A flow run outlives the worker that started it: its console may go, its work goes on.
"""

from tasks.shared.console import survive_lost_console

survive_lost_console()

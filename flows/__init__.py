"""Prefect flows only: they wire the steps of ``tasks`` and submit them; ``config`` is their form.

The command line, the local stack and the webhook receiver that start these flows are in ``app``.
A flow run outlives the worker that started it: its console may go, its work goes on.
"""

from tasks.shared.console import survive_lost_console

survive_lost_console()

# The saved settings a run form picks (Prefect blocks): a worker must know their types before a
# flow run's parameters are loaded, whichever flow it runs.
import flows.saved_settings  # noqa: E402, F401

"""How a plain step function becomes a Prefect task: retries with back-off, no pickled results.

Transient failures (a locked database, a worker killed mid-epoch) are retried with exponential
back-off. An :class:`~models.errors.ImageOpsError` means the input is wrong, and retrying cannot
fix it, so it fails the task at once with its message, unless the error says it is ``retryable``
(a crashed training worker); a full disk is not retried either (it is still full seconds later).

Prefect is imported only when a task is made or a run is asked about: importing it costs about a
second, and the command line, DVC stages and training workers call the steps as plain functions.
A module makes its tasks on first use with :func:`tasks_on_first_use`.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from models.errors import ImageOpsError, disk_full

if TYPE_CHECKING:
    from prefect import Task

RETRIES = 2
BACKOFF_SECONDS = 2.0


def _retry_unless_user_error(task: Task, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except ImageOpsError as exc:
        return exc.retryable
    except Exception as exc:
        return disk_full(exc) is None  # a full disk is still full seconds later
    return True


def step(fn: Callable[..., Any], *, name: str, retries: int = RETRIES, **options: Any) -> Task:
    """Wrap ``fn`` as a Prefect task named ``name`` with the project's retry policy.

    Results stay in memory (``persist_result=False``): Prefect would otherwise pickle them, and the
    steps pass only paths and small JSON-able values anyway; each step keeps its own outputs on
    disk, written atomically.
    """
    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.tasks import exponential_backoff

    settings: dict[str, Any] = {
        "retry_delay_seconds": exponential_backoff(backoff_factor=BACKOFF_SECONDS),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": _retry_unless_user_error,
        "cache_policy": NO_CACHE,
        "persist_result": False,
    }
    return task(fn, name=name, retries=retries, **{**settings, **options})


_MAKING = threading.Lock()


def tasks_on_first_use(
    namespace: dict[str, Any], **makers: Callable[[], Task]
) -> Callable[[str], Task]:
    """A module ``__getattr__`` that makes the module's Prefect tasks when first asked for.

    ``__getattr__ = tasks_on_first_use(globals(), score_task=lambda: step(score, name="score"))``:
    ``from module import score_task`` (a flow) imports Prefect and makes the task once; importing
    the module for its plain functions does neither.
    """
    module = namespace["__name__"]

    def __getattr__(name: str) -> Task:
        if name not in makers:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        with _MAKING:  # two threads asking at once get the same task
            if name not in namespace:
                namespace[name] = makers[name]()
        return namespace[name]

    return __getattr__


def in_prefect_run() -> bool:
    """True inside a Prefect flow or task run.

    Steps are plain functions first: they publish Prefect artifacts and use the run logger only
    when a run is there to receive them, and work unchanged from tests, DVC stages and workers.
    """
    if "prefect.context" not in sys.modules:
        return False  # no run without Prefect loaded; importing it to ask would cost a second
    from prefect.context import get_run_context
    from prefect.exceptions import MissingContextError

    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


def step_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run (messages reach the UI), else the module's own logger."""
    if not in_prefect_run():
        return logging.getLogger(name)
    from prefect.logging import get_run_logger

    return get_run_logger()


def name_flow_run(name: str) -> None:
    """Give the flow run we are in a name a person can find it by (model, data version, trial).

    Prefect names a run at random (two words, e.g. ``crimson-lemur``) before its parameters are
    validated; the flow renames it once it knows what it runs on. A name a person typed (in the
    UI's custom run form, ``prefect deployment run --flow-run-name``) is theirs: it is kept, and
    the name we would have given is logged. Outside a flow run this does nothing.
    """
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    run_id = context.flow_run.id
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(run_id).name
        if not _random_name(current) and _NAMED.get(run_id) != current:
            step_logger(__name__).info("Keeping the run name %r (it would be %r)", current, name)
            return
        client.update_flow_run(run_id, name=name)
    _NAMED[run_id] = name


# The names this process gave its flow runs: a later, more precise name may replace them.
_NAMED: dict[object, str] = {}


def named_from_parameters(name: Callable[[dict[str, Any]], str]) -> Callable[[], str]:
    """A flow's ``flow_run_name``: ``name(parameters)``, given before the run's first log line
    (Prefect's "Beginning flow run ..."), which otherwise carried the random name; the flow may
    make it more precise (:func:`name_flow_run`). A name a person typed is kept, and so is the
    random one when the parameters cannot make a name (the flow then says what is wrong)."""

    def flow_run_name() -> str:
        from prefect.context import FlowRunContext
        from prefect.utilities.callables import get_parameter_defaults

        context = FlowRunContext.get()
        run, flow = context.flow_run, context.flow  # type: ignore[union-attr]
        if not _random_name(run.name):
            return run.name
        # The flow's defaults under what the run was given: a deployment run's parameters may
        # leave them out, and ``name`` need not know them.
        parameters = get_parameter_defaults(flow.fn) | dict(context.parameters)  # type: ignore[union-attr]
        try:
            given = name(parameters)
        except Exception:  # a name is never worth failing a run: the flow says what is wrong
            return run.name
        _NAMED[run.id] = given
        return given

    return flow_run_name


def _random_name(name: str) -> bool:
    """Whether ``name`` is one Prefect made up: two words of coolname's, Prefect's name maker."""
    words = name.split("-")
    return len(words) == 2 and all(word in _coolname_words() for word in words)


@functools.cache
def _coolname_words() -> frozenset[str]:
    import coolname.data  # Prefect's own dependency, the source of its run names

    return frozenset(
        word
        for words in coolname.data.config.values()
        if words.get("type") == "words"
        for word in words["words"]
    )

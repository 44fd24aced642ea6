"""Scorings caught in the middle, for the tests of what happens beside them.

:class:`FirstShardThenWait` is a shard runner (``score_sharded(scoring, runner)``) that scores the
first shard, says so, and scores the rest only when let go: a scoring that holds its table while
the test does something else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from tasks.inference.score import ShardJob, run_in_turn

WAIT_S = 300  # how long either side waits for the other before the test fails


class FirstShardThenWait:
    """Score the first shard, set ``holding``, wait for ``go_on``, score the rest."""

    def __init__(self) -> None:
        self.holding, self.go_on = threading.Event(), threading.Event()

    def __call__(self, jobs: Sequence[ShardJob]) -> None:
        run_in_turn(jobs[:1])
        self.holding.set()
        assert self.go_on.wait(WAIT_S), "the test never let the scoring go on"
        run_in_turn(jobs[1:])

    def wait_holding(self, scoring: Future) -> None:
        """Return once the first shard is in; the scoring's error if it ends before that."""
        deadline = time.monotonic() + WAIT_S
        while not self.holding.wait(0.2):
            if scoring.done():
                scoring.result()
                raise AssertionError("the scoring ended without waiting")
            assert time.monotonic() < deadline, "the first shard took too long"

"""``--manual-gc``: Python's garbage collector run at chosen points, the same on every rank.

Python's cyclic collector runs whenever allocations pass a threshold, so each rank pauses at its
own moment of the step, and in a pipeline or a collective one rank's pause is every rank's wait.
With ``--manual-gc`` (Megatron's flag and meaning) the automatic collector is off for the run:
one full collection when the run starts, one after every ``--manual-gc-interval``-th iteration
(after its evaluation and save, where every rank is at the same point), and, unless
``--no-manual-gc-eval``, a full collection before each evaluation and one of the youngest
generation after it. megapipe's steps leave no reference cycle (``tests/pipeline/
test_reference_cycles.py``), so the collections only free what other code leaves.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

from megapipe.train.config.job_config import CollectorConfig


class ManualCollector:
    """The collector's schedule for one run; a context manager around the run's iterations that
    turns automatic collection off (when manual) and restores it at the end."""

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.collections = 0  # how many collections this object ran (tests, logs)
        self._was_enabled = False

    def __enter__(self) -> "ManualCollector":
        if self.config.manual:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.config.manual and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        """At the end of iteration ``iteration`` (1-based): collect every ``interval``-th."""
        interval = self.config.interval
        if self.config.manual and interval and iteration % interval == 0:
            self._collect()

    @contextmanager
    def around_evaluation(self) -> Iterator[None]:
        """Before an evaluation everything; after it, what it made (the youngest generation)."""
        at_eval = self.config.manual and self.config.at_eval
        if at_eval:
            self._collect()
        yield
        if at_eval:
            self._collect(generation=0)

    def _collect(self, generation: int = 2) -> None:
        gc.collect(generation)
        self.collections += 1

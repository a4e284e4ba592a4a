"""``--manual-gc``, ``--heap-trim-interval``: Python's garbage collector run at chosen points,
and the C heap's free pages handed back, the same on every rank.

Python's cyclic collector runs whenever allocations pass a threshold, so each rank pauses at its
own moment of the step, and in a pipeline or a collective one rank's pause is every rank's wait.
With ``--manual-gc`` (Megatron's flag and meaning) the automatic collector is off for the run:
one full collection when the run starts, one after every ``--manual-gc-interval``-th iteration
(after its evaluation and save, where every rank is at the same point), and, unless
``--no-manual-gc-eval``, a full collection before each evaluation and one of the youngest
generation after it. megapipe's steps leave no reference cycle (``tests/pipeline/
test_reference_cycles.py``), so the collections only free what other code leaves.

megapipe adds ``--heap-trim-interval N`` (default 100, 0: off), with or without ``--manual-gc``:
after every N-th iteration, after that iteration's collection if any, glibc's ``malloc_trim(0)``
(where the C library has it; elsewhere nothing) hands the free pages the C heap keeps back to the
system. Without it the resident memory of each rank kept growing by kilobytes per iteration while
the heap's bytes in use stayed flat (docs/memory.md, Long runs). With it, when the run starts,
glibc's mmap threshold is also pinned at its initial 128 KiB (``mallopt``): glibc raises the
threshold to the size of each mapped block freed, after which the host tensors of that size (a
CPU run's activations) come from the heap instead and fragment it, their sizes varying with the
tokens routed to each expert. ``--heap-trim-interval 0`` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megapipe.train.config.job_config import CollectorConfig

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value, kept from the run's start


class ManualCollector:
    """The collector's and the heap trim's schedule for one run; a context manager around the
    run's iterations that turns automatic collection off (when manual) and restores it after."""

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.collections = 0  # how many collections this object ran (tests, logs)
        self.trims = 0  # how many times the C heap's free pages were handed back
        self._was_enabled = False
        self._libc = _glibc() if config.trim_interval else None

    def __enter__(self) -> ManualCollector:
        if self._libc is not None:
            self._libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        if self.config.manual:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.config.manual and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        """At the end of iteration ``iteration`` (1-based): collect every ``interval``-th, then
        hand the heap's free pages back every ``trim_interval``-th."""
        interval, trim_interval = self.config.interval, self.config.trim_interval
        if self.config.manual and interval and iteration % interval == 0:
            self._collect()
        if self._libc is not None and iteration % trim_interval == 0:
            self._libc.malloc_trim(0)
            self.trims += 1

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


def _glibc() -> Any:
    """The C library when it has glibc's ``malloc_trim`` and ``mallopt``, else None (macOS,
    musl)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and libc.malloc_trim and libc.mallopt else None
    except (OSError, AttributeError):
        return None

"""Timing a schedule's actions again, with other durations, in the sequence an earlier timing took.

The engine's round robin (``engine``) decides which action runs next by what has been made, never
by when: timings of the same actions under other durations (or another p2p latency) take the
actions in the same sequence, sweep by sweep. Where every product has one maker and the first
timing finished, that sequence is a topological sort of the waits, so a later timing only has to
take, action by action in that sequence, the latest of its rank's previous end and its needs'
arrivals, and add the action's duration: the engine's own float operations, without its
round-robin bookkeeping (about a third of its cost). ``time_actions`` keeps a finished timing's
sequence with the schedule (``SWEEP_SEQUENCE``) and retimes in it whenever it can (the lowering's
timeline, then ``simulate``, time one schedule twice); actions timed by a function
(``ActionInputs.end_of``, ``made_at``) or products made twice always go to the engine.
``retime`` also takes a guessed sequence (the overlap pass times the original schedule in the
sequence its first candidate took): it checks the sequence as it goes (every action once, each
rank's in list order, nothing read before it is made) and gives up, for the engine to time, where
it does not hold; where it holds, the times are the engine's, since with one maker per product
they do not depend on the sequence actions are taken in. The loop itself is
``loops.in_sequence`` (Python, or compiled for large schedules where numba is installed).
"""

from __future__ import annotations

import functools

import numpy as np

from ..ir import Derived, Schedule
from . import loops
from .engine import ActionTimes, LoopColumns, time_in_order


class SweepSequence:
    """The sequence a finished timing took its actions in, from the sweep of each action (the same
    for any durations); worked out only when a retiming asks for it (the executor lowers and
    validates, and never retimes)."""

    def __init__(self, sweep: list[int] | np.ndarray) -> None:
        self.sweep = sweep

    @classmethod
    def of(cls, times: ActionTimes) -> SweepSequence:
        assert times.sweep is not None  # the engine's timing records each action's sweep
        return cls(times.sweep)

    @functools.cached_property
    def sequence(self) -> np.ndarray:
        """Actions by (sweep, row): rows go rank by rank, so that is (sweep, rank, list order),
        the sequence the round robin took them in."""
        sweep = np.asarray(self.sweep, dtype=np.int64)
        return np.argsort(sweep, kind="stable")


# of a finished timing (time_actions)
SWEEP_SEQUENCE: Derived[SweepSequence | None] = Derived(lambda: None)


def _retimable(graph) -> bool:
    """One maker per product, durations that do not depend on the start, and one latency for
    every need (with a latency, each need the actions wait for comes from another rank)."""
    actions = graph.inputs
    if not graph.unique or actions.end_of is not None or actions.made_at is not None:
        return False
    return not actions.delay or not ((graph.need >= 0) & (graph.need < graph.space.size)).any()


def time_actions(schedule: Schedule, graph, watch: frozenset = frozenset()) -> ActionTimes:
    """The times of ``graph``'s actions (a ``timeline.ActionGraph`` of ``schedule``): retimed in the
    sequence of an earlier finished timing of the schedule's actions where it can be (module
    docstring), else timed by the engine, keeping a finished timing's sequence for next time."""
    found = SWEEP_SEQUENCE.of(schedule)
    if found is not None and _retimable(graph):
        retimed = retime(graph, found.sequence, found.sweep)
        # a finished timing's sequence is one the same actions can run in, whatever the durations
        assert retimed is not None
        return retimed
    times = time_in_order(graph.inputs, watch=watch)
    if _retimable(graph) and not times.stuck and times.remade is None:
        SWEEP_SEQUENCE.keep(schedule, SweepSequence.of(times))
    return times


def retime(graph, sequence: np.ndarray, sweep: list[int] | np.ndarray | None) -> ActionTimes | None:
    """The engine's times of ``graph``'s actions, computed in ``sequence`` (module docstring);
    None if the actions cannot run in ``sequence`` (a rank's actions out of list order, or an
    action before a product it needs), so that a guessed sequence can be tried. ``sweep`` is given
    back as the times' sweep (None: unknown)."""
    table, actions = graph.table, graph.inputs
    if len(sequence) != len(table) or not _in_list_order(table, sequence):
        return None
    n, space = len(table), actions.space
    compiled = loops.compiled_loops(n)
    new = LoopColumns(compiled is not None)
    start, end = new.fill(n, 0.0, np.float64), new.fill(n, 0.0, np.float64)
    free, arrive = new.fill(table.pp, 0.0, np.float64), new.fill(2 * space + 1, -1.0, np.float64)
    _, need0, need1, need2, make0, make1, duration = new.of_actions(actions)
    ok = (compiled[1] if compiled else loops.in_sequence)(
        new.copy(sequence, np.int64),
        new.copy(table.rank, np.int64),
        need0,
        need1,
        need2,
        make0,
        make1,
        duration,
        float(actions.delay),
        space,
        start,
        end,
        free,
        arrive,
    )
    return ActionTimes(start, end, sweep, arrive, {}) if ok else None


def _in_list_order(table, sequence: np.ndarray) -> bool:
    """Whether ``sequence`` takes every action once, each rank's in list order."""
    position = np.full(len(table), -1, dtype=np.int64)
    position[sequence] = np.arange(len(sequence))
    same_rank = table.rank[1:] == table.rank[:-1]
    ordered = (position[1:][same_rank] > position[:-1][same_rank]).all()
    return bool(ordered and (position >= 0).all())

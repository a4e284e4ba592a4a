"""Running a schedule's actions again, with other durations, in the order an earlier run took.

The engine's round robin (``engine``) decides which action runs next by what has been made, never
by when: runs of the same actions under other durations (or another p2p latency) take the actions in
the same order, sweep by sweep. Where every product has one maker and the first run finished,
that order is a topological order of the waits, so a later run only has to take, action by action
in that order, the latest of its rank's previous end and its needs' arrivals, and add the
action's duration: the engine's own float operations, without its round-robin bookkeeping (about
a third of its cost). ``run_actions`` keeps a finished run's order with the schedule
(``RUN_ORDER``) and
reruns it in that order whenever it can (the lowering's timeline, then ``simulate``, need two
runs of one schedule); actions timed by a function (``ActionInputs.end_of``, ``made_at``) or products
made twice always go to the engine. ``rerun`` also takes a guessed order (the overlap pass times the
original schedule in the order its first candidate ran): it checks the order as it goes (every
action once, each rank's in list order, nothing read before it is made) and gives up, for the
engine to run, where it does not hold; where it holds, the times are the engine's, since with
one maker per product they do not depend on the order actions run in. The loop itself is
``loops.in_order`` (Python, or compiled for large runs where numba is installed).
"""

from __future__ import annotations

import functools

import numpy as np

from . import loops
from ..ir import Derived, Schedule
from .engine import LoopColumns, Run, run_in_order


class RunOrder:
    """The order a finished run took its actions in, from the run's sweep of each action (the same
    for any durations); worked out only when a rerun asks for it (the executor lowers and
    validates, and never reruns)."""

    def __init__(self, sweep: list[int]) -> None:
        self.sweep = sweep

    @classmethod
    def of(cls, run: Run) -> "RunOrder":
        return cls(run.sweep)

    @functools.cached_property
    def order(self) -> np.ndarray:
        """ActionInputs by (sweep, row): rows go rank by rank, so that is (sweep, rank, list order),
        the order the round robin took them."""
        sweep = np.asarray(self.sweep, dtype=np.int64)
        return np.argsort(sweep, kind="stable")


RUN_ORDER: Derived[RunOrder | None] = Derived(lambda: None)  # of a finished run (run_actions)

def _rerunnable(plan) -> bool:
    """One maker per product, durations that do not depend on the start, and one latency for
    every need (with a latency, each need the actions wait for comes from another rank)."""
    actions = plan.inputs
    if not plan.unique or actions.end_of is not None or actions.made_at is not None:
        return False
    return not actions.delay or not ((plan.need >= 0) & (plan.need < plan.space.size)).any()


def run_actions(schedule: Schedule, plan, watch: frozenset = frozenset()) -> Run:
    """The run of ``plan`` (a ``timeline.ActionGraph`` of ``schedule``): rerun in the order of an
    earlier finished run of the schedule's actions where it can be (module docstring), else run
    by the engine, keeping the order of a finished run for the next time."""
    found = RUN_ORDER.of(schedule)
    if found is not None and _rerunnable(plan):
        return rerun(plan, found.order, found.sweep)
    run = run_in_order(plan.inputs, watch=watch)
    if _rerunnable(plan) and not run.stuck and run.remade is None:
        RUN_ORDER.keep(schedule, RunOrder.of(run))
    return run


def rerun(plan, order: np.ndarray, sweep: list[int] | None) -> Run | None:
    """The engine's run of ``plan``'s actions, computed in ``order`` (module docstring); None if
    ``order`` is not an order the actions can run in (a rank's actions out of list order, or an action
    before a product it needs), so that a guessed order can be tried. ``sweep`` is given back
    as the run's sweep (None: unknown)."""
    table, actions = plan.table, plan.inputs
    if len(order) != len(table) or not _in_list_order(table, order):
        return None
    n, space = len(table), actions.space
    compiled = loops.compiled_loops(n)
    new = LoopColumns(compiled is not None)
    start, end = new.fill(n, 0.0, np.float64), new.fill(n, 0.0, np.float64)
    free, arrive = new.fill(table.pp, 0.0, np.float64), new.fill(2 * space + 1, -1.0, np.float64)
    ok = (compiled[1] if compiled else loops.in_order)(
        new.copy(order, np.int64), new.copy(table.rank, np.int64), *new.of_actions(actions)[1:],
        float(actions.delay), space, start, end, free, arrive)
    return Run(start, end, sweep, arrive, {}) if ok else None


def _in_list_order(table, order: np.ndarray) -> bool:
    """Whether ``order`` takes every action once, each rank's in list order."""
    position = np.full(len(table), -1, dtype=np.int64)
    position[order] = np.arange(len(order))
    same_rank = table.rank[1:] == table.rank[:-1]
    in_order = (position[1:][same_rank] > position[:-1][same_rank]).all()
    return bool(in_order and (position >= 0).all())

"""The overlap pass within a memory budget: at most K more microbatch-stages in flight per rank.

Pairing a schedule costs activation memory: rank r runs ``e_r`` extra warmup forwards and so
holds up to ``e_r`` more microbatch-stage activations than the plain schedule (``apply``).
Unbounded, the pass may take the *chain* (``e_r = pp - r``), which doubles plain 1F1B's peak on
rank 0. ``apply_overlap_within(schedule, K)`` caps that price: its candidates are the pairings
whose extra forwards are at most K on every rank,

- *uniform*: ``e_r = min(1, K)`` on every rank (with K = 0 each backward pairs with the
  forward that ran just before it, so nothing more is held than in the plain order),
- *cross-stage*: the same, only pairs of two stages (V placement; see ``overlap``),
- *capped chains*: ``e_r = min(pp - r, c)`` for each cap ``c`` from 2 to K (a smaller cap can
  run faster than a larger one, whose top ranks then take turns; trying each keeps the result
  no slower as K grows),

each settled as the unbounded pass settles its own (stuck pairs split; a late one refined
until it ends one pair after the original, where it can). Of those that run and stay within
the budget, measured with ``peak_in_flight`` against the plain rows, the fastest on the
dependency timeline wins (free communication, ``timeline``); on a tie the one with more pairs
(each pair hides an all-to-all that the free timeline does not see), then the one holding less.
If none is left, the plain order comes back (no pair, nothing more held).

Schedules that pair natively (DualPipe, DualPipeV) hold no more than their plain twins; the
check still runs and a budget they break is an error naming the rank.
"""

from __future__ import annotations

import math

from ..errors import ScheduleError
from ..ir import Schedule
from ..timing.timeline import timeline
from .apply import (
    Pairing,
    _finish,
    _longest_pair,
    _new_attempt,
    _opposite_flows,
    _settle,
    apply_overlap,
)
from .in_flight import peak_in_flight


def check_budget(max_extra_in_flight: object) -> None:
    """Raise ``ScheduleError`` unless the budget is None (unbounded) or an integer >= 0."""
    if max_extra_in_flight is None:
        return
    value = max_extra_in_flight
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ScheduleError(
            f"max_extra_in_flight must be an integer >= 0 (extra microbatch-stages in flight "
            f"per rank) or None for no budget, got {value!r}"
        )


def budget_pairings(schedule: Schedule, budget: int) -> list[Pairing]:
    """The pairings whose extra warmup forwards stay within ``budget`` on every rank."""
    pp = schedule.pp
    uniform = (min(1, budget),) * pp
    found = [Pairing("uniform", uniform)]
    if _opposite_flows(schedule):
        found.append(Pairing("cross-stage", uniform, cross_stage_only=True))
    for cap in range(2, min(budget, pp) + 1):
        found.append(Pairing(f"chain capped at {cap}", tuple(min(pp - r, cap) for r in range(pp))))
    return found


def extra_in_flight(plain: Schedule, combined: Schedule) -> list[int]:
    """Per rank: how many more microbatch-stages ``combined`` holds at its peak than ``plain``."""
    return [
        peak_in_flight(combined.row(rank)) - peak_in_flight(plain.row(rank))
        for rank in range(plain.pp)
    ]


def apply_overlap_within(schedule: Schedule, max_extra_in_flight: int | None) -> Schedule:
    """The combined version of ``schedule`` holding at most ``max_extra_in_flight`` more
    microbatch-stages than it on any rank (None: the unbounded pass, ``apply_overlap``)."""
    check_budget(max_extra_in_flight)
    if max_extra_in_flight is None:
        return apply_overlap(schedule)
    if schedule.table.has_overlap:
        return schedule
    paired = apply_overlap_budgeted(schedule, max_extra_in_flight)
    return _finish(schedule, schedule if paired is None else paired)


def apply_overlap_budgeted(schedule: Schedule, budget: int) -> Schedule | None:
    """The fastest pairing of ``schedule`` within ``budget`` (module docstring), or None if no
    pairing with a pair runs within it."""
    original = timeline(schedule)
    if original.stuck:
        apply_overlap(schedule)  # raises the pass's own error naming the stuck ranks
    target = original.makespan + _longest_pair(schedule)
    best, best_key = None, (math.inf, 0, 0)
    for pairing in budget_pairings(schedule, budget):
        attempt = _new_attempt(schedule.table, pairing)
        if not _settle(schedule, attempt, math.inf) or not attempt.paired:
            continue
        if attempt.built()[1].makespan > target:
            _settle(schedule, attempt, target)  # refine; keeps the latest runnable split
        combined, timed = attempt.built()
        if timed.stuck or not attempt.paired:
            continue
        extra = max(extra_in_flight(schedule, combined))
        if extra > budget:
            continue
        key = (timed.makespan, -attempt.paired, extra)
        if key < best_key:
            best, best_key = combined, key
    return best


def check_native_budget(plain: Schedule, combined: Schedule, budget: int | None) -> None:
    """Raise if a natively combined schedule holds more than ``budget`` extra on some rank."""
    if budget is None:
        return
    for rank, extra in enumerate(extra_in_flight(plain, combined)):
        if extra > budget:
            raise ScheduleError(
                f"{combined.name}: its combined order holds {extra} more microbatch-stages on "
                f"rank {rank} than its plain order, over max_extra_in_flight={budget}"
            )

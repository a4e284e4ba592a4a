"""Validation: does a schedule run every microbatch through every stage, in an order that finishes?

The rules, checked in this order (the first broken one raises ``ScheduleError`` naming the rank,
the action and the rule):

1. placement: an action's stage lives on the rank that runs it; stage and microbatch in range;
2. pairs: the two halves of an OVERLAP are different microbatches (otherwise one needs the other);
3. counts: each stage of a microbatch's pipeline (``Schedule.stages_for``) runs exactly one F and
   either one B or one I and one W for it, and no other stage runs that microbatch;
4. rank order: on a rank, F before B/I before W of the same stage and microbatch, and between
   adjacent stages on the same rank, F of stage s before F of stage s+1 and backward the reverse;
5. progress: with every rank running its list in order and each action waiting for the actions
   it needs from other stages, every rank finishes (no cycle of waits across ranks);
6. lowered batches: the schedule with SEND/RECV added (``lower``) finishes under the batched p2p
   model of ``check_batches``. A schedule that already holds SEND/RECV actions is checked as it is.

Rules 1-4 are array checks over every action at once (``table_checks``); 5 runs the schedule's
timeline (kept for lowering); 6 proves the lowered schedule finishes in O(actions)
(``comm_certificate``) and simulates it only where the proof does not hold. A passed schedule is not
checked again.
"""

from __future__ import annotations

from ..errors import ScheduleError
from ..ir import Action, Derived, Schedule
from ..p2p.comm_check import check_batches
from ..p2p.lower import lower
from ..table import is_comm
from ..timing.deps import missing_needs
from ..timing.timeline import timeline
from .table_checks import check_counts, check_list_order, check_pairs, check_placement

VALID: Derived[bool] = Derived(bool)  # ``validate`` passed


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` if ``schedule`` breaks any rule listed in the module docstring.

    Checked once per schedule (a schedule never changes): the executors of every rank of a
    process share the work when they share the schedule object.
    """
    if VALID.of(schedule):
        return
    check_placement(schedule)
    check_pairs(schedule)
    check_counts(schedule)
    check_list_order(schedule)
    _check_progress(schedule)
    _check_lowered_batches(schedule)
    VALID.keep(schedule, True)


def _compute_part(schedule: Schedule) -> Schedule:
    """``schedule`` without its SEND/RECV actions (itself if it has none)."""
    table = schedule.table
    if table.compute_only:
        return schedule
    return schedule.replace_actions(table.select(~is_comm(table.kind)))


def _check_progress(schedule: Schedule) -> None:
    """Run every rank's list in order against the cross-stage dependencies; find stuck ranks."""
    compute = _compute_part(schedule)
    timed = timeline(compute)
    if not timed.stuck:
        return
    waits = []
    for rank, index in timed.stuck.items():
        action = compute.row(rank)[index]
        blocked = [c for c in action.computations() if missing_needs(schedule, c, timed.made)]
        needs = ", ".join(_describe_need(schedule, c, timed.made) for c in blocked)
        waits.append(f"rank {rank} at {action} waits for {needs}")
    first_rank, first_index = next(iter(timed.stuck.items()))
    raise ScheduleError(
        "the ranks' orders wait on each other in a cycle (dependency order across stages): "
        + "; ".join(waits),
        first_rank,
        compute.row(first_rank)[first_index],
    )


def _describe_need(schedule: Schedule, comp: Action, made) -> str:
    """The first product ``comp`` still waits for; a backward's own forward runs on its own
    rank, so no rank is named for it."""
    kind, stage, mb = missing_needs(schedule, comp, made)[0]
    if kind == "F" and stage == comp.stage:
        return f"{stage}F{mb}"
    text = f"{stage}B/I{mb}" if kind == "G" else f"{stage}{kind}{mb}"
    return f"{text} on rank {schedule.stage_to_rank[stage]}"


def _check_lowered_batches(schedule: Schedule) -> None:
    check_batches(lower(schedule) if schedule.table.compute_only else schedule)

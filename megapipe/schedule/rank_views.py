"""What one rank runs, derived from a schedule: lowering, the forward-only view, in-flight count.

Pure functions of the schedule (no torch). An executor needs the checked, lowered schedule once
per process and then only its own rank's list: ``checked_lowering`` validates and lowers once per
schedule object (the results are kept with the schedule; the ranks of one process share the
schedule object), and ``Schedule.row(rank)`` makes the ``Action`` objects of one rank only.
The tests bound the live activations by ``in_flight_limit``.
"""

from __future__ import annotations

import numpy as np

from .checks.validate import validate
from .ir import Schedule
from .overlap_pass.in_flight import STASH_RELEASE, peak_in_flight
from .p2p.comm_check import check_batches
from .p2p.lower import lower
from .table import OVERLAP, RECV_F, SEND_F, ActionTable, F


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The schedule's forward actions (and their sends/receives) in their original order."""
    table = schedule.table
    kind = table.kind
    keep = (kind == F) | (kind == SEND_F) | (kind == RECV_F) | (kind == OVERLAP)
    sub = table.select(keep)
    forwards = ActionTable.from_columns(
        sub.offsets, np.where(sub.kind == OVERLAP, F, sub.kind), sub.stage, sub.mb
    )
    return schedule.replace_actions(forwards)


def lower_schedule(schedule: Schedule) -> Schedule:
    """``schedule`` with its sends and receives (a one-rank schedule has none)."""
    return lower(schedule) if schedule.pp > 1 else schedule


def checked_lowering(schedule: Schedule) -> Schedule:
    """``schedule`` checked and lowered, each once per schedule object: a compute-only schedule
    is validated (every rule, the lowered batches included) and lowered; a lowered one is checked to
    run as it is. Raises ``ScheduleError`` naming rank, action and rule."""
    if not schedule.table.compute_only:
        check_batches(schedule)
        return schedule
    validate(schedule)
    return lower_schedule(schedule)


def in_flight_limit(schedule: Schedule, pp_rank: int) -> int:
    """The most microbatches a rank's action list holds between a forward and its last backward
    (after an I the stash still holds W's part, so B or W releases)."""
    return peak_in_flight(schedule.row(pp_rank), STASH_RELEASE)

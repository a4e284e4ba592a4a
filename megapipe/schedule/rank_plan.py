"""What one rank runs, derived from a schedule: lowering, the forward-only view, in-flight count.

Pure functions of the schedule (no torch): the executor lowers a compute-only schedule once,
derives the forward-only action lists for evaluation from the lowered one, and the tests bound
the live activations by ``in_flight_limit``.
"""

from __future__ import annotations

from megapipe.schedule.in_flight import STASH_RELEASE, peak_in_flight
from megapipe.schedule.ir import Kind, Schedule
from megapipe.schedule.lower import lower


def is_lowered(schedule: Schedule) -> bool:
    return any(not a.is_compute for row in schedule.actions for a in row)


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The schedule's forward steps (and their sends/receives) in their original order."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    rows = []
    for row in schedule.actions:
        out = []
        for action in row:
            if action.kind is Kind.OVERLAP:
                out.append(action.forward)
            elif action.kind in keep:
                out.append(action)
        rows.append(out)
    return schedule.replace_actions(rows)


def lower_schedule(schedule: Schedule) -> Schedule:
    """``schedule`` with its sends and receives (a one-rank schedule has none)."""
    return lower(schedule) if schedule.pp > 1 else schedule


def in_flight_limit(schedule: Schedule, pp_rank: int) -> int:
    """The most microbatches a rank's action list holds between a forward and its last backward
    (after an I the stash still holds W's part, so B or W releases)."""
    return peak_in_flight(schedule.actions[pp_rank], STASH_RELEASE)

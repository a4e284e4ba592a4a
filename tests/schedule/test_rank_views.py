"""The forward-only view of every lowered schedule runs to the end; in-flight counts."""

from __future__ import annotations

import pytest

from megapipe.schedule import SCHEDULES, Kind, build_schedule
from megapipe.schedule.checks.validate import VALID
from megapipe.schedule.p2p.comm_check import BATCHES_FINISH, check_batches
from megapipe.schedule.rank_views import (
    checked_lowering,
    forward_only_schedule,
    in_flight_limit,
    lower_schedule,
)

VPP = {"zbv": 2, "dualpipev": 2, "dualpipe": 2, "interleaved-1f1b": 2, "looped-bfs": 2, "zb1p": 2}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_forward_only_view_is_deadlock_free(name, pp, overlap):
    schedule = build_schedule(name, pp, 2 * pp * 2, vpp=VPP.get(name, 1), overlap=overlap)
    view = forward_only_schedule(lower_schedule(schedule))
    check_batches(view)  # raises ScheduleError naming the stuck ranks if it could hang
    kinds = {a.kind for row in view.actions for a in row}
    assert kinds <= {Kind.F, Kind.SEND_F, Kind.RECV_F}
    forwards = sum(a.kind is Kind.F for row in view.actions for a in row)
    assert forwards == schedule.num_stages * schedule.num_microbatches // (
        2 if schedule.bidirectional else 1
    )


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 2)])
def test_one_f_one_b_in_flight_is_pp_minus_rank(pp, m):
    schedule = build_schedule("1f1b", pp, m)
    assert [in_flight_limit(schedule, r) for r in range(pp)] == [min(pp - r, m) for r in range(pp)]


def test_gpipe_holds_every_microbatch():
    assert in_flight_limit(build_schedule("gpipe", 2, 5), 0) == 5


def test_checked_lowering_is_worked_out_once_per_schedule():
    schedule = build_schedule("interleaved-1f1b", 4, 8, vpp=2, overlap=True)
    lowered = checked_lowering(schedule)
    assert lowered is checked_lowering(schedule)  # kept with the schedule
    assert VALID.of(schedule) and BATCHES_FINISH.of(lowered)
    assert checked_lowering(lowered) is lowered  # a lowered schedule is checked as it is
    assert lowered.row(2) == lowered.actions[2]

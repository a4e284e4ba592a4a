"""The overlap pass within a memory budget: every schedule name stays within plain + K on every
rank, validates (including the lowered run: no deadlock), and with K = 1 fits within +1."""

from __future__ import annotations

import pytest

from megapipe.schedule import SCHEDULES, ScheduleError, build_schedule, validate
from megapipe.schedule.ir import Kind
from megapipe.schedule.overlap_pass.budget import extra_in_flight
from megapipe.schedule.overlap_pass.in_flight import peak_in_flight
from megapipe.schedule.timing.timeline import timeline

# (name, pp, microbatches, vpp): every registered schedule at sizes it accepts.
CASES = [
    (name, pp, m, vpp)
    for name in SCHEDULES
    for pp, m, vpp in ((2, 4, 1), (3, 6, 2), (4, 8, 2), (4, 8, 1))
    if not (name in ("gpipe", "1f1b") and vpp > 1) and not (name == "dualpipe" and pp % 2)
]


def pairs(schedule) -> int:
    return sum(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)


@pytest.mark.parametrize("budget", [0, 1, 2])
@pytest.mark.parametrize("name,pp,m,vpp", CASES)
def test_budget_bounds_the_peak_on_every_rank(name, pp, m, vpp, budget):
    plain = build_schedule(name, pp, m, vpp)
    combined = build_schedule(name, pp, m, vpp, overlap=True, max_extra_in_flight=budget)
    validate(combined)  # placement, counts, order, progress and the lowered run
    for rank in range(pp):
        assert peak_in_flight(combined.row(rank)) <= peak_in_flight(plain.row(rank)) + budget
    assert combined.options.max_extra_in_flight == budget


def test_unbounded_1f1b_doubles_and_the_budget_caps_it():
    plain = build_schedule("1f1b", 4, 8)
    unbounded = build_schedule("1f1b", 4, 8, overlap=True)
    capped = build_schedule("1f1b", 4, 8, overlap=True, max_extra_in_flight=1)
    assert extra_in_flight(plain, unbounded) == [4, 3, 2, 1]
    assert max(extra_in_flight(plain, capped)) == 1
    assert pairs(capped) > 0


def test_a_budget_as_large_as_the_chain_keeps_its_speed_and_pairs():
    plain = build_schedule("1f1b", 4, 8)
    full = build_schedule("1f1b", 4, 8, overlap=True, max_extra_in_flight=4)
    assert timeline(full).makespan == timeline(plain).makespan
    assert pairs(full) == pairs(build_schedule("1f1b", 4, 8, overlap=True))


def test_interleaved_pays_megatrons_one_whatever_the_budget():
    unbounded = build_schedule("interleaved-1f1b", 4, 8, 2, overlap=True)
    capped = build_schedule("interleaved-1f1b", 4, 8, 2, overlap=True, max_extra_in_flight=1)
    assert capped.actions == unbounded.actions


def test_budget_zero_holds_exactly_the_plain_peak():
    plain = build_schedule("zb1p", 4, 8)
    combined = build_schedule("zb1p", 4, 8, overlap=True, max_extra_in_flight=0)
    assert extra_in_flight(plain, combined) == [0, 0, 0, 0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_budget_names_the_value(bad):
    with pytest.raises(
        ScheduleError, match=f"max_extra_in_flight must be an integer >= 0.*{bad!r}"
    ):
        build_schedule("1f1b", 2, 4, overlap=True, max_extra_in_flight=bad)

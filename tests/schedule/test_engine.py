"""The in-order engine gives exactly what the round robin of the ranks gives, order included,
also where a product is made twice or a rank gets stuck (checked against a plain round robin
written here)."""

from __future__ import annotations

import random

import pytest

from megapipe.schedule import ScheduleError, build_schedule, parse_action
from megapipe.schedule.deps import DEFAULT_DURATIONS, needs_of, product_of
from megapipe.schedule.ir import Schedule
from megapipe.schedule.timeline import timeline
from megapipe.sim import Costs, simulate

from sweep_outputs import _perturbed


def round_robin(schedule: Schedule):
    """Sweep the ranks 0..pp-1, each as far as it can, until a sweep moves nothing: start and
    end times, the order steps ran in, where ranks got stuck, and when each product was made."""
    rows = schedule.actions
    made, start, end, order = {}, {}, {}, []
    cursor, free = [0] * len(rows), [0.0] * len(rows)
    moved = True
    while moved:
        moved = False
        for rank, row in enumerate(rows):
            while cursor[rank] < len(row):
                action = row[cursor[rank]]
                needs = [n for c in action.computations() for n in needs_of(schedule, c)]
                if any(n not in made for n in needs):
                    break
                begin = max([free[rank]] + [made[n] for n in needs])
                duration = sum(DEFAULT_DURATIONS[c.kind] for c in action.computations())
                free[rank] = begin + duration
                for comp in action.computations():
                    made[product_of(comp)] = free[rank]
                start[(rank, cursor[rank])], end[(rank, cursor[rank])] = begin, free[rank]
                order.append((rank, cursor[rank]))
                cursor[rank] += 1
                moved = True
    stuck = {r: cursor[r] for r, row in enumerate(rows) if cursor[r] < len(row)}
    return start, end, order, stuck, made


def schedules():
    rng = random.Random(7)
    for name, pp, m, vpp, overlap in [("1f1b", 3, 5, 1, False), ("zbv", 2, 4, 2, True),
                                      ("interleaved-1f1b", 2, 4, 2, True), ("zb1p", 3, 6, 2, False),
                                      ("dualpipev", 2, 4, 2, True), ("gpipe", 3, 2, 1, False)]:
        base = build_schedule(name, pp, m, vpp=vpp, overlap=overlap)
        yield base
        for how in ("swap", "drop", "dup", "move", "renumber") * 2:
            rows = _perturbed(base.actions, rng, how, m)
            if rows is not None:
                yield base.replace_actions(rows)


@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: s.name)
def test_engine_equals_the_round_robin(schedule):
    start, end, order, stuck, made = round_robin(schedule)
    run = timeline(schedule)
    assert run.stuck == stuck
    assert dict(run.made) == made
    for rank, row in enumerate(schedule.actions):
        for index in range(len(row)):
            expected = (start.get((rank, index), -1.0), end.get((rank, index), -1.0))
            assert (run.start[rank][index], run.end[rank][index]) == expected
    try:
        result = simulate(schedule, Costs(1, 2, 1))  # the same durations as the timeline
    except ScheduleError:
        return  # broken schedules: test_golden_sweep pins the errors
    assert [(t.rank, t.action) for t in result.timeline] == [
        (r, schedule.actions[r][i]) for r, i in order]


def test_a_product_made_twice_is_read_as_it_stood():
    # Rank 0 makes 0F0's output twice (ends 1, then 2) before rank 1 comes to read it.
    schedule = Schedule([[parse_action("0F0"), parse_action("0F0")], [parse_action("1F0")]],
                        2, 1, (0, 1))
    run = timeline(schedule)
    assert run.start == ((0.0, 1.0), (2.0,))
    assert round_robin(schedule)[0][(1, 0)] == 2.0

"""The in-order engine gives exactly what the round robin of the ranks gives, order included,
also where a product is made twice or a rank gets stuck (checked against a plain round robin
written here)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from megapipe.schedule import ScheduleError, apply_overlap, build_schedule, parse_action
from megapipe.schedule.ir import Schedule
from megapipe.schedule.timing.deps import DEFAULT_DURATIONS, needs_of, product_of
from megapipe.schedule.timing.engine import time_in_order
from megapipe.schedule.timing.retime import SWEEP_SEQUENCE, SweepSequence, retime
from megapipe.schedule.timing.timeline import ActionGraph, action_durations, timeline
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
    timed = timeline(schedule)
    assert timed.stuck == stuck
    assert dict(timed.made) == made
    for rank, row in enumerate(schedule.actions):
        for index in range(len(row)):
            expected = (start.get((rank, index), -1.0), end.get((rank, index), -1.0))
            assert (timed.start[rank][index], timed.end[rank][index]) == expected
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
    timed = timeline(schedule)
    assert timed.start == ((0.0, 1.0), (2.0,))
    assert round_robin(schedule)[0][(1, 0)] == 2.0


@pytest.mark.parametrize("latency", [0.0, 0.25])
@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: s.name)
def test_a_rerun_in_a_finished_runs_order_equals_the_engine(schedule, latency):
    """Other durations (and a latency), the steps taken in the order of a finished run: the
    engine's times, arrivals and sweeps; an order that breaks a rank's list order or takes a
    step before what it needs is refused (None)."""
    durations = action_durations(schedule.table, dict(DEFAULT_DURATIONS))
    first = ActionGraph.build(schedule, durations)
    timed = time_in_order(first.inputs)
    if timed.stuck or not first.unique:
        return
    found = SweepSequence.of(timed)
    graph = ActionGraph.build(schedule, durations * 1.5 + 0.125, latency)
    expected = time_in_order(graph.inputs)
    got = retime(graph, found.sequence, found.sweep)
    assert (got.start, got.end, got.arrive, got.sweep) == (
        expected.start, expected.end, expected.arrive, expected.sweep)
    assert all(type(x) is float for x in got.start + got.end + got.arrive)
    swapped = found.sequence.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    assert retime(graph, swapped, None) is None
    # Rank after rank, each in list order: rank 0 would run before what it waits for.
    by_rank = np.arange(len(schedule.table))
    if (graph.need[: schedule.table.offsets[1]] >= 0).any():
        assert retime(graph, by_rank, None) is None


@pytest.mark.parametrize("name", ["interleaved-1f1b", "1f1b", "zb1p", "zbv"])
def test_the_overlap_pass_times_the_original_as_the_engine_does(name):
    """The pass times the original in the order its first candidate ran (a retiming, kept only
    when that order holds): the same timeline as a fresh engine run."""
    schedule = build_schedule(name, 4, 12, **({"vpp": 2} if name == "interleaved-1f1b" else {}))
    apply_overlap(schedule)
    rerun_run = timeline(schedule)
    fresh = timeline(schedule.replace_actions(schedule.table))
    assert (rerun_run.start, rerun_run.end, rerun_run.stuck, dict(rerun_run.made)) == (
        fresh.start, fresh.end, fresh.stuck, dict(fresh.made))
    if name == "interleaved-1f1b":  # no W between a pair's halves: the order holds
        assert SWEEP_SEQUENCE.of(schedule) is None  # the engine did not run on it


def test_a_rerun_refuses_an_order_that_repeats_a_step():
    schedule = build_schedule("1f1b", 2, 3)
    graph = ActionGraph.build(schedule, action_durations(schedule.table, dict(DEFAULT_DURATIONS)))
    timed = time_in_order(graph.inputs)
    order = SweepSequence.of(timed).sequence.copy()
    assert retime(graph, order, None) is not None
    order[-1] = order[-2]  # the last step twice, another never
    assert retime(graph, order, None) is None

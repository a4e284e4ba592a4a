"""The compiled loops (numba) give the bits the Python loops give: a sixth of the golden sweep
and the engine's own cases (stuck ranks, products made twice, a p2p latency, retimes) run with
every run compiled, however small."""

from __future__ import annotations

import numpy as np
import pytest

from megapipe.schedule.timing import loops
from megapipe.schedule.timing.deps import DEFAULT_DURATIONS
from megapipe.schedule.timing.engine import ActionTimes, time_in_order
from megapipe.schedule.timing.retime import SweepSequence, retime
from megapipe.schedule.timing.timeline import ActionGraph, action_durations
from sweep_outputs import MICROBATCHES, group_digests, group_key, groups, read_golden
from test_engine import schedules

pytest.importorskip("numba", reason="numba is not installed: the schedule layer's loops timed in "
                    "Python only (pip install megapipe[fast])")

GROUPS = list(groups())
GOLDEN = read_golden()


def _compiled_from(monkeypatch, steps: int) -> None:
    monkeypatch.setattr(loops, "COMPILED_FROM_ACTIONS", steps)


@pytest.mark.parametrize("group", range(1, len(GROUPS), 6), ids=lambda g: group_key(*GROUPS[g]))
def test_compiled_loops_give_the_golden_outputs(monkeypatch, group):
    """Groups the default golden test skips (odd ones), one microbatch count each."""
    _compiled_from(monkeypatch, 0)
    name, pp, vpp, overlap = GROUPS[group]
    m = MICROBATCHES[(group * 5) % len(MICROBATCHES)]
    expected = GOLDEN[group_key(name, pp, vpp, overlap)][m - 1]
    assert group_digests(name, pp, vpp, overlap, (m,))[0] == expected


def _as_lists(timed: ActionTimes | None) -> tuple | None:
    if timed is None:
        return None
    columns = (timed.start, timed.end, timed.arrive, timed.sweep)
    return (*(None if c is None else np.asarray(c).tolist() for c in columns), timed.stuck,
            timed.remade)


@pytest.mark.parametrize("latency", [0.0, 0.25])
@pytest.mark.parametrize("schedule", list(schedules()), ids=lambda s: s.name)
def test_compiled_runs_and_reruns_equal_the_python_ones(monkeypatch, schedule, latency):
    durations = action_durations(schedule.table, dict(DEFAULT_DURATIONS)) * 1.5 + 0.125
    graph = ActionGraph.build(schedule, durations, latency)
    runs = {}
    for steps in (10 ** 9, 0):  # Python, then compiled
        _compiled_from(monkeypatch, steps)
        timed = time_in_order(graph.inputs, watch=graph.watch)
        assert isinstance(timed.start, np.ndarray) == (steps == 0)
        again = by_rank = None
        if graph.unique and not timed.stuck:
            found = SweepSequence.of(timed)
            again = retime(graph, found.sequence, found.sweep)
            # rank after rank: None where a rank needs what a later rank makes
            by_rank = retime(graph, np.arange(len(schedule.table)), None)
        runs[steps] = (_as_lists(timed), _as_lists(again), _as_lists(by_rank))
    assert runs[0] == runs[10 ** 9]


def test_warm_up_loads_both_loops():
    assert loops.warm_up()
    assert loops.compiled_loops(loops.COMPILED_FROM_ACTIONS) is not None
    assert loops.compiled_loops(loops.COMPILED_FROM_ACTIONS - 1) is None

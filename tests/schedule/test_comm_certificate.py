"""The O(actions) proof that a lowered schedule finishes: it holds for every lowering, and never
for a schedule the batched-p2p simulation finds stuck."""

from __future__ import annotations

import random

import pytest

from megapipe.schedule import ScheduleError, build_schedule, lower
from megapipe.schedule.p2p.comm_certificate import certified
from megapipe.schedule.p2p.comm_check import _computations, _simulate_batches
from sweep_outputs import _perturbed

SPREAD = [("gpipe", 3, 1, 4), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 4, 2, 8),
          ("interleaved-1f1b", 3, 3, 9), ("looped-bfs", 2, 2, 3), ("zb1p", 4, 2, 8),
          ("zbv", 3, 2, 7), ("dualpipev", 4, 2, 8), ("dualpipe", 4, 2, 10)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name, pp, vpp, m", SPREAD)
def test_every_lowering_is_proved_to_finish(name, pp, vpp, m, overlap):
    lowered = lower(build_schedule(name, pp, m, vpp=vpp, overlap=overlap))
    source, run = _computations(lowered)
    assert certified(lowered, run, source)


@pytest.mark.parametrize("name, pp, vpp, m", SPREAD)
def test_the_proof_never_holds_for_a_stuck_schedule(name, pp, vpp, m):
    rng = random.Random(3)
    lowered = lower(build_schedule(name, pp, m, vpp=vpp))
    refused = 0
    for how in ("swap", "drop", "dup", "move") * 10:
        rows = _perturbed(lowered.actions, rng, how, m)
        if rows is None:
            continue
        broken = lowered.replace_actions(rows)
        source, run = _computations(broken)
        holds = run is not None and certified(broken, run, source)
        try:
            _simulate_batches(broken)
        except ScheduleError:
            assert not holds, f"{how}: proved, but the simulation is stuck"
            refused += 1
            continue
    assert refused  # the perturbations do break schedules

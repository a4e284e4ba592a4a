"""The data-parallel reduction term of the cost model (``sim.dp_reduction``)."""

import pytest

from megapipe.cli import main
from megapipe.schedule import build_schedule
from megapipe.sim import simulate
from megapipe.sim.costs import Costs
from megapipe.sim.dp_reduction import DPCosts, dp_reduction

COSTS = Costs(forward=1, backward=2, weight=1)


def _reduction(name, pp, m, reduce, buckets, **options):
    schedule = build_schedule(name, pp, m, **options)
    return dp_reduction(schedule, simulate(schedule, COSTS), DPCosts(reduce, buckets))


def test_buckets_of_the_last_backward_hide_behind_its_rest():
    # no pipelining: F B F B ... the last B runs 10..12; bucket k of 4 is final at
    # 10.5 + 0.5 k and takes 0.75, so the stream ends at 13.5: 1.5 of 3 exposed
    r = _reduction("1f1b", 1, 4, 3.0, 4)
    assert r.makespan_plain == 12
    assert r.exposed_after == (3.0,) and r.makespan_after == 15
    assert r.exposed_overlapped == (1.5,) and r.makespan_overlapped == 13.5
    assert r.hidden_fraction == pytest.approx(0.5)
    one = _reduction("1f1b", 1, 4, 3.0, 1)  # one bucket: final only when the backward ends
    assert one.exposed_overlapped == (3.0,) and one.hidden_fraction == 0


def test_earlier_stages_reduce_while_later_ones_still_compute():
    r = _reduction("interleaved-1f1b", 2, 4, 3.0, 1, vpp=2)
    assert r.total == (6.0, 6.0)
    assert all(x < 6.0 for x in r.exposed_overlapped)  # a stage's last B is not the rank's
    assert r.makespan_plain < r.makespan_overlapped < r.makespan_after


def test_dualpipe_reduces_only_after_summing_its_mirrored_stages():
    r = _reduction("dualpipe", 2, 4, 3.0, 4)
    assert r.exposed_overlapped == r.exposed_after and r.hidden_fraction == 0


def test_bad_dp_costs_are_refused():
    with pytest.raises(ValueError, match="dp reduce cost -1 must be a finite number >= 0"):
        DPCosts(-1)
    with pytest.raises(ValueError, match="dp buckets 0 must be an integer >= 1"):
        DPCosts(1.0, 0)


def test_the_schedule_command_prints_the_reduction(capsys):
    assert main(["schedule", "1f1b", "--pp", "1", "-m", "4", "--dp-reduce", "3",
                 "--dp-buckets", "4"]) == 0
    out = capsys.readouterr().out
    assert ("data-parallel reduction (3 per stage in 4 bucket(s)): after the step 3 exposed, "
            "step 12 -> 15; overlapped with the backward 1.5 exposed (50% hidden), step 13.5"
            ) in out

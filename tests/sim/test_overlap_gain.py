"""The overlap pass pays off in the simulator: faster with real all-to-all, at most one pair of
fill with free communication, and peak in-flight activations within the documented bound."""

from __future__ import annotations

import pytest

from megapipe.schedule import build_schedule
from megapipe.schedule.ir import Kind
from megapipe.sim import Costs, simulate

# F=1, B=2, W=1 per chunk; two MoE layers per chunk, each with a dispatch and a combine of 0.25.
ALL_TO_ALL = Costs(1, 2, 1, dispatch=0.25, combine=0.25, moe_layers=2)
FREE = Costs(1, 2, 1)

CASES = [
    ("1f1b", 1, 2, 4), ("1f1b", 1, 4, 8), ("1f1b", 1, 4, 16), ("1f1b", 1, 8, 16),
    ("zb1p", 1, 4, 8), ("zb1p", 1, 8, 16),
    ("zb1p", 2, 2, 4), ("zb1p", 2, 4, 8), ("zb1p", 2, 8, 16),
    ("zbv", 2, 2, 4), ("zbv", 2, 4, 8), ("zbv", 2, 4, 16), ("zbv", 2, 8, 16),
    ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 2, 4, 8), ("interleaved-1f1b", 2, 8, 16),
]


def schedules(name: str, vpp: int, pp: int, m: int):
    return (
        build_schedule(name, pp, m, vpp=vpp),
        build_schedule(name, pp, m, vpp=vpp, overlap=True),
    )


@pytest.mark.parametrize("name, vpp, pp, m", CASES)
def test_overlap_is_faster_with_all_to_all(name, vpp, pp, m):
    plain, paired = schedules(name, vpp, pp, m)
    before, after = simulate(plain, ALL_TO_ALL), simulate(paired, ALL_TO_ALL)
    assert after.makespan < before.makespan
    assert after.exposed_comm_fraction < before.exposed_comm_fraction


@pytest.mark.parametrize("name, vpp, pp, m", CASES)
def test_free_communication_costs_at_most_one_pair_and_bounded_memory(name, vpp, pp, m):
    plain, paired = schedules(name, vpp, pp, m)
    before, after = simulate(plain, FREE), simulate(paired, FREE)
    uses_i = any(c.kind is Kind.I for row in plain.actions for a in row for c in a.computations())
    pair = FREE.forward + (FREE.input_grad if uses_i else FREE.backward)
    assert after.makespan <= before.makespan + pair
    for rank in range(pp):
        extra = 1 if name == "interleaved-1f1b" else pp - rank
        assert after.peak_in_flight[rank] <= before.peak_in_flight[rank] + extra


def test_plain_1f1b_numbers_from_the_issue():
    # pp=8, M=16, F=1, B=2, W=1: Megatron's +1 alone made the bubble 63; the chain keeps 21.
    plain, paired = schedules("1f1b", 1, 8, 16)
    assert max(simulate(plain, FREE).bubble) == 21
    assert max(simulate(paired, FREE).bubble) == 21
    # pp=4, M=16 with all-to-all 0.5 per exchange (`--costs 1,2,1,0.5`): 95 -> 65 (was 107).
    costs = Costs.from_text("1,2,1,0.5")
    plain, paired = schedules("1f1b", 1, 4, 16)
    assert simulate(plain, costs).makespan == 95
    assert simulate(paired, costs).makespan == 65
    # The price: rank r holds 2 (pp - r) microbatches instead of pp - r.
    assert simulate(paired, FREE).peak_in_flight == tuple(2 * (4 - r) for r in range(4))

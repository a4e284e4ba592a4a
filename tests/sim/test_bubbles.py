"""The simulated bubble against the closed forms of DualPipe's README and the Megatron paper.

F, B, W are the costs of one stage (model chunk), I = B - W, F&B = F + B (free communication);
the bubble of a rank is makespan - busy. Every rank of these schedules has the same bubble.
"""

import pytest

from megapipe.schedule.registry import build_schedule
from megapipe.sim.costs import Costs
from megapipe.sim.simulate import simulate


def one_f_one_b(pp, f, b, w):
    return (pp - 1) * (f + b)


def zb1p(pp, f, b, w):
    return (pp - 1) * (f + b - 2 * w)


def dualpipe(pp, f, b, w):
    return (pp / 2 - 1) * ((f + b) + b - 3 * w)


def simulated(name, pp, m, costs, vpp=1, overlap=False):
    return simulate(build_schedule(name, pp, m, vpp=vpp, overlap=overlap), costs)


def assert_every_rank(result, value):
    assert result.bubble == pytest.approx((value,) * result.pp)


@pytest.mark.parametrize(
    "name,vpp,overlap,expected",
    [
        ("1f1b", 1, False, 21),
        ("zb1p", 1, False, 7),
        ("interleaved-1f1b", 2, False, 21),
        ("interleaved-1f1b", 2, True, 21),  # the combined step keeps the bubble
        ("interleaved-1f1b", 4, True, 21),
        ("dualpipe", 1, True, 6),
        ("dualpipev", 1, True, 14),  # 16 stages on 8 ranks: (16/2 - 1)(F&B + B - 3W)
    ],
)
def test_table_values_on_8_ranks(name, vpp, overlap, expected):
    """F=1, B=2, W=1, F&B=3 on 8 ranks: the numbers of the issue."""
    for m in (16, 32):
        assert_every_rank(simulated(name, 8, m, Costs(1, 2, 1), vpp, overlap), expected)


COSTS = [(1, 2, 1), (1, 2, 0.5), (1.5, 2, 0.6), (1, 3, 1), (2, 3, 1), (1, 1, 0.5), (1, 1, 0)]


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("pp", [4, 6])
def test_1f1b_and_interleaved_closed_form(pp, f, b, w):
    costs = Costs(f, b, w)
    assert_every_rank(simulated("1f1b", pp, 2 * pp, costs), one_f_one_b(pp, f, b, w))
    # Megatron: (pp-1)/v of a rank's work, i.e. (pp-1)(F+B) in per-stage costs, for any v.
    for vpp in (2, 3):
        result = simulated("interleaved-1f1b", pp, 2 * pp, costs, vpp=vpp)
        assert_every_rank(result, one_f_one_b(pp, f, b, w))


@pytest.mark.parametrize("f,b,w", COSTS)
def test_zb1p_closed_form_when_w_is_the_smallest(f, b, w):
    """Exact whenever W <= F and W <= I; the closed form assumes exactly that."""
    assert w <= f and w <= b - w
    for vpp in (1, 2):
        assert_every_rank(simulated("zb1p", 6, 12, Costs(f, b, w), vpp=vpp), zb1p(6, f, b, w))


@pytest.mark.parametrize("f,b,w,exact", [(1, 2, 1.1, 7), (1, 3, 2, 7), (0.5, 2, 1, 7)])
def test_zb1p_when_w_is_larger_the_bubble_is_pp_minus_1_times_max_f_i(f, b, w, exact):
    """With W > F or W > I the W no longer fills a whole slot: (pp-1) max(F, I), not the form."""
    result = simulated("zb1p", 8, 16, Costs(f, b, w))
    assert_every_rank(result, exact)
    assert exact == (8 - 1) * max(f, b - w)
    assert exact > zb1p(8, f, b, w)


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (1, 1.5, 0.5), (2, 2.5, 0.5), (1, 1, 0)])
@pytest.mark.parametrize("pp", [4, 6, 8])
def test_dualpipe_closed_form_when_f_equals_i(pp, f, b, w):
    """DualPipe's (PP/2-1)(F&B+B-3W) is exact when F = I and W <= F (the table's example)."""
    assert f == b - w and w <= f
    assert_every_rank(simulated("dualpipe", pp, 2 * pp, Costs(f, b, w), overlap=True),
                      dualpipe(pp, f, b, w))
    # DualPipeV: the same with 2 pp stages on pp ranks.
    assert_every_rank(simulated("dualpipev", pp, 2 * pp, Costs(f, b, w), overlap=True),
                      dualpipe(2 * pp, f, b, w))


@pytest.mark.parametrize(
    "f,b,w,exact_dualpipe,exact_dualpipev",
    [(1, 3, 1, 11, 27), (1, 2, 0.5, 9.5, 23.5), (1, 2, 1.1, 6, 14)],
)
def test_dualpipe_closed_form_is_approximate_otherwise(f, b, w, exact_dualpipe, exact_dualpipev):
    """With F != I the bubble follows the real critical path; exact values on 8 ranks."""
    costs = Costs(f, b, w)
    result = simulated("dualpipe", 8, 16, costs, overlap=True)
    assert_every_rank(result, exact_dualpipe)
    assert exact_dualpipe != pytest.approx(dualpipe(8, f, b, w))
    assert_every_rank(simulated("dualpipev", 8, 16, costs, overlap=True), exact_dualpipev)


def test_peak_in_flight_matches_the_table():
    """DualPipe's table: 1F1B and ZB1P hold PP microbatches on the first rank, DualPipe and
    DualPipeV PP+1 (counted per stage; PP is the number of stages of a pipeline)."""
    costs = Costs(1, 2, 1)
    assert simulated("1f1b", 8, 16, costs).peak_in_flight[0] == 8
    assert simulated("zb1p", 8, 16, costs).peak_in_flight[0] == 8
    assert set(simulated("dualpipe", 8, 16, costs, overlap=True).peak_in_flight) == {9}
    assert set(simulated("dualpipev", 8, 16, costs, overlap=True).peak_in_flight) == {17}

"""Interval arithmetic: the one-pass covered total is the per-span sum, to the last bit."""

import random

from megapipe.schedule.timing.intervals import covered_length, covered_total, union


def test_covered_total_is_the_sum_of_each_spans_covered_length_bitwise():
    assert covered_total([(0.0, 4.0), (5.0, 6.0)], [(1.0, 2.0), (3.0, 5.5)]) == 2.5
    assert covered_total([], [(0.0, 1.0)]) == 0.0 and covered_total([(0.0, 1.0)], []) == 0.0
    rng = random.Random(3)
    for _ in range(50):
        spans = [(a, a + 3 * rng.random()) for a in (100 * rng.random() for _ in range(40))]
        cover = union((a, a + 2 * rng.random()) for a in (100 * rng.random() for _ in range(40)))
        assert covered_total(spans, cover) == sum(covered_length(s, cover) for s in spans)

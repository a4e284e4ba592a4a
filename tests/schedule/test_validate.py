"""validate: each rule fires on a small broken schedule and names the rank, action and rule."""

from __future__ import annotations

import pytest

from megapipe.schedule import Schedule, ScheduleError, build_schedule, lower, parse_action, validate


def schedule_of(
    text: str, num_stages: int, m: int, placement=None, bidirectional=False
) -> Schedule:
    rows = [[parse_action(t) for t in line.split()] for line in text.strip().splitlines()]
    placement = placement or tuple(range(num_stages))
    return Schedule(rows, num_stages, m, placement, name="hand", bidirectional=bidirectional)


def assert_error(schedule: Schedule, rank, action: str | None, *words: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    error = err.value
    assert error.rank == rank
    if action is not None:
        assert str(error.action) == action
        assert f"rank {rank}, action {action}" in str(error)
    for word in words:
        assert word in str(error)
    return error


GOOD_1F1B = """
0F0 0F1 0B0 0B1
1F0 1B0 1F1 1B1
"""


def test_a_good_hand_schedule_passes():
    validate(schedule_of(GOOD_1F1B, 2, 2))


def test_error_is_a_value_error_with_fields():
    error = ScheduleError("some rule", 3, parse_action("1B2"))
    assert isinstance(error, ValueError)
    assert str(error) == "rank 3, action 1B2: some rule"
    assert str(ScheduleError("only a rule")) == "only a rule"


# One broken hand schedule per rule: (rows, stages, microbatches, rank, action, words in the error).
BROKEN = {
    "stage on the wrong rank": ("0F0 0B0 1F0\n1B0", 2, 1, 0, "1F0", "placed on rank 1"),
    "stage out of range": ("0F0 0B0 2F0\n1F0 1B0", 2, 1, 0, "2F0", "stage 2 does not exist"),
    "microbatch out of range": (
        "0F0 0B0 0F1\n1F0 1B0", 2, 1, 0, "0F1", "microbatch 1 does not exist"
    ),
    "overlap of the same microbatch": (
        "0F0 (0F1;0B1)OVERLAP_F_B 0B0", 1, 2, 0, "(0F1;0B1)OVERLAP_F_B", "different microbatches"
    ),
    "missing forward": ("0F0 0F1 0B0 0B1\n1F0 1B0 1B1", 2, 2, 1, "1F1", "missing"),
    "missing backward": ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1", 2, 2, 0, "0B1", "missing"),
    "missing W": ("0F0 0I0", 1, 1, 0, "0W0", "missing"),
    "missing I": ("0F0 0W0", 1, 1, 0, "0I0", "missing"),
    "duplicate action": ("0F0 0F0 0B0", 1, 1, 0, "0F0", "runs F of microbatch 0 twice"),
    "both B and I": ("0F0 0B0 0I0 0W0", 1, 1, 0, "0I0", "not both B and I"),
    "backward before forward": ("0B0 0F0", 1, 1, 0, "0B0", "backward needs its forward first"),
    "W before I": ("0F0 0W0 0I0", 1, 1, 0, "0W0", "W needs the I"),
}


@pytest.mark.parametrize("rule", BROKEN)
def test_each_broken_rule_is_named(rule):
    rows, num_stages, m, rank, action, words = BROKEN[rule]
    assert_error(schedule_of(rows, num_stages, m), rank, action, words)


def test_microbatch_on_a_stage_outside_its_pipeline():
    # Bidirectional: microbatch 0 flows through stages 0..1, not 2..3.
    rows = """
0F0 3F0 0B0 3B0 3F1 3B1
1F0 2F1 1B0 2B1
"""
    s = schedule_of(rows, 4, 2, placement=(0, 1, 1, 0), bidirectional=True)
    assert_error(s, 0, "3F0", "does not flow through stage 3", "its stages are 0..1")


def test_adjacent_stages_on_one_rank_forward_order():
    # V placement with one rank: stages 0 and 1 both on rank 0; 1F0 needs 0F0's output.
    s = schedule_of("1F0 0F0 1B0 0B0", 2, 1, placement=(0, 0))
    assert_error(s, 0, "1F0", "needs the output of stage 0")


def test_adjacent_stages_on_one_rank_backward_order():
    s = schedule_of("0F0 1F0 0B0 1B0", 2, 1, placement=(0, 0))
    assert_error(s, 0, "0B0", "needs the input gradient of stage 1")


def test_cross_rank_cycle_is_reported_with_every_stuck_rank():
    rows = """
0F0 0B0 0F1 0B1
1F1 1F0 1B0 1B1
"""
    error = assert_error(schedule_of(rows, 2, 2), 0, "0B0", "cycle")
    assert "rank 1 at 1F1 waits for 0F1 on rank 0" in str(error)
    assert "rank 0 at 0B0 waits for 1B/I0 on rank 1" in str(error)


def test_lowered_schedule_that_deadlocks_is_caught():
    # Rank 0 posts RECV_B0 alone before its forward: that batch waits for rank 1's SEND_B0,
    # which needs rank 0's forward output first.
    rows = """
0RECV_B0 0F0 0SEND_F0 0B0
1RECV_F0 1F0 1B0 1SEND_B0
"""
    with pytest.raises(ScheduleError) as err:
        validate(schedule_of(rows, 2, 1))
    assert "rank 0" in str(err.value) and "rank 1" in str(err.value)


def test_lowered_good_schedule_passes_as_is():
    validate(lower(build_schedule("1f1b", 3, 5)))

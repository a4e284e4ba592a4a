"""The overlap pass: Megatron's combined orders, independent pairs, +1 warmup, memory bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.schedule import ScheduleError, apply_overlap, build_schedule, validate
from megapipe.schedule.ir import Action, Kind, Schedule, parse_action
from megapipe.schedule.lower import lower
from megapipe.schedule.overlap import pair_is_independent, peak_in_flight


def rows_of(text: str) -> list[list[Action]]:
    return [[parse_action(t) for t in line.split()] for line in text.strip().splitlines()]


def pairs_of(schedule: Schedule) -> list[Action]:
    return [a for row in schedule.actions for a in row if a.kind is Kind.OVERLAP]


def forwards_through_first_backward(row) -> int:
    """Forwards started up to and including the first action that runs a backward."""
    count = 0
    for action in row:
        count += sum(c.kind is Kind.F for c in action.computations())
        if any(c.kind in (Kind.B, Kind.I) for c in action.computations()):
            return count
    return count


def leading_forwards(row) -> int:
    count = 0
    for action in row:
        if action.kind is not Kind.F:
            break
        count += 1
    return count


def flatten(row) -> list[Action]:
    return [c for a in row for c in a.computations()]


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_no_pipelining_is_megatron_order(m):
    combined = build_schedule("1f1b", 1, m, overlap=True)
    expected = ["0F0"] + [f"(0F{i};0B{i - 1})OVERLAP_F_B" for i in range(1, m)] + [f"0B{m - 1}"]
    assert [str(a) for a in combined.actions[0]] == expected


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("groups", [2, 3])
def test_interleaved_pairs_independent_and_one_more_warmup(pp, groups):
    m = groups * pp
    base = build_schedule("interleaved-1f1b", pp, m, vpp=2)
    combined = build_schedule("interleaved-1f1b", pp, m, vpp=2, overlap=True)
    validate(combined)
    pairs = pairs_of(combined)
    assert pairs and all(pair_is_independent(p.forward, p.backward) for p in pairs)
    for rank in range(pp):
        # Megatron: warmup (pp - rank - 1) * 2 + (vpp - 1) * pp, plus one in the combined order.
        megatron_warmup = (pp - rank - 1) * 2 + pp
        assert leading_forwards(combined.actions[rank]) == megatron_warmup + 1
        assert forwards_through_first_backward(combined.actions[rank]) == (
            forwards_through_first_backward(base.actions[rank]) + 1
        )
        assert peak_in_flight(combined.actions[rank]) == peak_in_flight(base.actions[rank]) + 1
        # Same computations, forwards and backwards each in their original order.
        for kinds in ({Kind.F}, {Kind.B}):
            assert [c for c in flatten(combined.actions[rank]) if c.kind in kinds] == [
                c for c in flatten(base.actions[rank]) if c.kind in kinds
            ]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (3, 3)])
def test_plain_1f1b_pairs_every_steady_step(pp, m):
    combined = build_schedule("1f1b", pp, m, overlap=True)
    validate(combined)
    for rank, row in enumerate(combined.actions):
        warmup = min(pp - rank, m)
        expected = [f"{rank}F{i}" for i in range(warmup)]
        expected += [f"({rank}F{i + warmup};{rank}B{i})OVERLAP_F_B" for i in range(m - warmup)]
        expected += [f"{rank}B{i}" for i in range(m - warmup, m)]
        assert [str(a) for a in row] == expected


@pytest.mark.parametrize("name, pp, vpp, m", [
    ("zb1p", 2, 2, 4), ("zb1p", 4, 2, 8), ("zb1p", 3, 1, 6), ("zbv", 2, 2, 4), ("zbv", 4, 2, 8),
])
def test_zero_bubble_pairs_forward_with_input_backward(name, pp, vpp, m):
    base = build_schedule(name, pp, m, vpp=vpp)
    combined = build_schedule(name, pp, m, vpp=vpp, overlap=True)
    validate(combined)
    pairs = pairs_of(combined)
    assert pairs and all(p.backward.kind is Kind.I for p in pairs)
    assert all(pair_is_independent(p.forward, p.backward) for p in pairs)
    for old, new in zip(base.actions, combined.actions):
        assert peak_in_flight(new) <= peak_in_flight(old) + 1
        # W actions keep their order relative to the backwards (only forwards move).
        keep = {Kind.I, Kind.W}
        assert [c for c in flatten(new) if c.kind in keep] == [
            c for c in flatten(old) if c.kind in keep
        ]
        # Every I that had a forward next (W's aside) is paired.
        expected_pairs = sum(
            1 for i, a in enumerate(old) if a.kind is Kind.I
            and next((b.kind for b in old[i + 1:] if b.kind is not Kind.W), None) is Kind.F
        )
        assert sum(a.kind is Kind.OVERLAP for a in new) == expected_pairs


@pytest.mark.parametrize("name", ["gpipe", "looped-bfs"])
def test_no_forward_after_backward_means_no_pairs(name):
    base = build_schedule(name, 2, 4, vpp=1 if name == "gpipe" else 2)
    assert apply_overlap(base).actions == base.actions


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_overlapped_schedules_pass_unchanged(name):
    native = build_schedule(name, 4, 8, overlap=True)
    assert pairs_of(native)
    assert apply_overlap(native) is native


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_pass_pairs_the_unpaired_dualpipe_orders_too(name):
    # The generic rule on DualPipe's F/B order (bidirectional, too) finds at least as many pairs
    # as the hand-written overlapped order, at one more microbatch in flight.
    base = build_schedule(name, 4, 8)
    combined = apply_overlap(base)
    validate(combined)
    assert len(pairs_of(combined)) >= len(pairs_of(build_schedule(name, 4, 8, overlap=True)))
    for old, new in zip(base.actions, combined.actions):
        assert peak_in_flight(new) <= peak_in_flight(old) + 1


def test_pass_is_idempotent():
    once = build_schedule("interleaved-1f1b", 2, 4, vpp=2, overlap=True)
    assert apply_overlap(once) is once


def test_pair_that_would_close_a_cycle_is_split():
    # Pairing both (F1;B0) would make each rank's pair wait for the other's: rank 0's B0 needs
    # rank 1's B0, whose partner F1 needs rank 0's F1. Splitting rank 1's pair (its backward can
    # run alone) opens the cycle; rank 0 keeps its pair.
    schedule = Schedule(rows_of("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1"), 2, 2, (0, 1))
    combined = apply_overlap(schedule)
    assert combined.to_text() == "0F0 (0F1;0B0)OVERLAP_F_B 0B1\n1F0 1B0 1F1 1B1"
    validate(combined)


def test_pair_independence_rule():
    forward, backward = parse_action("1F2"), parse_action("3B2")
    assert not pair_is_independent(forward, backward)
    assert pair_is_independent(parse_action("1F3"), backward)
    assert pair_is_independent(parse_action("0F1"), parse_action("0I0"))
    with pytest.raises(ValueError, match="forward; B or I"):
        pair_is_independent(backward, forward)


def test_rejects_lowered_and_stuck_input():
    lowered = lower(build_schedule("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="compute-only"):
        apply_overlap(lowered)
    stuck = Schedule(rows_of("0B0 0F0\n1F0 1B0"), 2, 1, (0, 1))
    with pytest.raises(ScheduleError, match="rank 0, action 0B0: cannot pair"):
        apply_overlap(stuck)


def test_peak_in_flight_counts_forward_half_first():
    assert peak_in_flight(rows_of("0F0 (0F1;0B0)OVERLAP_F_B 0B1")[0]) == 2
    assert peak_in_flight(rows_of("0F0 0B0 0F1 0B1")[0]) == 1


_CASES = st.sampled_from(
    [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb1p", 1),
     ("zb1p", 2), ("zbv", 2), ("looped-bfs", 2)]
)


@settings(max_examples=40, deadline=None)
@given(case=_CASES, pp=st.integers(1, 4), groups=st.integers(1, 3), extra=st.integers(0, 3))
def test_property_overlap_valid_independent_and_bounded(case, pp, groups, extra):
    name, vpp = case
    m = groups * pp + (extra if vpp == 1 else 0)
    try:
        base = build_schedule(name, pp, m, vpp=vpp)
    except ScheduleError:
        return
    combined = apply_overlap(base)
    validate(combined)  # counts, dependencies, pair independence, and a deadlock-free lowering
    for old, new in zip(base.actions, combined.actions):
        assert sorted(map(str, flatten(old))) == sorted(map(str, flatten(new)))
        assert peak_in_flight(new) <= peak_in_flight(old) + 1

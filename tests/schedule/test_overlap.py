"""The overlap pass: Megatron's combined orders, the chain of extra warmups, the free-communication
bound, independent pairs, memory bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megapipe.schedule import ScheduleError, apply_overlap, build_schedule, validate
from megapipe.schedule.ir import Action, Kind, Schedule, parse_action
from megapipe.schedule.overlap_pass.apply import (
    critical_path,
    makespan,
    pair_is_independent,
    pairing_candidates,
    peak_in_flight,
)
from megapipe.schedule.p2p.lower import lower
from megapipe.schedule.timing.timeline import timeline
from schedule_rows import leading_forwards


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


def flatten(row) -> list[Action]:
    return [c for a in row for c in a.computations()]


def free_makespan(schedule: Schedule) -> float:
    """Makespan on the dependency timeline with F=1, B=2, I=W=1 and pairs of F + B (or F + I):
    free communication, where pairing gains nothing."""
    return makespan(timeline(schedule))


def longest_pair(schedule: Schedule) -> float:
    """F + B if the schedule holds full backwards, else F + I: the fill the pass may add."""
    kinds = {c.kind for row in schedule.actions for a in row for c in a.computations()}
    return 3.0 if Kind.B in kinds else 2.0


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


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (3, 7), (4, 16)])
def test_plain_1f1b_takes_the_chain_of_extra_warmups(pp, m):
    # Rank r runs e_r = pp - r extra warmup forwards (2(pp - r) - 1 in all), so that the pair
    # holding B_i on rank r + 1 never waits for rank r's pair holding B_i's predecessor. (With
    # very few microbatches, M < 2 pp, Megatron's +1 may already end in time and is kept.)
    combined = build_schedule("1f1b", pp, m, overlap=True)
    validate(combined)
    for rank, row in enumerate(combined.actions):
        warmup = min(2 * (pp - rank) - 1, m)
        expected = [f"{rank}F{i}" for i in range(warmup)]
        expected += [f"({rank}F{i + warmup};{rank}B{i})OVERLAP_F_B" for i in range(m - warmup)]
        expected += [f"{rank}B{i}" for i in range(max(m - warmup, 0), m)]
        assert [str(a) for a in row] == expected


@pytest.mark.parametrize("name, pp, vpp, m", [
    ("zb1p", 2, 2, 4), ("zb1p", 4, 2, 8), ("zb1p", 3, 1, 6), ("zb1p", 4, 1, 16),
    ("zbv", 2, 2, 4), ("zbv", 4, 2, 8), ("zbv", 4, 2, 16),
])
def test_zero_bubble_pairs_forward_with_input_backward(name, pp, vpp, m):
    base = build_schedule(name, pp, m, vpp=vpp)
    combined = build_schedule(name, pp, m, vpp=vpp, overlap=True)
    validate(combined)
    pairs = pairs_of(combined)
    assert pairs and all(p.backward.kind is Kind.I for p in pairs)
    assert all(pair_is_independent(p.forward, p.backward) for p in pairs)
    for rank, (old, new) in enumerate(zip(base.actions, combined.actions)):
        assert peak_in_flight(new) <= peak_in_flight(old) + (pp - rank)
        # I and W keep their order, forwards keep theirs (forwards only move earlier).
        for kinds in ({Kind.I, Kind.W}, {Kind.F}):
            assert [c for c in flatten(new) if c.kind in kinds] == [
                c for c in flatten(old) if c.kind in kinds
            ]


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
    # The generic pass also pairs DualPipe's F/B orders (bidirectional, too), within the same
    # free-communication bound; the hand-written overlapped orders stay the better choice.
    base = build_schedule(name, 4, 8)
    combined = apply_overlap(base)
    validate(combined)
    assert len(pairs_of(combined)) >= len(pairs_of(build_schedule(name, 4, 8, overlap=True))) // 2
    assert free_makespan(combined) <= free_makespan(base) + longest_pair(base)
    for rank, (old, new) in enumerate(zip(base.actions, combined.actions)):
        assert peak_in_flight(new) <= peak_in_flight(old) + (4 - rank)


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
    assert free_makespan(combined) <= free_makespan(base) + longest_pair(base)
    for rank, (old, new) in enumerate(zip(base.actions, combined.actions)):
        assert sorted(map(str, flatten(old))) == sorted(map(str, flatten(new)))
        assert peak_in_flight(new) <= peak_in_flight(old) + (pp - rank)


_BOUND_CASES = [
    (name, vpp, pp, m)
    for name, vpp in [("1f1b", 1), ("zb1p", 1), ("zb1p", 2), ("zbv", 2), ("interleaved-1f1b", 2)]
    for pp, m in [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]
]


@pytest.mark.parametrize("name, vpp, pp, m", _BOUND_CASES)
def test_free_communication_costs_at_most_one_pair(name, vpp, pp, m):
    # The bound the pass guarantees by construction: on the timeline with free communication
    # the paired schedule ends at most one pair (F + B, or F + I) after the original. For the
    # one-chunk schedules (chain) and interleaved 1F1B (Megatron's +1) it ends with it.
    base = build_schedule(name, pp, m, vpp=vpp)
    combined = build_schedule(name, pp, m, vpp=vpp, overlap=True)
    assert pairs_of(combined)
    assert free_makespan(combined) <= free_makespan(base) + longest_pair(base)
    if name in ("1f1b", "interleaved-1f1b") or (name == "zb1p" and vpp == 1):
        assert free_makespan(combined) == free_makespan(base)
    for rank, (old, new) in enumerate(zip(base.actions, combined.actions)):
        extra = 1 if name == "interleaved-1f1b" or pp == 1 else pp - rank
        assert peak_in_flight(new) <= peak_in_flight(old) + extra


@pytest.mark.parametrize("name, vpp, pp, m", [
    ("1f1b", 1, 4, 16), ("1f1b", 1, 8, 32), ("zb1p", 1, 4, 16), ("zb1p", 2, 4, 16),
    ("zbv", 2, 4, 16), ("interleaved-1f1b", 2, 4, 16), ("interleaved-1f1b", 4, 8, 64),
])
def test_most_backwards_are_paired_with_enough_microbatches(name, vpp, pp, m):
    base = build_schedule(name, pp, m, vpp=vpp)
    combined = build_schedule(name, pp, m, vpp=vpp, overlap=True)
    backwards = sum(c.kind in (Kind.B, Kind.I) for row in base.actions for c in flatten(row))
    assert len(pairs_of(combined)) >= 0.6 * backwards


def test_megatron_plus_one_beats_the_chain_only_where_the_chunks_give_slack():
    # Plain 1F1B with Megatron's +1 alternates adjacent ranks (two pairs per turn: bubble 21 ->
    # 63 at pp=8, M=16); the chain needs pp - r extras. Interleaved 1F1B keeps the +1.
    candidates = [p.name for p in pairing_candidates(build_schedule("1f1b", 8, 16))]
    assert candidates == ["megatron", "chain"]
    one_chunk = build_schedule("1f1b", 8, 16, overlap=True)
    assert [leading_forwards(row) for row in one_chunk.actions] == [
        2 * (8 - rank) - 1 for rank in range(8)
    ]
    interleaved = build_schedule("interleaved-1f1b", 8, 16, vpp=2, overlap=True)
    assert [leading_forwards(row) for row in interleaved.actions] == [
        2 * (8 - rank - 1) + 8 + 1 for rank in range(8)
    ]
    assert [p.name for p in pairing_candidates(build_schedule("zbv", 4, 8))] == [
        "megatron", "cross-stage", "chain"
    ]


def test_critical_path_follows_the_waits():
    schedule = Schedule(rows_of("0F0 0B0\n1F0 1B0"), 2, 1, (0, 1))
    run = timeline(schedule)
    assert critical_path(schedule, run) == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert makespan(run) == 6.0

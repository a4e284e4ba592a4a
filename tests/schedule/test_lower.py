"""Lowering: SEND/RECV placement, channel order, the batched-p2p run check and its errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megapipe.schedule import ScheduleError, build_schedule, check_batches, lower
from megapipe.schedule.ir import (
    COMM_KINDS,
    Action,
    Kind,
    Schedule,
    parse_action,
    read_csv,
    write_csv,
)
from megapipe.schedule.p2p.comm_check import check_channel_matching
from megapipe.schedule.timing.deps import message_of_comm, received_message, sent_message
from megapipe.schedule.timing.timeline import timeline

# (name, pp, vpp, microbatches): a spread over every registered schedule, including odd pp,
# M not a multiple of pp where allowed, and the smallest M each schedule takes.
SPREAD = [
    ("gpipe", 1, 1, 3), ("gpipe", 3, 1, 5),
    ("1f1b", 1, 1, 4), ("1f1b", 2, 1, 1), ("1f1b", 3, 1, 7), ("1f1b", 4, 1, 8),
    ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 2, 3, 6),
    ("interleaved-1f1b", 3, 2, 9), ("interleaved-1f1b", 4, 2, 12),
    ("looped-bfs", 2, 2, 3), ("looped-bfs", 4, 2, 8),
    ("zb1p", 2, 1, 5), ("zb1p", 2, 2, 4), ("zb1p", 4, 2, 8), ("zb1p", 3, 3, 6),
    ("zbv", 2, 2, 2), ("zbv", 3, 2, 7), ("zbv", 4, 2, 8),
    ("dualpipev", 2, 2, 4), ("dualpipev", 3, 2, 7), ("dualpipev", 4, 2, 8),
    ("dualpipe", 2, 2, 4), ("dualpipe", 4, 2, 8), ("dualpipe", 4, 2, 10),
]


def rows_of(text: str) -> list[list[Action]]:
    return [[parse_action(t) for t in line.split()] for line in text.strip().splitlines()]


def two_rank_schedule(text: str, microbatches: int = 1) -> Schedule:
    return Schedule(rows_of(text), 2, microbatches, (0, 1))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name, pp, vpp, m", SPREAD)
def test_every_schedule_lowers_without_deadlock(name, pp, vpp, m, overlap):
    schedule = build_schedule(name, pp, m, vpp=vpp, overlap=overlap)
    lowered = lower(schedule)
    check_batches(lowered)
    # Compute actions are untouched, in order.
    for old, new in zip(schedule.actions, lowered.actions):
        assert [a for a in new if a.is_compute] == list(old)
    # One SEND and one RECV per cross-rank message, none inside a rank.
    expected = {
        sent_message(schedule, c) for row in schedule.actions for a in row
        for c in a.computations()
    } - {None}
    sends = [message_of_comm(lowered, a) for row in lowered.actions for a in row
             if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    recvs = [message_of_comm(lowered, a) for row in lowered.actions for a in row
             if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    assert sorted(sends) == sorted(recvs) == sorted(expected)
    if pp == 1:
        assert lowered.actions == schedule.actions


def test_sends_follow_producers_and_recvs_precede_consumers():
    schedule = build_schedule("interleaved-1f1b", 4, 8, vpp=2, overlap=True)
    lowered = lower(schedule)
    for row in lowered.actions:
        index = {str(a): i for i, a in enumerate(row)}
        for i, action in enumerate(row):
            if not action.is_compute:
                continue
            for comp in action.computations():
                sent = sent_message(lowered, comp)
                if sent is not None:
                    send = Action(comp.stage, Kind.SEND_F if sent[0] == "F" else Kind.SEND_B,
                                  comp.microbatch)
                    # In the gap's batch right after the action (an OVERLAP sends both results).
                    assert i < index[str(send)] and all(
                        not a.is_compute for a in row[i + 1:index[str(send)]]
                    )
                received = received_message(lowered, comp)
                if received is not None:
                    kind = Kind.RECV_F if received[0] == "F" else Kind.RECV_B
                    assert index[str(Action(comp.stage, kind, comp.microbatch))] < i


UNIT = {Kind.F: 1, Kind.B: 1, Kind.I: 1, Kind.W: 1}
SLOW_BACKWARD = {Kind.F: 1, Kind.B: 3, Kind.I: 2, Kind.W: 1, Kind.OVERLAP: 3}


@pytest.mark.parametrize("durations", [None, UNIT, SLOW_BACKWARD])
@pytest.mark.parametrize("name, vpp, overlap", [("interleaved-1f1b", 2, False),
                                                ("interleaved-1f1b", 2, True), ("zbv", 2, True)])
def test_recvs_posted_when_the_data_is_sent(name, vpp, overlap, durations):
    # Each RECV sits before the receiver's first action that starts once the SEND is posted on
    # the timeline: never delaying an earlier action, and ahead of its consumer by everything
    # that runs in between.
    schedule = build_schedule(name, 4, 8, vpp=vpp, overlap=overlap)
    run = timeline(schedule, durations)
    lowered = lower(schedule, durations)
    check_batches(lowered)
    sent_at = {}
    for rank, row in enumerate(schedule.actions):
        for k, action in enumerate(row):
            for comp in action.computations():
                if sent_message(schedule, comp):
                    sent_at[sent_message(schedule, comp)] = run.end[rank][k]
    leads = []
    for rank, row in enumerate(lowered.actions):
        computed = 0
        for i, action in enumerate(row):
            if action.is_compute:
                computed += 1
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                sent = sent_at[message_of_comm(lowered, action)]
                assert computed == sum(1 for t in run.start[rank] if t < sent)
                consumer = next(j for j, a in enumerate(row[i:]) if a.is_compute and any(
                    received_message(lowered, c) == message_of_comm(lowered, action)
                    for c in a.computations()))
                leads.append(sum(1 for a in row[i:i + consumer] if a.is_compute))
    assert max(leads) >= 1  # some transfers overlap computation on the receiver


def test_durations_must_be_positive():
    with pytest.raises(ScheduleError, match=r"durations\[B\] must be a positive number, got 0"):
        lower(build_schedule("1f1b", 2, 2), {Kind.F: 1, Kind.B: 0, Kind.I: 1, Kind.W: 1})


@pytest.mark.parametrize("name, vpp", [("interleaved-1f1b", 2), ("dualpipe", 2), ("zbv", 2)])
def test_lowered_text_and_csv_round_trip(tmp_path, name, vpp):
    lowered = lower(build_schedule(name, 4, 8, vpp=vpp, overlap=True))
    parsed = [[parse_action(t) for t in line.split()] for line in lowered.to_text().splitlines()]
    assert parsed == [list(r) for r in lowered.actions]
    path = str(tmp_path / "lowered.csv")
    write_csv(lowered, path)
    loaded = read_csv(path, bidirectional=lowered.bidirectional)
    assert loaded.actions == lowered.actions
    assert loaded.stage_to_rank == lowered.stage_to_rank
    check_batches(loaded)


def test_channel_order_matching():
    lowered = lower(build_schedule("1f1b", 2, 3))
    matching = check_channel_matching(lowered)
    for (rank, index), (peer, peer_index) in matching.items():
        assert matching[(peer, peer_index)] == (rank, index)
        assert message_of_comm(lowered, lowered.actions[rank][index]) == message_of_comm(
            lowered, lowered.actions[peer][peer_index]
        )


def test_swapped_recv_order_is_caught():
    lowered = lower(build_schedule("gpipe", 2, 2))
    row = list(lowered.actions[1])
    first, second = row.index(parse_action("1RECV_F0")), row.index(parse_action("1RECV_F1"))
    row[first], row[second] = row[second], row[first]
    broken = lowered.replace_actions([lowered.actions[0], row])
    with pytest.raises(ScheduleError, match=r"rank 1, action 1RECV_F1: is message 0 from rank 0"):
        check_batches(broken)


@pytest.mark.parametrize("removed, error", [
    ("0SEND_F1", r"rank 1, action 1RECV_F1: .*a SEND is missing"),
    ("0RECV_B1", r"rank 1, action 1SEND_B1: .*a RECV is missing"),
])
def test_missing_send_or_recv_is_caught(removed, error):
    lowered = lower(build_schedule("1f1b", 2, 2))
    row = [a for a in lowered.actions[0] if str(a) != removed]
    broken = lowered.replace_actions([row, lowered.actions[1]])
    with pytest.raises(ScheduleError, match=error):
        check_batches(broken)


def test_nccl_head_of_line_deadlock_is_caught():
    # Rank 0 posts its RECV of the gradient first; its SEND of F0 is queued behind that batch,
    # so rank 1 never gets F0's output and never sends the gradient.
    broken = two_rank_schedule("0RECV_B0 0F0 0SEND_F0 0B0\n1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError) as err:
        check_batches(broken)
    message = str(err.value)
    assert "deadlocks, stuck ranks [0, 1]" in message
    assert "rank 0 ran its list" not in message
    assert "rank 0 at 0B0 waits for 0RECV_B0" in message
    assert "rank 1 at 1F0 waits for 1RECV_F0" in message
    assert "rank 0's earlier batches to complete before its 0SEND_F0" in message
    # The same ops with the SEND first (as lower places them) run.
    check_batches(two_rank_schedule("0F0 0SEND_F0 0RECV_B0 0B0\n1RECV_F0 1F0 1B0 1SEND_B0"))


def test_recv_after_its_consumer_is_caught():
    broken = two_rank_schedule("0F0 0SEND_F0 0RECV_B0 0B0\n1F0 1RECV_F0 1B0 1SEND_B0")
    expected = r"rank 1 at 1F0 waits for 1RECV_F0, which is posted only after it"
    with pytest.raises(ScheduleError, match=expected):
        check_batches(broken)


def test_compute_only_schedule_has_no_recvs():
    expected = r"rank 1 at 1F0 waits for a RECV of 0F0 \(rank 0\) that is never posted"
    with pytest.raises(ScheduleError, match=expected):
        check_batches(build_schedule("1f1b", 2, 2))


def test_send_before_its_computation_is_caught():
    broken = two_rank_schedule("0SEND_F0 0F0 0RECV_B0 0B0\n1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match=r"rank 0, action 0SEND_F0: sends the result of 0F0"):
        check_batches(broken)


def test_comm_inside_one_rank_is_caught():
    lowered = lower(build_schedule("zbv", 2, 2))
    # Stages 1 and 2 share rank 1 in the V placement: their hand-off is local.
    row = list(lowered.actions[1])
    row.insert(row.index(parse_action("1F0")) + 1, parse_action("1SEND_F0"))
    broken = lowered.replace_actions([lowered.actions[0], row])
    expected = r"rank 1, action 1SEND_F0: both stages are on this rank"
    with pytest.raises(ScheduleError, match=expected):
        check_batches(broken)


def test_comm_on_wrong_rank_or_without_peer_is_caught():
    lowered = lower(build_schedule("1f1b", 2, 1))
    expected = r"rank 0, action 1RECV_F0: stage 1 is placed on rank 1"
    with pytest.raises(ScheduleError, match=expected):
        actions = [list(lowered.actions[0]) + [parse_action("1RECV_F0")], lowered.actions[1]]
        check_batches(lowered.replace_actions(actions))
    with pytest.raises(ScheduleError, match=r"rank 1, action 1SEND_F0: .*no peer"):
        actions = [lowered.actions[0], list(lowered.actions[1]) + [parse_action("1SEND_F0")]]
        check_batches(lowered.replace_actions(actions))


def test_lower_rejects_lowered_and_stuck_schedules():
    lowered = lower(build_schedule("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="lowered already"):
        lower(lowered)
    with pytest.raises(ScheduleError, match="rank 0, action 0B0: cannot lower"):
        lower(two_rank_schedule("0B0 0F0\n1F0 1B0"))


def test_comm_kinds_only_between_ranks():
    lowered = lower(build_schedule("dualpipe", 4, 8, overlap=True))
    for rank, row in enumerate(lowered.actions):
        for action in row:
            if action.kind in COMM_KINDS:
                assert lowered.stage_to_rank[action.stage] == rank


def test_spread_covers_every_registered_schedule():
    from megapipe.schedule import SCHEDULES

    assert {name for name, *_ in SPREAD} == set(SCHEDULES)


@pytest.mark.parametrize("name, pp, vpp, m", [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 4, 2, 8), ("looped-bfs", 2, 2, 4),
    ("zb1p", 4, 2, 8), ("zbv", 4, 2, 8), ("dualpipev", 4, 2, 8),
])
def test_lowered_schedules_run_in_torch_simulator(name, pp, vpp, m):
    # torch.distributed.pipelining's own dry run (blocking RECVs, no OVERLAP) as a second opinion.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    lowered = lower(build_schedule(name, pp, m, vpp=vpp))
    order = {r: [schedules._Action.from_str(str(a)) for a in row]
             for r, row in enumerate(lowered.actions)}
    schedules._simulate_comms_compute(order, lambda s: lowered.stage_to_rank[s], lowered.num_stages)


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(SPREAD),
    overlap=st.booleans(),
    costs=st.tuples(*[st.floats(0.1, 4.0) for _ in range(5)]),
)
def test_property_any_durations_lower_deadlock_free(case, overlap, costs):
    # Durations only move RECVs; the placement stays deadlock-free and order-matched for any.
    name, pp, vpp, m = case
    durations = dict(zip((Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP), costs))
    check_batches(lower(build_schedule(name, pp, m, vpp=vpp, overlap=overlap), durations))

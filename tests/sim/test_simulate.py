"""The event simulation on hand-made schedules, and against an independent longest-path model."""

import pytest
from hypothesis import given, settings, strategies as st

from megapipe.pairing.timing import COMM, COMPUTE
from megapipe.schedule.errors import ScheduleError
from megapipe.schedule.ir import Kind, Schedule, loop_placement, parse_action
from megapipe.schedule.registry import build_schedule
from megapipe.sim.costs import Costs
from megapipe.sim.simulate import simulate


def rows_schedule(text_rows, num_stages, num_microbatches, placement=None, **kw) -> Schedule:
    rows = [[parse_action(a) for a in row.split()] for row in text_rows]
    placement = placement or loop_placement(len(rows), num_stages)
    return Schedule(rows, num_stages, num_microbatches, placement, name="hand", **kw)


def hand_1f1b(pp: int, m: int) -> Schedule:
    """1F1B written out here, independently of megapipe.schedule.families.simple."""
    rows = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        row = [f"{r}F{i}" for i in range(warm)]
        for j in range(m - warm):
            row += [f"{r}F{warm + j}", f"{r}B{j}"]
        row += [f"{r}B{j}" for j in range(m - warm, m)]
        rows.append(" ".join(row))
    return rows_schedule(rows, pp, m)


def test_one_rank_runs_back_to_back():
    result = simulate(rows_schedule(["0F0 0B0 0F1 0B1"], 1, 2), Costs(1, 2, 1))
    assert result.makespan == 6
    assert result.bubble == (0,) and result.busy == (6,)
    assert [(t.start, t.end) for t in result.timeline] == [(0, 1), (1, 3), (3, 4), (4, 6)]


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 8)])
def test_hand_1f1b_bubble_and_in_flight(pp, m):
    costs = Costs(1.5, 2.5, 1)
    result = simulate(hand_1f1b(pp, m), costs)
    for bubble in result.bubble:
        assert bubble == pytest.approx((pp - 1) * (1.5 + 2.5))
    assert result.peak_in_flight == tuple(min(pp - r, m) for r in range(pp))
    assert result.makespan == pytest.approx((m + pp - 1) * 4.0)


def test_p2p_latency_only_between_ranks():
    two_ranks = rows_schedule(["0F0 0B0", "1F0 1B0"], 2, 1)
    assert simulate(two_ranks, Costs(1, 2, 1, p2p_latency=0.25)).makespan == 6.5
    # Two stages on one rank hand over locally: no latency.
    one_rank = rows_schedule(["0F0 1F0 1B0 0B0"], 2, 1, placement=(0, 0))
    assert simulate(one_rank, Costs(1, 2, 1, p2p_latency=5)).makespan == 6


def test_stage_multipliers_scale_compute():
    one_rank = rows_schedule(["0F0 1F0 1B0 0B0"], 2, 1, placement=(0, 0))
    result = simulate(one_rank, Costs(1, 2, 1, stage_multipliers=(2.0, 1.0)))
    assert result.makespan == 2 + 1 + 2 + 4
    with pytest.raises(ValueError, match="3 stage multipliers"):
        simulate(one_rank, Costs(stage_multipliers=(1, 1, 1)))


def test_input_and_weight_gradients():
    result = simulate(rows_schedule(["0F0 0I0 0W0"], 1, 1), Costs(1, 2, 0.5))
    assert [(t.start, t.end) for t in result.timeline] == [(0, 1), (1, 2.5), (2.5, 3)]
    with pytest.raises(ScheduleError, match="deadlock.*0W0 waits for 0B/I0"):
        simulate(rows_schedule(["0F0 0W0 0I0"], 1, 1), Costs(1, 2, 0.5))


def test_overlap_with_free_comm_costs_f_plus_b():
    sched = rows_schedule(["0F0 (0F1;0B0)OVERLAP_F_B 0B1"], 1, 2)
    result = simulate(sched, Costs(1, 2, 1, moe_layers=3))
    overlap = result.timeline[1]
    assert (overlap.start, overlap.end) == pytest.approx((1, 4))
    assert [str(h.action) for h in overlap.halves] == ["0F1", "0B0"]
    assert result.makespan == pytest.approx(6) and result.exposed_comm_fraction == 0


def test_overlap_hides_the_all_to_all():
    costs = Costs(1, 2, 1, dispatch=0.5, combine=0.5, moe_layers=1)
    plain = simulate(rows_schedule(["0F0 0B0 0F1 0B1"], 1, 2), costs)
    assert plain.makespan == 2 * (1 + 1 + 2 + 1)
    assert plain.exposed_comm_fraction == 1.0
    assert plain.idle == (4.0,) and plain.bubble == (0.0,)

    paired = simulate(rows_schedule(["0F0 (0F1;0B0)OVERLAP_F_B 0B1"], 1, 2), costs)
    overlap = paired.timeline[1]
    # Every all-to-all of the pair runs beside compute: the pair costs F + B.
    assert overlap.end - overlap.start == 3.0
    assert paired.makespan == 2 + 3 + 3
    assert paired.comm == (4.0,) and paired.exposed_comm == (2.0,)
    assert paired.exposed_comm_fraction == 0.5


def test_overlap_pairs_layers_in_the_documented_order():
    costs = Costs(1, 2, 1, dispatch=0.1, combine=0.1, moe_layers=2)
    result = simulate(rows_schedule(["0F0 (0F1;0B0)OVERLAP_F_B 0B1"], 1, 2), costs)
    segs = result.timeline[1].segments

    def order(stream):
        return [f"{s.action.kind.value}{s.layer}:{s.part}" for s in segs if s.stream == stream]

    assert order(COMPUTE) == [
        "F0:attention", "B1:experts", "F0:experts", "B1:attention",
        "F1:attention", "B0:experts", "F1:experts", "B0:attention",
    ]
    assert order(COMM) == [
        "B1:combine", "F0:dispatch", "B1:dispatch", "F0:combine",
        "B0:combine", "F1:dispatch", "B0:dispatch", "F1:combine",
    ]
    compute = [s for s in segs if s.stream == COMPUTE]
    assert all(a.end <= b.start + 1e-12 for a, b in zip(compute, compute[1:]))


def test_bidirectional_pipelines():
    # mb 0 flows through stages 0 (rank 0) -> 1 (rank 1); mb 1 through 2 (rank 1) -> 3 (rank 0).
    sched = rows_schedule(
        ["0F0 3F1 3B1 0B0", "2F1 1F0 1B0 2B1"], 4, 2, placement=(0, 1, 1, 0), bidirectional=True
    )
    result = simulate(sched, Costs(1, 2, 1))
    assert result.makespan == 6 and result.bubble == (0, 0)
    with pytest.raises(ScheduleError, match="3F0: microbatch 0 does not flow through stage 3"):
        simulate(rows_schedule(["0F0 3F0", "2F0 1F0"], 4, 2, placement=(0, 1, 1, 0),
                               bidirectional=True))


def test_deadlock_names_ranks_and_what_they_wait_for():
    sched = rows_schedule(["0B0 0F0", "1F0 1B0"], 2, 1)
    with pytest.raises(ScheduleError) as info:
        simulate(sched)
    message = str(info.value)
    assert "rank 0 at 0B0 waits for 0F0, 1B/I0" in message
    assert "rank 1 at 1F0 waits for 0F0" in message


def test_broken_schedules_are_named():
    with pytest.raises(ScheduleError, match="rank 0, action 1F0: stage 1 is placed on rank 1"):
        simulate(rows_schedule(["1F0", "0F0"], 2, 1, placement=(0, 1)))
    with pytest.raises(ScheduleError, match="0F0 runs twice"):
        simulate(rows_schedule(["0F0 0F0 0B0"], 1, 1))
    with pytest.raises(ScheduleError, match="microbatch 3 does not exist"):
        simulate(rows_schedule(["0F3"], 1, 1))


def test_lowered_comm_actions_are_skipped():
    plain = rows_schedule(["0F0 0B0", "1F0 1B0"], 2, 1)
    lowered = rows_schedule(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 2, 1)
    assert simulate(lowered).makespan == simulate(plain).makespan


def longest_path_starts(schedule: Schedule, costs: Costs) -> dict:
    """Start times from the action graph by longest paths: a second, independent model."""

    def duration(action):
        return sum(costs.compute(c.kind, c.stage) for c in action.computations())

    producer = {}
    for rank, row in enumerate(schedule.actions):
        for action in row:
            for comp in action.computations():
                letter = "F" if comp.kind is Kind.F else "W" if comp.kind is Kind.W else "B"
                producer[(letter, comp.stage, comp.microbatch)] = (rank, action)
    preds = {}
    for rank, row in enumerate(schedule.actions):
        for i, action in enumerate(row):
            edges = [((rank, row[i - 1]), 0.0)] if i else []
            for comp in action.computations():
                s, mb = comp.stage, comp.microbatch
                if comp.kind is Kind.F:
                    needs = [] if schedule.prev_stage(s) is None else [("F", s - 1, mb)]
                elif comp.kind is Kind.W:
                    needs = [("B", s, mb)]
                else:
                    nxt = schedule.next_stage(s)
                    needs = [("F", s, mb)] + ([] if nxt is None else [("B", nxt, mb)])
                for key in needs:
                    src_rank, src = producer[key]
                    lat = costs.p2p_latency if src_rank != rank else 0.0
                    edges.append(((src_rank, src), lat))
            preds[(rank, action)] = edges
    start = {}

    def visit(node):
        if node not in start:
            start[node] = max(
                [0.0] + [visit(p) + duration(p[1]) + lat for p, lat in preds[node]]
            )
        return start[node]

    for node in preds:
        visit(node)
    return start


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from([
        ("1f1b", 3, 1, 5, False), ("interleaved-1f1b", 2, 2, 4, True),
        ("zb1p", 3, 1, 6, False), ("zbv", 2, 2, 4, False), ("dualpipev", 2, 2, 4, True),
        ("dualpipe", 2, 2, 4, True), ("gpipe", 2, 1, 3, False), ("looped-bfs", 2, 2, 4, False),
    ]),
    f=st.floats(0.1, 3), b=st.floats(0.2, 4), w_share=st.floats(0, 1), lat=st.floats(0, 1),
)
def test_matches_longest_path_model(case, f, b, w_share, lat):
    name, pp, vpp, m, overlap = case
    schedule = build_schedule(name, pp, m, vpp=vpp, overlap=overlap)
    costs = Costs(f, b, b * w_share, p2p_latency=lat)
    result = simulate(schedule, costs)
    expected = longest_path_starts(schedule, costs)
    for timed in result.timeline:
        assert timed.start == pytest.approx(expected[(timed.rank, timed.action)])
    stages = schedule.num_stages // (2 if schedule.bidirectional else 1)
    assert sum(result.busy) == pytest.approx(m * stages * (f + b))
    assert all(x >= -1e-9 for x in result.bubble)


def test_overlap_hides_all_to_all_in_a_pipeline():
    costs = Costs(1, 2, 1, dispatch=0.25, combine=0.25, moe_layers=2)
    plain = simulate(build_schedule("interleaved-1f1b", 2, 8, vpp=2), costs)
    paired = simulate(build_schedule("interleaved-1f1b", 2, 8, vpp=2, overlap=True), costs)
    assert plain.exposed_comm_fraction == 1.0
    assert paired.comm == plain.comm
    assert paired.exposed_comm_fraction < 0.5
    assert paired.makespan < plain.makespan

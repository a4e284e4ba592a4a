"""Property tests over (schedule, pp, vpp, microbatches, overlap): valid, deadlock-free, counts
right.

``validate`` covers placement, counts, per-rank order, pair independence and a simulated run of
the lowered schedule under the batched-p2p model, so "valid" here includes "deadlock-free".
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings, strategies as st

from megapipe.schedule import SCHEDULES, Kind, ScheduleError, build_schedule, validate

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def requests(draw):
    """A request build_schedule must accept: (name, pp, m, vpp, overlap, options)."""
    name = draw(st.sampled_from(list(SCHEDULES)))
    options = {}
    if name == "dualpipe":
        pp = draw(st.sampled_from([2, 4, 6, 8]))
        m = 2 * draw(st.integers(pp, pp + 6))
        vpp = draw(st.sampled_from([1, 2]))
    elif name in ("dualpipev", "zbv"):
        pp = draw(st.sampled_from([1, 2, 3, 4, 8]))
        least = 2 * pp if name == "dualpipev" else 1
        m = draw(st.integers(least, least + 12))
        vpp = draw(st.sampled_from([1, 2]))
    elif name in ("interleaved-1f1b", "zb1p"):
        pp = draw(st.sampled_from([1, 2, 3, 4, 8]))
        vpp = draw(st.integers(1, 4))
        if vpp == 1:
            m = draw(st.integers(1, 20))
        else:
            group = pp + draw(st.integers(0, 3))
            remainder = draw(st.sampled_from([0] + list(range(pp, group))))
            m = group * draw(st.integers(1, 3)) + remainder
            if group != pp or draw(st.booleans()):
                options["microbatch_group_size_per_vp_stage"] = group
    else:
        pp = draw(st.sampled_from([1, 2, 3, 4, 8]))
        vpp = draw(st.integers(1, 4)) if name == "looped-bfs" else 1
        m = draw(st.integers(1, 20))
    return name, pp, m, vpp, draw(st.booleans()), options


@SETTINGS
@given(requests())
def test_accepted_requests_build_valid_schedules_with_the_right_counts(request):
    name, pp, m, vpp, overlap, options = request
    schedule = build_schedule(name, pp, m, vpp=vpp, overlap=overlap, **options)
    validate(schedule)  # includes the deadlock check of the lowered schedule
    assert schedule.pp == pp and schedule.num_microbatches == m

    per_rank_stages = Counter(schedule.stage_to_rank)
    stages_per_rank = 2 if name in ("zbv", "dualpipev", "dualpipe") else vpp
    assert all(per_rank_stages[r] == stages_per_rank for r in range(pp))

    mbs_per_stage = m // 2 if schedule.bidirectional else m
    for row in schedule.actions:
        kinds = Counter(c.kind for a in row for c in a.computations())
        assert kinds[Kind.F] == stages_per_rank * mbs_per_stage
        assert kinds[Kind.B] + kinds[Kind.I] == stages_per_rank * mbs_per_stage
        assert kinds[Kind.I] == kinds[Kind.W]
        for action in row:
            if action.kind is Kind.OVERLAP:
                assert action.forward.microbatch != action.backward.microbatch
    if overlap and m > 1 and name not in ("gpipe", "looped-bfs"):
        assert any(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)
    if not overlap:
        assert not any(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)


@SETTINGS
@given(
    st.sampled_from(list(SCHEDULES)),
    st.integers(1, 8),
    st.integers(1, 20),
    st.integers(1, 4),
    st.sampled_from([None, 1, 2, 3, 4, 5, 6, 9]),
)
def test_anything_build_schedule_accepts_is_valid(name, pp, m, vpp, group):
    options = {} if group is None else {"microbatch_group_size_per_vp_stage": group}
    try:
        schedule = build_schedule(name, pp, m, vpp=vpp, **options)
    except ScheduleError as error:
        assert name in str(error)  # refusals say which schedule refused
        return
    validate(schedule)

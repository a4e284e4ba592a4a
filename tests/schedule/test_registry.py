"""build_schedule: names, vpp handling, the overlap switch, and clear refusals."""

from __future__ import annotations

import pytest

from megapipe.schedule import SCHEDULES, Kind, ScheduleError, build_schedule, validate

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb1p", "zbv", "dualpipev", "dualpipe"]


def test_registry_lists_every_schedule():
    assert list(SCHEDULES) == NAMES


@pytest.mark.parametrize(
    "name, pp, vpp, stages",
    [("gpipe", 3, 1, 3), ("1f1b", 3, 1, 3), ("interleaved-1f1b", 3, 2, 6), ("looped-bfs", 3, 3, 9),
     ("zb1p", 3, 2, 6), ("zbv", 3, 1, 6), ("zbv", 3, 2, 6), ("dualpipev", 3, 2, 6),
     ("dualpipe", 4, 1, 8)],
)
def test_stage_counts(name, pp, vpp, stages):
    schedule = build_schedule(name, pp, 12, vpp=vpp)
    assert (schedule.pp, schedule.num_stages, schedule.num_microbatches) == (pp, stages, 12)
    assert schedule.name == name
    validate(schedule)


def test_options_are_recorded():
    schedule = build_schedule(
        "interleaved-1f1b", 4, 10, vpp=2, microbatch_group_size_per_vp_stage=5
    )
    assert schedule.options.microbatch_group_size_per_vp_stage == 5
    assert schedule.options.vpp == 2 and schedule.options.overlap is False
    assert build_schedule("zbv", 2, 4).options.vpp == 2


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_dualpipe_family_overlaps_natively(name):
    paired = build_schedule(name, 4, 16, overlap=True)
    assert any(a.kind is Kind.OVERLAP for row in paired.actions for a in row)
    plain = build_schedule(name, 4, 16)
    assert not any(a.kind is Kind.OVERLAP for row in plain.actions for a in row)


@pytest.mark.parametrize("name, vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb1p", 2)])
def test_overlap_goes_through_the_overlap_pass(name, vpp):
    schedule = build_schedule(name, 4, 8, vpp=vpp, overlap=True)
    assert any(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)
    validate(schedule)


@pytest.mark.parametrize(
    "args, kwargs, words",
    [
        (("1F1B", 4, 8), {}, ["unknown schedule '1F1B'", "gpipe", "dualpipev"]),
        (("dualpipe", 3, 12), {}, ["even pp", "pp=3"]),
        (("dualpipe", 4, 9), {}, ["even number of microbatches", "9"]),
        (("dualpipe", 4, 6), {}, ["at least 8 microbatches", "got 6"]),
        (("dualpipev", 4, 7), {}, ["at least 8 microbatches", "got 7"]),
        (("1f1b", 4, 8), {"vpp": 2}, ["one stage per rank", "vpp=2"]),
        (("gpipe", 4, 8), {"vpp": 3}, ["vpp=3"]),
        (("zbv", 4, 8), {"vpp": 3}, ["2 stages per rank", "vpp=3"]),
        (("dualpipe", 4, 8), {"vpp": 4}, ["2 stages per rank", "vpp=4"]),
        (("interleaved-1f1b", 4, 6), {"vpp": 2}, ["last microbatch group", "6 % 4 = 2"]),
        (("interleaved-1f1b", 4, 3), {"vpp": 2}, ["at least", "got 3"]),
        (("zb1p", 4, 10), {"vpp": 2, "microbatch_group_size_per_vp_stage": 3}, [">= pp=4", "3"]),
        (("1f1b", 4, 8), {"microbatch_group_size_per_vp_stage": 4}, ["unknown option"]),
        (("1f1b", 0, 8), {}, ["pp must be a positive integer", "0"]),
        (("1f1b", 2, 0), {}, ["num_microbatches must be a positive integer"]),
        (("looped-bfs", 2, 4), {"vpp": 0}, ["vpp must be a positive integer"]),
    ],
)
def test_impossible_requests_are_refused_with_a_reason(args, kwargs, words):
    with pytest.raises(ScheduleError) as err:
        build_schedule(*args, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_an_option_no_schedule_has_is_refused_by_name():
    with pytest.raises(TypeError, match="chunks"):
        build_schedule("interleaved-1f1b", 4, 8, vpp=2, chunks=2)


def test_interleaved_accepts_non_multiples_with_a_larger_group():
    # Megatron's rule: M % group is 0 or >= pp (10 % 5 = 0; 9 % 5 = 4 >= pp).
    for m in (9, 10, 14):
        validate(
            build_schedule("interleaved-1f1b", 4, m, vpp=2, microbatch_group_size_per_vp_stage=5)
        )


def test_default_schedule_is_megatrons_choice():
    from megapipe.schedule.registry import default_schedule_name

    assert default_schedule_name(4, 2) == "interleaved-1f1b"
    assert default_schedule_name(4, 1) == "1f1b"
    assert default_schedule_name(1, 1) == "1f1b"

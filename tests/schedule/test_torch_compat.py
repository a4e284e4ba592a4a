"""Schedules move between megapipe and torch.distributed.pipelining in both directions.

* every megapipe schedule without OVERLAP passes torch's own ``_validate_schedule``;
* the orders torch generates load into megapipe through the CSV form and pass ``validate``;
* where the two implement the same schedule with the same parameters, the orders are identical.

Torch's orders come from its schedule classes built on stand-in stages, the way torch's own
schedule visualizer does it (``_schedule_visualizer.get_schedule_ops``): no process group needed.
"""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("torch")

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.schedules import (  # noqa: E402
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    _Action,
    _validate_schedule,
)

from megapipe.schedule import Kind, build_schedule, read_csv, validate  # noqa: E402

MEGAPIPE_CASES = [
    ("gpipe", 4, 6, 1), ("1f1b", 1, 3, 1), ("1f1b", 4, 7, 1), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-1f1b", 3, 9, 3), ("looped-bfs", 2, 5, 3), ("zb1p", 4, 8, 1), ("zb1p", 2, 6, 4),
    ("zbv", 4, 5, 1), ("dualpipev", 3, 6, 1), ("dualpipe", 4, 10, 1), ("dualpipe", 8, 16, 1),
]


def torch_order(schedule) -> dict[int, list[_Action]]:
    return {
        rank: [_Action.from_str(str(a)) for a in row] for rank, row in enumerate(schedule.actions)
    }


@pytest.mark.parametrize("name, pp, m, vpp", MEGAPIPE_CASES)
def test_megapipe_schedules_pass_torchs_validation(name, pp, m, vpp):
    schedule = build_schedule(name, pp, m, vpp=vpp)
    assert not any(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)
    # torch counts microbatches per stage; in DualPipe each stage sees half of them.
    per_stage = m // 2 if schedule.bidirectional else m
    placement = _validate_schedule(torch_order(schedule), pp, schedule.num_stages, per_stage)
    assert placement == dict(enumerate(schedule.stage_to_rank))


def torch_rows(schedule_class, pp: int, m: int, stages_per_rank: int) -> list[list[str]]:
    ops = get_schedule_ops(schedule_class, pp, m, stages_per_rank)
    return [[str(a) for a in row if a is not None] for row in ops]


TORCH_CASES = [
    (ScheduleInterleaved1F1B, 2, 4, 2), (ScheduleInterleaved1F1B, 4, 8, 2),
    (ScheduleInterleaved1F1B, 4, 6, 3), (ScheduleInterleaved1F1B, 3, 3, 4),
    (ScheduleInterleavedZeroBubble, 2, 4, 3), (ScheduleInterleavedZeroBubble, 4, 8, 2),
    (ScheduleInterleavedZeroBubble, 4, 12, 2),
    (ScheduleZBVZeroBubble, 2, 4, 2), (ScheduleZBVZeroBubble, 4, 8, 2),
    (ScheduleZBVZeroBubble, 4, 3, 2),
    (ScheduleDualPipeV, 2, 4, 2), (ScheduleDualPipeV, 4, 8, 2), (ScheduleDualPipeV, 4, 11, 2),
]


@pytest.mark.parametrize("schedule_class, pp, m, stages_per_rank", TORCH_CASES)
def test_torch_orders_load_through_csv_and_pass_megapipe_validation(
    tmp_path, schedule_class, pp, m, stages_per_rank
):
    rows = torch_rows(schedule_class, pp, m, stages_per_rank)
    path = tmp_path / "torch.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    schedule = read_csv(str(path), name=schedule_class.__name__)
    assert schedule.num_stages == pp * stages_per_rank and schedule.num_microbatches == m
    validate(schedule)


SAME_SCHEDULE = [
    ("interleaved-1f1b", ScheduleInterleaved1F1B, 4, 8, 2, False),
    ("interleaved-1f1b", ScheduleInterleaved1F1B, 3, 6, 3, False),
    ("zb1p", ScheduleInterleavedZeroBubble, 4, 8, 2, False),
    ("zb1p", ScheduleInterleavedZeroBubble, 2, 6, 3, False),
    ("looped-bfs", ScheduleLoopedBFS, 3, 5, 2, False),
    ("zbv", ScheduleZBVZeroBubble, 4, 8, 2, False),
    ("zbv", ScheduleZBVZeroBubble, 3, 2, 2, False),
    ("dualpipev", ScheduleDualPipeV, 4, 8, 2, True),
    ("dualpipev", ScheduleDualPipeV, 3, 10, 2, True),
]


@pytest.mark.parametrize("name, schedule_class, pp, m, vpp, overlap", SAME_SCHEDULE)
def test_orders_equal_torchs_where_both_define_them(name, schedule_class, pp, m, vpp, overlap):
    ours = build_schedule(name, pp, m, vpp=vpp, overlap=overlap)
    assert [[str(a) for a in row] for row in ours.actions] == torch_rows(schedule_class, pp, m, vpp)

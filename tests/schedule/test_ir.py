"""The schedule IR's text and CSV forms: round trips, torch's spelling, and parse errors."""

from __future__ import annotations

import csv

import pytest

from megapipe.schedule import (
    Action,
    Kind,
    Schedule,
    build_schedule,
    parse_action,
    read_csv,
    write_csv,
)
from megapipe.schedule.ir import infer_stage_to_rank, loop_placement, read_rows, v_placement

TEXTS = [
    "2F0", "1B3", "0I1", "0W1", "13F27", "1SEND_F2", "3RECV_F0", "0SEND_B11", "4RECV_B5",
    "(0F3;3B1)OVERLAP_F_B", "(2F0;5I7)OVERLAP_F_B",
]


@pytest.mark.parametrize("text", TEXTS)
def test_action_text_round_trips(text):
    assert str(parse_action(text)) == text
    assert parse_action(str(parse_action(text))) == parse_action(text)


def test_parse_reads_fields_and_whitespace():
    action = parse_action("  12W3 ")
    assert (action.stage, action.kind, action.microbatch) == (12, Kind.W, 3)
    pair = parse_action("(0F3;3B1)OVERLAP_F_B")
    assert pair.kind is Kind.OVERLAP and pair.stage is None and pair.microbatch is None
    assert pair.forward == Action(0, Kind.F, 3) and pair.backward == Action(3, Kind.B, 1)
    assert pair.computations() == (Action(0, Kind.F, 3), Action(3, Kind.B, 1))


@pytest.mark.parametrize(
    "text",
    ["", "F0", "0F", "0X1", "0F1x", "-1F0", "(0F3;3B1)", "(0F3;3B1)OVERLAP", "(0F3)OVERLAP_F_B",
     "(0F3;3B1;4B2)OVERLAP_F_B", "(3B1;0F3)OVERLAP_F_B", "(0F3;3W1)OVERLAP_F_B", "0OVERLAP_F_B1"],
)
def test_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError):
        parse_action(text)


def test_parse_error_names_the_text():
    with pytest.raises(ValueError, match="'0X1'"):
        parse_action("0X1")


def test_action_checks_its_fields():
    with pytest.raises(ValueError):
        Action(None, Kind.F, 0)
    with pytest.raises(ValueError):
        Action(0, Kind.F, 0, (Action(0, Kind.F, 1), Action(1, Kind.B, 0)))


@pytest.mark.parametrize(
    "name, pp, m, vpp, overlap",
    [("1f1b", 4, 8, 1, False), ("interleaved-1f1b", 4, 8, 2, False), ("zbv", 3, 6, 1, False),
     ("dualpipev", 2, 8, 1, True), ("zb1p", 2, 4, 3, False), ("interleaved-1f1b", 2, 4, 2, True)],
)
def test_csv_round_trip(tmp_path, name, pp, m, vpp, overlap):
    schedule = build_schedule(name, pp, m, vpp, overlap=overlap)
    path = str(tmp_path / "s.csv")
    write_csv(schedule, path)
    loaded = read_csv(path, name=name)
    assert loaded.actions == schedule.actions
    assert loaded.stage_to_rank == schedule.stage_to_rank
    assert (loaded.num_stages, loaded.num_microbatches) == (schedule.num_stages, m)


def test_csv_is_torch_format_one_row_per_rank(tmp_path):
    schedule = build_schedule("1f1b", 2, 3)
    path = tmp_path / "s.csv"
    write_csv(schedule, str(path))
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    ]


def test_csv_skips_empty_cells_as_torch_pads_rows(tmp_path):
    path = tmp_path / "padded.csv"
    path.write_text("0F0,,0B0,\n1F0,1B0,,\n")
    assert [[str(a) for a in row] for row in read_rows(str(path))] == [
        ["0F0", "0B0"],
        ["1F0", "1B0"],
    ]


def test_csv_of_bidirectional_schedule_keeps_mirrored_placement(tmp_path):
    schedule = build_schedule("dualpipe", 4, 8, overlap=True)
    path = str(tmp_path / "d.csv")
    write_csv(schedule, path)
    loaded = read_csv(path, bidirectional=True)
    assert loaded.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert loaded.actions == schedule.actions and loaded.bidirectional


def test_text_form_is_one_line_per_rank():
    schedule = build_schedule("gpipe", 2, 2)
    assert schedule.to_text() == "0F0 0F1 0B0 0B1\n1F0 1F1 1B0 1B1"
    assert "rank 1" in schedule.format_grid().splitlines()[0]


def test_infer_placement_rejects_a_stage_on_two_ranks():
    rows = [[parse_action("0F0")], [parse_action("0B0")]]
    with pytest.raises(ValueError, match="stage 0"):
        infer_stage_to_rank(rows)


def test_placements():
    assert loop_placement(2, 6) == (0, 1, 0, 1, 0, 1)
    assert v_placement(3, 6) == (0, 1, 2, 2, 1, 0)


def test_schedule_checks_placement_length():
    with pytest.raises(ValueError, match="stage_to_rank"):
        Schedule(((),), num_stages=2, num_microbatches=1, stage_to_rank=(0,))

"""ActionTable and the Schedule built on it: encoding, lazy Action objects, equality, pickling."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from megapipe.schedule import Schedule, build_schedule, lower, parse_action
from megapipe.schedule.table import ActionTable

CASES = [
    ("1f1b", 3, 5, 1, False), ("interleaved-1f1b", 2, 4, 2, True), ("zbv", 2, 4, 2, True),
    ("dualpipe", 2, 4, 2, True), ("zb1p", 3, 6, 2, False), ("looped-bfs", 2, 3, 2, False),
]


@pytest.mark.parametrize("name, pp, m, vpp, overlap", CASES)
def test_rows_round_trip_through_the_table(name, pp, m, vpp, overlap):
    for schedule in (build_schedule(name, pp, m, vpp=vpp, overlap=overlap),
                     lower(build_schedule(name, pp, m, vpp=vpp, overlap=overlap))):
        table = schedule.table
        rows = [table.actions_of(r) for r in range(table.pp)]
        assert ActionTable.from_rows(rows).same_as(table)
        assert [table.texts_of(r) for r in range(table.pp)] == [
            [str(a) for a in row] for row in rows]
        # A schedule made from Action rows equals the one made from the table.
        again = schedule.replace_actions(rows)
        assert again == schedule and hash(again) == hash(schedule)
        assert again.to_text() == schedule.to_text()


def test_row_makes_one_rank_and_matches_actions():
    schedule = build_schedule("interleaved-1f1b", 4, 8, vpp=2, overlap=True)
    third = schedule.row(2)
    assert schedule._rows is None  # only rank 2's actions were made
    assert third == schedule.actions[2]


def test_select_keeps_ranks_apart():
    schedule = build_schedule("1f1b", 3, 4)
    table = schedule.table
    forwards = table.select(table.kind == 0)
    assert [forwards.texts_of(r) for r in range(3)] == [
        [f"{r}F{i}" for i in range(4)] for r in range(3)]


def test_schedule_pickles_and_stays_frozen():
    schedule = lower(build_schedule("zbv", 2, 4, overlap=True))
    copy = pickle.loads(pickle.dumps(schedule))
    assert copy == schedule and copy.options == schedule.options
    with pytest.raises(FrozenInstanceError):
        schedule.name = "other"


def test_numbers_beyond_32_bits_are_refused():
    rows = [[parse_action("0F0"), parse_action(f"0B{2 ** 31}")]]
    with pytest.raises(ValueError, match="32 bits"):
        Schedule(rows, 1, 1, (0,)).table  # noqa: B018  # the property's computation raises


def test_table_without_overlap_stores_no_backward_columns():
    table = build_schedule("1f1b", 2, 3).table
    assert table._back is None
    assert np.all(table.back_kind == -1) and len(table.back_mb) == len(table)

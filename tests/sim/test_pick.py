"""The picker on hand-checkable cases: pp 2, 4 microbatches, F=1 B=2 W=1, 100 bytes a stage.

Hand figures: plain 1F1B holds pp = 2 microbatches on rank 0 (200 bytes) and takes
(M + pp - 1)(F + B) = 5 x 3 = 15; GPipe holds all M = 4 (400 bytes); ZBV holds 4 chunks of half
a stage (200 bytes). Selective recompute with saves=0.5, cost=0.5 keeps half the bytes and makes
B = 2.5, so plain 1F1B takes 5 x 3.5 = 17.5 holding 100 bytes; full recompute with saves=0.75,
cost=1 keeps a quarter and makes B = 3: 5 x 4 = 20 holding 50 bytes.
"""

import pytest

from megapipe.cli import main
from megapipe.sim.costs import Costs
from megapipe.sim.pick import Recompute, all_choices, format_pick, pick

STAGE_BYTES = 100.0


@pytest.fixture(scope="module")
def choices():
    return all_choices(2, 4, Costs(1, 2, 1), STAGE_BYTES, Recompute(saves=0.5, cost=0.5),
                       Recompute(saves=0.75, cost=1.0))


def _find(choices, schedule, budget=None, recompute="none", vpp=1):
    return next(c for c in choices if (c.schedule, c.vpp, c.budget, c.recompute)
                == (schedule, vpp, budget, recompute))


def test_bytes_and_times_match_the_hand_figures(choices):
    assert (_find(choices, "1f1b").peak_bytes, _find(choices, "1f1b").makespan) == (200, 15)
    assert _find(choices, "gpipe").peak_bytes == 400
    assert _find(choices, "zbv", vpp=2).peak_bytes == 200
    recomputed = _find(choices, "1f1b", recompute="selective")
    assert (recomputed.peak_bytes, recomputed.makespan) == (100, 17.5)
    full = _find(choices, "1f1b", recompute="full")
    assert (full.peak_bytes, full.makespan) == (50, 20)


def test_a_huge_budget_picks_the_fastest_overall_without_recompute(choices):
    best = pick(choices, 1e12)[0]
    assert best.makespan == min(c.makespan for c in choices)
    assert best.recompute == "none"  # recompute only costs time
    assert best.schedule == "dualpipe"


def test_a_budget_of_plain_1f1b_bytes_leaves_out_what_holds_more():
    no_saving = Recompute(saves=0.0)
    fitting = pick(all_choices(2, 4, Costs(1, 2, 1), STAGE_BYTES, no_saving, no_saving), 200)
    assert fitting and all(c.peak_bytes <= 200 for c in fitting)
    names = {c.schedule for c in fitting}
    assert "1f1b" in names and "gpipe" not in names and "dualpipe" not in names
    # 1F1B's chain at K = 2 doubles rank 0's microbatches in flight (400 bytes): left out;
    # K = 0 equals plain in time and bytes, so only plain is listed
    assert {c.budget for c in fitting if c.schedule == "1f1b"} == {None, 1}
    assert fitting[0].makespan == min(c.makespan for c in fitting)


def test_recompute_is_chosen_when_it_is_the_only_way_to_fit(choices):
    fitting = pick(choices, 100)
    assert fitting and all(c.recompute != "none" for c in fitting)
    assert fitting[0].peak_bytes <= 100
    assert fitting[0].makespan <= _find(choices, "1f1b", recompute="selective").makespan
    # below what selective keeps anywhere (100 bytes), only full recompute fits
    fitting = pick(choices, 99)
    assert fitting and all(c.recompute == "full" for c in fitting)
    assert fitting[0].makespan <= _find(choices, "1f1b", recompute="full").makespan


def test_nothing_fits_names_the_smallest_memory(choices):
    text = format_pick(choices, 49)
    assert text == ("no choice fits the memory budget of 49 bytes: the smallest needs 50 bytes")


def test_cli_prints_the_best_line_and_a_table(capsys):
    code = main(["schedule", "--pick", "--pp", "2", "-m", "4", "--costs", "1,2,1",
                 "--memory-budget", "100", "--activation-bytes", "100",
                 "--recompute-saves", "0.5", "--recompute-cost", "0.5"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith("best: ") and "recompute selective" in out[0]
    assert out[2].startswith("schedule") and len(out) > 3


def test_cli_no_fit_and_missing_bytes_are_one_line_errors(capsys):
    args = ["schedule", "--pick", "--pp", "2", "-m", "4", "--memory-budget", "10"]
    assert main(args) == 2
    assert "--pick needs --activation-bytes BYTES" in capsys.readouterr().err
    assert main(args + ["--activation-bytes", "100"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "the smallest needs 60 bytes" in out[0]  # full keeps 0.3 of 200
    assert main(args + ["--activation-bytes", "100", "--full-recompute-saves", "0.96"]) == 0
    assert "recompute full" in capsys.readouterr().out.splitlines()[0]


def test_bad_recompute_fraction_is_named():
    with pytest.raises(ValueError, match="recompute saves must be a fraction in \\[0, 1\\], got 2"):
        Recompute(saves=2)


def test_bad_memory_budget_is_named(choices):
    with pytest.raises(ValueError, match="memory budget must be a number of bytes >= 0, got -1"):
        pick(choices, -1)

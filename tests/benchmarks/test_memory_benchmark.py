"""The memory benchmark in its smallest form (``benchmarks/memory.py``): one schedule on the
tiny pretrain shape, plain and combined. The peak in flight is the one the budget sweep gives
the plain schedule and the unbounded pass (what pretrain runs), the measured bytes grow with
it, and the table prints both beside the simulated speed at every budget."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from megapipe.sim.budget_sweep import budget_sweep  # noqa: E402
from megapipe.sim.costs import Costs  # noqa: E402
from megapipe.train.config.parse import parse_pretrain_args  # noqa: E402
from memory import format_table, pretrain_flags  # noqa: E402
from support.memory_case import memory_run  # noqa: E402
from support.pretrain_flags import TINY  # noqa: E402

FLAGS = [*TINY, "--global-batch-size", "16"]  # 4 microbatches: 1f1b's pairs hold one more


def _swept_peaks() -> tuple[int, int]:
    """The largest rank's peak in flight of plain 1f1b and of its unbounded combined pass."""
    config = parse_pretrain_args(pretrain_flags("1f1b", True, tuple(FLAGS)), env={})
    microbatches = config.schedule.num_microbatches  # dp = 2
    plain, points = budget_sweep("1f1b", 2, microbatches, Costs.from_text("1,2,1"))
    return max(plain.peak_in_flight), max(points[-1].peak_in_flight)


def test_plain_and_combined_1f1b_measured_side_by_side(rank_pools):
    runs = {label: rank_pools(4).run(memory_run, "1f1b", label == "combined", FLAGS)
            for label in ("plain", "combined")}
    for per_rank in runs.values():
        assert all(r == per_rank[0] for r in per_rank), per_rank  # every rank: the largest's
    plain, combined = runs["plain"][0], runs["combined"][0]
    assert (plain["in_flight"], combined["in_flight"]) == _swept_peaks()
    assert combined["in_flight"] > plain["in_flight"] and combined["bytes"] > plain["bytes"] > 0
    table = format_table({"1f1b": {"plain": plain, "combined": combined}}, Costs.from_text("1,2,1"))
    row = table.splitlines()[-1].split()
    assert row[:4] == ["1f1b", "1", str(plain["in_flight"]), str(combined["in_flight"])]
    assert len(row) == 7 + plain["pp"] + 2  # a makespan ratio per budget 0..pp and unbounded

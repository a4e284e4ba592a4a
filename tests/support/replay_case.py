"""A short replay run on a rank of a gloo pool (``benchmarks/overlap_replay.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


def replay_run(fields: dict, name: str, chunks: int) -> dict:
    """Median plain and combined step (ms) of schedule ``name`` replayed with the
    ``ReplaySettings`` of ``fields`` (a dict: the pool's processes import the benchmark here)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups
    from overlap_replay import ReplaySettings, measure_schedule

    settings = ReplaySettings(**fields)
    groups = create_groups(ParallelConfig(pp=settings.pp, dp=settings.dp, ep=settings.ep))
    return measure_schedule(settings, groups, name, chunks)

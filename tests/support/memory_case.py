"""A measured pretrain step on a rank of a gloo pool (``benchmarks/memory.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


def memory_run(schedule: str, overlap: bool, flags: list[str]) -> dict:
    """``measure`` of the memory benchmark (the pool's processes import the benchmark here)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    from memory import measure

    return measure(schedule, overlap, tuple(flags))

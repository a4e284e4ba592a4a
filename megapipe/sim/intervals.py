"""Arithmetic on time intervals ``(start, end)``: how much of one set lies outside another.

The simulator asks how much all-to-all time no compute covers (exposed communication), the
co-scheduler's trace asks the same of measured spans, and the timeline picture draws the exposed
parts. ``cover`` is always sorted by start and disjoint (``union`` makes it so); sums run in list
order, so the simulator's figures are reproducible to the last bit.
"""

from __future__ import annotations

from typing import Iterable, Sequence

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap or touch, sorted by start."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_length(span: Interval, cover: Sequence[Interval]) -> float:
    """How much of ``span`` lies inside ``cover``."""
    start, end = span
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in cover)


def uncovered_length(intervals: Sequence[Interval], cover: Sequence[Interval]) -> float:
    """Total length of ``intervals`` (sorted by start) outside ``cover``."""
    total, j = 0.0, 0
    for start, end in intervals:
        covered = 0.0
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            covered += min(end, cover[k][1]) - max(start, cover[k][0])
            k += 1
        total += (end - start) - covered
    return total


def subtract(span: Interval, cover: Sequence[Interval]) -> list[Interval]:
    """The parts of ``span`` outside every interval of ``cover``."""
    start, end = span
    parts, cursor = [], start
    for c_start, c_end in cover:
        if c_end <= cursor or c_start >= end:
            continue
        if c_start > cursor:
            parts.append((cursor, c_start))
        cursor = max(cursor, c_end)
    if cursor < end:
        parts.append((cursor, end))
    return parts

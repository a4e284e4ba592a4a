"""Arithmetic on time intervals ``(start, end)``: how much of one set lies outside another.

The simulator asks how much all-to-all time no compute covers (exposed communication), the
combined step's trace asks the same of measured spans, and the timeline picture draws the exposed
parts. ``cover`` is always sorted by start and disjoint (``union`` makes it so); the lengths are
added up in a fixed order (each interval's overlaps in cover order, then the intervals in
order), so the simulator's figures are reproducible to the last bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

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


def covered_lengths(
    starts: np.ndarray, ends: np.ndarray, cover_starts: np.ndarray, cover_ends: np.ndarray
) -> np.ndarray:
    """How much of each interval lies inside ``cover``: per interval, its overlaps with the
    cover intervals it meets, added up in cover order (starting from 0.0)."""
    starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    cover_starts = np.asarray(cover_starts, dtype=np.float64)
    cover_ends = np.asarray(cover_ends, dtype=np.float64)
    first = np.searchsorted(cover_ends, starts, "right")  # first cover ending after the start
    stop = np.maximum(np.searchsorted(cover_starts, ends, "left"), first)
    covered = np.zeros(len(starts))
    live = np.flatnonzero(stop > first)
    step = 0
    while len(live):
        at = first[live] + step
        covered[live] += np.minimum(ends[live], cover_ends[at]) - np.maximum(
            starts[live], cover_starts[at]
        )
        step += 1
        live = live[stop[live] > first[live] + step]
    return covered


def covered_length(span: Interval, cover: Sequence[Interval]) -> float:
    """How much of ``span`` lies inside ``cover``."""
    bounds = np.asarray(cover, dtype=np.float64).reshape(-1, 2)
    return float(
        covered_lengths(np.array([span[0]]), np.array([span[1]]), bounds[:, 0], bounds[:, 1])[0]
    )


def covered_total(spans: Sequence[Interval], cover: Sequence[Interval]) -> float:
    """How much of ``spans`` lies inside ``cover`` (sorted, disjoint): each span's covered
    length, added up in span order from 0.0 (``covered_length`` of each, in one pass)."""
    if not spans:
        return 0.0
    spans_ = np.asarray(spans, dtype=np.float64).reshape(-1, 2)
    cover_ = np.asarray(cover, dtype=np.float64).reshape(-1, 2)
    return sum(covered_lengths(spans_[:, 0], spans_[:, 1], cover_[:, 0], cover_[:, 1]).tolist())


def uncovered_length(
    starts: np.ndarray, ends: np.ndarray, cover_starts: np.ndarray, cover_ends: np.ndarray
) -> float:
    """Total length of the intervals outside ``cover``, added up in order from 0.0."""
    if not len(starts):
        return 0.0
    covered = covered_lengths(starts, ends, cover_starts, cover_ends)
    return float(np.cumsum((np.asarray(ends) - np.asarray(starts)) - covered)[-1])


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

"""Timeline arithmetic: node spans on two streams -> concurrent and busy time, idle share, ceiling.

A ``Span`` is one node's interval on one stream (milliseconds from a common origin, read from
CUDA events on a GPU, from the host clock on CPU: ``gpu_timing.node_spans``). Everything here is
plain arithmetic on such intervals, so the figures the GPU check reports are unit-tested on CPU
(the exposed communication is megapipe's own ``NodeTrace.exposed_comm_fraction``):

- ``concurrent_ms``: time during which both kinds ran at once;
- ``busy_ms``: time covered by the spans of one kind (overlaps within a kind counted once);
- ``idle_share``: share of a window during which no span of either kind ran;
- ``ceiling``: the best speedup any overlap of the same nodes could reach (their sequential time
  over the busier of the two streams).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Interval = tuple[float, float]


@dataclass(frozen=True)
class Span:
    """One node's interval: ``kind`` is "compute" or "comm"; ``label`` names the node."""

    kind: str
    start: float
    end: float
    label: str = ""
    stream: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered by ``intervals`` (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Time covered by both ``a`` and ``b``."""
    left, right = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        total += max(0.0, end - start)
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return total


def _of(spans: Sequence[Span], kind: str) -> list[Interval]:
    return [(s.start, s.end) for s in spans if s.kind == kind]


def busy_ms(spans: Sequence[Span], kind: str) -> float:
    """Time covered by the spans of ``kind``."""
    return length(_of(spans, kind))


def concurrent_ms(spans: Sequence[Span]) -> float:
    """Time during which a compute span and a comm span ran at the same time."""
    return intersection_length(_of(spans, "compute"), _of(spans, "comm"))


def window(spans: Sequence[Span]) -> Interval:
    """From the first start to the last end."""
    if not spans:
        return (0.0, 0.0)
    return (min(s.start for s in spans), max(s.end for s in spans))


def idle_share(
    spans: Sequence[Span], start: float | None = None, end: float | None = None
) -> float:
    """Share of ``[start, end]`` (default: the spans' window) during which no span ran."""
    first, last = window(spans)
    start = first if start is None else start
    end = last if end is None else end
    if end <= start:
        return 0.0
    clipped = [(max(s.start, start), min(s.end, end)) for s in spans]
    return 1.0 - length(clipped) / (end - start)


def ceiling(sequential_ms: float, compute_ms: float, comm_ms: float) -> float:
    """Best speedup over ``sequential_ms`` when compute and comm overlap perfectly: the run can
    be no shorter than the busier stream."""
    busier = max(compute_ms, comm_ms)
    if busier <= 0:
        raise ValueError(f"ceiling needs some busy time, got compute {compute_ms}, comm {comm_ms}")
    return sequential_ms / busier

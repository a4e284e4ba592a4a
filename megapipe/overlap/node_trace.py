"""A recorder of the nodes the co-scheduler issued: who ran where, when.

Each span names the microbatch, the layer, the node, the direction (F forward, B backward,
W deferred weight gradients), the stream, the co-scheduler's slot, and start/end times
(``time.perf_counter``, taken around the work on the thread that ran it; on CUDA these are
host issue times unless the caller synchronizes). Tests read the order; the benchmark reads the exposed-communication
fraction: the share of communication time during which no compute ran.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class NodeSpan:
    microbatch: int | None
    layer: int
    node: str
    direction: str  # "F", "B" or "W"
    stream: str
    kind: str  # "compute" or "comm"
    start: float
    end: float
    slot: int = -1  # spans with the same slot were issued side by side by the co-scheduler

    @property
    def duration(self) -> float:
        return self.end - self.start

    def label(self) -> str:
        microbatch = "" if self.microbatch is None else self.microbatch
        return f"{self.direction}{microbatch}.{self.layer}.{self.node}"


class NodeTrace:
    """Thread-safe list of ``NodeSpan`` (the co-scheduler appends from two threads on CPU)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.spans: list[NodeSpan] = []
        self._lock = threading.Lock()
        self._slots = 0

    @contextmanager
    def span(
        self,
        microbatch: int | None,
        layer: int,
        node: str,
        direction: str,
        stream: str,
        kind: str,
        slot: int = -1,
    ) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            with self._lock:
                self.spans.append(
                    NodeSpan(microbatch, layer, node, direction, stream, kind, start, end, slot)
                )

    def new_slot(self) -> int:
        """A slot number never handed out before by this trace (co-schedulers sharing one
        trace number their slots from here, so ``slots()`` never mixes two runners)."""
        with self._lock:
            self._slots += 1
            return self._slots

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def slots(self) -> list[list[NodeSpan]]:
        """Spans grouped by co-scheduler slot, in issue order (what ran beside what)."""
        groups: dict[int, list[NodeSpan]] = {}
        for span in self.by_start():
            groups.setdefault(span.slot, []).append(span)
        return [groups[k] for k in sorted(groups)]

    def by_start(self) -> list[NodeSpan]:
        with self._lock:
            return sorted(self.spans, key=lambda s: s.start)

    def total(self, kind: str) -> float:
        """Summed duration of the spans of one kind ("compute" or "comm")."""
        with self._lock:
            return sum(s.duration for s in self.spans if s.kind == kind)

    def exposed_comm_fraction(self) -> float:
        """Share of communication time not covered by any compute span (0: all hidden)."""
        with self._lock:
            comm = [(s.start, s.end) for s in self.spans if s.kind == "comm"]
            compute = _union([(s.start, s.end) for s in self.spans if s.kind == "compute"])
        total = sum(e - s for s, e in comm)
        if total <= 0:
            return 0.0
        covered = sum(_overlap(span, compute) for span in comm)
        return max(0.0, (total - covered) / total)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(span: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    start, end = span
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in merged)
